"""The weight-source contract: what the model asks of wherever weights live (a `.fst` file, an official
checkpoint directory, a synthetic model).

Owns: the `WeightSource` protocol, the `ExpertWeights` record and `Closing` (the file-holding sources' lifetime). Does not own: caching or paging of experts
(`fastar.weights.expert_cache`) nor the arithmetic on weights (`fastar.quant`).

Tensor names are the official checkpoint names, verbatim (`layers.3.attn.wq_a.weight`, `.scale`, `embed.weight`,
`mtp.0.e_proj.weight`, ...). Arrays come back in storage precision, never widened:
  F8_E4M3, F8_E8M0, I8 (packed FP4) -> uint8;  BF16 -> uint16 (bit patterns);  F32 -> float32;  I64 -> int64.
Routed experts are addressed by (layer slot, expert id); slots 0..L-1 are the main layers and L.. the MTP
blocks (mtp.0 is slot L).
"""
from __future__ import annotations

from typing import NamedTuple, Protocol

import numpy as np

from ..config import ModelConfig


class ExpertWeights(NamedTuple):
    """One routed expert in checkpoint layout: FP4 packed [rows, cols/2] + UE8M0 scales [rows, cols/32]."""
    w1: np.ndarray        # gate  [I, D/2]  uint8
    w1_scale: np.ndarray  # [I, D/32] uint8
    w3: np.ndarray        # up    [I, D/2]
    w3_scale: np.ndarray  # [I, D/32]
    w2: np.ndarray        # down  [D, I/2]
    w2_scale: np.ndarray  # [D, I/32]


class Closing:
    """`with source:` and close-on-collect for sources that hold files; subclasses define an idempotent `close`."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # half-constructed, or at interpreter exit
            pass


class WeightSource(Protocol):
    config: ModelConfig

    def has(self, name: str) -> bool: ...

    def dtype(self, name: str) -> str:
        """Checkpoint dtype string of a resident tensor: F8_E4M3, F8_E8M0, BF16, F32, I64."""
        ...

    def tensor(self, name: str) -> np.ndarray:
        """A resident (non-routed-expert) tensor in storage precision, as described above."""
        ...

    def expert(self, layer: int, expert: int) -> ExpertWeights: ...

    def tokenizer_json(self) -> bytes | None: ...
