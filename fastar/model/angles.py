"""RoPE cos / sin by position for decode steps, computed a block of positions at a time and shared by a model's layers.

Owns: `AngleTable`, one per set of RoPE frequencies (a model has two: plain theta, and the compressed layers'
YaRN ones): `rows(positions)` is `ops.rope_cos_sin(inv_freq, tensor(positions))` bit for bit, looked up instead of
computed. A decode step asked torch for them on every layer kind and every closing compressor window: five small
ops each, ~80 us apiece in the middle of a step (cold caches between the weight products), ~0.2 ms a step.
Why the bits are the same: each value is the angle `float(p) * f_i` (one rounded product, whatever the batch) through
torch's elementwise cos and sin, which take their SIMD path for every value of a contiguous run whose length is a
multiple of 32 (two AVX-512 vectors, four AVX2 ones) and a block of positions is computed on one thread (below
torch's grain size). So when r/2 is a multiple of 32 (Flash: 32) a position's row is the same computed alone, in a
step's batch or in a block; otherwise, and where ops take their torch paths (a device backend's scope, whose
tensors live on its device), `rows` computes as `ops.rope_cos_sin` does (no table).
Does not own: the frequencies (`deepseek_v4.layer_inv_freq`), applying the rotation (`ops.apply_rope`).
"""

from __future__ import annotations

import numpy as np
import torch

from . import ops

BLOCK = 256  # positions computed at once: 256 x 32 values, below torch's parallel grain (32,768): one thread
MAX_BLOCKS = 16  # blocks kept (64 KiB each at r/2 = 32): a batch's rows sit in a few; past that the table restarts


class AngleTable:
    """cos / sin of position x frequency for one set of RoPE frequencies (see the module docstring)."""

    def __init__(self, inv_freq: torch.Tensor) -> None:
        self.inv_freq = inv_freq
        self.tabled = inv_freq.shape[0] % 32 == 0
        self._blocks: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        # the last positions asked and their rows, as registered tensors: a step's layers of these frequencies all
        # ask for the same positions, and each hands the rows to a few C calls (`ops.buffer_tensor`)
        self._last: tuple[list[int], tuple[torch.Tensor, torch.Tensor]] | None = None

    def _block(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        b = self._blocks.get(k)
        if b is None:
            if len(self._blocks) >= MAX_BLOCKS:
                self._blocks.clear()
            cos, sin = ops.rope_cos_sin(self.inv_freq, torch.arange(k * BLOCK, (k + 1) * BLOCK))  # [BLOCK, r/2]
            b = self._blocks[k] = (cos.numpy(), sin.numpy())
        return b

    def row(self, p: int) -> tuple[np.ndarray, np.ndarray]:
        """cos, sin [1, r/2] of position p as numpy arrays (read-only by contract: views of the table)."""
        if not self.tabled:
            cos, sin = ops.rope_cos_sin(self.inv_freq, torch.tensor([p]))
            return cos.numpy(), sin.numpy()
        cos, sin = self._block(p // BLOCK)
        i = p % BLOCK
        return cos[i : i + 1], sin[i : i + 1]

    def rows(self, pos: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, r/2] of the positions pos (B of them): `ops.rope_cos_sin(inv_freq, torch.tensor(pos))`, the
        same bits (read-only by contract: for one position, views of the table)."""
        if not self.tabled or not ops.c_enabled():  # a device backend's scope: computed there, on its device
            return ops.rope_cos_sin(self.inv_freq, torch.tensor(pos))
        last = self._last
        if last is not None and last[0] == pos:
            return last[1]
        if len(pos) == 1:
            cos, sin = self.row(pos[0])
        else:
            parts = [self.row(p) for p in pos]
            cos, sin = np.concatenate([c for c, _ in parts]), np.concatenate([s for _, s in parts])
        if last is not None:
            for t in last[1]:
                ops.forget_buffer(t)
        got = ops.buffer_tensor(cos), ops.buffer_tensor(sin)
        self._last = (list(pos), got)
        return got


def shared_table(tables: dict, inv_freq: torch.Tensor, key: tuple) -> AngleTable:
    """The `AngleTable` of frequencies inv_freq (`key`: their values as a tuple) in a model's shared `tables`."""
    t = tables.get(key)
    if t is None:
        t = tables[key] = AngleTable(inv_freq)
    return t
