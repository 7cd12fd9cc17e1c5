"""`fastar audit FILE --reference HF_DIR`: layer-by-layer comparison of fastar against transformers.

Owns: `run(model_path, hf_dir, tokens=...) -> AuditReport` (cosine similarity and max-abs difference of the
residual streams after every block and of the logits, fastar in `reference` numerics vs transformers'
`DeepseekV4ForCausalLM` on the same weights, float32) and `AuditReport.table()` for printing.
Does not own: argument parsing (the CLI calls `run` and prints `table()`), any tolerance policy beyond `ok`.
transformers is imported only here, only when an audit runs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from .errors import FastarError

DEFAULT_TOKENS = 64


@dataclass
class AuditRow:
    name: str
    cosine: float
    max_abs: float
    ref_max_abs: float  # scale of the reference values, to read max_abs against


@dataclass
class AuditReport:
    tokens: list[int]
    rows: list[AuditRow] = field(default_factory=list)
    tolerance: float = 1e-4

    @property
    def logits(self) -> AuditRow:
        return self.rows[-1]

    @property
    def ok(self) -> bool:
        """True when the logits agree within `tolerance` max-abs."""
        return self.logits.max_abs <= self.tolerance

    def table(self) -> str:
        lines = [
            f"audit over {len(self.tokens)} tokens (fastar reference numerics vs transformers, float32)",
            f"{'stage':<12} {'cosine':>12} {'max |diff|':>12} {'max |ref|':>12}",
        ]
        for r in self.rows:
            lines.append(f"{r.name:<12} {r.cosine:>12.9f} {r.max_abs:>12.3e} {r.ref_max_abs:>12.3e}")
        lines.append(f"logits {'OK' if self.ok else 'MISMATCH'} (tolerance {self.tolerance:g} max-abs)")
        return "\n".join(lines)


def _compare(name: str, ours: torch.Tensor, ref: torch.Tensor) -> AuditRow:
    a, b = ours.double().reshape(-1), ref.double().reshape(-1)
    cos = float(torch.dot(a, b) / (a.norm() * b.norm()).clamp_min(1e-300))
    return AuditRow(name, cos, float((a - b).abs().max()), float(b.abs().max()))


def run(
    model_path: str | os.PathLike,
    hf_dir: str | os.PathLike,
    tokens: list[int] | None = None,
    seed: int = 0,
    tolerance: float = 1e-4,
) -> AuditReport:
    """Compare fastar (`model_path`: `.fst` file or checkpoint directory) with transformers loading `hf_dir`.

    `tokens` defaults to DEFAULT_TOKENS random ids drawn with `seed`.
    """
    from .convert.checkpoint import Checkpoint
    from .engine.engine import load

    with Checkpoint(hf_dir) as reference:  # a missing directory or config.json: said here, not by transformers
        ref_config = reference.config
    engine = load(model_path, numerics="reference")
    cfg = engine.config
    if cfg != ref_config:  # another model's weights would fail deep in a comparison, or compare nothing alike
        differ = [f.name for f in fields(cfg) if getattr(cfg, f.name) != getattr(ref_config, f.name)]
        raise FastarError(f"{hf_dir} is not the model in {model_path}: their configs differ in {', '.join(differ)}")
    if tokens is None:
        rng = np.random.default_rng(seed)
        tokens = rng.integers(0, cfg.vocab_size, size=DEFAULT_TOKENS).tolist()
    if not tokens:
        raise FastarError("no tokens to audit")
    if bad := [t for t in tokens if not 0 <= t < cfg.vocab_size]:
        raise FastarError(f"token id {bad[0]} is outside the vocabulary [0, {cfg.vocab_size})")
    from transformers import DeepseekV4ForCausalLM  # heavy: only for audits, once the input is known good

    collect: list[torch.Tensor] = []
    ours_logits, _ = engine.model.forward(tokens, engine.new_state(), collect=collect)

    hf = DeepseekV4ForCausalLM.from_pretrained(str(hf_dir), dtype=torch.float32).eval()
    streams: list[torch.Tensor] = []  # each decoder layer's output streams [T, n, d], via forward hooks
    hooks = [
        layer.register_forward_hook(lambda _m, _i, out: streams.append(out[0].detach())) for layer in hf.model.layers
    ]
    try:
        with torch.no_grad():
            ref_logits = hf(torch.tensor([tokens])).logits[0]
    finally:
        for h in hooks:
            h.remove()
    if len(streams) != len(collect):
        raise RuntimeError(f"transformers ran {len(streams)} layers, fastar has {len(collect)}")
    report = AuditReport(list(tokens), tolerance=tolerance)
    for i, (ours, ref) in enumerate(zip(collect, streams)):
        report.rows.append(_compare(f"layer {i}", ours, ref))
    report.rows.append(_compare("logits", ours_logits, ref_logits))
    return report
