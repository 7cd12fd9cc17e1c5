"""Greedy decode with the screened LM head against the full one, in one engine on the same states: blocks of greedy
decode steps of --rows sequences (`forward_rows`, as the scheduler steps them) alternate `argmax_only` True (the head
screen, docs/MODEL.md) and False (every logit), each block between two memory bandwidth probes, so both heads run at
the memory speed of the same minutes.

    flock /tmp/bench.lock python scripts/head_screen_ab.py -m flash4.fst [--rows 1,4,8] [--rounds 4] [--steps 12]
        [--against full|two-term]

--against two-term alternates instead the screen as it runs (from `HeadScreen.ONE_TERM_ROWS` rows the first int8
term alone where it settles a head row, `head_i8_screen`) with the screen taking both terms of every row
(`head_i8_dot` and `head_i8_select`). Prints per block its aggregate tokens/s, ms per step and the bandwidth around
it. That both heads give the same
tokens is tests/test_head_screen.py's to check, not this script's.
"""

from __future__ import annotations

import argparse
import time

import fastar
from fastar.bench.model import _settle, _stream_gbps
from fastar.engine.sampling import argmax


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=12, help="greedy steps per block")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--rows", default="1", help="comma-separated decode batch sizes, 1 to 8")
    ap.add_argument("--against", choices=("full", "two-term"), default="full", help="the other side of the A/B")
    a = ap.parse_args()
    eng = fastar.load(a.model)
    if eng.model.screen is None:
        raise SystemExit("this engine has no head screen (the C kernels are needed)")
    _settle(eng)
    model = eng.model
    one_term = model.screen.ONE_TERM_ROWS  # before any block sets it (each --against two-term block changes it)
    for n in (int(r) for r in a.rows.split(",")):
        states = [eng.new_state() for _ in range(n)]
        last = []
        for i, state in enumerate(states):
            prompt = list(range(1000 + 97 * i, 1000 + 97 * i + a.prompt_tokens))
            last.append(argmax(eng.prefill(prompt, state)[-1]))

        def step(screen: bool) -> None:
            if a.against == "two-term":  # both sides screened; the B side with both terms of every row
                model.screen.ONE_TERM_ROWS = one_term if screen else model.screen.MAX_ROWS + 1
            logits = model.forward_rows(last, states, [screen or a.against == "two-term"] * n)
            last[:] = [argmax(row) for row in logits]

        for _ in range(4):  # first touches out of the timing
            step(True)
        for rnd in range(a.rounds):
            for screen in (True, False):
                bw0, t0 = _stream_gbps(eng), time.perf_counter()
                for _ in range(a.steps):
                    step(screen)
                dt = (time.perf_counter() - t0) / a.steps
                head = (
                    ("screened" if screen else "full    ")
                    if a.against == "full"
                    else ("one-term" if screen else "two-term")
                )
                print(
                    f"{n} rows, round {rnd} {head}: {n / dt:6.2f} tok/s ({dt * 1e3:.1f} ms/step), memory {bw0:.1f} "
                    f"-> {_stream_gbps(eng):.1f} GB/s",
                    flush=True,
                )


if __name__ == "__main__":
    main()
