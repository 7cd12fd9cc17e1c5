"""Tests for the random-checkpoint generator (`fastar.fixtures`): official format, loadable by HF transformers
5.24 with its own key renames and FP8/FP4 dequantizer, bit-exact against our reference codecs."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import pytest
import torch

from fastar.config import ModelConfig
from fastar.convert.checkpoint import Checkpoint, parse_safetensors_header
from fastar.convert.names import expected_tensors
from fastar.fixtures import PRESETS, preset_config, write_checkpoint
from fastar.quant.reference import bf16_decode, fp4_decode, fp8_block_dequant, ue8m0_decode

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV4ForCausalLM  # noqa: E402
from transformers.conversion_mapping import get_checkpoint_conversion_mapping  # noqa: E402
from transformers.core_model_loading import WeightRenaming, rename_source_key  # noqa: E402

OFFICIAL_DTYPES = {"F8_E4M3", "F8_E8M0", "I8", "BF16", "F32", "I64"}


def hf_load(path: Path):
    """Load with HF on CPU (auto-dequantize FP8/FP4 to the requested float32). HF ignores `mtp.*` on load
    (`_keys_to_ignore_on_load_unexpected`), so the MTP block is neither loaded nor reported as unexpected."""
    logging.getLogger("transformers").setLevel(logging.ERROR)
    model, info = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32, output_loading_info=True)
    return model.eval(), info


@pytest.fixture(scope="module")
def hf_tiny(tiny_ckpt):
    return hf_load(tiny_ckpt)


def hf_renamer(model):
    """Official name -> HF parameter name, through HF's own rename table for deepseek_v4 (§3.4)."""
    renamings = [t for t in get_checkpoint_conversion_mapping("deepseek_v4") if isinstance(t, WeightRenaming)]
    sd = model.state_dict()
    return lambda name: rename_source_key(name, renamings, [], base_model_prefix="model", meta_state_dict=sd)[0]


def reference_value(ck: Checkpoint, name: str) -> np.ndarray:
    """Our own decode of an official tensor to float32 (or int64 for tid2eid)."""
    dtype = ck.dtype(name)
    a = ck.read(name)
    if dtype == "F8_E4M3":
        return fp8_block_dequant(a, ck.read(name.removesuffix(".weight") + ".scale"))
    if dtype == "BF16":
        return bf16_decode(a)
    return a


# --- format ----------------------------------------------------------------------------------------------


def test_on_disk_format(tiny_ckpt):
    files = {p.name for p in tiny_ckpt.iterdir()}
    assert {"config.json", "generation_config.json", "model.safetensors.index.json", "tokenizer.json"} <= files
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    seen: dict[str, str] = {}
    for s in shards:
        for name, ti in parse_safetensors_header(tiny_ckpt / s).items():
            assert name not in seen
            seen[name] = ti.dtype
            assert index["weight_map"][name] == s
    assert set(seen) == set(index["weight_map"])
    assert set(seen.values()) == OFFICIAL_DTYPES  # the header strings safetensors wrote are the official ones
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    assert cfg["quantization_config"] == {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    }
    assert len(cfg["compress_ratios"]) == cfg["num_hidden_layers"] + cfg["num_nextn_predict_layers"]
    assert cfg["rope_scaling"]["type"] == "yarn" and cfg["expert_dtype"] == "fp4"
    assert index["metadata"]["total_size"] == sum(Checkpoint(tiny_ckpt).tensor_info(n).nbytes for n in seen)


def test_presets_and_revisions():
    assert set(PRESETS) == {"tiny", "tiny-dspark", "vocab", "flash"}
    assert "expert_dtype" not in preset_config("tiny", revision="initial")
    assert preset_config("vocab")["vocab_size"] == 129280
    ds = preset_config("tiny-dspark")
    assert ds["dspark_target_layer_ids"] == [2, 3, 4] and ds["dspark_noise_token_id"] < ds["vocab_size"]
    assert "hidden_size" not in preset_config("tiny", hidden_size=None)
    assert preset_config("tiny", sliding_window=16)["sliding_window"] == 16
    with pytest.raises(ValueError):
        preset_config("huge")
    for p in PRESETS:
        for rev in ("initial", "current"):
            cfg = ModelConfig.from_hf(preset_config(p, revision=rev))
            assert cfg.expert_dtype == "fp4"


def test_deterministic_and_seeded(tiny_ckpt, tmp_path):
    again = write_checkpoint(tmp_path / "again", "tiny", seed=0, num_shards=2, tokenizer=False)
    other = write_checkpoint(tmp_path / "other", "tiny", seed=1, num_shards=2, tokenizer=False)
    a, b, c = Checkpoint(tiny_ckpt), Checkpoint(again), Checkpoint(other)
    for name in (
        "embed.weight",
        "layers.1.attn.wq_b.weight",
        "layers.1.attn.wq_b.scale",
        "layers.4.ffn.experts.3.w2.weight",
        "layers.0.ffn.gate.tid2eid",
        "mtp.0.hc_head_fn",
    ):
        assert np.array_equal(a.read(name), b.read(name)), name  # same values whatever the sharding
        assert not np.array_equal(a.read(name), c.read(name)), name


def test_value_ranges(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt)
    cfg = ck.config
    for i in range(cfg.num_hash_layers):
        t = ck.read(f"layers.{i}.ffn.gate.tid2eid")
        assert t.min() >= 0 and t.max() < cfg.n_routed_experts
        assert all(len(set(row)) == len(row) for row in t[:64].tolist())
    # FP8 block scales differ between blocks, so a transposed or mis-tiled scale shows
    s = ck.read("layers.1.attn.wq_b.scale")
    assert s.shape == (8, 3) and len(np.unique(s)) >= 3
    # FP4 expert scales vary by +-2 exponents around their base
    es = ck.expert(3, 5).w1_scale
    assert np.ptp(es.astype(int)) == 4
    # healthy magnitudes: dense weights ~1/sqrt(fan_in), experts similar, norms ~1
    w = fp8_block_dequant(ck.read("layers.0.attn.wq_a.weight"), ck.read("layers.0.attn.wq_a.scale"))
    assert 0.3 < w.std() * np.sqrt(w.shape[1]) < 3
    ew = ck.expert(0, 0)
    w1 = fp4_decode(ew.w1, ew.w1_scale)
    assert 0.3 < w1.std() * np.sqrt(w1.shape[1]) < 3
    assert np.isfinite(ue8m0_decode(ew.w2_scale)).all()
    n = bf16_decode(ck.read("layers.2.attn_norm.weight"))
    assert 0.5 < n.mean() < 1.5


def test_dspark_fixture(dspark_ckpt):
    ck = Checkpoint(dspark_ckpt)
    assert ck.config.num_mtp_layers == 3 and ck.config.has_dspark
    assert ck.info("mtp.0.main_proj.weight")[:2] == ("F8_E4M3", (256, 768))
    assert ck.info("mtp.2.markov_head.markov_w2.weight")[:2] == ("BF16", (1024, 32))
    assert not ck.has("mtp.0.e_proj.weight")
    assert set(ck.names()) == set(expected_tensors(ck.config))


def test_vocab_fixture_uses_the_real_tokenizer(vocab_ckpt):
    from tokenizers import Tokenizer

    ck = Checkpoint(vocab_ckpt)
    assert ck.config.vocab_size == 129280 and ck.info("embed.weight")[1] == (129280, 256)
    tok = Tokenizer.from_str(ck.tokenizer_json().decode())
    assert tok.token_to_id("<｜begin▁of▁sentence｜>") == ck.config.bos_token_id == 0
    assert tok.token_to_id("<｜end▁of▁sentence｜>") == ck.config.eos_token_id == 1
    assert tok.token_to_id("<｜Assistant｜>") == 128804
    ids = tok.encode("Hello, world").ids
    assert ids and max(ids) < ck.config.vocab_size


def test_flash_preset_has_the_real_widths(tmp_path):
    """`flash` (what `fastar synth --hf-dir` writes): Flash's widths, the ratios and hash layers following the layer
    count; written in shards of bounded size and read back by the checkpoint reader with every tensor in place."""
    d = preset_config("flash", num_hidden_layers=4)
    cfg = ModelConfig.from_hf(d)
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim, cfg.q_lora_rank, cfg.o_lora_rank) == (
        4096,
        64,
        512,
        1024,
        1024,
    )
    assert (cfg.o_groups, cfg.index_topk, cfg.sliding_window, cfg.vocab_size) == (8, 512, 128, 129280)
    assert list(cfg.compress_ratios) == [0, 0, 4, 128, 0] and cfg.num_hash_layers == 3
    assert cfg.n_routed_experts == 16 and cfg.num_experts_per_tok == 6
    one = ModelConfig.from_hf(preset_config("flash", num_hidden_layers=1))
    assert list(one.compress_ratios) == [0, 0] and one.num_hash_layers == 1
    out = write_checkpoint(tmp_path / "f", "flash", num_hidden_layers=1, n_routed_experts=6, vocab_size=2048)
    ck = Checkpoint(out)
    assert ck.config.hidden_size == 4096 and ck.config.n_routed_experts == 6
    assert set(ck.names()) == set(expected_tensors(ck.config))
    assert len(list(out.glob("*.safetensors"))) >= 2
    emb = bf16_decode(ck.tensor("embed.weight"))
    assert emb.shape == (2048, 4096) and 0.9 < emb.std() < 1.1


# --- HF transformers 5.24 loads it as the official checkpoint -------------------------------------------


def test_hf_loads_with_no_missing_or_unexpected_keys(hf_tiny):
    _, info = hf_tiny
    assert not info["missing_keys"]
    assert not info["unexpected_keys"]  # mtp.* is ignored by HF on load, by design
    assert not info["mismatched_keys"]
    assert not info["error_msgs"]


def test_hf_dequantized_parameters_equal_reference(hf_tiny, tiny_ckpt):
    model, _ = hf_tiny
    ck = Checkpoint(tiny_ckpt)
    to_hf = hf_renamer(model)
    sd = model.state_dict()
    checked = {"F8_E4M3": 0, "BF16": 0, "F32": 0, "I64": 0}
    for name in ck.names():
        dtype = ck.dtype(name)
        if name.startswith("mtp.") or ".experts." in name or dtype == "F8_E8M0":
            continue
        hf = sd[to_hf(name)]
        ref = reference_value(ck, name)
        assert hf.shape == ref.shape, name
        assert np.array_equal(hf.numpy(), ref), name  # bit for bit: products of FP8 and powers of two
        checked[dtype] += 1
    assert all(checked.values()), checked
    cfg = ck.config
    inter = cfg.moe_intermediate_size
    for layer, e in [(0, 0), (1, 7), (2, 3), (4, 6)]:
        ew = ck.expert(layer, e)
        gate_up = sd[f"model.layers.{layer}.mlp.experts.gate_up_proj"][e].numpy()
        down = sd[f"model.layers.{layer}.mlp.experts.down_proj"][e].numpy()
        assert np.array_equal(gate_up[:inter], fp4_decode(ew.w1, ew.w1_scale))  # w1 first
        assert np.array_equal(gate_up[inter:], fp4_decode(ew.w3, ew.w3_scale))
        assert np.array_equal(down, fp4_decode(ew.w2, ew.w2_scale))


def test_hf_forward_is_finite(hf_tiny):
    model, _ = hf_tiny
    ids = torch.randint(0, 1024, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, 40, 1024)
    assert torch.isfinite(logits).all()
    assert 0.1 < logits.std().item() < 30


def test_hf_loads_the_initial_revision(tmp_path, tiny_ckpt):
    d = write_checkpoint(tmp_path / "initial", "tiny", revision="initial", tokenizer=False)
    assert "expert_dtype" not in json.loads((d / "config.json").read_text())
    model, info = hf_load(d)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    ck = Checkpoint(d)
    ck.validate()
    ew = ck.expert(3, 2)
    inter = ck.config.moe_intermediate_size
    got = model.state_dict()["model.layers.3.mlp.experts.gate_up_proj"][2, :inter].numpy()
    assert np.array_equal(got, fp4_decode(ew.w1, ew.w1_scale))
