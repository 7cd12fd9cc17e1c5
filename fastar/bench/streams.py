"""`fastar bench -m FILE --streams 1,2,4,8`: N concurrent greedy streams through the step scheduler.

Per N: aggregate decode tokens/s (tokens emitted while all N streams decode / that wall time), per-stream
tokens/s, p50/p95 inter-token latency, whether every stream's tokens equal its solo run (`identical_to_solo`),
and the batched ceiling: each decode step reads the resident bytes once plus the bytes of the union of its
rows' experts (hits at the memory bandwidth measured in the run, misses at the disk bandwidth), the additive
model of `fastar.bench`'s decode ceiling. Owns only the measuring; the scheduler is `fastar.engine.scheduler`.
"""

from __future__ import annotations

import itertools
import json
import sys
import time
from pathlib import Path

import torch

from .model import _disk_bw, _preload, _stream_gbps, token_bytes


def _prompts(n: int, length: int, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1234)
    return [torch.randint(2, min(vocab, 100000), (length,), generator=g).tolist() for _ in range(n)]


class _UnionProbe:
    """Counts, per decode call (`forward_rows`), the distinct experts each layer routed to (wraps the MoE routers
    of this engine's model; `close` restores them)."""

    def __init__(self, model) -> None:
        self.model, self.calls, self.experts = model, 0, 0
        self._in_rows = False
        self._orig_rows = model.forward_rows
        self._orig_route = {}
        for b in model.layers:
            self._orig_route[b.layer] = b.ffn.route
            b.ffn.route = self._route(b.ffn.route)
        model.forward_rows = self._rows

    def _route(self, route):
        def wrapped(x, ids):
            idx, wts = route(x, ids)
            if self._in_rows:
                self.experts += len(set(idx.reshape(-1).tolist()))
            return idx, wts

        return wrapped

    def _rows(self, ids, states):
        self._in_rows, self.calls = True, self.calls + 1
        try:
            return self._orig_rows(ids, states)
        finally:
            self._in_rows = False

    def close(self) -> None:
        for b in self.model.layers:
            b.ffn.route = self._orig_route[b.layer]
        self.model.forward_rows = self._orig_rows


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
    probe = _UnionProbe(engine.model)
    cache = engine.expert_cache
    misses0 = cache.stats().get("misses", 0) if cache else 0
    try:
        sched.run_until_idle()
    finally:
        probe.close()
    return {
        "times": times,
        "tokens": out,
        "calls": probe.calls,
        "experts": probe.experts,
        "misses": (cache.stats().get("misses", 0) - misses0) if cache else 0,
    }


def bench(path: str, streams: list[int], tokens: int = 32, prompt_tokens: int = 16, ram_budget="auto") -> dict:
    from ..engine.engine import load

    engine = load(path, ram_budget=ram_budget)
    src = engine.source
    if engine.expert_cache and engine.expert_cache.n_slots >= src.bank["slots"] * src.bank["experts"]:
        _preload(engine.expert_cache)
    resident_tok, _, _ = token_bytes(src)
    stride = src.expert_stride
    prompts = _prompts(max(streams), prompt_tokens, engine.config.vocab_size)
    membw = _stream_gbps(engine) or 0.0
    disk = _disk_bw(str(path)) if Path(path).is_file() else 0.0  # GB/s
    solo = []
    for p in prompts:
        r = _run(engine, [p], tokens)
        solo.append(r["tokens"][0])
    rows = []
    for n in streams:
        r = _run(engine, prompts[:n], tokens)
        out = r["tokens"]
        times = r["times"]
        start = max(t[0] for t in times)  # every stream decoding from here
        end = max(t[-1] for t in times)
        in_window = sum(sum(1 for x in t if start < x <= end) for t in times)
        gaps = sorted(b - a for t in times for a, b in itertools.pairwise(t))
        pct = (lambda q: gaps[min(len(gaps) - 1, int(q * len(gaps)))] * 1e3) if gaps else (lambda q: 0.0)
        decode_tokens = sum(len(t) - 1 for t in times)
        bytes_read = r["calls"] * resident_tok + r["experts"] * stride
        miss_bytes = r["misses"] * stride
        ceil_s = ((bytes_read - miss_bytes) / (membw * 1e9) if membw else 0.0) + (
            miss_bytes / (disk * 1e9) if disk and miss_bytes else 0.0
        )
        rows.append(
            {
                "streams": n,
                "aggregate_decode_tok_s": in_window / (end - start) if end > start else 0.0,
                "per_stream_tok_s": [
                    (len(t) - 1) / (t[-1] - t[0]) if len(t) > 1 and t[-1] > t[0] else 0.0 for t in times
                ],
                "itl_p50_ms": pct(0.5),
                "itl_p95_ms": pct(0.95),
                "identical_to_solo": all(o == s[: len(o)] and len(o) == len(s) for o, s in zip(out, solo)),
                "decode_calls": r["calls"],
                "expert_reads_per_call": r["experts"] / max(1, r["calls"]),
                "batched_ceiling_tok_s": decode_tokens / ceil_s if ceil_s else None,
            }
        )
        c = rows[-1]["batched_ceiling_tok_s"]
        rows[-1]["fraction_of_ceiling"] = rows[-1]["aggregate_decode_tok_s"] / c if c else None
    return {
        "model": str(path),
        "membw_gbps": membw,
        "disk_gbps": disk,
        "resident_bytes_per_step": resident_tok,
        "expert_bytes": stride,
        "tokens": tokens,
        "prompt_tokens": prompt_tokens,
        "rows": rows,
    }


def main(a) -> int:
    streams = [int(s) for s in a.streams.split(",")]
    budget = (
        (a.ram_budget.split(",")[0] if isinstance(a.ram_budget, str) else a.ram_budget)
        if getattr(a, "ram_budget", None) is not None
        else "auto"
    )
    r = bench(a.model, streams, tokens=a.decode_tokens, prompt_tokens=a.prompt_tokens, ram_budget=budget)
    if a.json:
        print(json.dumps(r))
        return 0
    print(f"{r['model']}: memory {r['membw_gbps']:.1f} GB/s, {r['tokens']} tokens per stream", file=sys.stdout)
    for row in r["rows"]:
        ceil = row["batched_ceiling_tok_s"]
        print(
            f"  {row['streams']} streams: {row['aggregate_decode_tok_s']:.1f} tok/s aggregate"
            + (f" (ceiling {ceil:.1f})" if ceil else ""),
            end="",
        )
        print(
            f", per stream {min(row['per_stream_tok_s']):.1f}-{max(row['per_stream_tok_s']):.1f} tok/s, "
            f"ITL p50 {row['itl_p50_ms']:.1f} ms p95 {row['itl_p95_ms']:.1f} ms, "
            f"identical_to_solo {row['identical_to_solo']}"
        )
    return 0
