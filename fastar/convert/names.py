"""The official DeepSeek-V4 tensor manifest: the one place that knows every tensor name, dtype and shape.

Owns: `expected_tensors(cfg)` (name -> (safetensors dtype string, shape)) for the official HF checkpoint of
DeepSeek-V4-Flash and of the DSpark revision (DeepSeek-V4-Flash-0731), the routed-expert name helpers, and
`layer_prefix`. Does not own: reading files (`fastar.convert.checkpoint`), the meaning of the values
(`fastar.quant.reference`) or any renaming to other frameworks' names.

Layout facts (docs/MODEL.md, "The checkpoint"):
- FP8 linear: `<p>.weight` F8_E4M3 [out, in] + `<p>.scale` F8_E8M0 [ceil(out/128), ceil(in/128)].
- Routed expert (FP4): `.weight` I8 [rows, cols/2] + `.scale` F8_E8M0 [rows, cols/32].
- Layer slots: 0..L-1 are `layers.{i}`, L+k is `mtp.{k}` (a classic MTP block, or DSpark stage k).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from ..config import ModelConfig
from ..quant.reference import FP4_GROUP, FP8_BLOCK

Manifest = dict[str, tuple[str, tuple[int, ...]]]

_EXPERT_RE = re.compile(r"^(?:layers|mtp)\.\d+\.ffn\.experts\.\d+\.")
_MTP_RE = re.compile(r"^mtp\.(\d+)\.")
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(?:ffn\.experts\.(\d+)\.)?")
_MTP_EXPERT_RE = re.compile(r"^mtp\.\d+\.ffn\.experts\.(\d+)\.")

# ExpertWeights field -> (projection, suffix)
_EXPERT_FIELDS = {
    "w1": ("w1", "weight"),
    "w1_scale": ("w1", "scale"),
    "w3": ("w3", "weight"),
    "w3_scale": ("w3", "scale"),
    "w2": ("w2", "weight"),
    "w2_scale": ("w2", "scale"),
}


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def layer_prefix(slot: int, cfg: ModelConfig) -> str:
    """Name prefix (no trailing dot) of layer slot `slot`: `layers.{i}` or, for MTP/DSpark slot L+k, `mtp.{k}`."""
    n = cfg.num_hidden_layers
    if not 0 <= slot < cfg.num_layer_slots:
        raise IndexError(f"layer slot {slot} out of range (model has {cfg.num_layer_slots} slots)")
    return f"layers.{slot}" if slot < n else f"mtp.{slot - n}"


def is_routed_expert(name: str) -> bool:
    """True for the tensors of a routed expert (`layers.{i}.ffn.experts.{e}.*`, `mtp.{k}.ffn.experts.{e}.*`)."""
    return _EXPERT_RE.match(name) is not None


def mtp_blocks_in(names: Iterable[str]) -> int:
    """Number of MTP/DSpark blocks present, judged from tensor names (`mtp.N.` -> N+1); 0 when none."""
    top = -1
    for name in names:
        m = _MTP_RE.match(name)
        if m:
            top = max(top, int(m.group(1)))
    return top + 1


def highest_layer_and_expert(names: Iterable[str]) -> tuple[int, int]:
    """The highest main-layer index (`layers.N.`) and routed-expert id (`.ffn.experts.E.`) among tensor names;
    -1 for none."""
    layer = expert = -1
    for name in names:
        m = _LAYER_RE.match(name)
        if m:
            layer = max(layer, int(m.group(1)))
            if m.group(2) is not None:
                expert = max(expert, int(m.group(2)))
        else:
            m = _MTP_EXPERT_RE.match(name)
            if m:
                expert = max(expert, int(m.group(1)))
    return layer, expert


def expert_tensor_names(layer_slot: int, e: int, cfg: ModelConfig) -> dict[str, str]:
    """The six official tensor names of routed expert `e` of `layer_slot`, keyed by `ExpertWeights` field."""
    if not 0 <= e < cfg.n_routed_experts:
        raise IndexError(f"expert {e} out of range (model has {cfg.n_routed_experts} routed experts)")
    p = f"{layer_prefix(layer_slot, cfg)}.ffn.experts.{e}"
    return {field: f"{p}.{proj}.{suffix}" for field, (proj, suffix) in _EXPERT_FIELDS.items()}


def fp8_pair(name: str, out_dim: int, in_dim: int) -> Manifest:
    """An FP8 linear `name` ([out, in]) with its 128x128 UE8M0 block scale."""
    return {
        f"{name}.weight": ("F8_E4M3", (out_dim, in_dim)),
        f"{name}.scale": ("F8_E8M0", (_ceil(out_dim, FP8_BLOCK), _ceil(in_dim, FP8_BLOCK))),
    }


def fp4_pair(name: str, rows: int, cols: int) -> Manifest:
    """An FP4 expert projection `name` (logical [rows, cols]) packed two per byte, one scale per 32 columns."""
    return {
        f"{name}.weight": ("I8", (rows, cols // 2)),
        f"{name}.scale": ("F8_E8M0", (rows, cols // FP4_GROUP)),
    }


def _hc(prefix: str, site: str, cfg: ModelConfig) -> Manifest:
    hc, d = cfg.hc_mult, cfg.hidden_size
    mix = (2 + hc) * hc  # pre (hc) + post (hc) + comb (hc x hc)
    return {
        f"{prefix}hc_{site}_fn": ("F32", (mix, hc * d)),
        f"{prefix}hc_{site}_base": ("F32", (mix,)),
        f"{prefix}hc_{site}_scale": ("F32", (3,)),
    }


def hc_head(prefix: str, cfg: ModelConfig) -> Manifest:
    """The HC head (stream collapse before the final norm) under `prefix` ('' or 'mtp.{k}.')."""
    hc, d = cfg.hc_mult, cfg.hidden_size
    return {
        f"{prefix}hc_head_fn": ("F32", (hc, hc * d)),
        f"{prefix}hc_head_base": ("F32", (hc,)),
        f"{prefix}hc_head_scale": ("F32", (1,)),
    }


def block_tensors(slot: int, cfg: ModelConfig, routed: bool = True) -> Manifest:
    """Tensors of one V4 block (mHC, attention with its compressor/indexer, MoE) at layer slot `slot`; without the
    routed experts' with `routed=False`."""
    p = layer_prefix(slot, cfg) + "."
    d, h, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
    qr, og, olr = cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank
    inter, n_exp = cfg.moe_intermediate_size, cfg.n_routed_experts
    ratio = cfg.ratio(slot)
    out: Manifest = {}
    out.update(_hc(p, "attn", cfg))
    out.update(_hc(p, "ffn", cfg))
    out[f"{p}attn_norm.weight"] = ("BF16", (d,))
    out[f"{p}ffn_norm.weight"] = ("BF16", (d,))
    out[f"{p}attn.attn_sink"] = ("F32", (h,))
    out[f"{p}attn.q_norm.weight"] = ("BF16", (qr,))
    out[f"{p}attn.kv_norm.weight"] = ("BF16", (hd,))
    out.update(fp8_pair(f"{p}attn.wq_a", qr, d))
    out.update(fp8_pair(f"{p}attn.wq_b", h * hd, qr))
    out.update(fp8_pair(f"{p}attn.wkv", hd, d))
    out.update(fp8_pair(f"{p}attn.wo_a", og * olr, h * hd // og))
    out.update(fp8_pair(f"{p}attn.wo_b", d, og * olr))
    if ratio:
        c = 2 if ratio == 4 else 1  # ratio-4 compressors overlap windows: two halves (Ca | Cb)
        cp = f"{p}attn.compressor."
        out[cp + "ape"] = ("F32", (ratio, c * hd))
        out[cp + "norm.weight"] = ("BF16", (hd,))
        out[cp + "wgate.weight"] = ("BF16", (c * hd, d))
        out[cp + "wkv.weight"] = ("BF16", (c * hd, d))
    if ratio == 4:
        ni, di = cfg.index_n_heads, cfg.index_head_dim
        ip = f"{p}attn.indexer."
        out.update(fp8_pair(ip + "wq_b", ni * di, qr))
        out[ip + "weights_proj.weight"] = ("BF16", (ni, d))
        out[ip + "compressor.ape"] = ("F32", (4, 2 * di))
        out[ip + "compressor.norm.weight"] = ("BF16", (di,))
        out[ip + "compressor.wgate.weight"] = ("BF16", (2 * di, d))
        out[ip + "compressor.wkv.weight"] = ("BF16", (2 * di, d))
    out[f"{p}ffn.gate.weight"] = ("BF16", (n_exp, d))
    if cfg.is_hash_layer(slot):
        out[f"{p}ffn.gate.tid2eid"] = ("I64", (cfg.vocab_size, cfg.num_experts_per_tok))
    else:
        out[f"{p}ffn.gate.bias"] = ("F32", (n_exp,))
    out.update(fp8_pair(f"{p}ffn.shared_experts.w1", inter, d))
    out.update(fp8_pair(f"{p}ffn.shared_experts.w3", inter, d))
    out.update(fp8_pair(f"{p}ffn.shared_experts.w2", d, inter))
    for e in range(n_exp if routed else 0):
        ep = f"{p}ffn.experts.{e}."
        out.update(fp4_pair(ep + "w1", inter, d))
        out.update(fp4_pair(ep + "w3", inter, d))
        out.update(fp4_pair(ep + "w2", d, inter))
    return out


def _mtp_extras(k: int, cfg: ModelConfig) -> Manifest:
    """Classic MTP block k: input projections and its own head (§2.9)."""
    p, d = f"mtp.{k}.", cfg.hidden_size
    out: Manifest = {}
    out.update(fp8_pair(p + "e_proj", d, d))
    out.update(fp8_pair(p + "h_proj", d, d))
    out[p + "enorm.weight"] = ("BF16", (d,))
    out[p + "hnorm.weight"] = ("BF16", (d,))
    out[p + "norm.weight"] = ("BF16", (d,))
    out.update(hc_head(p, cfg))
    return out


def _dspark_extras(k: int, cfg: ModelConfig) -> Manifest:
    """DSpark stage k: stage 0 takes the target context (main_proj/main_norm), the last stage owns the heads."""
    p, d = f"mtp.{k}.", cfg.hidden_size
    rank = cfg.dspark_markov_rank
    out: Manifest = {}
    if k == 0:
        out.update(fp8_pair(p + "main_proj", d, len(cfg.dspark_target_layer_ids) * d))
        out[p + "main_norm.weight"] = ("BF16", (d,))
    if k == cfg.num_mtp_layers - 1:
        out[p + "norm.weight"] = ("BF16", (d,))
        out.update(hc_head(p, cfg))
        out[p + "markov_head.markov_w1.weight"] = ("BF16", (cfg.vocab_size, rank))
        out[p + "markov_head.markov_w2.weight"] = ("BF16", (cfg.vocab_size, rank))
        out[p + "confidence_head.proj.weight"] = ("BF16", (1, d + rank))
    return out


def expected_tensors(cfg: ModelConfig, routed: bool = True) -> Manifest:
    """Every tensor of the official checkpoint described by `cfg`, in checkpoint order (globals, layers, mtp);
    `routed=False`: all but the routed experts' (six per expert: most of the names, built for nothing by a caller
    that drops them)."""
    d, v = cfg.hidden_size, cfg.vocab_size
    out: Manifest = {
        "embed.weight": ("BF16", (v, d)),
        "head.weight": ("BF16", (v, d)),
        "norm.weight": ("BF16", (d,)),
    }
    out.update(hc_head("", cfg))
    for i in range(cfg.num_hidden_layers):
        out.update(block_tensors(i, cfg, routed))
    for k in range(cfg.num_mtp_layers):
        out.update(block_tensors(cfg.num_hidden_layers + k, cfg, routed))
        out.update(_dspark_extras(k, cfg) if cfg.has_dspark else _mtp_extras(k, cfg))
    return out


def resident_mismatch(tensors: list[dict], cfg: ModelConfig) -> str | None:
    """The first way a `.fst` file's resident tensor table (its header's `tensors`) differs from the manifest of `cfg`
    less the routed experts in names or shapes, or None. (Not in dtypes: a file converted from FaStar v2 keeps
    v2's BF16 where the checkpoint has FP8 or F32, and the engine takes either.)"""
    want = expected_tensors(cfg, routed=False)
    have = {t["name"]: t for t in tensors}
    for name, (_, shape) in want.items():
        t = have.get(name)
        if t is None:
            weight = have.get(name.removesuffix(".scale") + ".weight") if name.endswith(".scale") else None
            if weight is not None and weight["dtype"] == "BF16":  # a v2 weight kept dequantized needs no scale
                continue
            return f"tensor {name} is missing (the model's config names it)"
        if tuple(t["shape"]) != shape:
            return f"tensor {name} has shape {list(t['shape'])}, the model's config gives {list(shape)}"
    extra = [n for n in have if n not in want]
    return f"tensor {extra[0]} is not one of the model's ({len(extra)} such)" if extra else None


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    """Bytes of a tensor of safetensors dtype `dtype` and `shape`."""
    n = DTYPE_SIZES[dtype]
    for s in shape:
        n *= s
    return n


# safetensors dtype string -> bytes per element (all dtypes the header parser accepts)
DTYPE_SIZES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "F8_E8M0": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
