"""The .fst v3 container: write -> read round trip, structural rejection, corruption, header fuzzing."""

from __future__ import annotations

import json
import os
import struct

import numpy as np
import pytest
import xxhash
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastar.config import ModelConfig
from fastar.errors import FastarError, FormatError
from fastar.format import spec
from fastar.format.reader import FstFile
from fastar.format.writer import FstWriter, WriterState

CFG = ModelConfig(
    vocab_size=100,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    head_dim=32,
    qk_rope_head_dim=8,
    q_lora_rank=16,
    o_lora_rank=16,
    o_groups=2,
    n_routed_experts=3,
    num_experts_per_tok=2,
    compress_ratios=(0, 4, 0),
    num_hash_layers=1,
    index_n_heads=4,
    index_head_dim=16,
    index_topk=2,
)
SHAPES = [(32, 32), (32, 2), (32, 32), (32, 2), (64, 16), (64, 1)]


def _expert(rng, slot, e):
    return [rng.integers(0, 256, s, dtype=np.uint8) for s in SHAPES]


def write_sample(path, seed=0):
    rng = np.random.default_rng(seed)
    tensors = {
        "embed.weight": ("BF16", rng.integers(0, 65535, (100, 64), dtype=np.uint16)),
        "layers.0.attn.wq_a.weight": ("F8_E4M3", rng.integers(0, 255, (16, 64), dtype=np.uint8)),
        "layers.0.attn.wq_a.scale": ("F8_E8M0", rng.integers(120, 130, (1, 1), dtype=np.uint8)),
        "hc_head_base": ("F32", rng.standard_normal(4).astype(np.float32)),
        "layers.0.ffn.gate.tid2eid": ("I64", rng.integers(0, 3, (100, 2), dtype=np.int64)),
    }
    experts = {(s, e): _expert(rng, s, e) for s in range(3) for e in range(3)}
    w = FstWriter(path, CFG.to_dict(), source={"test": True})
    for n, (dt, a) in tensors.items():
        w.add_tensor(n, dt, a.shape)
    w.add_blob("tokenizer.json", 5)
    w.set_expert_bank(3, 3, 64, 32)
    w.begin()
    for n, (dt, a) in tensors.items():
        w.write_tensor(n, a)
    w.write_tensor("tokenizer.json", b"hello")
    for (s, e), parts in experts.items():
        w.write_expert(s, e, parts)
    w.finish()
    return tensors, experts


def test_round_trip(tmp_path):
    p = tmp_path / "m.fst"
    tensors, experts = write_sample(p)
    assert not (tmp_path / "m.fst.partial").exists()
    with FstFile(p) as f:
        assert f.config == CFG
        for n, (dt, a) in tensors.items():
            assert f.dtype(n) == dt
            np.testing.assert_array_equal(f.tensor(n), a)
        for (s, e), parts in experts.items():
            got = f.expert(s, e)
            for g, want in zip(got, parts):
                np.testing.assert_array_equal(g, want)
            buf = bytearray(f.expert_stride)
            for g, want in zip(f.read_expert_into(s, e, buf), parts):
                np.testing.assert_array_equal(g, want)
        assert f.tokenizer_json() == b"hello"
        assert f.verify() == []
        # every region is page-aligned and the file has no holes
        for label, off, n, _ in f.regions():
            assert off % spec.ALIGN == 0
        assert os.path.getsize(p) % spec.ALIGN == 0


def test_o_direct_read(tmp_path):
    import mmap

    p = tmp_path / "m.fst"
    _, experts = write_sample(p)
    with FstFile(p) as f:
        fd = f.open_direct()
        if fd is None:
            pytest.skip("O_DIRECT not supported on this filesystem")
        try:
            buf = mmap.mmap(-1, f.expert_stride)  # page-aligned, as O_DIRECT requires
            got = f.read_expert_into(2, 1, buf, fd=fd)
            np.testing.assert_array_equal(got.w2, experts[(2, 1)][4])
        finally:
            os.close(fd)


def test_flash_expert_geometry():
    secs = spec.expert_sections(4096, 2048)
    assert [s["nbytes"] for s in secs] == [4 << 20, 256 << 10] * 3
    assert spec.expert_stride(secs) == 13_369_344 == 3264 * 4096


def test_writer_state_machine(tmp_path):
    w = FstWriter(tmp_path / "x.fst", CFG.to_dict())
    w.add_tensor("a", "F32", [2])
    with pytest.raises(FastarError):
        w.write_tensor("a", np.zeros(2, np.float32))  # before begin()
    with pytest.raises(FormatError):
        w.add_tensor("a", "F32", [2])  # duplicate
    w.begin()
    with pytest.raises(FastarError):
        w.add_tensor("b", "F32", [2])
    with pytest.raises(FormatError):
        w.write_tensor("a", np.zeros(3, np.float32))
    with pytest.raises(FastarError):
        w.finish()  # "a" never written
    assert w.state is WriterState.ABORTED
    assert not (tmp_path / "x.fst").exists() and not (tmp_path / "x.fst.partial").exists()


def test_interrupted_write_leaves_nothing_complete(tmp_path):
    p = tmp_path / "x.fst"
    with pytest.raises(RuntimeError), FstWriter(p, CFG.to_dict()) as w:
        w.add_tensor("a", "F32", [2])
        w.begin()
        raise RuntimeError("killed")
    assert not p.exists() and not (tmp_path / "x.fst.partial").exists()


def test_partial_file_is_rejected(tmp_path):
    p = tmp_path / "x.fst"
    w = FstWriter(p, CFG.to_dict())
    w.add_tensor("a", "F32", [1024])
    w.begin()
    w.write_tensor("a", np.ones(1024, np.float32))
    # simulate a crash: the .partial exists, with placeholder checksums
    part = tmp_path / "x.fst.partial"
    w._f.flush()
    with FstFile(part) as f:
        assert f.verify() == ["a"]
    w.abort()


def _corrupt(p, offset, data=None):
    with open(p, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]) if data is None else data)


def test_corruption_named(tmp_path):
    p = tmp_path / "m.fst"
    write_sample(p)
    with FstFile(p) as f:
        t_off = next(t["offset"] for t in f.header["tensors"] if t["name"] == "hc_head_base")
        e_off = f.expert_offset(1, 2) + 100
    _corrupt(p, t_off + 3)
    with FstFile(p) as f:
        assert f.verify() == ["hc_head_base"]
    _corrupt(p, t_off + 3)  # undo
    _corrupt(p, e_off)
    with FstFile(p) as f:
        assert f.verify() == ["expert (layer 1, id 2)"]


def test_header_flip_detected(tmp_path):
    p = tmp_path / "m.fst"
    write_sample(p)
    _corrupt(p, spec.PREAMBLE_SIZE + 40)
    with pytest.raises(FormatError, match="header checksum"):
        FstFile(p)


@pytest.mark.parametrize("cut", [0, 10, 63, 64, 200, 4096, 5000, -1])
def test_truncation(tmp_path, cut):
    p = tmp_path / "m.fst"
    write_sample(p)
    size = os.path.getsize(p)
    os.truncate(p, size - 1 if cut == -1 else cut)
    with pytest.raises(FormatError, match=r"too short|truncated"):
        FstFile(p)


def test_not_fst(tmp_path):
    p = tmp_path / "x.fst"
    p.write_bytes(b"PK\x03\x04" + b"\0" * 100)
    with pytest.raises(FormatError, match=r"not a \.fst"):
        FstFile(p)
    with pytest.raises(FormatError, match="directory"):
        FstFile(tmp_path)


def _rewrite_header(p, mutate):
    """Rewrite the header JSON (with a valid checksum) to test the structural rules."""
    with open(p, "rb") as f:
        magic, ver, hlen, _, data_off, fsize = struct.unpack(spec.PREAMBLE_FMT, f.read(spec.PREAMBLE_SIZE))
        h = json.loads(f.read(hlen))
    mutate(h)
    hb = json.dumps(h, separators=(",", ":")).encode()
    assert spec.PREAMBLE_SIZE + len(hb) <= data_off
    hb = hb + b" " * (hlen - len(hb)) if len(hb) < hlen else hb
    with open(p, "r+b") as f:
        f.write(struct.pack(spec.PREAMBLE_FMT, magic, ver, len(hb), xxhash.xxh64_intdigest(hb), data_off, fsize))
        f.write(hb)


@pytest.mark.parametrize(
    "mutate,msg",
    [
        (lambda h: h["tensors"][1].update(offset=h["tensors"][1]["offset"] + 4096), "hole"),
        (lambda h: h["tensors"][1].update(offset=h["tensors"][0]["offset"]), "overlaps"),
        (lambda h: h["tensors"][1].update(name=h["tensors"][0]["name"]), "duplicate"),
        (lambda h: h["tensors"][0].update(shape=[100, 65]), "do not match"),
        (lambda h: h["tensors"][0].update(dtype="F16"), "unknown dtype"),
        (lambda h: h["experts"].update(slots=99), "checksums missing"),
        (lambda h: h["experts"].update(stride=h["experts"]["stride"] * 2), "end at"),
        (lambda h: h["config"].update(hidden_size=-1), "hidden_size"),
        (lambda h: h.update(version=4), "v3"),
        # `fastar inspect` read `converter` as a dict: a list was an AttributeError traceback, none a KeyError
        (lambda h: h.update(converter=[]), "'converter' missing or not a dict"),
        (lambda h: h.pop("converter"), "'converter' missing or not a dict"),
    ],
)
def test_structural_rules(tmp_path, mutate, msg):
    p = tmp_path / "m.fst"
    write_sample(p)
    _rewrite_header(p, mutate)
    with pytest.raises(FormatError, match=msg):
        FstFile(p)


def test_extent_past_eof(tmp_path):
    p = tmp_path / "m.fst"
    write_sample(p)
    size = os.path.getsize(p)

    def grow(h):
        h["experts"]["offset"] = size + 4096

    _rewrite_header(p, grow)
    with pytest.raises(FormatError):
        FstFile(p)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    data=st.binary(max_size=300),
    hlen=st.integers(0, 2**64 - 1),
    data_off=st.integers(0, 2**64 - 1),
    fsize=st.integers(0, 2**64 - 1),
    use_json=st.booleans(),
    ver=st.sampled_from([3, 2, 0, 2**32 - 1]),
)
def test_header_parser_fuzz(tmp_path_factory, data, hlen, data_off, fsize, use_json, ver):
    """Whatever the preamble and header hold, the reader raises FormatError and nothing else."""
    p = tmp_path_factory.mktemp("fz") / "f.fst"
    if use_json:
        hlen = len(data)
        data_off = spec.align(spec.PREAMBLE_SIZE + hlen)
        fsize = data_off
    pre = struct.pack(spec.PREAMBLE_FMT, spec.MAGIC, ver, hlen, xxhash.xxh64_intdigest(data), data_off, fsize)
    p.write_bytes((pre + data).ljust(data_off if use_json else 0, b"\0"))
    try:
        FstFile(p).close()
    except FormatError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.text(max_size=5),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    key=st.sampled_from(["tensors", "blobs", "experts", "config", "source", "format"]),
    value=json_values,
    idx=st.integers(0, 4),
    field=st.sampled_from(["name", "dtype", "shape", "offset", "nbytes", "xxh64", "sections", "stride", "slots"]),
)
def test_header_semantic_fuzz(tmp_path_factory, key, value, idx, field):
    """Valid JSON with wrong types or values anywhere is a FormatError, never a crash."""
    p = tmp_path_factory.mktemp("fz") / "m.fst"
    write_sample(p)

    def mutate(h):
        tgt = h.get(key)
        if isinstance(tgt, list) and tgt:
            e = tgt[idx % len(tgt)]
            if isinstance(e, dict):
                e[field] = value
            else:
                tgt[idx % len(tgt)] = value
        elif isinstance(tgt, dict):
            tgt[field] = value
        else:
            h[key] = value

    try:
        _rewrite_header(p, mutate)
    except AssertionError:
        return  # header grew past its reserved space: not a case this test can build
    try:
        FstFile(p).close()
    except FormatError:
        pass


@pytest.mark.parametrize("header", [b"[" * 100_000, b'{"a": ' + b"9" * 5000 + b"}"])
def test_a_header_json_cannot_take_is_a_format_error(tmp_path, header):
    """A header that passes its checksum but nests deeper than the json module recurses, or holds a number of more
    digits than Python converts, ended `fastar verify`/`run` in a RecursionError or ValueError traceback."""
    p = tmp_path / "f.fst"
    data_off = spec.align(spec.PREAMBLE_SIZE + len(header))
    digest = xxhash.xxh64_intdigest(header)
    pre = struct.pack(spec.PREAMBLE_FMT, spec.MAGIC, spec.VERSION, len(header), digest, data_off, data_off)
    p.write_bytes((pre + header).ljust(data_off, b"\0"))
    with pytest.raises(FormatError, match="header is not valid JSON"):
        FstFile(p)
