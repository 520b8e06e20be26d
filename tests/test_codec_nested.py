"""Nested structs in the codec: the sampled MFG (several node and edge types), the optional
ring slot, malformed nested headers and descriptor paths by error code, and the bound on
struct nesting. Helpers and the fuzz test (whose valid messages include these) live in
tests/test_codec.py.
"""

from __future__ import annotations

import dataclasses

import msgpack
import pytest

from common import codec
from common.messages import Message, MsgType
from common.structs import Struct
from tests.test_codec import (
    assert_same_message,
    chain_mfg,
    count_tensors,
    error_code,
    examples,
    header_of,
    hetero_mfg,
    sample_frames,
    wire,
)


def test_heterogeneous_mfg_round_trips_with_path_descriptors():
    msg = hetero_mfg()
    frames = wire(msg)
    assert len(frames) == 1 + count_tensors(msg)
    names = [d[0] for d in header_of(frames)["d"]]
    assert "mfg.layers.0.rels.2.indices" in names and "mfg.nodes.1.feat.rows" in names
    out, _ = codec.decode(frames)
    assert_same_message(msg, out)
    assert [n.ntype for n in out.mfg.nodes] == ["paper", "author"]
    assert out.mfg.nodes[0].feat.cached_rows == 2
    with pytest.raises(ValueError):
        _ = out.mfg.input_nodes  # per node type only


def test_optional_struct_is_left_out_when_none():
    with_slot = header_of(wire(examples()[MsgType.SAMPLE]))["s"]
    assert with_slot["slot"] == {"pid": 4242, "fd": 7, "token": "ab" * 16, "offset": 4096,
                                 "capacity": 1 << 20}
    assert "slot" not in header_of(sample_frames())["s"]
    msg, _ = codec.decode(sample_frames())
    assert msg.slot is None


def _edit_s(frames: list[bytes], edit) -> list[bytes]:
    head = header_of(frames)
    edit(head["s"])
    return [msgpack.packb(head, use_bin_type=True), *frames[1:]]


@pytest.mark.parametrize("edit,code", [
    (lambda s: s.__setitem__("mfg", [1]), "bad_field"),                   # not a map
    (lambda s: s["mfg"].__setitem__("layers", {}), "bad_field"),          # not a list
    (lambda s: s["mfg"]["layers"].__setitem__(0, 3), "bad_field"),        # item not a map
    (lambda s: s["mfg"]["layers"][0].__setitem__("bogus", 1), "bad_field"),  # unknown field
    (lambda s: s["mfg"]["layers"][0].__setitem__("num_src", "5"), "bad_field"),  # wrong type
    (lambda s: s["mfg"]["nodes"][0]["feat"].__setitem__("via", 2), "bad_field"),
    (lambda s: s["mfg"]["layers"][0].pop("num_src"), "missing_field"),
    (lambda s: s["mfg"].pop("nodes"), "missing_field"),
    (lambda s: s.pop("mfg"), "missing_field"),
    (lambda s: s["mfg"]["layers"].append({}), "missing_field"),       # a layer without fields
    (lambda s: s["mfg"]["layers"][1]["rels"].append(                  # a relation, no tensors
        {"src_type": 0, "dst_type": 0, "etype": "x"}), "missing_field"),
    (lambda s: s["mfg"].__setitem__("layers", [{}] * (codec.MAX_STRUCTS + 1)), "bad_field"),
], ids=["not-a-map", "not-a-list", "item-not-a-map", "unknown-field", "wrong-type",
        "wrong-type-deep", "missing-scalar", "missing-struct-list", "missing-struct",
        "struct-without-fields", "struct-without-tensors", "too-many-structs"])
def test_malformed_nested_header(edit, code):
    assert error_code(_edit_s(wire(chain_mfg(2)), edit)) == code


@pytest.mark.parametrize("slot,code", [
    ({"pid": 1, "fd": 3, "token": "ab" * 16, "offset": 4096}, "missing_field"),
    ({"pid": 1, "fd": 3, "token": 5, "offset": 4096, "capacity": 1}, "bad_field"),
    ({"pid": 0, "fd": 3, "token": "ab" * 16, "offset": 4096, "capacity": 1}, "bad_field"),
    ({"pid": 1, "fd": 3, "token": "zz" * 16, "offset": 4096, "capacity": 1}, "bad_field"),
    ({"pid": 1, "fd": 3, "token": "ab" * 16, "offset": 0, "capacity": 1}, "bad_field"),
    (None, "bad_field"),
], ids=["missing", "token-type", "pid", "token-hex", "offset", "nil"])
def test_bad_ring_slot(slot, code):
    assert error_code(_edit_s(sample_frames(), lambda s: s.__setitem__("slot", slot))) == code


@pytest.mark.parametrize("path", [
    "mfg.layers.2.rels.0.indptr",      # no such layer
    "mfg.layers.01.rels.0.indptr",     # not canonical
    "mfg.layers.-1.rels.0.indptr",
    "mfg.layers.\u0661.rels.0.indptr",  # a non-ASCII digit
    "mfg.layers.x.rels.0.indptr",
    "mfg.layers." + "1" * 5000 + ".rels.0.indptr",  # int() refuses so many digits
    "mfg.layers.0",                     # a struct, not a tensor
    "mfg.layers",
    "mfg.layers.0.num_src",             # a scalar
    "mfg.nodes.0.ids.more",             # past a tensor
    "mfg.nodes.0.feat.rows.0",
    "mfg..layers.0.rels.0.indptr",
    "mfg",
    "ids",
    "slot.pid",
    "",
], ids=lambda p: p[:32] or "empty")
def test_bad_nested_descriptor_path(path):
    frames = wire(chain_mfg(2))
    head = header_of(frames)
    head["d"][0][0] = path  # the first tensor (the input node ids) renamed
    assert error_code([msgpack.packb(head, use_bin_type=True), *frames[1:]]) == "bad_descriptor"


def test_descriptor_into_an_absent_optional_struct():
    frames = sample_frames()
    head = header_of(frames)
    head["d"].append(["slot.token", "int64", [1]])
    assert error_code([msgpack.packb(head, use_bin_type=True), *frames[1:],
                       b"\0" * 8]) == "bad_descriptor"


@dataclasses.dataclass
class _Deep5(Struct):
    x: int


@dataclasses.dataclass
class _Deep4(Struct):
    inner: _Deep5


@dataclasses.dataclass
class _Deep3(Struct):
    inner: list[_Deep4]


@dataclasses.dataclass
class _Deep2(Struct):
    inner: _Deep3 | None


@dataclasses.dataclass
class _Deep1(Struct):
    inner: _Deep2


@dataclasses.dataclass
class _Deep0(Message):
    inner: _Deep1


def test_struct_nesting_depth_is_bounded_on_the_classes():
    codec._schema(_Deep1)  # four levels below it: allowed
    with pytest.raises(TypeError, match="deeper"):
        codec._schema(_Deep0)
