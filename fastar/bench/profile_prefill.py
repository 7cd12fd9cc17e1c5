"""`fastar bench -m FILE --profile-prefill 64,512`: where the time of a prefill goes, for prompts of T tokens.

Owns: the prefill profile. It loads the model as `fastar bench` does (every expert preloaded where the budget holds
them all) and, per prompt length T, prefills one random prompt of T tokens from a fresh state (`Engine.prefill`, as
a session runs a prompt, the last position's logits included): once untimed, then alternately a plain run and a
profiled one. In a profiled run every call into the C extension is timed under its category, and so are the
regions of Python around them, with the clock and the timers of the decode-step profile (`fastar.bench.profile`;
each category its own time less its nested timers', so the categories add up to the run). The categories are the
decode profile's, with its row ops apart: RoPE, activation rounding (FP8 / FP4), SwiGLU, the embedding. Beside the
time of each weight product: its FLOPs (2 x the multiply-adds of the rows it ran: a dense product's T rows, a routed
expert's tokens) and their rate against the bf16 dot peak measured in the same run, which bounds every product a
prefill chunk runs on the bf16 tile path (docs/PREFILL.md).
Owns only the measuring: nothing here runs in production.
"""

from __future__ import annotations

import json
import statistics
import sys
import time

import torch

from ..words import counted
from .model import _settle, bf16_dot_peak_gflops, one_engine_options
from .profile import C_CATEGORIES, OUTSIDE, PRODUCTS, _Clock, _Instrumented

# the decode profile's categories, with the row ops a prefill spends more on apart
CATEGORIES = C_CATEGORIES | {
    "rope": "RoPE",
    "fp8_act_quant": "activation rounding",
    "fp4_act_quant": "activation rounding",
    "swiglu": "SwiGLU",
    "embed_streams": "embedding",
}

# the products a prefill chunk runs on the bf16 tile path (BF16 weights take the FP32 one: their input is float32)
ON_BF16_PATH = ("FP8 products", "FP4 experts")


def _flops(name: str, args: tuple) -> int:
    """FLOPs of one weight product call (2 x its multiply-adds), from its arguments."""
    if name in ("fp8_matmul", "bf16_matmul"):  # x [T, K] (grouped: [T, G K]) and w [N, K] (grouped: [G R, K])
        return 2 * args[0].shape[0] * args[1].size
    if name == "experts_ffn":  # expert e runs rows[offsets[e]:offsets[e + 1]] through its packed FP4 w1, w3, w2
        offsets = args[3]
        return sum(
            2 * int(offsets[e + 1] - offsets[e]) * 2 * (ew[0].size + ew[2].size + ew[4].size)
            for e, ew in enumerate(args[1])
        )
    if name == "shared_ffn":  # x [T, d], FP8 w13 [2 I, d] and w2 [d, I]
        return 2 * args[0].shape[0] * (args[1].size + args[3].size)
    return 0


def profile_prefill(engine, tokens: int, repeats: int = 2, seed: int = 0) -> dict:
    """`repeats` plain and `repeats` profiled prefills of one random `tokens`-token prompt, alternated, after an
    untimed one -> the breakdown of the profiled ones (their mean) and the plain ones' median."""
    vocab = engine.config.vocab_size
    g = torch.Generator().manual_seed(seed + tokens)
    ids = torch.randint(3, min(vocab, 100_000), (tokens,), generator=g).tolist()
    engine.prefill(ids, engine.new_state())
    clock = _Clock()
    clock.flops_of = _flops
    inst = _Instrumented(engine, clock, CATEGORIES)
    plain, profiled = [], []
    try:
        for _ in range(repeats):
            state = engine.new_state()
            t0 = time.perf_counter()
            engine.prefill(ids, state)
            plain.append(time.perf_counter() - t0)
            state = engine.new_state()
            clock.on = True
            clock.enter(OUTSIDE + "step")
            try:
                engine.prefill(ids, state)
            finally:
                profiled.append(clock.leave())
                clock.on = False
                clock.settle()
    finally:
        inst.close()
    run_s = sum(profiled) / repeats
    per_run = {k: v / repeats for k, v in clock.own.items()}
    outside = sum(v for k, v in per_run.items() if k.startswith(OUTSIDE))
    return {
        "tokens": tokens,
        "repeats": repeats,
        "run_ms": 1e3 * run_s,
        "plain_run_ms_median": 1e3 * statistics.median(plain),
        "tok_s": tokens / statistics.median(plain),
        "categories_ms": {k: 1e3 * v for k, v in sorted(per_run.items(), key=lambda kv: -kv[1])},
        "calls_per_run": {k: v / repeats for k, v in clock.calls.items()},
        "outside_kernels_ms": 1e3 * outside,
        "outside_kernels_fraction": outside / run_s,
        "product_gflops": {k: clock.flops[k] / repeats / per_run[k] / 1e9 for k in PRODUCTS if clock.flops.get(k)},
    }


def bench(path: str, tokens: list[int], repeats: int = 2, **options) -> dict:
    """`options`: the engine's (`load`'s; `model.one_engine_options`)."""
    from ..engine.engine import load
    from ..quant import kernels

    engine = load(path, **options)
    try:
        settled = _settle(engine)
        threads = kernels.get_num_threads() if kernels.available() else 1
        peak = bf16_dot_peak_gflops(threads)
        out = [profile_prefill(engine, t, repeats) for t in tokens]
        return {"model": str(path), "preloaded": settled["preloaded"], "bf16_dot_peak_gflops": peak, "profiles": out}
    finally:
        engine.close()


def format_profile(r: dict) -> str:
    peak = r["bf16_dot_peak_gflops"]
    lines = [
        f"{r['model']}: prefill profile (Engine.prefill from a fresh state; bf16 dot peak "
        + (f"{peak:.0f} GFLOP/s in this run)" if peak else "not measured: no bf16 path)")
    ]
    for p in r["profiles"]:
        run = p["run_ms"]
        lines.append(
            f"  {counted(p['tokens'], 'token')}: {run:.1f} ms profiled, {p['plain_run_ms_median']:.1f} ms plain "
            f"(median of {p['repeats']}, {p['tok_s']:.1f} tok/s); outside any kernel "
            f"{100 * p['outside_kernels_fraction']:.1f}%"
        )
        for k, v in p["categories_ms"].items():
            rate = p["product_gflops"].get(k)
            of_peak = f" ({100 * rate / peak:.0f}% of the peak)" if rate and peak and k in ON_BF16_PATH else ""
            extra = f"  {rate:.0f} GFLOP/s{of_peak}" if rate else ""
            calls = p["calls_per_run"].get(k, 0)
            lines.append(f"    {k:<40} {v:9.1f} ms {100 * v / run:5.1f}%  {calls:6.0f} calls{extra}")
    return "\n".join(lines)


def main(a) -> int:
    """`a.profile_prefill` and `a.repeats` as `fastar.bench.check_arguments` let them through."""
    parts = a.profile_prefill.split(",")
    r = bench(a.model, [int(s) for s in parts], repeats=a.repeats, **one_engine_options(a))
    print(json.dumps(r) if a.json else format_profile(r), file=sys.stdout)
    return 0
