"""A/B of two builds of the C kernels on the small-batch (T = 1..8) bf16 dot path: FP8 products and FP4 routed
experts on DeepSeek-V4-Flash shapes, weights from DRAM, the builds alternated in one process.

    python scripts/dot_rows_ab.py BEFORE.so AFTER.so [MORE.so ...] [--tokens 1,2,3,4,6,8] [--rounds 3]

x is bfloat16-exact (FP8-quantized, as the official numerics hand the products), so the calls take the bf16 dot path
on an AVX512_BF16 CPU. Each product's weights cycle through --pool MB of copies, so they come from DRAM as in decode.
Prints per case and T the median weight GB/s and GFLOP/s on the pool's threads (wall clock), with the memory read
bandwidth and the vdpbf16ps peak measured in the same run (their medians over the rounds).
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from kernels_ab import load

D, I = 4096, 2048  # DeepSeek-V4-Flash hidden size and expert intermediate size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("builds", nargs="+", help="BEFORE.so AFTER.so [MORE.so ...]: each compared with the first")
    p.add_argument("--tokens", default="1,2,3,4,6,8")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pool", type=int, default=512, help="MB of weight copies per case")
    p.add_argument("--cases", default="fp8,fp8w,experts")
    p.add_argument("--seconds", type=float, default=0.25, help="per measurement")
    a = p.parse_args()
    names = ["before", "after"] if len(a.builds) == 2 else ["before"] + [f"#{i}" for i in range(1, len(a.builds))]
    mods = {v: load(b) for v, b in zip(names, a.builds, strict=True)}
    tokens = [int(t) for t in a.tokens.split(",")]
    rng = np.random.default_rng(0)
    m0 = list(mods.values())[-1]

    def fp8(n: int, k: int):
        w = rng.integers(0, 256, (n, k), dtype=np.uint8)
        w[(w & 0x7F) == 0x7F] = 0x7E  # no NaN codes
        return w, rng.integers(118, 131, (n // 128, k // 128), dtype=np.uint8)

    def fp4(n: int, k: int):
        return rng.integers(0, 256, (n, k // 2), dtype=np.uint8), rng.integers(116, 124, (n, k // 32), np.uint8)

    def copies(make, nbytes: int) -> list:
        return [make() for _ in range(max(2, (a.pool << 20) // nbytes))]

    def xq(t: int, k: int) -> np.ndarray:
        return m0_quant(rng.standard_normal((t, k)).astype(np.float32))

    def m0_quant(x: np.ndarray) -> np.ndarray:
        out = np.empty_like(x)
        m0.fp8_act_quant(x, 128, out)
        return out

    cases = []  # (name, weight bytes per call, flops per token, make call(m, T, i))
    want = a.cases.split(",")

    def fp8_case(name: str, n: int, k: int, pooled: bool) -> None:
        """An FP8 n x k product: weights cycled through the pool (from DRAM), or one copy (L3-resident)."""
        ws = copies(lambda: fp8(n, k), n * k) if pooled else [fp8(n, k)]
        xs = {t: xq(t, k) for t in tokens}
        outs = {t: np.empty((t, n), np.float32) for t in tokens}
        cases.append(
            (
                name,
                n * k,
                2 * n * k,
                lambda m, t, i: m.fp8_matmul(xs[t], *ws[i % len(ws)], outs[t], accumulate=False, groups=1),
            )
        )

    if "fp8" in want:
        fp8_case("fp8 4096x4096", D, D, pooled=True)
    if "fp8c" in want:  # L3-resident weights: the kernels' compute speed
        fp8_case("fp8 2048x4096 (L3)", 2048, D, pooled=False)
    if "fp8w" in want:  # wo_a-like: many rows, short K
        fp8_case("fp8 32768x1024", 8 * D, 1024, pooled=True)
    if "fp8n" in want:  # wkv-like: few rows, so each thread's chunk holds few rows of a 128-row scale block
        fp8_case("fp8 512x4096", 512, D, pooled=True)
    if "experts" in want:
        E = 4  # experts per call, every token in each
        one = 3 * (I * D // 2 + I * D // 32)
        ex = copies(lambda: (*fp4(I, D), *fp4(I, D), *fp4(D, I)), one)
        xe = {t: rng.standard_normal((t, D)).astype(np.float32) for t in tokens}
        rows = {t: np.tile(np.arange(t, dtype=np.int64), E) for t in tokens}
        offs = {t: np.arange(E + 1, dtype=np.int64) * t for t in tokens}
        rws = {t: np.full(E * t, 0.5, np.float32) for t in tokens}
        oute = {t: np.zeros((t, D), np.float32) for t in tokens}

        def experts(m, t, i):
            sel = [ex[(E * i + e) % len(ex)] for e in range(E)]
            m.experts_ffn(xe[t], sel, rows[t], offs[t], rws[t], 10.0, oute[t], 128)

        cases.append((f"experts {E}x(2x{I}x{D}+{D}x{I}) fp4", E * one, E * 3 * 2 * I * D, experts))

    buf = np.ones(512 << 20, np.uint8)
    res: dict[tuple, list[float]] = {}
    bw, peak = [], []
    for _ in range(a.rounds):
        bw.append(buf.nbytes / m0.read_bandwidth(buf) / 1e9)
        s, f = m0.bf16_dot_peak(20_000_000)
        peak.append(f / s / 1e9)
        for name, _, _, call in cases:
            for t in tokens:
                for v, m in mods.items():
                    call(m, t, 0)
                    t0, k = time.perf_counter(), 0
                    while time.perf_counter() - t0 < a.seconds or k < 3:
                        call(m, t, k)
                        k += 1
                    res.setdefault((name, t, v), []).append(k / (time.perf_counter() - t0))
    pk = float(np.median(peak))
    runs = ", ".join(f"{b:.1f}" for b in bw)
    print(
        f"threads {m0.get_num_threads()}  memory read {np.median(bw):.1f} GB/s (runs {runs})"
        f"  vdpbf16ps peak {pk:.0f} GFLOP/s"
    )
    for name, nbytes, flops, _ in cases:
        print(name)
        for t in tokens:
            line = f"  T={t}"
            rate = {}
            for v in mods:
                r = float(np.median(res[(name, t, v)]))
                rate[v] = r
                gf = flops * t * r / 1e9
                line += f"  {v} {nbytes * r / 1e9:5.1f} GB/s {gf:5.0f} GFLOP/s ({100 * gf / pk:3.0f} %)"
            print(line + "".join(f"  x{rate[v] / rate['before']:.2f}" for v in list(mods)[1:]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
