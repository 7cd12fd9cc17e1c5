"""A checkpoint folder written aside and put in place at the end: what `export` and `write_checkpoint` (`fixture`,
`synth --hf-dir`) do with `force` over an existing checkpoint.

Owns: `aside` (the temporary folder next to the output), `put_in_place` (the new folder renamed to the output's
name, the old one moved out of the way first and removed only once the new one is there) and `write_folder` (a
writer of a folder run into a new or empty one, or aside and put in place over an old one). Until that last step
the old checkpoint is untouched, so a failed or interrupted run leaves it as it was. Does not own: whether an
existing output may be replaced (`fastar.outputs.refuse_existing_output`, asked by each writer first).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path


def aside(out: str | os.PathLike) -> Path:
    """The temporary folder `.NAME.partial-PID` next to `out`, made empty (one left by an earlier run of this
    process id is removed; others belong to other runs, which may still be writing)."""
    out = Path(out)
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def put_in_place(tmp: str | os.PathLike, out: str | os.PathLike) -> Path:
    """Rename the complete folder `tmp` to `out`. An empty folder at `out` is removed first; a non-empty one is
    renamed to `.NAME.old-PID` and removed after the new one is in place (put back when the rename fails)."""
    tmp, out = Path(tmp), Path(out)
    old = None
    if out.is_dir() and not out.is_symlink():
        if any(out.iterdir()):
            old = out.parent / f".{out.name}.old-{os.getpid()}"
            shutil.rmtree(old, ignore_errors=True)
            os.rename(out, old)
        else:
            out.rmdir()
    try:
        os.rename(tmp, out)
    except BaseException:
        if old is not None:
            os.rename(old, out)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return out


def write_folder(out: str | os.PathLike, write: Callable[[Path], object]) -> Path:
    """`write(folder)` makes a checkpoint folder at `out`: straight into it when it is new or empty (removed again,
    when this made it, if the write fails: no half-written checkpoint that looks complete), or over an existing
    checkpoint (the caller checked it may be replaced) into a folder beside it, renamed over it only when complete."""
    out = Path(out)
    if out.is_dir() and any(out.iterdir()):
        tmp = aside(out)
        try:
            write(tmp)
            put_in_place(tmp, out)
        except BaseException:  # a full disk, Ctrl-C: the old checkpoint is left as it was
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return out
    created = not os.path.lexists(out)
    try:
        write(out)
    except BaseException:  # a full disk, Ctrl-C: leave no half-written checkpoint that looks complete
        if created:
            shutil.rmtree(out, ignore_errors=True)
        raise
    return out
