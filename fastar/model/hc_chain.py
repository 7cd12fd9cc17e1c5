"""A decode step's mHC sites chained: `DeepseekV4.forward_rows`' residual streams in preallocated buffers, each
sub-layer's mix back and the next site's collapse in one C call.

A decode step runs two mHC sites per layer, each a collapse before its sub-layer and a mix back after it: four
Python-level calls per layer, each converting and checking its tensors and allocating its outputs, and all of it
from the cold caches the weight-streaming kernels leave behind (a few numpy and torch calls then cost tens of
microseconds). Here the step's streams live in two buffers per row count, used in turn, the collapse's outputs in
one set more, and `kernels.extension.hc_post_pre` runs a site's mix back (`ops.hc_post`) and the next site's
collapse with its norm (`hc_fused.FusedHC.pre`, or the final head's `ops.hc_head` with the final norm) back to back:
the same C routines on the same values, so the same bits (tests/test_hc_chain.py), in two calls per layer. The step's
tokens enter the first buffer straight from the embedding's bfloat16 rows (`begin_ids`, one C call).

Owns: `HCChain`, built once per model over its sites' weights.
Does not own: the mHC math and its references (`ops.hc_pre`, `ops.hc_post`, `ops.hc_head` and their torch forms),
the layer loop (`DeepseekV4.forward_rows`).
"""

from __future__ import annotations

import numpy as np
import torch

from ..quant import kernels
from ..quant.linear import Linear
from . import ops
from .hc_fused import FusedHC


class _Buffers:
    """One row count's buffers: the streams twice (the mix back reads one and writes the other), the collapse's
    outputs (u [B, d] also the head's output), and u as a tensor once."""

    def __init__(self, B: int, n: int, d: int) -> None:
        self.X = [np.empty((B, n * d), np.float32), np.empty((B, n * d), np.float32)]
        self.u, self.post, self.comb = (np.empty(s, np.float32) for s in ((B, d), (B, n), (B, n * n)))
        self.u_t = ops.buffer_tensor(self.u)  # the sub-layers' C calls get the array back without a check


class HCChain:
    """`forward_rows`' mHC sites in order (each layer's attention site, then its MoE site), then the final head: `begin`
    collapses the embedded token into the first sub-layer's input, and each `then` mixes a sub-layer's output back and
    collapses for the next sub-layer (after the last one: the head's normed output). The tensor either returns is a
    view of a buffer the next call overwrites: the sub-layer consumes it before handing back its output. Not reentrant
    (one step at a time per model, as the scheduler runs them)."""

    def __init__(
        self, sites: list[tuple[FusedHC, np.ndarray]], head: tuple, n: int, d: int, embed: np.ndarray | None = None
    ) -> None:
        self.sites, self.head, self.n, self.d = sites, head, n, d
        self.embed = embed  # the embedding's bfloat16 bits [V, d] (`begin_ids`), or None
        self._buffers: dict[int, _Buffers] = {}
        self._b: _Buffers | None = None
        self._site = self._cur = 0

    @classmethod
    def build(cls, layers: list, hc_head, norm: torch.Tensor, embed: Linear | None = None) -> HCChain | None:
        """Over the blocks' `HyperConnection` sites with their norms and the final `HyperHead` with the final norm,
        or None where one of them would not take its C path (`FusedHC.build`, `ops.c_arrays`) or the extension
        lacks the chained call. `embed`: the token embedding, for `begin_ids` where it is stored as BF16."""
        if kernels.extension is None or not layers:
            return None
        sites = []
        for b in layers:
            for hc, nw in ((b.hc_attn, b.attn_norm), (b.hc_ffn, b.ffn_norm)):
                arrays = ops.c_arrays(nw)
                if hc.fused is None or arrays is None or nw.shape != (hc.fused.fn.shape[1] // hc.fused.n,):
                    return None
                sites.append((hc.fused, arrays[0]))
        first = sites[0][0]
        n, d = first.n, first.fn.shape[1] // first.n
        if any(s.n != n or s.fn.shape[1] != n * d for s, _ in sites):
            return None
        arrays = ops.c_arrays(hc_head.fn, hc_head.base, hc_head.scale, norm)
        if arrays is None or hc_head.fn.shape != (n, n * d) or hc_head.scale.shape != (1,) or norm.shape != (d,):
            return None
        bits = embed.kernel_operands() if embed is not None and embed.dtype == "BF16" else None
        table = bits[0] if bits is not None and bits[0].shape[1:] == (d,) else None
        return cls(sites, (*arrays, float(hc_head.hc_eps), float(hc_head.eps)), n, d, table)

    def begin_ids(self, ids: list[int]) -> torch.Tensor | None:
        """`begin(embed.rows(ids))` for the step's token ids, the embedding's rows widened straight into the streams
        (`embed_streams`, one C call: the same values as `.float()`'s), then the first collapse. None, having done
        nothing, where `begin` would not apply or the embedding is not BF16: the caller then embeds, calls `begin`."""
        if self.embed is None or not ops.c_enabled():
            return None
        b = self._buffers.get(len(ids))
        if b is None:
            b = self._buffers[len(ids)] = _Buffers(len(ids), self.n, self.d)
        kernels.extension.embed_streams(self.embed, ids, b.X[0])
        return self._first(b)

    def begin(self, emb: torch.Tensor) -> torch.Tensor | None:
        """The embedded tokens emb [B, d] (float32) as every stream, collapsed by the first site with its norm ->
        the first sub-layer's input [B, d]; None, having done nothing, where `ops.hc_pre` would take its torch path
        (`ops.torch_only()`, a tensor not float32 on the CPU), the caller then steps as `Block.rows` does."""
        if not ops.c_enabled() or emb.dtype is not torch.float32 or not emb.is_cpu or emb.dim() != 2:
            return None
        B = emb.shape[0]
        b = self._buffers.get(B)
        if b is None:
            b = self._buffers[B] = _Buffers(B, self.n, self.d)
        b.X[0].reshape(B, self.n, self.d)[:] = emb.numpy()[:, None, :]  # what `expand` shows the first site
        return self._first(b)

    def _first(self, b: _Buffers) -> torch.Tensor:
        """The first site's collapse with its norm of the streams b.X[0] -> the first sub-layer's input."""
        self._b, self._site, self._cur = b, 0, 0
        s, na = self.sites[0]
        kernels.extension.hc_pre(
            b.X[0], s.fn, s.base, s.scale, s.n, s.iters, s.hc_eps, s.eps, b.u, b.post, b.comb, norm=na, norm_eps=s.eps
        )
        return b.u_t

    def then(self, f: torch.Tensor) -> torch.Tensor:
        """The current sub-layer's output f [B, d] mixed back into the streams, collapsed by the next site with its
        norm -> the next sub-layer's input [B, d]; after the last site, the head's collapse with the final norm ->
        [B, d], the LM head's input."""
        b, i, cur = self._b, self._site, self._cur
        fa = ops.buffer_array(f)  # a sub-layer's registered output buffer: its array as it is (`ops.buffer_tensor`)
        if fa is None:
            got = ops.c_arrays(f)
            fa = got[0] if got is not None else f.contiguous().numpy()
        if i + 1 < len(self.sites):
            s, na = self.sites[i + 1]
            kernels.extension.hc_post_pre(
                fa, b.X[cur], b.post, b.comb, b.X[1 - cur], s.fn, s.base, s.scale, s.iters, s.hc_eps, s.eps, b.u,
                b.post, b.comb, na, s.eps,
            )  # fmt: skip
        else:
            fn, base, scale, norm, hc_eps, eps = self.head
            kernels.extension.hc_post_pre(
                fa, b.X[cur], b.post, b.comb, b.X[1 - cur], fn, base, scale, 1, hc_eps, eps, b.u, None, None, norm, eps
            )
        self._site, self._cur = i + 1, 1 - cur
        return b.u_t
