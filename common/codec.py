"""The one place that turns messages into ZeroMQ frames and back.

Frame layout of every message::

    frame 0      msgpack header {"v": protocol version, "t": MsgType, "id": request id,
                                 "s": {scalar field: value},
                                 "d": [[tensor field name, dtype, shape], ...]}
    frame 1..n   raw bytes of tensor i (C order), one frame per descriptor in "d"

Tensors are sent without copying (``copy=False`` on the socket; the frames here are
memoryviews of the tensors) and decoded without copying (``torch.frombuffer`` on the received
frame). Nothing is ever pickled. :func:`decode` validates every header field (version, type,
id bounds, scalar types, dtype whitelist, shapes against frame lengths, total size) and then
the message's own :meth:`check`; any violation raises :class:`ProtocolError` with a code.
"""

from __future__ import annotations

import dataclasses
import math
import typing
import warnings
from collections.abc import Sequence
from typing import Any

import msgpack
import torch
from torch import Tensor

from common.errors import ProtocolError
from common.messages import MESSAGE_CLASSES, PROTOCOL_VERSION, Message, MsgType

MAX_HEADER_BYTES = 1 << 20
MAX_REQUEST_ID = 2**63 - 1
MAX_TENSORS = 64
MAX_NDIM = 4
MAX_LIST_LEN = 1024
MAX_STR_LEN = 4096
DEFAULT_MAX_MESSAGE_BYTES = 512 << 20

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# Field kinds, derived once per class from its annotations.
_TENSOR, _TENSOR_LIST, _INT, _FLOAT, _STR, _BOOL, _INT_LIST, _FLOAT_DICT = range(8)


def _kind_of(tp: Any) -> int:
    if tp is Tensor:
        return _TENSOR
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is list and args == (Tensor,):
        return _TENSOR_LIST
    if origin is list and args == (int,):
        return _INT_LIST
    if origin is dict and args == (str, float):
        return _FLOAT_DICT
    simple = {int: _INT, float: _FLOAT, str: _STR, bool: _BOOL}
    if tp in simple:
        return simple[tp]
    raise TypeError(f"unsupported message field type {tp}")


@dataclasses.dataclass(frozen=True)
class _Schema:
    cls: type[Message]
    fields: tuple[tuple[str, int, bool], ...]  # (name, kind, required)

    @property
    def tensor_fields(self) -> dict[str, int]:
        return {n: k for n, k, _ in self.fields if k in (_TENSOR, _TENSOR_LIST)}

    @property
    def scalar_fields(self) -> dict[str, tuple[int, bool]]:
        return {n: (k, r) for n, k, r in self.fields if k not in (_TENSOR, _TENSOR_LIST)}


def _schema(cls: type[Message]) -> _Schema:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        out.append((f.name, _kind_of(hints[f.name]), required))
    return _Schema(cls, tuple(out))


SCHEMAS: dict[MsgType, _Schema] = {t: _schema(c) for t, c in MESSAGE_CLASSES.items()}


def _tensor_bytes(t: Tensor) -> memoryview:
    """A zero-copy byte view of a (CPU, contiguous) tensor; copies only if it must."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    if t.numel() == 0:
        return memoryview(b"")
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())  # type: ignore[arg-type]


def encode(msg: Message, request_id: int) -> list[Any]:
    """Frames of ``msg``: the header, then one buffer per tensor (send with copy=False)."""
    schema = SCHEMAS[msg.TYPE]
    scalars: dict[str, Any] = {}
    descs: list[list[Any]] = []
    buffers: list[memoryview] = []

    def add(name: str, t: Tensor) -> None:
        if t.dtype not in DTYPE_NAMES:
            raise ProtocolError("bad_dtype", f"{name}: dtype {t.dtype} is not sendable")
        descs.append([name, DTYPE_NAMES[t.dtype], list(t.shape)])
        buffers.append(_tensor_bytes(t))

    for name, kind, _ in schema.fields:
        value = getattr(msg, name)
        if kind == _TENSOR:
            add(name, value)
        elif kind == _TENSOR_LIST:
            for t in value:
                add(name, t)
        else:
            scalars[name] = value
    header = msgpack.packb(
        {"v": PROTOCOL_VERSION, "t": int(msg.TYPE), "id": int(request_id), "s": scalars,
         "d": descs},
        use_bin_type=True,
    )
    return [header, *buffers]


def _frame_bytes(frame: Any) -> memoryview:
    buf = getattr(frame, "buffer", None)  # zmq.Frame received with copy=False
    return memoryview(buf if buf is not None else frame)


def peek_request_id(header_frame: Any) -> int:
    """Best-effort request id of a (possibly bad) message, so an error reply can echo it."""
    try:
        head = msgpack.unpackb(bytes(_frame_bytes(header_frame)[:MAX_HEADER_BYTES]), raw=False)
        rid = head.get("id", 0) if isinstance(head, dict) else 0
        return rid if isinstance(rid, int) and 0 <= rid <= MAX_REQUEST_ID else 0
    except Exception:
        return 0


def _check_scalar(name: str, kind: int, v: Any) -> Any:
    def bad(what: str) -> ProtocolError:
        return ProtocolError("bad_field", f"field {name!r} must be {what}, got {type(v).__name__}")

    if kind == _INT:
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad("an integer")
    elif kind == _FLOAT:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad("a number")
        v = float(v)
    elif kind == _BOOL:
        if not isinstance(v, bool):
            raise bad("a boolean")
    elif kind == _STR:
        if not isinstance(v, str) or len(v) > MAX_STR_LEN:
            raise bad(f"a string of at most {MAX_STR_LEN} characters")
    elif kind == _INT_LIST:
        if (not isinstance(v, list) or len(v) > MAX_LIST_LEN
                or any(isinstance(x, bool) or not isinstance(x, int) for x in v)):
            raise bad(f"a list of at most {MAX_LIST_LEN} integers")
    elif kind == _FLOAT_DICT:
        if (not isinstance(v, dict) or len(v) > MAX_LIST_LEN
                or any(not isinstance(k, str) or isinstance(x, bool)
                       or not isinstance(x, (int, float)) for k, x in v.items())):
            raise bad("a mapping of names to numbers")
        v = {k: float(x) for k, x in v.items()}
    return v


def _tensor_from_frame(buf: memoryview, dtype: torch.dtype, shape: list[int]) -> Tensor:
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # zmq frames are read-only; receivers never write into decoded tensors in place.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def decode(frames: Sequence[Any],
           max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[Message, int]:
    """Validate and decode frames into ``(message, request_id)``; raises ProtocolError."""
    if not frames:
        raise ProtocolError("empty", "message has no frames")
    if len(frames) > MAX_TENSORS + 1:
        raise ProtocolError("too_many_frames", f"{len(frames)} frames exceed {MAX_TENSORS + 1}")
    views = [_frame_bytes(f) for f in frames]
    total = sum(v.nbytes for v in views)
    if total > max_message_bytes:
        raise ProtocolError("too_large", f"message of {total} bytes exceeds the cap of "
                            f"{max_message_bytes} bytes (max_message_mb)")
    if views[0].nbytes > MAX_HEADER_BYTES:
        raise ProtocolError("bad_header", f"header of {views[0].nbytes} bytes is too large")
    try:
        head = msgpack.unpackb(bytes(views[0]), raw=False, strict_map_key=True,
                               max_bin_len=0, max_ext_len=0)
    except Exception as e:
        raise ProtocolError("bad_header", f"header is not valid msgpack: {e}") from None
    if not isinstance(head, dict) or set(head) != {"v", "t", "id", "s", "d"}:
        raise ProtocolError("bad_header", "header must be a map with keys v, t, id, s, d")
    if head["v"] != PROTOCOL_VERSION:
        raise ProtocolError("bad_version", f"protocol version {head['v']!r} is not supported; "
                            f"this peer speaks version {PROTOCOL_VERSION}: upgrade the older side")
    rid = head["id"]
    if isinstance(rid, bool) or not isinstance(rid, int) or not 0 <= rid <= MAX_REQUEST_ID:
        raise ProtocolError("bad_request_id", f"request id {rid!r} is not in [0, 2^63)")
    try:
        mtype = MsgType(head["t"])
    except (ValueError, TypeError):
        raise ProtocolError("unknown_type", f"message type {head['t']!r} is unknown") from None
    schema = SCHEMAS[mtype]
    scalars, descs = head["s"], head["d"]
    if not isinstance(scalars, dict) or not isinstance(descs, list):
        raise ProtocolError("bad_header", "header fields s/d must be a map and a list")
    known = schema.scalar_fields
    extra = set(scalars) - set(known)
    if extra:
        raise ProtocolError("bad_field", f"unknown field(s) {sorted(map(str, extra))} "
                            f"for {mtype.name}")
    kwargs: dict[str, Any] = {}
    for name, (kind, required) in known.items():
        if name not in scalars:
            if required:
                raise ProtocolError("missing_field", f"{mtype.name} lacks field {name!r}")
            continue
        kwargs[name] = _check_scalar(name, kind, scalars[name])
    if len(descs) != len(views) - 1:
        raise ProtocolError("frame_count", f"header describes {len(descs)} tensors but "
                            f"{len(views) - 1} tensor frames arrived")
    tfields = schema.tensor_fields
    for name, kind in tfields.items():
        if kind == _TENSOR_LIST:
            kwargs[name] = []
    for i, desc in enumerate(descs):
        if not (isinstance(desc, list) and len(desc) == 3 and isinstance(desc[0], str)
                and isinstance(desc[1], str) and isinstance(desc[2], list)):
            raise ProtocolError("bad_descriptor", f"tensor descriptor {i} must be "
                                "[name, dtype, shape]")
        name, dname, shape = desc
        if name not in tfields:
            raise ProtocolError("bad_descriptor", f"{mtype.name} has no tensor field {name!r}")
        if dname not in DTYPES:
            raise ProtocolError("bad_dtype", f"dtype {dname!r} of {name!r} is not one of "
                                f"{sorted(DTYPES)}")
        if (len(shape) > MAX_NDIM
                or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape)):
            raise ProtocolError("bad_shape", f"shape {shape!r} of {name!r} is invalid")
        dtype = DTYPES[dname]
        nbytes = math.prod(shape) * dtype.itemsize
        if nbytes != views[i + 1].nbytes:
            raise ProtocolError("size_mismatch", f"{name!r} of shape {shape} {dname} needs "
                                f"{nbytes} bytes, its frame has {views[i + 1].nbytes}")
        if nbytes == 0 and math.prod(max(s, 1) for s in shape) > max_message_bytes:
            # an empty tensor's other dims are unchecked by the size test; torch overflows on them
            raise ProtocolError("bad_shape", f"shape {shape!r} of empty {name!r} is too large")
        t = _tensor_from_frame(views[i + 1], dtype, shape)
        if tfields[name] == _TENSOR_LIST:
            kwargs[name].append(t)
        elif name in kwargs:
            raise ProtocolError("bad_descriptor", f"tensor field {name!r} appears twice")
        else:
            kwargs[name] = t
    missing = [n for n, k in tfields.items() if k == _TENSOR and n not in kwargs]
    if missing:
        raise ProtocolError("missing_field", f"{mtype.name} lacks tensor(s) {missing}")
    msg = schema.cls(**kwargs)
    msg.check()
    return msg, rid
