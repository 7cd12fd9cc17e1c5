"""The weight source a model path names, opened and checked before an engine is built on it.

Owns: `open_source` (a `.fst` v3 or FaStar v2 file, or an official checkpoint directory checked against the
manifest) and `checked_reads` (a `.fst`'s resident tensors checked against their checksums as the engine is built on
them).
Does not own: the formats themselves (`fastar.format`, `fastar.convert`), what is built on the source (`engine`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

from ..contracts import WeightSource
from ..errors import FormatError, ModelNotFound


def open_source(path: str | os.PathLike) -> WeightSource:
    """A `.fst` file -> FstFile (v3) or FstV2File (FaStar v2 + sidecars); a checkpoint directory -> Checkpoint; a path
    to nothing -> `ModelNotFound` (a FormatError and a FileNotFoundError). A checkpoint directory is
    checked against the manifest first (headers only: every tensor present with its dtype and shape, as `convert`
    checks), so a wrong tensor is one line naming it, not a shape error deep in a forward or a model run as is."""
    p = Path(path)
    if not p.exists():
        hint = ""
        if str(path).startswith("~") and p.expanduser().exists():  # the shell expands "~", Python's open() does not
            hint = f" (a path starting with ~ is not expanded: give {str(p.expanduser())!r}, or os.path.expanduser)"
        raise ModelNotFound(f"{path}: no such file or directory{hint}")
    if p.is_dir():
        from ..convert.checkpoint import Checkpoint

        ck = Checkpoint(p)
        try:
            ck.validate()
        except BaseException:
            ck.close()
            raise
        return ck
    if p.exists() and not p.is_file():  # a FIFO would block the open forever, a device stream without end
        raise FormatError(f"{path}: not a regular file or checkpoint directory")
    from ..convert.v2 import open_model_file

    return open_model_file(p)


@contextlib.contextmanager
def checked_reads(source: WeightSource) -> Iterator[None]:
    """Around building an engine on `source`: a `.fst` v3's resident tensors and blobs checked against their
    checksums as they are read to be built (`FstFile.check_reads`, so the file is read once, not once to check and
    again to build), and at the end those the build did not read (the expert bank is checked record by record as
    the cache first reads it). A mismatch is a FormatError naming the tensor before anything is served. Other
    sources carry no checksums to check."""
    from ..format.reader import FstFile

    if not isinstance(source, FstFile):
        yield
        return
    source.check_reads(
        f" (run `fastar verify {source.path}`; load with verify=False, or --no-verify, to skip this check)",
    )
    yield
    source.check_unread()
