"""An output path checked against the files a command reads, before anything is written to it.

Owns: `refuse_unwritable_output` (an output that cannot be written, said before the work that makes it) and
`refuse_inputs_as_output` (a one-line `FastarError` when an output is the same file as one of the command's
inputs: chat's `/save`, `perplexity --save-logits` and `bench --plot` would otherwise rename or write over the
model, the text or the base they read) and `model_files` (the files a model path names). Does not own: writing the
outputs (`session.Session.save`, `logits_file.LogitsWriter`, the benchmark's plot), nor `convert -o`'s own check,
which sits below this layer (`fastar.convert.hf.check_output`).

Also `refuse_existing_output`: every command that writes a model or data file (`convert`, `synth`, `export`,
`fixture`, `perplexity --save-logits`, chat's `/save`) refuses an output that exists unless told `--force`, before
any work: a converted model takes an hour to make, and a mistyped `-o` must not replace one. With `--force` the old
output is still replaced only once the new one is complete (each writer renames a temporary file or folder into
place at its end), so a failed or interrupted forced run leaves it as it was.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

from ..errors import FastarError


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


def refuse_unwritable_output(out: str | os.PathLike | None, flag: str, what: str) -> None:
    """Raise a one-line FastarError when `out` (after `~`) cannot be written as a new file: it is a directory, its
    folder does not exist or is not writable. For outputs written after long work (`bench --plot`, `perplexity
    --save-logits`): said before the work, not after it, when its numbers would be lost. `what`: the file's kind."""
    if out is None:
        return
    target = os.path.expanduser(os.fspath(out))
    folder = os.path.dirname(os.path.abspath(target))
    if os.path.isdir(target):
        raise FastarError(f"{flag} {out}: it is a directory; give a file name for {what}")
    if not os.path.isdir(folder):
        raise FastarError(f"{flag} {out}: no such directory {folder}")
    if not os.access(folder, os.W_OK):
        raise FastarError(f"{flag} {out}: the directory {folder} is not writable")


FORCE_HINT = "add --force to replace it, or remove it first"


def refuse_existing_output(
    out: str | os.PathLike | None, force: bool, flag: str, folder: bool = False, hint: str = FORCE_HINT
) -> None:
    """Raise a one-line FastarError when `out` (after `~`) exists and `force` is false: `FLAG OUT: already exists;
    HINT` (`OUT: ...` without a flag: chat's `/save`, whose errors read `cannot save: OUT: ...`). `folder`: the
    output is a checkpoint folder, where an empty folder is no output yet (it is written into), and `force` replaces
    only a folder holding a checkpoint's `config.json`, never any other folder (`-o ~`). What is neither a regular
    file nor a folder is left to the writer, which refuses it (a FIFO, a device)."""
    if out is None:
        return
    target = os.path.expanduser(os.fspath(out))
    if not os.path.lexists(target):
        return
    if folder and os.path.isdir(target):
        try:
            entries = os.listdir(target)
        except OSError:  # unreadable: writing there says why
            return
        if not entries:
            return
        if force and "config.json" not in entries:
            raise FastarError(
                f"{flag} {out}: already exists and holds no checkpoint (no config.json): --force replaces only a "
                "checkpoint folder; remove it first or give a new folder"
            )
    elif folder:
        raise FastarError(f"{flag} {out}: not a folder; give a new folder for the checkpoint")
    elif not os.path.isfile(target):
        return
    if not force:
        raise FastarError(f"{flag} {out}: already exists; {hint}" if flag else f"{out}: already exists; {hint}")
