"""`fastar bench -m FILE`: end-to-end prefill and decode speed against the ceiling measured in the same run.

Owns: the model benchmark. For each RAM budget it loads the engine over the expert pager, prefills a random
prompt, decodes greedily, and reports tokens/s beside the ceiling that this machine's memory and disk bandwidth
(both measured in the same run) allow for the bytes a token touches at the measured hit rate:

    t_token >= resident_bytes_per_token / membw + hit * expert_bytes_per_token / membw
                                                + (1 - hit) * expert_bytes_per_token / disk_bw

Also: hit rate, bytes read per token, achieved GB/s, peak RSS (sampled), and with `--reference HF_DIR` the same
prompt through transformers on the same weights. Does not own: the kernels benchmark (`bench_kernels`) or
the cache's trace replay (`weights.expert_store.bench_cache`).
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from .config import parse_size
from .errors import FastarError


class _PeakRSS:
    """Samples this process's RSS every 20 ms (the kernel's own high-water mark never goes down between runs)."""

    def __init__(self) -> None:
        import psutil
        self._proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self._proc.memory_info().rss)
            self._stop.wait(0.02)

    def __enter__(self) -> "_PeakRSS":
        self.peak = self._proc.memory_info().rss
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()


def token_bytes(src) -> tuple[int, int, int]:
    """(resident bytes a decode token reads, routed-expert bytes it reads, resident bytes in all)."""
    cfg = src.config
    if hasattr(src, "header"):  # .fst
        sizes = {t["name"]: t["nbytes"] for t in src.header["tensors"]}
    else:  # checkpoint directory
        from .convert.names import is_routed_expert
        sizes = {n: src.tensor_info(n).nbytes for n in src.names() if not is_routed_expert(n)}
    touched = 0
    for name, n in sizes.items():
        if name.startswith("mtp.") or name.endswith("tid2eid"):
            continue  # the draft block and the hash tables are not read by a plain decode step (one row at most)
        touched += n // cfg.vocab_size if name == "embed.weight" else n
    experts = cfg.num_hidden_layers * cfg.num_experts_per_tok * src.expert_stride
    return touched, experts, sum(sizes.values())


def _disk_bw(path: str, nbytes: int = 256 << 20) -> float:
    """Sequential O_DIRECT read rate of one file (GB/s), page cache dropped first; a fallback probe for sources
    that are not one .fst (a checkpoint directory's largest shard)."""
    import mmap
    from .weights.expert_store import drop_page_cache
    drop_page_cache(path)
    flag = getattr(os, "O_DIRECT", 0)
    try:
        fd = os.open(path, os.O_RDONLY | flag)
    except OSError:
        fd = os.open(path, os.O_RDONLY)
    buf = mmap.mmap(-1, 8 << 20)
    done, t0 = 0, time.perf_counter()
    try:
        while done < nbytes:
            n = os.preadv(fd, [buf], done)
            if n <= 0:
                break
            done += n
    finally:
        os.close(fd)
    return done / max(time.perf_counter() - t0, 1e-9) / 1e9


def run_one(path: str, budget, prompt: list[int], decode: int, options: dict) -> dict:
    from .engine.engine import load

    with _PeakRSS() as rss:
        t0 = time.perf_counter()
        engine = load(path, ram_budget=budget, **options)
        load_s = time.perf_counter() - t0
        state = engine.new_state()
        t0 = time.perf_counter()
        logits = engine.prefill(prompt, state)
        prefill_s = time.perf_counter() - t0
        cache = engine.expert_cache
        before = cache.stats() if cache else {}
        tok = int(logits[-1].argmax())
        t0 = time.perf_counter()
        for _ in range(decode):  # plain greedy decode, one token per forward: what the ceiling describes
            logits = engine.prefill([tok], state)
            tok = int(logits[-1].argmax())
        decode_s = time.perf_counter() - t0
        after = cache.stats() if cache else {}
    hits = after.get("hits", 0) - before.get("hits", 0)
    misses = after.get("misses", 0) - before.get("misses", 0)
    read = after.get("bytes_read", 0) - before.get("bytes_read", 0)
    out = {
        "ram_budget_bytes": cache.budget_bytes if cache else 0,
        "load_s": load_s,
        "prefill_tokens": len(prompt), "prefill_tok_s": len(prompt) / prefill_s,
        "decode_tokens": decode, "decode_tok_s": decode / decode_s,
        "hit_rate": hits / max(hits + misses, 1) if cache else 1.0,
        "bytes_read_per_token": read / decode,
        "stall_s_per_token": (after.get("stall_s", 0) - before.get("stall_s", 0)) / decode,
        "peak_rss_bytes": rss.peak,
        "prefetch": {k: v for k, v in after.get("sources", {}).items()},
    }
    if cache:
        cache.close()
    return out


def run(path: str, budgets: list, prompt_tokens: int = 64, decode_tokens: int = 16, reference: str | None = None,
        options: dict | None = None, seed: int = 0) -> dict:
    from .bench_kernels import machine_limits
    from .format.reader import FstFile
    from .quant import kernels
    from .weights.expert_store import measure_disk

    from .engine.engine import open_source

    options = options or {}
    src = open_source(path)
    resident_tok, expert_tok, resident = token_bytes(src)
    vocab = src.config.vocab_size
    if isinstance(src, FstFile):
        disk = measure_disk(src, records=min(16, src.bank["slots"] * src.bank["experts"] // 4 or 1))
        disk_bw = (disk.get("direct_GBps") or disk["buffered_cold_GBps"]) * 1e9
    else:
        shard = max(Path(path).glob("*.safetensors"), key=lambda p: p.stat().st_size)
        disk = {"sequential_GBps": _disk_bw(str(shard))}
        disk_bw = disk["sequential_GBps"] * 1e9
    n = kernels.get_num_threads()
    membw = machine_limits([n])["membw"][n] * 1e9
    prompt = [int(t) for t in np.random.default_rng(seed).integers(3, min(vocab, 100_000), prompt_tokens)]
    runs = []
    for b in budgets:
        r = run_one(path, b, prompt, decode_tokens, options)
        h = r["hit_rate"]
        t_tok = resident_tok / membw + h * expert_tok / membw + (1 - h) * expert_tok / disk_bw
        r["ceiling_tok_s"] = 1 / t_tok
        r["fraction_of_ceiling"] = r["decode_tok_s"] / r["ceiling_tok_s"]
        r["achieved_gbps"] = (resident_tok + expert_tok) * r["decode_tok_s"] / 1e9
        runs.append(r)
    result = {**runs[0], "resident_bytes": resident, "resident_bytes_per_token": resident_tok,
              "expert_bytes_per_token": expert_tok, "membw_gbps": membw / 1e9, "disk_gbps": disk_bw / 1e9,
              "disk": disk, "threads": n, "runs": runs}
    if reference:
        result["transformers"] = _transformers(reference, prompt, decode_tokens)
        result["speedup_vs_transformers"] = result["decode_tok_s"] / result["transformers"]["decode_tok_s"]
    return result


def _transformers(hf_dir: str, prompt: list[int], decode: int) -> dict:
    import torch
    from transformers import DeepseekV4ForCausalLM

    m = DeepseekV4ForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        t0 = time.perf_counter()
        out = m(ids, use_cache=True)
        prefill_s = time.perf_counter() - t0
        past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(decode):
            out = m(tok, past_key_values=past, use_cache=True)
            past, tok = out.past_key_values, out.logits[:, -1:].argmax(-1)
        decode_s = time.perf_counter() - t0
    return {"prefill_tok_s": len(prompt) / prefill_s, "decode_tok_s": decode / decode_s}


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def print_table(r: dict, out=sys.stdout) -> None:
    print(f"machine: memory {r['membw_gbps']:.1f} GB/s, disk {r['disk_gbps']:.2f} GB/s (O_DIRECT), "
          f"{r['threads']} threads; per token: resident {_gb(r['resident_bytes_per_token'])}, experts "
          f"{_gb(r['expert_bytes_per_token'])}", file=out)
    print(f"{'budget':>10} {'prefill t/s':>11} {'decode t/s':>10} {'ceiling':>8} {'%ceil':>6} {'hit':>6} "
          f"{'read/tok':>10} {'GB/s':>6} {'peak RSS':>10}", file=out)
    for x in r["runs"]:
        print(f"{_gb(x['ram_budget_bytes']):>10} {x['prefill_tok_s']:11.1f} {x['decode_tok_s']:10.2f} "
              f"{x['ceiling_tok_s']:8.2f} {100 * x['fraction_of_ceiling']:5.0f}% {100 * x['hit_rate']:5.1f}% "
              f"{_gb(x['bytes_read_per_token']):>10} {x['achieved_gbps']:6.1f} {_gb(x['peak_rss_bytes']):>10}",
              file=out)
    if "transformers" in r:
        t = r["transformers"]
        print(f"transformers (same weights, float32): prefill {t['prefill_tok_s']:.1f} t/s, decode "
              f"{t['decode_tok_s']:.2f} t/s; fastar/transformers decode = {r['speedup_vs_transformers']:.1f}x",
              file=out)


def plot(r: dict, path: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise FastarError("--plot needs matplotlib (pip install matplotlib)") from None
    runs = sorted(r["runs"], key=lambda x: x["ram_budget_bytes"])
    xs = [x["ram_budget_bytes"] / 1e9 for x in runs]
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(xs, [x["decode_tok_s"] for x in runs], "o-", label="decode tok/s")
    ax.plot(xs, [x["ceiling_tok_s"] for x in runs], "--", label="ceiling tok/s")
    ax.set_xlabel("expert RAM budget (GB)")
    ax.set_ylabel("tokens/s")
    ax2 = ax.twinx()
    ax2.plot(xs, [100 * x["hit_rate"] for x in runs], "s:", color="gray", label="hit rate %")
    ax2.set_ylabel("hit rate (%)")
    fig.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path)


def main(a) -> int:
    from .console import memory_options

    if not os.path.exists(a.model):
        raise FastarError(f"{a.model}: no such file or directory")
    opts = memory_options(a)
    budgets = [None if s.strip().lower() == "none" else s.strip() for s in str(opts.pop("ram_budget") or "none").split(",")]
    budgets = [b if b in (None, "auto") else parse_size(b) for b in budgets]
    opts["draft"] = getattr(a, "draft", "none")
    r = run(a.model, budgets, prompt_tokens=a.prompt_tokens, decode_tokens=a.decode_tokens, reference=a.reference,
            options=opts)
    if a.compare:  # the same benchmark on another source of the same model (e.g. .fst vs checkpoint dir)
        r["compare"] = run(a.compare, budgets, prompt_tokens=a.prompt_tokens, decode_tokens=a.decode_tokens,
                           options=opts)
        r["compare"]["model"] = a.compare
        r["decode_ratio_vs_compare"] = r["decode_tok_s"] / r["compare"]["decode_tok_s"]
    if a.plot:
        plot(r, a.plot)
    if a.json:
        print(json.dumps(r, default=float))
    else:
        print(f"{a.model}:")
        print_table(r)
        if a.compare:
            print(f"\n{a.compare}:")
            print_table(r["compare"])
            print(f"\ndecode speed {a.model} / {a.compare} = {r['decode_ratio_vs_compare']:.2f}x")
    return 0
