"""The engine's start-up timed: `load(MODEL)` in this process, from a cold page cache (the model file's pages dropped
first, `posix_fadvise(DONTNEED)`) or a warm one (`--warm`: the file read once first).

    python scripts/start_time.py MODEL.fst [--warm] [--no-verify] [--ram-budget auto] [--warm-experts]

Prints one line: cold or warm, the load's seconds (and CPU seconds, all threads), the process's peak RSS, the bytes
the load read through `read` calls (`rchar`, page cache hits included) and from the disk (`read_bytes`; pages a
mapping faults in are not counted by either), and the memory bandwidth measured after the load (the machine is
shared: `fastar.bench.model`'s probe). Alternate it between builds in fresh processes (each run is one start).
"""

from __future__ import annotations

import argparse
import resource
import time

from fastar.bench.cache import drop_page_cache
from fastar.bench.model import _stream_gbps
from fastar.engine.engine import load


def _io() -> dict[str, int]:
    """This process's I/O counters (Linux: /proc/self/io)."""
    with open("/proc/self/io") as f:
        return {k: int(v) for k, v in (line.split(": ") for line in f)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--warm", action="store_true", help="read the file into the page cache first")
    ap.add_argument("--no-verify", action="store_true", help="load(verify=False)")
    ap.add_argument("--ram-budget", default="auto")
    ap.add_argument("--warm-experts", action="store_true", help="load(warm_experts=True), as `serve` loads")
    a = ap.parse_args()
    if a.warm:
        with open(a.model, "rb") as f:
            while f.read(64 << 20):
                pass
    else:
        drop_page_cache(a.model)
    io0, cpu0 = _io(), time.process_time()
    t0 = time.perf_counter()
    engine = load(a.model, ram_budget=a.ram_budget, verify=not a.no_verify, warm_experts=a.warm_experts)
    seconds = time.perf_counter() - t0
    io1, cpu = _io(), time.process_time() - cpu0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # kB -> GB
    gbps = _stream_gbps(engine)
    engine.close()
    bw = f"{gbps:.0f} GB/s" if gbps else "n/a"
    print(
        f"{'warm' if a.warm else 'cold'} {'no-verify' if a.no_verify else 'verify'}: "
        f"load {seconds:.2f} s (CPU {cpu:.2f} s), "
        f"peak RSS {rss:.2f} GB, read {(io1['rchar'] - io0['rchar']) / 1e9:.2f} GB "
        f"(from disk {(io1['read_bytes'] - io0['read_bytes']) / 1e9:.2f} GB), memory {bw}",
        flush=True,
    )


if __name__ == "__main__":
    main()
