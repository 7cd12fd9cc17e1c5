"""An engine's parts, built from `load`'s options: the device it runs on, the process's thread and memory settings,
the expert pager its source gets, and the model.

Owns: `resolve_device` (the `device` option checked with the options that depend on it), `set_threads` and
`keep_freed_memory` (the one place fastar touches process-wide settings), `paged_experts` (the budgeted expert
cache, when the source pages and no provider was given) and `build_model` (`DeepseekV4` on the CPU, or its device
backend's model).
Does not own: the options' wrong kinds (`arguments`), opening and checking the source (`source`), the expert cache's
budget and warm-up (`pager`), the drafter (`speculative.resolve`), what runs on the parts (`engine`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..contracts import ExpertProvider, WeightSource
from ..errors import OptionError
from ..model.deepseek_v4 import DeepseekV4, Numerics
from ..model.head_screen import HeadScreen
from ..quant import kernels as K
from .pager import make_expert_cache

if TYPE_CHECKING:
    from ..model.device import DeviceBackend
    from ..weights.expert_cache import ExpertCache


def resolve_device(device: str | None, gpu_budget: int | str | None, draft: str | None) -> str:
    """The device `load(device=)` names (`fastar.model.device.resolve_device`), once the options that depend on it
    are checked: `gpu_budget` is a size on every device (a typo is an error, not silently unused), and speculative
    decoding runs on the CPU only."""
    from ..model.device import resolve_device as resolve

    resolved = resolve(device)
    if gpu_budget not in (None, "auto"):
        from ..config import parse_size

        parse_size(gpu_budget)
    if resolved != "cpu" and draft not in (None, "none"):
        raise OptionError("draft", draft, f"speculative decoding runs on {{device=cpu}} only (not {resolved})")
    return resolved


def set_threads(kernels: bool, threads: int | None) -> None:
    """The thread counts: with the C kernels in use torch runs single-threaded and `threads` sizes the kernels' pool,
    else `threads` sets torch's."""
    if kernels and K.available():
        # The one place fastar touches process-wide thread settings. The C kernels' pool does the heavy work;
        # torch's OpenMP workers spin after each small op and steal the cores from it (decode 8.3 -> 12.2
        # tok/s, prefill 38 -> 51 tok/s with one torch thread on a 4-layer Flash-width model, 2 cores).
        torch.set_num_threads(1)
        if threads is not None:
            K.set_num_threads(threads)
    elif threads is not None:
        torch.set_num_threads(threads)


def keep_freed_memory(kernels: bool) -> None:
    """With the C kernels in use, glibc's malloc keeps freed memory for reuse: called once the resident weights are
    read (each into a fresh mapping numpy backs with huge pages: from malloc's heap they would not be, and decode
    measured ~10 % slower). A prefill chunk's temporaries (64 MB tensors at Flash widths) are then reused instead of
    unmapped and page-faulted anew each chunk (prefill CPU time -20 %, `K.keep_freed_memory`)."""
    if kernels and K.available():
        K.keep_freed_memory()


def paged_experts(
    source: WeightSource,
    ram_budget: int | str | None,
    cache_policy: str,
    direct_io: bool | None,
    verify: bool,
    head_screen: bool,
) -> ExpertCache | None:
    """The expert cache routed experts are paged into from `source` (`pager.make_expert_cache`), or None where the
    budget is None (the whole file mapped) or the source cannot page. `head_screen`: the LM head's int8 copy will be
    kept, its bytes taken from an "auto" budget."""
    if ram_budget is None or not source.pageable:
        return None
    cfg = source.config
    extra = HeadScreen.bytes_for(cfg.vocab_size, cfg.hidden_size) if head_screen else 0
    return make_expert_cache(source, ram_budget, cache_policy, direct_io, verify, extra_bytes=extra)


def build_model(
    source: WeightSource,
    device: str,
    numerics: str | Numerics,
    kernels: bool,
    experts: ExpertProvider | None,
    max_rollback: int | None,
    lookahead: bool,
    gpu_budget: int | str | None,
    head_screen: bool,
) -> tuple[DeviceBackend | None, DeepseekV4]:
    """(backend, model): the model over `source`'s resident weights (read here) and `experts`, on the CPU (backend
    None) or on `device` through a `DeviceBackend`."""
    if device == "cpu":
        model = DeepseekV4(
            source,
            numerics=numerics,
            kernels=kernels,
            experts=experts,
            max_rollback=max_rollback,
            lookahead=lookahead,
            head_screen=head_screen,
        )
        return None, model
    from ..model.device import DeviceBackend

    # on a device, `kernels` still chooses how the CPU's share of the routed experts is computed
    backend = DeviceBackend(device, gpu_budget, host_kernels=kernels)
    # the accelerator tier: resident weights, attention, state on the device; experts split
    model = backend.build_model(
        source, numerics=numerics, experts=experts, max_rollback=max_rollback, lookahead=lookahead
    )
    return backend, model
