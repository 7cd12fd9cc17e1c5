"""The attention block's decode-time work around its products as one C call each (the C extension's
`attn_project`, `attn_output` and `index_queries`, fastar/quant/csrc/bind_blocks.c).

Owns: `FusedAttention`, built once per layer from the `Attention`'s weights: `project` (the query and KV projections
with their norms, FP8 activation rounding and RoPE) and `output` (inverse RoPE, the bfloat16 input of `wo_a`, the
grouped O-LoRA product and `wo_b`) for a decode step's rows. At decode each of these is a dozen Python-level ops
around two weight products, and their dispatch cost more than their arithmetic; the C calls run the same C routines
in the same order on the same values, so they return exactly what `Attention._project` / `Attention._output` return
op by op on the C extension (those stay the reference; tests/test_fused_blocks.py compares the bits). Likewise
`FusedIndexer.queries`, the lightning indexer's queries and head weights (`Indexer.queries`), once its scoring starts.
Does not own: the math (deepseek_v4.py's `Attention`), the state updates and attention between the two calls.
Each method returns None where the C calls do not apply (the extension not built or turned off for a torch-only
run, a chunk longer than a decode step's rows, weights without a C product); the caller then runs its own path.
"""

from __future__ import annotations

import numpy as np
import torch

from ..quant import kernels
from ..quant.linear import Linear
from . import ops


class FusedAttention:
    """One layer's fused decode calls over its weights (see the module docstring)."""

    def __init__(
        self,
        wq_a_kv: Linear,
        q_lora: int,
        wq_b: Linear,
        q_norm: torch.Tensor,
        kv_norm: torch.Tensor,
        wo_a: Linear,
        wo_b: Linear,
        heads: int,
        groups: int,
        eps: float,
        act_block: int,
        nope_block: int,
        bf16_wo_a: bool,
    ) -> None:
        self.a, self.b = wq_a_kv.kernel_operands(), wq_b.kernel_operands()
        self.oa, self.ob = wo_a.kernel_operands(), wo_b.kernel_operands()
        self.q_lora, self.heads, self.groups, self.eps = q_lora, heads, groups, float(eps)
        self.act_block, self.nope_block, self.bf16_wo_a = act_block, nope_block, bf16_wo_a
        self.q_norm, self.kv_norm = q_norm.contiguous().numpy(), kv_norm.contiguous().numpy()
        self.head_dim = wq_a_kv.out_features - q_lora
        self.d = wo_b.out_features
        self._outs: dict[int, tuple] = {}  # `project`'s outputs by row count: ((q, qr, kv), their arrays)
        self._outputs: dict[int, tuple] = {}  # `output`'s, by row count: (tensor, array); read before the next call

    @classmethod
    def build(cls, wq_a_kv: Linear | None, wq_b: Linear, wo_a: Linear, wo_b: Linear, **kw) -> FusedAttention | None:
        """The fused calls over these weights, or None where some has no C product or `wo_a`'s groups would split an
        FP8 scale block (its product then runs group by group, not as one grouped call)."""
        if wq_a_kv is None or any(w.kernel_operands() is None for w in (wq_a_kv, wq_b, wo_a, wo_b)):
            return None
        rank = wo_a.out_features // kw["groups"]
        if wo_a.is_fp8 and rank % 128:
            return None
        return cls(wq_a_kv=wq_a_kv, wq_b=wq_b, wo_a=wo_a, wo_b=wo_b, **kw)

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """`Attention._project(x, cos, sin)` for a decode step's rows x [T, d] (T <= `ops.SMALL_CHUNK`) -> (q [T, H,
        D], qr [T, q_lora], kv [T, D]), or None where the C call does not apply."""
        T = x.shape[0]
        args = ops.c_arrays(x, cos, sin) if T <= ops.SMALL_CHUNK else None
        if args is None:
            return None
        outs = self._outs.get(T)
        if outs is None:  # made once per row count: every caller reads them before this layer projects again
            arrays = [np.empty(s, np.float32) for s in ((T, self.heads, self.head_dim), (T, self.q_lora))]
            arrays.append(np.empty((T, self.head_dim), np.float32))
            tensors = tuple(ops.buffer_tensor(a) for a in arrays)  # their arrays back from `ops.c_arrays` unchecked
            outs = self._outs[T] = (tensors, (arrays[0].reshape(T, -1), arrays[1], arrays[2]))
        (wa, sa), (wb, sb) = self.a, self.b
        kernels.extension.attn_project(
            args[0], wa, sa, self.q_lora, wb, sb, self.q_norm, self.kv_norm, args[1], args[2], self.eps,
            self.act_block, self.nope_block, *outs[1],
        )  # fmt: skip
        return outs[0]

    def output(self, o: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor | None:
        """`Attention._output(o, cos, sin)` for a decode step's attention outputs o [T, H, D] -> [T, d], or None
        where the C call does not apply."""
        T = o.shape[0]
        args = ops.c_arrays(o, cos, sin) if T <= ops.SMALL_CHUNK else None
        if args is None:
            return None
        got = self._outputs.get(T)
        if got is None:  # made once per row count, registered: the next C call (the mHC chain's) takes it unchecked
            a = np.empty((T, self.d), np.float32)
            got = self._outputs[T] = (ops.buffer_tensor(a), a)
        (wa, sa), (wb, sb) = self.oa, self.ob
        kernels.extension.attn_output(
            args[0].reshape(T, -1), args[1], args[2], self.heads, self.bf16_wo_a, wa, sa, self.groups,
            self.act_block, wb, sb, got[1],
        )  # fmt: skip
        return got[0]


class FusedIndexer:
    """The lightning indexer's decode-time queries in one C call (the C extension's `index_queries`): the FP8
    rounding of the Q-LoRA latent, wq_b, RoPE, the Hadamard rotation and FP4 rounding, and the head weights
    (weights_proj times Hi^-1/2), as `Indexer.queries` runs them op by op (the same C routines in the same order: the
    same bits; tests/test_fused_blocks.py)."""

    def __init__(self, wq_b: Linear, weights_proj: Linear, heads: int, act_block: int, rotate: bool) -> None:
        self.b, self.w = wq_b.kernel_operands(), weights_proj.kernel_operands()
        self.heads, self.act_block, self.rotate = heads, act_block, rotate
        self.width, self.w_scale = wq_b.out_features, heads**-0.5

    @classmethod
    def build(cls, wq_b: Linear, weights_proj: Linear, **kw) -> FusedIndexer | None:
        """The fused call over these weights, or None where one has no C product."""
        if wq_b.kernel_operands() is None or weights_proj.kernel_operands() is None:
            return None
        return cls(wq_b, weights_proj, **kw)

    def queries(
        self, x: torch.Tensor, qr: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """`Indexer.queries` for a decode step's rows x [T, d] (T <= `ops.SMALL_CHUNK`) with their Q-LoRA latents qr
        [T, q_lora] and RoPE angles -> (queries [T, Hi, Di], head weights [T, Hi]), or None where the C call does not
        apply."""
        T = x.shape[0]
        args = ops.c_arrays(qr, x, cos, sin) if T <= ops.SMALL_CHUNK else None
        if args is None:
            return None
        q, w = torch.empty(T, self.heads, self.width // self.heads), torch.empty(T, self.heads)
        (wb, sb), (ww, sw) = self.b, self.w
        kernels.extension.index_queries(
            args[0], wb, sb, args[1], ww, sw, args[2], args[3], self.heads, self.act_block, self.rotate,
            self.w_scale, q.numpy().reshape(T, -1), w.numpy(),
        )  # fmt: skip
        return q, w
