"""`fastar bench -m FILE --streams 1,2,4,8`: N concurrent greedy streams through the step scheduler.

Per N: aggregate decode tokens/s (tokens emitted while all N streams decode / that wall time: from the last
stream's first token to the first stream's last, so every decode call in it carries N rows), per-stream
tokens/s, p50/p95 inter-token latency, whether every stream's tokens equal its solo run (`identical_to_solo`),
and the batched ceiling over the same decode calls: each reads the resident bytes once plus the bytes of the
union of its rows' experts (all but its misses, at the memory bandwidth measured around that N's run), and the
expert bytes read from disk over those calls go at the disk's rate (the fastest of the start's probe and the rate
the reads were served at); the loader threads read while the kernels compute, so the calls take at least the
larger of the two times (`window_seconds`, the overlapped model of `fastar.bench`'s decode ceiling). Beside it,
the arithmetic floor of the same calls: each call's multiply-adds (rows x the per-token products, `decode_macs`) at
the FP32 FMA peak (BF16/F32 weights: the LM head, routers, compressors) and at the bf16 dot peak (FP8/FP4 weights
and the routed experts, whose inputs the official numerics quantize), both measured in the run. With several rows a
call can be bound by arithmetic rather than bytes (the LM head is 2 x 529 M FLOP per row in float32); the roofline
is, per call, the larger of its memory and arithmetic times, summed, or the disk's time where larger.
Owns only the measuring; the scheduler is `fastar.engine.scheduler`.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch

from ..words import counted
from .model import (
    MemoryBandwidth,
    StepBytes,
    _disk_bw,
    _settle,
    bf16_dot_peak_gflops,
    decode_macs,
    one_engine_options,
    token_bytes,
)


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(2, min(vocab, 100000), (length,), generator=g).tolist() for _ in range(n)]


class _UnionProbe:
    """Records, per decode call (`forward_rows`): when it returned, its rows, the distinct experts each layer
    routed to (summed over layers), the expert cache's misses during it and the head rows the screen computed
    exactly (`log`); and the cache's bytes read and read-busy seconds so far at its start and its end (`io`).
    Wraps both routers of this engine's MoE layers (`MoE.route`, and `MoE.route_c`, the C router a fused layer
    takes, which returns None where it does not apply and `route` then runs); `close` restores them."""

    def __init__(self, model, cache=None) -> None:
        self.model, self.cache, self.calls, self.experts = model, cache, 0, 0
        self.log: list[tuple[float, int, int, int, int]] = []  # (end time, rows, experts, misses, exact) per call
        self.io: list[tuple[tuple[int, float], tuple[int, float]]] = []  # ((bytes read, busy s) at start, at end)
        self._in_rows = False
        self._orig_rows = model.forward_rows
        for b in model.layers:
            b.ffn.route, b.ffn.route_c = self._route(b.ffn.route), self._route(b.ffn.route_c)
        model.forward_rows = self._rows

    def _route(self, route):
        def wrapped(x, ids, *args):
            got = route(x, ids, *args)
            if self._in_rows and got is not None:
                self.experts += len(set(got[0].reshape(-1).tolist()))
            return got

        return wrapped

    def _stats(self) -> dict:
        return self.cache.stats() if self.cache else {}

    def _misses(self) -> int:
        return self._stats().get("misses", 0)

    def _io(self) -> tuple[int, float]:
        st = self._stats()
        return st.get("bytes_read", 0), st.get("read_busy_s", 0.0)

    def _exact_rows(self) -> int:
        screen = self.model.screen
        return screen.exact_rows if screen is not None else 0

    def _rows(self, ids, states, argmax_only=None):
        self._in_rows, self.calls = True, self.calls + 1
        experts, misses, exact, io = self.experts, self._misses(), self._exact_rows(), self._io()
        try:
            return self._orig_rows(ids, states, argmax_only)
        finally:
            self._in_rows = False
            self.log.append(
                (
                    time.perf_counter(),
                    len(ids),
                    self.experts - experts,
                    self._misses() - misses,
                    self._exact_rows() - exact,
                )
            )
            self.io.append((io, self._io()))

    def close(self) -> None:
        for b in self.model.layers:
            del b.ffn.route, b.ffn.route_c  # the wrappers: the class's methods show through again
        self.model.forward_rows = self._orig_rows


def _call_seconds(step: StepBytes, call: tuple, membw: float) -> float:
    """The memory time of one decode call (end, rows, experts, misses, head rows computed exactly by the head
    screen): its bytes (`StepBytes`, as `--profile`'s byte floor counts them: the resident bytes once, with the
    screen the int8 head in place of the BF16 one plus the rows it computed, and its experts' bytes) but the
    misses' (those go to the disk's time, `window_seconds`), at the memory bandwidth (GB/s; 0 = unknown, 0 s)."""
    _, rows, experts, misses, exact = call
    return step(rows, experts, exact, misses) / (membw * 1e9) if membw else 0.0


def window_seconds(call_s: list[float], read_bytes: int, disk: float) -> float:
    """The least time a run of decode calls can take: each call's own least time (`call_s`: its memory time, or
    the larger of that and its arithmetic for the roofline), one after another, or the time the disk takes to
    read `read_bytes` at `disk` GB/s (0 = unknown, not counted) where that is longer: the loader threads read
    while the calls compute, so the two overlap rather than add."""
    disk_s = read_bytes / (disk * 1e9) if disk and read_bytes else 0.0
    return max(sum(call_s), disk_s)


def _machine_rates(engine) -> tuple[float, float, float]:
    """(multiply-adds per second of the FP32 FMA path, of the path the FP8/FP4 products take, streaming read GB/s),
    measured now: the second is the bf16 dot peak under the official numerics on a CPU with one (reference numerics
    split each input into three bfloat16s there: a third of it), else the FP32 FMA peak; the bandwidth is the
    start-of-run probe over 1 GiB, used where the model's head is too small to stream (`MemoryBandwidth`)."""
    from ..quant import kernels
    from .kernels import machine_limits

    n = kernels.get_num_threads()
    limits = machine_limits([n])
    fma, membw = limits["peak"][n] * 1e9 / 2, limits["membw"][n]
    dot = bf16_dot_peak_gflops(n)
    if not dot:
        return fma, fma, membw
    return fma, dot * 1e9 / 2 / (1 if engine.model.numerics.fp8_activations else 3), membw


def _i8_rate(K: int, rows: int = 256, tokens: int = 16) -> float:
    """Multiply-adds per second of the head screen's int8 products (`head_i8_dot`, all threads), measured now on
    weights that stay in cache: the rate its arithmetic allows (16 inputs, where its products are densest)."""
    import numpy as np

    from ..quant import kernels

    g = np.random.default_rng(0)
    q = g.integers(-127, 128, (rows * kernels.get_num_threads(), K), dtype=np.int8)
    x = g.integers(-127, 128, (tokens, K), dtype=np.int8)
    rowsum = q.sum(axis=1, dtype=np.int32)
    out = np.empty((tokens, q.shape[0]), np.int32)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(20):
            kernels.head_i8_dot(x, q, rowsum, out)
        best = min(best, (time.perf_counter() - t0) / 20)
    return tokens * q.shape[0] * K / best


def _run(engine, prompts: list[list[int]], tokens: int) -> dict:
    """The prompts together through a scheduler: per stream its tokens and token times."""
    from ..engine.sampling import SamplingParams

    sched = engine.scheduler(max_batch=max(8, len(prompts)), max_queue=len(prompts))
    times: list[list[float]] = [[] for _ in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)

    def on_chunk(c, i):
        if c.token is not None:
            times[i].append(time.perf_counter())
            out[i].append(c.token)

    for i, p in enumerate(prompts):
        sched.submit(p, params, on_chunk=lambda c, i=i: on_chunk(c, i))
    probe = _UnionProbe(engine.model, engine.expert_cache)
    try:
        sched.run_until_idle()
    finally:
        probe.close()
    return {
        "times": times,
        "tokens": out,
        "calls": probe.calls,
        "experts": probe.experts,
        "log": probe.log,
        "io": probe.io,
    }


def bench(
    path: str,
    streams: list[int],
    tokens: int = 32,
    prompt_tokens: int = 16,
    **options,
) -> dict:
    """`options`: the engine's (`load`'s; `model.one_engine_options`)."""
    from ..engine.engine import load

    engine = load(path, **options)
    src = engine.source
    _settle(engine)  # the slab's pages in, every expert preloaded where the budget holds them: before the probes
    resident_tok, _, _ = token_bytes(src)
    stride = src.expert_stride
    step = StepBytes.of(engine)
    prompts = _prompts(max(streams), prompt_tokens, engine.config.vocab_size)
    wide_macs, quant_macs = decode_macs(src)
    fma_rate, quant_rate, probe_gbps = _machine_rates(engine)
    bandwidth = MemoryBandwidth(engine, probe_gbps)
    membw0 = bandwidth.gbps()
    row_s = wide_macs / fma_rate + quant_macs / quant_rate  # one row's arithmetic at the peaks
    # calls of at most HeadScreen.MAX_ROWS greedy rows take the head screen: its int8 head in place of the BF16 one
    # (two int8 terms of y per row in place of the FP32 head's products; from HeadScreen.ONE_TERM_ROWS rows one, the
    # second terms of the ~1 % of head rows the first leaves open not counted), and exactly only the candidate rows
    screen, exact_s, i8_rate, head, head_s = engine.model.screen, 0.0, None, 0, 0.0
    if screen is not None:
        head = screen.V * screen.K
        i8_rate = _i8_rate(screen.K)
        head_s = head / fma_rate  # the FP32 head's products of one row, in row_s
        exact_s = screen.K / fma_rate  # per candidate row and decode row

    def screened(call) -> bool:
        return step.screened(call[1])

    def call_row_s(call) -> float:
        """One row's arithmetic at the peaks in this call."""
        if not screened(call):
            return row_s
        return row_s - head_s + (1 if call[1] >= screen.ONE_TERM_ROWS else 2) * head / i8_rate

    disk = _disk_bw(str(path)) if Path(path).is_file() else 0.0  # GB/s
    solo = []
    for p in prompts:
        r = _run(engine, [p], tokens)
        solo.append(r["tokens"][0])
    rows = []
    for n in streams:
        before = bandwidth.gbps()
        r = _run(engine, prompts[:n], tokens)
        membw = (bandwidth.gbps() + before) / 2  # the bandwidth drifts: measured around the run
        out = r["tokens"]
        times = r["times"]
        start = max(t[0] for t in times)  # every stream decoding from here ...
        end = min(t[-1] for t in times)  # ... until the first one ends
        full = end > start
        if not full:  # fewer decode tokens than streams: no step carries all N; the whole decode tail instead
            end = max(t[-1] for t in times)
        in_window = sum(sum(1 for x in t if start < x <= end) for t in times)
        gaps = sorted(b - a for t in times for a, b in itertools.pairwise(t))
        pct = (lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1e3) if gaps else (lambda q: 0.0)
        # the ceiling of the decode calls whose tokens are in the window (a call's rows are emitted right after it)
        inside = [i for i, c in enumerate(r["log"]) if start < c[0] <= end]
        window = [r["log"][i] for i in inside]
        # the expert bytes read from disk from the first such call's start to the last one's end, and the rate they
        # were served at (over the time any read was in flight) where faster than the start's probe
        (read0, busy0), (read1, busy1) = (r["io"][inside[0]][0], r["io"][inside[-1]][1]) if inside else ((0, 0), (0, 0))
        read_bytes = read1 - read0
        served = read_bytes / (busy1 - busy0) / 1e9 if read_bytes and busy1 > busy0 else 0.0
        disk_n = max(disk, served)
        bytes_s = [_call_seconds(step, c, membw) for c in window]
        ceil_s = window_seconds(bytes_s, read_bytes, disk_n)
        roof_s = window_seconds(
            [max(b, c[1] * (call_row_s(c) + c[4] * exact_s)) for b, c in zip(bytes_s, window)], read_bytes, disk_n
        )
        window_tokens = sum(c[1] for c in window)
        rows.append(
            {
                "streams": n,
                "membw_gbps": membw,  # the mean of the probes just before and just after this N's run
                "window_read_bytes": read_bytes,  # expert bytes read from disk over the window's calls
                "disk_served_gbps": served,
                "ceiling_disk_gbps": disk_n,
                "aggregate_decode_tok_s": in_window / (end - start) if end > start else 0.0,
                "per_stream_tok_s": [
                    (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 0.0 for t in times
                ],
                "itl_p50_ms": pct(0.5),
                "itl_p95_ms": pct(0.95),
                "identical_to_solo": all(o == s[: len(o)] and len(o) == len(s) for o, s in zip(out, solo)),
                "decode_calls": r["calls"],
                "expert_reads_per_call": r["experts"] / max(1, r["calls"]),
                "window_experts_per_call": sum(c[2] for c in window) / len(window) if window else 0.0,
                "window_calls": len(window),
                "window_rows_per_call": window_tokens / len(window) if window else 0.0,
                "window_all_streams": full,
                "batched_ceiling_tok_s": window_tokens / ceil_s if ceil_s else None,
                "arithmetic_floor_tok_s": 1 / row_s,
                "roofline_tok_s": window_tokens / roof_s if roof_s else None,
            }
        )
        c, roof = rows[-1]["batched_ceiling_tok_s"], rows[-1]["roofline_tok_s"]
        rows[-1]["fraction_of_ceiling"] = rows[-1]["aggregate_decode_tok_s"] / c if c else None
        rows[-1]["fraction_of_roofline"] = rows[-1]["aggregate_decode_tok_s"] / roof if roof else None
    return {
        "model": str(path),
        "membw_gbps": membw0,
        "membw_source": bandwidth.source,  # "head": measured around each run; "probe": the machine's (small heads)
        "disk_gbps": disk,
        "resident_bytes_per_step": resident_tok,
        "expert_bytes": stride,
        "decode_macs_fp32_path": wide_macs,
        "decode_macs_quant_path": quant_macs,
        "head_screen": screen is not None,
        "head_screen_macs_per_s": i8_rate,
        "fma_peak_gflops": 2 * fma_rate / 1e9,
        "quant_path_gflops": 2 * quant_rate / 1e9,
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "rows": rows,
    }


def main(a) -> int:
    streams = [int(s) for s in a.streams.split(",")]
    r = bench(a.model, streams, tokens=a.decode_tokens, prompt_tokens=a.prompt_tokens, **one_engine_options(a))
    if a.json:
        print(json.dumps(r))
        return 0
    print(
        f"{r['model']}: memory {r['membw_gbps']:.1f} GB/s, FP32 FMA {r['fma_peak_gflops']:.0f} GFLOP/s, FP8/FP4 "
        f"products {r['quant_path_gflops']:.0f} GFLOP/s; per row {r['decode_macs_fp32_path'] / 1e9:.2f} G "
        f"multiply-adds on FP32 + {r['decode_macs_quant_path'] / 1e9:.2f} G on the quantized path; "
        f"{counted(r['tokens'], 'token')} per stream; "
        + (
            f"LM head screened (int8 products {2 * r['head_screen_macs_per_s'] / 1e9:.0f} GOP/s)"
            if r["head_screen"]
            else "full LM head"
        ),
        file=sys.stdout,
    )

    def bounds(row) -> str:  # " (byte ceiling X, P%; roofline Y, Q%)", each where known
        parts = [
            f"{name} {row[key]:.1f}, {row[frac]:.0%}"
            for name, key, frac in (
                ("byte ceiling", "batched_ceiling_tok_s", "fraction_of_ceiling"),
                ("roofline", "roofline_tok_s", "fraction_of_roofline"),
            )
            if row[key]
        ]
        if not parts:
            return ""
        disk = f", reads at {row['ceiling_disk_gbps']:.2f} GB/s" if row["window_read_bytes"] else ""
        where = MemoryBandwidth.PROBE_NOTE if r.get("membw_source") == "probe" else "measured around this run"
        return f" ({'; '.join(parts)}; at {row['membw_gbps']:.1f} GB/s, {where}{disk})"

    for row in r["rows"]:
        if not row["window_calls"]:  # no rate over zero calls (`check_arguments` asks for the tokens that avoid it)
            print(f"  {counted(row['streams'], 'stream')}: no decode call timed; raise --decode-tokens")
            continue
        print(
            f"  {counted(row['streams'], 'stream')}: {row['aggregate_decode_tok_s']:.1f} tok/s aggregate"
            + bounds(row)
            + f" over {counted(row['window_calls'], 'call')} of {row['window_rows_per_call']:.1f} rows",
            end="",
        )
        print(
            f", per stream {min(row['per_stream_tok_s']):.1f}-{max(row['per_stream_tok_s']):.1f} tok/s, "
            f"ITL p50 {row['itl_p50_ms']:.1f} ms p95 {row['itl_p95_ms']:.1f} ms, "
            f"identical_to_solo {row['identical_to_solo']}"
            + (
                ""
                if row["window_all_streams"]
                else f" (no call carried all {row['streams']} streams: the rate is over the decode tail; raise "
                "--decode-tokens)"
            )
        )
    return 0
