"""The `fastar` command line: argparse subcommands that map flags 1:1 onto library calls.

Owns: argument parsing, `FASTAR_*` environment mirrors of flags, and turning errors into one clear line and a
non-zero exit. Does not own: any tensor code (commands import their implementation lazily, so `fastar --help`
and `fastar inspect` start fast and never import torch).
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator

from . import __version__
from .config import int_flag
from .console import home_path
from .errors import ConfigError, FastarError, OptionError, OutputError
from .words import counted


class UsageError(Exception):
    """A bad flag value found outside argparse (an environment mirror): one line, exit 2 like argparse's own."""


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("", "0", "false", "no", "off")


def _env_default(dest: str, default, convert=None, switch: bool = False):
    """Flags can be set by FASTAR_<FLAG> environment variables (the flag on the command line wins). A `switch`
    (a flag that takes no value: --verbose, --direct-io/--no-direct-io) reads 1/true/yes/on or 0/false/no/off."""
    name = "FASTAR_" + dest.upper()
    v = os.environ.get(name)
    if v is None:
        return default
    if switch or isinstance(default, bool):
        if v.strip().lower() not in _TRUE + _FALSE:  # never the string itself: "0" would be a true value
            raise UsageError(f"{name}={v!r}: expected 1/true/yes/on or 0/false/no/off")
        return v.strip().lower() in _TRUE
    try:
        if convert is not None:
            return convert(v)
        if isinstance(default, int):
            return int(v)
        if isinstance(default, float):
            return float(v)
    except (ValueError, argparse.ArgumentTypeError) as err:
        raise UsageError(f"{name}={v!r}: {err}") from None
    return v


def _did_you_mean(word: str, known) -> str:
    """` (did you mean X?)` for a misspelt flag or command, else nothing."""
    close = difflib.get_close_matches(word, list(known), n=1, cutoff=0.6)
    return f" (did you mean {close[0]}?)" if close else ""


class _Parser(argparse.ArgumentParser):
    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._given: list[str] = []  # the arguments of the last parse, for `error`
        self._checks: list[Callable[[argparse.Namespace, frozenset[str]], str | None]] = []

    def add_check(self, check: Callable[[argparse.Namespace, frozenset[str]], str | None]) -> None:
        """A check of this command's flags together, run once they are parsed: `check(args, given)`, `args` with the
        environment mirrors included, `given` the dests of the flags given on the command line (a mirror is a
        setting, not a flag given to this command). The message it returns is a usage error, one line and exit 2 as
        a bad flag value is; None passes."""
        self._checks.append(check)

    def _given_dests(self) -> frozenset[str]:
        """The dests of the flags the last parse's arguments gave (abbreviations, `--flag=value` and `--no-flag`
        included, as argparse reads them): they are parsed again into a namespace whose every flag holds a marker,
        which argparse leaves where no flag set it (its defaults fill only absent names)."""
        unset = object()
        flags = {x.dest for x in self._actions if x.option_strings}
        seen, _ = super().parse_known_args(self._given, argparse.Namespace(**dict.fromkeys(flags, unset)))
        return frozenset(d for d in flags if getattr(seen, d) is not unset)

    def error(self, message: str):
        """A usage error in one line (argparse's own prints the whole usage first), exit 2. A command's error about
        its positionals or its required flags gives way to a `--flag` it does not know: `bench --ram-budgt 1G` took
        1G for its positional and said `argument what: invalid choice: '1G'`; the misspelt flag is the mistake."""
        bad = re.match(r"argument COMMAND: invalid choice: '([^']*)'", message)
        if bad and self._subparsers is not None:
            commands = next(a for a in self._subparsers._group_actions if isinstance(a, argparse._SubParsersAction))
            message += _did_you_mean(bad.group(1), commands.choices)
        elif self._subparsers is None and not message.startswith(("argument -", "unrecognized arguments")):
            flag = self._unknown_flag()
            if flag is not None:
                message = f"unrecognized arguments: {flag}{_did_you_mean(flag, self._option_string_actions)}"
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        self._given = list(sys.argv[1:] if args is None else args)
        a, extra = super().parse_known_args(args, namespace)
        given = self._given_dests() if self._checks else frozenset()
        for check in self._checks:
            if (message := check(a, given)) is not None:
                self.error(message)
        return a, extra

    def _unknown_flag(self) -> str | None:
        """The first `--flag` given to this parser (before a `--`) that none of its flags is or begins with (argparse
        takes an unambiguous abbreviation), None when there is none."""
        for x in self._given:
            if x == "--":
                break
            name = x.split("=", 1)[0]
            if (
                name.startswith("--")
                and len(name) > 2
                and not any(o.startswith(name) for o in self._option_string_actions)
            ):
                return name
        return None

    def parse_args(self, args=None, namespace=None):
        """Flags no parser knows are said by the command's parser, which argparse leaves to the top one: `fastar run
        --tmp 0` said `fastar: error: unrecognized arguments: --tmp 0 (see fastar --help)`, a help without --temp;
        now `fastar run: error: ... (did you mean --temp?) (see fastar run --help)`."""
        a, extra = self.parse_known_args(args, namespace)
        if extra:
            parser = self
            if self._subparsers is not None and a.command is not None:
                commands = next(x for x in self._subparsers._group_actions if isinstance(x, argparse._SubParsersAction))
                parser = commands.choices[a.command]
            flags = [x.split("=", 1)[0] for x in extra if x.startswith("-")]
            hint = _did_you_mean(flags[0], parser._option_string_actions) if flags else ""
            if not flags and "-p" in parser._option_string_actions:  # `fastar run "Hello"`, as `ollama run` takes it
                hint = " (give the prompt with -p, quoted: -p 'TEXT')"
            parser.error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return a

    def add_argument(self, *args, **kw):
        act = super().add_argument(*args, **kw)
        if act.dest not in ("help", "version") and act.option_strings:
            convert = act.type if callable(act.type) else None
            act.default = _env_default(act.dest, act.default, convert, switch=act.nargs == 0)
            name = "FASTAR_" + act.dest.upper()
            if act.choices is not None and name in os.environ and act.default not in act.choices:  # as argparse
                choices = ", ".join(map(repr, act.choices))
                raise UsageError(f"{name}={os.environ[name]!r}: invalid choice (choose from {choices})")
            if act.required and os.environ.get("FASTAR_" + act.dest.upper()):
                act.required = False
        return act


def _path(text: str) -> str:
    """A file or directory argument: an empty one would mean the current directory (a fixture written into it, a
    traceback from convert), so it is a usage error."""
    if not text.strip():
        raise argparse.ArgumentTypeError("the path is empty")
    return home_path(text)  # `--output=~/x.fst` and a FASTAR_* mirror get no shell to expand `~`


_seed = int_flag(0, None, "a seed")  # numpy's generators take non-negative seeds only


def _decimal(n: float) -> str:
    """A byte count in decimal units (kB, MB, GB, TB), the units of the rates beside it (MB/s, GB/s) in `verify`,
    `convert`, `synth` and `bench`; `_human` says sizes in memory (`inspect`) in binary units, as `--ram-budget`
    reads them."""
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1000
    return f"{n:.1f} TB"


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


# --- commands ----------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _output_flag(flag: str) -> Iterator[None]:
    """The library's writers refuse an existing output (unless --force, passed on as `force`) or one they cannot
    write before any work, with an OutputError naming the path (`fastar.outputs`): the flag that gave it goes in
    front, `-o out.fst: already exists; ...`. One check, the library's."""
    try:
        yield
    except OutputError as e:
        raise e.named(flag) from None


def _add_force(p: argparse.ArgumentParser, what: str) -> None:
    p.add_argument(
        "--force",
        action="store_true",
        help=f"replace an existing {what} (without it, one is refused before any work; the old one stays until the "
        "new one is complete)",
    )


def cmd_convert(a) -> int:
    from .convert.hf import convert, convert_indexer

    if a.indexer_sidecar and not a.output.endswith(".fst.indexer"):  # where FstV2File looks; never over a model
        raise FastarError(
            f"--indexer-sidecar: name the output MODEL.fst.indexer, next to the FaStar v2 MODEL.fst "
            f"it completes (got {a.output})"
        )
    t = time.perf_counter()
    with _output_flag("-o"):  # refused before the checkpoint is read (or downloaded): ~160 GB on Flash
        out = (convert_indexer if a.indexer_sidecar else convert)(a.src, a.output, progress=a.progress, force=a.force)
    dt = time.perf_counter() - t
    size = os.path.getsize(out)
    print(f"wrote {out} ({_decimal(size)}) in {dt:.1f} s ({size / dt / 1e6:.0f} MB/s)")
    return 0


def cmd_export(a) -> int:
    from .config import parse_size
    from .convert.export import export

    t = time.perf_counter()
    try:
        shard = parse_size(a.shard_size)
    except ConfigError as e:  # one line naming the flag
        raise ConfigError(f"--shard-size: {e}") from None
    if not shard:
        raise FastarError(f"--shard-size: give a positive size such as 4G, got {a.shard_size!r}")
    with _output_flag("-o"):
        out = export(a.file, a.output, progress=a.progress, shard_size=shard, force=a.force)
    print(f"wrote {out} in {time.perf_counter() - t:.1f} s")
    return 0


def _not_special(path: str) -> None:
    """A FIFO or device would block or stream forever where a file is read."""
    if os.path.exists(path) and not (os.path.isfile(path) or os.path.isdir(path)):
        raise FastarError(f"{path}: not a regular file")


def cmd_verify(a) -> int:
    from .format.reader import FstFile

    _not_special(a.file)
    t = time.perf_counter()
    with FstFile(a.file) as f:
        n_t = len(f.header["tensors"])
        n_e = 0 if f.bank is None else f.bank["slots"] * f.bank["experts"]
        if f.bank is not None:  # a model file (not a sidecar): its tensors are its config's, or it cannot load
            from .convert.names import resident_mismatch

            why = resident_mismatch(f.header["tensors"], f.config)
            if why is not None:
                raise FastarError(f"{a.file}: {why}")
        if a.quick:
            records = counted(n_e, "expert record")
            print(f"{a.file}: structure OK ({counted(n_t, 'tensor')}, {records}; checksums not checked)")
            return 0
        bar = None
        if sys.stderr.isatty():
            from tqdm import tqdm

            bar = tqdm(
                total=f.file_size,
                unit="B",
                unit_scale=True,
                unit_divisor=1000,  # decimal, as the MB/s of the line after it
                desc="verifying",
                file=sys.stderr,
                mininterval=0.5,
            )
        bad = f.verify(progress=bar.update if bar else None)
        if bar:
            bar.close()
    dt = time.perf_counter() - t
    if bad:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        print(f"fastar: error: {a.file}: checksum mismatch in {bad[0]}{more}", file=sys.stderr)
        return 1
    size = os.path.getsize(a.file)
    print(
        f"{a.file}: OK ({counted(n_t, 'tensor')}, {counted(n_e, 'expert record')}, {_decimal(size)} checked in "
        f"{dt:.1f} s, {size / max(dt, 1e-9) / 1e6:.0f} MB/s)"
    )
    return 0


def cmd_inspect(a) -> int:
    from .format.reader import FstFile

    _not_special(a.file)
    with FstFile(a.file) as f:
        h = f.header
        by_type: dict[str, int] = {}
        for t in h["tensors"]:
            by_type[t["dtype"]] = by_type.get(t["dtype"], 0) + t["nbytes"]
        bank = f.bank
        if a.json:
            info = {
                "file": str(a.file),
                "file_size": f.file_size,
                "config": h["config"],
                "source": h["source"],
                "decode_state": _state_accounting(f),
                "converter": h["converter"],
                "bytes_by_dtype": by_type,
                "tensors": [{k: t[k] for k in ("name", "dtype", "shape", "offset", "nbytes")} for t in h["tensors"]],
                "experts": None
                if bank is None
                else {k: bank[k] for k in ("offset", "stride", "slots", "experts", "sections")},
            }
            print(json.dumps(info, indent=1))
            return 0
        print(f"{a.file}: fastar .fst v3, {_human(f.file_size)}, written by fastar {h['converter'].get('version')}")
        print("\nconfig:")
        for k, v in h["config"].items():
            print(f"  {k:34} {v}")
        if h["source"]:
            print("\nsource:", json.dumps(h["source"])[:400])
        print(f"\ntensors ({len(h['tensors'])}):")
        rows = h["tensors"] if a.all else h["tensors"][:40]
        for t in rows:
            print(f"  {t['name']:56} {t['dtype']:8} {t['shape']!s:20} {_human(t['nbytes']):>10} @ {t['offset']}")
        if len(rows) < len(h["tensors"]):
            print(f"  ... {len(h['tensors']) - len(rows)} more (--all to list them)")
        print("\nbytes by storage type:")
        for k, v in sorted(by_type.items(), key=lambda kv: -kv[1]):
            print(f"  {k:8} {_human(v):>12}")
        for b in h["blobs"]:
            print(f"  blob {b['name']} {_human(b['nbytes'])}")
        if bank is not None:
            n = bank["slots"] * bank["experts"]
            print(
                f"\nexpert bank: {counted(bank['slots'], 'layer')} x {counted(bank['experts'], 'expert')} = "
                f"{counted(n, 'record')}, stride {bank['stride']} B ({counted(bank['stride'] // 4096, 'page')}) at "
                f"offset {bank['offset']}, "
                f"{_human(n * bank['stride'])} in all"
            )
            for s in bank["sections"]:
                print(f"  +{s['offset']:<10} {s['field']:9} {s['dtype']:8} {s['shape']}")
        st = _state_accounting(f)
        ref = st["reference"]
        print(
            f"\ndecode state, official numerics ({st['format']}; max_rollback {st['max_rollback']}): "
            f"{st['per_token']:,.2f} B per token = {_human(st['per_1k'])} per 1k tokens, "
            f"{_human(st['at_1m'])} at a 1M-token context ({_human(st['fixed'])} of it fixed: window rows, open "
            f"compressor windows, the rollback margin)\n  reference numerics (float32 rows): "
            f"{ref['per_token']:,.0f} B per token = {_human(ref['per_1k'])} per 1k tokens, {_human(ref['at_1m'])} "
            f"at 1M\n  the official inference's layout (bf16 caches): {st['official_per_token']:,.0f} B per token, "
            f"{_human(st['official_at_1m'])} at 1M"
        )
    return 0


def _state_accounting(f) -> dict:
    """fastar.model.state.state_accounting for the file's model at the engine's default max_rollback, in the
    official numerics' state format, with the reference numerics' (float32 rows) under "reference"."""
    from .engine.engine import DEFAULT_MAX_ROLLBACK
    from .model.state import official_format, state_accounting

    acct = state_accounting(f.config, DEFAULT_MAX_ROLLBACK, fmt=official_format(f.config))
    return {**acct, "reference": state_accounting(f.config, DEFAULT_MAX_ROLLBACK)}


def cmd_audit(a) -> int:
    from .audit import run

    report = run(a.file, a.reference, tokens=a.tokens or None)
    print(report.table())
    if not report.ok:
        print(
            f"fastar: error: logits differ from transformers by {report.logits.max_abs:.3g} "
            f"(tolerance {report.tolerance:g})",
            file=sys.stderr,
        )
        return 1
    return 0


def _token_ids(text: str) -> list[int]:
    """--tokens: comma-separated token ids (empty: the audit's default prompt)."""
    try:
        return [int(t) for t in text.split(",")] if text.strip() else []
    except ValueError:
        raise argparse.ArgumentTypeError(f"give comma-separated token ids such as 1,2,3, got {text!r}") from None


def cmd_fixture(a) -> int:
    from .fixtures import write_checkpoint

    with _output_flag("-o"):
        p = write_checkpoint(a.output, preset=a.preset, seed=a.seed, force=a.force)
    print(f"wrote an official-format {a.preset} checkpoint to {p}")
    return 0


def cmd_synth(a) -> int:
    from .synth import synth

    for name in ("layers", "experts", "vocab", "hidden", "inter"):
        if getattr(a, name) < 1:
            raise FastarError(f"synth: --{name} must be at least 1, got {getattr(a, name)}")
    if a.hidden % 128 or a.inter % 128:
        raise FastarError("synth: --hidden and --inter must be multiples of 128 (the FP8 and FP4 block sizes)")
    if not 0 <= a.router_bias < float("inf"):  # NaN too: it would route every token nowhere in particular
        raise FastarError(f"synth: --router-bias is a standard deviation, got {a.router_bias}")
    from .synth import plan, refuse_too_large, synth_config

    # said at once, naming the flags, for both outputs: an expert bank or tensor table over the .fst header's cap (a
    # checkpoint directory is for the .fst converted from it: the same caps), or more bytes than the disk has free;
    # `--layers 100000` planned 3.6 million tensors for ~45 s before 'header exceeds'
    flag, out = ("--hf-dir", a.hf_dir) if a.hf_dir else ("-o", a.output)
    with _output_flag(flag):
        shape = f"synth: --layers {a.layers} (+ --mtp {a.mtp}) x --experts {a.experts}"
        if a.vocab != 129280 or a.hidden != 4096 or a.inter != 2048:
            shape += f" at --vocab {a.vocab} --hidden {a.hidden} --inter {a.inter}"
        cfg = synth_config(a.layers, a.experts, a.vocab, a.hidden, a.inter, mtp=a.mtp)
        refuse_too_large(out, plan(cfg), shape)
    if a.hf_dir:  # the official layout: safetensors shards, config.json (one MTP block, fixed router recipe)
        from .fixtures import write_checkpoint

        if a.mtp != 1 or a.router_bias != 0.05:
            raise FastarError("synth: --hf-dir writes the official layout: one MTP block and the default --router-bias")
        with _output_flag("--hf-dir"):
            p = write_checkpoint(
                a.hf_dir,
                "flash",
                a.seed,
                force=a.force,
                num_hidden_layers=a.layers,
                n_routed_experts=a.experts,
                num_experts_per_tok=min(6, a.experts),  # as synth's .fst: V4's top-6, or every expert when fewer
                vocab_size=a.vocab,
                hidden_size=a.hidden,
                moe_intermediate_size=a.inter,
            )
        shape = f"{counted(a.layers, 'layer')} x {counted(a.experts, 'expert')}"
        print(f"wrote an official-format checkpoint ({shape}) to {p}")
        return 0
    with _output_flag("-o"):
        p = synth(
            a.output,
            a.layers,
            a.experts,
            a.vocab,
            a.hidden,
            a.inter,
            a.seed,
            mtp=a.mtp,
            progress=True,
            router_bias=a.router_bias,
            force=a.force,
        )
    print(
        f"wrote a random-weight model ({counted(a.layers, 'layer')} x {counted(a.experts, 'expert')}, hidden "
        f"{a.hidden}, expert width {a.inter}) to {p}"
    )
    return 0


def cmd_chat(a) -> int:
    from .console import cmd_chat

    a.prompt_cache = a.serve_mod.prompt_cache_dir(a)  # the flag, the default folder, or None (--no-prompt-cache)
    return cmd_chat(a)


def cmd_serve(a) -> int:
    from .console import check_model_path, check_sizes, open_engine

    check_model_path(a.model)  # before binding the port: a wrong path is one line, not a failed load later
    check_sizes(a)  # and so is a --ram-budget or --gpu-budget that is no size
    from .model.device import resolve_device

    resolve_device(a.device)  # and a --device that is none, or CUDA where there is none
    a.prompt_cache = a.serve_mod.prompt_cache_dir(a)  # the usage profile the warm-up follows is kept beside it
    from .engine.source import open_source

    # and a file that is no model (truncated, another format): its header is read here, as `run` reads it
    source = open_source(a.model) if a.model is not None else None
    # --draft: the scheduler drafts a lone greedy request with it (docs/SERVING.md), batched steps otherwise
    return a.serve_mod.run_from_args(a, lambda: open_engine(a, warm=True, source=source))


# --- parser ------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="fastar",
        description="DeepSeek-V4-Flash on one machine, experts paged from SSD.",
        epilog="Every flag can also be set by a FASTAR_<FLAG> environment variable (FASTAR_MODEL, FASTAR_RAM_BUDGET, "
        "FASTAR_API_KEY, ...; a switch takes 1/true/yes/on or 0/false/no/off); the flag wins. `fastar COMMAND --help` "
        "lists a command's flags.",
    )
    p.add_argument("--version", action="version", version=f"fastar {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    p.set_defaults(fn=None)  # no command given: `main` prints the help (each command sets its own)

    c = sub.add_parser(
        "convert",
        help="convert an official checkpoint (directory or hub id) or a FaStar v2 .fst to "
        ".fst (--indexer-sidecar: the indexer weights v2 lacks)",
        description="Convert an official DeepSeek-V4 checkpoint, or a FaStar v2 .fst with its "
        "sidecars, to one .fst v3 file; or, with --indexer-sidecar, write the lightning-indexer "
        "weights a FaStar v2 model lacks.",
    )
    c.add_argument(
        "src",
        type=_path,
        help="checkpoint directory (config.json, safetensors shards, tokenizer.json) or hub id, or a FaStar v2 .fst",
    )
    c.add_argument("-o", "--output", type=_path, required=True, help="output .fst path")
    c.add_argument(
        "--indexer-sidecar",
        action="store_true",
        help="write only the lightning-indexer tensors (layers.*.attn.indexer.*) of the checkpoint SRC "
        "as -o MODEL.fst.indexer, next to a FaStar v2 MODEL.fst: v2 files lack them and run at most "
        "4*index_topk+3 (2051) tokens without them. Needs only config.json, "
        "model.safetensors.index.json and the shards holding those tensors (a hub id downloads just "
        "those)",
    )
    c.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: on a terminal)"
    )
    _add_force(c, "output file")
    c.set_defaults(fn=cmd_convert)

    ex = sub.add_parser(
        "export",
        help="write a .fst (or FaStar v2 .fst + sidecars) back as an official checkpoint "
        "directory (safetensors shards, index, config.json, tokenizer) for vLLM / SGLang",
    )
    ex.add_argument("file", type=_path, help=".fst v3 file, or a FaStar v2 .fst with its sidecars next to it")
    ex.add_argument("-o", "--output", type=_path, required=True, help="new checkpoint directory")
    ex.add_argument("--shard-size", default="4G", help="largest shard, e.g. 4G (default)")
    ex.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=None, help="progress bar (default: on a terminal)"
    )
    _add_force(ex, "checkpoint directory")
    ex.set_defaults(fn=cmd_export)

    v = sub.add_parser("verify", help="check a .fst file's structure and every checksum")
    v.add_argument("file", type=_path, help="the .fst file to check")
    v.add_argument("--quick", action="store_true", help="structure only, no checksums")
    v.set_defaults(fn=cmd_verify)

    i = sub.add_parser("inspect", help="print a .fst file's config, tensors and expert-bank geometry")
    i.add_argument("file", type=_path, help="the .fst file to describe")
    i.add_argument("--all", action="store_true", help="list every tensor")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(fn=cmd_inspect)

    au = sub.add_parser("audit", help="per-layer comparison against transformers on the same weights")
    au.add_argument("file", type=_path, help=".fst file (or checkpoint directory) to audit")
    au.add_argument("--reference", type=_path, required=True, help="official checkpoint directory transformers loads")
    au.add_argument(
        "--tokens", type=_token_ids, default=None, help="comma-separated token ids (default: a fixed random prompt)"
    )
    au.set_defaults(fn=cmd_audit)

    f = sub.add_parser("fixture", help="write a small random checkpoint in the official on-disk format")
    f.add_argument("-o", "--output", type=_path, required=True, help="the new checkpoint directory")
    f.add_argument(
        "--preset",
        default="tiny",
        choices=["tiny", "tiny-dspark", "vocab", "flash"],
        help="tiny (default): hidden 256, 5 layers, 8 experts and a 1,024-token vocabulary (token ids only, no "
        "text); tiny-dspark: tiny with DSpark draft stages; vocab: tiny with the real 129,280-token vocabulary (runs "
        "text); flash: the real Flash widths, 2 layers of 16 experts (several GB)",
    )
    f.add_argument("--seed", type=_seed, default=0, help="random seed of the weights (default 0)")
    _add_force(f, "checkpoint directory")
    f.set_defaults(fn=cmd_fixture)

    sy = sub.add_parser(
        "synth",
        help="write a random-weight .fst at the real Flash widths (any number of layers), "
        "for benchmarks larger than RAM",
    )
    out = sy.add_mutually_exclusive_group(required=True)
    out.add_argument("-o", "--output", type=_path, help="the .fst to write")
    out.add_argument(
        "--hf-dir",
        type=_path,
        help="write an official-format checkpoint directory instead (safetensors shards, config.json), the same "
        "weights transformers can load: for bench --compare-transformers",
    )
    sy.add_argument(
        "--layers",
        type=int,
        default=4,
        help="layers (default 4; Flash has 43). A shape over the .fst header's caps, or larger than the output "
        "folder's free space (~3.6 GB a layer at the defaults), is refused before anything is written",
    )
    sy.add_argument(
        "--experts",
        type=int,
        default=256,
        help="routed experts per layer (default 256, as Flash: ~3.4 GB of experts a layer; 16 makes a small file)",
    )
    sy.add_argument(
        "--vocab", type=int, default=129280, help="vocabulary size (default 129280, the real one: runs text)"
    )
    sy.add_argument("--hidden", type=int, default=4096, help="hidden size (default 4096, as Flash)")
    sy.add_argument("--inter", type=int, default=2048, help="routed expert width (default 2048, as Flash)")
    sy.add_argument("--mtp", type=int, default=1, help="MTP blocks (default 1)")
    sy.add_argument("--seed", type=_seed, default=0, help="random seed of the weights (default 0)")
    sy.add_argument(
        "--router-bias",
        type=float,
        default=0.05,
        help="spread of the routers' selection bias: 0.05 uses the experts almost evenly, 0.2 unevenly "
        "(the most used fifth of the experts then gets ~70%% of the traffic, as real routing is skewed)",
    )
    _add_force(sy, "output (-o file or --hf-dir checkpoint)")
    sy.set_defaults(fn=cmd_synth)

    from . import console  # light: torch is imported only when run/chat actually run

    r = sub.add_parser("run", help="one-shot generation, streamed to stdout (timings on stderr)")
    console.add_run_arguments(r)
    r.set_defaults(fn=console.cmd_run)
    from .serve import server as serve_mod  # imports no torch

    ch = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    console.add_chat_arguments(ch)
    serve_mod.add_prompt_cache_arguments(ch)
    ch.set_defaults(fn=cmd_chat, serve_mod=serve_mod)

    sv = sub.add_parser("serve", help="OpenAI-compatible HTTP API and the web chat UI")
    sv.add_argument(
        "-m",
        "--model",
        type=console.home_path,
        default=None,
        help=".fst file or official checkpoint directory (default: the built-in demo model)",
    )
    console.add_numerics_argument(sv)
    sv.add_argument(
        "-c",
        "--ctx-size",
        "--max-model-len",
        dest="ctx_size",
        type=console.non_negative_int,
        default=0,
        help=console.CONTEXT_HELP,
    )
    sv.add_argument("--threads", type=console.thread_count, default=0, help=console.THREADS_HELP)
    console.add_draft_argument(sv)
    console.add_memory_arguments(sv)
    sv.add_argument("--verbose", action="store_true", help=console.VERBOSE_LOAD_HELP)
    serve_mod.add_arguments(sv)
    sv.set_defaults(fn=cmd_serve, serve_mod=serve_mod)

    from . import evaluate  # light: the engine is imported when it runs

    pp = sub.add_parser(
        "perplexity",
        help="perplexity of a text file over sliding windows (as llama-perplexity); --save-logits and "
        "--kl-divergence compare two runs token by token",
    )
    evaluate.add_arguments(pp)
    pp.set_defaults(fn=evaluate.cmd_perplexity)

    from . import bench  # light: each benchmark is imported when it runs

    b = sub.add_parser("bench", help="benchmarks: `bench kernels` (quantized products) or `bench -m FILE`")
    bench.add_arguments(b)
    b.add_check(bench.check_arguments)
    b.set_defaults(fn=bench.main)
    return p


def _terminate(signum, frame) -> None:
    raise KeyboardInterrupt  # SIGTERM cleans up as Ctrl-C does (convert removes its .partial file, serve stops)


def _exit_now(signum, frame) -> None:
    """Once the command is over, a Ctrl-C or SIGTERM while the interpreter tears down (the model's files closed,
    torch's exit hooks) ends the process at once, quietly: a KeyboardInterrupt there is a traceback from inside an
    exit hook. What the command wrote was flushed before."""
    os._exit(128 + signum)


def _stdout_to_devnull() -> None:
    """After a broken pipe, what is still buffered for stdout would fail again when Python flushes it at exit."""
    try:
        fd = os.open(os.devnull, os.O_WRONLY)
        os.dup2(fd, sys.stdout.fileno())
        os.close(fd)
    except (OSError, ValueError):  # io.UnsupportedOperation is a ValueError: stdout is no file (a test's capture)
        pass


def main(argv: list[str] | None = None) -> int:
    if sys.stderr is None:  # nowhere to report anything: say it in the exit status only
        return 1
    try:
        parser = build_parser()  # imports the subcommands' modules: half a second, more on a busy machine
        a = parser.parse_args(argv)
    except UsageError as e:
        print(f"fastar: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C before the command started: nothing was done, nothing to clean up
        print("fastar: interrupted", file=sys.stderr)
        return 130
    if a.fn is None:
        parser.print_help()
        return 2
    if sys.stdout is None:
        print("fastar: error: standard output is closed", file=sys.stderr)
        return 1
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _terminate)
    try:
        code = a.fn(a)
        sys.stdout.flush()  # a reader gone early (`| head`) shows here, not at the interpreter's exit
        return code
    except BrokenPipeError:  # before OSError, its base: the reader took what it wanted; no error, no traceback
        _stdout_to_devnull()
        return 0
    except FastarError as e:
        if isinstance(e, OptionError):  # a load option checked outside `open_engine` (serve's --device, at start)
            from .console import LOAD_FLAGS

            e = e.as_flags(LOAD_FLAGS)
        print(f"fastar: error: {e}", file=sys.stderr)
        return 1
    except OSError as e:  # the file system's answer to a path the user gave: one line, not a traceback
        where = f"{e.filename}: " if e.filename else ""
        print(f"fastar: error: {where}{e.strerror or e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("fastar: interrupted", file=sys.stderr)
        return 130
    finally:
        if argv is None and threading.current_thread() is threading.main_thread():  # the program, not a test's call
            signal.signal(signal.SIGINT, _exit_now)
            signal.signal(signal.SIGTERM, _exit_now)
