"""FaStar `.fst` v2 (+ `.hc`, `.norm`, `.tid2eid` sidecars): read directly as a `WeightSource`, run by the
engine with the same outputs as its v3 conversion, converted by `fastar convert`, and every malformed or
incomplete input rejected with an error naming the file.

The v2 files come from `tests/fst_v2_writer.py` (an independent, test-side reading of the spec) applied to the
`tiny` official-format fixture, so every value can be checked against the checkpoint it came from.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import struct

import numpy as np
import pytest
from fst_v2_writer import ENTRY_FMT, HEADER_FMT, q8_0_encode, write_v2  # tests/ helper

from fastar.cli import main as cli_main
from fastar.convert.checkpoint import Checkpoint
from fastar.convert.hf import convert
from fastar.engine.engine import Engine, load, open_source
from fastar.errors import FormatError
from fastar.fixtures import write_checkpoint
from fastar.format.reader import FstFile, open_model_file
from fastar.format.v2 import FstV2File, read_version
from fastar.quant import reference as ref

IDS = [3, 17, 250, 999, 4, 4, 4, 61, 700, 12, 0, 1, 512, 300, 301, 302, 9, 88, 1023, 5, 6, 7, 8, 900]


@pytest.fixture(scope="module")
def ck(tiny_ckpt):
    return Checkpoint(tiny_ckpt)


@pytest.fixture(scope="module")
def v2_path(tiny_ckpt, tmp_path_factory):
    return write_v2(tiny_ckpt, tmp_path_factory.mktemp("v2") / "tiny.fst")


def fixture_overrides(cfg):
    """The fields a v2 file cannot carry, set to the fixture's values (v2 derives the rest)."""
    return {k: getattr(cfg, k) for k in ("sliding_window", "index_topk", "original_max_position_embeddings",
                                         "max_position_embeddings")}


def copy_model(src, dst_dir):
    """Copy a v2 model and its sidecars (to corrupt one without touching the shared fixture)."""
    dst = dst_dir / src.name
    for suffix in ("", ".hc", ".norm", ".tid2eid"):
        shutil.copyfile(f"{src}{suffix}", f"{dst}{suffix}")
    return dst


def ckpt_value(ck, name):
    """float32 value of an official tensor after dequantization."""
    dt, a = ck.dtype(name), ck.read(name)
    if dt == "F8_E4M3":
        return ref.fp8_block_dequant(a, ck.read(name[: -len("weight")] + "scale"))
    return ref.bf16_decode(a) if dt == "BF16" else a


def bf16_trunc(x):
    return ((np.asarray(x, np.float32).view(np.uint32) >> 16) << 16).view(np.float32)


# --- values ----------------------------------------------------------------------------------------------------

def test_tensors_and_experts_equal_the_checkpoint(ck, v2_path):
    with FstV2File(v2_path) as f:
        assert f.ignored == []
        assert len(f.names()) == len(set(f.names()))
        for name in f.names():
            got = f.tensor(name)
            want = ckpt_value(ck, name)
            if name.endswith("_fn"):  # HC mixes: F32 in the checkpoint, BF16 (truncated) in v2
                assert f.dtype(name) == "BF16"
                want = bf16_trunc(want)
            elif name.endswith("tid2eid"):
                assert f.dtype(name) == "I64" and got.dtype == np.int64
            elif ck.dtype(name) == "F8_E4M3":  # FP8 x power-of-two scale: exact in BF16
                assert f.dtype(name) == "BF16" and not f.has(name[: -len("weight")] + "scale")
            else:
                assert f.dtype(name) == ck.dtype(name), name
            value = ref.bf16_decode(got) if f.dtype(name) == "BF16" else got
            assert value.shape == want.shape and np.array_equal(value, want), name
        # the main file holds norms 40x too small (like the early converter): the norm sidecar wins
        assert np.array_equal(ref.bf16_decode(f.tensor("layers.3.ffn_norm.weight")),
                              ckpt_value(ck, "layers.3.ffn_norm.weight"))
        for slot in range(f.config.num_hidden_layers):
            for e in range(f.config.n_routed_experts):
                for u, v in zip(ck.expert(slot, e), f.expert(slot, e)):
                    assert u.dtype == v.dtype == np.uint8 and np.array_equal(u, v)
        with pytest.raises(FormatError, match="no expert"):
            f.expert(f.config.num_hidden_layers, 0)  # v2 has no MTP block


def test_config_from_header_ratios_and_shapes(ck, v2_path):
    with FstV2File(v2_path) as f:
        c = f.config
        assert c.num_mtp_layers == 0 and c.compress_ratios == ck.config.compress_ratios[:c.num_hidden_layers]
        assert c.num_hash_layers == ck.config.num_hash_layers == 2  # leading layers without a router bias
        assert (c.sliding_window, c.index_topk) == (128, 512)  # not in v2: the Flash values
        with FstV2File(v2_path, overrides=fixture_overrides(ck.config)) as g:
            assert g.config == dataclasses.replace(ck.config, num_mtp_layers=0, compress_ratios=c.compress_ratios)
        tok = f.tokenizer_json()
        assert tok is None or b"<\xef\xbd\x9cbegin\xe2\x96\x81of\xe2\x96\x81sentence\xef\xbd\x9c>" in tok


def test_q8_0_and_dense_mxfp4_storage_decode_exactly(ck, tmp_path):
    qt = {"layers.0.attn.wq_a.weight": "Q8_0", "head.weight": "MXFP4", "layers.1.ffn.gate.weight": "F32"}
    p = write_v2(ck, tmp_path / "q.fst", qtypes=qt)
    with FstV2File(p) as f:
        x = ckpt_value(ck, "layers.0.attn.wq_a.weight")
        raw = np.frombuffer(q8_0_encode(x), np.uint8)
        nb = x.size // 32
        want = (raw[2 * nb:].view(np.int8).reshape(nb, 32) * raw[:2 * nb].view(np.float16)[:, None].astype(np.float32))
        assert f.dtype("layers.0.attn.wq_a.weight") == "F32"
        assert np.array_equal(f.tensor("layers.0.attn.wq_a.weight"), want.reshape(x.shape))
        packed, scale = ref.fp4_encode(ckpt_value(ck, "head.weight"))
        assert np.array_equal(f.tensor("head.weight"), ref.fp4_decode(packed, scale))
        assert np.array_equal(f.tensor("layers.1.ffn.gate.weight"), ckpt_value(ck, "layers.1.ffn.gate.weight"))


# --- engine ----------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def v3_from_v2(v2_path, tmp_path_factory):
    return convert(v2_path, tmp_path_factory.mktemp("v3") / "from_v2.fst", progress=False)


@pytest.fixture(scope="module")
def v2_logits(v2_path):
    return load(v2_path).logits(IDS)


def test_convert_v2_to_v3_verifies_and_keeps_every_value(v2_path, v3_from_v2):
    with FstV2File(v2_path) as a, FstFile(v3_from_v2) as b:
        assert b.verify() == []
        assert b.config == a.config and b.names() == a.names()
        for name in a.names():
            assert b.dtype(name) == a.dtype(name) and np.array_equal(b.tensor(name), a.tensor(name)), name
        for slot in range(a.config.num_layer_slots):
            for e in range(a.config.n_routed_experts):
                assert all(np.array_equal(u, v) for u, v in zip(a.expert(slot, e), b.expert(slot, e)))
        assert b.tokenizer_json() == a.tokenizer_json()
        assert b.header["source"]["format"] == "FaStar .fst v2"


def test_cli_convert_dispatches_on_the_v2_magic(v2_path, tmp_path, capsys):
    out = tmp_path / "cli.fst"
    assert cli_main(["convert", str(v2_path), "-o", str(out), "--no-progress"]) == 0
    assert read_version(out) == 3 and read_version(v2_path) == 2
    assert cli_main(["verify", str(out)]) == 0
    capsys.readouterr()
    p = copy_model(v2_path, tmp_path)
    os.unlink(f"{p}.tid2eid")
    assert cli_main(["convert", str(p), "-o", str(tmp_path / "no.fst"), "--no-progress"]) == 1
    assert f"{p.name}.tid2eid: no such file" in capsys.readouterr().err
    assert not (tmp_path / "no.fst").exists() and not (tmp_path / "no.fst.partial").exists()


def test_v2_logits_equal_its_v3_conversion(v2_path, v3_from_v2, v2_logits):
    assert isinstance(open_source(v2_path), FstV2File) and isinstance(open_model_file(v3_from_v2), FstFile)
    assert np.array_equal(v2_logits, load(v3_from_v2).logits(IDS))


def test_v2_logits_equal_the_checkpoint_up_to_bf16_hc(ck, v2_path):
    """The whole mapping at once: with the fixture's window/top-k (so the indexer selects) and the checkpoint's
    HC mixes truncated to BF16 as v2 stores them, the torch path gives bit-identical logits (FP8 x scale and its
    BF16 copy widen to the same float32 weights)."""

    class TruncatedHC:
        config = ck.config

        def has(self, n):
            return ck.has(n)

        def dtype(self, n):
            return ck.dtype(n)

        def tensor(self, n):
            return bf16_trunc(ck.tensor(n)) if n.endswith("_fn") else ck.tensor(n)

        def expert(self, slot, e):
            return ck.expert(slot, e)

        def tokenizer_json(self):
            return None

    v2 = FstV2File(v2_path, overrides=fixture_overrides(ck.config))
    a = load(v2, numerics="reference", kernels=False).logits(IDS)
    assert np.array_equal(a, load(TruncatedHC(), numerics="reference", kernels=False).logits(IDS))


def test_v2_through_the_expert_pager(v2_path, v2_logits):
    from fastar.weights.expert_cache import ExpertCache

    f = FstV2File(v2_path)
    cache = ExpertCache(f, ram_budget_bytes=4 * f.expert_stride, io_threads=1)
    try:
        assert np.array_equal(load(f, experts=cache).logits(IDS), v2_logits)
    finally:
        cache.close()


# --- errors ----------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["hc", "norm", "tid2eid"])
def test_missing_sidecar_names_the_file(v2_path, tmp_path, kind):
    p = copy_model(v2_path, tmp_path)
    os.unlink(f"{p}.{kind}")
    with pytest.raises(FormatError, match=rf"{p.name}\.{kind}: no such file"):
        FstV2File(p)


@pytest.mark.parametrize("kind,cut", [("tid2eid", 4), ("hc", 5000), ("norm", 3000), ("norm", 4096 * 10)])
def test_short_sidecar_names_the_file(v2_path, tmp_path, kind, cut):
    p = copy_model(v2_path, tmp_path)
    side = f"{p}.{kind}"
    os.truncate(side, os.path.getsize(side) - cut)
    with pytest.raises(FormatError, match=rf"{p.name}\.{kind}.*(truncated|expected)"):
        FstV2File(p)


def test_tid2eid_out_of_range_expert(v2_path, tmp_path):
    p = copy_model(v2_path, tmp_path)
    t = np.fromfile(f"{p}.tid2eid", "<i4")
    t[5] = 8  # the fixture has 8 experts
    t.tofile(f"{p}.tid2eid")
    with pytest.raises(FormatError, match=r"tid2eid: expert ids outside"):
        FstV2File(p)


@pytest.mark.parametrize("where", ["header", "directory", "data", "bank", "ragged"])
def test_truncated_main_file(v2_path, tmp_path, where):
    p = copy_model(v2_path, tmp_path)
    size = os.path.getsize(p)
    cut = {"header": 100, "directory": 4096, "data": 40960, "bank": size - 4096, "ragged": size - 10}[where]
    os.truncate(p, cut)
    with pytest.raises(FormatError, match=rf"{p.name}: .*(truncated|too short)"):
        FstV2File(p)


def test_missing_indexer_is_listed_not_guessed(ck, tmp_path):
    p = write_v2(ck, tmp_path / "noidx.fst", indexer=False)
    with pytest.raises(FormatError, match=r"lacks 12 tensor\(s\).*layers\.\{1,3\}\.attn\.indexer\.wq_b\.weight.*never wrote"):
        FstV2File(p)


def test_without_compress_ratios_the_flash_pattern_is_assumed_and_checked(ck, tmp_path):
    p = write_v2(ck, tmp_path / "noratio.fst", drop={"compress_ratios"})  # fixture ratios are 0, 4, 128, 4, 0
    with pytest.raises(FormatError, match=r"layers\.\{4\}\.attn\.compressor"):
        FstV2File(p)
    flash_like = write_checkpoint(tmp_path / "ck", "tiny", seed=2, tokenizer=False, compress_ratios=[0, 0, 4, 128, 4, 0])
    q = write_v2(flash_like, tmp_path / "flashlike.fst", drop={"compress_ratios"})
    with FstV2File(q) as f:
        assert f.config.compress_ratios == (0, 0, 4, 128, 4)


def test_tensor_missing_from_the_norm_sidecar(ck, tmp_path):
    p = write_v2(ck, tmp_path / "nonorm.fst", drop={"layers.3.attn_norm.weight"})
    with pytest.raises(FormatError, match=r"layers\.\{3\}\.attn_norm\.weight.*nonorm\.fst\.norm"):
        FstV2File(p)


def _patch_entry(path, match, **fields):
    """Rewrite the first directory entry whose (tid, layer, sub) equals `match`."""
    with open(path, "r+b") as f:
        h = struct.unpack(HEADER_FMT, f.read(struct.calcsize(HEADER_FMT)))
        dir_off, count = h[15], h[16]
        for i in range(count):
            f.seek(dir_off + 64 * i)
            e = list(struct.unpack(ENTRY_FMT, f.read(64)))
            if tuple(e[:3]) == match:
                for k, v in fields.items():
                    e[{"tid": 0, "layer": 1, "sub": 2, "qtype": 3, "nbytes": 10}[k]] = v
                f.seek(dir_off + 64 * i)
                f.write(struct.pack(ENTRY_FMT, *e))
                return
    raise AssertionError(f"no entry {match}")


def test_duplicate_entry_rejected(v2_path, tmp_path):
    p = copy_model(v2_path, tmp_path)
    _patch_entry(p, (5, 2, 1), sub=0)  # wq_b written as sub 0, like FaStar's legacy state-dict path
    with pytest.raises(FormatError, match=r"duplicate directory entry TID 5 sub 0 \(layer 2\)"):
        FstV2File(p)


def test_entry_size_and_shape_checked(v2_path, tmp_path):
    p = copy_model(v2_path, tmp_path)
    _patch_entry(p, (6, 1, 0), qtype=3)
    with pytest.raises(FormatError, match=r"TID 6 sub 0 \(layer 1\).* do not match F32"):
        FstV2File(p)


@pytest.mark.parametrize("header,msg", [
    ({"qh": 64, "kh": 8, "hd2": 128}, "Hunyuan-3.0"),
    ({"qh": 24, "kh": 4, "hd2": 256}, "Qwen3.5"),
    ({"eb": 1000}, "expert block of 1000 B"),
    ({"qh": 16}, "header says 16 heads"),
])
def test_header_checks(ck, tmp_path, header, msg):
    p = write_v2(ck, tmp_path / "h.fst", header=header)
    with pytest.raises(FormatError, match=msg):
        FstV2File(p)


def test_not_v2(tmp_path, tiny_ckpt):
    bad = tmp_path / "x.fst"
    bad.write_bytes(b"FST\x00" + struct.pack("<I", 7) + b"\0" * 200)
    with pytest.raises(FormatError, match="version 7, expected 2"):
        FstV2File(bad)
    assert read_version(bad) == 7 and read_version(tiny_ckpt / "config.json") is None
    with pytest.raises(FormatError, match="is a directory"):
        FstV2File(tiny_ckpt)


@pytest.mark.skipif(not hasattr(Engine, "stats"), reason="Engine.stats (used by `fastar run`) is not written yet")
def test_fastar_run_on_a_v2_file_equals_its_conversion(vocab_ckpt, tmp_path, capsys):
    v2 = write_v2(vocab_ckpt, tmp_path / "vocab.fst")
    v3 = convert(v2, tmp_path / "vocab3.fst", progress=False)
    outs = []
    for model in (v2, v3):
        assert cli_main(["run", "-m", str(model), "-p", "Hello", "-n", "4", "--temp", "0"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()
