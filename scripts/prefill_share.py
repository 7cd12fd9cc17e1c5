"""A reply streaming while another request's long prompt prefills, at each `--prefill-share` given.

On one engine's scheduler (no HTTP): a reader request decodes (greedy, 16 random prompt tokens); after its fifth
token a prompt of `--long` random tokens is submitted. Prints, per share and trial, when the long prompt's first
token came (seconds after it was submitted), how many tokens the reader got meanwhile (and their rate), and the
reader's longest gap between two tokens in that time. Shares alternate within each trial.

With `--late S`, each trial then also submits the long prompt with nothing else running and, S seconds later (on
another thread, the scheduler running on its own), a 16-token request: it prints when that one's first token came
(seconds after it was submitted) and the long prompt's.

    python scripts/prefill_share.py MODEL [--long 3800] [--shares 1,0.5] [--trials 2] [--late S]
"""

from __future__ import annotations

import argparse
import itertools
import threading
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


def late_trial(engine, share: float, short: list[int], long_prompt: list[int], late: float) -> str:
    sched = engine.scheduler(prefill_share=share)
    stop = threading.Event()
    worker = threading.Thread(target=sched.run, args=(stop,), kwargs={"idle_wait": 0.05})
    worker.start()
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    t0 = time.perf_counter()
    a = sched.submit(long_prompt, one)
    time.sleep(late)
    t1 = time.perf_counter()
    b = sched.submit(short, SamplingParams(max_tokens=2, ignore_eos=True))
    firsts = {}
    for name, h, t in (("short", b, t1), ("long", a, t0)):
        next(iter(h))
        firsts[name] = time.perf_counter() - t
    stop.set()
    worker.join()
    return (
        f"share {share:g}: a 16-token request {late:g} s into the {len(long_prompt)}-token prompt: its first token "
        f"after {firsts['short']:.2f} s, the long prompt's after {firsts['long']:.2f} s"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--long", type=int, default=3800, help="the long prompt's tokens")
    ap.add_argument("--shares", default="1,0.5", help="comma-separated --prefill-share values")
    ap.add_argument("--trials", type=int, default=2)
    ap.add_argument("--late", type=float, default=None, help="also time a short request this many seconds in")
    a = ap.parse_args()
    shares = [float(s) for s in a.shares.split(",")]
    engine = fastar.load(a.model)
    g = torch.Generator().manual_seed(0)
    reader = torch.randint(2, 50000, (16,), generator=g).tolist()
    long_prompt = torch.randint(2, 50000, (a.long,), generator=g).tolist()
    for _ in range(a.trials):
        for share in shares:
            print(trial(engine, share, reader, long_prompt), flush=True)
            if a.late is not None:
                print(late_trial(engine, share, reader, long_prompt, a.late), flush=True)


if __name__ == "__main__":
    main()
