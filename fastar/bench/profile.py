"""`fastar bench -m FILE --profile 1,4`: where the time of a decode step goes, for 1 and N rows.

Owns: the decode-step profile. It loads the model as `fastar bench` does (every expert preloaded where the budget
holds them all), starts N sequences on short random prompts, and times decode steps as the scheduler runs them
(`DeepseekV4.forward_rows` on the N rows, then each row's `Sampler`), alternating a plain step and a profiled one.
In a profiled step every call into the C extension is timed (the extension module is swapped for a timing proxy in
`fastar.quant.kernels`, `fastar.model.ops` and `fastar.model.state` for the run, calls from other threads such as
the pager's pass through untimed) and so are a few Python regions; each timer counts its own time less the timers
nested in it, so the categories and the remainder add up to the step exactly:

- C kernels, by what they compute: FP8 products (with the MoE's shared expert, one C call with its SwiGLU and
  rounding: `fastar.model.moe_fused`), BF16 products (LM head, routers, compressors), FP4 routed experts,
  attention, the indexer's scores and top-k, compressor pooling (at decode a row's whole compressor step, one call:
  `fastar.model.compress_fused`), mHC, norms, other row ops (RoPE, activation quantization, SwiGLU), KV-state row
  packing, the router's weights after its top-k (`fastar.model.route_fused`), and the attention block's fused decode
  calls (its four FP8 products with the norms, RoPE and rounding between them: `fastar.model.fused`);
- torch ops: routing/top-k (`MoE.route`, or `MoE.route_c` where the C router applies, less its C calls) and
  sampling (`Sampler`, less nothing: it is all torch and numpy);
- waiting for expert reads (a model paged from disk): the time the MoE waited for routed experts still being read
  (the expert cache's stall counter over the step), taken out of the MoE's bookkeeping below: I/O, not glue;
- outside kernels: what is left, i.e. Python and small torch ops between the kernels, split by where it runs: the
  attention block's query/KV projections (`Attention._project`), its compressors and indexer
  (`Attention._compress_project`, `Compressor.add`, their fused decode calls, the indexer's queries), its attention
  core (`Attention._attend`: window and entry rows, the C call's arguments), its output (`Attention._output`) and the
  rest of `Attention.rows` (per-row state bookkeeping); the MoE block's shared expert (`MoE._shared`) and the rest of
  `MoE.__call__` (expert lookup, routing bookkeeping); the mHC wrappers (`HyperConnection.pre` / `post`, or at
  decode `HCChain.begin` / `begin_ids` / `then`: `fastar.model.hc_chain`); the LM head's wrappers after the final norm
  (`DeepseekV4._logits`: the screen's or the head's Python); and the step itself (the layer loop, the embedding,
  the states' lengths and trims).

Beside them: the calling thread's CPU time in the glue (wall time outside kernels also counts the time it waited for
a core on a loaded machine; its CPU time counts only the work), the plain steps' median (what profiling costs
shows as the difference), the memory bandwidth measured around the run (this machine's 1 GiB probe where the
model's LM head is too small to measure it: `model.MemoryBandwidth`, as `--streams`), the bytes a step reads
(`model.StepBytes`, the count `--streams`' ceiling uses too: resident weights once, with the head screen its int8
head and the head rows it computed exactly, plus the distinct experts the rows routed to, by whichever router the
layer takes) and the step's byte floor at that bandwidth, and each product category's achieved weight GB/s.
Each plain step is followed by two profiled ones: one for the times, whose timers read the wall clock only (a C
call's: two clock reads and a note, its weight bytes and the routed experts counted after the step), and one for
the CPU figures, whose timers also read the thread's CPU clock (a system call: from the cold caches a
weight-streaming kernel leaves, it costs several microseconds, twice per timed call, which would land in the
time outside kernels).
What the timers cost: each timed call still adds its clock reads and bookkeeping; the wall clock is read inside
them, so a kernel's time is its own and the cost lands in the enclosing category, overstating the time outside
kernels. So the profile also gives the glue less the timers, twice: less their cost measured on a no-op timed the
same way in a loop (warm caches: a lower bound of the cost, so an upper bound of the glue), and less their cost on
a no-op timed right after streaming 128 MB of weights (cold caches: an upper bound of the cost, as every timer
would run right after a kernel; so a lower bound of the glue). The glue lies between the two. (The plain steps'
median beside it is no better a measure: the memory bandwidth moves between steps by more than the whole glue.)
Owns only the measuring: nothing here runs in production.
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable

import torch

from .model import MemoryBandwidth, StepBytes, _settle, one_engine_options

# the attention block's fused decode calls (`fastar.model.fused`): its four FP8 products with their row ops
FUSED_ATTENTION = "attention products (fused)"
# C entry point -> category (anything else the extension does during a step: "other C kernels")
C_CATEGORIES = {
    "fp8_matmul": "FP8 products",
    "bf16_matmul": "BF16 products",
    "fp4_matmul": "FP4 experts",
    "expert_ffn": "FP4 experts",
    "experts_ffn": "FP4 experts",
    "attend": "attention",
    "attend_stored": "attention",  # a decode query's attention over its stored rows (`fastar.model.attend_fused`)
    "index_scores": "indexer scores/top-k",
    "index_topk": "indexer scores/top-k",
    "compress_pool": "compressor pooling",
    "compress_row": "compressor pooling",  # a decode row's whole compressor step (`fastar.model.compress_fused`)
    "hc_pre": "mHC",
    "hc_post": "mHC",
    "hc_post_pre": "mHC",  # a sub-layer's mix back and the next site's collapse in one call (`fastar.model.hc_chain`)
    "sinkhorn": "mHC",
    "rms_norm": "norms",
    "rope": "other row ops",
    "fp8_act_quant": "other row ops",
    "swiglu": "other row ops",
    "state_rows_encode": "KV-state rows",
    "state_rows_decode": "KV-state rows",
    "attn_project": FUSED_ATTENTION,
    "attn_output": FUSED_ATTENTION,
    "index_queries": FUSED_ATTENTION,  # the indexer's queries and head weights at decode (`fastar.model.fused`)
    "shared_ffn": "FP8 products",  # the MoE's shared expert in one call (`fastar.model.moe_fused`): two FP8 products
    "route_weights": "routing weights",  # the router after its top-k in one call (`fastar.model.route_fused`)
    "head_i8_dot": "LM head screen (int8)",  # greedy rows' int8 head products (`fastar.model.head_screen`)
    "head_i8_select": "LM head screen (int8)",  # the rows whose bound can hold the argmax
    "head_i8_screen": "LM head screen (int8)",  # the two above in one pass, from 2 rows (first int8 terms mostly)
    "gather_rows": "LM head screen (int8)",  # the candidate rows, gathered for their exact BF16 logits
    "embed_streams": "other row ops",  # the step's embedding rows widened into the mHC streams (`hc_chain`)
    "head_i8_exact": "LM head screen (int8)",  # the candidates gathered, their exact BF16 logits, scattered
}
TORCH_CATEGORIES = ("routing/top-k", "sampling")
STALL = "waiting for expert reads"  # the MoE's waits for routed experts still being read from disk (paged models)
OUTSIDE = "outside: "  # the prefix of every category of time outside any kernel
PRODUCTS = ("FP8 products", "BF16 products", "FP4 experts", FUSED_ATTENTION, "LM head screen (int8)")
# where each weight-reading entry point's weights are among its arguments
_WEIGHT_ARGS = {
    "attn_project": (1, 2, 4, 5),
    "attn_output": (5, 6, 9, 10),
    "index_queries": (1, 2, 4, 5),
    "shared_ffn": (1, 2, 3, 4),
    "head_i8_dot": (1,),
    "head_i8_screen": (3,),
}


class _Clock:
    """Nested exclusive timers on one thread: each category gets its own time less its nested timers'. In a step with
    `cpu` off the timers read the wall clock only (the step's times, `own`); with it on they read this thread's CPU
    clock too (`own_cpu` only): a system call that costs ~6 us from the cold caches a kernel leaves, twice per timed
    call, which would land in the times outside kernels of the step that reads it."""

    def __init__(self) -> None:
        self.own: Counter = Counter()
        self.own_cpu: Counter = Counter()  # this thread's CPU time (time.thread_time): not inflated when descheduled
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()
        self.flops: Counter = Counter()  # the weight products' multiply-adds x 2, where `flops_of` counts them
        self.flops_of: Callable[[str, tuple], int] | None = None  # (entry point, its arguments) -> FLOPs
        self.owner = threading.get_ident()
        self.on = self.cpu = False
        self._stack: list[list] = []  # [category, start, nested seconds, start CPU, nested CPU]
        self._kernels: list[tuple] = []  # (category, seconds, entry point or None, its arguments): `settle` sums them

    def enter(self, cat: str) -> None:
        # the wall clock read last on entering and first on leaving: the CPU clock and the bookkeeping fall outside
        # the timed call, so a kernel's time is the kernel's
        c0 = time.thread_time() if self.cpu else 0.0
        self._stack.append([cat, 0.0, 0.0, c0, 0.0])
        self._stack[-1][1] = time.perf_counter()

    def leave(self) -> float:
        t1 = time.perf_counter()
        cat, t0, nested, c0, nested_cpu = self._stack.pop()
        dt = t1 - t0
        if self.cpu:
            dc = time.thread_time() - c0
            self.own_cpu[cat] += dc - nested_cpu
            if self._stack:
                self._stack[-1][4] += dc
        else:
            self.own[cat] += dt - nested
            self.calls[cat] += 1
            if self._stack:
                self._stack[-1][2] += dt
        return dt

    def kernel(self, cat: str, dt: float, weighs: str | None, args: tuple) -> None:
        """A C call's `dt` seconds (wall, a step with `cpu` off), noted for `settle` and taken off the enclosing
        timer."""
        self._kernels.append((cat, dt, weighs, args))
        if self._stack:
            self._stack[-1][2] += dt

    def settle(self) -> None:
        """The C calls noted since the last `settle` into the totals, and the weight bytes they read (counted here,
        after the step, not inside the time of the code around them)."""
        for cat, dt, weighs, args in self._kernels:
            self.own[cat] += dt
            self.calls[cat] += 1
            if weighs is not None:
                self.bytes[cat] += _weight_bytes(weighs, args)
                if self.flops_of is not None:
                    self.flops[cat] += self.flops_of(weighs, args)
        self._kernels.clear()

    def timing(self) -> bool:
        return self.on and threading.get_ident() == self.owner

    def wrap(self, cat: str, fn):
        def timed(*a, **k):
            if not self.timing():
                return fn(*a, **k)
            self.enter(cat)
            try:
                return fn(*a, **k)
            finally:
                self.leave()

        return timed


def _weight_bytes(name: str, args: tuple) -> int:
    """Weight bytes a product call reads (its weight and scale arrays)."""
    if name in ("fp8_matmul", "fp4_matmul"):
        return args[1].nbytes + args[2].nbytes
    if name == "bf16_matmul":
        return args[1].nbytes
    if name == "expert_ffn":
        return sum(a.nbytes for a in args[1:7])
    if name == "experts_ffn":
        return sum(a.nbytes for ew in args[1] for a in ew)
    if name in _WEIGHT_ARGS:
        return sum(args[i].nbytes for i in _WEIGHT_ARGS[name] if args[i] is not None)
    return 0


class _TimedExtension:
    """Stands in for the C extension module: every entry point timed under its category on the clock's thread."""

    def __init__(self, ext, clock: _Clock, categories: dict[str, str] = C_CATEGORIES) -> None:
        self._ext, self._clock, self._categories = ext, clock, categories

    def __getattr__(self, name: str):
        f = getattr(self._ext, name)
        if not callable(f):
            return f
        cat, clock = self._categories.get(name, "other C kernels"), self._clock
        weighs = name in ("fp8_matmul", "bf16_matmul", "fp4_matmul", "expert_ffn", "experts_ffn", *_WEIGHT_ARGS)

        weighs = name if weighs else None

        def timed(*a, **k):  # the least a timer can do here: two clock reads and one note (`_Clock.kernel`)
            if not clock.timing():
                return f(*a, **k)
            if clock.cpu:  # a step timed for the CPU figures: nested as the regions are
                clock.enter(cat)
                try:
                    return f(*a, **k)
                finally:
                    clock.leave()
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                clock.kernel(cat, time.perf_counter() - t0, weighs, a)

        setattr(self, name, timed)  # looked up once per name
        return timed


class _Instrumented:
    """The timers installed on a loaded engine for the profile's life (`close` puts everything back)."""

    def __init__(self, engine, clock: _Clock, categories: dict[str, str] = C_CATEGORIES) -> None:
        from ..model import ops, state
        from ..quant import kernels

        self.clock, self.model = clock, engine.model
        self._modules = [m for m in (kernels, ops, state) if m._C is not None]
        self._saved_c = [m._C for m in self._modules]
        proxy = _TimedExtension(kernels._C, clock, categories) if kernels._C is not None else None
        for m in self._modules:
            m._C = proxy
        self._saved_ext = kernels.extension  # what `Linear`'s bound products call
        if proxy is not None:
            kernels.extension = proxy
        self.experts: list[int] = []  # distinct experts per layer of each timed call, summed per step
        self._routes: list = []  # the expert ids each routing call of the step picked
        self._saved = []  # (object, attribute) wrapped on the instance: popped from its __dict__ at close

        def wrap(obj, name: str, cat: str, fn=None) -> None:
            self._saved.append((obj, name))
            setattr(obj, name, clock.wrap(OUTSIDE + cat, fn or getattr(obj, name)))

        for b in self.model.layers:
            ffn, attn = b.ffn, b.attn
            for name in ("route", "route_c"):  # the torch router, and the C one where it applies
                self._saved.append((ffn, name))
                setattr(ffn, name, self._route(clock.wrap("routing/top-k", getattr(ffn, name))))
            wrap(attn, "rows", "attention (rest)")
            wrap(attn, "_project", "attention q/kv projections")
            wrap(attn, "_attend", "attention core")
            if attn.stored_attend is not None:  # a decode row's attention and picks, called from `Attention.rows`
                wrap(attn.stored_attend, "into", "attention core")
                if attn.indexer is not None:
                    wrap(attn.indexer, "pick_stored", "attention core")
            wrap(attn, "_output", "attention output")
            if attn.compressors:
                wrap(attn, "_compress_project", "compressors and indexer")
            if attn.comp_fused is not None:
                wrap(attn.comp_fused, "project", "compressors and indexer")
                wrap(attn.comp_fused, "add", "compressors and indexer")
            for c in attn.compressors:
                wrap(c, "add", "compressors and indexer")
            if attn.indexer is not None:
                wrap(attn.indexer, "queries", "compressors and indexer")
            wrap(ffn, "_shared", "shared expert")
            wrap(b.hc_attn, "pre", "mHC wrappers")
            wrap(b.hc_ffn, "pre", "mHC wrappers")
        if self.model.hc_chain is not None:  # `forward_rows`' mHC sites chained: one call per sub-layer
            wrap(self.model.hc_chain, "begin", "mHC wrappers")
            wrap(self.model.hc_chain, "begin_ids", "mHC wrappers")  # the step's embedding into the streams, collapsed
            wrap(self.model.hc_chain, "then", "mHC wrappers")
        wrap(self.model, "_logits", "LM head (rest)")
        # looked up on the class: the block calls `self.ffn(...)` and `HyperConnection.post(...)`
        self._moe_cls = type(self.model.layers[0].ffn)
        self._moe_call = self._moe_cls.__call__
        self._moe_cls.__call__ = clock.wrap(OUTSIDE + "MoE (rest)", self._moe_call)
        self._hc_cls = type(self.model.layers[0].hc_attn)
        self._hc_post = self._hc_cls.__dict__["post"]
        self._hc_cls.post = staticmethod(clock.wrap(OUTSIDE + "mHC wrappers", self._hc_post.__func__))

    def _route(self, route):
        def routed(x, ids, *xa):
            got = route(x, ids, *xa)  # (expert ids, weights), tensors or arrays; None where `route_c` does not apply
            if got is not None and self.clock.timing() and not self.clock.cpu:
                self._routes.append(got[0])  # counted after the step (`count_experts`), not in the MoE's time
            return got

        return routed

    def count_experts(self) -> None:
        """The distinct experts of each routing call since the last count, summed: one step's entry of `experts`."""
        self.experts.append(sum(len(set(ids.reshape(-1).tolist())) for ids in self._routes))
        self._routes.clear()

    def close(self) -> None:
        for m, c in zip(self._modules, self._saved_c):
            m._C = c
        from ..quant import kernels

        kernels.extension = self._saved_ext
        for obj, name in self._saved:
            obj.__dict__.pop(name, None)
        self._moe_cls.__call__ = self._moe_call
        self._hc_cls.post = self._hc_post


def _stall_s(engine) -> float:
    """Seconds the engine's expert cache has waited for reads so far (0 without a paging cache)."""
    cache = engine.expert_cache
    return cache.stats()["stall_s"] if cache is not None else 0.0


def _noop() -> None:
    return None


def _timers(clock: _Clock) -> tuple:
    """A no-op timed as a kernel is (the extension proxy's wrapper) and as a region is (`_Clock.wrap`), on `clock`."""
    kernel = _TimedExtension(type("Ext", (), {"noop": staticmethod(_noop)}), clock).noop
    return kernel, clock.wrap("calibration", _noop)


def _timer_cost(n: int = 20_000) -> tuple[float, float]:
    """Seconds one timed call adds to its step beside what it times, (a kernel's timer, a region's): the no-op timed
    against the no-op alone, best of 3, in a loop (warm caches: a lower bound)."""
    clock = _Clock()
    clock.on = True
    clock.enter("calibration")  # the timers run inside a region's, as in a step
    out = []
    for timed in _timers(clock):
        best = float("inf")
        for _ in range(3):
            t0 = time.perf_counter()
            for _ in range(n):
                timed()
            t1 = time.perf_counter()
            for _ in range(n):
                _noop()
            best = min(best, (t1 - t0) - (time.perf_counter() - t1))
            clock.settle()
        out.append(max(0.0, best / n))
    clock.leave()
    return out[0], out[1]


def _timer_cost_cold(flush, n: int = 15) -> tuple[float, float]:
    """`_timer_cost` from cold caches, as a timer runs right after a weight-streaming kernel: each time the timed no-op
    and the no-op alone after `flush()` (a stream through weights larger than the caches), the medians' difference
    (an upper bound: in a step some timers find the code warm)."""
    clock = _Clock()
    clock.on = True
    clock.enter("calibration")
    out = []
    for timed in _timers(clock):
        with_timer, alone = [], []
        for _ in range(n):
            for fn, got in ((timed, with_timer), (_noop, alone)):
                flush()
                t0 = time.perf_counter()
                fn()
                got.append(time.perf_counter() - t0)
        clock.settle()
        out.append(max(0.0, statistics.median(with_timer) - statistics.median(alone)))
    clock.leave()
    return out[0], out[1]


FLUSH_BYTES = 128 << 20  # streamed to leave the caches cold (4x this machine's L3, and more than most)


def _flusher(engine):
    """A call that streams FLUSH_BYTES of the LM head's weights (as a decode step streams its weights), or None where
    the head is smaller or the C kernels are not built."""
    from ..quant import kernels

    w = engine.model.head.weight
    if kernels._C is None or w.numel() * w.element_size() < FLUSH_BYTES:
        return None
    buf, ext = w.reshape(-1).view(torch.uint8).numpy()[:FLUSH_BYTES], kernels._C
    return lambda: ext.read_bandwidth(buf)


def _step(model, samplers, pending: list[int], states, clock: _Clock | None) -> list[int]:
    """One scheduler decode step on the rows: `forward_rows`, then each row's sampler. -> the next tokens."""
    logits = model.forward_rows(pending, states, [s.head_request() for s in samplers])
    out = []
    for s, row in zip(samplers, logits):
        if clock is not None:
            clock.enter("sampling")
        out.append(s(row)[0])
        if clock is not None:
            clock.leave()
    return out


def profile_rows(
    engine, rows: int, steps: int, prompt_tokens: int = 16, warmup: int = 2, seed: int = 0, flush=None
) -> dict:
    """`steps` profiled decode steps of `rows` sequences (each after a plain one, alternated) -> the breakdown.
    `flush`: a call that streams more than the caches hold, for the timers' cost from cold caches (None: not
    measured)."""
    from ..engine.sampling import Sampler, SamplingParams

    model, vocab = engine.model, engine.config.vocab_size
    g = torch.Generator().manual_seed(seed + rows)
    states, pending = [], []
    for _ in range(rows):
        st = engine.new_state()
        logits = engine.prefill(torch.randint(3, min(vocab, 100_000), (prompt_tokens,), generator=g).tolist(), st)
        states.append(st)
        pending.append(int(logits[-1].argmax()))
    samplers = [Sampler(SamplingParams()) for _ in range(rows)]
    for _ in range(warmup):
        pending = _step(model, samplers, pending, states, None)
    clock = _Clock()
    inst = _Instrumented(engine, clock)
    plain, profiled, stall, exact = [], [], 0.0, 0

    def exact_rows() -> int:  # the head rows the screen computed in full so far (their bytes are the step's too)
        return model.screen.exact_rows if model.screen is not None else 0

    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            pending = _step(model, samplers, pending, states, None)
            plain.append(time.perf_counter() - t0)
            for cpu in (False, True):  # a step for the times, then one for the CPU figures
                if not cpu:
                    waited, exact0 = _stall_s(engine), exact_rows()
                clock.on, clock.cpu = True, cpu
                clock.enter(OUTSIDE + "step")
                try:
                    pending = _step(model, samplers, pending, states, clock)
                finally:
                    took = clock.leave()
                    clock.on = clock.cpu = False
                    clock.settle()
                if not cpu:
                    profiled.append(took)
                    stall += _stall_s(engine) - waited
                    exact += exact_rows() - exact0
                    inst.count_experts()
    finally:
        inst.close()
    step_s = sum(profiled) / steps
    per_step = {k: v / steps for k, v in clock.own.items()}
    if stall > 0:  # the MoE waited for reads inside its bookkeeping: I/O, not glue; carved out of that category
        moved = min(stall / steps, per_step.get(OUTSIDE + "MoE (rest)", 0.0))
        per_step[OUTSIDE + "MoE (rest)"] -= moved
        per_step[STALL] = moved
    kernels = sum(
        v for k, v in per_step.items() if k not in TORCH_CATEGORIES and k != STALL and not k.startswith(OUTSIDE)
    )
    torch_ops = sum(per_step.get(k, 0.0) for k in TORCH_CATEGORIES)
    outside = sum(v for k, v in per_step.items() if k.startswith(OUTSIDE))
    # the timers' own cost lands outside kernels (a few us per timed call): measured on a no-op, taken off
    # (the kernels' timers and the regions' differ: a region's reads the CPU clock too)
    kernel_cats = {*C_CATEGORIES.values(), "other C kernels"}
    kernel_calls = sum(v for k, v in clock.calls.items() if k in kernel_cats) / steps
    region_calls = sum(v for k, v in clock.calls.items() if k not in kernel_cats and k != OUTSIDE + "step") / steps
    timed_calls = kernel_calls + region_calls
    hot = _timer_cost()
    timers_s = kernel_calls * hot[0] + region_calls * hot[1]
    outside_net = max(0.0, outside - timers_s)
    # from cold caches the timers cost several times more (each step streams its weights through the caches): that
    # cost is an upper bound of theirs, so the glue less it a lower bound of the glue (between the two: the truth)
    cold = _timer_cost_cold(flush) if flush is not None else None
    timers_cold_s = None if cold is None else kernel_calls * cold[0] + region_calls * cold[1]
    outside_net_cold = None if cold is None else max(0.0, outside - timers_cold_s)
    return {
        "rows": rows,
        "steps": steps,
        "positions": states[0].length,
        "step_ms": 1e3 * step_s,
        "plain_step_ms_median": 1e3 * statistics.median(plain),
        "timed_calls_per_step": timed_calls,
        "timer_us": {"kernel": 1e6 * hot[0], "region": 1e6 * hot[1]}
        | ({} if cold is None else {"kernel_cold": 1e6 * cold[0], "region_cold": 1e6 * cold[1]}),
        "timers_ms": 1e3 * timers_s,
        "timers_cold_ms": None if cold is None else 1e3 * timers_cold_s,
        "outside_kernels_net_cold_ms": None if cold is None else 1e3 * outside_net_cold,
        "outside_kernels_net_cold_fraction": None if cold is None else outside_net_cold / (step_s - timers_cold_s),
        "outside_kernels_net_ms": 1e3 * outside_net,
        "outside_kernels_net_fraction": outside_net / (step_s - timers_s),
        "profiled_step_ms_median": 1e3 * statistics.median(profiled),
        "categories_ms": {k: 1e3 * v for k, v in sorted(per_step.items(), key=lambda kv: -kv[1])},
        "calls_per_step": {k: v / steps for k, v in clock.calls.items()},
        "kernels_ms": 1e3 * kernels,
        "torch_ops_ms": 1e3 * torch_ops,
        "outside_kernels_ms": 1e3 * outside,
        "expert_stall_ms": 1e3 * per_step.get(STALL, 0.0),
        "outside_kernels_fraction": outside / step_s,
        # the calling thread's CPU seconds in the glue: on a loaded machine wall time outside kernels also counts
        # the time the thread waited for a core, its CPU time only the work (judge glue changes by it there)
        "outside_kernels_cpu_ms": 1e3 * sum(v for k, v in clock.own_cpu.items() if k.startswith(OUTSIDE)) / steps,
        "categories_cpu_ms": {k: 1e3 * clock.own_cpu.get(k, 0.0) / steps for k in clock.own}
        | ({STALL: 0.0} if stall else {}),
        "outside_c_kernels_fraction": (outside + torch_ops) / step_s,
        "product_gbps": {k: clock.bytes[k] / steps / per_step[k] / 1e9 for k in PRODUCTS if per_step.get(k)},
        "experts_per_step": sum(inst.experts) / steps,
        "exact_head_rows_per_step": exact / steps,
    }


def bench(path: str, rows: list[int], steps: int = 16, prompt_tokens: int = 16, **options) -> dict:
    """`options`: the engine's (`load`'s; `model.one_engine_options`)."""
    from ..engine.engine import load

    engine = load(path, **options)
    try:
        settled = _settle(engine)
        step = StepBytes.of(engine)  # as --streams counts a call's bytes
        out, bandwidth = [], MemoryBandwidth(engine)
        for n in rows:
            before = bandwidth.gbps()
            r = profile_rows(engine, n, steps, prompt_tokens, flush=_flusher(engine))
            after = bandwidth.gbps()
            r["membw_gbps"] = (before + after) / 2 if before and after else None
            r["membw_source"] = bandwidth.source  # "head": measured around the run; "probe": the machine's
            r["step_bytes"] = step(n, r["experts_per_step"], r["exact_head_rows_per_step"])
            if r["membw_gbps"]:
                r["byte_floor_ms"] = 1e3 * r["step_bytes"] / (r["membw_gbps"] * 1e9)
            out.append(r)
        head = engine.model.screen is not None
        return {"model": str(path), "preloaded": settled["preloaded"], "head_screen": head, "profiles": out}
    finally:
        engine.close()


def format_profile(r: dict) -> str:
    head = "the LM head screened for greedy rows" if r.get("head_screen") else "the full LM head"
    lines = [f"{r['model']}: decode-step profile (forward_rows + sampling, as the scheduler steps; {head})"]
    for p in r["profiles"]:
        step = p["step_ms"]
        probe = f"; the GB/s is {MemoryBandwidth.PROBE_NOTE}" if p.get("membw_source") == "probe" else ""
        floor = (
            f"; byte floor {p['byte_floor_ms']:.1f} ms at {p['membw_gbps']:.1f} GB/s ({p['step_bytes'] / 1e9:.2f} GB"
            f", step at {100 * p['byte_floor_ms'] / step:.0f}% of it){probe}"
            if p.get("byte_floor_ms")
            else ""
        )
        lines.append(
            f"  {p['rows']} row(s) at position ~{p['positions']}: step {step:.2f} ms profiled, "
            f"{p['plain_step_ms_median']:.2f} ms plain (median of {p['steps']}){floor}"
        )
        for k, v in p["categories_ms"].items():
            gbps = f"  {p['product_gbps'][k]:.1f} GB/s" if k in p["product_gbps"] else ""
            calls = p["calls_per_step"].get(k, 0)
            lines.append(f"    {k:<40} {v:8.3f} ms {100 * v / step:5.1f}%  {calls:6.0f} calls{gbps}")
        lines.append(
            f"    {'= C kernels':<40} {p['kernels_ms']:8.3f} ms {100 * p['kernels_ms'] / step:5.1f}%; torch ops "
            f"{100 * p['torch_ops_ms'] / step:.1f}%; waiting for expert reads {100 * p['expert_stall_ms'] / step:.1f}%"
            f"; outside kernels {100 * p['outside_kernels_fraction']:.1f}% "
            f"(outside any C kernel {100 * p['outside_c_kernels_fraction']:.1f}%); the calling thread's CPU time "
            f"outside kernels {p['outside_kernels_cpu_ms']:.2f} ms"
        )
        lines.append(
            f"    {'= outside kernels, less the timers':<40} {p['outside_kernels_net_ms']:8.3f} ms "
            f"{100 * p['outside_kernels_net_fraction']:5.1f}% of the step less the timers' cost "
            f"({p['timed_calls_per_step']:.0f} timed calls at "
            f"{1e3 * p['timers_ms'] / max(p['timed_calls_per_step'], 1):.2f} us, their cost in a loop)"
        )
        if p.get("outside_kernels_net_cold_ms") is not None:
            lines.append(
                f"    {'= outside kernels, less cold timers':<40} {p['outside_kernels_net_cold_ms']:8.3f} ms "
                f"{100 * p['outside_kernels_net_cold_fraction']:5.1f}% of the step less the timers' cost from cold "
                f"caches ({1e3 * p['timers_cold_ms'] / max(p['timed_calls_per_step'], 1):.2f} us a call: the glue lies"
                " between the two)"
            )
    return "\n".join(lines)


def main(a) -> int:
    """`a.profile` (row counts) and `a.decode_tokens` (steps, at least 1) as `fastar.bench.check_arguments` and the
    flag's type let them through."""
    rows = [int(s) for s in a.profile.split(",")]
    r = bench(a.model, rows, steps=a.decode_tokens, prompt_tokens=a.prompt_tokens, **one_engine_options(a))
    print(json.dumps(r) if a.json else format_profile(r), file=sys.stdout)
    return 0
