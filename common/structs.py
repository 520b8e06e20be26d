"""The base of everything the codec carries, and the checks that message and struct classes
share (no networking, no codec: :mod:`common.messages` and the structs both build on this).

A :class:`Struct` is a dataclass whose fields the codec knows how to send (see
:mod:`common.codec`): scalars go into the msgpack header, tensors become frames, and a field
may itself be a Struct, an optional Struct (``X | None``) or a list of Structs. The codec
calls every decoded struct's :meth:`Struct.check` (innermost first), so a receiver never
holds an ill-formed one.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.errors import ProtocolError

MAX_ID = 2**62  # node ids, part ids and counts are checked against this bound


class Struct:
    """Base of every codec-carried dataclass (messages and nested structs); subclasses are
    dataclasses (frozen or not)."""

    def check(self) -> None:  # overridden where there is something to check
        return None


def need(cond: bool, code: str, msg: str) -> None:
    if not cond:
        raise ProtocolError(code, msg)


def id_bounds(t: Tensor) -> tuple[int, int]:
    """(min, max) of a non-empty CPU tensor, in numpy: a single-threaded pass. torch's
    reductions split a 10^5-element tensor over its intra-op threads, and on a machine whose
    cores the sampler servers keep busy every such split waits for a preempted thread
    (milliseconds per reply checked on 2 cores; docs/benchmarks.md, "Reply checks")."""
    a = t.numpy()
    return int(a.min()), int(a.max())


def rises(t: Tensor) -> bool:
    """Whether a 1-D CPU tensor never decreases (numpy, as :func:`id_bounds`)."""
    a = t.numpy()
    return bool((a[1:] >= a[:-1]).all())


def check_ids(t: Tensor, name: str, upper: int | None = None) -> None:
    need(t.dtype == torch.int64 and t.dim() == 1, "bad_tensor",
         f"{name} must be a 1-D int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if t.numel():
        lo, hi = id_bounds(t)
        bound = MAX_ID if upper is None else upper
        need(lo >= 0 and hi < bound, "id_out_of_range",
             f"{name} holds ids in [{lo}, {hi}], outside [0, {bound})")


def check_unique(t: Tensor, name: str) -> None:
    need(torch.unique(t).numel() == t.numel(), "bad_tensor", f"{name} must be unique")
