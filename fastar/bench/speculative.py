"""Benchmark of speculative decoding against expert-cache pressure (`fastar bench draft -m CHECKPOINT`).

Owns: `SlowExperts` (an LRU expert cache of a given size in front of the real provider, each miss costing a fixed
extra time: a simulated SSD read), `ReplayDrafter` (drafts read from a plain greedy transcript, right with a chosen
probability, at no cost: what a well-trained draft would give), `bench` and `format_bench`. Does not own the
decoding itself (`fastar.engine.speculative`).

Why replay: the fixtures' MTP/DSpark weights are random, so their drafts are almost never right and only show the
cost side. Replay rows show the other side: at a given acceptance, how much a verify pass saves, and how that
saving shrinks as expert misses make every extra verified token cost nearly a full pass.
"""

from __future__ import annotations

import statistics
import time
from collections import OrderedDict

import torch

from ..config import parse_size
from ..contracts import Unpaged
from ..engine.speculative import Drafter, Pick, Proposal, Schedule
from ..errors import ConfigError
from ..model.state import ModelState


class SlowExperts(Unpaged):
    """An expert provider with an LRU cache of `capacity` experts in front of the real one; every miss also
    sleeps `miss_s` (a simulated SSD read, synchronous: no prefetch), which `io_s` adds up."""

    def __init__(self, inner, capacity: int, miss_s: float) -> None:
        self.inner, self.capacity, self.miss_s = inner, capacity, miss_s
        self.lru: OrderedDict = OrderedDict()
        self.hits = self.misses = 0
        self.io_s = 0.0  # simulated read time so far

    def get(self, layer: int, e: int):
        key = (layer, e)
        if key in self.lru:
            self.hits += 1
            self.lru.move_to_end(key)
        else:
            self.misses += 1
            self.io_s += self.miss_s
            time.sleep(self.miss_s)  # real, so `auto` measures it like a disk read
            self.lru[key] = True
            while len(self.lru) > self.capacity:
                self.lru.popitem(last=False)
        return self.inner.get(layer, e)

    def stats(self) -> dict:
        return {"hits": self.hits, "misses": self.misses}


def ram_budgets(flag: str | None) -> tuple[int | None, ...] | None:
    """`--ram-budget` for `bench draft`: None for "auto" (the default: the whole bank, a half, a quarter), else one
    size in bytes per comma-separated entry ("none": the whole bank). Raises ConfigError naming the flag."""
    entries = [e.strip() for e in str(flag or "auto").split(",")]
    if entries == ["auto"]:
        return None
    out: list[int | None] = []
    for entry in entries:
        if not entry or entry.lower() == "auto":
            raise ConfigError("--ram-budget: bench draft takes sizes or none in a list (auto alone: 1, 1/2, 1/4)")
        try:
            out.append(None if entry.lower() == "none" else parse_size(entry))
        except ConfigError as e:
            raise ConfigError(f"--ram-budget: {e}") from None
    return tuple(out)


def bench(
    path,
    drafts: tuple[str, ...] = ("none", "auto"),
    capacities: tuple[float, ...] = (1.0, 0.5, 0.25),
    miss_ms: float = 2.0,
    tokens: int = 64,
    prompt_tokens: int = 24,
    prompts: int = 2,
    reps: int = 3,
    numerics: str = "reference",
    wall: bool = False,
    ram_budgets: tuple[int | None, ...] | None = None,
    head_screen: bool = True,
) -> list[dict]:
    """Greedy decode tok/s for each draft mode and expert-cache size (a fraction of all experts, LRU; or, given
    `ram_budgets`, the experts that fit each budget in bytes, None: all of them), each miss costing `miss_ms` more, over
    `prompts` random prompts of `prompt_tokens` tokens with `tokens` generated each (the first out of the prefill,
    untimed). `head_screen` is the engine option of that name. Modes: `none`, `mtp`, `dspark`, `auto`, `replay:<a>` (4
    drafts per pass read from the plain greedy transcript, each right with probability a, at no draft cost: what a
    well-trained draft could give, so the table shows where drafting pays although the fixtures' random drafts are never
    right), and `auto-replay:<a>` (the same drafts under `auto`'s schedule). `none` must come first: it writes the
    transcripts and is the baseline. Modes run interleaved, `reps` times, each from a cold cache; tok/s is the median.
    Time is this process's CPU time plus the simulated read time (`wall=True`: wall-clock), so other load on a shared
    machine does not enter; everything runs on one thread. (`auto` itself still decides from wall time.) One row per
    (mode, capacity)."""
    from ..engine.engine import load
    from ..engine.source import open_source
    from ..quant.linear import SourceExperts

    source = open_source(path)
    cfg = source.config
    n_exp = cfg.num_layer_slots * cfg.n_routed_experts
    stride = source.expert_stride
    if ram_budgets is None:
        sizes = [max(1, int(frac * n_exp)) for frac in capacities]
    else:
        sizes = [n_exp if b is None else max(1, min(n_exp, b // stride)) for b in ram_budgets]
    g = torch.Generator().manual_seed(0)
    prompt_ids = [torch.randint(2, cfg.vocab_size, (prompt_tokens,), generator=g).tolist() for _ in range(prompts)]
    transcripts: list[list[int]] = []
    rows = []
    clock = time.perf_counter if wall else time.process_time
    for size in sizes:
        engines = {}
        for mode in drafts:
            replay = "replay:" in mode  # "replay:<a>" verifies 4 drafts; "auto-replay:<a>" schedules like auto
            slow = SlowExperts(SourceExperts(source), size, miss_ms / 1e3)
            eng = load(
                source,
                numerics=numerics,
                experts=slow,
                draft="none" if replay else mode,
                threads=1,
                head_screen=head_screen,
            )
            if replay:
                schedule = Schedule(r=0.3, q=0.0, adaptive=True) if mode.startswith("auto-") else Schedule(fixed=4)
                eng.use_draft(ReplayDrafter(eng.model, float(mode.split(":")[1])), schedule, mode)
            engines[mode] = (eng, slow, [])
        for _ in range(reps):
            for mode, (eng, slow, speeds) in engines.items():
                slow.lru.clear()
                t, n = 0.0, 0
                for i, ids in enumerate(prompt_ids):
                    if "replay:" in mode:
                        eng.drafter.transcript = transcripts[i]
                    chunks = eng.stream(ids, session=eng.open_session(), max_tokens=tokens, ignore_eos=True)
                    first = next(chunks)  # the prefill is not timed
                    t0, io0 = clock(), slow.io_s
                    out = [first.token] + [c.token for c in chunks]
                    t += clock() - t0 + (0.0 if wall else slow.io_s - io0)
                    n += len(out) - 1
                    if len(transcripts) <= i:
                        transcripts.append(ids + out)
                speeds.append(n / t)
        base = statistics.median(engines[drafts[0]][2])
        for mode, (eng, slow, speeds) in engines.items():
            st = eng.stats()
            plain, passes = st.get("draft_plain_steps", 0), st.get("draft_verify_passes", 0)
            drafted = st.get("draft_tokens_verified", 0)
            # a mode that verified no draft (`none`, or `auto` while drafting does not pay) has no acceptance or
            # tokens per pass: None (`-` in the table), not 0.0
            rows.append(
                {
                    "mode": mode,
                    "capacity": size / n_exp,
                    "cache_bytes": size * stride,
                    "tok_per_s": statistics.median(speeds),
                    "speedup": statistics.median(speeds) / base,
                    "acceptance": st["draft_acceptance_rate"] if drafted else None,
                    "tokens_per_pass": st["draft_tokens_per_pass"] if passes else None,
                    "plain_share": plain / (plain + passes) if plain + passes else None,
                    "hit_rate": slow.hits / max(1, slow.hits + slow.misses),
                }
            )
    return rows


class ReplayDrafter(Drafter):
    """Benchmark-only draft: the next tokens of `transcript` (a plain greedy run), each right with probability
    `accuracy` and otherwise another token; no model cost, no context rows. `sampled`: each draft comes with the
    one-hot distribution it was "drawn" from, so speculative sampling can verify it (accepted with the target's
    probability of that token: lossless, as any draft distribution is)."""

    kind = "replay"
    max_drafts = 4

    def __init__(self, model, accuracy: float, sampled: bool = False) -> None:
        super().__init__(model)
        self.accuracy, self.transcript, self.sampled = accuracy, [], sampled
        self.rng = torch.Generator().manual_seed(1)

    def _observe(self, state, rec, prev) -> None:
        pass

    def propose(self, state: ModelState, anchor: int, k: int, pick: Pick) -> Proposal:
        m, seq, V = state.length, self.transcript, self.model.config.vocab_size
        nxt = seq[m + 1 : m + 1 + k] if m < len(seq) and seq[m] == anchor else []
        nxt += [anchor] * (k - len(nxt))
        out = [t if float(torch.rand(1, generator=self.rng)) < self.accuracy else (t + 1) % V for t in nxt]
        probs = torch.nn.functional.one_hot(torch.tensor(out), V).float() if self.sampled else None
        return Proposal(out, probs, [None] * k)


def format_bench(rows: list[dict]) -> str:
    head = ("mode", "cache", "cache_MB", "hit", "tok/s", "speedup", "accept", "tok/pass", "plain")
    keys = ("capacity", "hit_rate", "tok_per_s", "speedup", "acceptance", "tokens_per_pass", "plain_share")
    lines = [f"{head[0]:>16} " + " ".join(f"{h:>8}" for h in head[1:])]
    for r in rows:
        values = [r["capacity"], r["cache_bytes"] / 1e6, *(r[k] for k in keys[1:])]
        lines.append(f"{r['mode']:>16} " + " ".join("       -" if v is None else f"{v:>8.2f}" for v in values))
    return "\n".join(lines)


if __name__ == "__main__":  # python -m fastar.bench.speculative CHECKPOINT [modes...]
    import sys

    torch.set_num_threads(1)
    modes = tuple(sys.argv[2:]) or ("none", "auto", "replay:0.5", "replay:0.8")
    print(format_bench(bench(sys.argv[1], drafts=modes)))
