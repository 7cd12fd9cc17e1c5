"""A reply streaming while another request's long prompt prefills, at each `--prefill-share` given.

On one engine's scheduler (no HTTP): a reader request decodes (greedy, 16 random prompt tokens); after its fifth
token a prompt of `--long` random tokens is submitted. Prints, per share and trial, when the long prompt's first
token came (seconds after it was submitted), how many tokens the reader got meanwhile (and their rate), and the
reader's longest gap between two tokens in that time. Shares alternate within each trial.

    python scripts/prefill_share.py MODEL [--long 3800] [--shares 1,0.5] [--trials 2]
"""

from __future__ import annotations

import argparse
import itertools
import time

import torch

import fastar
from fastar.engine.sampling import SamplingParams


def trial(engine, share: float, reader: list[int], long_prompt: list[int]) -> str:
    sched = engine.scheduler(prefill_share=share)
    times: list[float] = []
    first: list[float] = []
    endless = SamplingParams(max_tokens=1 << 20, ignore_eos=True)
    a = sched.submit(reader, endless, on_chunk=lambda c: times.append(time.perf_counter()))
    while len(times) < 5:
        sched.step()
    t0 = time.perf_counter()
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    sched.submit(long_prompt, one, on_chunk=lambda c: first.append(time.perf_counter()))
    while not first:
        sched.step()
    a.cancel()
    sched.run_until_idle()
    t1 = first[0]
    got = [t for t in times if t0 <= t <= t1]
    gaps = [y - x for x, y in itertools.pairwise(got)]
    return (
        f"share {share:g}: the {len(long_prompt)}-token prompt's first token after {t1 - t0:.2f} s; "
        f"the reader meanwhile {len(got)} tokens ({len(got) / (t1 - t0):.2f} tok/s), "
        f"longest gap {max(gaps, default=t1 - t0):.2f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--long", type=int, default=3800, help="the long prompt's tokens")
    ap.add_argument("--shares", default="1,0.5", help="comma-separated --prefill-share values")
    ap.add_argument("--trials", type=int, default=2)
    a = ap.parse_args()
    shares = [float(s) for s in a.shares.split(",")]
    engine = fastar.load(a.model)
    g = torch.Generator().manual_seed(0)
    reader = torch.randint(2, 50000, (16,), generator=g).tolist()
    long_prompt = torch.randint(2, 50000, (a.long,), generator=g).tolist()
    for _ in range(a.trials):
        for share in shares:
            print(trial(engine, share, reader, long_prompt), flush=True)


if __name__ == "__main__":
    main()
