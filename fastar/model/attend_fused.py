"""A decode query's attention over its stored rows as one C call (the C extension's `attend_stored`,
fastar/quant/csrc/bind_attend.c).

Owns: `StoredAttend`, built once per layer from its `Attention`'s sinks, window and ratio: called for one query of a
decode step (or of a short chunk's token slices, which attend one query at a time), it hands the C call the state's
stored window rows and compressed entries (packed rows decoded inside it, the indexer's picks mapped to the rows they
name there), instead of `Attention._attend`'s float32 copies of each buffer's rows and the attention call's
arguments built in Python: a dozen Python-level steps per row and layer that cost more than the attention. The same
floats reach the same attention kernel, so the output is bit-identical to `Attention._attend`'s path (which stays the
reference; tests/test_attend_stored.py compares them).
Does not own: the attention (`deepseek_v4.attend`), the buffers (`fastar.model.state`), the indexer's picks.
A call returns None where the C call does not apply (the extension not built or turned off for a torch-only run,
more than one query, rows the state no longer holds, picks that name no entry); the caller then runs its own path.
"""

from __future__ import annotations

import torch

from ..quant import kernels
from . import ops
from .state import LayerState

_KIND = {"f32": -1, "fp8": 0, "fp4": 1}  # a buffer's row format -> `attend_stored`'s kinds


class StoredAttend:
    """One layer's decode-query attention over stored rows (see the module docstring)."""

    def __init__(self, sinks: torch.Tensor, window: int, ratio: int, scale: float) -> None:
        self.sinks, self.window, self.ratio, self.scale = sinks.contiguous().numpy(), window, ratio, scale

    @classmethod
    def build(cls, sinks: torch.Tensor, window: int, ratio: int, scale: float) -> StoredAttend | None:
        """The call for these attention parameters, or None without the C extension."""
        return cls(sinks, window, ratio, scale) if kernels.extension is not None else None

    def __call__(
        self, q: torch.Tensor, state: LayerState, k0: int, a: int, b: int, picks: torch.Tensor | None
    ) -> torch.Tensor | None:
        """`Attention._attend`'s result for the one query q [1, H, D] at position a (b = a + 1) over the window
        keys [k0, b) and the entries of `state` (the indexer's `picks` [1, k] of them, or every one closed by a),
        or None where the C call does not apply."""
        args = ops.c_arrays(q)
        if args is None or q.shape[0] != 1:
            return None
        out = torch.empty(q.shape)
        return out if self.into(args[0], state, k0, a, b, picks, out.numpy()) else None

    def into(self, q, state: LayerState, k0: int, a: int, b: int, picks: torch.Tensor | None, out) -> bool:
        """`__call__` on numpy arrays, the query q [1, H, D] (float32, C-contiguous) into out [1, H, D] (a decode
        step's rows write their slices of one array): False (out untouched) where the C call does not apply."""
        kv = state.kv
        if k0 < kv.start or b > kv.stop or b - k0 < 1:
            return False
        ent, n_ent, ent_kind, ent_rope, pk = None, 0, -1, 0, None
        if self.ratio:
            entries = state.entries
            n_ent = b // self.ratio
            if entries.start or n_ent > entries.stop:
                return False
            if picks is not None:
                pk = picks.numpy()
                if picks.dtype != torch.int64 or pk.shape[0] != 1 or pk[0, -1] < 0:  # none missing: as scoring picks
                    return False
            ent, ent_kind, ent_rope = entries.raw_array(), _KIND[entries.fmt.kind], entries.fmt.rope
        kernels.extension.attend_stored(
            q, kv.raw_array(), _KIND[kv.fmt.kind], kv.fmt.rope, k0 - kv.start, b - k0, k0, a, self.window,
            ent, ent_kind, ent_rope, n_ent, pk, self.ratio, self.sinks, self.scale, out,
        )  # fmt: skip
        return True
