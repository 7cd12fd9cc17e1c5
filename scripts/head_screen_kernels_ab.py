"""A/B of two builds of the C kernels on the LM head screen's one pass (`head_i8_screen`), on a model's own int8 head
and its own decode rows, in one process and alternating call by call, so both builds see the same memory speed.

    flock /tmp/bench.lock python scripts/head_screen_kernels_ab.py BEFORE.so AFTER.so -m flash4.fst
        [--rows 2,4,6,8] [--threads 2] [--rounds 5] [--reps 6]

Each .so is a build of fastar.quant._kernels (e.g. `cp fastar/quant/_kernels*.so /tmp/before.so` before a change,
then `python setup.py build_ext --inplace` and the new one). The script loads the model with the head screen, runs
a few greedy decode steps of max(--rows) sequences (`forward_rows`, as the scheduler steps them) to take the head's
input rows, then calls each build's `head_i8_screen` on the first n of those rows for each n in --rows, with the
terms and bounds `HeadScreen` gives them. It checks that both builds keep the same candidate rows in every case, and
prints per round the read-bandwidth probe, then per row count the median and best wall and CPU time per call
(time.process_time: every thread of the process, so less sensitive to other processes on the cores) of each build.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from kernels_ab import load  # (scripts/: two builds side by side)

import fastar
from fastar.engine.sampling import argmax
from fastar.model.head_screen import MARGIN


def decode_rows(engine, n: int, steps: int = 4, prompt: int = 64) -> list[np.ndarray]:
    """The LM head's input rows [n, K] of `steps` greedy decode steps of n sequences."""
    screen, rows = engine.model.screen, []
    logits = screen.logits

    def taking(y, races=None):
        rows.append(y.detach().float().numpy().copy())
        return logits(y, races)

    states = [engine.new_state() for _ in range(n)]
    last = [
        argmax(engine.prefill(list(range(1000 + 97 * i, 1000 + 97 * i + prompt)), s)[-1]) for i, s in enumerate(states)
    ]
    screen.logits = taking
    try:
        for _ in range(steps):
            last = [argmax(row) for row in engine.model.forward_rows(last, states, [True] * n)]
    finally:
        del screen.logits
    return [y for y in rows if y.shape[0] == n]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--rows", default="2,4,6,8", help="decode rows per call, 1 to 8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--reps", type=int, default=6, help="calls of each build per row count and round")
    a = p.parse_args()
    counts = [int(r) for r in a.rows.split(",")]
    mods = {"before": load(a.before), "after": load(a.after)}
    for m in mods.values():
        m.set_num_threads(a.threads)
    engine = fastar.load(a.model)
    screen = engine.model.screen
    if screen is None:
        raise SystemExit("this engine has no head screen (the C kernels are needed)")
    ys = decode_rows(engine, max(counts))
    V, K = screen.V, screen.K
    keep, rows, ub = np.empty(V, np.uint8), np.empty(V, np.int64), np.empty((max(counts), V), np.float32)

    def inputs(y: np.ndarray):
        """head_i8_screen's terms, scales and bound factors for the rows y, as `HeadScreen` computes them."""
        T = y.shape[0]
        x, sx, st = np.empty((2 * T, K), np.int8), np.empty(2 * T, np.float32), np.empty((T, 5))
        mods["before"].head_i8_quantize(np.ascontiguousarray(y), x, sx, st)
        g, m = screen.gamma, MARGIN
        c = [[(r[3] + g * r[2]) * (1 + m), r[4] * (1 + m), (r[0] + g * r[2]) * (1 + m), r[1] * (1 + m)] for r in st]
        return x, sx, np.array(c, np.float32)

    def call(m, case) -> np.ndarray:
        x, sx, c = case
        args = (screen.q, screen.rowsum, screen.scale, screen.wnorm32, screen.dnorm32, MARGIN)
        n = m.head_i8_screen(x, sx, c, *args, ub[: c.shape[0]], keep, rows)
        return rows[:n]

    cases = {n: [inputs(y[:n]) for y in ys] for n in counts}
    for n in counts:
        for case in cases[n]:
            if not np.array_equal(call(mods["before"], case), call(mods["after"], case)):
                raise SystemExit(f"{n} rows: the builds keep different candidate rows")
    print(f"{a.threads} threads, {len(ys)} steps' rows of {a.model}: both builds keep the same candidates")
    probe = screen.q.reshape(-1).view(np.uint8)
    res: dict[tuple[int, str], list[tuple[float, float]]] = {}
    for r in range(a.rounds):
        bw = probe.nbytes / min(mods["before"].read_bandwidth(probe) for _ in range(2)) / 1e9
        for n in counts:
            for k in range(a.reps):
                order = list(mods) if k % 2 == 0 else list(mods)[::-1]
                for v in order:
                    case = cases[n][k % len(cases[n])]
                    c0, w0 = time.process_time(), time.perf_counter()
                    call(mods[v], case)
                    res.setdefault((n, v), []).append((time.perf_counter() - w0, time.process_time() - c0))
        print(f"round {r}: read bandwidth probe {bw:.1f} GB/s", flush=True)
    for n in counts:
        line = f"{n} rows:"
        for v in mods:
            w, c = (np.array(t) * 1e3 for t in zip(*res[(n, v)]))
            line += f"  {v} wall {np.median(w):5.2f} (best {w.min():5.2f})"
            line += f" cpu {np.median(c):5.2f} (best {c.min():5.2f}) ms;"
        b, f = (np.median([t[1] for t in res[(n, v)]]) for v in mods)
        print(f"{line}  after/before cpu {f / b:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
