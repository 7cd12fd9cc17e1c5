"""fastar: DeepSeek-V4-Flash on one machine, experts paged from SSD, exact to the reference math.

The public API (torch is imported only when one of these is first used):
  load(path, numerics="official"|"reference", **options) -> Engine
  Engine.generate / stream / chat / logits / generate_tokens / open_session / stats / close (also `with`)
  SamplingParams, GenerationChunk
"""

from __future__ import annotations

__version__ = "0.1.0"

_LAZY = {
    "load": ("fastar.engine.engine", "load"),
    "Engine": ("fastar.engine.engine", "Engine"),
    "Session": ("fastar.engine.session", "Session"),
    "SamplingParams": ("fastar.engine.sampling", "SamplingParams"),
    "GenerationChunk": ("fastar.engine.generate", "GenerationChunk"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        mod, attr = _LAZY[name]
        return getattr(importlib.import_module(mod), attr)
    raise AttributeError(f"module 'fastar' has no attribute {name!r}")
