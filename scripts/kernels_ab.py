"""A/B of two builds of the C kernels on the T=1 products, in one process and alternating, so both see the same
machine load (on a shared machine a before/after pair of `fastar bench kernels` runs minutes apart can differ 10x).

    python scripts/kernels_ab.py BEFORE.so AFTER.so [--isa scalar] [--rounds 5]

Each .so is a build of fastar.quant._kernels (e.g. `git stash; pip install -e . --no-deps; cp
fastar/quant/_kernels*.so /tmp/before.so; git stash pop; pip install -e . --no-deps`). Flash-sized matrices, the
weights cycling through 256 MB of copies (from DRAM, as in decode). Prints, per product, the median over rounds of
weight GB/s on 2 threads (wall clock) and per CPU-second on 1 thread (time.process_time: less sensitive to other
processes on the cores), before and after.
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import sys
import time

import numpy as np

D, I = 4096, 2048  # DeepSeek-V4-Flash hidden size and expert intermediate size


def load(path: str):
    """The extension at path as a module of its own (two builds side by side)."""
    loader = importlib.machinery.ExtensionFileLoader("_kernels", path)
    spec = importlib.util.spec_from_file_location("_kernels", path, loader=loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    sys.modules.pop("_kernels", None)
    return module


def copies(arrays: tuple[np.ndarray, ...], total: int = 256 << 20) -> list[tuple[np.ndarray, ...]]:
    n = max(2, total // sum(a.nbytes for a in arrays))
    return [tuple(a.copy() for a in arrays) for _ in range(n)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("before")
    p.add_argument("after")
    p.add_argument("--isa", default="scalar")
    p.add_argument("--rounds", type=int, default=5)
    a = p.parse_args()
    mods = {"before": load(a.before), "after": load(a.after)}
    for m in mods.values():
        m.set_isa(a.isa)
    rng = np.random.default_rng(0)
    fp4 = copies((rng.integers(0, 256, (I, D // 2), dtype=np.uint8), rng.integers(116, 124, (I, D // 32), np.uint8)))
    w8 = rng.integers(0, 256, (D, D), dtype=np.uint8)
    w8[(w8 & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    fp8 = copies((w8, rng.integers(118, 131, (D // 128, D // 128), dtype=np.uint8)))
    bf16 = copies(((rng.standard_normal((D, D)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16),))
    x = (rng.standard_normal((1, D)) * 0.5).astype(np.float32)
    o1, o2 = np.empty((1, I), np.float32), np.empty((1, D), np.float32)
    cases = [
        ("fp4 2048x4096", lambda m, c: m.fp4_matmul(x, c[0], c[1], o1, accumulate=False, groups=1), fp4),
        ("fp8 4096x4096", lambda m, c: m.fp8_matmul(x, c[0], c[1], o2, accumulate=False, groups=1), fp8),
        ("bf16 4096x4096", lambda m, c: m.bf16_matmul(x, c[0], o2, accumulate=False, groups=1), bf16),
    ]
    res: dict[tuple[str, str, int], list[float]] = {}
    for _ in range(a.rounds):
        for name, call, cs in cases:
            nbytes = sum(arr.nbytes for arr in cs[0])
            for v, m in mods.items():
                for threads, clock in ((2, time.perf_counter), (1, time.process_time)):
                    m.set_num_threads(threads)
                    call(m, cs[0])
                    t0, k = clock(), 0
                    while clock() - t0 < 0.25 or k < 3:
                        call(m, cs[k % len(cs)])
                        k += 1
                    res.setdefault((name, v, threads), []).append(nbytes * k / (clock() - t0) / 1e9)
    for name, _, _ in cases:
        for threads, what in ((2, "GB/s, 2 threads, wall"), (1, "GB/s per CPU-second, 1 thread")):
            b, f = np.median(res[(name, "before", threads)]), np.median(res[(name, "after", threads)])
            print(f"{name:16s} {what:32s} before {b:6.2f}  after {f:6.2f}  x{f / b:4.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
