"""Model configuration: the one frozen description of a DeepSeek-V4 model that every part of fastar reads.

Owns: `ModelConfig` (built from an official `config.json` or from a `.fst` header, validated once) and the
derived per-layer facts (compress ratio, hash routing, which rope). Does not own: engine options (memory
budgets, threads), which belong to the engine.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

ALLOWED_RATIOS = (0, 4, 128)
# The context a session gets unless -c/--ctx-size (`Engine.context_length`) asks for more: the model allows 1M
# positions, whose compressed KV alone would take many GB; this fits a workstation.
MAX_DEFAULT_CONTEXT = 32768

# Fields an official config.json must carry; everything else has the Flash default.
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "head_dim",
    "q_lora_rank",
    "o_lora_rank",
    "o_groups",
    "n_routed_experts",
    "num_experts_per_tok",
    "compress_ratios",
)


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int = 129280
    hidden_size: int = 4096
    moe_intermediate_size: int = 2048
    num_hidden_layers: int = 43
    num_attention_heads: int = 64
    num_key_value_heads: int = 1
    head_dim: int = 512
    qk_rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_lora_rank: int = 1024
    o_groups: int = 8
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    num_experts_per_tok: int = 6
    scoring_func: str = "sqrtsoftplus"
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.5
    num_hash_layers: int = 3
    swiglu_limit: float = 10.0
    sliding_window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_factor: float = 16.0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    original_max_position_embeddings: int = 65536
    max_position_embeddings: int = 1048576
    # one entry per main layer, then one per MTP layer (the official file carries 44 entries)
    compress_ratios: tuple[int, ...] = field(default_factory=tuple)
    num_nextn_predict_layers: int = 1
    # MTP/DSpark blocks actually present in the weights (mtp.0 .. mtp.{n-1}); may exceed the config's count
    num_mtp_layers: int = 1
    bos_token_id: int = 0
    eos_token_id: int = 1
    expert_dtype: str = "fp4"
    # DSpark (DeepSeek-V4-Flash-0731): empty when absent
    dspark_block_size: int = 0
    dspark_target_layer_ids: tuple[int, ...] = ()
    dspark_markov_rank: int = 0
    dspark_noise_token_id: int = 0

    def __post_init__(self) -> None:
        def bad(msg: str) -> None:
            raise ConfigError(f"invalid model config: {msg}")

        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.type == "int" and (not isinstance(v, int) or isinstance(v, bool)):
                bad(f"{f.name} must be an integer, got {v!r}")
            if f.type == "float" and (not isinstance(v, (int, float)) or isinstance(v, bool)):
                bad(f"{f.name} must be a number, got {v!r}")
            if f.type == "bool" and not isinstance(v, bool):
                bad(f"{f.name} must be true or false, got {v!r}")
            if f.type == "str" and not isinstance(v, str):
                bad(f"{f.name} must be a string, got {v!r}")
            if f.type == "tuple[int, ...]" and not all(isinstance(x, int) and not isinstance(x, bool) for x in v):
                bad(f"{f.name} must be a list of integers, got {v!r}")
        for name in (
            "vocab_size",
            "hidden_size",
            "moe_intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "head_dim",
            "q_lora_rank",
            "o_lora_rank",
            "o_groups",
            "n_routed_experts",
            "num_experts_per_tok",
            "sliding_window",
            "hc_mult",
            "max_position_embeddings",
            "original_max_position_embeddings",
            "rope_theta",
            "compress_rope_theta",
            "rope_factor",
        ):
            if getattr(self, name) <= 0:
                bad(f"{name} must be positive, got {getattr(self, name)}")
        for f in dataclasses.fields(self):  # NaN passes every comparison above; JSON readers take NaN and Infinity
            if f.type == "float" and not math.isfinite(getattr(self, f.name)):
                bad(f"{f.name} must be a finite number, got {getattr(self, f.name)}")
        for name in ("rms_norm_eps", "hc_eps"):
            if getattr(self, name) < 0:
                bad(f"{name} must not be negative, got {getattr(self, name)}")
        if self.num_key_value_heads != 1:
            bad(f"num_key_value_heads must be 1 (one shared KV latent), got {self.num_key_value_heads}")
        if self.n_shared_experts != 1:
            bad(f"n_shared_experts must be 1, got {self.n_shared_experts}")
        if self.scoring_func != "sqrtsoftplus":
            bad(f"scoring_func {self.scoring_func!r} is not supported (only 'sqrtsoftplus')")
        if self.expert_dtype != "fp4":
            bad(f"expert_dtype {self.expert_dtype!r} is not supported (only 'fp4')")
        if self.num_experts_per_tok > self.n_routed_experts:
            bad("num_experts_per_tok exceeds n_routed_experts")
        if self.num_attention_heads % self.o_groups:
            bad(f"num_attention_heads {self.num_attention_heads} is not divisible by o_groups {self.o_groups}")
        if self.qk_rope_head_dim % 2 or not 0 < self.qk_rope_head_dim <= self.head_dim:
            bad(f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and at most head_dim")
        for name in ("hidden_size", "moe_intermediate_size"):
            if getattr(self, name) % 32:
                bad(f"{name} must be a multiple of 32 (FP4 scale groups), got {getattr(self, name)}")
        n = self.num_hidden_layers
        if len(self.compress_ratios) < n + self.num_mtp_layers:
            bad(f"compress_ratios has {len(self.compress_ratios)} entries, need {n} layers + {self.num_mtp_layers} MTP")
        odd = [r for r in self.compress_ratios if r not in ALLOWED_RATIOS]
        if odd:
            bad(f"compress_ratios may only hold {ALLOWED_RATIOS}, got {odd}")
        if 4 in self.compress_ratios and (self.index_n_heads <= 0 or self.index_topk <= 0):
            bad("ratio-4 layers need index_n_heads > 0 and index_topk > 0")
        if not 0 <= self.num_hash_layers <= n:
            bad(f"num_hash_layers {self.num_hash_layers} out of range")
        if self.num_mtp_layers < 0:
            bad("num_mtp_layers must be >= 0")
        if self.dspark_block_size and len(self.dspark_target_layer_ids) == 0:
            bad("dspark_block_size set without dspark_target_layer_ids")

    # --- derived facts -------------------------------------------------------------------------------------

    @property
    def num_layer_slots(self) -> int:
        """Main layers plus MTP layers: the number of (layer) rows of routed experts."""
        return self.num_hidden_layers + self.num_mtp_layers

    def ratio(self, layer: int) -> int:
        """Compression ratio of layer `layer` (MTP layers are num_hidden_layers, +1, ...)."""
        return self.compress_ratios[layer]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    @property
    def has_dspark(self) -> bool:
        return self.dspark_block_size > 0

    # --- (de)serialisation ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["dspark_target_layer_ids"] = list(self.dspark_target_layer_ids)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> ModelConfig:
        """From our own header dict (exact field names). Unknown keys are an error: the file is newer."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"invalid model config: unknown fields {sorted(unknown)}")
        d = dict(d)
        for k in ("compress_ratios", "dspark_target_layer_ids"):
            if k in d:
                if not isinstance(d[k], (list, tuple)):
                    raise ConfigError(f"invalid model config: {k} must be a list")
                d[k] = tuple(d[k])
        try:
            return cls(**d)
        except TypeError as e:
            raise ConfigError(f"invalid model config: {e}") from None

    @classmethod
    def from_hf(cls, d: dict[str, Any], num_mtp_layers: int | None = None) -> ModelConfig:
        """From an official HF `config.json` dict (either upstream revision, with or without `expert_dtype`)."""
        missing = [k for k in REQUIRED if k not in d]
        if missing:
            raise ConfigError(f"config.json is missing required field(s): {', '.join(missing)}")
        names = {f.name for f in dataclasses.fields(cls)}
        kw: dict[str, Any] = {k: v for k, v in d.items() if k in names}
        # each value read here is checked before it is used: a wrong type in config.json is one line naming the
        # field, never a TypeError from the arithmetic below (the dataclass checks the fields taken as they are)
        if "qk_rope_head_dim" not in d and "partial_rotary_factor" in d:
            share = _hf_number(d["partial_rotary_factor"], "partial_rotary_factor")
            kw["qk_rope_head_dim"] = int(_hf_integer(d["head_dim"], "head_dim") * share)
        rs = _hf_object(d, "rope_scaling")
        if rs:
            kw.update(
                rope_factor=_hf_number(rs.get("factor", 16.0), "rope_scaling.factor"),
                beta_fast=_hf_number(rs.get("beta_fast", 32.0), "rope_scaling.beta_fast"),
                beta_slow=_hf_number(rs.get("beta_slow", 1.0), "rope_scaling.beta_slow"),
                original_max_position_embeddings=_hf_integer(
                    rs.get("original_max_position_embeddings", 65536), "rope_scaling.original_max_position_embeddings"
                ),
            )
        q = _hf_object(d, "quantization_config")
        kw["expert_dtype"] = d.get("expert_dtype", q.get("expert_dtype", "fp4"))
        eos = d.get("eos_token_id", 1)
        if isinstance(eos, list) and not eos:
            raise ConfigError("invalid model config: eos_token_id is an empty list")
        kw["eos_token_id"] = eos[0] if isinstance(eos, list) else eos
        n_cfg = _hf_integer(d.get("num_nextn_predict_layers", 1), "num_nextn_predict_layers")
        kw["num_mtp_layers"] = n_cfg if num_mtp_layers is None else num_mtp_layers
        for k in ("compress_ratios", "dspark_target_layer_ids"):
            if k in kw:
                if not isinstance(kw[k], list):
                    raise ConfigError(f"invalid model config: {k} must be a list, got {kw[k]!r}"[:300])
                kw[k] = tuple(kw[k])
        # DSpark stages are ratio-0 blocks that the config's single MTP entry does not list (only those: padding
        # up to a layer count read from the file would also fill main layers, or memory, from one bad number)
        layers = _hf_integer(kw["num_hidden_layers"], "num_hidden_layers")
        extra = max(0, layers + kw["num_mtp_layers"] - max(len(kw["compress_ratios"]), layers))
        kw["compress_ratios"] += (0,) * extra
        for k in (
            "rope_theta",
            "compress_rope_theta",
            "routed_scaling_factor",
            "swiglu_limit",
            "hc_eps",
            "rms_norm_eps",
        ):
            if k in kw:
                kw[k] = _hf_number(kw[k], k)
        return cls(**kw)


def _hf_number(v: Any, where: str) -> float:
    """A finite number of config.json (a JSON number, not a string, a bool, NaN or Infinity) as a float."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ConfigError(f"invalid model config: {where} must be a finite number, got {v!r}"[:300])
    return float(v)


def _hf_integer(v: Any, where: str) -> int:
    """An integer of config.json (a JSON integer; 65536.0 is read as 65536)."""
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ConfigError(f"invalid model config: {where} must be an integer, got {v!r}"[:300])
    return v


def _hf_object(d: dict[str, Any], key: str) -> dict[str, Any]:
    """A nested object of config.json ({} when absent or null)."""
    v = d.get(key) or {}
    if not isinstance(v, dict):
        raise ConfigError(f"invalid model config: {key} must be an object, got {v!r}"[:300])
    return v


def parse_size(v: int | str | None) -> int | None:
    """Byte counts as users write them: 24G, 512M, 1.5GiB, 1000000 (None and "auto" stay None)."""
    if v is None or isinstance(v, int):
        return v
    s = str(v).strip().upper().removesuffix("B").removesuffix("I")
    if s in ("", "AUTO"):
        return None
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}.get(s[-1], 1)
    try:
        n = float(s[:-1] if mult > 1 else s)
    except ValueError:
        raise ConfigError(f"cannot read {v!r} as a size (examples: 24G, 512M, 1000000)") from None
    if not math.isfinite(n * mult):  # float() reads "nan", "inf" and "1e400"
        raise ConfigError(f"size {v!r} is not a finite number of bytes (examples: 24G, 512M, 1000000)")
    if n < 0:
        raise ConfigError(f"size {v!r} is negative")
    return int(n * mult)


def int_flag(lo: int, hi: int | None, what: str) -> Callable[[str], int]:
    """An argparse `type` for an integer flag in [lo, hi] (hi None: no upper bound): a bad value is one usage line
    naming `what`, never a traceback."""

    def parse(v: str) -> int:
        try:
            n = int(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be an integer, got {v!r}") from None
        if n < lo or (hi is not None and n > hi):
            raise argparse.ArgumentTypeError(
                f"{what} must be {f'at least {lo}' if hi is None else f'{lo}..{hi}'}, got {n}"
            )
        return n

    parse.__name__ = what  # argparse names the type in its messages
    return parse


def float_flag(lo: float, hi: float, what: str, open_lo: bool = False) -> Callable[[str], float]:
    """An argparse `type` for a number in [lo, hi], or (lo, hi] with `open_lo`; with `hi` infinite, any finite
    number above (or from) lo. A bad value (out of range, nan, not a number) is one usage line naming `what`."""

    def parse(v: str) -> float:
        try:
            x = float(v)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{what} must be a number, got {v!r}") from None
        if not (lo < x if open_lo else lo <= x) or not (x < hi if hi == math.inf else x <= hi):  # NaN fails too
            if hi == math.inf:
                more = f"a finite number {'above' if open_lo else 'of at least'} {lo:g}"
            else:
                more = f"above {lo:g} and at most {hi:g}" if open_lo else f"between {lo:g} and {hi:g}"
            raise argparse.ArgumentTypeError(f"{what} must be {more}, got {v}")
        return x

    parse.__name__ = what
    return parse
