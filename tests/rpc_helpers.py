"""One request/reply from a test: open a channel, call, check the reply type, close.

Replaces the open / call / expect / close sequence every test that talks to a server by hand
used to spell out. Everything opened here is closed again, also when the call fails."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import zmq

from common.messages import Message
from common.rpc import RpcChannel
from common.rpc import expect as expect_type
from common.sockets import CurveKeys

R = TypeVar("R", bound=Message)
TEST_SETTING = "the test's timeout"


@contextmanager
def channel(endpoint: str, *, ctx: zmq.Context | None = None, timeout_s: float = 10.0,
            setting: str = TEST_SETTING, curve: CurveKeys | None = None,
            **kw: Any) -> Iterator[RpcChannel]:
    """An :class:`RpcChannel` to ``endpoint``, closed on exit; with no ``ctx``, in a context
    of its own that is terminated on exit too."""
    own = ctx is None
    context = zmq.Context() if own else ctx
    try:
        ch = RpcChannel(context, endpoint, timeout_s=timeout_s, setting=setting, curve=curve,
                        **kw)
        try:
            yield ch
        finally:
            ch.close()
    finally:
        if own:
            context.term()


def call(endpoint: str, msg: Message, expect: type[R] | None = None, *,
         ctx: zmq.Context | None = None, timeout_s: float = 10.0, setting: str = TEST_SETTING,
         curve: CurveKeys | None = None) -> Any:
    """Send ``msg`` to ``endpoint`` on a fresh channel and return the reply, which must be an
    ``expect`` (any type when None). Raises what :meth:`RpcChannel.call` raises (RemoteError
    for an error reply, PeerTimeoutError past ``timeout_s``) or ProtocolError for a reply of
    the wrong type."""
    with channel(endpoint, ctx=ctx, timeout_s=timeout_s, setting=setting, curve=curve) as ch:
        reply = ch.call(msg)
    return reply if expect is None else expect_type(reply, expect, endpoint)
