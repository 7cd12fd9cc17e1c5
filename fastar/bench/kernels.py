"""`fastar bench kernels`: what the CPU kernels achieve on this machine, as fractions of what it can do.

Owns: measuring this machine's limits (streaming read bandwidth over a 1 GiB buffer, FP32 FMA peak, each for
1 and N threads, with the kernels' own instruction set and thread pool), then every kernel's weight GB/s and
GFLOP/s at T=1 (decode: bandwidth-bound) and T=16 (prefill/speculation: compute-bound) on Flash-sized
matrices, plus numpy and torch dequantize-then-matmul on the same matrices for comparison.
Honesty rules (docs/PERFORMANCE.md): random weights with realistic scales, never zeros; each timed
call reads a different copy of the weights, cycling through more than the last-level cache, so weights
come from DRAM as in real decoding; warm-up, then the median of the repeats (spread reported).
The limits are measured with the running ISA's own loops (isa_ops.read_sum / fma_loop: AVX2 / AVX-512 on x86-64,
NEON on AArch64, the portable vectors for FASTAR_ISA=scalar), so on an ARM machine the same command reports the
NEON / NEON-BF16 kernels' fraction of its bandwidth and peak (`--prefill`, the bf16 tile path, is AVX512_BF16 only).
Does not own: end-to-end tokens/s (`fastar.bench.model`) or the kernels themselves (fastar.quant.kernels).

Usage: python -m fastar.bench.kernels [--json] [--threads 1,2] (or `fastar bench kernels`)
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time

import numpy as np

from ..quant import kernels as K
from ..quant import reference as R

GIB = 1 << 30
CYCLE_BYTES = 256 << 20  # weight copies per matrix: > 8x a 32 MB L3
D, I = 4096, 2048  # DeepSeek-V4-Flash hidden size and expert intermediate size


def _timeit(fn, n_inputs: int, min_reps: int = 10, budget_s: float = 0.6) -> tuple[float, float, float]:
    """Median, min and max seconds of fn(i) over rotating inputs i, after a warm-up."""
    for i in range(2):
        fn(i % n_inputs)
    times: list[float] = []
    t_end = time.perf_counter() + budget_s
    i = 0
    while len(times) < min_reps or (time.perf_counter() < t_end and len(times) < 200):
        t0 = time.perf_counter()
        fn(i % n_inputs)
        times.append(time.perf_counter() - t0)
        i += 1
    return float(np.median(times)), float(np.min(times)), float(np.max(times))


def _copies(arrays: tuple[np.ndarray, ...]) -> list[tuple[np.ndarray, ...]]:
    """Distinct copies of one set of weight arrays, enough to exceed CYCLE_BYTES."""
    nbytes = sum(a.nbytes for a in arrays)
    n = max(2, -(-CYCLE_BYTES // nbytes))
    return [tuple(a.copy() for a in arrays) for _ in range(n)]


def _fp4(rng, n: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    w = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    s = rng.integers(116, 124, (n, k // 32), dtype=np.uint8)  # 2^-11..2^-4: weights ~0.01-0.4 as in the checkpoint
    return w, s


def _probe_buffer() -> np.ndarray:
    buf = np.empty(GIB, np.uint8)
    buf.view(np.uint64)[:] = np.arange(GIB // 8, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)  # not zeros
    return buf


def _read_gbps(buf: np.ndarray) -> float:
    """Streaming read GB/s over `buf` with the kernels' threads now, best of 5 (after one read that faults it in)."""
    K._C.read_bandwidth(buf)  # fault in, warm the pool
    return max(buf.nbytes / K._C.read_bandwidth(buf) for _ in range(5)) / 1e9


def read_gbps() -> float:
    """This machine's streaming read GB/s over 1 GiB at the kernels' thread count (`machine_limits`' bandwidth
    alone): the probe the benches fall back on where the model's LM head is too small to measure it
    (`model.MemoryBandwidth`)."""
    return _read_gbps(_probe_buffer())


def machine_limits(threads: list[int]) -> dict:
    """Streaming read GB/s over 1 GiB and FP32 FMA GFLOP/s, per thread count (best of 5 / of 3)."""
    buf = _probe_buffer()
    bw, peak = {}, {}
    for n in threads:
        K.set_num_threads(n)
        bw[n] = _read_gbps(buf)
        s, _ = K._C.fma_peak(100_000)
        iters = max(100_000, int(100_000 * 0.15 / max(s, 1e-6)))  # ~0.15 s per measurement
        peak[n] = max(f / s for s, f in (K._C.fma_peak(iters) for _ in range(3))) / 1e9
    del buf
    return {"membw": bw, "peak": peak}


def _kernel_cases(rng) -> list[tuple[str, int, int, int, object, list]]:
    """(name, N, K, weight bytes, call(x, weights, out), weight copies) for every benchmarked product."""
    gate = _copies(_fp4(rng, I, D))
    down = _copies(_fp4(rng, D, I))
    w8 = rng.integers(0, 256, (D, D), dtype=np.uint8)
    w8[(w8 & 0x7F) == 0x7F] = 0x7E  # no NaN codes
    fp8 = _copies((w8, rng.integers(118, 131, (D // 128, D // 128), dtype=np.uint8)))
    bf16 = _copies((R.bf16_encode((rng.standard_normal((D, D)) * 0.02).astype(np.float32)),))
    expert = _copies(_fp4(rng, I, D) + _fp4(rng, I, D) + _fp4(rng, D, I))
    nb = lambda c: sum(a.nbytes for a in c[0])  # noqa: E731
    return [
        ("fp4 gate/up 2048x4096", I, D, nb(gate), lambda x, c, o: K.fp4_matmul(x, c[0], c[1], out=o), gate),
        ("fp4 down 4096x2048", D, I, nb(down), lambda x, c, o: K.fp4_matmul(x, c[0], c[1], out=o), down),
        (
            "expert_ffn (gate+up+down)",
            D,
            D,
            nb(expert),
            lambda x, c, o, q=False: K.expert_ffn(
                x, *c, np.ones(x.shape[0], np.float32), 10.0, o, act_block=128 if q else 0
            ),
            expert,
        ),
        ("fp8 4096x4096", D, D, nb(fp8), lambda x, c, o: K.fp8_matmul(x, c[0], c[1], out=o), fp8),
        ("bf16 4096x4096", D, D, nb(bf16), lambda x, c, o: K.bf16_matmul(x, c[0], out=o), bf16),
    ]


def _baselines(rng, T: int) -> list[tuple[str, float, int, int]]:
    """numpy and torch dequantize-then-matmul on the gate matrix and the 8-bit matrix: (name, s, bytes, flops)."""
    out = []
    w, s = _fp4(rng, I, D)
    w8 = rng.integers(0, 256, (D, D), dtype=np.uint8) & 0x7E
    s8 = rng.integers(118, 131, (D // 128, D // 128), dtype=np.uint8)
    x = rng.standard_normal((T, D)).astype(np.float32)
    f4, f8 = 2 * T * I * D, 2 * T * D * D
    med = lambda fn: _timeit(lambda i: fn(), 1, min_reps=3, budget_s=0.5)[0]  # noqa: E731
    out.append(("numpy fp4 dequant+matmul", med(lambda: x @ R.fp4_decode(w, s).T), w.nbytes + s.nbytes, f4))
    out.append(("numpy fp8 dequant+matmul", med(lambda: x @ R.fp8_block_dequant(w8, s8).T), w8.nbytes + s8.nbytes, f8))
    try:
        import torch  # noqa: PLC0415 (optional comparison)
    except ImportError:
        return out
    lut = torch.tensor(R.FP4_VALUES)
    tw, ts, tx = torch.from_numpy(w), torch.from_numpy(s), torch.from_numpy(x)

    def torch_fp4():
        codes = torch.stack([tw & 15, tw >> 4], -1).reshape(I, D).long()
        scale = torch.exp2(ts.float() - 127).repeat_interleave(32, 1)
        return torch.nn.functional.linear(tx, lut[codes] * scale)

    t8, ts8 = torch.from_numpy(w8).view(torch.float8_e4m3fn), torch.from_numpy(s8)

    def torch_fp8():
        scale = torch.exp2(ts8.float() - 127).repeat_interleave(128, 0).repeat_interleave(128, 1)
        return torch.nn.functional.linear(tx, t8.float() * scale)

    out.append(("torch fp4 dequant+matmul", med(torch_fp4), w.nbytes + s.nbytes, f4))
    out.append(("torch fp8 dequant+matmul", med(torch_fp8), w8.nbytes + s8.nbytes, f8))
    return out


def run(json_out: bool = False, threads: list[int] | None = None) -> dict:
    """Measure and print (a table, or one JSON object with --json). Returns the same dict.

    Keys: membw_gbps and fp32_gflops (at the largest thread count), their per-thread-count maps, isa, and
    kernels: [{name, T, threads, gbps, gflops, ms, spread_ms, bw_frac, peak_frac}], baselines included.
    """
    if not K.available():
        raise RuntimeError("the C kernels are not built (pip install -e . or python setup.py build_ext --inplace)")
    default = K._C.default_num_threads()
    threads = sorted(set(threads or [1, default]))
    before = K.get_num_threads()
    rng = np.random.default_rng(0)
    try:
        lim = machine_limits(threads)  # measured again at the end: the machine is shared, keep the best seen
        rows = []
        cases = _kernel_cases(rng)
        for T in (1, 16):
            x = rng.standard_normal((T, D)).astype(np.float32) * 0.5
            # decode also with the official numerics' inputs: FP8-quantized x (exact bfloat16s: the bf16 dot path)
            variants = [("", x, False)] + ([(" [x FP8-quantized]", K.fp8_act_quant(x, 128), True)] if T == 1 else [])
            for n in threads:
                K.set_num_threads(n)
                for (name, N, Kd, nbytes, call, copies), (tag, xv, q) in itertools.product(cases, variants):
                    if q and "bf16" in name:
                        continue  # BF16 weights take unquantized inputs (the LM head, the routers)
                    xs = xv if Kd == D else np.ascontiguousarray(xv[:, :Kd])
                    o = np.zeros((T, N), np.float32)
                    run_one = (
                        (lambda i: call(xs, copies[i], o, True))
                        if "expert" in name and q
                        else (lambda i: call(xs, copies[i], o))
                    )
                    med, lo, hi = _timeit(run_one, len(copies))
                    flops = 2 * T * (3 * I * D if "expert" in name else N * Kd)
                    rows.append(
                        {
                            "name": name + tag,
                            "T": T,
                            "threads": n,
                            "gbps": nbytes / med / 1e9,
                            "gflops": flops / med / 1e9,
                            "ms": med * 1e3,
                            "spread_ms": [lo * 1e3, hi * 1e3],
                        }
                    )
            try:  # the comparison libraries, with their own default threading
                for name, sec, nbytes, flops in _baselines(rng, T):
                    n = default
                    rows.append(
                        {
                            "name": name,
                            "T": T,
                            "threads": n,
                            "gbps": nbytes / sec / 1e9,
                            "gflops": flops / sec / 1e9,
                            "ms": sec * 1e3,
                            "spread_ms": None,
                        }
                    )
            except Exception as e:  # pragma: no cover - a broken optional library must not sink the bench
                print(f"(baselines skipped: {e})", file=sys.stderr)
        again = machine_limits(threads)
        for key in lim:
            for n in threads:
                lim[key][n] = max(lim[key][n], again[key][n])
        for r in rows:
            n = r["threads"] if r["threads"] in lim["membw"] else max(threads)
            r["bw_frac"] = r["gbps"] / lim["membw"][n]
            r["peak_frac"] = r["gflops"] / lim["peak"][n]
    finally:
        K.set_num_threads(before)
    top = max(threads)
    result = {
        "membw_gbps": lim["membw"][top],
        "fp32_gflops": lim["peak"][top],
        "membw_by_threads": {str(k): v for k, v in lim["membw"].items()},
        "fp32_gflops_by_threads": {str(k): v for k, v in lim["peak"].items()},
        "isa": K.get_isa(),
        "cpu": K.cpu_features(),
        "kernels": rows,
    }
    if json_out:
        print(json.dumps(result))
    else:
        _print_table(result, lim)
    return result


def _print_table(result: dict, lim: dict) -> None:
    print(
        f"isa {result['isa']}; weights cycle through >= {CYCLE_BYTES >> 20} MB of copies (DRAM, not cache); "
        "limits = best of start and end of the run"
    )
    for n in lim["membw"]:
        print(f"threads {n}: memory read {lim['membw'][n]:6.1f} GB/s   FP32 FMA peak {lim['peak'][n]:7.1f} GFLOP/s")
    print(f"{'kernel':48s} {'T':>3s} {'thr':>3s} {'ms':>8s} {'GB/s':>7s} {'GFLOP/s':>8s} {'%bw':>5s} {'%peak':>6s}")
    for r in result["kernels"]:
        print(
            f"{r['name']:48s} {r['T']:3d} {r['threads']:3d} {r['ms']:8.3f} {r['gbps']:7.2f} {r['gflops']:8.1f} "
            f"{100 * r['bw_frac']:5.0f} {100 * r['peak_frac']:6.0f}"
        )


def prefill_products(tokens: int = 512, rounds: int = 3, threads: int = 1) -> list[dict]:
    """The prefill's products on the bf16 tile path and the FP32 tile path, alternating in one process: per round
    and path, GFLOP per CPU-second (time.process_time, so other processes on the cores matter less) against the
    path's own instruction peak measured the same way just before (bf16_dot_peak / fma_peak). x is FP8-quantized
    (bf16-exact), as the official numerics hand it over. Needs the avx512bf16 ISA."""
    if "avx512bf16" not in K.cpu_features()["usable_isas"]:
        raise RuntimeError("the bf16 tile path needs AVX512_BF16 + AVX512_VBMI (this CPU or build lacks them)")
    rng = np.random.default_rng(0)
    K.set_num_threads(threads)
    cases = []
    for fmt, n, k in (("fp8", D, D), ("fp8", D, 2 * D), ("fp4", I, D), ("fp4", D, I)):
        x = R.fp8_act_quant(rng.standard_normal((tokens, k)).astype(np.float32), 128)
        if fmt == "fp8":
            w = rng.integers(0, 256, (n, k), dtype=np.uint8)
            w[(w & 0x7F) == 0x7F] = 0x7E  # no NaN codes
            s = rng.integers(118, 124, (n // 128, k // 128), dtype=np.uint8)
        else:
            w, s = _fp4(rng, n, k)
        cases.append((f"{fmt} {n}x{k}", x, w, s, K.fp8_matmul if fmt == "fp8" else K.fp4_matmul))

    def cpu_rate(fn) -> float:
        t = time.process_time()
        flops = fn()
        return flops / max(time.process_time() - t, 1e-9) / 1e9

    rows = []
    try:
        for rnd in range(rounds):
            for name, x, w, s, f in cases:
                for isa, probe in (("avx512bf16", K._C.bf16_dot_peak), ("avx512", K._C.fma_peak)):
                    K.set_isa(isa)
                    peak = cpu_rate(lambda: probe(1_000_000)[1])  # noqa: B023 (called at once)
                    f(x, w, s)  # warm
                    got = cpu_rate(lambda: (f(x, w, s), 2.0 * x.shape[0] * w.shape[0] * x.shape[1])[1])  # noqa: B023
                    rows.append(
                        {
                            "round": rnd,
                            "product": name,
                            "path": isa,
                            "tokens": tokens,
                            "threads": threads,
                            "gflops_per_cpu_s": got,
                            "peak_gflops_per_cpu_s": peak,
                            "fraction": got / peak,
                        }
                    )
    finally:
        K.set_isa("auto")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fastar bench kernels", description=__doc__.split("\n")[0])
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.add_argument("--threads", default=None, help="comma-separated thread counts (default: 1 and all CPUs)")
    p.add_argument(
        "--prefill",
        type=int,
        default=None,
        metavar="T",
        help="instead: the prefill products at T tokens, bf16 vs FP32 tile path, against each peak",
    )
    a = p.parse_args(argv)
    if a.prefill:
        rows = prefill_products(a.prefill, threads=int(a.threads or 1))
        if a.json:
            print(json.dumps(rows))
        for r in rows if not a.json else []:
            print(
                f"{r['product']:16s} {r['path']:10s} {r['gflops_per_cpu_s']:6.0f} GFLOP per CPU-s = "
                f"{100 * r['fraction']:3.0f} % of {r['peak_gflops_per_cpu_s']:.0f}"
            )
        return 0
    run(json_out=a.json, threads=[int(t) for t in a.threads.split(",")] if a.threads else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
