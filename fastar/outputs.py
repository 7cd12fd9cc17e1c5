"""An output path checked before anything is written to it: against the files the command reads, against what is
already there, and against its folder.

Owns: `refuse_existing_output` (every writer of a model or data file refuses an output that exists unless told
`force`: the library's `convert`, `synth`, `export` and `write_checkpoint` themselves, and `perplexity
--save-logits`, chat's `/save` and `bench --plot` on the command line; a converted model takes an hour to make, and
a mistyped `-o` must not replace one), `refuse_unwritable_output` (an output whose folder cannot be written, said
before the work that makes it; `unwritable` says why), `refuse_inputs_as_output` (an output that is one of the
command's inputs: chat's `/save`, `perplexity --save-logits` and `bench --plot` would otherwise rename or write over
the model, the text or the base they read) and `model_files` (the files a model path names). Their errors are
`OutputError`s (`OutputExists` for the first) whose message starts with the path; the command line puts its flag
in front (`OutputError.named`). With `force` an old output is still replaced only once the new one is complete
(each writer renames a temporary file or folder into place at its end), so a failed or interrupted forced run
leaves it as it was.

Does not own: writing the outputs (`format.writer`, `convert.replace`, `session.Session.save`,
`logits_file.LogitsWriter`, the benchmark's plot), nor `convert -o`'s check against the checkpoint's own files
(`fastar.convert.hf.check_output`).
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from .errors import FastarError, OutputError, OutputExists


def model_files(model: str | os.PathLike | None) -> list[str]:
    """The files a model path names: the `.fst` file itself, or a checkpoint folder and every entry in it."""
    if model is None:
        return []
    model = os.path.expanduser(os.fspath(model))
    if not os.path.isdir(model):
        return [model]
    try:
        return [model, *(os.path.join(model, name) for name in sorted(os.listdir(model)))]
    except OSError:  # unreadable: nothing of it can be named here (loading it says why)
        return [model]


def refuse_inputs_as_output(
    out: str | os.PathLike | None, inputs: Iterable[tuple[str | os.PathLike | None, str]], flag: str = ""
) -> None:
    """Raise a one-line FastarError when `out` (after `~`) is the same file as one of `inputs`, (path, what it is)
    pairs (None paths are skipped), symlinks and hard links followed (`os.path.samefile`): written there, the output
    would replace that input. An output or input that does not exist yet is none of them. `flag`: the option or
    command that names `out` in the message (`--save-logits`, `/save`)."""
    if out is None:
        return
    target = os.path.expanduser(os.fspath(out))
    if not os.path.exists(target):
        return
    for path, what in inputs:
        if path is None:
            continue
        path = os.path.expanduser(os.fspath(path))
        try:
            same = os.path.exists(path) and os.path.samefile(target, path)
        except OSError:  # a file gone or unreadable between the two calls: not the same file we can tell
            same = False
        if same:
            prefix = f"{flag} " if flag else ""
            raise FastarError(f"{prefix}{out}: it is {what} ({path}); give the output another name")


def unwritable(out: str | os.PathLike, folder: bool = False, parents: bool = False) -> str | None:
    """Why nothing can be written at `out` (after `~`), in words for after `OUT: `, or None where nothing stops it
    that can be told before writing. A file is made in its folder (`parents`: with any missing folders, found from
    the nearest one there); a checkpoint `folder` is written into when it is an empty folder, else made (or, with
    force, made aside and renamed over the old one) in its parent, missing folders made. The folder that would get
    the new entry must be a directory this process may write (`os.access`: a read-only mount says so to root too)."""
    target = os.path.expanduser(os.fspath(out))
    if not folder and os.path.isdir(target):
        return "it is a directory; give a file name"
    if folder and os.path.isdir(target) and not _entries(target):
        where = target  # an empty folder: written into
    else:
        where = os.path.dirname(os.path.abspath(target))
        if parents or folder:
            while not os.path.lexists(where) and os.path.dirname(where) != where:
                where = os.path.dirname(where)  # the folder the first missing one is made in
        elif not os.path.isdir(where):
            return f"no such directory {where}"
    if not os.path.isdir(where):
        return f"{where} is not a directory"
    if not os.access(where, os.W_OK):
        return f"the directory {where} is not writable"
    return None


def _entries(path: str) -> list[str]:
    try:
        return os.listdir(path)
    except OSError:  # unreadable: writing there says why
        return ["?"]


def refuse_unwritable_output(
    out: str | os.PathLike | None, flag: str = "", what: str = "", folder: bool = False, parents: bool = False
) -> None:
    """Raise a one-line OutputError (`FLAG OUT: WHY`, `OUT: WHY` without a flag) when `unwritable` says why `out`
    cannot be written: said before the work, not after it, when its result would be lost (`bench --plot`,
    `perplexity --save-logits`, a checkpoint). `what`: the file's kind, for a directory given where a file goes."""
    if out is None:
        return
    why = unwritable(out, folder=folder, parents=parents)
    if why is None:
        return
    if what and why.startswith("it is a directory"):
        why = f"it is a directory; give a file name for {what}"
    raise OutputError(f"{flag} {out}: {why}" if flag else f"{out}: {why}")


FORCE_HINT = "add --force to replace it, or remove it first"


def refuse_existing_output(
    out: str | os.PathLike | None, force: bool, flag: str = "", folder: bool = False, hint: str = FORCE_HINT
) -> None:
    """Raise a one-line OutputExists when `out` (after `~`) exists and `force` is false: `FLAG OUT: already exists;
    HINT` (`OUT: ...` without a flag: the library's writers, whose callers put their flag in front with
    `OutputError.named`, and chat's `/save`, whose errors read `cannot save: OUT: ...`). `folder`: the output is a
    checkpoint folder, where an empty folder is no output yet (it is written into), and `force` replaces only a
    folder holding a checkpoint's `config.json`, never any other folder (`-o ~`). What is neither a regular file nor
    a folder is left to the writer, which refuses it (a FIFO, a device)."""
    if out is None:
        return
    target = os.path.expanduser(os.fspath(out))
    if not os.path.lexists(target):
        return
    name = f"{flag} {out}" if flag else f"{out}"
    if folder and os.path.isdir(target):
        try:
            entries = os.listdir(target)
        except OSError:  # unreadable: writing there says why
            return
        if not entries:
            return
        if force and "config.json" not in entries:
            raise OutputExists(
                f"{name}: already exists and holds no checkpoint (no config.json): --force replaces only a "
                "checkpoint folder; remove it first or give a new folder"
            )
    elif folder:
        raise OutputExists(f"{name}: not a folder; give a new folder for the checkpoint")
    elif not os.path.isfile(target):
        return
    if not force:
        raise OutputExists(f"{name}: already exists; {hint}")
