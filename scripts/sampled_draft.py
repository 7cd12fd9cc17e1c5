"""Speculative sampling in the server's scheduler: a lone sampled request (unseeded) with and without drafting.

Loads MODEL (every expert preloaded where the budget holds them), decodes a plain greedy transcript of the prompt,
then times sampled requests alone through the step scheduler, alternating plain steps (`draft=False`) and
draft/verify steps with drafts replayed from that transcript (each right with probability --accuracy, verified by
speculative sampling with a one-hot draft distribution: `fastar.bench.speculative.ReplayDrafter`), as `fastar bench
--replay` does for greedy decoding. At a low temperature the target's distribution is nearly the greedy one, so a
right draft is accepted with nearly the probability --accuracy. Prints decode tok/s of each, the speed-up, the
acceptance, and how many sampled tokens followed the transcript, from one process.

The replayed drafts mean something only while the sampled run stays on the greedy transcript: once it samples
another token, the transcript no longer continues its context and every later draft is rejected. A synthetic model's
random weights give near-ties between its top logits, so the default temperature is 0.001: at 0.1, and at 0.01 on
some prompts, the run leaves the transcript within a few tokens and the figure measures rejected drafts, not
speculative sampling (`on transcript` in the output shows which case a run was).

    python scripts/sampled_draft.py MODEL [--accuracy 0.8] [--temperature 0.001] [--tokens 32] [--repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--accuracy", type=float, default=0.8)
    p.add_argument("--temperature", type=float, default=0.001)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--prompt", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    a = p.parse_args()

    from fastar.bench.model import _settle
    from fastar.bench.speculative import ReplayDrafter
    from fastar.engine.engine import load
    from fastar.engine.sampling import SamplingParams
    from fastar.engine.scheduler import Scheduler
    from fastar.engine.speculative import Schedule

    eng = load(a.model, ram_budget="auto")
    _settle(eng)
    g = torch.Generator().manual_seed(5)
    prompt = torch.randint(3, min(eng.config.vocab_size, 100_000), (a.prompt,), generator=g).tolist()
    drafter = ReplayDrafter(eng.model, a.accuracy, sampled=True)

    def run(draft: bool, params: SamplingParams) -> tuple[list[int], float, dict]:  # tokens, decode tok/s, metrics
        sched = Scheduler(eng, draft=draft)
        times, toks = [], []
        sched.submit(
            prompt,
            params,
            on_chunk=lambda c: (times.append(time.perf_counter()), toks.append(c.token)) if c.token is not None else 0,
        )
        sched.run_until_idle()
        return toks, (len(times) - 1) / (times[-1] - times[0]), sched.metrics()

    transcript, _, _ = run(False, SamplingParams(max_tokens=a.tokens + 8, ignore_eos=True))
    drafter.transcript = prompt + transcript
    params = SamplingParams(max_tokens=a.tokens, temperature=a.temperature, ignore_eos=True)  # unseeded: may draft
    rates: dict[str, list[float]] = {"plain": [], "drafted": []}
    steps = accepted = drafted_tokens = passes = on = total = 0
    for i in range(a.repeats):
        for mode in ("plain", "drafted") if i % 2 == 0 else ("drafted", "plain"):
            eng.use_draft(drafter if mode == "drafted" else None, Schedule(fixed=4), "replay")
            toks, rate, m = run(mode == "drafted", params)
            rates[mode].append(rate)
            lead = next((i for i, (t, g) in enumerate(zip(toks, transcript)) if t != g), len(toks))
            on, total = on + lead, total + len(toks)  # tokens before the run first left the greedy transcript
            if mode == "drafted":  # use_draft starts new counters: read them after each drafted run
                st = eng.draft_stats
                steps, passes = steps + m["sampled_draft_steps"], passes + st.passes
                accepted, drafted_tokens = accepted + st.accepted, drafted_tokens + st.drafted
    plain, drafted = statistics.median(rates["plain"]), statistics.median(rates["drafted"])
    print(
        f"{a.model}: sampled request alone, temperature {a.temperature}, drafts right with probability "
        f"{a.accuracy}: plain {plain:.2f} tok/s, drafted {drafted:.2f} tok/s -> {drafted / plain:.2f}x "
        f"(medians of {a.repeats}, alternated; plain {', '.join(f'{r:.2f}' for r in rates['plain'])}; drafted "
        f"{', '.join(f'{r:.2f}' for r in rates['drafted'])}); {steps} sampled draft steps, {passes} verify passes, "
        f"{accepted}/{drafted_tokens} drafts accepted; {on}/{total} sampled tokens on transcript"
    )
    eng.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
