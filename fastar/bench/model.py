"""`fastar bench -m FILE`: end-to-end prefill and decode speed against the ceiling measured in the same run.

Owns: the model benchmark. For each RAM budget it loads the engine over the expert pager, prefills a random
prompt, decodes greedily, and reports tokens/s beside the ceiling that this machine's memory and disk bandwidth
(both measured in the same run) allow for the bytes a token touches at the measured hit rate and the expert bytes
the run read from disk (`decode_ceiling`):

    t_token >= max((resident_bytes_per_token + hit * expert_bytes_per_token) / membw,
                   expert_bytes_read_per_token / disk_bw)

The loader threads read while the kernels compute, so the two terms overlap: their sum (`serial_ceiling_tok_s`,
printed beside) is what a token would take with no overlap, not a bound. disk_bw is the fastest of the cold probes
(O_DIRECT with one and two readers, buffered, mapped) and the rate the run's own reads were served at (bytes read
over the time any read was in flight: a read the OS or the host serves from a cache is faster than the disk).

membw is measured twice per timed decode, streaming the model's LM head just before and just after it (the shared
machine's bandwidth moves between minutes); the mean sets that decode's ceiling (`membw_gbps`; the header's
start-of-run probe for models too small to leave the caches). `--repeats N` times N decodes in a row, each
against its own probes (`repeats` in --json, median and range printed), to see both of the host's memory phases.
Also: hit rate, bytes read per token, achieved GB/s, peak RSS (sampled), and with `--reference HF_DIR` the same
prompt through transformers on the same weights. Does not own: the kernels benchmark (`bench_kernels`) or
the cache's trace replay (`bench.cache`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..config import parse_size
from ..errors import ConfigError, FastarError
from ..words import counted


class _PeakRSS:
    """Samples this process's RSS every 20 ms (the kernel's own high-water mark never goes down between runs)."""

    def __init__(self) -> None:
        import psutil

        self._proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            self._stop.wait(0.02)

    def __enter__(self) -> _PeakRSS:
        self.peak = self._proc.memory_info().rss
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def one_engine_options(a) -> dict:
    """The engine options of a bench that loads one engine (`--streams`, `--profile`, `--profile-prefill`): the
    budget `--ram-budget` gives (a list as a flag is refused, `fastar.bench.check_arguments`; of a list in its
    environment mirror, the first), `--head-screen`, `--cache-policy`, `--direct-io`, `--lookahead` and
    `--no-verify` (`fastar.bench.check_arguments` refuses the memory flags these do not read: `--device`,
    `--gpu-budget`)."""
    budget = a.ram_budget.split(",")[0] if isinstance(a.ram_budget, str) else a.ram_budget
    return {
        "ram_budget": "auto" if budget is None else None if budget.strip().lower() == "none" else budget.strip(),
        "head_screen": a.head_screen,
        "cache_policy": a.cache_policy,
        "direct_io": a.direct_io,
        "lookahead": a.lookahead,
        "verify": a.verify,
    }


def token_bytes(src) -> tuple[int, int, int]:
    """(resident bytes a decode token reads, routed-expert bytes it reads, resident bytes in all)."""
    from ..format.reader import FstFile

    cfg = src.config
    if isinstance(src, FstFile):  # from its header
        sizes = {t["name"]: t["nbytes"] for t in src.header["tensors"]}
    else:  # checkpoint directory
        from ..convert.names import is_routed_expert

        sizes = {n: src.tensor_info(n).nbytes for n in src.names() if not is_routed_expert(n)}
    touched = 0
    for name, n in sizes.items():
        if name.startswith("mtp.") or name.endswith("tid2eid"):
            continue  # the draft block and the hash tables are not read by a plain decode step (one row at most)
        touched += n // cfg.vocab_size if name == "embed.weight" else n
    experts = cfg.num_hidden_layers * cfg.num_experts_per_tok * src.expert_stride
    return touched, experts, sum(sizes.values())


@dataclass(frozen=True)
class StepBytes:
    """The bytes one decode step (a `forward_rows` call) reads from memory: the one count behind `--profile`'s byte
    floor and `--streams`' byte ceiling and roofline. `resident`: the weights every step reads once (`token_bytes`);
    with the head screen (`screen_rows` > 0), a step of at most that many rows reads the screen's int8 head in place
    of the BF16 one (`screen_delta`, negative) plus the BF16 head rows it computed exactly (`row_bytes` each); and
    the distinct experts its rows routed to, each layer's counted apart (`stride` bytes each; those read from disk,
    the caller's `misses`, left to the disk's time)."""

    resident: int
    stride: int
    screen_delta: int = 0
    row_bytes: int = 0
    screen_rows: int = 0

    @classmethod
    def of(cls, engine) -> StepBytes:
        """The counts of a loaded engine: its source's resident bytes and expert stride, its screen's."""
        from ..model.head_screen import HeadScreen

        resident, _, _ = token_bytes(engine.source)
        stride, screen = engine.source.expert_stride, engine.model.screen
        if screen is None:
            return cls(resident, stride)
        return cls(resident, stride, screen.read_delta, 2 * screen.K, HeadScreen.MAX_ROWS)

    def screened(self, rows: int) -> bool:
        """Whether a greedy step of `rows` rows takes the head screen."""
        return rows <= self.screen_rows

    def __call__(self, rows: int, experts: float, exact: float = 0, misses: float = 0) -> float:
        """A step of `rows` rows that routed to `experts` distinct experts (summed over layers; `misses` of them read
        from disk) and computed `exact` head rows in full."""
        head = self.screen_delta + exact * self.row_bytes if self.screened(rows) else 0
        return self.resident + head + (experts - misses) * self.stride


def _matrices(src):
    """(name, rows x columns, stored dtype) of every resident 2-D weight but the draft block's. A checkpoint
    directory also names the routed experts' matrices: they are counted apart (k per token), so skipped here."""
    from ..convert.checkpoint import Checkpoint
    from ..convert.names import is_routed_expert
    from ..convert.v2 import FstV2File

    for name in src.names():
        if name.startswith("mtp.") or not name.endswith(".weight") or is_routed_expert(name):
            continue
        if isinstance(src, Checkpoint):  # from the safetensors header
            shape = tuple(src.tensor_info(name).shape)
        elif isinstance(src, FstV2File):  # without decoding
            shape = tuple(src.shape(name))
        else:  # .fst: a view of the mapped file
            shape = tuple(src.tensor(name).shape)
        if len(shape) == 2:
            yield name, shape[0] * shape[1], src.dtype(name)


def _expert_macs(cfg) -> int:
    """Multiply-adds of one routed expert on one token (gate, up and down)."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size


def prefill_macs(src) -> int:
    """Multiply-adds one prompt token costs in the weight products (every resident matrix but the embedding,
    the LM head (applied to a chunk's last token only) and the draft block, plus its k routed experts)."""
    cfg = src.config
    macs = sum(n for name, n, _ in _matrices(src) if name not in ("embed.weight", "head.weight"))
    return macs + cfg.num_hidden_layers * cfg.num_experts_per_tok * _expert_macs(cfg)


def decode_macs(src) -> tuple[int, int]:
    """Multiply-adds one decoded token costs, split by the instruction path they can take: (products of BF16 and
    F32 weights, which take float32 inputs and run on FP32 FMA; products of FP8 and FP4 weights, including the k
    routed experts, whose inputs the official numerics quantize to FP8 so they run on the bf16 dot path where the
    CPU has one). The embedding is a row lookup, not a product."""
    cfg = src.config
    wide = quant = 0
    for name, n, dtype in _matrices(src):
        if name == "embed.weight":
            continue
        if dtype in ("BF16", "F32"):
            wide += n
        else:
            quant += n
    return wide, quant + cfg.num_hidden_layers * cfg.num_experts_per_tok * _expert_macs(cfg)


def _disk_bw(path: str, nbytes: int = 256 << 20) -> float:
    """Sequential O_DIRECT read rate of one file (GB/s), page cache dropped first; a fallback probe for sources
    that are not one .fst (a checkpoint directory's largest shard)."""
    import mmap

    from .cache import drop_page_cache

    drop_page_cache(path)
    flag = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    buf = mmap.mmap(-1, 8 << 20)
    done, t0 = 0, time.perf_counter()
    try:
        while done < nbytes:
            n = os.preadv(fd, [buf], done)
            if n <= 0:
                break
            done += n
    finally:
        os.close(fd)
    return done / max(time.perf_counter() - t0, 1e-9) / 1e9


COLD_PROBES = ("direct_GBps", "direct_2threads_GBps", "buffered_cold_GBps", "mmap_cold_GBps", "sequential_GBps")


def fastest_disk_gbps(disk: dict) -> float:
    """The fastest rate any cold probe of `measure_disk` (or `_disk_bw`'s "sequential_GBps") read the file at: the
    disk's rate in the ceilings, a bound rather than one way of reading it."""
    return max((disk[k] for k in COLD_PROBES if disk.get(k)), default=0.0)


def decode_ceiling(
    resident: float, experts: float, hit: float, read: float, membw_gbps: float, disk_gbps: float
) -> dict:
    """The least time one decode token can take (seconds), from its bytes: `resident` bytes and the `hit` part of
    its `experts` bytes from RAM at `membw_gbps`, and the `read` bytes of experts the run read from disk per token
    at `disk_gbps`. The loader threads read while the kernels compute, so the bound is the larger of the two
    times ("seconds"); "serial_seconds" is their sum, a token's time with no overlap (not a bound). A miss's
    record is charged to the disk only, though the kernels then read it from RAM as well: the bound stays a bound
    where a just-read record is still in the CPU's caches."""
    memory_s = (resident + hit * experts) / (membw_gbps * 1e9)
    disk_s = read / (disk_gbps * 1e9) if read else 0.0
    return {
        "seconds": max(memory_s, disk_s),
        "serial_seconds": memory_s + disk_s,
        "memory_s": memory_s,
        "disk_s": disk_s,
        "bound": "disk" if disk_s > memory_s else "memory",
    }


PROBE_MIN_BYTES = 256 << 20  # a resident weight at least this big is streamed for the bandwidth beside each run


def _stream_gbps(engine) -> float | None:
    """Memory read bandwidth (GB/s) right now, streaming the model's own LM head (the largest weight a decode step
    reads, already resident: nothing is allocated), best of 3 over the kernels' threads. The machine is shared
    and its bandwidth moves by tens of percent between minutes, so each run's ceiling uses the bandwidth measured
    just before and just after its timed decode. None when the head is too small to leave the caches (tiny test
    models: the start-of-run probe is used instead) or the C kernels are not built."""
    import torch

    from ..quant import kernels

    w = engine.model.head.weight
    if kernels._C is None or w.numel() * w.element_size() < PROBE_MIN_BYTES:
        return None
    buf = w.reshape(-1).view(torch.uint8).numpy()
    return max(buf.nbytes / kernels._C.read_bandwidth(buf) for _ in range(3)) / 1e9


class MemoryBandwidth:
    """The memory bandwidth a bench sets a byte floor or ceiling at (`--profile`, `--streams`): the model's LM head
    streamed now (`_stream_gbps`), or where the head is too small to leave the caches (small models, the demo's)
    this machine's streaming probe over 1 GiB (`kernels.read_gbps`), taken once, at the first call that needs it
    (or given: `probe_gbps`, where the bench measured it already). `source`: what the last `gbps()` read, "head"
    (measured around the run) or "probe"; `PROBE_NOTE` says the latter in the benches' lines."""

    PROBE_NOTE = "this machine's 1 GiB probe (the LM head is too small to measure the bandwidth around the run)"

    def __init__(self, engine, probe_gbps: float | None = None) -> None:
        self.engine, self._probe, self.source = engine, probe_gbps, "head"

    def gbps(self) -> float | None:
        """GB/s now; None only without the C kernels (which both measures need)."""
        from ..quant import kernels

        now = _stream_gbps(self.engine)
        if now is not None:
            self.source = "head"
            return now
        if kernels._C is None:
            return None
        if self._probe is None:
            from .kernels import read_gbps

            self._probe = read_gbps()
        self.source = "probe"
        return self._probe


def _preload(cache) -> float:
    """Reads every expert into the slab (the budget holds them all): the "experts all in RAM" case, timed warm."""
    t0 = time.perf_counter()
    slots, experts = cache.fst.bank["slots"], cache.fst.bank["experts"]
    for layer in range(slots):
        cache.prefetch(layer, range(experts))
    cache.wait_idle()
    return time.perf_counter() - t0


def _settle(engine) -> dict:
    """Right after load: wait for the expert slab's pages (`ExpertCache.wait_committed`, a one-time cost a server
    pays right after loading; not beside a probe or a timed run), then preload every expert when the budget holds
    them all. -> {"commit_s", "preloaded", "preload_s"}."""
    cache, src = engine.expert_cache, engine.source
    t0 = time.perf_counter()
    if cache:
        cache.wait_committed()
    commit_s = time.perf_counter() - t0
    preloaded = bool(cache) and cache.n_slots >= src.bank["slots"] * src.bank["experts"]
    return {"commit_s": commit_s, "preloaded": preloaded, "preload_s": _preload(cache) if preloaded else 0.0}


# Prompts up to this many tokens are prefilled twice where every expert is in RAM (see `_start`); a longer one's
# one-time costs are a small part of its time, and a second pass would double a long benchmark.
WARM_PREFILL_MAX = 8192


def _start(path: str, budget, options: dict, prompt: list[int], warmup: int, draft: str):
    """Load, `_settle` (the slab's commit reported apart as `commit_s`), prefill `prompt` (twice where every expert
    is in RAM: the first prefill after load timed apart as `prefill_first_s`) and decode `warmup` greedy steps
    (untimed: the cache settles). -> (engine, state, tokens so far, info)."""
    from ..engine.engine import load
    from ..engine.sampling import argmax

    t0 = time.perf_counter()
    engine = load(path, ram_budget=budget, **{**options, "draft": draft})
    info = {"load_s": time.perf_counter() - t0}
    cache = engine.expert_cache
    info.update(_settle(engine))
    if (info["preloaded"] or not cache) and len(prompt) <= WARM_PREFILL_MAX:
        # the first prefill after load also pays one-time costs (first touch of its scratch memory, of the
        # weights' pages): timed apart, then the same prompt again on a new state is the prefill figure. Only
        # with every expert in RAM, where the first one leaves the cache as it found it (a paging budget's
        # prefill is timed from a cold cache: what its I/O ceiling describes)
        t0 = time.perf_counter()
        engine.prefill(prompt, engine.new_state())
        info["prefill_first_s"] = time.perf_counter() - t0
    state = engine.new_state()
    before = cache.stats() if cache else {}
    t0 = time.perf_counter()
    logits = engine.prefill(prompt, state)
    info["prefill_s"] = time.perf_counter() - t0
    after = cache.stats() if cache else {}
    info["prefill_span"] = engine.prefill_span
    # what the prefill read from disk, how long a read was in flight, and how long it waited for them
    for k in ("bytes_read", "reads", "stall_s", "read_busy_s"):
        info["prefill_" + k] = after.get(k, 0) - before.get(k, 0)
    seq = list(prompt) + [argmax(logits[-1])]
    for _ in range(warmup):
        logits = engine.prefill(seq[-1:], state)
        seq.append(argmax(logits[-1]))
    return engine, state, seq, info


def _close(engine) -> None:
    engine.close()  # the pager's slab goes with the last array view of it (gc at the caller's del)


def _state_measure(engine, state) -> dict:
    """The main blocks' decode-state bytes after the run (rows held, as ModelState.nbytes counts them) beside what
    fastar.model.state.state_bytes accounts for that many positions, and the accounting's growth per token."""
    from ..model.state import state_accounting, state_bytes

    held = sum(b.nbytes for s in state.layers for b in s.buffers().values())
    fmt = engine.model.numerics.state_format(engine.config)
    acct = state_accounting(engine.config, state.max_rollback, mtp_layers=0, fmt=fmt)
    return {
        "state_positions": state.length,
        "state_format": acct["format"],
        "state_bytes": held,
        "state_bytes_accounted": state_bytes(engine.config, state.length, state.max_rollback, mtp_layers=0, fmt=fmt),
        "state_bytes_per_token": acct["per_token"],
        "state_official_bytes_per_token": acct["official_per_token"],
    }


def run_one(
    path: str,
    budget,
    prompt: list[int],
    decode: int,
    options: dict,
    warmup: int = 8,
    replay: float | None = None,
    repeats: int = 1,
    sampling: tuple[float, float] = (0.0, 1.0),
) -> dict:
    """One budget: `_start`, then `decode` timed greedy steps, one token per forward (`repeats` times, each between
    two bandwidth probes: the host's memory speed moves between runs of a few seconds); with `sampling`'s
    temperature > 0, sampled steps (that temperature and top_p, a fixed seed), which take the full LM head unless
    top_p is 1 (the screen's race, `fastar.model.head_screen.Race`). With a draft
    (`options["draft"]`, or `replay`: drafts read from that plain run, each right with probability `replay`),
    a second engine goes through the same start (so its cache is in the same condition) and decodes the same
    `decode` tokens through the speculative loop; its draft_* stats are added."""
    from ..engine.sampling import Sampler, SamplingParams, argmax, screenable

    draft = options.get("draft") or "none"
    temperature, top_p = sampling
    sampler = Sampler(SamplingParams(temperature=temperature, top_p=top_p, seed=0)) if temperature > 0 else None
    gc.collect()  # the previous budget's slab goes with its last array view, before this one's RSS is sampled
    with _PeakRSS() as rss:
        engine, state, seq, info = _start(path, budget, options, prompt, warmup, "none")
        cache, start = engine.expert_cache, len(seq)
        before = cache.stats() if cache else {}
        each = []  # per repeat: (seconds, bandwidth before, after)
        # greedy steps, and sampled ones without top-p (from the second on: the sampler then knows the
        # vocabulary), take the screened head where the engine keeps one; other sampled ones the full head
        screen = engine.model.screen if sampler is None or screenable(sampler.params) else None
        exact0 = screen.exact_rows if screen is not None else 0
        for _ in range(repeats):
            bw0, t0 = _stream_gbps(engine), time.perf_counter()
            for _ in range(decode):  # plain decode, one token per forward: what the ceiling describes
                want = (sampler is None or sampler.head_request()) if screen is not None else False
                logits = engine.prefill(seq[-1:], state, argmax_only=want)
                seq.append(argmax(logits[-1]) if sampler is None else sampler(logits[-1])[0])
            each.append((time.perf_counter() - t0, bw0, _stream_gbps(engine)))
        # the screen's bytes a token: its int8 head in place of the BF16 one, and the rows it computed exactly
        screen_bytes = (
            screen.read_delta + 2 * screen.K * (screen.exact_rows - exact0) / (decode * repeats)
            if screen is not None
            else 0
        )
        del screen  # its arrays go with the engine below
        decode_s = sum(e[0] for e in each)
        state_info = _state_measure(engine, state)
        # the accelerator tier's policy counters (fastar.model.device): experts on each side, pool, memory
        device_info = {k: v for k, v in engine.stats().items() if k.startswith("device")}
        after = cache.stats() if cache else {}
        budget_bytes = cache.budget_bytes if cache else 0
        bank, engine_stride = engine.source.bank, engine.source.expert_stride
        bank_bytes = bank["slots"] * bank["experts"] * engine_stride
        del state, logits
        _close(engine)
        del engine
        gc.collect()
        if replay is not None or draft != "none":
            engine, state, head, _ = _start(path, budget, options, prompt, warmup, "none" if replay else draft)
            if replay is not None:
                from ..engine.speculative import Schedule
                from .speculative import ReplayDrafter

                engine.use_draft(ReplayDrafter(engine.model, replay), Schedule(fixed=4), f"replay:{replay:g}")
                engine.drafter.transcript = seq
            session = engine.open_session()
            session.resume(head, state)  # the last token pending, as in the plain run
            gen_before = engine.stats()
            out_ids = [
                c.token
                for c in engine.stream(head, session=session, max_tokens=decode, ignore_eos=True)
                if c.token is not None
            ]
            gen = engine.stats()
            spec_s = gen["decode_seconds"] - gen_before["decode_seconds"]
            same = head == seq[:start] and out_ids == seq[start : start + decode]
            del state, session
            _close(engine)
            del engine
            gc.collect()
    hits = after.get("hits", 0) - before.get("hits", 0)
    misses = after.get("misses", 0) - before.get("misses", 0)
    read = after.get("bytes_read", 0) - before.get("bytes_read", 0)
    busy = after.get("read_busy_s", 0) - before.get("read_busy_s", 0)
    out = {
        "ram_budget_asked": "none" if budget is None else budget,  # as given: bytes, "auto" or "none"
        "ram_budget_bytes": budget_bytes,  # what the cache holds: at most the bank, whole experts
        "expert_bank_bytes": bank_bytes,
        "expert_bytes": engine_stride,
        "direct_io": bool(after.get("direct", False)),  # the expert reads bypass the OS page cache (O_DIRECT)
        "cache_policy": options.get("cache_policy", "lrfu"),
        "load_s": info["load_s"],
        "preloaded": info["preloaded"],
        "preload_s": info["preload_s"],
        "commit_s": info["commit_s"],
        "prefill_tokens": len(prompt),
        "prefill_tok_s": len(prompt) / info["prefill_s"],
        "prefill_s": info["prefill_s"],
        "prefill_span": info["prefill_span"],
        "prefill_bytes_read": info["prefill_bytes_read"],
        "prefill_reads": info["prefill_reads"],
        "prefill_stall_s": info["prefill_stall_s"],
        "prefill_read_busy_s": info["prefill_read_busy_s"],
        **({"prefill_first_tok_s": len(prompt) / info["prefill_first_s"]} if "prefill_first_s" in info else {}),
        "warmup_tokens": warmup,
        "decode_tokens": decode * repeats,
        "decode_tok_s": decode * repeats / decode_s,
        "head_screen_bytes_per_token": screen_bytes,  # added to the resident bytes (negative: fewer)
        "hit_rate": hits / max(hits + misses, 1) if cache else 1.0,
        "bytes_read_per_token": read / (decode * repeats),
        # the rate the decode's expert reads were served at: their bytes over the time any was in flight
        "disk_served_gbps": read / busy / 1e9 if read and busy > 0 else 0.0,
        "stall_s_per_token": (after.get("stall_s", 0) - before.get("stall_s", 0)) / (decode * repeats),
        "peak_rss_bytes": rss.peak,
        "repeats": [
            {"decode_tok_s": decode / e[0], "membw_before_after_gbps": list(e[1:]) if None not in e else None}
            for e in each
        ],
        "prefetch": {k: v for k, v in after.get("sources", {}).items()},
        **state_info,
        **device_info,
    }
    if replay is not None or draft != "none":
        out.update({k: v for k, v in gen.items() if k.startswith("draft_")})
        # decode_seconds counts the first token's sampling too: one token fewer was decoded in them
        out["draft_decode_tok_s"] = (len(out_ids) - 1) / spec_s if spec_s > 0 else 0.0
        out["draft_speedup"] = out["draft_decode_tok_s"] / out["decode_tok_s"]
        out["draft_same_tokens"] = same
    return out


def bf16_dot_peak_gflops(threads: int) -> float | None:
    """The bf16 tile path's instruction peak (vdpbf16ps, 2 multiply-adds per lane), measured like the FP32 FMA
    peak (best of 3, ~0.15 s each); None where the ISA in use has no such path."""
    from ..quant import kernels as K

    if not K.available():
        return None
    K.set_num_threads(threads)
    try:
        s, _ = K._C.bf16_dot_peak(100_000)
    except ValueError:  # this ISA has no bf16 tile path
        return None
    iters = max(100_000, int(100_000 * 0.15 / max(s, 1e-6)))
    return max(f / s for s, f in (K._C.bf16_dot_peak(iters) for _ in range(3))) / 1e9


def run(
    path: str,
    budgets: list,
    prompt_tokens: int = 64,
    decode_tokens: int = 16,
    reference: str | None = None,
    options: dict | None = None,
    seed: int = 0,
    policies: list[str] | None = None,
    warmup: int = 8,
    replay: float | None = None,
    repeats: int = 1,
    reference_dtype: str = "float32",
    sampling: tuple[float, float] = (0.0, 1.0),
) -> dict:
    from ..engine.source import open_source
    from ..format.reader import FstFile
    from ..quant import kernels
    from .cache import measure_disk
    from .kernels import machine_limits

    options = options or {}
    src = open_source(path)
    resident_tok, expert_tok, resident = token_bytes(src)
    vocab = src.config.vocab_size
    if isinstance(src, FstFile):
        disk = measure_disk(src, records=min(16, src.bank["slots"] * src.bank["experts"] // 4 or 1))
    else:
        shard = max(Path(path).glob("*.safetensors"), key=lambda p: p.stat().st_size)
        disk = {"sequential_GBps": _disk_bw(str(shard))}
    disk_bw = fastest_disk_gbps(disk) * 1e9
    n = kernels.get_num_threads()
    limits = machine_limits([n])
    membw, peak_flops = limits["membw"][n] * 1e9, limits["peak"][n] * 1e9
    macs = prefill_macs(src)
    dot_peak = bf16_dot_peak_gflops(n)  # the prefill's products run at this rate where x is bfloat16-exact
    prompt = [int(t) for t in np.random.default_rng(seed).integers(3, min(vocab, 100_000), prompt_tokens)]
    runs = []
    for b in budgets:
        for policy in policies or [options.get("cache_policy", "lrfu")]:
            r = run_one(
                path,
                b,
                prompt,
                decode_tokens,
                {**options, "cache_policy": policy},
                warmup=warmup,
                replay=replay,
                repeats=repeats,
                sampling=sampling,
            )
            r["sampling"] = {"temperature": sampling[0], "top_p": sampling[1]}
            h, read_tok = r["hit_rate"], r["bytes_read_per_token"]
            rt = resident_tok + r["head_screen_bytes_per_token"]
            # the disk's rate: the fastest probe, or the rate this run's reads were served at where faster (a
            # read served from the OS's or the host's cache)
            r["ceiling_disk_gbps"] = max(disk_bw / 1e9, r["disk_served_gbps"])

            def ceiling(gbps: float) -> float:
                return 1 / decode_ceiling(rt, expert_tok, h, read_tok, gbps, r["ceiling_disk_gbps"])["seconds"]

            for x in r["repeats"]:  # each repeat against the bandwidth measured around it, else the machine's
                around = x["membw_before_after_gbps"]
                x["membw_gbps"] = sum(around) / 2 if around else membw / 1e9
                x["ceiling_tok_s"] = ceiling(x["membw_gbps"])
                x["fraction_of_ceiling"] = x["decode_tok_s"] / x["ceiling_tok_s"]
            r["membw_gbps"] = sum(x["membw_gbps"] for x in r["repeats"]) / repeats
            r["ceiling_tok_s"] = ceiling(r["membw_gbps"])
            r["fraction_of_ceiling"] = r["decode_tok_s"] / r["ceiling_tok_s"]
            parts = decode_ceiling(rt, expert_tok, h, read_tok, r["membw_gbps"], r["ceiling_disk_gbps"])
            r["ceiling_memory_s_per_token"], r["ceiling_disk_s_per_token"] = parts["memory_s"], parts["disk_s"]
            r["ceiling_bound"] = parts["bound"]
            r["serial_ceiling_tok_s"] = 1 / parts["serial_seconds"]  # no overlap of reads and compute: not a bound
            r["achieved_gbps"] = (rt + expert_tok) * r["decode_tok_s"] / 1e9
            r["prefill_ceiling_tok_s"] = peak_flops / (2 * macs)  # FP32 FMA peak over the products' FLOPs
            r["prefill_fraction_of_flops"] = r["prefill_tok_s"] / r["prefill_ceiling_tok_s"]
            if dot_peak:  # against the bf16 instruction's peak: the ceiling of the path the products take
                r["prefill_bf16_ceiling_tok_s"] = dot_peak * 1e9 / (2 * macs)
                r["prefill_fraction_of_bf16_peak"] = r["prefill_tok_s"] / r["prefill_bf16_ceiling_tok_s"]
            runs.append(r)
    _prefill_io_ceiling(runs, disk_bw)
    result = {
        **runs[0],
        "resident_bytes": resident,
        "resident_bytes_per_token": resident_tok,
        "expert_bytes_per_token": expert_tok,
        "membw_gbps": membw / 1e9,
        "disk_gbps": disk_bw / 1e9,
        "disk": disk,
        "threads": n,
        "peak_gflops": peak_flops / 1e9,
        "prefill_macs_per_token": macs,
        "bf16_peak_gflops": dot_peak,
        "runs": runs,
    }
    if reference:
        twice = "prefill_first_tok_s" in result  # as fastar's prefill was timed
        result["transformers"] = _transformers(reference, prompt, decode_tokens, reference_dtype, twice, threads=n)
        result["speedup_vs_transformers"] = result["decode_tok_s"] / result["transformers"]["decode_tok_s"]
        result["prefill_speedup_vs_transformers"] = result["prefill_tok_s"] / result["transformers"]["prefill_tok_s"]
    return result


def _prefill_io_ceiling(runs: list[dict], disk_bw: float) -> None:
    """Prefill against the I/O ceiling, for each run whose prefill read experts from disk: io_s = the bytes it
    read / the disk's rate (the fastest cold probe of this run, or the rate the prefill's reads were served at
    where faster: bytes over the time any read was in flight); compute_s = the shorter of the prefill time of this run's
    all-in-RAM budget where there is one (same prompt, no reads) and its own time less the time it waited for reads
    (on a shared machine either can be the slower: the shorter gives the stricter ceiling). Overlapped,
    a prefill cannot beat max(io_s, compute_s): that is the ceiling (`prefill_io_ceiling_tok_s`); the serial sum
    (`prefill_serial_ceiling_tok_s`, like decode's additive ceiling) is what it would take with no overlap."""
    in_ram = [r["prefill_s"] for r in runs if r["preloaded"]]
    for r in runs:
        if r["preloaded"] or not r["prefill_bytes_read"]:
            continue
        busy = r["prefill_read_busy_s"]
        served = r["prefill_bytes_read"] / busy if busy > 0 else 0.0
        r["prefill_disk_gbps"] = max(disk_bw, served) / 1e9
        io_s = r["prefill_bytes_read"] / (r["prefill_disk_gbps"] * 1e9)
        own = r["prefill_s"] - r["prefill_stall_s"]
        compute_s = min(in_ram + [own])
        n = r["prefill_tokens"]
        r.update(
            prefill_io_s=io_s,
            prefill_compute_s=compute_s,
            prefill_compute_from="own time less stalls" if compute_s == own else "all-in-RAM run",
            prefill_io_ceiling_tok_s=n / max(io_s, compute_s),
            prefill_serial_ceiling_tok_s=n / (io_s + compute_s),
        )
        r["prefill_fraction_of_io_ceiling"] = r["prefill_tok_s"] / r["prefill_io_ceiling_tok_s"]


def _transformers(
    hf_dir: str, prompt: list[int], decode: int, dtype: str = "float32", twice: bool = False, threads: int | None = None
) -> dict:
    """transformers' DeepseekV4ForCausalLM on the checkpoint directory in `dtype`: prefill `prompt` and decode
    `decode` greedy tokens, after an untimed 8-token forward (one-time set-up costs out of the timing). The prefill
    asks for the last position's logits only (`logits_to_keep=1`), as `generate()` does and as fastar's prefill
    computes them: the LM head at every prompt position would time work neither engine does when generating.
    `twice` (when fastar's prompt was, see `_start`): the prompt is prefilled twice, the first timed apart.
    `threads`: torch's threads for the run (fastar's kernel threads, so both engines get the same cores; the engine
    loaded before it set torch to one thread, which transformers would otherwise have run on), restored after."""
    import torch

    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _transformers_run(hf_dir, prompt, decode, dtype, twice)
    finally:
        torch.set_num_threads(before)


def _transformers_run(hf_dir: str, prompt: list[int], decode: int, dtype: str, twice: bool) -> dict:
    import torch
    from transformers import DeepseekV4ForCausalLM

    m = DeepseekV4ForCausalLM.from_pretrained(hf_dir, dtype=getattr(torch, dtype)).eval()
    ids = torch.tensor([prompt])
    first = {}
    with torch.inference_mode():
        m(ids[:, :8], use_cache=True, logits_to_keep=1)
        if twice:
            t0 = time.perf_counter()
            m(ids, use_cache=True, logits_to_keep=1)
            first["prefill_first_tok_s"] = len(prompt) / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        out = m(ids, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t0
        first["prefill_logits_positions"] = out.logits.shape[1]
        past, tok = out.cache, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(decode):
            out = m(tok, cache=past, use_cache=True)
            past, tok = out.cache, out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - t0
    return {
        "prefill_tok_s": len(prompt) / prefill_s,
        **first,
        "decode_tok_s": decode / decode_s,
        "dtype": dtype,
        "threads": torch.get_num_threads(),
    }


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _typed(n: int) -> str:
    """Bytes as --ram-budget takes them (binary units, as `parse_size` reads them): 2147483648 -> "2G"."""
    for unit, shift in (("T", 40), ("G", 30), ("M", 20), ("K", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift}{unit}"
    return str(n)


def budget_asked(x: dict) -> str:
    """A run's --ram-budget as given: "2G", "auto", "none" (the table's budget column)."""
    asked = x["ram_budget_asked"]
    return _typed(asked) if isinstance(asked, int) else str(asked)


def budget_line(x: dict) -> str:
    """What a run's budget asked for and what the expert cache holds: "budget 2G (2.15 GB) asked: 1.07 GB, every
    expert (the bank is 1.07 GB)" (the cache keeps whole experts, at most the bank)."""
    asked, held, bank = x["ram_budget_asked"], x["ram_budget_bytes"], x["expert_bank_bytes"]
    if asked == "none":
        return "budget none: the file mapped, no expert cache"
    head = f"budget {budget_asked(x)} ({_gb(asked)}) asked" if isinstance(asked, int) else f"budget {asked}"
    stride = x.get("expert_bytes") or 0
    held_experts = (
        "every expert" if held >= bank else f"{held // stride} of {bank // stride} experts" if stride else "part"
    )
    return f"{head}: {_gb(held)}, {held_experts} (the bank is {_gb(bank)})"


def print_table(r: dict, out=sys.stdout) -> None:
    print(
        f"machine: memory {r['membw_gbps']:.1f} GB/s, disk {r['disk_gbps']:.2f} GB/s (fastest cold probe), FP32 FMA "
        f"{r['peak_gflops']:.0f} GFLOP/s, {r['threads']} threads; per token: resident "
        f"{_gb(r['resident_bytes_per_token'])}, experts {_gb(r['expert_bytes_per_token'])}, prefill "
        f"{2 * r['prefill_macs_per_token'] / 1e9:.2f} GFLOP",
        file=out,
    )
    print(
        f"{'budget':>10} {'policy':>6} {'prefill t/s':>11} {'decode t/s':>10} {'ceiling':>8} {'%ceil':>6} "
        f"{'hit':>6} {'read/tok':>10} {'GB/s':>6} {'mem GB/s':>8} {'peak RSS':>10}",
        file=out,
    )
    for x in r["runs"]:
        print(
            f"{budget_asked(x):>10} {x['cache_policy']:>6} {x['prefill_tok_s']:11.1f} "
            f"{x['decode_tok_s']:10.2f} {x['ceiling_tok_s']:8.2f} {100 * x['fraction_of_ceiling']:5.0f}% "
            f"{100 * x['hit_rate']:5.1f}% {_gb(x['bytes_read_per_token']):>10} {x['achieved_gbps']:6.1f} "
            f"{x['membw_gbps']:8.1f} {_gb(x['peak_rss_bytes']):>10}"
            + f"  ({budget_line(x)}{'; all experts preloaded' if x['preloaded'] else ''})"
            + (
                f"  (sampled: temperature {x['sampling']['temperature']:g}, top_p {x['sampling']['top_p']:g})"
                if x.get("sampling", {}).get("temperature")
                else ""
            )
            + (
                f"  (LM head screened: {_gb(x['head_screen_bytes_per_token'])} a token against the full head)"
                if x.get("head_screen_bytes_per_token")
                else ""
            )
            + (f"  (expert slab committed in {x['commit_s']:.1f} s after load)" if x.get("commit_s", 0) >= 0.5 else ""),
            file=out,
        )
        print(
            f"{'':>10} prefill {x['prefill_tok_s']:.1f} t/s = {100 * x['prefill_fraction_of_flops']:.0f}% of the "
            f"FLOP ceiling {x['prefill_ceiling_tok_s']:.1f} t/s"
            + (
                f"; {100 * x['prefill_fraction_of_bf16_peak']:.0f}% of the bf16 dot peak's "
                f"({r['bf16_peak_gflops']:.0f} GFLOP/s) {x['prefill_bf16_ceiling_tok_s']:.1f} t/s"
                if "prefill_fraction_of_bf16_peak" in x
                else ""
            )
            + (f" (first after load: {x['prefill_first_tok_s']:.1f} t/s)" if "prefill_first_tok_s" in x else ""),
            file=out,
        )
        if "prefill_io_ceiling_tok_s" in x:
            print(
                f"{'':>10} prefill read {_gb(x['prefill_bytes_read'])} ({x['prefill_reads']} records, spans of "
                f"{x['prefill_span']} tokens): I/O {x['prefill_io_s']:.2f} s at {x['prefill_disk_gbps']:.2f} GB/s, "
                f"compute "
                f"{x['prefill_compute_s']:.2f} s ({x['prefill_compute_from']}); ceiling "
                f"{x['prefill_io_ceiling_tok_s']:.1f} t/s overlapped ({x['prefill_serial_ceiling_tok_s']:.1f} serial): "
                f"prefill = {100 * x['prefill_fraction_of_io_ceiling']:.0f}% of it",
                file=out,
            )
        if x["bytes_read_per_token"]:
            print(
                f"{'':>10} decode ceiling {x['ceiling_tok_s']:.2f} t/s: the larger of memory "
                f"{1e3 * x['ceiling_memory_s_per_token']:.1f} ms and disk {1e3 * x['ceiling_disk_s_per_token']:.1f} ms "
                f"a token ({_gb(x['bytes_read_per_token'])} read at {x['ceiling_disk_gbps']:.2f} GB/s; the reads were "
                f"served at {x['disk_served_gbps']:.2f} GB/s, "
                f"{'O_DIRECT' if x['direct_io'] else 'through the page cache'}): reads overlap compute; with no "
                f"overlap {x['serial_ceiling_tok_s']:.2f} t/s",
                file=out,
            )
        print(
            f"{'':>10} decode state after {x['state_positions']} positions: {x['state_bytes'] / 1e6:.1f} MB held, "
            f"{x['state_bytes_accounted'] / 1e6:.1f} MB accounted; grows {x['state_bytes_per_token']:,.0f} B per "
            f"token ({x['state_format']}; official inference's bf16: {x['state_official_bytes_per_token']:,.0f})",
            file=out,
        )
        if x.get("device", "cpu") != "cpu":
            print(f"{'':>10} {device_line(x)}", file=out)
        if len(x["repeats"]) > 1:
            fr = sorted(100 * y["fraction_of_ceiling"] for y in x["repeats"])
            print(
                f"{'':>10} {len(fr)} repeats: % of ceiling median {fr[len(fr) // 2]:.0f}, "
                f"range {fr[0]:.0f}-{fr[-1]:.0f}; "
                + ", ".join(f"{y['decode_tok_s']:.1f} t/s @ {y['membw_gbps']:.0f} GB/s" for y in x["repeats"]),
                file=out,
            )
        if "draft_mode" in x:
            print(
                f"{'':>10} draft {x['draft_mode']}: {x['draft_decode_tok_s']:.2f} t/s = "
                f"{x['draft_speedup']:.2f}x plain decode; acceptance {100 * x['draft_acceptance_rate']:.0f}%, "
                f"{x['draft_tokens_per_pass']:.2f} tokens per verify pass; same tokens as plain: "
                f"{'yes' if x['draft_same_tokens'] else 'NO'}",
                file=out,
            )
    if "transformers" in r:
        t = r["transformers"]
        print(
            f"{'engine':>24} {'prefill t/s':>11} {'decode t/s':>10}   (same weights, {len(r['runs'])} budget(s); "
            f"fastar's first)",
            file=out,
        )

        def first(x: dict) -> str:
            return f"   (first prefill: {x['prefill_first_tok_s']:.1f})" if "prefill_first_tok_s" in x else ""

        print(f"{'fastar':>24} {r['prefill_tok_s']:11.1f} {r['decode_tok_s']:10.2f}{first(r)}", file=out)
        print(
            f"{'transformers ' + t.get('dtype', 'float32'):>24} {t['prefill_tok_s']:11.1f} {t['decode_tok_s']:10.2f}"
            f"{first(t)}",
            file=out,
        )
        print(
            f"{'fastar / transformers':>24} {r['prefill_speedup_vs_transformers']:10.2f}x "
            f"{r['speedup_vs_transformers']:9.2f}x",
            file=out,
        )


def device_line(x: dict) -> str:
    """The accelerator tier's counters of one run (`fastar.model.device`), in one line."""
    n = max(1, x["device_experts_device"] + x["device_experts_cpu"])
    peak = (
        f", peak {_gb(x['device_peak_bytes'])} (resident {_gb(x['device_resident_bytes'])})"
        if "device_peak_bytes" in x
        else ""
    )
    return (
        f"device {x['device']}: experts {100 * x['device_experts_device'] / n:.0f}% on the device "
        f"({x['device_experts_streamed']} streamed), {100 * x['device_experts_cpu'] / n:.0f}% on the CPU "
        f"(CPU {x['device_cpu_seconds']:.2f} s, waited {x['device_wait_seconds']:.2f} s); pool "
        f"{counted(x['device_pool_n_slots'], 'slot')}, {counted(x['device_pool_hits'], 'hit')}, "
        f"{x['device_pool_admitted']} admitted, "
        f"{_gb(x['device_pool_bytes_copied'])} copied{peak}"
    )


def plot(r: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FastarError("--plot needs matplotlib: pip install 'fastar[plot]' (or matplotlib)") from None
    fig, ax = plt.subplots(figsize=(7, 4))
    ax2 = ax.twinx()
    for policy in dict.fromkeys(x["cache_policy"] for x in r["runs"]):
        runs = sorted((x for x in r["runs"] if x["cache_policy"] == policy), key=lambda x: x["ram_budget_bytes"])
        xs = [x["ram_budget_bytes"] / 1e9 for x in runs]
        ax.plot(xs, [x["decode_tok_s"] for x in runs], "o-", label=f"decode tok/s ({policy})")
        ax.plot(xs, [x["ceiling_tok_s"] for x in runs], "--", label=f"ceiling tok/s ({policy})")
        ax2.plot(xs, [100 * x["hit_rate"] for x in runs], "s:", label=f"hit rate % ({policy})")
    ax.set_xlabel("expert RAM budget (GB)")
    ax.set_ylabel("tokens/s")
    ax2.set_ylabel("hit rate (%)")
    fig.legend(loc="upper left")
    fig.tight_layout()
    tmp = os.path.join(os.path.dirname(os.path.abspath(path)), f".{os.path.basename(path)}.partial")
    try:  # written whole, then renamed over the name: an old plot (--force) is never left half replaced
        fig.savefig(tmp, format="png")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    finally:
        plt.close(fig)


def _refuse_v2(path: str, flag: str) -> None:
    """The table's byte and disk figures read a `.fst` v3 header or a checkpoint's shards: a FaStar v2 file has
    neither, so it is refused up front, naming the conversion that gives it both."""
    from ..convert.v2 import read_version

    if read_version(path) == 2:
        raise FastarError(
            f"{flag} {path}: a FaStar v2 file, which bench -m cannot measure: convert it to .fst v3 first "
            f"(`fastar convert {path} -o NEW.fst`) and bench that"
        )


def main(a) -> int:
    from ..console import memory_options

    if not os.path.exists(a.model):
        raise FastarError(f"{a.model}: no such file or directory")
    _refuse_v2(a.model, "-m")
    if a.compare:
        _refuse_v2(a.compare, "--compare")
    opts = memory_options(a)
    budgets = [
        None if s.strip().lower() == "none" else s.strip() for s in str(opts.pop("ram_budget") or "none").split(",")
    ]
    try:
        budgets = [b if b in (None, "auto") else parse_size(b) for b in budgets]
    except ConfigError as e:  # one line naming the flag, as run's --ram-budget
        raise ConfigError(f"--ram-budget: {e}") from None
    opts["draft"] = a.draft
    policies = [p.strip() for p in a.policies.split(",")] if a.policies else None
    bad = [p for p in policies or [] if p not in ("lrfu", "lru")]
    if bad:
        raise FastarError(f"--policies: unknown policy {bad[0]!r} (choose from lrfu, lru)")
    replay = a.replay
    if replay is not None and not 0 <= replay <= 1:
        raise FastarError(f"--replay: a probability in [0, 1], got {replay}")
    if replay is not None and opts["draft"] != "none":
        raise FastarError("--replay replaces the model's own draft: drop --draft")
    sampling = (a.temperature, a.top_p)
    if not (math.isfinite(sampling[0]) and sampling[0] >= 0):
        raise FastarError(f"--temperature: a finite number >= 0, got {sampling[0]}")
    if not 0 < sampling[1] <= 1:
        raise FastarError(f"--top-p: a number in (0, 1], got {sampling[1]}")
    if sampling[0] > 0 and (replay is not None or opts["draft"] != "none"):
        raise FastarError(
            "--temperature times plain sampled steps: drop --draft and --replay (bench draft compares them)"
        )
    reference, ref_dtype = a.reference, "float32"
    if a.compare_transformers:
        if a.reference:
            raise FastarError("--compare-transformers and --reference both name a transformers run: pick one")
        reference, ref_dtype = a.compare_transformers, "bfloat16"
    if reference and not os.path.isdir(reference):
        raise FastarError(f"{reference}: not a checkpoint directory (transformers loads a directory)")
    r = run(
        a.model,
        budgets,
        prompt_tokens=a.prompt_tokens,
        decode_tokens=a.decode_tokens,
        reference=reference,
        options=opts,
        policies=policies,
        warmup=a.warmup_tokens,
        replay=replay,
        repeats=a.repeats,
        reference_dtype=ref_dtype,
        sampling=sampling,
    )
    if a.compare:  # the same benchmark on another source of the same model (e.g. .fst vs checkpoint dir)
        r["compare"] = run(
            a.compare,
            budgets,
            prompt_tokens=a.prompt_tokens,
            decode_tokens=a.decode_tokens,
            options=opts,
            policies=policies,
            warmup=a.warmup_tokens,
            replay=replay,
            repeats=a.repeats,
            sampling=sampling,
        )
        r["compare"]["model"] = a.compare
        r["decode_ratio_vs_compare"] = r["decode_tok_s"] / r["compare"]["decode_tok_s"]
    if a.plot:
        plot(r, a.plot)
    if a.json:
        print(json.dumps(r, default=float))
    else:
        print(f"{a.model}:")
        print_table(r)
        if a.compare:
            print(f"\n{a.compare}:")
            print_table(r["compare"])
            print(f"\ndecode speed {a.model} / {a.compare} = {r['decode_ratio_vs_compare']:.2f}x")
    if a.plot:  # after the table (stdout, flushed first), where a reader of both streams looks last
        sys.stdout.flush()
        print(f"plot of tokens/s and hit rate against the RAM budget written to {a.plot}", file=sys.stderr)
    return 0
