"""Exactness under start-up races: many fresh processes each load a model and compare its logits with a reference.

Each child process runs `fastar.load(MODEL, numerics="reference").logits(ids)` once and compares every position
with reference logits computed once up front (transformers' `DeepseekV4ForCausalLM` on the checkpoint directory
`--hf`, float32), optionally while other processes load the cores (`--load`), and optionally with the kernel
pool's race-widening test hooks on (`--pool-delays W,C`: a worker sleeps W us after reading the claim counter, a
posting caller sleeps C us before publishing a job; see fastar/quant/csrc/pool.c). It prints one line per bad run
(positions that differ, the first one, the largest |difference|) and the fraction of bad runs.

    python scripts/exactness_stress.py --hf CKPT_DIR --model CKPT_DIR_OR_FST --runs 200 --threads 1,2 --load mixed

--load: none; cpu (two busy-loop processes); mixed (a busy loop, a process that keeps loading the same model and
running a short forward, and a process writing and deleting a large file), the kind of mixed work the bad runs
were first seen beside.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

CHILD = r"""
import json, sys, numpy as np, torch, fastar
from fastar.quant import kernels
args = json.loads(sys.argv[1])
ids = args["ids"]
eng = fastar.load(args["model"], numerics="reference", threads=args["threads"])
if args["pool_delays"]:
    kernels.pool_test_delays(*args["pool_delays"])
out = eng.logits(ids)
ref = np.load(args["ref"])
d = np.abs(out - ref).max(axis=-1)
bad = np.flatnonzero(d > args["tol"])
print(json.dumps({"max": float(d.max()), "bad": bad.tolist()}))
"""

BUSY = "while True: pass"
RELOAD = r"""
import sys, fastar
while True:
    fastar.load(sys.argv[1], numerics="reference").logits(list(range(48)))
"""
WRITER = r"""
import os, sys
p = sys.argv[1]
while True:
    with open(p, "wb") as f:
        for _ in range(256):
            f.write(os.urandom(1 << 20))
        f.flush(); os.fsync(f.fileno())
    os.unlink(p)
"""


def reference_logits(hf_dir: str, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import DeepseekV4ForCausalLM

    model = DeepseekV4ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def start_load(kind: str, model: str, tmp: Path) -> list[subprocess.Popen]:
    py = [sys.executable, "-c"]
    quiet = dict(stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if kind == "none":
        return []
    if kind == "cpu":
        return [subprocess.Popen(py + [BUSY], **quiet) for _ in range(2)]
    if kind == "mixed":
        return [
            subprocess.Popen(py + [BUSY], **quiet),
            subprocess.Popen(py + [RELOAD, model], **quiet),
            subprocess.Popen(py + [WRITER, str(tmp / "scratch.bin")], **quiet),
        ]
    raise SystemExit(f"--load must be none, cpu or mixed, got {kind!r}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hf", required=True, help="checkpoint directory (the reference runs transformers on it)")
    ap.add_argument("--model", required=True, help="what fastar loads: the same directory or its converted .fst")
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--tokens", type=int, default=400)
    ap.add_argument("--threads", default="2", help="kernel threads per run, cycled: e.g. 1,2")
    ap.add_argument("--load", default="none", help="none | cpu | mixed")
    ap.add_argument("--pool-delays", default="", help="W,C microseconds for the pool's test hooks")
    ap.add_argument("--tol", type=float, default=1e-4)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        vocab = json.loads((Path(a.hf) / "config.json").read_text())["vocab_size"]
        ids = np.random.default_rng(5).integers(0, min(vocab, 1024), a.tokens).tolist()
        np.save(tmp / "ref.npy", reference_logits(a.hf, ids))
        threads = [int(t) for t in a.threads.split(",")]
        delays = [int(v) for v in a.pool_delays.split(",")] if a.pool_delays else None
        load = start_load(a.load, a.model, tmp)
        bad, t0 = 0, time.time()
        try:
            for i in range(a.runs):
                arg = dict(
                    model=a.model,
                    ids=ids,
                    ref=str(tmp / "ref.npy"),
                    threads=threads[i % len(threads)],
                    pool_delays=delays,
                    tol=a.tol,
                )
                r = subprocess.run([sys.executable, "-c", CHILD, json.dumps(arg)], capture_output=True, text=True)
                if r.returncode:
                    print(f"run {i}: exit {r.returncode}: {r.stderr.strip().splitlines()[-1:]}", flush=True)
                    bad += 1
                    continue
                res = json.loads(r.stdout.strip().splitlines()[-1])
                print(f"run {i}: max |diff| {res['max']:.3g}", flush=True)
                if res["bad"]:
                    bad += 1
                    print(
                        f"run {i} (threads {arg['threads']}): {len(res['bad'])} positions differ, first "
                        f"{res['bad'][0]}, max |diff| {res['max']:.3g}",
                        flush=True,
                    )
        except KeyboardInterrupt:
            a.runs = i  # stopped early: report the runs that finished
        finally:
            for p in load:
                p.kill()
                p.wait()
    print(
        f"bad runs: {bad} of {a.runs} ({a.model}; threads {a.threads}; load {a.load}; "
        f"pool delays {a.pool_delays or 'off'}; {time.time() - t0:.0f} s)"
    )


if __name__ == "__main__":
    main()
