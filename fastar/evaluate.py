"""`fastar perplexity FILE`: the perplexity of a text file as llama.cpp's `llama-perplexity` reports it, and the
comparison of two runs token by token (`--save-logits`, `--kl-divergence`).

Owns: the command's flags, reading the text file (missing, empty, binary or not UTF-8: one line naming the file),
the window against the context, the progress bar (scored tokens, running PPL, tokens/s; on a terminal) and the
report (plain text, or `--json`). Does not own: the windows and numbers (`fastar.engine.perplexity`), opening the
model (`fastar.console.open_engine`, as `run` opens it). What each number means: docs/PERPLEXITY.md.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from . import console
from .errors import FastarError
from .outputs import model_files, refuse_existing_output, refuse_inputs_as_output, refuse_unwritable_output
from .words import counted


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", nargs="?", help="a UTF-8 text file")
    p.add_argument(
        "-f",
        "--file",
        dest="text_file",
        metavar="FILE",
        default=None,
        help="the text file, as llama-perplexity takes it",
    )
    p.add_argument(
        "-m",
        "--model",
        type=console.home_path,
        default=None,
        help=".fst file or checkpoint directory (default: the demo model)",
    )
    p.add_argument(
        "-c", "--ctx", type=console.positive_int, default=512, help="tokens per window (default 512, as llama.cpp)"
    )
    p.add_argument(
        "--stride",
        type=console.positive_int,
        default=None,
        help="tokens a window moves by (default ctx/2): only tokens no earlier window scored are scored, so each "
        "has at least ctx - stride tokens of context after the first window",
    )
    console.add_numerics_argument(p)
    p.add_argument("--threads", type=console.thread_count, default=0, help=console.THREADS_HELP)
    console.add_memory_arguments(p)
    p.add_argument(
        "--save-logits", metavar="OUT", default=None, help="save every scored token's distribution (float16) to OUT"
    )
    p.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --save-logits file (without it, one is refused before the model loads; the old "
        "one stays until the run is complete)",
    )
    p.add_argument(
        "--kl-divergence",
        metavar="BASE",
        default=None,
        help="compare with a run saved by --save-logits on the same text and windows: KL divergence, top-1 "
        "agreement, largest change of a token's logprob",
    )
    p.add_argument("--json", action="store_true", help="print the results as one JSON object")
    p.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: on a terminal)"
    )
    p.add_argument("--verbose", action="store_true", help=console.VERBOSE_LOAD_HELP)
    # the engine options open_engine reads that perplexity has no flag for: the window sets the context (-c),
    # and every window is one forward pass, so no draft
    p.set_defaults(ctx_size=0, draft="none")


def read_text(path: str) -> str:
    """The file's text; a missing, empty, binary or non-UTF-8 file is a one-line `FastarError`."""
    p = Path(path)
    if not p.exists():
        raise FastarError(f"{path}: no such file")
    if not p.is_file():
        raise FastarError(f"{path}: not a regular file")
    raw = p.read_bytes()
    if not raw.strip():
        raise FastarError(f"{path}: the file is empty: nothing to score")
    nul = raw.find(b"\0")
    if nul >= 0:
        raise FastarError(f"{path}: a binary file (a NUL byte at offset {nul}); give a UTF-8 text file")
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise FastarError(f"{path}: not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start})") from None


def _check_window(engine, ctx: int) -> None:
    """The window must fit the context; -c raises the engine's context up to what the model computes."""
    limit = engine.config.max_position_embeddings
    if ctx > limit:
        raise FastarError(f"--ctx {ctx} is larger than the model's context ({limit} tokens)")
    if ctx > engine.context_length:
        engine.context_length = ctx
    if ctx > engine.context_length:
        note = f": {engine.context_note}" if engine.context_note else ""
        raise FastarError(f"--ctx {ctx} is larger than the model's context ({engine.context_length} tokens){note}")


def _bar(a, total: int):
    show = sys.stderr.isatty() if a.progress is None else a.progress
    if not show:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="perplexity", unit="tok", file=sys.stderr, mininterval=0.25)


def _check_save_target(a) -> None:
    """`--save-logits` is renamed over what it names: never the text, the --kl-divergence base or the model."""
    model = a.model
    if model is None:
        from .demo import demo_path

        model = demo_path()
    inputs = [(a.file, "the text file being scored"), (a.kl_divergence, "the --kl-divergence base")]
    what = "a file of the model" if os.path.isdir(console.home_path(model)) else "the model file"
    refuse_inputs_as_output(a.save_logits, [*inputs, *((f, what) for f in model_files(model))], "--save-logits")


def cmd_perplexity(a) -> int:
    if a.file is not None and a.text_file is not None and a.file != a.text_file:
        raise FastarError(f"two text files given ({a.file} and -f {a.text_file}): give one")
    a.file = a.file if a.file is not None else a.text_file
    if a.file is None:
        raise FastarError("no text file: give it as `fastar perplexity FILE` or with -f FILE")
    text = read_text(a.file)
    _check_save_target(a)
    # the outputs and the base are checked before the model loads (minutes on Flash) and the windows run (hours):
    # a base path mistyped, or a --save-logits folder that does not exist, was said only then
    refuse_unwritable_output(a.save_logits, "--save-logits", "the logits file")
    refuse_existing_output(a.save_logits, a.force, "--save-logits")  # the run it holds took hours to make
    if a.kl_divergence is not None:
        from .engine.logits_file import LogitsFile

        LogitsFile(a.kl_divergence)  # missing, a folder, another kind of file, truncated: one line now
    if a.stride is not None and a.stride > a.ctx:
        raise FastarError(f"--stride {a.stride} is larger than --ctx {a.ctx}: tokens between windows would be skipped")
    if a.ctx < 2:
        raise FastarError("--ctx must be at least 2 (a token and the one it predicts)")
    engine = console.open_engine(a, sys.stderr)
    _check_window(engine, a.ctx)
    ids = engine.tokenizer.encode(text)
    if len(ids) < 2:
        raise FastarError(f"{a.file}: {len(ids)} token(s): nothing to score (it needs at least 2)")
    bar = None

    def progress(done: int, total: int, seconds: float) -> None:
        nonlocal bar
        if bar is None:
            bar = _bar(a, total)
        if bar is not None:
            bar.update(done - bar.n)
            bar.set_postfix_str(f"{done / seconds:.1f} scored tok/s" if seconds > 0 else "")

    meta = {"numerics": a.numerics, "model": str(a.model or "demo")}
    try:
        result = engine.perplexity(
            ids,
            ctx=a.ctx,
            stride=a.stride,
            save_logits=a.save_logits,
            compare=a.kl_divergence,
            on_window=progress,
            meta=meta,
        )
    finally:
        if bar is not None:
            bar.close()
        engine.close()
    summary = {"file": a.file, **result.summary()}
    if a.save_logits:
        summary["saved_logits"] = a.save_logits
    if a.json:
        print(json.dumps(summary, indent=2))
    else:
        print(report(summary))
    return 0


def report(s: dict) -> str:
    lines = [
        f"{s['file']}: {counted(s['tokens'], 'token')}, {counted(s['windows'], 'window')} of {s['ctx']} moved by "
        f"{s['stride']}, {counted(s['scored'], 'token')} scored",
        f"Final estimate: PPL = {s['ppl']:.4f} +/- {s['ppl_stderr']:.4f}",
        f"mean NLL {s['nll']:.6f} +/- {s['nll_stderr']:.6f} nats/token; {s['tokens_per_s']:.1f} tokens/s "
        f"({s['evaluated_tokens']} run through the model in {s['seconds']:.1f} s)",
    ]
    kl = s.get("kl_divergence")
    if kl:
        lines += [
            f"against the base run ({counted(kl['tokens'], 'token')}): PPL(base) = {kl['base_ppl']:.4f}, "
            f"PPL(this) / PPL(base) = {s['ppl'] / kl['base_ppl']:.6f}",
            f"  mean KLD      {kl['kl_mean']:.6f} +/- {kl['kl_mean_stderr']:.6f}",
            f"  max KLD       {kl['kl_max']:.6f}",
            f"  99.9 % KLD    {kl['kl_p99.9']:.6f}",
            f"  99 % KLD      {kl['kl_p99']:.6f}",
            f"  95 % KLD      {kl['kl_p95']:.6f}",
            f"  90 % KLD      {kl['kl_p90']:.6f}",
            f"  median KLD    {kl['kl_p50']:.6f}",
            f"  same top-1    {100 * kl['top1_agreement']:.3f} %",
            f"  max |dlogp|   {kl['max_abs_delta_logprob']:.6f} (a scored token's logprob)",
        ]
    if s.get("saved_logits"):
        lines.append(f"saved every scored token's distribution to {s['saved_logits']}")
    return "\n".join(lines)
