"""The int8 screened LM head's kernels on DeepSeek-V4's head shape (V = 129280, K = 4096), weights from DRAM: the time
of head_i8_build, and head_i8_dot's GB/s of int8 weights next to bf16_matmul's GB/s of the BF16 head (twice the
bytes) for each T, the two alternated in one process, with the memory read bandwidth measured in the same run.

    flock /tmp/bench.lock python scripts/head_i8_bench.py [--tokens 1,2,4,8] [--threads 2] [--rounds 3]

Prints per round the read-bandwidth probe, then per T the best time of each kernel over --reps calls and the speedup
of the int8 products over the BF16 product (what a step saves before its exact candidates are added back).
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fastar.quant import kernels as K

V, D = 129280, 4096  # DeepSeek-V4's vocabulary and hidden size


def best(fn, reps: int) -> float:
    b = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        b = min(b, time.perf_counter() - t)
    return b


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", default="1,2,4,8")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args()
    K.set_num_threads(a.threads)
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((V, D), dtype=np.float32) * 0.02).view(np.uint32)
    w = (w >> 16).astype(np.uint16)  # bfloat16 bits
    outs = K.head_i8_build(w)  # faults the outputs in
    t_build = best(lambda: K.head_i8_build(w, *outs), 2)
    q, _, _, _, rowsum = outs
    buf = np.ones(1 << 30, np.uint8)
    K._C.read_bandwidth(buf)
    print(f"isa {K.get_isa()}, head_i8_dot path {K.head_i8_path()}, {a.threads} threads")
    print(f"head_i8_build [{V}, {D}]: {t_build:.3f} s ({V * D / t_build / 1e9:.2f} G values/s)")
    for r in range(a.rounds):
        bw = buf.nbytes / best(lambda: K._C.read_bandwidth(buf), 3) / 1e9
        print(f"round {r}: read bandwidth probe {bw:.1f} GB/s")
        for T in (int(t) for t in a.tokens.split(",")):
            xq = rng.integers(-127, 128, (T, D), dtype=np.int8)
            xf = rng.standard_normal((T, D), dtype=np.float32)
            oi, of = np.empty((T, V), np.int32), np.empty((T, V), np.float32)
            ti = best(lambda: K.head_i8_dot(xq, q, rowsum, oi), a.reps)
            tb = best(lambda: K.bf16_matmul(xf, w, of), a.reps)
            print(
                f"  T={T}: head_i8_dot {ti * 1e3:6.1f} ms {q.nbytes / ti / 1e9:5.1f} GB/s | "
                f"bf16_matmul {tb * 1e3:6.1f} ms {w.nbytes / tb / 1e9:5.1f} GB/s | {tb / ti:.2f}x"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
