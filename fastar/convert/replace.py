"""A checkpoint folder written aside and put in place at the end: what `export`, `fixture` and `synth --hf-dir` do
with `--force` over an existing checkpoint.

Owns: `aside` (the temporary folder next to the output) and `put_in_place` (the new folder renamed to the output's
name, the old one moved out of the way first and removed only once the new one is there). Until that last step the
old checkpoint is untouched, so a failed or interrupted run leaves it as it was. Does not own: whether an existing
output may be replaced (`fastar.engine.outputs.refuse_existing_output`, asked by the command line first).
"""

from __future__ import annotations

import os
import shutil
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
