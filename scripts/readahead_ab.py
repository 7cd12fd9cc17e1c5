"""A/B of the weight readahead (fastar/quant/csrc/readahead.c) on one-row greedy decode steps, in one process: the
cap switched between off and on every few steps, in alternating order, the memory bandwidth probed around each pair
(the machine's memory speed moves by itself, and the readahead can only help where the memory binds).

    python scripts/readahead_ab.py MODEL.fst [--steps 16] [--pairs 30] [--mb 8] [--ram-budget auto]

Prints each pair (bandwidth before / after, tok/s off and on, their ratio, MB prefetched a token) and the median ratio
of the pairs below and above 45 GB/s.
"""

from __future__ import annotations

import argparse
import statistics
import time

from fastar.bench.model import _stream_gbps
from fastar.engine.engine import load
from fastar.engine.sampling import argmax
from fastar.quant import kernels as K


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--steps", type=int, default=16, help="decode steps a run")
    ap.add_argument("--pairs", type=int, default=30, help="off/on pairs")
    ap.add_argument("--mb", type=int, default=8, help="the cap when on")
    ap.add_argument("--ram-budget", default="auto")
    a = ap.parse_args()
    engine = load(a.model, ram_budget=a.ram_budget)
    screen = engine.model.screen is not None
    state = engine.new_state()
    seq = list(range(100, 164))
    seq.append(argmax(engine.prefill(seq, state)[-1]))

    def run(mb: int) -> float:
        K.readahead(mb)
        t0 = time.perf_counter()
        for _ in range(a.steps):
            seq.append(argmax(engine.prefill(seq[-1:], state, argmax_only=screen)[-1]))
        return a.steps / (time.perf_counter() - t0)

    run(0)  # warm
    pairs = []
    for i in range(a.pairs):
        bw0, bytes0 = _stream_gbps(engine), K.readahead_stats()[1]
        got = {mb: run(mb) for mb in ((0, a.mb) if i % 2 == 0 else (a.mb, 0))}
        bw1, mb_token = _stream_gbps(engine), (K.readahead_stats()[1] - bytes0) / a.steps / 1e6
        pairs.append(((bw0 + bw1) / 2, got[a.mb] / got[0]))
        print(
            f"pair {i}: {bw0:.0f} / {bw1:.0f} GB/s  off {got[0]:.2f}  on {got[a.mb]:.2f} tok/s  "
            f"ratio {got[a.mb] / got[0]:.3f}  {mb_token:.0f} MB prefetched a token",
            flush=True,
        )
    for name, keep in (("below 45 GB/s", lambda bw: bw < 45), ("at 45 GB/s or more", lambda bw: bw >= 45)):
        ratios = [q for bw, q in pairs if keep(bw)]
        median = f"{len(ratios)} pairs, median on/off {statistics.median(ratios):.3f}" if ratios else "none"
        print(f"{name}: {median}")
    engine.close()


if __name__ == "__main__":
    main()
