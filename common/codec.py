"""The one place that turns messages into ZeroMQ frames and back.

Frame layout of every message::

    frame 0      msgpack header {"v": protocol version, "t": MsgType, "id": request id,
                                 "s": {scalar field: value},
                                 "d": [[tensor path, dtype, shape], ...]}
    frame 1..n   raw bytes of tensor i (C order), one frame per descriptor in "d"

A field may be a nested struct (a :class:`~common.structs.Struct` dataclass), an optional one
(``X | None``, left out of the header when None) or a list of them. A struct's scalar fields
nest in the header (``"s": {"mfg": {"layers": [{"num_src": [5]}, ...]}}``); its tensors are
frames whose descriptor names the path to them: field names and list positions joined by dots
(``"mfg.layers.0.rels.0.indptr"``). The header alone decides which structs exist; a
descriptor may only name a tensor field of one of them. A ``list[Tensor]`` field's tensors
repeat its path, in order.

Tensors are sent without copying (``copy=False`` on the socket; the frames here are
memoryviews of the tensors) and decoded without copying (``torch.frombuffer`` on the received
frame). Nothing is ever pickled. :func:`decode` validates every header field (version, type,
id bounds, scalar types, struct shapes, nesting bounds, dtype whitelist, shapes against frame
lengths, total size) and then every struct's and the message's own :meth:`check`, innermost
first; any violation raises :class:`ProtocolError` with a code.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
import warnings
from collections.abc import Sequence
from typing import Any

import msgpack
import torch
from torch import Tensor

from common.errors import ProtocolError
from common.messages import MESSAGE_CLASSES, PROTOCOL_VERSION, Message, MsgType
from common.structs import Struct

MAX_HEADER_BYTES = 1 << 20
MAX_REQUEST_ID = 2**63 - 1
# tensor frames per message: a typed MFG carries 2 per relation and layer plus 4 per node
# type (ogbn-mag with reverse relations, 3 layers: 58); version 5 raised it from 64
MAX_TENSORS = 512
MAX_NDIM = 4
MAX_LIST_LEN = 1024
MAX_STR_LEN = 4096
MAX_DEPTH = 4  # struct nesting below a message (checked on the classes, so also on receipt)
MAX_STRUCTS = 1024  # nested structs in one message
DEFAULT_MAX_MESSAGE_BYTES = 512 << 20

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
    "int16": torch.int16, "int8": torch.int8, "uint8": torch.uint8, "bool": torch.bool,
}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}

# Field kinds, derived once per class from its annotations.
(_TENSOR, _TENSOR_LIST, _INT, _FLOAT, _STR, _BOOL, _INT_LIST, _FLOAT_DICT, _STRUCT,
 _STRUCT_LIST) = range(10)
_TENSOR_KINDS = (_TENSOR, _TENSOR_LIST)


@dataclasses.dataclass(frozen=True)
class _Field:
    name: str
    kind: int
    required: bool
    sub: _Schema | None = None  # the struct's schema, for _STRUCT / _STRUCT_LIST


@dataclasses.dataclass(frozen=True)
class _Schema:
    cls: type[Struct]
    fields: tuple[_Field, ...]

    def field(self, name: str) -> _Field | None:
        return next((f for f in self.fields if f.name == name), None)


def _is_struct(tp: Any) -> bool:
    return (isinstance(tp, type) and issubclass(tp, Struct) and not issubclass(tp, Message)
            and dataclasses.is_dataclass(tp))


def _kind_of(tp: Any, depth: int) -> tuple[int, _Schema | None]:
    if tp is Tensor:
        return _TENSOR, None
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType) and len(args) == 2 and type(None) in args:
        inner = args[0] if args[1] is type(None) else args[1]
        if _is_struct(inner):  # X | None: an optional struct
            return _STRUCT, _schema(inner, depth + 1)
    if _is_struct(tp):
        return _STRUCT, _schema(tp, depth + 1)
    if origin is list and len(args) == 1 and _is_struct(args[0]):
        return _STRUCT_LIST, _schema(args[0], depth + 1)
    if origin is list and args == (Tensor,):
        return _TENSOR_LIST, None
    if origin is list and args == (int,):
        return _INT_LIST, None
    if origin is dict and args == (str, float):
        return _FLOAT_DICT, None
    simple = {int: _INT, float: _FLOAT, str: _STR, bool: _BOOL}
    if tp in simple:
        return simple[tp], None
    raise TypeError(f"unsupported message field type {tp}")


def _schema(cls: type[Struct], depth: int = 0) -> _Schema:
    if depth > MAX_DEPTH:
        raise TypeError(f"{cls.__name__} nests structs deeper than {MAX_DEPTH}")
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # every Struct is a dataclass
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        kind, sub = _kind_of(hints[f.name], depth)
        out.append(_Field(f.name, kind, required, sub))
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


class _Encoder:
    def __init__(self) -> None:
        self.descs: list[list[Any]] = []  # [path, dtype, shape] per tensor
        self.buffers: list[memoryview] = []

    def tensor(self, path: str, t: Tensor) -> None:
        if t.dtype not in DTYPE_NAMES:
            raise ProtocolError("bad_dtype", f"{path}: dtype {t.dtype} is not sendable")
        self.descs.append([path, DTYPE_NAMES[t.dtype], list(t.shape)])
        self.buffers.append(_tensor_bytes(t))

    def obj(self, obj: Struct, schema: _Schema, prefix: str) -> dict[str, Any]:
        """``obj``'s header map; its tensors (nested ones too) go to descs/buffers."""
        head: dict[str, Any] = {}
        for f in schema.fields:
            value, path = getattr(obj, f.name), prefix + f.name
            if f.kind == _TENSOR:
                self.tensor(path, value)
            elif f.kind == _TENSOR_LIST:
                for t in value:
                    self.tensor(path, t)
            elif f.kind == _STRUCT:
                if value is not None:  # an optional struct that is None is left out
                    head[f.name] = self.obj(value, f.sub, path + ".")  # type: ignore[arg-type]
            elif f.kind == _STRUCT_LIST:
                head[f.name] = [self.obj(x, f.sub, f"{path}.{i}.")  # type: ignore[arg-type]
                                for i, x in enumerate(value)]
            else:
                head[f.name] = value
        return head


def encode(msg: Message, request_id: int) -> list[Any]:
    """Frames of ``msg``: the header, then one buffer per tensor (send with copy=False)."""
    enc = _Encoder()
    scalars = enc.obj(msg, SCHEMAS[msg.TYPE], "")
    header = msgpack.packb(
        {"v": PROTOCOL_VERSION, "t": int(msg.TYPE), "id": int(request_id), "s": scalars,
         "d": enc.descs},
        use_bin_type=True,
    )
    return [header, *enc.buffers]


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


def peek_error_code(frames: Sequence[Any]) -> str | None:
    """The code of an encoded ErrorReply (``frames`` as :func:`encode` returned them), None
    for any other message. Cheap for the replies that matter: an MFG reply has tensor frames
    and is never unpacked here."""
    if len(frames) != 1:
        return None  # an ErrorReply has no tensors: one frame
    head = msgpack.unpackb(bytes(_frame_bytes(frames[0])[:MAX_HEADER_BYTES]), raw=False)
    if not isinstance(head, dict) or head.get("t") != MsgType.ERROR:
        return None
    code = head.get("s", {}).get("code")
    return code if isinstance(code, str) else "?"


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


@dataclasses.dataclass
class _Pending:
    """A struct being decoded: its arguments so far (scalars, nested _Pending, tensors)."""

    schema: _Schema
    where: str
    kwargs: dict[str, Any] = dataclasses.field(default_factory=dict)


class _Decoder:
    def __init__(self) -> None:
        self.structs = 0

    def parse(self, schema: _Schema, head: Any, where: str) -> _Pending:
        """A struct's header map, checked against its schema (tensors come later)."""
        if not isinstance(head, dict):
            raise ProtocolError("bad_field", f"{where} must be a map, got {type(head).__name__}")
        names = {f.name for f in schema.fields if f.kind not in _TENSOR_KINDS}
        extra = set(head) - names
        if extra:
            raise ProtocolError("bad_field", f"unknown field(s) {sorted(map(str, extra))} "
                                f"for {where}")
        p = _Pending(schema, where)
        for f in schema.fields:
            if f.kind == _TENSOR_LIST:
                p.kwargs[f.name] = []
            if f.kind in _TENSOR_KINDS:
                continue
            if f.name not in head:
                if f.required:
                    raise ProtocolError("missing_field", f"{where} lacks field {f.name!r}")
                continue
            p.kwargs[f.name] = self.value(f, head[f.name], f"{where}.{f.name}")
        return p

    def value(self, f: _Field, v: Any, where: str) -> Any:
        if f.kind == _STRUCT:
            self.count(1)
            return self.parse(f.sub, v, where)  # type: ignore[arg-type]
        if f.kind == _STRUCT_LIST:
            if not isinstance(v, list):
                raise ProtocolError("bad_field", f"{where} must be a list of maps")
            self.count(len(v))
            return [self.parse(f.sub, x, f"{where}.{i}")  # type: ignore[arg-type]
                    for i, x in enumerate(v)]
        return _check_scalar(f.name, f.kind, v)

    def count(self, n: int) -> None:
        self.structs += n
        if self.structs > MAX_STRUCTS:
            raise ProtocolError("bad_field", f"more than {MAX_STRUCTS} nested structs")

    @staticmethod
    def place(root: _Pending, path: str, t: Tensor) -> None:
        """Put tensor ``t`` where descriptor ``path`` says, in a struct the header made."""
        node, parts = root, path.split(".")
        i = 0
        while True:
            f = node.schema.field(parts[i])
            last = i == len(parts) - 1
            if f is not None and f.kind in _TENSOR_KINDS and last:
                break
            child = None if f is None or last else node.kwargs.get(f.name)
            if f is not None and f.kind == _STRUCT_LIST and child is not None:
                i += 1
                idx = parts[i]
                ok = idx.isascii() and idx.isdigit() and len(idx) < 6 and idx == str(int(idx))
                child = child[int(idx)] if ok and int(idx) < len(child) else None
            if child is None or i == len(parts) - 1 or not isinstance(child, _Pending):
                raise ProtocolError("bad_descriptor", f"{root.where} has no tensor {path!r} "
                                    "(a tensor field of a struct in the header)")
            node, i = child, i + 1
        if f.kind == _TENSOR_LIST:
            node.kwargs[f.name].append(t)
        elif f.name in node.kwargs:
            raise ProtocolError("bad_descriptor", f"tensor field {path!r} appears twice")
        else:
            node.kwargs[f.name] = t

    def build(self, p: _Pending) -> Any:
        """The struct (nested ones first), constructed and checked."""
        kw = p.kwargs
        missing = []
        for f in p.schema.fields:
            if f.kind == _STRUCT and f.name in kw:
                kw[f.name] = self.build(kw[f.name])
            elif f.kind == _STRUCT_LIST and f.name in kw:
                kw[f.name] = [self.build(x) for x in kw[f.name]]
            elif f.kind == _TENSOR and f.name not in kw:
                missing.append(f.name)
        if missing:
            raise ProtocolError("missing_field", f"{p.where} lacks tensor(s) {missing}")
        obj = p.schema.cls(**kw)
        obj.check()
        return obj


def _tensor_from_frame(buf: memoryview, dtype: torch.dtype, shape: list[int]) -> Tensor:
    if buf.nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    with warnings.catch_warnings():
        # zmq frames are read-only; receivers never write into decoded tensors in place.
        warnings.simplefilter("ignore", UserWarning)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)


def _read_header(views: list[memoryview], max_message_bytes: int) -> dict:
    if len(views) > MAX_TENSORS + 1:
        raise ProtocolError("too_many_frames", f"{len(views)} frames exceed {MAX_TENSORS + 1}")
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
    if not isinstance(head["s"], dict) or not isinstance(head["d"], list):
        raise ProtocolError("bad_header", "header fields s/d must be a map and a list")
    return head


def _read_tensor(i: int, desc: Any, view: memoryview, max_message_bytes: int
                 ) -> tuple[str, Tensor]:
    if not (isinstance(desc, list) and len(desc) == 3 and isinstance(desc[0], str)
            and isinstance(desc[1], str) and isinstance(desc[2], list)):
        raise ProtocolError("bad_descriptor", f"tensor descriptor {i} must be "
                            "[name, dtype, shape]")
    name, dname, shape = desc
    if dname not in DTYPES:
        raise ProtocolError("bad_dtype", f"dtype {dname!r} of {name!r} is not one of "
                            f"{sorted(DTYPES)}")
    if (len(shape) > MAX_NDIM
            or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in shape)):
        raise ProtocolError("bad_shape", f"shape {shape!r} of {name!r} is invalid")
    dtype = DTYPES[dname]
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes != view.nbytes:
        raise ProtocolError("size_mismatch", f"{name!r} of shape {shape} {dname} needs "
                            f"{nbytes} bytes, its frame has {view.nbytes}")
    if nbytes == 0 and math.prod(max(s, 1) for s in shape) > max_message_bytes:
        # an empty tensor's other dims are unchecked by the size test; torch overflows on them
        raise ProtocolError("bad_shape", f"shape {shape!r} of empty {name!r} is too large")
    return name, _tensor_from_frame(view, dtype, shape)


def decode(frames: Sequence[Any],
           max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> tuple[Message, int]:
    """Validate and decode frames into ``(message, request_id)``; raises ProtocolError."""
    if not frames:
        raise ProtocolError("empty", "message has no frames")
    views = [_frame_bytes(f) for f in frames]
    head = _read_header(views, max_message_bytes)
    try:
        mtype = MsgType(head["t"])
    except (ValueError, TypeError):
        raise ProtocolError("unknown_type", f"message type {head['t']!r} is unknown") from None
    dec = _Decoder()
    root = dec.parse(SCHEMAS[mtype], head["s"], mtype.name)
    descs = head["d"]
    if len(descs) != len(views) - 1:
        raise ProtocolError("frame_count", f"header describes {len(descs)} tensors but "
                            f"{len(views) - 1} tensor frames arrived")
    for i, desc in enumerate(descs):
        path, t = _read_tensor(i, desc, views[i + 1], max_message_bytes)
        dec.place(root, path, t)
    return dec.build(root), head["id"]
