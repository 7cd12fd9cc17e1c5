"""DeepSeek-V4 (Flash) forward pass: the whole model in one file, in forward order.

Owns: embedding -> 43 x [mHC pre -> attention (Q-LoRA, shared KV latent, partial interleaved RoPE, sliding
window, ratio-4 compressor + lightning indexer or ratio-128 compressor, per-head sinks, inverse RoPE, grouped
O-LoRA) -> mHC post -> mHC pre -> MoE (hash or sqrtsoftplus router, FP4 routed experts, shared expert) -> mHC
post] -> HC head -> final norm -> LM head, and the MTP block (logits for position t+2).
Does not own: weight storage and products (`fastar.quant.linear`: resident weights stay FP8/BF16 as stored,
routed experts come from an `ExpertProvider`, `fastar.contracts`), decode state layout (`fastar.model.state`),
sessions and sampling (`fastar.engine`).

Every call processes a chunk of T new tokens at positions p0..p0+T-1 against a `ModelState`; one full
prefill, any chunking and token-by-token decode compute the same thing (state.py says how) - to float32
rounding in `reference` numerics; in `official` numerics see the last paragraph below.

Lightning indexer: while a query sees at most index_topk compressed entries, its top-k is all of them, so the
chunk attends to every visible entry without scoring. A model without indexer weights (FaStar v2 files) runs
only that way: `DeepseekV4.max_positions` = 4 * index_topk + 3 (2051 on Flash), later positions are refused.

Numerics: `Numerics` has one switch per difference between DeepSeek's inference code (`official`, the default)
and transformers (`reference`); what each switch does, what neither mode simulates, and how chunking interacts
with the FP8/FP4 rounding (prefill vs decode differ by quantization noise under `official`; chunks of at most
`ops.SMALL_CHUNK` tokens are bit-identical to decoding one at a time) are in docs/MODEL.md, "Numerics".
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields

import numpy as np
import torch

from ..config import ModelConfig
from ..contracts import ExpertProvider, WeightSource
from ..errors import FastarError
from ..quant.kernels import available as _kernels_built
from ..quant.kernels import get_isa as _kernels_isa
from ..quant.linear import Linear, SourceExperts, Weights, expert_ffn, experts_ffn
from . import moe_fused, ops, route_fused
from .angles import shared_table
from .attend_fused import StoredAttend
from .compress_fused import FusedCompressors
from .fused import FusedAttention, FusedIndexer
from .hc_chain import HCChain
from .hc_fused import FusedHC
from .head_screen import Ban, HeadRequest, HeadScreen, Race
from .state import LayerState, ModelState, RowBuffer, StateFormat

SCORE_BLOCK = 1 << 24  # indexer score elements (query x head x entry) computed at once
PREFILL_SPAN_BYTES = 1 << 30  # bound on a prefill span's activations (`span_bytes_per_token`): inside the 2 GiB
# that the default expert budget leaves free, so a span never pushes the pager's slab out of RAM


def span_bytes_per_token(cfg: ModelConfig) -> int:
    """Float32 bytes a prefill span holds per token across a layer (`DeepseekV4._span`): the residual streams
    before and after the block (2 n d), the MoE's normed input, routed sum and shared output (3 d), and each
    routed expert's output kept until its fixed-order sum (k d). 272 KiB at Flash widths. A piece's attention
    temporaries come on top, as for any chunk (they depend on `prefill_chunk`, not on the span)."""
    d = cfg.hidden_size
    return 4 * (2 * cfg.hc_mult * d + 3 * d + cfg.num_experts_per_tok * d)


# --- numerics ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Numerics:
    """One switch per documented difference between DeepSeek's inference math and transformers'."""

    fp8_kv: bool = True
    fp4_indexer: bool = True
    fp8_activations: bool = True
    official_routing: bool = True
    bf16_wo_a: bool = True

    @classmethod
    def named(cls, name: str | Numerics) -> Numerics:
        if isinstance(name, Numerics):
            return name
        if name == "official":
            return cls()
        if name == "reference":
            return cls(**{f.name: False for f in fields(cls)})
        raise ValueError(f"numerics must be 'official' or 'reference', got {name!r}")

    def state_format(self, cfg: ModelConfig) -> StateFormat:
        """How a decode state stores what these numerics round: FP8 window rows and entries under `fp8_kv`, FP4
        index keys under `fp4_indexer` (exact: the rows are already rounded so), float32 otherwise."""
        return StateFormat(fp8_kv=self.fp8_kv, fp4_index=self.fp4_indexer, rope=cfg.qk_rope_head_dim)

    def act(self, x: torch.Tensor) -> torch.Tensor:
        """Input of an FP8/FP4 weight product."""
        return ops.fp8_quant_sim(x, 128) if self.fp8_activations else x


def layer_inv_freq(cfg: ModelConfig, ratio: int) -> torch.Tensor:
    """RoPE frequencies of a layer: plain theta on ratio-0 layers, compress theta + YaRN on compressed ones
    (their compressor and indexer use the same)."""
    r = cfg.qk_rope_head_dim
    if ratio == 0:
        return ops.rope_inv_freq(r, cfg.rope_theta)
    if cfg.rope_factor <= 1:
        return ops.rope_inv_freq(r, cfg.compress_rope_theta)
    return ops.yarn_inv_freq(
        r, cfg.compress_rope_theta, cfg.rope_factor, cfg.beta_fast, cfg.beta_slow, cfg.original_max_position_embeddings
    )


# --- hyper-connections (mHC) ---------------------------------------------------------------------------------


class HyperConnection:
    """mHC at one site: collapses the n residual streams into a sub-layer input and mixes them back (the math:
    `ops.hc_pre_torch`, `ops.hc_post_torch`; one C call each when the extension is built)."""

    def __init__(self, w: Weights, prefix: str, cfg: ModelConfig) -> None:
        self.fn = w.vector(prefix + "_fn")  # [(2+n)*n, n*d]
        self.base = w.vector(prefix + "_base")  # [(2+n)*n]
        self.scale = w.vector(prefix + "_scale")  # [3]
        self.iters, self.hc_eps, self.eps = cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps
        # the collapse with these weights bound once (`hc_fused`; the same C call, the same bits), None: `ops.hc_pre`
        self.fused = FusedHC.build(self.fn, self.base, self.scale, cfg.hc_mult, self.iters, self.hc_eps, self.eps)

    def pre(self, X: torch.Tensor, norm: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """X [T, n, d] -> (u [T, d], post [T, n], comb [T, n, n]); with `norm`, u comes back as the sub-layer's input
        rms_norm(u, norm) (one C call for both)."""
        fused = self.fused and norm is not None and self.fused.pre(X, norm)
        if fused:
            return fused
        return ops.hc_pre(X, self.fn, self.base, self.scale, self.iters, self.hc_eps, self.eps, norm)

    @staticmethod
    def post(f: torch.Tensor, X: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """New streams X'_k = post_k f + sum_j comb[j, k] X_j (comb is not symmetric: the first index sums)."""
        return ops.hc_post(f, X, post, comb)  # [T, n, d]


class HyperHead:
    """Final collapse of the n streams (no Sinkhorn, no post; `ops.hc_head_torch`)."""

    def __init__(self, w: Weights, prefix: str, cfg: ModelConfig) -> None:
        self.fn = w.vector(prefix + "hc_head_fn")  # [n, n*d]
        self.base = w.vector(prefix + "hc_head_base")  # [n]
        self.scale = w.vector(prefix + "hc_head_scale")  # [1]
        self.hc_eps, self.eps = cfg.hc_eps, cfg.rms_norm_eps

    def __call__(self, X: torch.Tensor, norm: torch.Tensor | None = None) -> torch.Tensor:
        """X [T, n, d] -> u [T, d], or with `norm` the final norm's output rms_norm(u, norm)."""
        return ops.hc_head(X, self.fn, self.base, self.scale, self.hc_eps, self.eps, norm)  # [T, d]


# --- compressor (ratio 4 overlapping, ratio 128) -------------------------------------------------------------


class Compressor:
    """Pools every `ratio` tokens into one KV entry: per feature, a softmax over the window's gate rows.

    Ratio 4 overlaps windows: projections are [Ca | Cb] halves and entry w mixes the Ca half of window w-1 with
    the Cb half of window w (8 rows). Entry w exists once token w*ratio + ratio - 1 has been processed; it is
    normed, RoPE'd at position w*ratio and passed through `quant` (official numerics) before it is stored.
    """

    def __init__(
        self, w: Weights, prefix: str, ratio: int, head_dim: int, inv_freq: torch.Tensor, eps: float, quant=None
    ) -> None:
        self.prefix = prefix
        self.wkv = w.linear(prefix + "wkv")  # BF16 [c*hd, d]
        self.wgate = w.linear(prefix + "wgate")  # BF16 [c*hd, d]
        self.ape = w.vector(prefix + "ape")  # [ratio, c*hd]
        self.norm = w.vector(prefix + "norm.weight")  # [hd]
        self.ratio, self.head_dim, self.overlap = ratio, head_dim, ratio == 4
        self.inv_freq, self.eps, self.quant = inv_freq, eps, quant

    def __call__(self, x: torch.Tensor, p0: int, kv_buf, gate_buf, out_buf, projected=None) -> None:
        """`project` the chunk x [T, d] at p0.. (or take its `projected` rows, `Attention._compress_project`), `add`."""
        pos = torch.arange(p0, p0 + x.shape[0])
        self.add(*(projected if projected is not None else self.project(x, pos)), p0, kv_buf, gate_buf, out_buf)

    def project(self, x: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The kv and gate rows [T, c*hd] of x [T, d] at positions pos [T] (any positions: each row on its own)."""
        return self.gated(self.wkv(x), self.wgate(x), pos)

    def gated(self, kv: torch.Tensor, gate: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`project` from the products x wkv^T and x wgate^T already made (one stacked product, `Attention`)."""
        return kv, gate + self.ape[pos % self.ratio]

    def add(self, kv_rows: torch.Tensor, gate_rows: torch.Tensor, p0: int, kv_buf, gate_buf, out_buf) -> None:
        """Appends the `project`ed rows of positions p0.. and stores the entries of the windows they close."""
        T, m, hd = kv_rows.shape[0], self.ratio, self.head_dim
        kv_buf.append(kv_rows)  # [T, c*hd]
        gate_buf.append(gate_rows)  # [T, c*hd]
        win = torch.arange(p0 // m, (p0 + T) // m)  # windows closed by this chunk [n]
        if len(win) == 0:
            return
        rows = win[:, None] * m + torch.arange(m)[None, :]  # absolute positions [n, m]
        kv, gate = kv_buf.take(rows), gate_buf.take(rows)  # [n, m, c*hd]
        if self.overlap:
            has_prev = (win >= 1)[:, None, None]  # window 0 has no Ca rows: kv 0, gate -inf
            prev = (rows - m).clamp(min=0)
            prev_kv = torch.where(has_prev, kv_buf.take(prev)[..., :hd], 0.0)  # [n, m, hd]
            prev_gate = torch.where(has_prev, gate_buf.take(prev)[..., :hd], float("-inf"))
            kv = torch.cat([prev_kv, kv[..., hd:]], dim=1)  # [n, 2m, hd]
            gate = torch.cat([prev_gate, gate[..., hd:]], dim=1)  # [n, 2m, hd]
        c = ops.compress_pool(kv, gate)  # [n, hd]
        c = ops.rms_norm(c, self.norm, self.eps)
        cos, sin = ops.rope_cos_sin(self.inv_freq, win * m)
        c = ops.apply_rope(c, cos, sin, overwrite=True)
        if self.quant is not None:
            c = self.quant(c)
        out_buf.append(c)


# --- lightning indexer (ratio-4 layers) ----------------------------------------------------------------------


class Indexer:
    """Scores compressed entries for each query, `I(t,s) = sum_h w_h relu(q_h . k_s)`, keeps the top k visible."""

    def __init__(self, w: Weights, prefix: str, cfg: ModelConfig, inv_freq: torch.Tensor, numerics: Numerics) -> None:
        self.wq_b = w.linear(prefix + "wq_b")  # FP8 [Hi*Di, q_lora]
        self.weights_proj = w.linear(prefix + "weights_proj")  # BF16 [Hi, d]
        self.heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.inv_freq, self.numerics = inv_freq, numerics
        self.fused = FusedIndexer.build(
            self.wq_b, self.weights_proj, heads=self.heads, act_block=128 if numerics.fp8_activations else 0,
            rotate=numerics.fp4_indexer,
        )  # fmt: skip
        rot = self._rotate if numerics.fp4_indexer else None
        self.compressor = Compressor(
            w, prefix + "compressor.", 4, cfg.index_head_dim, inv_freq, cfg.rms_norm_eps, quant=rot
        )

    @staticmethod
    def _rotate(x: torch.Tensor) -> torch.Tensor:
        return ops.fp4_quant_sim(ops.hadamard(x), 32)

    def __call__(self, x: torch.Tensor, qr: torch.Tensor, p0: int, state: LayerState) -> torch.Tensor | None:
        """The indexer on a whole chunk: `prepare`, then `pick` over every stored key -> entry ids [T, k], or None
        (`scores`). (`Attention` picks per query in small chunks: `Attention._attend`.)"""
        scoring = self.prepare(x, qr, p0, state)
        return None if scoring is None else self.pick(*scoring, p0, state.idx_entries.all())

    def prepare(
        self, x: torch.Tensor, qr: torch.Tensor, p0: int, state: LayerState, projected=None
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Adds the chunk's index keys (from its compressor's `projected` rows when given). -> the chunk's scoring
        queries (`queries`), or None when no query of the chunk sees more than topk entries (`scores`)."""
        self.compressor(x, p0, state.idx_kv, state.idx_gate, state.idx_entries, projected)
        return self.queries(x, qr, torch.arange(p0, p0 + x.shape[0])) if self.scores(p0 + x.shape[0]) else None

    def scores(self, stop: int) -> bool:
        """Whether the query at position stop-1 needs scoring: it sees stop//4 entries; with at most topk, top-k
        keeps every visible entry (and only -1 beside them) whatever the scores, so the caller attends to all
        visible entries instead - the same set, without scoring."""
        return stop // 4 > self.topk

    def queries(
        self, x: torch.Tensor, qr: torch.Tensor, pos: torch.Tensor, cos_sin: tuple | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries [T, Hi, Di] (RoPE'd, rotated under fp4_indexer) and head weights [T, Hi] of the rows of x
        at positions pos [T] (`cos_sin`: their RoPE angles' cos and sin, when the caller has them)."""
        T, Hi, Di = x.shape[0], self.heads, self.head_dim
        cos, sin = cos_sin if cos_sin is not None else ops.rope_cos_sin(self.inv_freq, pos)
        fused = self.fused and self.fused.queries(x, qr, cos, sin)  # the same bits in one C call at decode
        if fused is not None:
            return fused
        q = self.wq_b(self.numerics.act(qr)).view(T, Hi, Di)  # [T, Hi, Di]
        q = ops.apply_rope(q, cos, sin, overwrite=True)
        if self.numerics.fp4_indexer:
            q = self._rotate(q)
        return q, self.weights_proj(x) * Hi**-0.5

    def pick_stored(
        self, q: torch.Tensor, weights: torch.Tensor, p0: int, entries: RowBuffer, stop: int
    ) -> torch.Tensor:
        """`pick` over the stored index keys [0, stop) of `entries`: scored straight from their packed FP4 rows where
        the C kernel takes them (the same scores as over the decoded keys), else decoded first."""
        if self.numerics.fp4_indexer and entries.fmt.kind == "fp4" and entries.start == 0 and stop:
            score = ops.index_scores_fp4(q, weights, entries.raw()[:stop], p0)
            if score is not None:
                return ops.index_topk(score, p0, min(self.topk, stop))
        return self.pick(q, weights, p0, entries.rows(0, stop))

    def pick(self, q: torch.Tensor, weights: torch.Tensor, p0: int, keys: torch.Tensor) -> torch.Tensor:
        """Entry ids [T, k] with the top scores among keys [E, Di] (k = min(topk, E)) for the queries q [T, Hi, Di]
        (head weights [T, Hi]) at positions p0.., ascending in each row; -1 (last) where a query sees fewer."""
        score = ops.index_scores(q, weights, keys, p0, self.numerics.fp4_indexer)  # [T, E], -inf: not visible yet
        return ops.index_topk(score, p0, min(self.topk, keys.shape[0]))  # [T, k], ascending ids, then -1


# --- attention -----------------------------------------------------------------------------------------------


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    k0: int,
    p0: int,
    window: int,
    comp: torch.Tensor | None,
    comp_idx: torch.Tensor | None,
    ratio: int,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Softmax attention of the queries q [T, H, D] at positions p0.. over the window keys [K, D] (K = V; row i at
    position k0 + i; query p sees positions (p - window, p]) plus compressed entries comp [E, D]: those comp_idx
    [T, k] picks (-1 = none), else every one closed by p (e < (p+1) // ratio); a per-head sink logit sinks [H]
    sits in the softmax denominator only. -> [T, H, D]. One C call over the kernels' thread pool when the
    extension is built (each query and head in one fixed order: batch-invariant; equal to `attend_torch` within
    float32 rounding, tested), else `attend_torch` on the masks."""
    out = ops.attend_c(q, keys, k0, p0, window, comp, comp_idx, ratio, sinks, scale)
    if out is not None:
        return out
    pos = torch.arange(p0, p0 + q.shape[0])[:, None]  # [T, 1]
    kpos = torch.arange(k0, k0 + keys.shape[0])[None, :]  # [1, K]
    comp_mask = None
    if comp is not None and comp_idx is None:
        comp_mask = torch.arange(comp.shape[0])[None, :] < (pos + 1) // ratio  # [T, E]
    return attend_torch(q, keys, (kpos <= pos) & (kpos > pos - window), comp, comp_mask, comp_idx, sinks, scale)


def attend_torch(
    q: torch.Tensor,
    keys: torch.Tensor,
    key_mask: torch.Tensor,
    comp: torch.Tensor | None,
    comp_mask: torch.Tensor | None,
    comp_idx: torch.Tensor | None,
    sinks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """`attend` in torch, on any masks: the reference the C kernel is tested against (and DSpark's block attention,
    whose mask is no window). `key_mask` [T, K] and `comp_mask` [T, E] mark what each query sees; `comp_idx` [T, k]
    gathers per-query entries instead (-1 = none)."""
    T, H, _ = q.shape
    logits = [torch.einsum("thd,kd->htk", q, keys).mul(scale).masked_fill(~key_mask, float("-inf"))]  # [H,T,K]
    picked = None
    if comp is not None and comp_idx is not None:
        picked = comp[comp_idx.clamp(min=0)]  # [T, k, D]
        s = torch.einsum("thd,tkd->htk", q, picked).mul(scale)  # [H, T, k]
        logits.append(s.masked_fill(comp_idx[None] < 0, float("-inf")))
    elif comp is not None:
        logits.append(torch.einsum("thd,ed->hte", q, comp).mul(scale).masked_fill(~comp_mask, float("-inf")))
    logits.append(sinks[:, None, None].expand(H, T, 1))
    z = torch.cat(logits, dim=-1)  # [H, T, K + E|k + 1]
    p = torch.softmax(z - z.max(dim=-1, keepdim=True).values, dim=-1)
    K = keys.shape[0]
    o = torch.einsum("htk,kd->thd", p[..., :K], keys)  # [T, H, D]
    if picked is not None:
        o = o + torch.einsum("htk,tkd->thd", p[..., K:-1], picked)
    elif comp is not None:
        o = o + torch.einsum("hte,ed->thd", p[..., K:-1], comp)
    return o


class Attention:
    """MQA with one shared KV latent (K = V), Q-LoRA, partial RoPE, sliding window + compressed entries."""

    def __init__(self, w: Weights, prefix: str, cfg: ModelConfig, ratio: int, numerics: Numerics) -> None:
        self.wq_a = w.linear(prefix + "wq_a")  # FP8 [q_lora, d]
        self.q_norm = w.vector(prefix + "q_norm.weight")  # [q_lora]
        self.wq_b = w.linear(prefix + "wq_b")  # FP8 [H*D, q_lora]
        self.wkv = w.linear(prefix + "wkv")  # FP8 [D, d]
        self.wq_a_kv = w.stacked([prefix + "wq_a", prefix + "wkv"])  # both on one input: one product (or None)
        self.kv_norm = w.vector(prefix + "kv_norm.weight")  # [D]
        self.wo_a = w.linear(prefix + "wo_a")  # FP8 [G*R, H*D/G]
        self.wo_b = w.linear(prefix + "wo_b")  # FP8 [d, G*R]
        self.sinks = w.vector(prefix + "attn_sink")  # [H]
        self.H, self.D, self.rope = cfg.num_attention_heads, cfg.head_dim, cfg.qk_rope_head_dim
        self.groups, self.window, self.ratio, self.eps = cfg.o_groups, cfg.sliding_window, ratio, cfg.rms_norm_eps
        self.numerics, self.prefix = numerics, prefix
        self.inv_freq = layer_inv_freq(cfg, ratio)
        # a decode step's cos/sin looked up in the table of these frequencies (`angles.AngleTable`: the same bits as
        # `ops.rope_cos_sin`); the model shares one dict of tables among its layers (`DeepseekV4`)
        self.freq_key, self.angles = tuple(self.inv_freq.tolist()), {}
        self._table = None  # `rows`' AngleTable, once looked up in `angles`
        self.compressor = self.indexer = self.max_positions = None  # max_positions: computed exactly (None: all)
        if ratio:
            fp8 = self._fp8_nope if numerics.fp8_kv else None
            self.compressor = Compressor(w, prefix + "compressor.", ratio, cfg.head_dim, self.inv_freq, self.eps, fp8)
        if ratio == 4 and w.has(prefix + "indexer.wq_b.weight"):
            self.indexer = Indexer(w, prefix + "indexer.", cfg, self.inv_freq, numerics)
        elif ratio == 4:
            # No indexer weights (FaStar v2 files lack them): attend to every visible entry. Query t sees (t+1)//4
            # entries and the indexer keeps index_topk of them, so all while t <= 4*index_topk + 2: exact for the
            # first 4*index_topk + 3 positions (2051 on Flash); later ones are refused.
            self.max_positions = 4 * cfg.index_topk + 3
        # the compressors' BF16 products (the layer's and its indexer's, kv and gate each) all take the block's
        # input: stacked into one product, one kernel call instead of four (row r of it is row r of its own
        # weight's product: the same numbers, tested); None where they cannot stack (then one call each)
        self.fused = FusedAttention.build(
            self.wq_a_kv, self.wq_b, self.wo_a, self.wo_b, q_lora=self.wq_a.out_features, q_norm=self.q_norm,
            kv_norm=self.kv_norm, heads=self.H, groups=self.groups, eps=self.eps,
            act_block=128 if numerics.fp8_activations else 0, nope_block=64 if numerics.fp8_kv else 0,
            bf16_wo_a=numerics.bf16_wo_a,
        )  # fmt: skip
        self.compressors = [c for c in (self.compressor, self.indexer and self.indexer.compressor) if c is not None]
        self.comp_stack = (
            w.stacked([c.prefix + name for c in self.compressors for name in ("wkv", "wgate")])
            if self.compressors
            else None
        )
        # at decode, each query's attention over its stored rows in one C call (the same bits as `_attend`'s path)
        self.stored_attend = StoredAttend.build(self.sinks, self.window, ratio, self.D**-0.5)
        self._rows_o: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # `_rows_out`'s buffers, by row count
        # at decode, each row's compressor work in one C call per compressor (the same bits as `Compressor.add`)
        own = (self.compressor, ("comp_kv", "comp_gate", "entries"), "fp8_nope" if numerics.fp8_kv else None, self.rope)
        rot = "fp4_rotate" if numerics.fp4_indexer else None
        idx = (self.indexer and self.indexer.compressor, ("idx_kv", "idx_gate", "idx_entries"), rot, 0)
        self.comp_fused = FusedCompressors.build(self.comp_stack, [c for c in (own, idx) if c[0] is not None])

    def _fp8_nope(self, kv: torch.Tensor) -> torch.Tensor:
        """QAT simulation of DeepSeek's FP8 KV cache: the non-RoPE dims, blocks of 64."""
        return torch.cat([ops.fp8_quant_sim(kv[..., : -self.rope], 64), kv[..., -self.rope :]], dim=-1)

    def _attend(
        self, q: torch.Tensor, s: slice, p0: int, state: LayerState, scoring: tuple[torch.Tensor, torch.Tensor] | None
    ) -> torch.Tensor:
        """Attention of the queries q[s] of a chunk at p0 (q [T, H, D]; positions [a, b)) over what they see,
        stored already: window keys [max(0, a-W+1), b) and the compressed entries closed by position b-1, picked
        with the indexer's `scoring` queries of the chunk when position b-1 needs it, else all visible ones.
        -> [b-a, H, D]"""
        q, a, b = q[s], p0 + s.start, p0 + s.stop
        k0 = max(0, a - self.window + 1)
        comp = comp_idx = None
        if self.ratio and scoring is not None and self.indexer.scores(b):
            comp_idx = self.indexer.pick_stored(scoring[0][s], scoring[1][s], a, state.idx_entries, b // 4)
        out = self.stored_attend and self.stored_attend(q, state, k0, a, b, comp_idx)  # one query: one C call
        if out is not None:
            return out
        if self.ratio:
            if comp_idx is not None and state.entries.is_packed:  # decode only the picked entries [U, D]
                ids, comp_idx = ops.picked_entries(comp_idx, b // self.ratio)
                comp = state.entries.take(ids)
            elif b // self.ratio:  # none closed yet: window keys only (the C kernel takes no empty entry array)
                comp = state.entries.rows(0, b // self.ratio)  # [E, D]
        return attend(q, state.kv.rows(k0, b), k0, a, self.window, comp, comp_idx, self.ratio, self.sinks, self.D**-0.5)

    def __call__(self, x: torch.Tensor, p0: int, state: LayerState) -> torch.Tensor:
        T = x.shape[0]
        if self.max_positions is not None and p0 + T > self.max_positions:
            raise FastarError(
                f"position {p0 + T - 1} needs {self.prefix}indexer (the lightning indexer), which the "
                f"model lacks: without it only the first {self.max_positions} positions are exact"
            )
        cos, sin = ops.rope_cos_sin(self.inv_freq, torch.arange(p0, p0 + T))  # [T, r/2]
        q, qr, kv = self._project(x, cos, sin)
        state.kv.append(kv)

        scoring = None  # the indexer's queries, when some query of the chunk needs scoring
        if self.ratio:
            projected = self._compress_project(x, torch.arange(p0, p0 + T))
            self.compressor(x, p0, state.comp_kv, state.comp_gate, state.entries, projected[0])
            if self.indexer is not None:
                scoring = self.indexer.prepare(x, qr, p0, state, projected[1])
        # queries one by one in small chunks (`ops.token_slices`): a verify pass attends exactly as decode does;
        # long chunks in pieces of a window's length, each against only the keys its queries can see
        o = torch.cat([self._attend(q, s, p0, state, scoring) for s in ops.token_slices(T, self.window)])
        return self._output(o, cos, sin)

    def rows(self, x: torch.Tensor, states: list[LayerState], step: dict | None = None) -> torch.Tensor:
        """One new token for each of B sequences (B <= `ops.SMALL_CHUNK`): row b of x [B, d] continues states[b]
        at its own position. The weight products run on all B rows at once (batch-invariant: each row as if
        alone), the compressors' and the indexer's included; everything that reads or writes a state (window KV,
        compressor windows, indexer picks, attention) runs row by row exactly as a one-token `__call__` does. So
        every row's output and state are bit-identical to decoding that sequence alone. -> [B, d]
        `step`: a dict the step's layers share (`DeepseekV4.forward_rows`), where the RoPE angles of the rows'
        positions are kept by frequencies once a layer has looked them up (the same rows the table gives)."""
        pos = [s.length for s in states]
        if self.max_positions is not None and max(pos) + 1 > self.max_positions:
            raise FastarError(
                f"position {max(pos)} needs {self.prefix}indexer (the lightning indexer), which the "
                f"model lacks: without it only the first {self.max_positions} positions are exact"
            )
        got = step.get(self.freq_key) if step is not None else None
        if got is not None and got[0] == pos:
            cos, sin = got[1]
        else:
            table = self._table
            if table is None or table is not self.angles.get(self.freq_key):  # looked up once (the shared dict)
                table = self._table = shared_table(self.angles, self.inv_freq, self.freq_key)
            cos, sin = table.rows(pos)  # [B, r/2] each
            if step is not None:
                step[self.freq_key] = (pos, (cos, sin))
        q, qr, kv = self._project(x, cos, sin)
        # the compressors' and the indexer's products on all the rows too (each row as if alone); the state updates
        # row by row: one C call per row and compressor (`FusedCompressors`, the same bits), else below
        fused = self.comp_fused and self.comp_fused.project(x)
        ckv = cgate = ikv = igate = iq = iw = None
        if self.ratio and fused is None:
            projected = self._compress_project(x, torch.tensor(pos))
            ckv, cgate = projected[0]
            if self.indexer is not None:
                ikv, igate = projected[1]
        if self.indexer is not None and any(self.indexer.scores(p + 1) for p in pos):
            iq, iw = self.indexer.queries(x, qr, torch.tensor(pos), (cos, sin))  # the layer's frequencies
        # each row's attention into its slice of one output, one C call each (`StoredAttend`), else below
        qn = self.stored_attend and ops.c_arrays(q, kv)  # q's and kv's arrays: [q, kv]
        o, on = self._rows_out(q.shape) if qn else (None, None)
        out = []
        lone = bool(qn) and qn[0].shape[0] == 1  # a lone row: its arrays whole (a slice is a numpy call each)
        for b, (p0, state) in enumerate(zip(pos, states)):
            if not (qn and state.kv.append_array(qn[1] if lone else qn[1][b : b + 1])):  # the bytes, no tensor calls
                state.kv.append(kv[b : b + 1])
            scoring = None
            if self.ratio:
                one = slice(b, b + 1)
                if fused is not None:
                    self.comp_fused.add(fused, b, p0, state, self.angles)
                else:
                    self.compressor.add(ckv[one], cgate[one], p0, state.comp_kv, state.comp_gate, state.entries)
                if self.indexer is not None:
                    if fused is None:
                        idx = self.indexer.compressor
                        idx.add(ikv[one], igate[one], p0, state.idx_kv, state.idx_gate, state.idx_entries)
                    scoring = (iq[one], iw[one]) if self.indexer.scores(p0 + 1) else None
            if o is not None:
                picks = None
                if scoring is not None:
                    picks = self.indexer.pick_stored(*scoring, p0, state.idx_entries, (p0 + 1) // 4)
                k0 = max(0, p0 - self.window + 1)
                qb, ob = (qn[0], on) if lone else (qn[0][b : b + 1], on[b : b + 1])
                if not self.stored_attend.into(qb, state, k0, p0, p0 + 1, picks, ob):
                    o[b : b + 1] = self._attend(q[b : b + 1], slice(0, 1), p0, state, scoring)
                continue
            out.append(self._attend(q[b : b + 1], slice(0, 1), p0, state, scoring))
        if o is not None:
            return self._output(o, cos, sin)
        return self._output(torch.cat(out) if len(out) > 1 else out[0], cos, sin)

    def _rows_out(self, shape: torch.Size) -> tuple[torch.Tensor, np.ndarray]:
        """`rows`' attention output [B, H, D] for B rows, one per B made once (a tensor and its array): each call fills
        it row by row and `_output` reads it before `rows` returns, so a step allocates none."""
        got = self._rows_o.get(shape[0])
        if got is None:
            on = np.empty(tuple(shape), np.float32)
            got = self._rows_o[shape[0]] = (ops.buffer_tensor(on), on)  # `_output`'s C call gets `on` unchecked
        return got

    def _compress_project(self, x: torch.Tensor, pos: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`Compressor.project` of x [T, d] at positions pos for each of `self.compressors` (the layer's, then its
        indexer's), from the one stacked product where there is one."""
        if self.comp_stack is None:
            return [c.project(x, pos) for c in self.compressors]
        y, out, o = self.comp_stack(x), [], 0  # [T, sum of the rows]
        for c in self.compressors:
            n = c.wkv.out_features
            out.append(c.gated(y[:, o : o + n], y[:, o + n : o + 2 * n], pos))
            o += 2 * n
        return out

    def _project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, d] -> queries [T, H, D] (normed, RoPE'd), the Q-LoRA latent qr [T, q_lora] and the KV rows [T, D]
        to store (RoPE'd; FP8 non-RoPE dims under fp8_kv); cos/sin [T, r/2] at each row's position."""
        fused = self.fused and self.fused.project(x, cos, sin)  # the same bits in one C call at decode
        if fused is not None:
            return fused
        T, H, D, act = x.shape[0], self.H, self.D, self.numerics.act
        xq = act(x)
        if self.wq_a_kv is not None:
            q_lin, kv_lin = self.wq_a_kv(xq).split([self.wq_a.out_features, D], dim=1)
        else:
            q_lin, kv_lin = self.wq_a(xq), self.wkv(xq)
        qr = ops.rms_norm(q_lin, self.q_norm, self.eps)  # [T, q_lora]
        q = self.wq_b(act(qr)).view(T, H, D)  # [T, H, D]
        q = ops.apply_rope(ops.rms_norm(q, None, self.eps, True), cos, sin, overwrite=True)  # per-head norm, RoPE
        kv = ops.rms_norm(kv_lin, self.kv_norm, self.eps)  # [T, D]
        kv = ops.apply_rope(kv, cos, sin, overwrite=True)
        if self.numerics.fp8_kv:
            kv = self._fp8_nope(kv)
        return q, qr, kv

    def _output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Attention outputs o [T, H, D] -> [T, d]: inverse RoPE, grouped O-LoRA."""
        fused = self.fused and self.fused.output(o, cos, sin)  # the same bits in one C call at decode
        if fused is not None:
            return fused
        T, H, D = o.shape
        # V carried RoPE: undo it at the query's position; then wo_a's input, rounded to bfloat16 under bf16_wo_a
        o = ops.apply_rope(o, cos, sin, inverse=True, overwrite=True, bf16=self.numerics.bf16_wo_a)
        z = self.wo_a.grouped(o.reshape(T, self.groups, H * D // self.groups))  # [T, G, R]
        return self.wo_b(self.numerics.act(z.reshape(T, -1)))  # [T, d]


# --- mixture of experts --------------------------------------------------------------------------------------


class MoE:
    """Router (hash table or sqrtsoftplus top-k with selection-only bias), routed FP4 experts, shared expert."""

    def __init__(
        self,
        w: Weights,
        prefix: str,
        cfg: ModelConfig,
        layer: int,
        numerics: Numerics,
        experts: ExpertProvider,
        kernels: bool,
    ) -> None:
        self.gate = w.linear(prefix + "gate")  # BF16 [E, d]
        self.is_hash = cfg.is_hash_layer(layer)
        self.tid2eid = w.table(prefix + "gate.tid2eid") if self.is_hash else None  # [V, k]
        self.bias = None if self.is_hash else w.vector(prefix + "gate.bias")  # [E]
        self.shared = [w.linear(prefix + f"shared_experts.{n}") for n in ("w1", "w3", "w2")]  # FP8
        self.shared_up = w.stacked([prefix + "shared_experts.w1", prefix + "shared_experts.w3"])  # one product
        self.layer, self.topk, self.scale = layer, cfg.num_experts_per_tok, cfg.routed_scaling_factor
        self.limit, self.numerics, self.experts, self.kernels = cfg.swiglu_limit, numerics, experts, kernels
        self.lookahead = None  # set by DeepseekV4 when the expert provider can prefetch
        self.offload = None  # set by a device backend: runs the routed experts instead (`fastar.model.device`)
        self.span_next = None  # set by DeepseekV4 with a paging provider: prefetch the next layer during a span
        self.act_block = 128 if numerics.fp8_activations else 0  # the FP8 activation block (official numerics)
        self._outs: dict[int, tuple[torch.Tensor, np.ndarray]] = {}  # `_rows_out`'s buffers, by row count
        # the routed experts through `moe_fused.routed_sum` (False: `routed_reference`): where the fused kernel
        # applies, as `experts_ffn` decides (the C build; an activation hook only with DeepSeek's routing order)
        self.fused = kernels and _kernels_built() and (not numerics.fp8_activations or numerics.official_routing)
        self.shared_fused = moe_fused.SharedExpert.build(self.shared_up, self.shared[2], self.limit, self.act_block)
        # the router after its product as one C call (`route_fused`; None: `route` in torch), with the fused experts
        self.router = (
            route_fused.FusedRouter.build(
                self.gate, self.bias, self.tid2eid, self.topk, self.scale, numerics.official_routing
            )
            if self.fused
            else None
        )

    def guess(self, x: torch.Tensor, xa: np.ndarray | None = None) -> list[int]:
        """This layer's likely experts for x (its router on another layer's input): lookahead prefetch. `xa`: x's
        array where the caller has it: the C router then picks the same experts in one call (`route_fused`)."""
        if self.is_hash:
            return []
        got = None if self.router is None or xa is None else self.router(x[-1:], None, xa[-1:])
        if got is not None:
            return got[0][0].tolist()
        scores = ops.sqrtsoftplus(self.gate(x[-1:]))  # [1, E]: the newest token is the one decode waits on
        return torch.topk(scores + self.bias, self.topk, dim=-1).indices.reshape(-1).tolist()

    def route(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (expert ids [T, k], weights [T, k])."""
        scores = moe_fused.router_scores(self.gate(x))  # [T, E]: as per token (the torch path's softplus: see there)
        if self.is_hash:
            idx = self.tid2eid[ids]  # [T, k]
        else:
            idx = ops.topk_ordered(scores + self.bias, self.topk)  # bias: selection only; descending, ties to lower ids
        wts = scores.gather(1, idx)  # [T, k]
        total = wts.sum(dim=-1, keepdim=True)  # >= +0 (sqrt(softplus)): DeepSeek's `+ 0` would change no bit
        if not self.numerics.official_routing:
            total += 1e-20
        return idx, wts.div_(total).mul_(self.scale)  # in place: two tensors fewer per layer at decode

    def route_c(
        self, x: torch.Tensor, ids: torch.Tensor, xa: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray] | None:
        """`route` as numpy arrays through `route_fused` (the same bits), or None where it does not apply. `xa`: x's
        array where the caller has it."""
        return None if self.router is None else self.router(x, ids, xa)

    def __call__(self, x: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        xa = ops.buffer_array(x)  # a decode step's registered input: its array, known float32 and contiguous
        if xa is None:
            fused = self.fused and x.dtype is torch.float32 and x.is_cpu and x.is_contiguous()
            xa = x.numpy() if fused else None  # x's array once for the fused calls below (each would convert it)
        fused = self.fused and self.offload is None and xa is not None
        routes = self.route_c(x, ids, xa) if fused else None  # numpy (ids, weights): `moe_fused.routed_sum` takes them
        idx, wts = routes if routes is not None else self.route(x, ids)
        if self.lookahead is not None:  # guess the next layer's experts now, so their reads overlap this layer
            self.lookahead(x, xa)
        if self.offload is not None:  # split between the device and the CPU, summed in expert-id order
            return self.offload(self, x, idx, wts) + self._shared(x)
        if fused:  # `moe_fused`: the same bits
            routed = idx if routes is not None else idx.numpy()
            buf = self._rows_out(x.shape[0]) if x.shape[0] <= ops.SMALL_CHUNK else None  # a decode step's rows
            out = moe_fused.routed_sum(
                xa, routed, wts, self.experts, self.layer, self.limit, self.act_block, None if buf is None else buf[1],
                by_expert=routes is not None,  # the C router's rows come in expert order
            )  # fmt: skip
            return self._shared(x, out, xa, None if buf is None else buf[0])
        return self.routed_reference(x, idx, wts).add_(self._shared(x))

    def routed_reference(self, x: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        """The routed experts' sum [T, d] expert by expert (one fused call when the first batch holds them all),
        in torch and numpy: the reference `moe_fused.routed_sum` is tested against, and the path without it."""
        out = torch.zeros_like(x)  # [T, d]
        act = self.numerics.act if self.numerics.fp8_activations else None
        routed = idx.numpy()  # [T, k]: the bookkeeping in numpy (a few small arrays per expert)
        wanted = np.unique(routed).tolist()  # one fetch per expert per chunk
        ys = {}
        for batch in self.experts.each_batch(self.layer, wanted):
            if len(batch) == len(wanted) and experts_ffn(
                x,
                routed,
                wts,
                dict(batch),
                wanted,
                self.limit,
                out,
                act_quant=act,
                kernels=self.kernels,
                weight_before_down=self.numerics.official_routing,
                act_block=128 if act else 0,
            ):
                break  # every expert was present at once: computed and summed in one call
            for e, ew in batch:
                tok, slot = (torch.from_numpy(a) for a in np.nonzero(routed == e))
                ys[e] = (tok, self._expert(x[tok], ew, wts[tok, slot], act))
        for e in wanted if ys else ():  # summed in a fixed order, so arrival order never changes the result
            out.index_add_(0, *ys[e])
        return out

    def _expert(self, x: torch.Tensor, ew, w: torch.Tensor, act) -> torch.Tensor:
        """One routed expert on its tokens `x` [n, d] with their routing weights `w` [n] (torch path)."""
        return expert_ffn(
            x,
            ew,
            w,
            self.limit,
            weight_before_down=self.numerics.official_routing,
            act_quant=act,
            kernels=self.kernels,
            act_block=128 if act else 0,
        )

    def span(self, xs: list[torch.Tensor], ids: list[torch.Tensor]) -> list[torch.Tensor]:
        """`self(xs[j], ids[j])` for each piece j of a prefill span ([T_j, d] each), with each routed expert fetched
        once for all pieces: one read of a paged expert serves every token of the span. Bit for bit the calls one
        by one: each expert runs on each piece's tokens exactly as that piece's call runs it (the kernels' path
        depends on the rows of a call), and each piece sums its tokens' experts in the same fixed order."""
        if self.offload is not None:  # a device backend splits each piece's experts itself
            return [self(x, i) for x, i in zip(xs, ids)]
        routes = [self.route(x, i) for x, i in zip(xs, ids)]  # [(idx [T_j, k], wts [T_j, k])]
        routed = [idx.numpy() for idx, _ in routes]
        wanted = [np.unique(r).tolist() for r in routed]
        act = self.numerics.act if self.numerics.fp8_activations else None
        ys: list[dict] = [{} for _ in xs]
        for n, batch in enumerate(
            self.experts.each_batch(self.layer, np.unique(np.concatenate(routed)).tolist(), scan=True)
        ):
            if n == 0 and self.span_next is not None:  # this layer's reads are queued: the next layer's go behind
                self.span_next(xs, ids)
            for e, ew in batch:
                for j, (x, r, (_, wts)) in enumerate(zip(xs, routed, routes)):
                    tok, slot = np.nonzero(r == e)
                    if tok.size:
                        tok, slot = torch.from_numpy(tok), torch.from_numpy(slot)
                        ys[j][e] = (tok, self._expert(x[tok], ew, wts[tok, slot], act))
        outs = []
        for x, want, y in zip(xs, wanted, ys):
            out = torch.zeros_like(x)  # [T_j, d]
            for e in want:  # the fixed order of __call__
                out.index_add_(0, *y[e])
            outs.append(out + self._shared(x))
        return outs

    def guess_span(self, xs: list[torch.Tensor], ids: list[torch.Tensor]) -> list[int]:
        """The experts this layer will likely need for a span (exact for a hash layer; else its router on the
        previous layer's MoE input): what a span prefetches while the previous layer computes."""
        if self.is_hash:
            return np.unique(self.tid2eid[torch.cat(ids)].numpy()).tolist()
        x = torch.cat(xs)  # [T, d]
        scores = ops.per_token(ops.sqrtsoftplus, self.gate(x))  # [T, E]
        return torch.unique(torch.topk(scores + self.bias, self.topk, dim=-1).indices).tolist()

    def _shared(
        self,
        x: torch.Tensor,
        routed: np.ndarray | None = None,
        xa: np.ndarray | None = None,
        result: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The shared expert on x [T, d]; with `routed` (the routed experts' sum, float32 [T, d]) added into it. `xa`:
        x's array (float32, C-contiguous) where the caller has it; `result`: a tensor over `routed` to return (the
        decode step's buffer, `_rows_out`)."""
        y = None if self.shared_fused is None else self.shared_fused(x, routed, xa, result)  # one C call, same bits
        if y is None:
            y = self.shared_reference(x)
            return y if routed is None else torch.from_numpy(routed).add_(y)
        return y

    def _rows_out(self, T: int) -> tuple[torch.Tensor, np.ndarray]:
        """The MoE's output [T, d] for a decode step's T rows, made once per row count (a registered tensor and its
        array, `ops.buffer_tensor`): the caller reads it before this layer's next call."""
        got = self._outs.get(T)
        if got is None:
            a = np.empty((T, self.gate.in_features), np.float32)
            got = self._outs[T] = (ops.buffer_tensor(a), a)
        return got

    def shared_reference(self, x: torch.Tensor) -> torch.Tensor:
        """The shared expert through the ops and `Linear` wrappers: the reference of `moe_fused.shared_expert`."""
        w1, w3, w2 = self.shared
        xq = self.numerics.act(x)
        gate, up = self.shared_up(xq).chunk(2, dim=1) if self.shared_up is not None else (w1(xq), w3(xq))
        mid = ops.limited_swiglu(gate, up, self.limit)  # [T, I]
        return w2(self.numerics.act(mid))


# --- block, MTP block, model ---------------------------------------------------------------------------------


class Block:
    """One V4 layer: X -> mHC(attention) -> mHC(MoE), on [T, n, d] residual streams."""

    def __init__(
        self, w: Weights, cfg: ModelConfig, layer: int, numerics: Numerics, experts: ExpertProvider, kernels: bool
    ) -> None:
        p = f"layers.{layer}." if layer < cfg.num_hidden_layers else f"mtp.{layer - cfg.num_hidden_layers}."
        self.prefix, self.layer, self.ratio, self.eps = p, layer, cfg.ratio(layer), cfg.rms_norm_eps
        self.hc_attn = HyperConnection(w, p + "hc_attn", cfg)
        self.hc_ffn = HyperConnection(w, p + "hc_ffn", cfg)
        self.attn_norm = w.vector(p + "attn_norm.weight")  # [d]
        self.ffn_norm = w.vector(p + "ffn_norm.weight")  # [d]
        self.attn = Attention(w, p + "attn.", cfg, self.ratio, numerics)
        self.ffn = MoE(w, p + "ffn.", cfg, layer, numerics, experts, kernels)

    def __call__(self, X: torch.Tensor, ids: torch.Tensor, p0: int, state: LayerState) -> torch.Tensor:
        u, post, comb = self.hc_attn.pre(X, self.attn_norm)  # [T, d] (normed), [T, n], [T, n, n]
        X = HyperConnection.post(self.attn(u, p0, state), X, post, comb)
        u, post, comb = self.hc_ffn.pre(X, self.ffn_norm)
        return HyperConnection.post(self.ffn(u, ids), X, post, comb)

    def span(
        self, Xs: list[torch.Tensor], ids: list[torch.Tensor], p0: int, state: LayerState, max_rollback: int | None
    ) -> list[torch.Tensor]:
        """`__call__` on the consecutive pieces Xs[j] [T_j, n, d] of a prefill span from position p0: attention
        piece after piece (advancing `state` as `DeepseekV4.forward` does between calls), then the MoE of all pieces
        with each routed expert fetched once (`MoE.span`). Bit for bit the pieces through `__call__` in turn."""
        mixed = []
        for X in Xs:
            u, post, comb = self.hc_attn.pre(X, self.attn_norm)
            X = HyperConnection.post(self.attn(u, p0, state), X, post, comb)
            p0 += X.shape[0]
            state.length = p0
            state.trim(max_rollback)
            mixed.append(X)
        pre = [self.hc_ffn.pre(X, self.ffn_norm) for X in mixed]  # [(normed u [T_j, d], post, comb)]
        ys = self.ffn.span([u for u, _, _ in pre], ids)
        return [HyperConnection.post(y, X, post, comb) for y, X, (_, post, comb) in zip(ys, mixed, pre)]

    def rows(self, X: torch.Tensor, ids: torch.Tensor, states: list[LayerState]) -> torch.Tensor:
        """`__call__` for one new token of each of B sequences (`Attention.rows`): X [B, n, d], ids [B]."""
        u, post, comb = self.hc_attn.pre(X, self.attn_norm)
        X = HyperConnection.post(self.attn.rows(u, states), X, post, comb)
        u, post, comb = self.hc_ffn.pre(X, self.ffn_norm)
        return HyperConnection.post(self.ffn(u, ids), X, post, comb)


class MTPBlock:
    """Multi-token prediction: from the main model's final streams at position i and the embedding of token
    i+1, one more V4 block (ratio 0) and its own HC head + norm, with the shared LM head -> logits for i+2."""

    def __init__(
        self, w: Weights, cfg: ModelConfig, k: int, numerics: Numerics, experts: ExpertProvider, kernels: bool
    ) -> None:
        p = f"mtp.{k}."
        self.e_proj, self.h_proj = w.linear(p + "e_proj"), w.linear(p + "h_proj")  # FP8 [d, d]
        self.enorm, self.hnorm = w.vector(p + "enorm.weight"), w.vector(p + "hnorm.weight")  # [d]
        self.norm = w.vector(p + "norm.weight")  # [d]
        self.hc_head = HyperHead(w, p, cfg)
        self.block = Block(w, cfg, cfg.num_hidden_layers + k, numerics, experts, kernels)
        self.eps, self.numerics = cfg.rms_norm_eps, numerics

    def __call__(
        self, X: torch.Tensor, emb_next: torch.Tensor, ids_next: torch.Tensor, p0: int, state: LayerState
    ) -> torch.Tensor:
        """X [T, n, d] main streams, emb_next [T, d] -> normed output [T, d] (before the LM head)."""
        act = self.numerics.act
        e = self.e_proj(act(ops.rms_norm(emb_next, self.enorm, self.eps)))  # [T, d]
        # n product rows per token: token by token in small chunks, where the kernels' invariance holds (<= 8 rows)
        h = ops.per_token(self._streams, X)  # [T, n, d]
        Y = self.block(e[:, None, :] + h, ids_next, p0, state)  # [T, n, d]
        return self.hc_head(Y, self.norm)

    def _streams(self, X: torch.Tensor) -> torch.Tensor:
        T, n, d = X.shape
        return self.h_proj(self.numerics.act(ops.rms_norm(X, self.hnorm, self.eps).reshape(T * n, d))).view(T, n, d)


def _on_device(fn):
    """A `DeepseekV4` entry point run inside its backend's scope (`fastar.model.device`: tensors made on the device,
    ops on their torch paths), with the logits it returns brought to the host; without a backend, as it is."""

    @functools.wraps(fn)
    def run(self, *args, **kw):
        if self.backend is None:
            return fn(self, *args, **kw)
        with self.backend.scope():
            out = fn(self, *args, **kw)
        if isinstance(out, torch.Tensor):
            return out.cpu()
        return (out[0].cpu(), *out[1:]) if isinstance(out, tuple) else out

    return run


class DeepseekV4:
    """The model over a `WeightSource`. Weights stay in the source's storage precision; see module docstring.

    Args:
        source: any `WeightSource` (a `.fst` file, an official checkpoint directory).
        numerics: "official" (default), "reference" or a `Numerics`.
        kernels: use `fastar.quant.kernels` for weight products where available.
        experts: routed-expert provider with `get(layer, e)`; default reads the source directly.
        max_rollback: positions a state keeps for `truncate` (None = all).
        lookahead: with a prefetching expert provider, apply layer L+1's router to layer L's MoE input and
            prefetch what it picks (hash-routed layers are always prefetched exactly from the token ids).
        backend: a `fastar.model.device.DeviceBackend` to run on a torch device (build with its `build_model`);
            None: the CPU with the C kernels. Logits come back on the host either way.
        head_screen: keep the LM head also as int8 (`fastar.model.head_screen`) so that decode rows asked for
            their argmax only (`argmax_only`: True, or a sampled row's `Race`) compute the exact logits of the rows
            that can hold it (win the race) and no others
            (the C kernels on the CPU only; +0.5 GB on Flash).
    """

    def __init__(
        self,
        source: WeightSource,
        numerics: str | Numerics = "official",
        kernels: bool = True,
        experts: ExpertProvider | None = None,
        max_rollback: int | None = None,
        lookahead: bool = False,
        backend=None,
        head_screen: bool = False,
    ) -> None:
        cfg = source.config
        self.config, self.numerics, self.max_rollback = cfg, Numerics.named(numerics), max_rollback
        self.experts = experts if experts is not None else SourceExperts(source)
        self.backend = backend
        w = Weights(source, kernels) if backend is None else backend.weights(source)
        self.embed = w.linear("embed", streamed=False)  # BF16 [V, d]: rows looked up, left in the file's mapping
        self.layers = [Block(w, cfg, i, self.numerics, self.experts, kernels) for i in range(cfg.num_hidden_layers)]
        # positions computed exactly: all (None) unless a ratio-4 layer lacks its indexer (see Attention)
        self.max_positions = min((b.attn.max_positions for b in self.layers if b.attn.max_positions), default=None)
        self.hc_head = HyperHead(w, "", cfg)
        self.norm = w.vector("norm.weight")  # [d]
        self.head: Linear = w.linear("head")  # BF16 [V, d]
        self.screen = HeadScreen.build(self.head) if head_screen and backend is None and kernels else None
        # forward_rows' mHC sites chained in one C call per sub-layer (`hc_chain`; None: `Block.rows`' calls)
        self.hc_chain = HCChain.build(self.layers, self.hc_head, self.norm, self.embed) if backend is None else None
        if lookahead and self.experts.pages:  # a provider that does not page gains nothing from the guesses
            prefetch = self.experts.prefetch
            for cur, nxt in zip(self.layers, self.layers[1:]):
                cur.ffn.lookahead = lambda x, xa, m=nxt.ffn: prefetch(m.layer, m.guess(x, xa), source="lookahead")
        if self.experts.pages:  # a span knows (nearly) every expert of the next layer: read it behind this one
            for cur, nxt in zip(self.layers, self.layers[1:]):
                cur.ffn.span_next = lambda xs, ids, m=nxt.ffn: self.experts.prefetch(
                    m.layer, m.guess_span(xs, ids), source="hash" if m.is_hash else "lookahead", scan=True
                )
        self.hash_tables = {b.layer: b.ffn.tid2eid.cpu().numpy() for b in self.layers if b.ffn.is_hash}
        angles: dict = {}  # one table of RoPE angles per frequency set for every layer (`Attention.rows`)
        for b in self.layers:
            b.attn.angles = angles
        has_mtp = cfg.num_mtp_layers > 0 and not cfg.has_dspark and w.has("mtp.0.e_proj.weight")
        self.mtp = (
            [MTPBlock(w, cfg, k, self.numerics, self.experts, kernels) for k in range(cfg.num_mtp_layers)]
            if has_mtp
            else []
        )
        if backend is not None:
            backend.attach(self)

    def _place(self, state: ModelState) -> None:
        """A state read from bytes comes back on the host: moved to the backend's device before use."""
        if self.backend is not None and state.layers and state.layers[0].kv.device != self.backend.device:
            state.to(self.backend.device)

    @_on_device
    def new_state(self, fmt: StateFormat | None = None) -> ModelState:
        """An empty decode state; `fmt` how it stores rows (default: the numerics' own, `Numerics.state_format`;
        `StateFormat()` keeps float32 rows, which computes the same bits)."""
        cfg = self.config
        fmt = self.numerics.state_format(cfg) if fmt is None else fmt

        def layer(i: int) -> LayerState:
            return LayerState.new(cfg.ratio(i), cfg.sliding_window, cfg.head_dim, cfg.index_head_dim, fmt)

        L = cfg.num_hidden_layers
        return ModelState([layer(i) for i in range(L)], [layer(L + k) for k in range(len(self.mtp))], self.max_rollback)

    @_on_device
    @torch.inference_mode()
    def forward(
        self,
        ids: list[int] | torch.Tensor,
        state: ModelState,
        all_logits: bool = True,
        collect: list | None = None,
        capture: dict | None = None,
        chunk: int | None = None,
        argmax_only: HeadRequest = False,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Process tokens `ids` [T] at positions state.length.. and advance `state`.

        `chunk` (a prefill over paged experts): run the tokens as a span of pieces of `chunk` (`_span`), bit for bit
        `forward` on each piece in turn, but each routed expert fetched once per layer for the whole span and the
        pager asked to evict as for a scan. Calls of at most `ops.SMALL_CHUNK` tokens (decode) ignore it.

        Returns (logits [T, V] float32, or [1, V] for the last position when `all_logits` is False; final
        residual streams [T, n, d], the MTP input). `collect`, when a list, receives the streams after every
        block (for `fastar audit`). `capture`, when a dict, gets `capture[i]` = the streams [T, n, d] entering
        block i for each key i (DSpark reads the target's state entering its target layers).
        `argmax_only` (with `all_logits` False): the caller takes the last position's argmax and nothing else from
        the logits (True), or the argmax of a `Race` over them (a sampled token), or a `Ban` of either (the same over
        the tokens not banned: `HeadRequest`); with the head screen, only the rows that can hold it (win the race) are
        exact, the others -inf.
        """
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        self._place(state)
        p0, T = state.length, ids.shape[0]
        if T == 0:
            raise ValueError("forward needs at least one token")
        if chunk is not None and (chunk < T or ops.SMALL_CHUNK < T) and collect is None and capture is None:
            return self._span(ids, state, all_logits, chunk, argmax_only)
        self.experts.prefetch_tokens(ids.tolist(), self.hash_tables)  # hash-routed layers: known from the ids alone
        X = self.embed.rows(ids)[:, None, :].expand(T, self.config.hc_mult, -1)  # [T, n, d]
        for i, (block, s) in enumerate(zip(self.layers, state.layers)):
            if capture is not None and i in capture:
                capture[i] = X
            X = block(X, ids, p0, s)
            s.length = p0 + T
            s.trim(state.max_rollback)
            if collect is not None:
                collect.append(X)
            if state.on_layer is not None:
                state.on_layer(i + 1, len(self.layers))
        if argmax_only and not all_logits:
            return self._head(X[-1:], [argmax_only]), X
        return self._head(X if all_logits else X[-1:]), X

    def _span(
        self, ids: torch.Tensor, state: ModelState, all_logits: bool, chunk: int, argmax_only: HeadRequest = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward` of ids [T] as pieces of `chunk` tokens taken layer by layer: each block's attention piece after
        piece, then its MoE over the whole span (`Block.span`), so a paged expert is read once per span instead of
        once per piece while every number is what the pieces one by one give. The next layer's experts are
        prefetched while a layer's MoE runs (`MoE.span_next`), and the pager evicts as for a scan."""
        cfg, T = self.config, ids.shape[0]
        p0 = state.length
        pieces = list(ids.split(chunk))  # [T_j]
        for b in self.layers:  # the hash layers' experts are known from the ids: read them from the start
            if b.ffn.is_hash:
                self.experts.prefetch(b.layer, b.ffn.guess_span([], pieces), "hash", scan=True)
        Xs = [self.embed.rows(i)[:, None, :].expand(i.shape[0], cfg.hc_mult, -1) for i in pieces]  # [T_j, n, d]
        for i, (block, s) in enumerate(zip(self.layers, state.layers)):
            Xs = block.span(Xs, pieces, p0, s, state.max_rollback)
            s.length = p0 + T
            if state.on_layer is not None:
                state.on_layer(i + 1, len(self.layers))
        if argmax_only and not all_logits:  # the last position's argmax alone, as `forward` gives it
            return self._head(Xs[-1][-1:], [argmax_only]), torch.cat(Xs)
        heads = Xs if all_logits else [Xs[-1][-1:]]  # per piece: the head's rows as the pieces' calls give them
        return torch.cat([self._head(h) for h in heads]), torch.cat(Xs)

    def _head(self, X: torch.Tensor, argmax_only: list[HeadRequest] | None = None) -> torch.Tensor:
        """Final streams X [T, n, d] -> logits [T, V] float32: HC head, final norm, LM head. When every row is
        argmax_only and there are few enough for the head screen to pay (`HeadScreen.MAX_ROWS`), the screen:
        exact where the rows can hold their argmax, -inf elsewhere."""
        return self._logits(self.hc_head(X, self.norm), argmax_only)

    def _logits(self, y: torch.Tensor, argmax_only: list[HeadRequest] | None = None) -> torch.Tensor:
        """`_head` from the final norm's output y [T, d] on: the LM head, or the screen (see `_head`)."""
        if self.screen is not None and argmax_only and all(argmax_only) and len(argmax_only) <= HeadScreen.MAX_ROWS:
            return self.screen.logits(y, [a if isinstance(a, (Race, Ban)) else None for a in argmax_only])
        return self.head(y)

    @_on_device
    @torch.inference_mode()
    def head_logits(self, X: torch.Tensor) -> torch.Tensor:
        """The logits [T, V] float32 of final streams X [T, n, d] (what `forward` returns second), as `forward`
        computes them for those rows: for scoring every position of a prompt a few rows at a time
        (`fastar.engine.prompt_logprobs`) instead of holding [T, V] for a whole chunk."""
        return self._head(X)

    @_on_device
    @torch.inference_mode()
    def rows_match_forward(self) -> bool:
        """Whether `forward_rows` now gives every row `forward`'s bits: on the CPU, on the C kernels' SIMD dot path
        (batch invariance is its promise; the torch path and the scalar ISA do not make it). Then a lone decode
        token may take `forward_rows`, whose step is the better fused one (the engine's `prefill` does)."""
        return self.backend is None and _kernels_built() and _kernels_isa() != "scalar"

    def forward_rows(
        self, ids: list[int], states: list[ModelState], argmax_only: list[HeadRequest] | None = None
    ) -> torch.Tensor:
        """One decode step of B sequences at once: token ids[b] at position states[b].length, advancing each
        state. -> logits [B, V] float32, row b bit-identical to `forward([ids[b]], states[b], all_logits=False,
        argmax_only=argmax_only[b])` (argmax_only: see `forward`)
        (with the C kernels' SIMD dot path, B <= `ops.SMALL_CHUNK`): the weights are read once for the B rows
        and the MoE fetches the union of the rows' experts once per layer; attention and the compressors run
        per row on each sequence's own state (`Attention.rows`). The states must be distinct objects."""
        ids = torch.as_tensor(ids, dtype=torch.long).reshape(-1)
        B = ids.shape[0]
        if B == 0 or len(states) != B or B > ops.SMALL_CHUNK:
            raise ValueError(
                f"forward_rows takes 1 to {ops.SMALL_CHUNK} tokens, one per state "
                f"(got {B} tokens, {len(states)} states)"
            )
        if len({id(s) for s in states}) != B:
            raise ValueError("forward_rows needs a distinct state per token")
        if self.backend is not None:
            for s in states:
                self._place(s)
        listed = ids.tolist()
        self.experts.prefetch_tokens(listed, self.hash_tables)  # hash-routed layers: known from the ids
        emb = u = None
        if self.hc_chain is not None:  # the embedding's rows straight into the chain's streams, else through `begin`
            u = self.hc_chain.begin_ids(listed)
            if u is None:
                emb = self.embed.rows_array(listed)  # [B, d]: `embed.rows`' values
                emb = torch.from_numpy(emb) if emb is not None else self.embed.rows(ids)
                u = self.hc_chain.begin(emb)
        if u is not None:  # the mHC sites chained over preallocated streams (`hc_chain`): `Block.rows`' bits
            step: dict = {}  # what the layers share within the step (`Attention.rows`: the RoPE angles)
            for i, block in enumerate(self.layers):
                layers = [s.layers[i] for s in states]
                u = self.hc_chain.then(block.attn.rows(u, layers, step))
                u = self.hc_chain.then(block.ffn(u, ids))
                for s, ls in zip(states, layers):
                    ls.length += 1
                    if s.max_rollback is not None:  # (`trim` keeps everything without a bound)
                        ls.trim(s.max_rollback)
            return self._logits(u, argmax_only)
        emb = emb if emb is not None else self.embed.rows(ids)
        X = emb[:, None, :].expand(B, self.config.hc_mult, -1)  # [B, n, d]
        for i, block in enumerate(self.layers):
            X = block.rows(X, ids, [s.layers[i] for s in states])
            for s in states:
                s.layers[i].length += 1
                s.layers[i].trim(s.max_rollback)
        return self._head(X, argmax_only)

    @_on_device
    @torch.inference_mode()
    def mtp_logits(
        self, X: torch.Tensor, next_ids: list[int] | torch.Tensor, state: ModelState, k: int = 0
    ) -> torch.Tensor:
        """MTP block k on main streams X [T, n, d] at MTP positions state.mtp[k].length.. with the tokens that
        follow them (`next_ids` [T] = t_{i+1}); returns logits [T, V] predicting t_{i+2}."""
        if not self.mtp:
            raise ValueError("this model has no MTP block")
        ids = torch.as_tensor(next_ids, dtype=torch.long).reshape(-1)
        self._place(state)
        s = state.mtp[k]
        p0 = s.length
        y = self.mtp[k](X, self.embed.rows(ids), ids, p0, s)  # [T, d]
        s.length = p0 + ids.shape[0]
        s.trim(state.max_rollback)
        return self.head(y)
