"""What admitting a long conversation costs before the model runs, with and without the tokenizer's run cache.

A history of `--messages` messages of ~500 tokens each (Python source from the standard library: what a coding
agent's history holds), then three more turns of an agent (a reply and a question added each). Each turn is
admitted as a Responses request is (`truncation.fit`: the whole conversation, and where it does not fit the
steps' sizes and the cuts tried), by the real V4 tokenizer with its run cache and without (`run_cache_chars=0`),
alternating, each with a fresh replay cache; prints the CPU time per turn and checks the kept messages and the
ids are the same. Context `1M` fits the history; a smaller one makes `auto` cut it.

    python scripts/admission_tokens.py [--messages 200] [--contexts 1048576,65536]
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import time
from pathlib import Path
from types import SimpleNamespace

import tokenizers

from fastar.engine.tokenizer import Tokenizer, default_tokenizer_path
from fastar.serve import truncation
from fastar.serve.turn import Backend, Conversation


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--messages", type=int, default=200)
    ap.add_argument("--contexts", default="1048576,65536")
    args = ap.parse_args()
    rng = random.Random(0)
    files = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))[:200]
    source = "".join(Path(p).read_text(encoding="utf-8", errors="replace") for p in files)

    def text(tokens: int) -> str:  # ~4 characters a token
        at = rng.randrange(len(source) - 4 * tokens)
        return source[at : at + 4 * tokens]

    roles = ("user", "assistant")
    first = [{"role": roles[i % 2], "content": text(500)} for i in range(args.messages)]
    turns = [[*first, {"role": "user", "content": "and now?"}]]
    for k in range(3):
        turns.append(
            [*turns[-1], {"role": "assistant", "content": text(300)}, {"role": "user", "content": f"next {k}"}]
        )
    hf = tokenizers.Tokenizer.from_file(str(default_tokenizer_path()))
    toks = {"cached": Tokenizer(hf), "uncached": Tokenizer(hf, run_cache_chars=0)}
    for tok in toks.values():  # the first-use tables (the plain tokenizer, the longest token) outside the timing
        tok.encode(Conversation([{"role": "user", "content": "warm up"}], True).render())
        tok.max_token_bytes()

    def render(messages: list[dict]) -> Conversation:
        return Conversation(list(messages), True, None, True, "input")

    def admit(tok: Tokenizer, conversation: list[dict], context: int) -> tuple[float, list[dict], list[int]]:
        engine = SimpleNamespace(tokenizer=tok, context_length=context, context_note=None)
        backend = Backend(engine=lambda: engine, submit=lambda job: None)
        start = time.process_time()
        conv, (_, ids) = truncation.fit(backend, conversation, render, 1)
        return time.process_time() - start, conv.messages, ids

    for context in (int(c) for c in args.contexts.split(",")):
        times: dict[str, list[float]] = {name: [] for name in toks}
        kept = []
        for i, conversation in enumerate(turns):
            got = {}
            for name in ("cached", "uncached") if i % 2 == 0 else ("uncached", "cached"):
                seconds, messages, ids = admit(toks[name], conversation, context)
                times[name].append(seconds)
                got[name] = (messages, ids)
            if got["cached"] != got["uncached"]:
                raise SystemExit(f"context {context}, turn {i}: the cached tokenizer's cut or ids differ")
            kept.append(f"{len(got['cached'][0])}/{len(conversation)} messages, {len(got['cached'][1])} tokens")
        per = "; ".join(f"{name} " + ", ".join(f"{1000 * t:.0f}" for t in ts) + " ms" for name, ts in times.items())
        print(f"context {context}: {per} (CPU per turn; kept {', '.join(kept)}; same cut and ids)")


if __name__ == "__main__":
    main()
