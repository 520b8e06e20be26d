"""Codec tests: round trips of every message type and dtype, zero-copy in both directions,
every validation error by its code, and a fuzz property: whatever bytes arrive, ``decode``
raises nothing but ProtocolError.

The fuzz strategy (:func:`fuzzed_frames`) is reused by tests/test_server_bad_input.py against a
live server.
"""

from __future__ import annotations

import ctypes
import dataclasses
import random
from typing import Any

import msgpack
import numpy as np
import pytest
import torch
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from common import codec
from common.errors import ProtocolError
from common.messages import (
    MAX_FANOUT,
    MAX_ID,
    MAX_LAYERS,
    MESSAGE_CLASSES,
    PROTOCOL_VERSION,
    Ack,
    CacheFillReply,
    CacheFillRequest,
    ErrorReply,
    Message,
    MFGReply,
    MsgType,
    NeighborsReply,
    NeighborsRequest,
    NodeDataReply,
    NodeDataRequest,
    Ping,
    Pong,
    SampleJob,
    SampleRequest,
    SampleResult,
    SeedsReply,
    SeedsRequest,
    Shutdown,
    StatsReply,
    StatsRequest,
    StatusReply,
    StatusRequest,
    TensorCreate,
    TensorDrop,
    TensorInfo,
    TensorRead,
    TensorRows,
    TensorUpdate,
    TensorWrite,
    WorkerReady,
    WorkerStop,
)
from common.sampled_mfg import Features, Layer, NodeSet, Relation, SampledMFG
from common.shm_ring import SlotRef
from common.structs import Struct

# ---------------------------------------------------------------- examples and helpers


def chain_mfg(num_layers: int, seeds: int = 3, grow: int = 2, feat_dim: int = 4) -> MFGReply:
    """A valid MFG: each layer's destinations are the first nodes of its sources; every
    destination takes ``grow`` edges from the sources."""
    sizes = [seeds]
    for _ in range(num_layers):
        sizes.append(sizes[-1] + grow)
    sizes.reverse()  # sizes[0] = input layer's source count
    num_src = sizes[:-1]
    num_dst = sizes[1:]
    indptr, indices = [], []
    for ns, nd in zip(num_src, num_dst, strict=True):
        indptr.append(torch.arange(nd + 1, dtype=torch.int64) * grow)
        indices.append((torch.arange(nd * grow, dtype=torch.int64) * 7) % ns)
    n = num_src[0]
    layers = [Layer.homogeneous(*x) for x in zip(num_src, num_dst, indptr, indices, strict=True)]
    return MFGReply(
        mfg=SampledMFG.homogeneous(torch.arange(100, 100 + n, dtype=torch.int64), layers,
                                   Features.frames(torch.randn(n, feat_dim)),
                                   torch.arange(seeds, dtype=torch.int64)),
        timings={"sample_s": 0.25, "gather_s": 1.0},
    )


def hetero_mfg() -> MFGReply:
    """Two node types ("paper" fed by ring rows and the cache, "author" featureless), one
    layer with three relations: what a heterogeneous sampler will send."""
    paper = NodeSet(torch.tensor([10, 11, 12, 13], dtype=torch.int64),
                    Features.ring(2, 8, torch.float16, torch.tensor([True, False, True, False])),
                    torch.tensor([1, 0], dtype=torch.int64), ntype="paper")
    author = NodeSet(torch.tensor([5, 6, 7], dtype=torch.int64), Features.none(),
                     torch.empty(0, dtype=torch.int64), ntype="author")
    ip = torch.tensor([0, 1, 3], dtype=torch.int64)
    rels = [Relation(ip, torch.tensor([2, 0, 1]), 0, 0, "cites"),
            Relation(ip, torch.tensor([0, 1, 2]), 1, 0, "writes"),
            Relation(torch.tensor([0, 2], dtype=torch.int64), torch.tensor([0, 3]), 0, 1,
                     "written-by")]
    layer = Layer(num_src=[4, 3], num_dst=[2, 1], rels=rels)
    return MFGReply(mfg=SampledMFG([paper, author], [layer]))


def examples() -> dict[MsgType, Message]:
    """One valid, non-trivial instance of every message class."""
    return {
        MsgType.ERROR: ErrorReply(code="busy", message="queue full; raise --max-queue"),
        MsgType.PING: Ping(),
        MsgType.PONG: Pong(part_id=1, num_parts=2, num_nodes=3000, feat_dim=16, num_classes=5,
                           node_offsets=[0, 1500, 3000], feat_dtype="float32",
                           dataset="synthetic-3000", pid=4242, server_id="abcd1234",
                           set_id="0123456789abcdef0123456789abcdef"),
        MsgType.SAMPLE: SampleRequest(seeds=torch.tensor([5, 1, 9], dtype=torch.int64),
                                      fanouts=[10, -1], with_feat=False, with_label=True,
                                      slot=SlotRef(4242, 7, "ab" * 16, 4096, 1 << 20)),
        MsgType.MFG: chain_mfg(2),
        MsgType.NEIGHBORS_REQ: NeighborsRequest(nodes=torch.tensor([3, 4], dtype=torch.int64),
                                                fanout=5),
        MsgType.NEIGHBORS: NeighborsReply(counts=torch.tensor([2, 0, 1], dtype=torch.int64),
                                          src=torch.tensor([7, 8, 9], dtype=torch.int64)),
        MsgType.NODE_DATA_REQ: NodeDataRequest(nodes=torch.tensor([0, 2], dtype=torch.int64),
                                               with_feat=True, with_label=True),
        MsgType.NODE_DATA: NodeDataReply(feat=torch.randn(2, 3).to(torch.bfloat16),
                                         label=torch.tensor([1, -1], dtype=torch.int64)),
        MsgType.SEEDS_REQ: SeedsRequest(split="valid"),
        MsgType.SEEDS: SeedsReply(seeds=torch.arange(10, dtype=torch.int64)),
        MsgType.STATS_REQ: StatsRequest(),
        MsgType.STATS: StatsReply(values={"requests": 3.0, "errors": 1.0}),
        MsgType.SHUTDOWN: Shutdown(),
        MsgType.ACK: Ack(),
        MsgType.CACHE_FILL_REQ: CacheFillRequest(cache_ratio=0.25, feat_dtype="float16"),
        MsgType.CACHE_FILL: CacheFillReply(nodes=torch.tensor([3, 9, 11]),
                                           feat=torch.randn(3, 16)),
        MsgType.SAMPLE_JOB: SampleJob.of(
            SampleRequest(seeds=torch.tensor([5, 1, 9]), fanouts=[10, -1],
                          slot=SlotRef(4242, 7, "ab" * 16, 4096, 1 << 20)),
            client=torch.tensor([0, 128, 7, 255, 1], dtype=torch.uint8), t_in=12.5),
        MsgType.SAMPLE_RESULT: SampleResult(
            client=torch.tensor([0, 128, 7, 255, 1], dtype=torch.uint8),
            stats={"sample_requests": 1.0, "sample_s": 0.25},
            reply=[torch.arange(40, dtype=torch.uint8), torch.empty(0, dtype=torch.uint8)]),
        MsgType.WORKER_READY: WorkerReady(index=1, pid=4242),
        MsgType.WORKER_STOP: WorkerStop(),
        MsgType.TENSOR_CREATE: TensorCreate(name="emb.v1", dtype="bfloat16", row_shape=[4, 2],
                                            init="normal", init_scale=0.1, seed=7,
                                            optimizer="adam", lr=0.5, beta1=0.8, eps=1e-6),
        MsgType.TENSOR_INFO: TensorInfo(name="emb", first_id=1500, num_rows=1500, created=True),
        MsgType.TENSOR_WRITE: TensorWrite(name="emb", ids=torch.tensor([7, 3]),
                                          rows=torch.randn(2, 4)),
        MsgType.TENSOR_READ: TensorRead(name="emb", ids=torch.tensor([3, 3, 9])),
        MsgType.TENSOR_ROWS: TensorRows(rows=torch.arange(6, dtype=torch.int32).reshape(3, 2)),
        MsgType.TENSOR_UPDATE: TensorUpdate(name="emb", ids=torch.tensor([3, 3]),
                                            grads=torch.randn(2, 4, dtype=torch.float64)),
        MsgType.TENSOR_DROP: TensorDrop(name="emb"),
        MsgType.STATUS_REQ: StatusRequest(),
        MsgType.STATUS: StatusReply(
            part_id=1, num_parts=2, dataset="synthetic", set_id="ab12", server_id="0123abcd",
            pid=4242, host="node-7", protocol_version=PROTOCOL_VERSION, uptime_s=75.5,
            stats={"requests": 40.0, "mem_rss_bytes": 1e8}, window_s=59.5,
            window={"requests": 12.0, "seeds_served": 384.0}, pss_available=True, trainers=2,
            peers=1, queue_peak=3, queue_limit=64, error_codes={"busy": 2.0}, sampler_kind="processes",
            samplers=2, samplers_alive=1, node_tensor_bytes=4096),
    }


def assert_same_value(a: Any, b: Any, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        assert torch.equal(raw_bytes(a), raw_bytes(b)), where  # bitwise: NaN == NaN here
    elif isinstance(a, list) and a and isinstance(a[0], (torch.Tensor, Struct)):
        assert isinstance(b, list) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same_value(x, y, f"{where}[{i}]")
    elif isinstance(a, Struct):
        assert type(a) is type(b), where
        for f in dataclasses.fields(a):
            assert_same_value(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    else:
        # msgpack bytes compare floats bitwise (NaN included), as the wire does
        assert type(a) is type(b) and msgpack.packb(a) == msgpack.packb(b), (where, a, b)


def raw_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def assert_same_message(a: Message, b: Message) -> None:
    assert_same_value(a, b, type(a).__name__)


def count_tensors(value: Any) -> int:
    """Tensors in a message, nested structs included."""
    if isinstance(value, torch.Tensor):
        return 1
    if isinstance(value, list):
        return sum(count_tensors(x) for x in value)
    if isinstance(value, Struct):
        return sum(count_tensors(getattr(value, f.name)) for f in dataclasses.fields(value))
    return 0


def wire(msg: Message, rid: int = 7) -> list[bytes]:
    """Frames as bytes, as a peer would receive them."""
    return [bytes(f) for f in codec.encode(msg, rid)]


def header_of(frames: list[bytes]) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def with_header(frames: list[bytes], **changes: Any) -> list[bytes]:
    """The frames with header keys replaced (or removed, for a value of ``DROP``)."""
    head = header_of(frames)
    for k, v in changes.items():
        if v is DROP:
            head.pop(k, None)
        else:
            head[k] = v
    return [msgpack.packb(head, use_bin_type=True), *frames[1:]]


DROP = object()


def error_code(frames: list[Any], **kw: Any) -> str:
    with pytest.raises(ProtocolError) as info:
        codec.decode(frames, **kw)
    assert str(info.value), "a protocol error must say what is wrong"
    return info.value.code


def address_of(buf: Any) -> int:
    """Start address of a buffer (bytearray, memoryview, zmq frame buffer)."""
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("mtype", list(MsgType), ids=lambda t: t.name)
def test_round_trip_every_message_class(mtype):
    msg = examples()[mtype]
    assert isinstance(msg, MESSAGE_CLASSES[mtype])
    frames = wire(msg, rid=12345)
    assert len(frames) == 1 + count_tensors(msg)
    out, rid = codec.decode(frames)
    assert rid == 12345
    assert_same_message(msg, out)
    head = header_of(frames)
    assert head["v"] == PROTOCOL_VERSION and head["t"] == int(mtype)


def test_examples_cover_every_message_class():
    assert set(examples()) == set(MESSAGE_CLASSES) == set(MsgType)


@pytest.mark.parametrize("rid", [0, 1, 2**32, codec.MAX_REQUEST_ID])
def test_request_id_bounds_round_trip(rid):
    _, got = codec.decode(wire(Ping(), rid))
    assert got == rid


def test_dtype_whitelist_is_exactly_the_documented_set():
    assert set(codec.DTYPES) == {"float32", "float16", "bfloat16", "float64", "int64", "int32",
                                 "int16", "int8", "uint8", "bool"}


def _random_tensor(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g, dtype=torch.float64) * 1000
        if t.numel():
            t.view(-1)[0] = float("inf")
        return t.to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(dtype)


@pytest.mark.parametrize("dtype", list(codec.DTYPES.values()), ids=list(codec.DTYPES))
@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (2, 3, 4), (1, 2, 3, 2), (0,), (0, 5)],
                         ids=str)
def test_round_trip_every_dtype_and_shape(dtype, shape):
    t = _random_tensor(dtype, shape)
    msg = NodeDataReply(feat=t, label=torch.zeros(0, dtype=torch.int64))
    out, _ = codec.decode(wire(msg))
    assert_same_message(msg, out)
    assert out.feat.dtype == dtype and tuple(out.feat.shape) == shape


def test_unsendable_dtype_is_refused_on_encode():
    msg = NodeDataReply(feat=torch.zeros(2, dtype=torch.complex64),
                        label=torch.zeros(0, dtype=torch.int64))
    with pytest.raises(ProtocolError) as info:
        codec.encode(msg, 1)
    assert info.value.code == "bad_dtype"


def test_empty_tensors_keep_their_shape():
    msg = NodeDataReply(feat=torch.empty(0, 5, dtype=torch.float16),
                        label=torch.empty(0, dtype=torch.int64))
    frames = wire(msg)
    assert [len(f) for f in frames[1:]] == [0, 0]
    out, _ = codec.decode(frames)
    assert out.feat.shape == (0, 5) and out.feat.dtype == torch.float16
    assert out.label.shape == (0,)
    # An MFG with no nodes at all is well formed too.
    layer = Layer.homogeneous(0, 0, torch.zeros(1, dtype=torch.int64),
                              torch.empty(0, dtype=torch.int64))
    empty = MFGReply(mfg=SampledMFG.homogeneous(torch.empty(0, dtype=torch.int64), [layer],
                                                Features.frames(torch.empty(0, 5)),
                                                torch.empty(0, dtype=torch.int64)))
    out, _ = codec.decode(wire(empty))
    assert_same_message(empty, out)


@pytest.mark.parametrize("make", [
    lambda base: base.t(),
    lambda base: base[::2],
    lambda base: base[:, 1:4],
    lambda base: base.t()[1:, ::3],
    lambda base: base[0:1].expand(5, 6),
], ids=["transposed", "row-stride", "column-slice", "transposed-sliced", "expanded"])
def test_non_contiguous_inputs_decode_equal(make):
    base = torch.arange(60, dtype=torch.float32).reshape(10, 6)
    t = make(base)
    assert not t.is_contiguous()
    msg = NodeDataReply(feat=t, label=torch.arange(4, dtype=torch.int64)[::2])
    out, _ = codec.decode(wire(msg))
    assert out.feat.shape == t.shape and torch.equal(out.feat, t)
    assert torch.equal(out.label, torch.tensor([0, 2]))


def test_eight_layer_mfg_has_one_frame_per_tensor():
    msg = chain_mfg(MAX_LAYERS)
    frames = wire(msg, rid=99)
    # header, input node ids, CSCs, feature rows, present-mask, label
    assert len(frames) == 1 + 1 + 2 * MAX_LAYERS + 3
    out, rid = codec.decode(frames)
    assert rid == 99
    assert_same_message(msg, out)
    assert len(out.mfg.layers) == MAX_LAYERS


# ---------------------------------------------------------------- zero copy


def test_encode_of_contiguous_tensor_is_a_view_not_a_copy():
    feat = torch.arange(1000, dtype=torch.float32).reshape(100, 10)
    label = torch.arange(100, dtype=torch.int64)
    frames = codec.encode(NodeDataReply(feat=feat, label=label), 1)
    for frame, t in zip(frames[1:], (feat, label), strict=True):
        assert isinstance(frame, memoryview)
        assert frame.nbytes == t.numel() * t.element_size()
        assert address_of(frame) == t.data_ptr()
    feat[0, 0] = -5.0  # a write to the tensor shows in the frame: same memory
    assert np.frombuffer(frames[1], dtype=np.float32)[0] == -5.0


@pytest.mark.parametrize("dtype", [torch.bool, torch.bfloat16, torch.float16, torch.uint8])
def test_encode_is_zero_copy_for_odd_dtypes(dtype):
    t = _random_tensor(dtype, (64, 8))
    frames = codec.encode(NodeDataReply(feat=t, label=torch.zeros(0, dtype=torch.int64)), 1)
    assert address_of(frames[1]) == t.data_ptr()


def test_decode_from_bytearrays_shares_memory():
    msg = NodeDataReply(feat=torch.randn(64, 16), label=torch.arange(64, dtype=torch.int64))
    frames = [bytes(codec.encode(msg, 3)[0])] + [bytearray(f) for f in codec.encode(msg, 3)[1:]]
    out, _ = codec.decode(frames)
    for t, buf in ((out.feat, frames[1]), (out.label, frames[2])):
        start = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
        ptr = t.untyped_storage().data_ptr()
        assert start <= ptr < start + len(buf)
        assert t.data_ptr() + t.numel() * t.element_size() <= start + len(buf)
    frames[2][:8] = (12345).to_bytes(8, "little")  # the tensor sees writes to the frame
    assert int(out.label[0]) == 12345


def test_decode_of_received_zmq_frames_shares_memory():
    ctx = zmq.Context()
    a = ctx.socket(zmq.PAIR)
    b = ctx.socket(zmq.PAIR)
    try:
        a.bind("inproc://codec-zero-copy")
        b.connect("inproc://codec-zero-copy")
        msg = NodeDataReply(feat=torch.randn(256, 32), label=torch.arange(256, dtype=torch.int64))
        a.send_multipart(codec.encode(msg, 5), copy=False)
        assert b.poll(5000), "inproc message did not arrive"
        frames = b.recv_multipart(copy=False)
        assert all(isinstance(f, zmq.Frame) for f in frames)
        out, rid = codec.decode(frames)
        assert rid == 5
        assert_same_message(msg, out)
        for t, frame in ((out.feat, frames[1]), (out.label, frames[2])):
            start = address_of(frame.buffer)
            ptr = t.untyped_storage().data_ptr()
            assert start <= ptr < start + len(frame.buffer)
    finally:
        a.close(0)
        b.close(0)
        ctx.term()


# ---------------------------------------------------------------- bad input, by code


def sample_frames(**kw: Any) -> list[bytes]:
    seeds = kw.pop("seeds", torch.tensor([1, 2, 3], dtype=torch.int64))
    return wire(SampleRequest(seeds=seeds, fanouts=kw.pop("fanouts", [5, 5]), **kw))


@pytest.mark.parametrize("header", [
    b"\xc1", b"\xc1\xc1garbage", b"", b"\x93\x01", msgpack.packb(1) + b"extra",
    b"\xc4\x03abc",  # a bin object: headers carry no binary data
], ids=["reserved-byte", "garbage", "empty", "truncated-array", "trailing-bytes", "bin"])
def test_garbage_header_bytes(header):
    assert error_code([header]) == "bad_header"


@pytest.mark.parametrize("obj", [[1, 2, 3], 7, "ping", None, {1: 2}],
                         ids=["list", "int", "str", "nil", "int-keys"])
def test_header_that_is_not_a_string_keyed_map(obj):
    assert error_code([msgpack.packb(obj)]) == "bad_header"


@pytest.mark.parametrize("key", ["v", "t", "id", "s", "d"])
def test_header_missing_a_key(key):
    assert error_code(with_header(wire(Ping()), **{key: DROP})) == "bad_header"


def test_header_with_an_extra_key():
    assert error_code(with_header(wire(Ping()), extra=1)) == "bad_header"


def test_header_too_large():
    frames = with_header(wire(ErrorReply("x", "y")),
                         s={"code": "x", "message": "m" * (codec.MAX_HEADER_BYTES + 10)})
    assert error_code(frames) == "bad_header"


@pytest.mark.parametrize("version", [*range(PROTOCOL_VERSION), PROTOCOL_VERSION + 1, 99,
                                     str(PROTOCOL_VERSION), None])
def test_wrong_protocol_version(version):
    with pytest.raises(ProtocolError) as info:
        codec.decode(with_header(wire(Ping()), v=version))
    assert info.value.code == "bad_version"
    text = str(info.value)
    assert repr(version) in text and f"version {PROTOCOL_VERSION}" in text


@pytest.mark.parametrize("mtype", [99, 255, -1, "PING", 1.0 + 0.5, None, [1]])
def test_unknown_message_type(mtype):
    assert error_code(with_header(wire(Ping()), t=mtype)) == "unknown_type"


@pytest.mark.parametrize("rid", [-1, 2**63, 2**64 - 1, True, False, 1.5, "7", None])
def test_bad_request_id(rid):
    assert error_code(with_header(wire(Ping()), id=rid)) == "bad_request_id"


def test_peek_request_id_is_best_effort():
    assert codec.peek_request_id(wire(Ping(), 77)[0]) == 77
    assert codec.peek_request_id(with_header(wire(Ping(), 77), v=9)[0]) == 77
    assert codec.peek_request_id(with_header(wire(Ping()), id=-3)[0]) == 0
    assert codec.peek_request_id(b"\xc1garbage") == 0


def test_unknown_scalar_field():
    assert error_code(with_header(wire(Ping()), s={"surprise": 1})) == "bad_field"
    frames = sample_frames()
    head = header_of(frames)
    assert error_code(with_header(frames, s={**head["s"], "fanout": 3})) == "bad_field"


@pytest.mark.parametrize("field,value", [
    ("part_id", True),      # bool is not an int
    ("part_id", 1.0),
    ("part_id", "1"),
    ("node_offsets", "0,1500,3000"),  # str is not a list
    ("node_offsets", [0, True]),
    ("node_offsets", [0, 1.5]),
    ("node_offsets", list(range(codec.MAX_LIST_LEN + 1))),
    ("dataset", 5),
    ("dataset", "x" * (codec.MAX_STR_LEN + 1)),
])
def test_wrong_scalar_types_pong(field, value):
    frames = wire(examples()[MsgType.PONG])
    head = header_of(frames)
    assert error_code(with_header(frames, s={**head["s"], field: value})) == "bad_field"


@pytest.mark.parametrize("field,value", [
    ("fanouts", "10,10"), ("fanouts", 10), ("with_feat", 1), ("with_label", "yes"),
])
def test_wrong_scalar_types_sample(field, value):
    frames = sample_frames()
    head = header_of(frames)
    assert error_code(with_header(frames, s={**head["s"], field: value})) == "bad_field"


@pytest.mark.parametrize("values", [{"a": True}, {"a": "1"}, [1.0], "x"])
def test_wrong_float_dict(values):
    assert error_code(with_header(wire(StatsReply({})), s={"values": values})) == "bad_field"


def test_missing_scalar_field_and_defaults():
    frames = sample_frames()
    head = header_of(frames)
    s = dict(head["s"])
    del s["fanouts"]
    assert error_code(with_header(frames, s=s)) == "missing_field"
    # Fields with defaults may be left out.
    s = {"fanouts": [3]}
    msg, _ = codec.decode(with_header(frames, s=s))
    assert msg.with_feat is True and msg.with_label is True


def test_header_s_and_d_must_be_map_and_list():
    assert error_code(with_header(wire(Ping()), s=[])) == "bad_header"
    assert error_code(with_header(wire(Ping()), d={})) == "bad_header"


def test_no_frames():
    assert error_code([]) == "empty"


def test_too_many_frames():
    frames = sample_frames()
    assert error_code(frames + [b""] * (codec.MAX_TENSORS + 1)) == "too_many_frames"


def test_frame_count_differs_from_descriptors():
    frames = sample_frames()
    assert error_code(frames[:1]) == "frame_count"                    # tensor frame dropped
    assert error_code(frames + [frames[1]]) == "frame_count"          # frame duplicated
    assert error_code(wire(Ping()) + [b"\x00" * 8]) == "frame_count"  # frame for nothing


@pytest.mark.parametrize("dtype", ["complex64", "float128", "object", "uint16", "Float32", ""])
def test_unknown_dtype(dtype):
    frames = sample_frames()
    assert error_code(with_header(frames, d=[["seeds", dtype, [3]]])) == "bad_dtype"


@pytest.mark.parametrize("shape", [[-3], [3.0], [True, 3], ["3"], [1, 1, 1, 1, 3], [None]],
                         ids=str)
def test_bad_shape(shape):
    frames = sample_frames()
    assert error_code(with_header(frames, d=[["seeds", "int64", shape]])) == "bad_shape"


@pytest.mark.parametrize("shape", [[0, 2**64 - 1], [0, 2**62], [2**40, 2**40, 2**40, 0]], ids=str)
def test_empty_tensor_with_absurd_dims(shape):
    frames = with_header(wire(NodeDataReply(feat=torch.empty(0, 2), label=torch.empty(0))),
                         d=[["feat", "float32", shape], ["label", "int64", [0]]])
    assert error_code(frames) == "bad_shape"


@pytest.mark.parametrize("desc", [["seeds", "int64"], "seeds", ["seeds", "int64", 3],
                                  [1, "int64", [3]], ["seeds", 4, [3]]], ids=str)
def test_malformed_descriptor(desc):
    assert error_code(with_header(sample_frames(), d=[desc])) == "bad_descriptor"


def test_size_mismatch():
    frames = sample_frames()  # seeds: 3 x int64 = 24 bytes
    assert error_code([frames[0], frames[1][:16]]) == "size_mismatch"
    assert error_code([frames[0], frames[1] + b"\x00"]) == "size_mismatch"
    assert error_code(with_header(frames, d=[["seeds", "int32", [3]]])) == "size_mismatch"
    assert error_code(with_header(frames, d=[["seeds", "int64", [4]]])) == "size_mismatch"


def test_total_size_over_cap():
    frames = wire(NodeDataReply(feat=torch.zeros(1024), label=torch.zeros(0, dtype=torch.int64)))
    total = sum(len(f) for f in frames)
    assert error_code(frames, max_message_bytes=total - 1) == "too_large"
    codec.decode(frames, max_message_bytes=total)  # exactly at the cap is fine
    with pytest.raises(ProtocolError) as info:
        codec.decode(frames, max_message_bytes=100)
    assert "max_message_mb" in str(info.value)


def test_duplicate_tensor_field():
    frames = sample_frames()
    dup = with_header(frames, d=[["seeds", "int64", [3]], ["seeds", "int64", [3]]])
    assert error_code(dup + [frames[1]]) == "bad_descriptor"


def test_unknown_tensor_field():
    frames = sample_frames()
    assert error_code(with_header(frames, d=[["nodes", "int64", [3]]])) == "bad_descriptor"


def test_missing_tensor_field():
    frames = sample_frames()
    assert error_code(with_header(frames[:1], d=[])) == "missing_field"
    nd = wire(examples()[MsgType.NODE_DATA])
    head = header_of(nd)
    assert error_code([with_header(nd, d=head["d"][:1])[0], nd[1]]) == "missing_field"


@pytest.mark.parametrize("seeds", [[-1, 2], [0, MAX_ID], [2**63 - 1]], ids=str)
def test_out_of_range_seed_ids(seeds):
    frames = sample_frames(seeds=torch.tensor(seeds, dtype=torch.int64))
    assert error_code(frames) == "id_out_of_range"


def test_largest_valid_id_passes():
    msg, _ = codec.decode(sample_frames(seeds=torch.tensor([0, MAX_ID - 1])))
    assert int(msg.seeds.max()) == MAX_ID - 1


@pytest.mark.parametrize("msg", [
    NeighborsRequest(nodes=torch.tensor([-5]), fanout=3),
    NodeDataRequest(nodes=torch.tensor([1, -1])),
    NeighborsReply(counts=torch.tensor([1]), src=torch.tensor([-2])),
    NeighborsReply(counts=torch.tensor([-1, 2]), src=torch.tensor([3])),
], ids=["neighbors-req", "node-data-req", "neighbors-src", "neighbors-counts"])
def test_out_of_range_ids_in_other_messages(msg):
    assert error_code(wire(msg)) == "id_out_of_range"


@pytest.mark.parametrize("seeds", [
    torch.tensor([1, 2], dtype=torch.int32), torch.tensor([[1, 2]]), torch.tensor([1.0]),
    torch.empty(0, dtype=torch.int64), torch.tensor(3),
], ids=["int32", "2d", "float", "empty", "0d"])
def test_seed_tensor_of_wrong_kind(seeds):
    assert error_code(sample_frames(seeds=seeds)) == "bad_tensor"


@pytest.mark.parametrize("fanouts", [[0], [-2], [5, 0], [], [5] * (MAX_LAYERS + 1),
                                     [MAX_FANOUT + 1]], ids=str)
def test_bad_fanouts(fanouts):
    assert error_code(sample_frames(fanouts=fanouts)) == "bad_fanouts"


def test_bad_fanout_in_neighbors_request():
    assert error_code(wire(NeighborsRequest(nodes=torch.tensor([1]), fanout=0))) == "bad_fanouts"


def test_neighbors_reply_counts_must_sum_to_src():
    msg = NeighborsReply(counts=torch.tensor([2, 2]), src=torch.tensor([1, 2, 3]))
    assert error_code(wire(msg)) == "bad_tensor"


def test_bad_split():
    assert error_code(wire(SeedsRequest(split="training"))) == "bad_split"


def _broken_mfg(change) -> list[bytes]:
    m = chain_mfg(2)
    change(m.mfg)
    return wire(m)


def _layer(m: SampledMFG, i: int) -> Layer:
    return m.layers[i]


def _rel(m: SampledMFG, i: int) -> Relation:
    return m.layers[i].rels[0]


def _feat(m: SampledMFG) -> Features:
    return m.nodes[0].feat


@pytest.mark.parametrize("change", [
    lambda m: _rel(m, 0).indptr.__setitem__(1, 5),                    # not monotone
    lambda m: _rel(m, 1).indices.__setitem__(0, _layer(m, 1).num_src[0]),  # index == num_src
    lambda m: _rel(m, 0).indices.__setitem__(0, -1),                  # negative index
    lambda m: _rel(m, 1).indptr.__setitem__(0, 1),                    # does not start at 0
    lambda m: setattr(_rel(m, 1), "indices", _rel(m, 1).indices[:-1]),  # end != len(indices)
    lambda m: setattr(_rel(m, 0), "indptr", _rel(m, 0).indptr[:-1]),  # wrong length
    lambda m: setattr(_rel(m, 0), "indptr", _rel(m, 0).indptr.to(torch.int32)),
    lambda m: setattr(_layer(m, 0), "num_dst", _layer(m, 0).num_dst * 2),  # lengths differ
    lambda m: setattr(_layer(m, 0), "num_src", [_layer(m, 0).num_src[0] + 1]),  # != len(ids)
    lambda m: setattr(_layer(m, 1), "num_src", [_layer(m, 1).num_src[0] + 1]),  # no chain
    lambda m: setattr(_layer(m, 1), "num_dst", [_layer(m, 1).num_src[0] + 1]),  # dst > src
    lambda m: setattr(m, "layers", []),                                # no layer
    lambda m: setattr(_rel(m, 0), "src_type", 1),                      # no such node type
    lambda m: setattr(_layer(m, 0), "rels", _layer(m, 0).rels * 2),    # relation twice
    lambda m: setattr(_feat(m), "rows", _feat(m).rows[:-1]),           # a row short
    lambda m: setattr(_feat(m), "num_rows", _feat(m).num_rows + 1),    # count disagrees
    lambda m: setattr(_feat(m), "via", "pigeon"),                      # unknown way
    lambda m: setattr(_feat(m), "via", "ring"),                        # ring, rows on wire
    lambda m: setattr(_feat(m), "present", torch.ones(3, dtype=torch.bool)),  # mask length
    lambda m: setattr(m.nodes[0], "label", torch.arange(4)),           # label count
], ids=["indptr-not-monotone", "index-too-big", "index-negative", "indptr-start",
        "indptr-end", "indptr-length", "indptr-dtype", "list-lengths", "input-count",
        "layer-chain", "dst-over-src", "no-layer", "bad-node-type", "relation-twice",
        "feat-row-short", "feat-count", "feat-via", "feat-ring-rows", "present-length",
        "label-count"])
def test_inconsistent_mfg(change):
    assert error_code(_broken_mfg(change)) == "bad_mfg"


def test_mfg_with_too_many_layers():
    assert error_code(wire(chain_mfg(MAX_LAYERS + 1))) == "bad_mfg"


def test_mfg_input_node_ids_are_checked():
    m = chain_mfg(1)
    m.mfg.nodes[0].ids[0] = -1
    assert error_code(wire(m)) == "id_out_of_range"


# ---------------------------------------------------------------- fuzz
#
# Mutations are drawn from a hypothesis-controlled ``random.Random`` (cheap to generate, still
# reproducible and shrinkable) rather than from nested strategies, which cost ~10 ms a draw.

_INTS = [-(2**63), -1, 0, 1, 2, 3, 8, 9, 64, 65, 2**31, 2**62, 2**63 - 1, 2**63, 2**64 - 1]
_WORDS = [*codec.DTYPES, "seeds", "feat", "label", "indptr", "indices", "fanouts", "num_src",
          "num_dst", "with_feat", "split", "values", "code", "nodes", "train", "", "ring",
          "frames", "none", "mfg.layers.0.rels.0.indptr", "mfg.nodes.0.feat.rows", "slot"]
_HEADER_KEYS = ["v", "t", "id", "s", "d"]
_SCALAR_KEYS = ["fanouts", "with_feat", "with_label", "num_src", "num_dst", "split", "values",
                "code", "message", "fanout", "node_offsets", "part_id", "timings", "bogus",
                "mfg", "slot", "layers", "nodes", "rels", "via", "num_rows", "pid", "token",
                "src_type", "ntype"]


def random_value(rnd: random.Random, depth: int = 0) -> Any:
    """A random msgpack-able value, biased towards boundary ints and the protocol's words."""
    kind = rnd.randrange(10 if depth < 2 else 7)
    if kind == 0:
        return None
    if kind == 1:
        return rnd.random() < 0.5
    if kind == 2:
        return rnd.choice(_INTS)
    if kind == 3:
        return rnd.randint(-5, 100)
    if kind == 4:
        return rnd.choice([0.0, -1.5, 1e300, float("inf"), float("nan"), rnd.random()])
    if kind in (5, 6):
        return rnd.choice(_WORDS) if rnd.random() < 0.7 else "".join(
            chr(rnd.randrange(32, 0x2FF)) for _ in range(rnd.randrange(6)))
    if kind in (7, 8):
        return [random_value(rnd, depth + 1) for _ in range(rnd.randrange(5))]
    return {rnd.choice(_WORDS + _HEADER_KEYS): random_value(rnd, depth + 1)
            for _ in range(rnd.randrange(4))}


def _mutate_header(frames: list[bytes], edit) -> list[bytes]:
    try:
        head = msgpack.unpackb(frames[0], raw=False)
    except Exception:
        return frames
    if not isinstance(head, dict):
        return frames
    try:
        edit(head)
    except Exception:  # e.g. a flipped byte made an unsortable key set: skip this edit
        return frames
    try:
        packed = msgpack.packb(head, use_bin_type=True)
    except (OverflowError, ValueError):  # an edit left msgpack's int range: not a message
        return frames
    return [packed, *frames[1:]]


_MUTATION_WEIGHTS = [0, 1, 2, 3, 4, 5, 6, 6, 7, 8, 8, 8, 9, 9, 9, 10, 10, 10, 11, 11, 11]


def _nested_maps(value: Any) -> list[dict]:
    """Every map inside a header's scalars (nested structs), the top one included."""
    if isinstance(value, dict):
        return [value] + [m for v in value.values() for m in _nested_maps(v)]
    if isinstance(value, list):
        return [m for v in value for m in _nested_maps(v)]
    return []


def mutate(frames: list[bytes], rnd: random.Random) -> list[bytes]:
    """One random structural or byte-level mutation of a multipart message."""
    frames = list(frames)
    n = len(frames)
    # Structural edits are weighted up: byte flips mostly stop at the msgpack parser.
    kind = rnd.choice(_MUTATION_WEIGHTS)
    if n == 0:
        return [rnd.randbytes(rnd.randrange(40))]
    i = rnd.randrange(n)
    if kind == 0 and frames[0]:  # flip a header byte
        f = bytearray(frames[0])
        f[rnd.randrange(len(f))] ^= rnd.randrange(1, 256)
        frames[0] = bytes(f)
    elif kind == 1 and frames[i]:  # flip a byte anywhere
        f = bytearray(frames[i])
        f[rnd.randrange(len(f))] ^= rnd.randrange(1, 256)
        frames[i] = bytes(f)
    elif kind == 2:  # truncate a frame
        frames[i] = frames[i][: rnd.randrange(len(frames[i]) + 1)]
    elif kind == 3:
        del frames[i]
    elif kind == 4:
        frames.insert(i, frames[i])
    elif kind == 5:
        frames.insert(rnd.randrange(n + 1), rnd.randbytes(rnd.randrange(40)))
    elif kind == 6:  # set a header key to anything
        key, value = rnd.choice(_HEADER_KEYS + ["x"]), random_value(rnd)
        frames = _mutate_header(frames, lambda h: h.__setitem__(key, value))
    elif kind == 7:
        key = rnd.choice(_HEADER_KEYS)
        frames = _mutate_header(frames, lambda h: h.pop(key, None))
    elif kind == 8:  # set or add a scalar field
        key, value = rnd.choice(_SCALAR_KEYS), random_value(rnd)

        def edit(h):
            if isinstance(h.get("s"), dict):
                h["s"][key] = value
        frames = _mutate_header(frames, edit)
    elif kind == 9:  # change one element of a tensor descriptor (name, dtype or shape)
        value = random_value(rnd) if rnd.random() < 0.5 else [
            rnd.choice([0, 1, 2, 3, 4, 8, 24, -1, 2**40, 2**64 - 1]) for _ in range(rnd.randrange(6))]

        def edit(h):
            d = h.get("d")
            if isinstance(d, list) and d and isinstance(d[i % len(d)], list) and d[i % len(d)]:
                desc = d[i % len(d)]
                desc[rnd.randrange(len(desc))] = value
        frames = _mutate_header(frames, edit)
    elif kind == 11:  # set, add or drop a field of a nested struct
        key, value, drop = rnd.choice(_SCALAR_KEYS), random_value(rnd), rnd.random() < 0.3

        def edit(h):
            maps = _nested_maps(h.get("s"))
            m = maps[rnd.randrange(len(maps))] if maps else {}
            if drop and m:
                m.pop(rnd.choice(sorted(m)))
            else:
                m[rnd.choice(sorted(m)) if m and rnd.random() < 0.6 else key] = value
        frames = _mutate_header(frames, edit)
    else:  # nudge one int inside the scalars (list items included)
        def edit(h):
            s = h.get("s")
            if isinstance(s, dict) and s:
                k = rnd.choice(sorted(s))
                v = s[k]
                j = rnd.randrange(len(v)) if isinstance(v, list) and v else 0
                if isinstance(v, list) and v and type(v[j]) is int:
                    v[j] += rnd.choice([-2, -1, 1, 2])
                elif isinstance(v, int) and not isinstance(v, bool):
                    s[k] = v + rnd.choice([-2, -1, 1, 2**62])
        frames = _mutate_header(frames, edit)
    return frames


_VALID = [wire(m, rid=i + 1) for i, m in enumerate(examples().values())]
_VALID.append(wire(chain_mfg(MAX_LAYERS)))
_VALID.append(wire(hetero_mfg()))


@st.composite
def fuzzed_frames(draw) -> list[bytes]:
    """Random byte frames, or a valid message (every type) with 1..3 random mutations."""
    rnd = draw(st.randoms(use_true_random=False))
    if rnd.random() < 0.15:
        return [rnd.randbytes(rnd.randrange(64)) for _ in range(rnd.randrange(1, 5))]
    frames = rnd.choice(_VALID)
    for _ in range(rnd.randrange(1, 4)):
        frames = mutate(frames, rnd)
    return frames


FUZZ_EXAMPLES = 2500


def test_fuzzed_frames_only_ever_raise_protocol_error(record_property):
    tried = {"messages": 0, "frames": 0, "decoded": 0, "rejected": 0}
    codes: dict[str, int] = {}

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(frames=fuzzed_frames(), cap=st.sampled_from([codec.DEFAULT_MAX_MESSAGE_BYTES, 4096]))
    def run(frames, cap):
        tried["messages"] += 1
        tried["frames"] += len(frames)
        try:
            msg, rid = codec.decode(frames, cap)
        except ProtocolError as e:
            assert isinstance(e.code, str) and e.code and str(e)
            tried["rejected"] += 1
            codes[e.code] = codes.get(e.code, 0) + 1
            return
        # Whatever decodes is a well-formed message: it re-encodes to an equal one.
        tried["decoded"] += 1
        again, rid2 = codec.decode(wire(msg, rid))
        assert rid2 == rid
        assert_same_message(msg, again)

    run()
    record_property("fuzz_messages", tried["messages"])
    record_property("fuzz_frames", tried["frames"])
    record_property("fuzz_error_codes", dict(sorted(codes.items())))
    print(f"\ncodec fuzz: {tried['messages']} messages ({tried['frames']} frames), "
          f"{tried['decoded']} decoded, {tried['rejected']} rejected; codes {dict(sorted(codes.items()))}")
    assert tried["messages"] >= FUZZ_EXAMPLES * 0.9
    # The fuzzer must reach deep validation, not only the header parser.
    assert tried["decoded"] > 0
    for code in ("bad_header", "frame_count", "size_mismatch", "bad_field"):
        assert codes.get(code, 0) > 0, f"fuzzer never produced {code}: {codes}"
