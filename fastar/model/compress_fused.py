"""A compressed layer's compressors at decode as one C call per row and compressor (the C extension's `compress_row`,
fastar/quant/csrc/bind_compress.c).

Owns: `FusedCompressors`, built once per layer from its `Compressor`s (the layer's, and its indexer's where it has
one) and their one stacked product: `rows` runs a decode step's compressor work for every row, each row's token
appended to its state's raw compressor rows and, where the token closes a window, the window's entry pooled, normed,
RoPE'd, rounded and stored in the entry buffer's format, all in one C call per row and compressor. `Compressor.add`
does this op by op: ~25 small torch ops per closing window and a few per token, whose dispatch cost far more than
their arithmetic (a few hundred microseconds a step). The C call runs the same C routines in the same order on the
same values, so every row, state and entry comes out bit-identical to `Compressor.gated` + `Compressor.add` on the C
extension (those stay the reference; tests/test_compress_fused.py compares the bits).
Does not own: the math (deepseek_v4.py's `Compressor`), the buffers (`fastar.model.state.RowBuffer`), the indexer's
queries and picks.
`project` returns None where the C call does not apply (the extension not built or turned off for a torch-only run, a
chunk longer than a decode step's rows); the caller then runs its own path. A row whose state the call cannot take
(buffers not in their usual layout) runs `Compressor.add` on the same product rows instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

import numpy as np
import torch

from ..quant import kernels
from ..quant.linear import Linear
from . import ops
from .angles import shared_table
from .state import LayerState, StateError

# how a compressor rounds its entries before they are stored (`compress_row`'s quant): none, the FP8 KV cache's
# non-RoPE dims (`Attention._fp8_nope`), the indexer's Hadamard rotation and FP4 (`Indexer._rotate`)
ROUNDING = {None: 0, "fp8_nope": 1, "fp4_rotate": 2}
_OUT_KIND = {"f32": -1, "fp8": 0, "fp4": 1}  # an entry buffer's row format -> `compress_row`'s out_kind


@dataclass(frozen=True)
class _Part:
    """One compressor of the stack: where its rows sit in the stacked product and what it stores where."""

    compressor: object  # the `Compressor` (its `add` is the reference; ratio, ape, norm, RoPE frequencies)
    buffers: attrgetter  # a LayerState -> (raw kv rows, raw gate rows, entries)
    off: int  # its kv columns in the stacked product (its gate columns follow)
    width: int  # its kv / gate row width
    rounding: int  # ROUNDING
    rope: int  # RoPE dims of an entry (kept float32 by the FP8 rounding and the FP8 row format)
    ape: object  # numpy [ratio, width]
    norm: object  # numpy [head_dim]
    freq_key: tuple  # its RoPE frequencies, the key of the layers' shared angle tables (`Attention.rows`)


class FusedCompressors:
    """One layer's compressors as C calls at decode (see the module docstring)."""

    def __init__(self, stack: Linear, parts: list[_Part]) -> None:
        self.stack, self.parts = stack, parts
        self._operands = stack.kernel_operands()  # the stacked weight as its C product takes it (None: `stack(x)`)
        self._outs: dict[int, tuple[torch.Tensor, object]] = {}  # `project`'s output by row count (tensor, array)

    @classmethod
    def build(cls, stack: Linear | None, compressors: list[tuple]) -> FusedCompressors | None:
        """The fused calls for `compressors`, [(Compressor, (its LayerState buffer names: raw kv, raw gate, entries),
        its rounding: a key of ROUNDING, the RoPE dims of its entries that stay float32)] in the stack's order, over
        their stacked product `stack`; or None without one (no stacked product, no C extension)."""
        if stack is None or kernels.extension is None:
            return None
        parts, off = [], 0
        for c, names, rounding, rope in compressors:
            n = c.wkv.out_features
            parts.append(
                _Part(
                    c, attrgetter(*names), off, n, ROUNDING[rounding], rope, c.ape.contiguous().numpy(),
                    c.norm.contiguous().numpy(), tuple(c.inv_freq.tolist()),
                )
            )  # fmt: skip
            off += 2 * n
        return cls(stack, parts) if off == stack.out_features else None

    def project(self, x: torch.Tensor) -> tuple | None:
        """The stacked product of a decode step's rows x [B, d] (each compressor's kv and gate rows side by side), for
        `add`, as (tensor, array) over one buffer per row count that the next call overwrites; or None where the C
        call does not apply."""
        args = ops.c_arrays(x) if x.shape[0] <= ops.SMALL_CHUNK else None
        if args is None:
            return None
        if self._operands is None:
            y = self.stack(x)  # [B, the stack's rows]
            return y, y.numpy()
        T = x.shape[0]
        got = self._outs.get(T)
        if got is None:  # made once per row count: `add` consumes it before this layer projects again
            a = np.empty((T, self.stack.out_features), np.float32)
            got = self._outs[T] = (ops.buffer_tensor(a), a)
        w, s = self._operands  # the C call `stack(x)` makes, on x's array: the same bits
        if s is None:
            kernels.extension.bf16_matmul(args[0], w, got[1])
        else:
            kernels.extension.fp8_matmul(args[0], w, s, got[1])
        return got

    def add(self, projected: tuple, t: int, p: int, state: LayerState, angles: dict) -> None:
        """`Compressor.add` of every compressor (in the stack's order) for row t of the `project`ed rows: the token at
        position p of `state`. `angles`: the layers' shared `AngleTable`s by frequencies."""
        for part in self.parts:
            self._add(part, *projected, t, p, state, angles)

    @staticmethod
    def _add(part: _Part, y: torch.Tensor, yn, t: int, p: int, state: LayerState, angles: dict) -> None:
        """Row t of the product (the token at position p of `state`) into one compressor's buffers."""
        c = part.compressor
        kv_buf, gate_buf, out_buf = part.buffers(state)
        m = c.ratio
        w = p // m
        closes = (p + 1) % m == 0
        first = (w - 1) * m if c.overlap and w else w * m  # the first row a closing window reads
        kind = _OUT_KIND[out_buf.fmt.kind]
        if (
            kv_buf.stop != p
            or gate_buf.stop != p
            or kv_buf.start != gate_buf.start
            or kv_buf.is_packed
            or gate_buf.is_packed
            or (closes and (first < kv_buf.start or (kind == 0 and out_buf.fmt.rope != part.rope)))
        ):  # not the layout the C call takes: the reference on the same rows
            o, n = part.off, part.width
            rows = c.gated(y[t : t + 1, o : o + n], y[t : t + 1, o + n : o + 2 * n], torch.tensor([p]))
            c.add(*rows, p, kv_buf, gate_buf, out_buf)
            return
        cos = sin = out = None
        out_row = 0
        if closes:
            cos, sin = shared_table(angles, c.inv_freq, part.freq_key).row(w * m)  # [1, r/2] each
            out = out_buf.grow_array(1)
            out_row = out_buf.stop - out_buf.start - 1
        row = p - kv_buf.start
        kvs, gates = kv_buf.grow_array(1), gate_buf.grow_array(1)
        if not kernels.extension.compress_row(
            yn, t, part.off, kvs, gates, row, part.ape, p, part.norm, c.eps, part.rounding, part.rope, cos, sin,
            out, out_row, kind,
        ):  # fmt: skip
            out_buf.truncate(out_buf.stop - 1)  # as `RowBuffer.append` refusing the entry
            raise StateError(out_buf.fmt.misfit())
