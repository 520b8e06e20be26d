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


def check_ids(t: Tensor, name: str, upper: int | None = None) -> None:
    need(t.dtype == torch.int64 and t.dim() == 1, "bad_tensor",
         f"{name} must be a 1-D int64 tensor, got {t.dtype} of shape {tuple(t.shape)}")
    if t.numel():
        lo, hi = int(t.min()), int(t.max())
        bound = MAX_ID if upper is None else upper
        need(lo >= 0 and hi < bound, "id_out_of_range",
             f"{name} holds ids in [{lo}, {hi}], outside [0, {bound})")


def check_unique(t: Tensor, name: str) -> None:
    need(torch.unique(t).numel() == t.numel(), "bad_tensor", f"{name} must be unique")
