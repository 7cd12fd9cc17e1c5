"""`fastar run` and `fastar chat`: the terminal front-ends, thin layers over `Engine.stream`.

Owns: their flags (`add_run_arguments`, `add_chat_arguments`; `fastar.cli` mirrors each in a `FASTAR_*`
variable), opening the model (the built-in demo when no `-m` is given, with its banner), progress bars for load
and long prefills (on a terminal only), streaming output (answer to stdout; reasoning dimmed, `styled`, and for
`run` on stderr so a pipe gets the answer alone), the timings line, and the chat REPL (`ChatREPL`: history, `/reset`,
`/thinking`, `/save`, `/load`, Ctrl-C stops a reply and keeps the chat; from a pipe, a failed turn or command is a
`fastar: error:` line on stderr and the exit status 1). Does not own: any tensor code
(everything goes through `Engine` and `Session`), the chat format (`fastar.encoding`), argument parsing
mechanics and the one-line error convention (`fastar.cli`).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from .config import MAX_DEFAULT_CONTEXT, float_flag, int_flag, parse_size
from .encoding import StreamParser
from .engine.tokenizer import InvalidText, check_text
from .errors import ConfigError, FastarError, OptionError
from .outputs import model_files, refuse_existing_output, refuse_inputs_as_output
from .words import counted

DIM, RESET = "\x1b[2m", "\x1b[0m"


def styled(f: TextIO) -> bool:
    """Whether `f` gets terminal styling (the dimmed reasoning): a terminal, unless NO_COLOR is set (non-empty, as
    no-color.org asks) or TERM is `dumb`, where an escape shows as `^[[2m` garbage."""
    return f.isatty() and not os.environ.get("NO_COLOR") and os.environ.get("TERM") != "dumb"


MAX_STDIN_PROMPT = 64 << 20  # characters: 16x a 1M-token context's text, and a bound for an endless stream
CHAT_HELP = """commands:
  /reset              forget the conversation (the system prompt stays)
  /thinking on|off    think before answering (reasoning is shown dimmed unless NO_COLOR is set)
  /save FILE          save the conversation and its model state (/save --force FILE: over an existing file)
  /load FILE          load a saved conversation (continues without recomputing it)
  /stats              token counts and speeds so far (then every counter of the engine)
  /help               this text
  /exit               quit (also Ctrl-D); Ctrl-C stops the current reply"""


# --- flags -------------------------------------------------------------------------------------------------


def _stop_string(text: str) -> str:
    """--stop: an empty string would stop nothing (it was dropped without a word); the API refuses it too."""
    if not text:
        raise argparse.ArgumentTypeError("the stop string is empty (omit --stop for none)")
    return text


non_negative_int = int_flag(0, None, "a count")
positive_int = int_flag(1, None, "a positive count")
MAX_THREADS = 256  # the kernels' thread pool holds at most this many (bindings.c's set_num_threads)
thread_count = int_flag(0, MAX_THREADS, "a thread count")
seed_value = int_flag(-(2**63), 2**64 - 1, "a seed")
CONTEXT_HELP = f"context length in tokens (default: the model's, at most {MAX_DEFAULT_CONTEXT:,})"
THREADS_HELP = "CPU threads of the kernels (default: every CPU this process may use)"
VERBOSE_HELP = "more detail on stderr (model, token counts, stats)"
VERBOSE_LOAD_HELP = "one more line on stderr: the loaded model's layers, widths, experts, vocabulary and context"


def home_path(text: str) -> str:
    """A path the user gave, with a leading `~` as the home folder, as a shell reads `-m ~/x.fst`: what no shell
    expands reaches fastar as written and failed as "no such file" (`--model=~/x.fst`, `-o=~/x.fst`, a
    `FASTAR_*` mirror such as `FASTAR_MODEL=~/x.fst` in a service's environment file, chat's `/save ~/c.json`).
    The one place every path flag (`fastar.cli`'s file arguments, each `-m/--model`) and chat command expands it."""
    return os.path.expanduser(text)


def _add_common(p: argparse.ArgumentParser, max_tokens: int) -> None:
    p.add_argument(
        "-m",
        "--model",
        type=home_path,
        default=None,
        help=".fst file or official checkpoint directory (default: the built-in demo model, random weights, "
        "built once)",
    )
    p.add_argument(
        "-n",
        "--max-tokens",
        type=positive_int,
        default=max_tokens,
        help="most tokens to generate per reply (default %(default)s)",
    )
    p.add_argument(
        "--temp",
        "--temperature",
        dest="temp",
        type=float_flag(0, 100, "a temperature"),
        default=0.0,
        help="0 = greedy (default %(default)s)",
    )
    p.add_argument(
        "--top-p",
        type=float_flag(0, 1, "top-p", open_lo=True),
        default=1.0,
        help="sample from the most likely tokens that together hold this probability (1 = off)",
    )
    p.add_argument("--top-k", type=non_negative_int, default=0, help="sample from the k most likely tokens (0 = off)")
    p.add_argument(
        "--min-p",
        type=float_flag(0, 1, "min-p"),
        default=0.0,
        help="drop tokens less likely than this fraction of the most likely one (0 = off)",
    )
    p.add_argument(
        "--seed", type=seed_value, default=None, help="random seed (same seed, same text; default: a new one each run)"
    )
    p.add_argument(
        "-c",
        "--ctx-size",
        "--max-model-len",
        dest="ctx_size",
        type=non_negative_int,
        default=0,
        help=CONTEXT_HELP,
    )
    p.add_argument(
        "--thinking",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="let the model think before answering (DeepSeek-V4 thinking mode; default: off)",
    )
    p.add_argument("--system", default=None, help="system prompt")
    p.add_argument(
        "--threads",
        type=thread_count,
        default=0,
        help=THREADS_HELP,
    )
    add_draft_argument(p)
    add_memory_arguments(p)
    p.add_argument("--verbose", action="store_true", help=VERBOSE_HELP)
    p.set_defaults(numerics="official")  # `open_engine` reads it; run and chat have no --numerics flag


# `load`'s keywords as the command line spells them: an `OptionError` from `load` names the flag the user typed
# (`--ram-budget 1000: ...`, where the Python API says `ram_budget=1000: ...`); a switch's flag is the one that turns
# it the way the message suggests (`{verify=False}`: --no-verify)
LOAD_FLAGS = {
    "ram_budget": "--ram-budget",
    "gpu_budget": "--gpu-budget",
    "cache_policy": "--cache-policy",
    "device": "--device",
    "draft": "--draft",
    "numerics": "--numerics",
    "threads": "--threads",
    "verify": "--no-verify",
}


def add_memory_arguments(p: argparse.ArgumentParser) -> None:
    """The engine's memory and device options, which `memory_options` reads: every command that loads a model
    (run, chat, serve, perplexity, bench) adds them."""
    p.add_argument(
        "--ram-budget",
        default="auto",
        help="RAM for routed experts paged from the .fst, e.g. 24G (auto: available memory less the "
        "resident weights and a margin; 'none': map the whole file)",
    )
    p.add_argument(
        "--cache-policy",
        default="lrfu",
        choices=["lrfu", "lru"],
        help="expert eviction policy: lrfu (default; recency and frequency) or lru (recency only)",
    )
    p.add_argument(
        "--direct-io",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="read experts with O_DIRECT, no second copy in the OS page cache (default: on where "
        "the file system supports it)",
    )
    p.add_argument("--lookahead", action="store_true", help="prefetch each next layer's experts guessed by its router")
    p.add_argument(
        "--head-screen",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="keep the LM head also as int8 so greedy decode steps (and those sampled without top-p or min-p) compute "
        "exactly only the logits that can be the argmax or win the draw (default: on; +0.5 GB on Flash, from the "
        "auto RAM budget)",
    )
    p.add_argument(
        "--no-verify",
        dest="verify",
        action="store_false",
        help="skip the checksums: of the resident tensors at load, of each expert at its first read",
    )
    p.add_argument(
        "--device",
        default=None,
        help="cpu (the C kernels; the default), torch:cpu (the GPU code path on the CPU: slow, for tests), cuda or "
        "cuda:N (experimental: not yet run on a GPU), auto (cuda when present, else cpu)",
    )
    p.add_argument(
        "--gpu-budget",
        default="auto",
        help="device memory for routed experts, e.g. 16G (auto: what is free after the resident weights less "
        "2 GiB; 0: every routed expert on the CPU)",
    )


def check_sizes(args: argparse.Namespace) -> None:
    """--ram-budget and --gpu-budget read as sizes before any model is opened: a typo is one line naming its flag,
    not an error after the resident weights' checksums (or after `serve` bound its port). Not for `bench`, whose
    --ram-budget is a list."""
    for flag, size in (("--ram-budget", args.ram_budget), ("--gpu-budget", args.gpu_budget)):
        if str(size).strip().lower() != "none":
            try:
                parse_size(size)
            except ConfigError as e:
                raise ConfigError(f"{flag}: {e}") from None


def memory_options(args: argparse.Namespace) -> dict:
    """`load`'s options from the flags `add_memory_arguments` added."""
    budget = args.ram_budget
    return {
        "ram_budget": None if str(budget).lower() == "none" else budget,
        "cache_policy": args.cache_policy,
        "direct_io": args.direct_io,
        "lookahead": args.lookahead,
        "head_screen": args.head_screen,
        "verify": args.verify,
        "device": args.device,
        "gpu_budget": args.gpu_budget,
    }


def add_numerics_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--numerics",
        default="official",
        choices=["official", "reference"],
        help="official (default): DeepSeek's inference rounding (FP8 activations and KV, FP4 index keys); "
        "reference: transformers' float32 arithmetic on the same weights (docs/MODEL.md, Numerics)",
    )


def add_draft_argument(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--draft",
        default="none",
        choices=["none", "mtp", "dspark", "auto"],
        help="speculative decoding: the checkpoint's MTP block, its DSpark stages (-0731), auto (the one "
        "it has, used only while it pays), or none (default)",
    )


def add_run_arguments(p: argparse.ArgumentParser) -> None:
    _add_common(p, max_tokens=256)
    p.add_argument("-p", "--prompt", default=None, help="the prompt ('-' or omitted with a pipe: read stdin)")
    p.add_argument("--raw", action="store_true", help="use the prompt as-is, without the chat encoding")
    p.add_argument(
        "--stop",
        type=_stop_string,
        default=None,
        help="stop string (not included in the output; with --thinking, matched in the answer only, not the reasoning)",
    )
    p.add_argument(
        "--min-tokens",
        type=non_negative_int,
        default=0,
        help="generate at least this many tokens: EOS is not drawn and --stop does not end the output before (vLLM's "
        "min_tokens; at most --max-tokens)",
    )


def add_chat_arguments(p: argparse.ArgumentParser) -> None:
    _add_common(p, max_tokens=1024)
    p.set_defaults(min_tokens=0)  # `run`'s --min-tokens, which chat has no flag for


# --- shared plumbing ---------------------------------------------------------------------------------------


def _bar(total: int | None, desc: str, err: TextIO, unit: str = "tok"):
    """A tqdm bar on a terminal that only appears for work lasting over a second; None elsewhere."""
    if not err.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=err, delay=1.0, leave=False, mininterval=0.25)


def check_model_path(path: str | None) -> None:
    """None means the demo model; anything else must be a regular file or a checkpoint directory."""
    if path is None:
        return
    if not str(path).strip():
        raise FastarError("-m/--model is empty: give a .fst file or checkpoint directory (omit -m for the demo)")
    p = Path(path)
    if not p.exists():
        raise FastarError(f"{path}: no such file")
    if not (p.is_file() or p.is_dir()):  # a FIFO or device would block or stream forever
        raise FastarError(f"{path}: not a regular file or checkpoint directory")


def open_engine(args: argparse.Namespace, err: TextIO | None = None, warm: bool = False, source=None):
    """Load `args.model` (or the demo) with a progress bar, and apply `--ctx-size`. `warm` (a server, a chat): the
    expert warm-up starts as the load does (following the usage profile in `args.prompt_cache`), and the tokenizer's
    tables are built now, so the first reply pays for neither (docs/SERVING.md, start-up). `source`: `args.model`
    already opened (`open_source`: `serve` opens it before it binds its port, so a bad file is one line). `err`: the
    progress bar's stream (None: sys.stderr as it is at the call, not as it was when this module was imported)."""
    err = err if err is not None else sys.stderr
    from .engine.engine import load
    from .engine.source import open_source

    path = args.model
    check_model_path(path)
    check_sizes(args)
    if path is None:
        from .demo import BANNER, ensure_demo_model

        print(BANNER, file=err, flush=True)
        path = ensure_demo_model(log=lambda msg: print(msg, file=err, flush=True))
    t = time.perf_counter()
    source = source if source is not None else open_source(path)
    bar = _bar(len(source.names()), "loading", err, unit="tensor")
    if bar is not None:  # count resident tensors as the model reads them (an instance attribute shadows the method)
        read = source.tensor
        source.tensor = lambda name: (bar.update(1), read(name))[1]
    try:
        engine = load(
            source,
            numerics=args.numerics,
            threads=args.threads or None,
            draft=args.draft,
            warm_experts=(args.prompt_cache or True) if warm else False,
            **memory_options(args),
        )
    except OptionError as e:  # in the words of the flags given, not of load()'s keywords
        raise e.as_flags(LOAD_FLAGS) from None
    finally:
        if bar is not None:
            del source.tensor
            bar.close()
    if args.ctx_size:
        try:
            engine.context_length = args.ctx_size
        except ConfigError as e:  # in the words of the flag given
            engine.close()
            raise ConfigError(f"-c/--ctx-size: {e}") from None
    tok_vocab, model_vocab = engine.tokenizer.vocab_size, engine.config.vocab_size
    if tok_vocab > model_vocab:
        engine.close()  # its warm-up stops reading
        raise FastarError(
            f"{path}: the model's vocabulary has {model_vocab} tokens but the tokenizer's has "
            f"{tok_vocab}, so text cannot be fed to it (a small test model? `fastar fixture --preset vocab`, "
            f"or `fastar synth` at its default --vocab 129280, writes one that runs text)"
        )
    if args.verbose:
        cfg = engine.config
        print(
            f"fastar: loaded {path} in {time.perf_counter() - t:.1f} s: {counted(cfg.num_hidden_layers, 'layer')}, "
            f"hidden {cfg.hidden_size}, {counted(cfg.n_routed_experts, 'expert')}, vocab {cfg.vocab_size}, context "
            f"{engine.context_length}",
            file=err,
        )
    if warm:
        engine.tokenizer.prepare()
    return engine


def sampling_params(args: argparse.Namespace, stop: list[str] | None = None, thinking: bool = False):
    """`thinking`: the reply opens with reasoning, which the stop strings do not match (only the answer)."""
    from .engine.sampling import SamplingParams

    if args.min_tokens > args.max_tokens:  # said of the flags, not of the API's min_tokens field
        raise FastarError(
            f"--min-tokens {args.min_tokens} is larger than --max-tokens {args.max_tokens}: the output cannot be "
            "that long"
        )
    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temp,
        top_p=args.top_p,
        top_k=args.top_k,
        min_p=args.min_p,
        seed=args.seed,
        stop=stop or [],
        min_tokens=args.min_tokens,
        thinking=thinking,
    )


def _timed(what: str, n: int, seconds: float, more: str = "") -> str:
    """`what N tokens in S s (R tok/s[; more])`; without the time and rate when nothing ran (no rate over zero)."""
    if not n or seconds <= 0:
        return f"{what} {counted(n, 'token')}"
    return f"{what} {counted(n, 'token')} in {seconds:.2f} s ({n / seconds:.1f} tok/s{more})"


def timings_line(before: dict, after: dict) -> str:
    """One line: this request's (or, over many, these requests') prompt, prefill speed, the tokens generated and the
    decode speed, and the expert cache hit rate when there is one. A reply's first token comes out of its prefill,
    so `-n 1` (or a reply that ends at once) runs no decode step: the line then says so instead of a rate over
    zero tokens. The decode speed counts the tokens the decode steps wrote, not the rejected drafts their verify
    passes ran."""
    d = {k: after[k] - before.get(k, 0) for k in after if isinstance(after[k], (int, float))}
    pre_n, pre_s = d.get("prefill_tokens_computed", 0), d.get("prefill_seconds", 0.0)
    dec_n, dec_s = d.get("decode_tokens_computed", 0), d.get("decode_seconds", 0.0)
    generated, many = d.get("generated_tokens", 0), d.get("requests", 1) > 1
    # a verify pass runs its drafts' positions too; the rejected ones wrote no token, so the rate counts the
    # tokens written (each pass writes its accepted drafts and one token of its own)
    rejected = d.get("draft_tokens_verified", 0) - d.get("draft_tokens_accepted", 0)
    written = dec_n - rejected
    parts = [
        f"prompt {counted(d.get('prompt_tokens', 0), 'token')} ({d.get('cached_tokens', 0)} reused)",
        _timed("prefill", pre_n, pre_s),
    ]
    if written > 0:
        first = "the first of each reply by its prefill" if many else "the first by the prefill"
        more = (
            f"; {counted(dec_n, 'position')} run, {counted(rejected, 'rejected draft')} among them" if rejected else ""
        )
        parts += [f"generated {counted(generated, 'token')} ({first})", _timed("decode", written, dec_s, more)]
    elif generated:
        parts.append(f"generated {counted(generated, 'token')} (by the prefill{'s' if many else ''}; no decode step)")
    else:
        parts.append("generated 0 tokens")
    hits, misses = d.get("expert_cache_hits"), d.get("expert_cache_misses")
    if hits is not None and misses is not None and hits + misses:
        parts.append(f"expert cache hit rate {100 * hits / (hits + misses):.1f}%")
    else:
        parts.append("expert cache: n/a")
    return "timings: " + "; ".join(parts)


def draft_line(before: dict, after: dict) -> str | None:
    """One line on speculative decoding since `before` (None without a draft): acceptance, tokens per verify
    pass, and the speedup estimated against one plain pass per token; no rate over no draft or pass (`-n 1`: the
    one token comes out of the prefill, nothing was drafted)."""
    mode = after.get("draft_mode", "none")
    if mode == "none":
        return None
    d = {k: after[k] - before.get(k, 0) for k in after if k.startswith("draft_") and isinstance(after[k], (int, float))}
    drafted, accepted, passes = (
        d.get("draft_tokens_verified", 0),
        d.get("draft_tokens_accepted", 0),
        d.get("draft_verify_passes", 0),
    )
    plain = d.get("draft_plain_steps", 0)
    parts = [f"{100 * accepted / drafted:.1f}% of {counted(drafted, 'draft')} accepted" if drafted else "no draft"]
    if passes:
        parts.append(f"{(accepted + passes) / passes:.2f} tokens per verify pass")
    parts.append(counted(plain, "plain step"))
    if "draft_est_speedup" in after and (passes or plain):  # a ratio: the running value, not a difference
        parts.append(f"est. speedup {after['draft_est_speedup']:.2f}x")
    return f"draft {mode}: " + "; ".join(parts)


class _Writer:
    """Routes reasoning and content to their streams, dimming reasoning on a terminal."""

    def __init__(self, out: TextIO, reasoning_out: TextIO) -> None:
        self.out, self.rout = out, reasoning_out
        self.dim = styled(reasoning_out)
        self.last = {id(out): "\n", id(reasoning_out): "\n"}
        self.kind = "content"

    def write(self, kind: str, text: str) -> None:
        if not text:
            return
        if self.kind == "reasoning" and kind == "content":  # the answer starts on its own line
            self.end_line(self.rout)
        self.kind = kind
        f = self.rout if kind == "reasoning" else self.out
        f.write(f"{DIM}{text}{RESET}" if kind == "reasoning" and self.dim else text)
        f.flush()
        self.last[id(f)] = text[-1]

    def end_line(self, f: TextIO) -> None:
        if self.last.get(id(f), "\n") != "\n":
            f.write("\n")
            f.flush()
            self.last[id(f)] = "\n"


def _stream_reply(
    engine,
    prompt: str,
    params,
    thinking: bool | None,
    writer: _Writer,
    err: TextIO,
    session=None,
    cancel: threading.Event | None = None,
):
    """Stream one reply; `thinking` None = raw text (no parsing). Returns (parsed completion | None, last chunk)."""
    parser = StreamParser(thinking) if thinking is not None else None
    bar = _bar(None, "prefill", err)

    def progress(done: int, total: int) -> None:
        if bar is not None:
            bar.total = total
            bar.update(done - bar.n)

    last = None
    try:
        for chunk in engine.stream(prompt, params, session=session, cancel=cancel, on_prefill_progress=progress):
            if bar is not None and chunk.token is not None:
                bar.close()
                bar = None
            last = chunk
            for kind, text in parser.feed(chunk.text) if parser else [("content", chunk.text)]:
                writer.write(kind, text)
    finally:
        if bar is not None:
            bar.close()
    done = None
    if parser is not None:
        for kind, text in parser.flush():
            writer.write(kind, text)
        done = parser.finish()
    if last is not None and last.finish_reason == "length" and last.usage["completion_tokens"] < params.max_tokens:
        # the context ended the reply, not -n: say so, or it reads as a reply that was complete
        writer.end_line(writer.out)
        writer.end_line(err)
        print(
            f"fastar: the reply stopped at the end of the context ({engine.context_length} tokens; -c/--ctx-size)",
            file=err,
        )
    return done, last


# --- fastar run --------------------------------------------------------------------------------------------


def _read_prompt(args: argparse.Namespace) -> str:
    prompt = args.prompt
    if (prompt is None or prompt == "-") and sys.stdin is None:
        raise FastarError("no prompt: standard input is closed; pass -p/--prompt TEXT")
    if prompt is None and not sys.stdin.isatty():
        prompt = "-"
    if prompt is None:
        raise FastarError("no prompt: pass -p/--prompt TEXT (or pipe it on stdin)")
    if prompt == "-":
        try:
            prompt = sys.stdin.read(MAX_STDIN_PROMPT + 1)
        except UnicodeDecodeError as err:
            byte = err.object[err.start]
            raise FastarError(f"standard input is not UTF-8 text: byte 0x{byte:02x} at offset {err.start}") from None
        if len(prompt) > MAX_STDIN_PROMPT:  # `yes | fastar run`, `< /dev/zero`: never read to the end of memory
            raise FastarError(f"the prompt on standard input is longer than {MAX_STDIN_PROMPT:,} characters")
    if not prompt.strip():
        raise FastarError("the prompt is empty")
    check_text(prompt, "the prompt")  # the tokenizer's text boundary, before the model loads
    if args.system is not None:
        check_text(args.system, "--system")
    return prompt


def cmd_run(args: argparse.Namespace) -> int:
    from .engine.generate import chat_prompt

    out, err = sys.stdout, sys.stderr
    if args.raw and (args.system is not None or args.thinking):
        # they shape the chat encoding, which --raw skips: taken without a word, they changed nothing
        flag = "--system" if args.system is not None else "--thinking"
        raise FastarError(f"{flag} has no effect with --raw (the prompt is sent as-is, without the chat encoding)")
    prompt = _read_prompt(args)
    # bad values fail before the load; --stop matches the answer only, after the reasoning (--thinking)
    params = sampling_params(args, [args.stop] if args.stop else None, bool(args.thinking))
    engine = open_engine(args, err)
    if args.raw:
        text, thinking = prompt, None
    else:
        messages = [{"role": "system", "content": args.system}] if args.system else []
        text, thinking = chat_prompt(messages + [{"role": "user", "content": prompt}], args.thinking), args.thinking
    writer = _Writer(out, err)
    before = engine.stats()
    try:
        _, last = _stream_reply(engine, text, params, thinking, writer, err)
    except KeyboardInterrupt:  # Ctrl-C: what ran so far is timed too (as llama.cpp prints its timings), then 130
        writer.end_line(err)
        writer.end_line(out)
        print(timings_line(before, engine.stats()), file=err)
        raise
    writer.end_line(err)
    writer.end_line(out)
    after = engine.stats()
    if args.verbose and last is not None:
        print(f"finish_reason: {last.finish_reason}; usage: {last.usage}", file=err)
    print(timings_line(before, after), file=err)
    if args.verbose and (line := draft_line(before, after)):
        print(line, file=err)
    return 0


# --- fastar chat -------------------------------------------------------------------------------------------


def _path_argument(arg: str) -> str:
    """A /save or /load path as a shell would read it: one pair of quotes around it dropped (a path with spaces),
    a leading `~` the home folder."""
    if len(arg) >= 2 and arg[0] == arg[-1] and arg[0] in "'\"":
        arg = arg[1:-1]
    return home_path(arg)


class ChatREPL:
    """The interactive chat over one session. Front-end only: `handle(line)` runs one input line."""

    def __init__(
        self,
        engine,
        params,
        thinking: bool = False,
        system: str | None = None,
        out: TextIO | None = None,
        err: TextIO | None = None,
        verbose: bool = False,
        prompt_cache=None,
    ) -> None:
        out = out if out is not None else sys.stdout  # the streams at the call, not at this module's import
        err = err if err is not None else sys.stderr
        self.engine, self.params, self.thinking = engine, params, thinking
        self.prompt_cache = prompt_cache  # a PrefixCache: a new chat that starts like a saved one resumes from it
        self.system = system
        self.out, self.err, self.verbose = out, err, verbose
        self.session = engine.open_session()
        self.messages: list[dict] = self._start()
        self.cancel = threading.Event()
        self.writer = _Writer(out, out)
        self.interactive = True  # `run` sets it from stdin: on a terminal or from a pipe/file
        self.failures = 0  # turns and commands that failed (from a pipe, the chat then exits 1)

    def _start(self) -> list[dict]:
        return [{"role": "system", "content": self.system}] if self.system else []

    def say(self, text: str) -> None:
        print(text, file=self.out, flush=True)

    def fail(self, message: object, what: str = "error") -> None:
        """A turn, /save or /load failed: `(what: message)` in the chat on a terminal; from a pipe or file, one
        `fastar: error: ...` line on stderr. The chat goes on either way; from a pipe it then exits 1 (`run`)."""
        self.failures += 1
        if self.interactive:
            self.say(f"({what}: {message})")
        else:
            print(f"fastar: error: {'' if what == 'error' else what + ': '}{message}", file=self.err, flush=True)

    def handle(self, line: str) -> bool:
        """Run one input line (a message or a /command). Returns False when the chat should end."""
        line = line.strip()
        if not line:
            return True
        try:
            check_text(line, "the message")
        except InvalidText as e:
            self.fail(e)
            return True
        if not line.startswith("/"):
            self.reply(line)
            return True
        cmd, _, arg = line.partition(" ")
        arg = arg.strip()
        if cmd in ("/exit", "/quit", "/bye"):
            return False
        if cmd == "/help":
            self.say(CHAT_HELP)
        elif cmd in ("/reset", "/clear"):
            self.session.reset()
            self.messages = self._start()
            self.say("(conversation reset)")
        elif cmd == "/thinking":
            if arg and arg not in ("on", "off"):
                self.fail(f"/thinking {arg}: use /thinking on|off")
            elif not arg:
                self.say(f"(thinking is {'on' if self.thinking else 'off'}; use /thinking on|off)")
            else:
                self.thinking = arg == "on"
                self.say(f"(thinking {arg})")
        elif cmd == "/save":
            force = arg == "--force" or arg.startswith("--force ")
            arg = arg.removeprefix("--force").strip() if force else arg
            if not arg:  # from a pipe a command that did nothing fails the chat as a failed turn does
                self.fail("usage: /save [--force] FILE")
            else:
                self.session.meta = {"messages": self.messages, "thinking": self.thinking}
                target = _path_argument(arg)
                model = self.engine.source.path
                try:  # never renamed over the model in use; an unwritable path: said, and the chat goes on
                    # (no flag: `cannot save: PATH: ...` names the command, as the session's own errors read)
                    refuse_inputs_as_output(target, [(f, "a file of the model in use") for f in model_files(model)])
                    refuse_existing_output(target, force, "", hint=f"/save --force {arg} replaces it")
                    path = self.session.save(target)
                except FastarError as e:
                    self.fail(e, "cannot save")
                    return True
                held = f"{counted(len(self.messages), 'message')}, {counted(self.session.num_tokens, 'token')}"
                self.say(f"(saved {held} to {path})")
        elif cmd == "/load":
            if not arg:
                self.fail("usage: /load FILE")
            else:
                try:
                    self.session.load(_path_argument(arg))
                except FastarError as e:
                    self.fail(e, "cannot load")
                    return True
                self.messages = list(self.session.meta.get("messages", []))
                self.thinking = bool(self.session.meta.get("thinking", self.thinking))
                held = f"{counted(len(self.messages), 'message')}, {counted(self.session.num_tokens, 'token')}"
                self.say(f"(loaded {held})")
        elif cmd == "/stats":  # the timings line's words first, then every counter (seconds and rates unrounded
            stats = self.engine.stats()  # to a tenth: 0.004 s of prefill said 0.0)
            self.say(timings_line({}, stats).replace("timings:", "so far:"))
            self.say(
                "details: "
                + " ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                    for k, v in stats.items()
                    if isinstance(v, (int, float))
                )
            )
        else:
            self.fail(f"unknown command {cmd}; /help lists them")
        return True

    def _resume_from_cache(self, prompt: str) -> int:
        """Take the prompt cache's longest stored prefix of `prompt` when it beats what the session holds.
        Returns the prompt's length in tokens."""
        from .engine.session import common_prefix

        ids = self.session.encode_prompt(prompt)
        held = min(common_prefix(self.session.tokens, ids), self.session.num_processed)
        hit = self.prompt_cache.lookup(ids, len(ids) - 1, better_than=held)
        if hit is not None:
            state, n = hit
            self.session.resume(ids[:n], state)
        return len(ids)

    def _save_to_cache(self, prompt_len: int) -> None:
        """Store the state at the end of this turn's reply and, rolled back, at the end of its prompt (the prefix
        a later chat that starts the same way resends)."""
        from .model.state import StateError

        done = self.session.processed()
        if done is None:
            return
        tokens, state = done
        self.prompt_cache.store(tokens, state)
        if 0 < prompt_len < len(tokens):
            snap = state.snapshot()
            try:
                snap.truncate(prompt_len)
            except StateError:  # a reply longer than the state's rollback: only its end is kept
                return
            self.prompt_cache.store(tokens[:prompt_len], snap)

    def reply(self, text: str) -> None:
        """Send one user message and stream the reply. A cancelled reply is kept as far as it went."""
        from .engine.generate import chat_prompt

        self.messages.append({"role": "user", "content": text})
        self.cancel.clear()
        before = self.engine.stats()
        try:
            prompt = chat_prompt(self.messages, self.thinking)
            prompt_len = self._resume_from_cache(prompt) if self.prompt_cache is not None else 0
            parsed, last = _stream_reply(
                self.engine,
                prompt,
                self.params,
                self.thinking,
                self.writer,
                self.err,
                session=self.session,
                cancel=self.cancel,
            )
        except FastarError as e:  # e.g. the conversation outgrew the context: say so and keep the chat
            self.messages.pop()
            self.writer.end_line(self.out)
            self.fail(e)
            return
        self.writer.end_line(self.out)
        if self.prompt_cache is not None:
            self._save_to_cache(prompt_len)
        cancelled = last is not None and last.finish_reason == "cancelled"
        if cancelled:
            self.say("(stopped)")
        if cancelled and not parsed.content and not parsed.reasoning:
            self.messages.pop()  # nothing came back: as if the message was never sent
        else:
            self.messages.append(parsed.to_message())
        if self.verbose:
            after = self.engine.stats()
            print(timings_line(before, after), file=self.err, flush=True)
            if line := draft_line(before, after):
                print(line, file=self.err, flush=True)

    def run(self, read: Callable[[str], str] | None = None) -> int:
        """The loop: Ctrl-C while a reply streams stops it; at the prompt it only reminds how to quit. `read`:
        `input` on a terminal, `stdin_line` from a pipe or file. Returns the exit status: 0, or from a pipe or
        file 1 when any turn or command failed (a script must see it; on a terminal the chat said so)."""
        self.interactive = sys.stdin.isatty()
        prompt = ">>> " if self.interactive else ""
        if read is None:
            read = input if self.interactive else stdin_line
        if self.interactive:  # from a pipe stdout keeps the replies (and what commands report) alone
            self.say("fastar chat: /help for commands, Ctrl-C stops a reply, Ctrl-D or /exit quits.")
        while True:
            try:
                line = read(prompt)
            except UnicodeDecodeError as e:  # stdin decoded strictly: the line is lost, the chat goes on
                self.fail(f"the input is not UTF-8 text: {e.reason}")
                continue
            except EOFError:
                if self.interactive:  # Ctrl-D: off the prompt's line
                    self.say("")
                return self._status()
            except KeyboardInterrupt:
                self.say("\n(Ctrl-D or /exit to quit)")
                continue
            previous = signal.signal(signal.SIGINT, lambda *_: self.cancel.set())
            try:
                if not self.handle(line):
                    return self._status()
            finally:
                signal.signal(signal.SIGINT, previous)

    def _status(self) -> int:
        return 1 if self.failures and not self.interactive else 0


def stdin_line(prompt: str = "") -> str:
    """`input` for a pipe or file: one line, at most MAX_STDIN_PROMPT characters (`< /dev/zero` has no line end
    to read up to). A longer one is an error that ends the chat: what follows it cannot be told apart."""
    line = sys.stdin.readline(MAX_STDIN_PROMPT + 1)
    if not line:
        raise EOFError
    if len(line) > MAX_STDIN_PROMPT:
        raise FastarError(f"a line on standard input is longer than {MAX_STDIN_PROMPT:,} characters")
    return line.removesuffix("\n")


def cmd_chat(args: argparse.Namespace) -> int:
    if sys.stdin is None:  # `fastar chat <&-`: nothing to read the conversation from
        raise FastarError("standard input is closed: fastar chat reads the conversation from it")
    if args.system is not None:
        check_text(args.system, "--system")
    params = sampling_params(args)
    # the budget's worth of experts read into RAM while the model loads and the user types (following the usage
    # profile saved beside the prompt cache when the last chat or server on this model closed), so the first reply
    # runs warm too
    engine = open_engine(args, sys.stderr, warm=True)
    try:
        import readline  # noqa: F401  line editing and up-arrow history for input()
    except ImportError:
        pass
    cache = engine.open_prefix_cache(args.prompt_cache, args.prompt_cache_size) if args.prompt_cache else None
    repl = ChatREPL(
        engine,
        params,
        thinking=args.thinking,
        system=args.system,
        out=sys.stdout,
        err=sys.stderr,
        verbose=args.verbose,
        prompt_cache=cache,
    )
    try:
        code = repl.run()
        stats = engine.stats()
        if stats.get("prompt_tokens"):  # no totals of zeros where no turn ran (empty input, commands alone)
            print(timings_line({}, stats).replace("timings:", "session totals:"), file=sys.stderr)
        if code:  # the last line says why the status is 1, as every failing command's does
            n = repl.failures
            print(f"fastar: error: {counted(n, 'line')} of the input failed (see above)", file=sys.stderr)
    finally:
        engine.close()  # stops the warm-up and saves the usage profile for the next start
    return code
