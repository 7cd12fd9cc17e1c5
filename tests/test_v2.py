"""FaStar `.fst` v2 (+ `.hc`, `.norm`, `.tid2eid` sidecars): read directly as a `WeightSource`, run by the
engine with the same outputs as its v3 conversion, converted by `fastar convert`, and every malformed or
incomplete input rejected with an error naming the file. Without the lightning indexer (as FaStar wrote them):
exact up to a capped context, refused past it; with the `.fst.indexer` sidecar `fastar convert --indexer-sidecar`
writes from the checkpoint's indexer shards: the full model, carried into v3 by `fastar convert`.

The v2 files come from `tests/fst_v2_writer.py` (an independent, test-side reading of the spec) applied to the
`tiny` official-format fixture, so every value can be checked against the checkpoint it came from.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import shutil
import struct

import numpy as np
import pytest
import torch
from fst_v2_writer import ENTRY_FMT, HEADER_FMT, q8_0_encode, write_v2  # tests/ helper

from fastar.cli import main as cli_main
from fastar.contracts import WeightSource
from fastar.convert.checkpoint import Checkpoint
from fastar.convert.hf import convert, convert_indexer
from fastar.convert.names import expected_tensors
from fastar.convert.v2 import FstV2File, open_model_file, read_version
from fastar.engine.engine import Engine, load, open_source
from fastar.engine.session import PromptError
from fastar.errors import FastarError, FormatError
from fastar.fixtures import write_checkpoint
from fastar.format import spec
from fastar.format.reader import FstFile
from fastar.model.deepseek_v4 import Indexer
from fastar.model.state import LayerState
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
    return {
        k: getattr(cfg, k)
        for k in ("sliding_window", "index_topk", "original_max_position_embeddings", "max_position_embeddings")
    }


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
        assert np.array_equal(
            ref.bf16_decode(f.tensor("layers.3.ffn_norm.weight")), ckpt_value(ck, "layers.3.ffn_norm.weight")
        )
        for slot in range(f.config.num_hidden_layers):
            for e in range(f.config.n_routed_experts):
                for u, v in zip(ck.expert(slot, e), f.expert(slot, e)):
                    assert u.dtype == v.dtype == np.uint8 and np.array_equal(u, v)
        with pytest.raises(FormatError, match="no expert"):
            f.expert(f.config.num_hidden_layers, 0)  # v2 has no MTP block


def test_config_from_header_ratios_and_shapes(ck, v2_path):
    with FstV2File(v2_path) as f:
        c = f.config
        assert c.num_mtp_layers == 0 and c.compress_ratios == ck.config.compress_ratios[: c.num_hidden_layers]
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
        want = raw[2 * nb :].view(np.int8).reshape(nb, 32) * raw[: 2 * nb].view(np.float16)[:, None].astype(np.float32)
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


def test_bench_refuses_a_v2_file_naming_the_conversion(v2_path, tiny_fst_path, tmp_path, capsys):
    """`bench -m` (and --compare) on a v2 file: one line naming the file and the convert command, no traceback."""
    assert cli_main(["bench", "-m", str(v2_path), "--decode-tokens", "1"]) == 1
    err = capsys.readouterr().err
    assert f"-m {v2_path}: a FaStar v2 file" in err and f"fastar convert {v2_path} -o NEW.fst" in err
    assert "Traceback" not in err and err.count("\n") == 1
    assert cli_main(["bench", "-m", str(tiny_fst_path), "--compare", str(v2_path)]) == 1
    assert f"--compare {v2_path}: a FaStar v2 file" in capsys.readouterr().err


def test_v2_logits_equal_its_v3_conversion(v2_path, v3_from_v2, v2_logits):
    assert isinstance(open_source(v2_path), FstV2File) and isinstance(open_model_file(v3_from_v2), FstFile)
    assert np.array_equal(v2_logits, load(v3_from_v2).logits(IDS))


class TruncatedHC(WeightSource):
    """A weight source with its HC mixes truncated to BF16, as v2 stores them (built in memory: no `path`)."""

    def __init__(self, src):
        self.src, self.config, self.path = src, src.config, None

    def names(self):
        return self.src.names()

    def has(self, n):
        return self.src.has(n)

    def dtype(self, n):
        return self.src.dtype(n)

    def tensor(self, n):
        return bf16_trunc(self.src.tensor(n)) if n.endswith("_fn") else self.src.tensor(n)

    def expert(self, slot, e):
        return self.src.expert(slot, e)

    def tokenizer_json(self):
        return None


def reference_logits(source, ids):
    """The torch path in reference numerics, where FP8 x scale and its BF16 copy widen to the same weights."""
    return load(source, numerics="reference", kernels=False).logits(ids)


def test_v2_logits_equal_the_checkpoint_up_to_bf16_hc(ck, v2_path):
    """The whole mapping at once: with the fixture's window/top-k (so the indexer selects) and the checkpoint's
    HC mixes truncated to BF16 as v2 stores them, the torch path gives bit-identical logits (FP8 x scale and its
    BF16 copy widen to the same float32 weights)."""
    v2 = FstV2File(v2_path, overrides=fixture_overrides(ck.config))
    assert np.array_equal(reference_logits(v2, IDS), reference_logits(TruncatedHC(ck), IDS))


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


@pytest.mark.parametrize("kind", ["hc", "norm"])
def test_a_sidecar_that_is_a_fifo_is_named_instead_of_blocking(v2_path, tmp_path, kind):
    """A `.hc` or `.norm` sidecar that is a FIFO blocked the open forever, waiting for a writer (the model file
    itself was checked, its sidecars not). The open runs on a thread joined with a bound: a hang is a failure."""
    from fifo_helpers import call_bounded

    p = copy_model(v2_path, tmp_path)
    side = f"{p}.{kind}"
    os.unlink(side)
    os.mkfifo(side)
    errors, hung = call_bounded(lambda: FstV2File(p), side)
    assert not hung, f"opening a v2 model whose .{kind} sidecar is a FIFO blocked"
    assert len(errors) == 1 and isinstance(errors[0], FormatError), errors
    assert str(errors[0]) == f"{side}: not a regular file"


def test_a_tokenizer_that_is_a_fifo_is_refused_instead_of_blocking(v2_path, tmp_path):
    """`tokenizer=` naming a FIFO was kept and read later, blocking that read forever waiting for a writer; it is
    refused when the model is opened, in one line. A missing one too (it was a FileNotFoundError at the read)."""
    from fifo_helpers import call_bounded

    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)

    def open_and_read():
        with FstV2File(v2_path, tokenizer=fifo) as src:
            src.tokenizer_json()

    errors, hung = call_bounded(open_and_read, fifo)
    assert not hung, "a v2 model given a FIFO as its tokenizer blocked"
    assert len(errors) == 1 and isinstance(errors[0], FormatError), errors
    assert str(errors[0]) == f"{fifo}: not a regular file (the tokenizer to serve)"
    with pytest.raises(FormatError, match=r"missing\.json: no such file \(the tokenizer to serve\)$"):
        FstV2File(v2_path, tokenizer=tmp_path / "missing.json")


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


def test_without_compress_ratios_the_flash_pattern_is_assumed_and_checked(ck, tmp_path):
    p = write_v2(ck, tmp_path / "noratio.fst", drop={"compress_ratios"})  # fixture ratios are 0, 4, 128, 4, 0
    with pytest.raises(FormatError, match=r"layers\.\{4\}\.attn\.compressor"):
        FstV2File(p)
    flash_like = write_checkpoint(
        tmp_path / "ck", "tiny", seed=2, tokenizer=False, compress_ratios=[0, 0, 4, 128, 4, 0]
    )
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


@pytest.mark.parametrize(
    "header,msg",
    [
        ({"qh": 64, "kh": 8, "hd2": 128}, "Hunyuan-3.0"),
        ({"qh": 24, "kh": 4, "hd2": 256}, "Qwen3.5"),
        ({"eb": 1000}, "expert block of 1000 B"),
        ({"qh": 16}, "header says 16 heads"),
    ],
)
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


def test_fastar_run_on_a_v2_file_equals_its_conversion(vocab_ckpt, tmp_path, capsys):
    v2 = write_v2(vocab_ckpt, tmp_path / "vocab.fst")
    v3 = convert(v2, tmp_path / "vocab3.fst", progress=False)
    outs = []
    for model in (v2, v3):
        assert cli_main(["run", "-m", str(model), "-p", "Hello", "-n", "4", "--temp", "0"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()


# --- the lightning indexer: absent (as in the real release), and its `.fst.indexer` sidecar ----------------------
# The fixture has index_topk 4: without the indexer a v2 model with the fixture's values runs 4 * 4 + 3 = 19
# positions (query t sees (t+1)//4 compressed entries: all of them are picked up to t = 18).

CAP = 19


def indexer_names(cfg):
    return [n for n in expected_tensors(cfg) if ".attn.indexer." in n]


@pytest.fixture(scope="module")
def noidx_path(ck, tmp_path_factory):
    return write_v2(ck, tmp_path_factory.mktemp("noidx") / "noidx.fst", indexer=False)


@pytest.fixture(scope="module")
def ck_v3(tiny_ckpt, tmp_path_factory):
    return FstFile(convert(tiny_ckpt, tmp_path_factory.mktemp("ckv3") / "ck.fst", progress=False))


@pytest.fixture(scope="module")
def indexer_shards_only(tiny_ckpt, tmp_path_factory):
    """The checkpoint as a user who downloads only what the sidecar needs has it: config, index, indexer shards."""
    d = tmp_path_factory.mktemp("partial")
    wm = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    shards = sorted({s for n, s in wm.items() if ".attn.indexer." in n})
    assert len(shards) < len(set(wm.values()))  # the fixture has a shard without any
    for name in ["config.json", "model.safetensors.index.json"] + shards:
        shutil.copyfile(tiny_ckpt / name, d / name)
    return d


@pytest.fixture(scope="module")
def with_sidecar(noidx_path, indexer_shards_only, tmp_path_factory):
    """The indexer-less v2 model plus `X.fst.indexer` written by the CLI from the partial checkpoint."""
    p = copy_model(noidx_path, tmp_path_factory.mktemp("sidecar"))
    assert (
        cli_main(["convert", str(indexer_shards_only), "--indexer-sidecar", "-o", f"{p}.indexer", "--no-progress"]) == 0
    )
    return p


def test_without_the_indexer_the_model_opens_with_a_capped_context(ck, noidx_path):
    with FstV2File(noidx_path) as f:
        assert not any(".attn.indexer." in n for n in f.names()) and f.ignored == []
        assert f"{noidx_path} has no lightning-indexer weights" in f.context_note
        assert f"--indexer-sidecar -o {noidx_path}.indexer" in f.context_note
    e = load(noidx_path)
    assert e.model.max_positions == e.context_length == 4 * 512 + 3  # Flash's index_topk: 2051
    assert all(b.attn.indexer is None for b in e.model.layers)
    e = load(FstV2File(noidx_path, overrides=fixture_overrides(ck.config)))
    assert e.context_length == CAP
    e.context_length = 100  # asking for more does not lift it
    assert e.context_length == CAP and "capped at 19 tokens" in e.context_note


def test_a_partial_indexer_is_still_an_error(ck, tmp_path):
    p = write_v2(ck, tmp_path / "part.fst", drop={"layers.3.attn.indexer.weights_proj.weight"})
    with pytest.raises(FormatError, match=r"lacks 1 tensor\(s\).*layers\.\{3\}\.attn\.indexer\.weights_proj\.weight"):
        FstV2File(p)


def test_within_the_cap_the_logits_equal_the_v3_conversion_bit_for_bit(ck, noidx_path, v2_logits, ck_v3):
    # default numerics and config (index_topk 512): equal to the same v2 model with the indexer
    assert np.array_equal(load(noidx_path).logits(IDS), v2_logits)
    # the fixture's top-k, so 19 positions are the most: equal to the full v3 conversion of the checkpoint
    v2 = FstV2File(noidx_path, overrides=fixture_overrides(ck.config))
    assert np.array_equal(reference_logits(v2, IDS[:CAP]), reference_logits(TruncatedHC(ck_v3), IDS[:CAP]))


def test_within_the_cap_every_visible_entry_is_what_the_indexer_selects(ck_v3, monkeypatch):
    model = load(ck_v3, numerics="reference", kernels=False).model
    cfg, attn = model.config, model.layers[1].attn  # a ratio-4 layer with its indexer
    g = torch.Generator().manual_seed(0)
    x, qr = torch.randn(CAP + 1, cfg.hidden_size, generator=g), torch.randn(CAP + 1, cfg.q_lora_rank, generator=g)
    state = LayerState.new(4, cfg.sliding_window, cfg.head_dim, cfg.index_head_dim)
    for p0, p1 in ((0, 7), (7, 8), (8, CAP)):  # chunked prefill, one decode step: never more than top-k visible
        assert attn.indexer(x[p0:p1], qr[p0:p1], p0, state) is None
    keys = state.idx_entries.all()  # [E, Di], E = 4 = index_topk
    queries = attn.indexer.queries(x[:CAP], qr[:CAP], torch.arange(CAP))
    sel = attn.indexer.pick(*queries, 0, keys)  # -1: a pick not visible yet
    k = sel.shape[1]
    for t in range(CAP):
        visible = (t + 1) // 4
        picks = sel[t][sel[t] >= 0].tolist()
        assert sorted(picks) == list(range(visible)) and (sel[t] == -1).sum() == k - visible
        # the mask Attention uses instead: the same entries, and every masked one is one the indexer drops
        assert (torch.arange(keys.shape[0]) < visible).tolist() == [w in picks for w in range(keys.shape[0])]
    assert attn.indexer(x[CAP:], qr[CAP:], CAP, state) is not None  # position 19 sees 5 entries: it must score
    # the whole model with scores computed anyway: the same logits, bit for bit (the picks come out in ascending
    # entry order, the order attention takes every visible entry in without scoring; leaving one entry out changes
    # them by ~1)
    short = model.forward(IDS[:CAP], model.new_state())[0]
    monkeypatch.setattr(Indexer, "scores", lambda self, stop: True)  # score every chunk, whatever it sees
    picks = []
    pick = Indexer.pick
    monkeypatch.setattr(Indexer, "pick", lambda self, *a: picks.append(1) or pick(self, *a))
    scored = model.forward(IDS[:CAP], model.new_state())[0]
    assert picks  # the scoring path did run
    assert torch.equal(scored, short)


def test_past_the_cap_a_clear_error(ck, noidx_path):
    e = load(FstV2File(noidx_path, overrides=fixture_overrides(ck.config)))
    why = rf"{noidx_path.name} has no lightning-indexer weights.*--indexer-sidecar -o \S*{noidx_path.name}\.indexer"
    with pytest.raises(PromptError, match=rf"the context length is 19 tokens.*capped at 19 tokens: \S*{why}"):
        list(e.stream(IDS[: CAP + 1], max_tokens=1))
    with pytest.raises(PromptError, match=rf"the prompt is 24 tokens, but the context length is 19 tokens.*{why}"):
        e.logits(IDS)
    # a generation stops at the context, as the session path does
    assert len(e.generate_tokens(IDS[: CAP - 4], max_tokens=10, ignore_eos=True)) == 4
    *_, last = e.stream(IDS[: CAP - 4], max_tokens=10, ignore_eos=True)
    assert last.finish_reason == "length" and last.usage["completion_tokens"] == 4
    with pytest.raises(FastarError, match=r"position 23 needs layers\.1\.attn\.indexer"):  # the model itself
        e.model.forward(IDS, e.model.new_state())


def test_indexer_sidecar_holds_only_the_indexer_in_checkpoint_precision(ck, with_sidecar):
    with FstFile(f"{with_sidecar}.indexer") as f:
        assert f.bank is None and f.verify() == []
        assert f.names() == indexer_names(ck.config)
        for n in f.names():
            assert f.dtype(n) == spec.FROM_SAFETENSORS[ck.dtype(n)] and np.array_equal(f.tensor(n), ck.read(n)), n
    with FstV2File(with_sidecar) as v2:
        assert v2.context_note is None and v2.dtype("layers.1.attn.indexer.wq_b.weight") == "F8_E4M3"
        assert (v2.config.index_n_heads, v2.config.index_head_dim, v2.config.index_topk) == (
            ck.config.index_n_heads,
            ck.config.index_head_dim,
            4,
        )  # from the sidecar: v2 has no index_topk
        assert set(indexer_names(ck.config)) <= set(v2.names())
        assert f"{with_sidecar.name}.indexer" in [x["name"] for x in v2.identity()["files"]]


def test_with_the_sidecar_the_logits_equal_the_v3_conversion_past_the_cap(ck, with_sidecar, ck_v3):
    e = load(with_sidecar)
    assert e.model.max_positions is None and e.context_note is None and e.context_length == Engine.MAX_DEFAULT_CONTEXT
    v2 = FstV2File(with_sidecar, overrides=fixture_overrides(ck.config))
    assert np.array_equal(reference_logits(v2, IDS), reference_logits(TruncatedHC(ck_v3), IDS))  # 24 > 19


def test_convert_carries_the_sidecar(ck, with_sidecar, noidx_path, tmp_path):
    out = convert(with_sidecar, tmp_path / "carried.fst", progress=False)
    with FstFile(out) as f, FstV2File(with_sidecar) as v2:
        assert f.verify() == [] and f.names() == v2.names()
        for n in indexer_names(ck.config):
            assert f.dtype(n) == spec.FROM_SAFETENSORS[ck.dtype(n)] and np.array_equal(f.tensor(n), ck.read(n)), n
    assert np.array_equal(load(out).logits(IDS), load(with_sidecar).logits(IDS))
    with pytest.raises(FormatError, match=rf"cannot convert: {noidx_path} has no lightning-indexer weights"):
        convert(noidx_path, tmp_path / "no.fst", progress=False)


def test_indexer_sidecar_needs_its_shards(indexer_shards_only, tmp_path, capsys):
    d = tmp_path / "ck"
    shutil.copytree(indexer_shards_only, d)
    gone = max(d.glob("*.safetensors"))
    gone.unlink()
    assert cli_main(["convert", str(d), "--indexer-sidecar", "-o", str(tmp_path / "x.fst.indexer")]) == 1
    assert f"lacks shard(s) {gone.name}: the indexer tensors are in" in capsys.readouterr().err
    assert not (tmp_path / "x.fst.indexer").exists()
    assert cli_main(["convert", str(indexer_shards_only), "--indexer-sidecar", "-o", str(tmp_path / "x.fst")]) == 1
    assert "name the output MODEL.fst.indexer" in capsys.readouterr().err and not (tmp_path / "x.fst").exists()


def test_indexer_sidecar_from_the_hub_downloads_only_its_shards(tiny_ckpt, indexer_shards_only, tmp_path, monkeypatch):
    import huggingface_hub

    asked = []

    def snapshot_download(repo_id, allow_patterns):
        asked.append(allow_patterns)
        d = tmp_path / "hub"
        d.mkdir(exist_ok=True)
        for f in tiny_ckpt.iterdir():
            if any(fnmatch.fnmatch(f.name, pat) for pat in allow_patterns):
                shutil.copyfile(f, d / f.name)
        return str(d)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    convert_indexer("someone/tiny", tmp_path / "x.fst.indexer", progress=False)
    assert asked[-1] == ["*.json"] + sorted(p.name for p in indexer_shards_only.glob("*.safetensors"))


@pytest.mark.parametrize("how", ["truncated", "corrupt", "another model", "a whole model", "not a .fst"])
def test_bad_indexer_sidecar_names_it(ck, tiny_ckpt, with_sidecar, ck_v3, tmp_path, how):
    p = copy_model(with_sidecar, tmp_path)
    side = f"{p}.indexer"
    shutil.copyfile(f"{with_sidecar}.indexer", side)
    if how == "truncated":
        os.truncate(side, os.path.getsize(side) - 4096)
    elif how == "corrupt":
        with FstFile(side) as f:
            off = f.header["tensors"][0]["offset"]
        with open(side, "r+b") as fh:
            fh.seek(off)
            b = fh.read(1)
            fh.seek(off)
            fh.write(bytes([b[0] ^ 1]))
    elif how == "another model":
        other = write_checkpoint(
            tmp_path / "other", "tiny", seed=0, tokenizer=False, compress_ratios=[0, 0, 4, 128, 4, 0]
        )
        convert_indexer(other, side, progress=False, force=True)  # over the copy made above
    elif how == "a whole model":
        shutil.copyfile(ck_v3.path, side)
    else:
        with open(side, "wb") as fh:
            fh.write(b"\0" * 8192)
    msg = {
        "truncated": "truncated",
        "corrupt": "checksum mismatch",
        "another model": r"lacks layers\.\{1,3\}",
        "a whole model": r"also holds",
        "not a .fst": "not a .fst file",
    }[how]
    with pytest.raises(FormatError, match=rf"{p.name}\.indexer.*{msg}.*--indexer-sidecar"):
        FstV2File(p)
