"""Constrained decoding's cost: decode tokens/s of a constrained request against a free one, and the mask time per
token (what the grammar adds to a `Sampler` call).

    python scripts/constrained_speed.py [MODEL] [--tokens 64] [--repeats 3]

MODEL defaults to the built-in demo model. Each round runs, one after another on a fresh session, a free request,
one under a JSON-schema grammar (`response_format: json_schema`, an object with one string) and one under a forced
tool call (a two-tool `tool_choice: required`), greedy, `--tokens` tokens each (the random-weight demo model never
closes a JSON string, so the JSON run rarely ends early; the tool-call run may, where the model closes a raw string
parameter; the token counts are printed); rounds alternate the order. Decode tokens/s counts from the first token to
the last (the prefill is the same for all three). Then the tokens each constrained run produced are replayed through
a fresh parser to time its per-token work alone: `Constraint.allowed()` (llguidance's mask, unpacked to one flag per
token), the masked fill of the logits, and `Constraint.advance()`. Medians, with min-max.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import torch

from fastar.encoding import encode_messages
from fastar.engine import constraint as C
from fastar.engine.engine import load
from fastar.engine.sampling import SamplingParams

# one required string: a random-weight model writes it until max_tokens (`{}` would end a bare json_object at once)
ANSWER = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
TOOLS = [
    {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
            "required": ["city"],
        },
    },
    {
        "name": "sum",
        "parameters": {"type": "object", "properties": {"xs": {"type": "array", "items": {"type": "string"}}}},
    },
]


def spread(xs: list[float], scale: float = 1.0, fmt: str = "{:.1f}") -> str:
    return f"{fmt.format(statistics.median(xs) * scale)} ({fmt.format(min(xs) * scale)}-{fmt.format(max(xs) * scale)})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", nargs="?", help="a .fst or checkpoint directory (default: the demo model)")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.model is None:
        from fastar.demo import ensure_demo_model

        args.model = ensure_demo_model()
    engine = load(args.model)
    tok = engine.tokenizer
    ask = [{"role": "user", "content": "What is the weather in Paris? Answer in JSON."}]
    runs = {
        "free": (encode_messages(ask, "chat"), None),
        "json_schema": (encode_messages(ask, "chat"), C.output_grammar(thinking=False, schema=ANSWER)),
        "tool_call": (
            encode_messages([{"role": "system", "content": "", "tools": TOOLS}, *ask], "chat"),
            C.output_grammar(thinking=False, functions=TOOLS, choice="required"),
        ),
    }
    t = time.perf_counter()
    compiled = {name: engine.compile_grammar(g) if g else None for name, (_, g) in runs.items()}
    print(f"compile (llguidance tokenizer + 2 grammars): {time.perf_counter() - t:.2f} s", file=sys.stderr)
    rates: dict[str, list[float]] = {name: [] for name in runs}
    produced: dict[str, list[int]] = {}
    names = list(runs)
    for r in range(args.repeats + 1):  # round 0 warms up
        for name in names if r % 2 else names[::-1]:
            text, _ = runs[name]
            params = SamplingParams(max_tokens=args.tokens, grammar=compiled[name], ignore_eos=compiled[name] is None)
            stamps, tokens = [], []
            for chunk in engine.stream(tok.encode(text), params, session=engine.open_session()):
                if chunk.token is not None:
                    stamps.append(time.perf_counter())
                    tokens.append(chunk.token)
            if r and len(stamps) > 1:
                rates[name].append((len(stamps) - 1) / (stamps[-1] - stamps[0]))
            produced[name] = tokens
    for name in names:
        print(f"{name:12s} decode tok/s {spread(rates[name])}  ({len(produced[name])} tokens)")
    vocab, us = engine.config.vocab_size, "{:.0f}"
    logits = torch.randn(vocab)
    for name in names[1:]:
        mask_t, fill_t, advance_t = [], [], []
        c = compiled[name].start()
        for token in produced[name]:
            t0 = time.perf_counter()
            allowed = c.allowed()
            t1 = time.perf_counter()
            torch.from_numpy(np.where(allowed, logits.numpy(), np.float32(-np.inf)))  # as the Sampler masks
            t2 = time.perf_counter()
            c.advance(token)
            t3 = time.perf_counter()
            mask_t.append(t1 - t0)
            fill_t.append(t2 - t1)
            advance_t.append(t3 - t2)
        total = [a + b + c for a, b, c in zip(mask_t, fill_t, advance_t)]
        print(
            f"{name:12s} per token, us: mask {spread(mask_t, 1e6, us)}, masked fill {spread(fill_t, 1e6, us)}, "
            f"advance {spread(advance_t, 1e6, us)}, all {spread(total, 1e6, us)}"
        )
    engine.close()


if __name__ == "__main__":
    main()
