"""Long-context prefill: peak memory against the decode-state accounting (issue 16, item 4).

Prefills N random tokens into one state of a model (a `.fst`, e.g. `fastar synth -o m.fst --layers 3 --experts 8
--mtp 0`: Flash widths, layer 2 a ratio-4 layer with the indexer) and prints the time, the state it holds beside
`fastar.model.state.state_bytes` for N positions, and how far the process's peak resident memory rose during the
prefill (Linux: the peak is reset through /proc/self/clear_refs after loading and a warm-up) against that
accounting + 1 GB (the goal). With `--other-chunk C` it prefills the same tokens again in chunks of C and prints
the largest difference of the last logits (the tests pin it on small models: tests/test_kvstate.py); with
`--decode N` it then decodes N tokens alternating between the packed state and a float32 copy of it.

    python scripts/long_context.py m.fst --tokens 65536 [--chunk 512] [--numerics official] [--other-chunk 1000]
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path


def _status(field: str) -> int:
    """A VmRSS / VmHWM line of /proc/self/status, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field}")


def _prefill(engine, ids: list[int], chunk: int, label: str):
    """Prefill `ids` into a fresh state chunk by chunk, printing progress -> (state, last logits [V], seconds)."""
    state = engine.new_state()
    t0 = time.perf_counter()
    logits = None
    mark, at = t0, 0  # the last progress line: its time and tokens done
    for a in range(0, len(ids), chunk):
        logits = engine.model.forward(ids[a : a + chunk], state, all_logits=False)[0][-1]
        done, now = a + len(ids[a : a + chunk]), time.perf_counter()
        if done == len(ids) or (a // chunk) % 8 == 7:
            print(
                f"  {label}: {done}/{len(ids)} tokens, {now - t0:.0f} s, {done / (now - t0):.1f} tok/s overall, "
                f"{(done - at) / (now - mark):.1f} tok/s over context {at}-{done}",
                flush=True,
            )
            mark, at = now, done
    return state, logits, time.perf_counter() - t0


def _float32_copy(state):
    """The same state with every buffer stored as float32 rows (what the state held before packed formats)."""
    import copy

    from fastar.model.state import RowBuffer

    out = copy.copy(state)
    out.layers = [copy.copy(s) for s in state.layers]
    for s in out.layers:
        for name, b in s.buffers().items():
            setattr(s, name, RowBuffer(b.width, b.start, b.all()))
    return out


def _decode_ab(engine, state, n: int) -> None:
    """Decode n greedy tokens from the prefilled state twice, alternating step by step between the packed state and
    a float32 copy (same tokens, same process: the machine's load hits both alike); prints ms per token each."""
    plain = _float32_copy(state)
    seqs: list[list[int]] = [[1], [1]]
    spent = [0.0, 0.0]
    for _ in range(n):
        for i, st in enumerate((state, plain)):
            t0 = time.perf_counter()
            logits = engine.model.forward(seqs[i][-1:], st, all_logits=False)[0][-1]
            spent[i] += time.perf_counter() - t0
            seqs[i].append(int(logits.argmax()))
    print(
        f"decode after {state.length - n} positions, {n} tokens: packed state {1e3 * spent[0] / n:.1f} ms/token, "
        f"float32 rows {1e3 * spent[1] / n:.1f} ms/token; same tokens: {seqs[0] == seqs[1]}"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--other-chunk", type=int, default=0, help="prefill again in chunks of this size and compare")
    ap.add_argument("--numerics", default="official", choices=("official", "reference"))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decode", type=int, default=0, help="then decode this many tokens, packed vs float32 state")
    a = ap.parse_args()

    import fastar
    from fastar.model.state import state_accounting, state_bytes

    engine = fastar.load(a.model, numerics=a.numerics, max_rollback=0, ram_budget=None)
    cfg = engine.config
    ids = [random.Random(a.seed).randrange(2, cfg.vocab_size) for _ in range(a.tokens)]
    engine.model.forward(ids[:16], engine.new_state(), all_logits=False)  # warm-up: kernels, expert pages
    Path("/proc/self/clear_refs").write_text("5")  # reset the peak (VmHWM) to the current RSS
    base = _status("VmRSS")
    print(
        f"{a.model}: {cfg.num_hidden_layers} layers (ratios {[cfg.ratio(i) for i in range(cfg.num_hidden_layers)]}), "
        f"{a.numerics} numerics, {a.tokens} tokens in chunks of {a.chunk}; RSS after load {base / 1e9:.2f} GB"
    )
    state, last, secs = _prefill(engine, ids, a.chunk, "prefill")
    peak = _status("VmHWM") - base
    fmt = engine.model.numerics.state_format(cfg)
    accounted = state_bytes(cfg, a.tokens, state.max_rollback, mtp_layers=0, fmt=fmt)
    held = state.nbytes()
    name = state_accounting(cfg, 0, mtp_layers=0, fmt=fmt)["format"]
    verdict = "met" if peak <= accounted + 1e9 else "NOT met"
    print(
        f"prefill: {secs:.0f} s ({a.tokens / secs:.1f} tok/s); state held {held / 1e6:.1f} MB, accounted "
        f"{accounted / 1e6:.1f} MB ({name}); peak RSS rose {peak / 1e6:.0f} MB during the prefill; "
        f"goal: <= accounting + 1 GB = {(accounted + 1e9) / 1e6:.0f} MB: {verdict}"
    )
    ok = held == accounted and peak <= accounted + 1e9
    if a.decode:
        _decode_ab(engine, state, a.decode)
    if a.other_chunk:
        del state
        _, other, _ = _prefill(engine, ids, a.other_chunk, f"chunks of {a.other_chunk}")
        diff = (other - last).abs().max().item()
        print(f"last logits, chunks of {a.chunk} vs {a.other_chunk}: max |difference| {diff:.3g}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
