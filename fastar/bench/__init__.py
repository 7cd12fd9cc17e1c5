"""Every benchmark, and the `fastar bench ...` command that runs them.

Owns: the `bench` subcommand's arguments (`add_arguments`) and its dispatch (`main`) to
- `model.py`: end-to-end prefill/decode tokens/s against the ceiling measured in the same run (`bench -m FILE`);
- `kernels.py`: the quantized products' GB/s against this machine's memory bandwidth (`bench kernels`);
- `profile.py`: where a decode step's time goes, by kernel category and outside the kernels (`bench --profile`);
- `profile_prefill.py`: the same for a prefill of T tokens, with the products' GFLOP/s (`bench --profile-prefill`);
- `speculative.py`: decode with and without speculative decoding under expert-cache pressure (`bench draft`);
- `cache.py`: the expert cache against the disk over routing traces, the policy simulator, disk probes (Python).
Does not own anything that runs in production: the engine, the pager and the kernels only get measured here.
How to measure honestly: docs/PERFORMANCE.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import json

from .. import console
from ..config import float_flag, int_flag
from ..errors import FastarError


def _thread_list(v: str) -> str:
    parts = v.split(",")
    if not all(p.strip().isdigit() and 1 <= int(p) <= console.MAX_THREADS for p in parts):
        raise argparse.ArgumentTypeError(f"--threads takes comma-separated counts 1..{console.MAX_THREADS}, got {v!r}")
    return v


def _stream_list(v: str) -> str:
    parts = v.split(",")
    if not all(p.strip().isdigit() and 1 <= int(p) <= 1024 for p in parts):
        raise argparse.ArgumentTypeError(f"--streams takes comma-separated stream counts 1..1024, got {v!r}")
    return v


def add_arguments(b: argparse.ArgumentParser) -> None:
    b.add_argument(
        "what",
        nargs="?",
        default="model",
        choices=["model", "kernels", "draft"],
        help="model (the default; needs -m): prefill/decode tokens/s, hit rate and peak RSS against the ceiling "
        "measured in the same run; kernels: the quantized products' GB/s against this machine's memory bandwidth; "
        "draft: decode speed with and without speculative decoding against expert-cache size",
    )
    b.add_argument(
        "-m",
        "--model",
        type=console.home_path,
        default=None,
        help=".fst file or checkpoint directory to benchmark end to end",
    )
    b.add_argument("--json", action="store_true", help="print one JSON object")
    b.add_argument(
        "--threads",
        default=None,
        type=_thread_list,
        help="CPU threads of the kernels: one count for a model benchmark (default: every CPU this process may use); "
        "kernels: comma-separated counts, each timed; bench draft runs on one thread and takes none",
    )
    console.add_draft_argument(b)
    console.add_memory_arguments(b)
    b.add_argument(
        "--prompt-tokens",
        type=int_flag(1, None, "--prompt-tokens"),
        default=None,
        help="model, --streams, --profile and draft: prompt length to prefill (default 64; bench draft: 24)",
    )
    b.add_argument(
        "--decode-tokens",
        type=int_flag(1, None, "--decode-tokens"),
        default=None,
        help="model: tokens to decode, timed (default 16; with --draft or --replay at least 2, with "
        "--streams N,M at least the largest N + 1: a reply's first token comes out of its prefill, the decode steps "
        "after it are timed); --profile: the steps profiled; bench draft: tokens per prompt (default 64, at least 2)",
    )
    b.add_argument(
        "--repeats",
        type=int_flag(1, None, "--repeats"),
        default=None,
        help="model: time the decode this many times in a row, each against the memory bandwidth measured around it "
        "(the host's memory speed moves; default 1); --profile-prefill: the runs profiled (default 1); bench draft: "
        "the runs of every mode, interleaved, of which the median is printed (default 3)",
    )
    b.add_argument(
        "--warmup-tokens",
        type=int_flag(0, None, "--warmup-tokens"),
        default=8,
        help="model: untimed decode steps after the prompt, so the expert cache settles first (default %(default)s)",
    )
    b.add_argument(
        "--temperature",
        type=float_flag(0, 100, "a temperature"),
        default=0.0,
        help="model: sample the timed decode at this temperature (0, the default: greedy). Without --top-p "
        "the steps screen the LM head for the rows that can win the draw, as greedy ones do; with --top-p below 1 "
        "they read the full head, and the ceiling counts it",
    )
    b.add_argument(
        "--top-p",
        type=float_flag(0, 1, "top-p", open_lo=True),
        default=1.0,
        help="model: with --temperature, the nucleus to sample from",
    )
    b.add_argument(
        "--replay",
        type=float,
        default=None,
        metavar="A",
        help="model: also decode speculatively with drafts replayed from the plain run, each right with "
        "probability A (what a trained draft gives; synthetic models' own drafts are random)",
    )
    b.add_argument(
        "--policies",
        default=None,
        help="model: run every budget with each of these eviction policies, e.g. lrfu,lru",
    )
    b.add_argument(
        "--reference",
        default=None,
        help="model: checkpoint dir to time transformers on too",
    )
    b.add_argument(
        "--compare-transformers",
        metavar="DIR",
        default=None,
        help="model: load this checkpoint dir (the same weights) into transformers in bfloat16 and print "
        "both engines' prefill and decode from one run",
    )
    b.add_argument(
        "--compare",
        default=None,
        help="model: another source of the same model (a checkpoint "
        "directory or .fst) to benchmark the same way, side by side",
    )
    b.add_argument(
        "--streams",
        default=None,
        type=_stream_list,
        metavar="N,N",
        help="model: N concurrent greedy streams through the batch scheduler, e.g. 1,2,4,8 (aggregate "
        "and per-stream tok/s, inter-token latency, identical_to_solo, the batched ceiling)",
    )
    b.add_argument(
        "--profile",
        default=None,
        metavar="N,N",
        help="model: where a decode step's time goes with N rows (1 to 8), e.g. 1,4: weight products by type, "
        "attention, routing, mHC, norms, sampling and the time outside any kernel, adding up to the step",
    )
    b.add_argument(
        "--profile-prefill",
        default=None,
        metavar="T,T",
        help="model: where a prefill's time goes for prompts of T tokens, e.g. 64,512: weight products by type "
        "(with their GFLOP/s against the bf16 dot peak), attention, mHC, norms, RoPE, activation rounding and the "
        "time outside any kernel, adding up to the prefill (--repeats runs each)",
    )
    b.add_argument(
        "--plot",
        default=None,
        help="model: PNG of tokens/s and hit rate against --ram-budget A,B,C (an existing file is refused before the "
        "benchmark starts unless --force)",
    )
    b.add_argument(
        "--force",
        action="store_true",
        help="replace an existing --plot file (the old one stays until the new one is written whole)",
    )


# The flags each benchmark reads, besides `what`, --json and --threads (`bench kernels` reads those two alone): a
# flag given to a benchmark that does not read it is a usage error naming both (it was taken and ignored: `bench
# draft --decode-tokens 8` decoded 64 tokens, `--profile 1 --streams 4` ran the profile alone). `model` is the
# plain model bench, which reads every other flag; a dest here names a flag as `_FLAG_NAMES` spells it.
_ENGINE = frozenset({"model", "ram_budget", "head_screen", "cache_policy", "direct_io", "lookahead", "verify"})
_READS = {
    "kernels": frozenset(),
    "draft": frozenset({"model", "ram_budget", "head_screen", "draft", "prompt_tokens", "decode_tokens", "repeats"}),
    "--profile": _ENGINE | {"profile", "prompt_tokens", "decode_tokens"},
    "--profile-prefill": _ENGINE | {"profile_prefill", "repeats"},
    "--streams": _ENGINE | {"streams", "prompt_tokens", "decode_tokens"},
}
_WHY = {  # why a benchmark does not read a flag, where it is not plain from the benchmark's name
    ("draft", "threads"): "it runs on one thread and times CPU time",
    ("draft", "replay"): "it runs replay:0.5 and replay:0.8 itself",
    ("draft", "temperature"): "it decodes greedily",
    ("draft", "top_p"): "it decodes greedily",
    ("--streams", "temperature"): "the streams decode greedily",
    ("--streams", "top_p"): "the streams decode greedily",
}
_FLAG_NAMES = {"model": "-m", "verify": "--no-verify"}
_NAMES = {
    "--profile": "the decode-step profile",
    "--profile-prefill": "the prefill profile",
    "--streams": "the streams bench",
}
# bench draft's own counts where its flags are not given: two prompts of 24 tokens, 64 decoded, 3 repeats (the
# draft modes' acceptance needs more tokens than the model bench's 16)
DRAFT_COUNTS = {"prompt_tokens": 24, "decode_tokens": 64, "repeats": 3}


def _flag(dest: str) -> str:
    return _FLAG_NAMES.get(dest, "--" + dest.replace("_", "-"))


def bench_mode(a: argparse.Namespace) -> str:
    """Which benchmark the flags select: `kernels`, `draft`, `--profile`, `--profile-prefill`, `--streams` or
    `model` (the plain model bench)."""
    if a.what != "model":
        return a.what
    for flag in ("--profile", "--profile-prefill", "--streams"):
        if getattr(a, flag[2:].replace("-", "_")) is not None:
            return flag
    return "model"


def counts(a: argparse.Namespace) -> tuple[int, int, int]:
    """(--prompt-tokens, --decode-tokens, --repeats) as the benchmark reads them: given, or its default (`bench
    draft`'s own, `DRAFT_COUNTS`; the flags' defaults are None so that a count given is told from one not)."""
    own = DRAFT_COUNTS if a.what == "draft" else {"prompt_tokens": 64, "decode_tokens": 16, "repeats": 1}
    prompt, decode, repeats = (own[k] if getattr(a, k) is None else getattr(a, k) for k in own)
    return prompt, decode, repeats


def _unread_flag(a: argparse.Namespace, given: frozenset[str]) -> str | None:
    """A usage message for the first flag given that the selected benchmark does not read, else None."""
    mode = bench_mode(a)
    if mode == "model":
        if "force" in given and a.plot is None:
            return "argument --force: it replaces an existing --plot file: give --plot too, or drop --force"
        return None
    modes = [f for f in ("--profile", "--profile-prefill", "--streams") if f[2:].replace("-", "_") in given]
    if mode not in ("kernels", "draft") and len(modes) > 1:
        return f"argument {modes[1]}: not with {modes[0]} (one benchmark a run: run them one after the other)"
    reads = _READS[mode] | {"json", "threads"} - ({"threads"} if mode == "draft" else set())
    if mode in _NAMES and "ram_budget" in given and "," in str(a.ram_budget):  # a budget list is the model bench's
        return (
            f"argument --ram-budget: one budget with {mode} (it loads one engine; a list is for the model bench), "
            f"got {a.ram_budget!r}"
        )
    for dest in vars(a):  # in the parser's order
        if dest in given and dest not in reads:
            why = _WHY.get((mode, dest))
            if mode in ("kernels", "draft"):
                return f"argument {_flag(dest)}: bench {mode} does not read it" + (f" ({why})" if why else "")
            return f"argument {_flag(dest)}: not with {mode} ({why or _NAMES[mode] + ' does not read it'})"
    return None


def check_arguments(a: argparse.Namespace, given: frozenset[str]) -> str | None:
    """The flags together, after parsing (`given`: the dests given on the command line): a message for the first
    flag the selected benchmark would not read (`_READS`) or combination no benchmark can measure (the CLI says it
    as a usage error: one line naming the flag, exit 2), else None. A decode rate over zero tokens or calls
    was printed as 0.0 tok/s: `--streams 2 --decode-tokens 1` (each stream's one token comes out of its prefill, so
    no decode call ran) said "0.0 tok/s aggregate over 0 calls", and with 2 tokens it timed calls of one row as the
    rate of 2 streams; `--replay`/`--draft` with one token timed its speculative decode over no token."""
    if (message := _unread_flag(a, given)) is not None:
        return message
    _, decode_tokens, _ = counts(a)
    if a.what == "draft":
        if decode_tokens < 2:
            return (
                f"argument --decode-tokens: at least 2 with bench draft, got {decode_tokens} (each prompt's first "
                "token comes out of the prefill: the decode steps after it are what is timed)"
            )
        return None
    if a.what != "model":
        return None
    if a.profile is not None:
        from ..model.ops import SMALL_CHUNK  # the rows a decode step takes (torch: only when --profile is given)

        parts = a.profile.split(",")
        if not all(p.strip().isdigit() and 1 <= int(p) <= SMALL_CHUNK for p in parts):
            return f"argument --profile: comma-separated row counts 1..{SMALL_CHUNK}, got {a.profile!r}"
        return None
    if a.profile_prefill is not None:
        parts = a.profile_prefill.split(",")
        if not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
            return (
                "argument --profile-prefill: comma-separated prompt lengths (tokens, at least 1), "
                f"got {a.profile_prefill!r}"
            )
        return None
    if a.streams:
        # the scheduler prefills one prompt (within one chunk) a step, and a stream's first token comes out of its
        # prefill: the first stream has N tokens when the Nth gets its first, so all N decode together from its N+1th
        n = max(int(s) for s in a.streams.split(","))
        if decode_tokens < n + 1:
            return (
                f"argument --decode-tokens: at least {n + 1} with --streams {a.streams}, got {decode_tokens} (each "
                "stream's first token comes out of its prefill, one prompt a step: with fewer, no decode call "
                f"carries {'the stream' if n == 1 else f'all {n} streams'})"
            )
    elif (a.replay is not None or a.draft != "none") and decode_tokens < 2:
        what = "--replay" if a.replay is not None else f"--draft {a.draft}"
        return (
            f"argument --decode-tokens: at least 2 with {what}, got {decode_tokens} (the speculative run's first "
            "token comes out of the prefill: the decode steps after it are what is timed)"
        )
    return None


def _check_plot_target(plot: str) -> None:
    """The PNG is written after the whole benchmark (and before its table is printed): a name that cannot be
    written, or no matplotlib, is said now, not after minutes of work whose numbers would then be lost."""
    from ..outputs import refuse_unwritable_output

    refuse_unwritable_output(plot, "--plot", "the PNG")
    if importlib.util.find_spec("matplotlib") is None:
        raise FastarError("--plot needs matplotlib: pip install 'fastar[plot]' (or matplotlib)")


def _check_context(a: argparse.Namespace) -> None:
    """A benchmark prefills and decodes with the engine's forward directly, past the session's context check: a
    prompt longer than the model's positions (`--prompt-tokens 100000` on a 4,096-position model, `--profile-prefill
    100000000`) ran for hours or until memory gave out. Said before anything loads, naming the flags."""
    from ..engine.source import open_source

    if a.profile_prefill:
        parts = [p.strip() for p in a.profile_prefill.split(",")]
        need, what = max((int(p) for p in parts if p.isdigit()), default=0), "--profile-prefill"
    elif a.profile or a.streams or a.what == "draft":
        need, what = a.prompt_tokens + a.decode_tokens, "--prompt-tokens + --decode-tokens"
    else:  # the decode goes on from one state through the warm-up and every repeat
        need = a.prompt_tokens + a.warmup_tokens + a.decode_tokens * max(a.repeats, 1)
        what = "--prompt-tokens + --warmup-tokens + --decode-tokens x --repeats"
    with open_source(a.model) as src:
        limit = src.config.max_position_embeddings
    if need > limit:
        raise FastarError(f"{what} is {need:,} positions, more than the model's {limit:,}")


def _model_threads(a: argparse.Namespace) -> None:
    """--threads of a model benchmark (`bench -m`, `bench draft`): one count, the kernels' pool for the whole run, as
    `run --threads` sets it (it was taken and ignored: the run used every CPU and said so). `bench kernels` takes a
    list and times each count."""
    if a.what == "kernels" or not a.threads:
        return
    if "," in a.threads:
        raise FastarError(
            f"--threads: a model benchmark runs with one thread count, got {a.threads!r} "
            "(a list is for `fastar bench kernels`)"
        )
    from ..engine.build import set_threads

    set_threads(True, int(a.threads))


def main(a: argparse.Namespace) -> int:
    """Run the benchmark `a.what` names with the parsed arguments (`check_arguments` passed them)."""
    a.prompt_tokens, a.decode_tokens, a.repeats = counts(a)  # the benchmark's own defaults where none was given
    _model_threads(a)
    if a.what == "draft":
        if not a.model:
            raise FastarError("bench draft: give -m CHECKPOINT (a .fst file or checkpoint directory)")
        _check_context(a)
        from . import speculative

        modes = (
            "none",
            a.draft if a.draft != "none" else "auto",
            "replay:0.5",
            "replay:0.8",
        )
        rows = speculative.bench(
            a.model,
            drafts=modes,
            ram_budgets=speculative.ram_budgets(a.ram_budget),
            head_screen=a.head_screen,
            tokens=a.decode_tokens,
            prompt_tokens=a.prompt_tokens,
            reps=a.repeats,
        )
        print(json.dumps(rows) if a.json else speculative.format_bench(rows))
        return 0
    if a.what == "kernels":
        from . import kernels

        kernels.run(
            json_out=a.json,
            threads=[int(t) for t in a.threads.split(",")] if a.threads else None,
        )
        return 0
    if not a.model:
        raise FastarError("bench: give -m FILE (or `fastar bench kernels`)")
    if a.plot:  # written after minutes of benchmark: never over what it reads
        a.plot = console.home_path(a.plot)  # (written where it is checked: `~/curve.png` quoted is the home's)
        from ..outputs import model_files, refuse_existing_output, refuse_inputs_as_output

        sources = {
            "-m": a.model,
            "--compare": a.compare,
            "--reference": a.reference,
            "--compare-transformers": a.compare_transformers,
        }
        inputs = [
            (f, f"the {flag} model" if i == 0 else f"a file of the {flag} model")
            for flag, path in sources.items()
            for i, f in enumerate(model_files(path))
        ]
        refuse_inputs_as_output(a.plot, inputs, "--plot")
        refuse_existing_output(a.plot, a.force, "--plot")  # an earlier run's curve: not replaced unless --force
        _check_plot_target(a.plot)
    _check_context(a)
    if a.profile:
        from . import profile

        return profile.main(a)
    if a.profile_prefill:
        from . import profile_prefill

        return profile_prefill.main(a)
    if a.streams:
        from . import streams

        return streams.main(a)
    from . import model

    return model.main(a)
