"""DSpark draft model of DeepSeek-V4-Flash-0731: three draft stages that propose a block of tokens at once.

Owns: `DSparkDraft` - the context projection (target HC states entering the target layers -> `main_x`), the
per-stage context KV rows, the three stages (V4 blocks with mHC and MoE whose attention sees the context window
plus the whole block, bidirectionally), the draft head (`mtp.2.hc_head_*`, `mtp.2.norm`, the target's shared
`head.weight`), the Markov head and the confidence head. Does not own: the target model, the acceptance rule and
the loop (`fastar.engine.speculative`), the decode-state layout (`fastar.model.state`; each stage's context lives
in one `LayerState` whose `kv` rows are indexed by target position, kept in `ModelState.mtp`).

What is read and what is inferred (architecture doc section 4.2; no real 0731 weights exist here to check against):
  [read] tensors and shapes: `mtp.0.main_proj` FP8 [d, 3d] + `mtp.0.main_norm`; stages `mtp.{0,1,2}` are full V4
    blocks (ratio 0, score-routed MoE); `mtp.2.norm`, `mtp.2.hc_head_*`, `mtp.2.markov_head.markov_w{1,2}`
    [V, rank], `mtp.2.confidence_head.proj` [1, d + rank]; block size 5, noise token, target layers 40-42.
  [read, third-party] the context is the target's HC state *entering* each target layer, averaged over the
    streams: `main_x = main_norm(main_proj(concat(h40, h41, h42)))`.
  [read] block = [anchor, noise x 4] at positions p+1..p+5 after the context ending at p; attention keys = the
    sliding window of context rows ending at p plus all block rows, bidirectional inside the block.
  [inferred] a context row is `RoPE(kv_norm(wkv(main_x)))` at the target position, with no attn_norm and no mHC
    (main_x is already normed and has one stream), FP8-simulated like any KV row under `official` numerics; every
    block slot sees the same context window (ending at p); RoPE theta is the ratio-0 one.
  [read] slot k predicts the token after slot k's input (slot 0 = anchor -> the first draft), so a block of 5
    gives up to 5 drafts; Markov head `logits_k = U_k + markov_w2 . markov_w1[x_prev]`; confidence
    `c_k = sigmoid(proj . [h_k ; markov_w1[x_prev]])` with h_k the pre-norm HC-head output of slot k.
A context row whose target state was not kept (after a rollback across requests, or a restored session) is
stored as zeros and masked out of attention: it only costs draft quality, never correctness.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..config import ModelConfig
from ..contracts import ExpertProvider
from ..quant.linear import Linear, Weights
from . import ops
from .deepseek_v4 import Block, HyperConnection, HyperHead, Numerics, attend_torch
from .state import LayerState, RowBuffer


@dataclass
class DraftBlock:
    """One drafted block: tokens x_1..x_k, the draft distributions they were drawn from, their confidences."""

    tokens: list[int]
    probs: torch.Tensor | None  # [k, V] processed draft distributions (None when greedy)
    confidence: list[float]  # c_1..c_k (conditional: slot k accepted given slots < k were)
    logits: torch.Tensor  # [k, V] raw draft logits (base + Markov term)


class DSparkStage:
    """One draft stage: a V4 block whose attention reads the stage's context rows plus the block."""

    def __init__(
        self, w: Weights, cfg: ModelConfig, k: int, numerics: Numerics, experts: ExpertProvider, kernels: bool
    ) -> None:
        self.block = Block(w, cfg, cfg.num_hidden_layers + k, numerics, experts, kernels)
        self.attn, self.numerics, self.eps = self.block.attn, numerics, cfg.rms_norm_eps

    def _kv(self, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """KV rows of inputs x [T, d] at positions pos [T] -> [T, D] (the same path as the target's KV)."""
        a = self.attn
        kv = ops.rms_norm(a.wkv(self.numerics.act(x)), a.kv_norm, self.eps)  # [T, D]
        kv = ops.apply_rope(kv, *ops.rope_cos_sin(a.inv_freq, pos))
        return a._fp8_nope(kv) if self.numerics.fp8_kv else kv

    def context_rows(self, main_x: torch.Tensor, p0: int) -> torch.Tensor:
        """Context KV rows [T, D] of main_x [T, d] at target positions p0..p0+T-1."""
        return self._kv(main_x, torch.arange(p0, p0 + main_x.shape[0]))

    def _attention(self, x: torch.Tensor, ctx: torch.Tensor, p: int) -> torch.Tensor:
        """x [B, d] (normed) at positions p..p+B-1 attends to ctx [K, D] and to every block row -> [B, d]."""
        a, act = self.attn, self.numerics.act
        B, H, D = x.shape[0], a.H, a.D
        pos = torch.arange(p, p + B)
        cos, sin = ops.rope_cos_sin(a.inv_freq, pos)
        xq = act(x)
        qr = ops.rms_norm(a.wq_a(xq), a.q_norm, self.eps)  # [B, q_lora]
        q = a.wq_b(act(qr)).view(B, H, D)
        q = ops.apply_rope(ops.rms_norm(q, None, self.eps), cos, sin)  # [B, H, D]
        keys = torch.cat([ctx, self._kv(x, pos)])  # [K + B, D]
        mask = (keys.abs().amax(-1) > 0)[None, :].expand(B, -1)  # all-zero context rows are missing ones
        o = attend_torch(q, keys, mask, None, None, None, a.sinks, D**-0.5)  # [B, H, D] (any mask: torch)
        o = ops.apply_rope(o, cos, sin, inverse=True)
        z = a.wo_a.grouped(o.reshape(B, a.groups, H * D // a.groups))  # [B, G, R]
        return a.wo_b(act(z.reshape(B, -1)))  # [B, d]

    def __call__(self, X: torch.Tensor, ids: torch.Tensor, ctx: torch.Tensor, p: int) -> torch.Tensor:
        """X [B, n, d] block streams -> [B, n, d]."""
        b = self.block
        u, post, comb = b.hc_attn.pre(X)
        X = HyperConnection.post(self._attention(ops.rms_norm(u, b.attn_norm, self.eps), ctx, p), X, post, comb)
        u, post, comb = b.hc_ffn.pre(X)
        return HyperConnection.post(b.ffn(ops.rms_norm(u, b.ffn_norm, self.eps), ids), X, post, comb)


class DSparkDraft:
    """The three DSpark stages and their heads over a `Weights` (shared embedding and LM head from the target).

    Args:
        w: the checkpoint's weights (`mtp.0`..`mtp.{S-1}` hold the stages).
        cfg: the model config (`dspark_*` fields set).
        numerics, experts, kernels: as the target's (`DeepseekV4`).
        embed, head: the target's `embed` and `head` (`Linear`s), shared as in the release.
    """

    def __init__(
        self,
        w: Weights,
        cfg: ModelConfig,
        numerics: Numerics,
        experts: ExpertProvider,
        kernels: bool,
        embed: Linear,
        head: Linear,
    ) -> None:
        if not cfg.has_dspark:
            raise ValueError("this checkpoint has no DSpark stages (dspark_block_size is not set)")
        self.cfg, self.numerics, self.eps = cfg, numerics, cfg.rms_norm_eps
        self.targets = tuple(cfg.dspark_target_layer_ids)
        bad = [t for t in self.targets if not 0 < t < cfg.num_hidden_layers]
        if bad:
            raise ValueError(
                f"DSpark target layers {bad} are not inner layers of a {cfg.num_hidden_layers}-layer model"
            )
        self.block_size, self.noise = cfg.dspark_block_size, cfg.dspark_noise_token_id
        self.window, self.head_dim = cfg.sliding_window, cfg.head_dim
        self.embed, self.head = embed, head
        last = cfg.num_mtp_layers - 1
        self.main_proj = w.linear("mtp.0.main_proj")  # FP8 [d, 3d]
        self.main_norm = w.vector("mtp.0.main_norm.weight")  # [d]
        self.stages = [DSparkStage(w, cfg, k, numerics, experts, kernels) for k in range(cfg.num_mtp_layers)]
        p = f"mtp.{last}."
        self.hc_head = HyperHead(w, p, cfg)
        self.norm = w.vector(p + "norm.weight")  # [d]
        self.markov_w1 = w.linear(p + "markov_head.markov_w1")  # BF16 [V, rank] (a lookup table)
        self.markov_w2 = w.linear(p + "markov_head.markov_w2")  # BF16 [V, rank]
        self.confidence_proj = w.linear(p + "confidence_head.proj")  # BF16 [1, d + rank]

    # --- context -------------------------------------------------------------------------------------------

    def new_states(self, start: int = 0) -> list[LayerState]:
        """Empty context states (one per stage) whose first row will be position `start`."""
        return [LayerState(0, self.window, RowBuffer(self.head_dim, start), length=start) for _ in self.stages]

    @torch.inference_mode()
    def main_x(self, captured: dict[int, torch.Tensor]) -> torch.Tensor:
        """Target streams entering the target layers {layer: [T, n, d]} -> main_x [T, d]."""
        h = torch.cat([captured[t].mean(dim=1) for t in self.targets], dim=-1)  # [T, 3d]
        return ops.rms_norm(self.main_proj(self.numerics.act(h)), self.main_norm, self.eps)

    @torch.inference_mode()
    def extend(
        self, states: list[LayerState], main_x: torch.Tensor | None, p0: int, T: int, max_rollback: int | None
    ) -> None:
        """Append the context rows of positions p0..p0+T-1 (zeros = missing when main_x is None)."""
        for stage, s in zip(self.stages, states):
            assert s.length == p0, (s.length, p0)
            rows = torch.zeros(T, self.head_dim) if main_x is None else stage.context_rows(main_x, p0)
            s.kv.append(rows)
            s.length = p0 + T
            s.trim(max_rollback)

    # --- drafting ------------------------------------------------------------------------------------------

    @torch.inference_mode()
    def base(self, states: list[LayerState], anchor: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the block [anchor, noise...] after the context -> (base logits U [B, V], pre-norm head h [B, d]).

        The anchor sits at position p+1 where p = the last context position (states' length - 1).
        """
        p = states[0].length
        B = self.block_size
        ids = torch.tensor([anchor] + [self.noise] * (B - 1))
        X = self.embed.rows(ids)[:, None, :].expand(B, self.cfg.hc_mult, -1)  # [B, n, d]
        for stage, s in zip(self.stages, states):
            k0 = max(s.kv.start, p - self.window)
            X = stage(X, ids, s.kv.rows(k0, p), p)  # context window: positions p-W..p-1 (those still kept)
        h = self.hc_head(X)  # [B, d]
        return self.head(ops.rms_norm(h, self.norm, self.eps)), h

    @torch.inference_mode()
    def markov(self, U: torch.Tensor, h: torch.Tensor, prev: int) -> tuple[torch.Tensor, float]:
        """Slot logits with the Markov term, and the slot's confidence, given the previous token."""
        e = self.markov_w1.rows(torch.tensor([prev]))  # [1, rank]
        logits = U + self.markov_w2(e)[0]  # [V]
        c = torch.sigmoid(self.confidence_proj(torch.cat([h[None], e], dim=-1))[0, 0])
        return logits, float(c)

    @torch.inference_mode()
    def draft(
        self,
        states: list[LayerState],
        anchor: int,
        k: int,
        pick: Callable[[torch.Tensor], tuple[int, torch.Tensor | None]],
    ) -> DraftBlock:
        """Up to k drafts after `anchor`: the block runs once, then the Markov head picks left to right with
        `pick(logits) -> (token, processed probs | None)` (the caller's sampler)."""
        U, h = self.base(states, anchor)
        tokens, probs, conf, rows = [], [], [], []
        prev = anchor
        for j in range(min(k, self.block_size)):
            logits, c = self.markov(U[j], h[j], prev)
            tok, q = pick(logits)
            tokens.append(tok)
            probs.append(q)
            conf.append(c)
            rows.append(logits)
            prev = tok
        qs = None if not probs or probs[0] is None else torch.stack(probs)
        return DraftBlock(tokens, qs, conf, torch.stack(rows) if rows else torch.empty(0))
