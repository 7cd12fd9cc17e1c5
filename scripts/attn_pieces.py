"""Times the context-dependent steps of one prefill piece of a ratio-4 layer at Flash shapes (issue 16, item 2).

For each context length P: 128 queries at positions P-128..P-1 over P/4 index keys (64 heads of 128, FP4-rounded as
the official numerics have them) and FP8-packed compressed entries; prints the best of `--repeat` runs of each step,
the C path beside its torch twin: index scores (FP32 kernel / the bf16 one the official numerics use), top-k
(`index_topk_torch` / `index_topk`), the dedupe of the picks (torch.unique / the mark array the model uses), the
decode of the picked entries and the attention over window + picks; then the compressor's pooling of one 512-token
chunk (`compress_pool_torch` / `compress_pool`).

    python scripts/attn_pieces.py [--contexts 4096,16384,65536] [--repeat 3]
"""

from __future__ import annotations

import argparse
import time

import torch

from fastar.model import ops
from fastar.model.deepseek_v4 import attend
from fastar.model.state import RowFormat

H, D, HI, DI, T, TOPK, W = 64, 512, 64, 128, 128, 512, 128


def _best(f, n: int) -> tuple[float, object]:
    best, out = float("inf"), None
    for _ in range(n):
        t = time.perf_counter()
        out = f()
        best = min(best, time.perf_counter() - t)
    return best * 1e3, out


def _dedupe(idx: torch.Tensor, E: int) -> tuple[torch.Tensor, torch.Tensor]:
    used = idx >= 0
    mark = torch.zeros(E, dtype=torch.bool)
    mark[idx[used]] = True
    return mark.nonzero().squeeze(1), torch.where(used, (mark.cumsum(0) - 1)[idx.clamp(min=0)], -1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--contexts", default="4096,16384,65536")
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()
    g = torch.Generator().manual_seed(0)
    for P in (int(c) for c in a.contexts.split(",")):
        E, p0 = P // 4, P - T
        q = ops.fp4_quant_sim(torch.randn(T, HI, DI, generator=g), 32)
        w = torch.randn(T, HI, generator=g)
        keys = ops.fp4_quant_sim(torch.randn(E, DI, generator=g), 32)
        fmt = RowFormat("fp8", D, 64)
        nope = ops.fp8_quant_sim(torch.randn(E, D - 64, generator=g), 64)
        raw = fmt.encode(torch.cat([nope, torch.randn(E, 64, generator=g)], 1))
        r = {}
        r["scores fp32"], _ = _best(lambda: ops.index_scores(q, w, keys, p0), a.repeat)
        r["scores bf16"], s = _best(lambda: ops.index_scores(q, w, keys, p0, fp4=True), a.repeat)
        r["topk torch"], _ = _best(lambda: ops.index_topk_torch(s, p0, TOPK), a.repeat)
        r["topk C"], idx = _best(lambda: ops.index_topk(s, p0, TOPK), a.repeat)
        r["unique torch"], _ = _best(lambda: torch.unique(idx[idx >= 0], return_inverse=True), a.repeat)
        r["dedupe mark"], (ids, ci) = _best(lambda: _dedupe(idx, E), a.repeat)
        r["decode picks"], comp = _best(lambda: fmt.decode(raw.index_select(0, ids)), a.repeat)
        qa, win, sinks = torch.randn(T, H, D, generator=g), torch.randn(T + W - 1, D, generator=g), torch.randn(H)
        r["attend"], _ = _best(lambda: attend(qa, win, p0 - W + 1, p0, W, comp, ci, 4, sinks, D**-0.5), a.repeat)
        print(f"context {P} ({E} entries, {len(ids)} picked): " + ", ".join(f"{k} {v:.0f} ms" for k, v in r.items()))
    for n, M, hd, what in ((128, 8, 512, "ratio-4 KV"), (128, 8, 128, "index keys"), (4, 128, 512, "ratio 128")):
        kv, gate = torch.randn(n, M, hd, generator=g), torch.randn(n, M, hd, generator=g)
        t_ref, _ = _best(lambda: ops.compress_pool_torch(kv, gate), 3 * a.repeat)
        t_c, _ = _best(lambda: ops.compress_pool(kv, gate), 3 * a.repeat)
        print(
            f"compressor pooling of a 512-token chunk, {what} ({n} x {M} x {hd}): torch {t_ref:.1f} ms, C {t_c:.1f} ms"
        )


if __name__ == "__main__":
    main()
