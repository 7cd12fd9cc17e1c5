"""The `--save-logits` file of `fastar perplexity`: each scored token's whole distribution, to compare runs by.

Owns `LogitsWriter` (streams a run's rows to disk) and `LogitsFile` (reads one back, memory-mapped). Does not own
the windows or the comparison itself (`fastar.engine.perplexity`).

What is stored, and why: a comparison over the whole vocabulary (KL divergence, top-1 agreement) needs each scored
position's full distribution, not a top-K; so each row is the position's log-softmax rounded to float16 (2 bytes
per vocabulary entry: 253 KiB a token at V = 129,280, as llama.cpp's `--kl-divergence-base` file keeps 16 bits per
logit). float16 keeps ~3 significant digits over the range a log-probability takes (down to -65504); a comparison
rounds the live run's rows the same way and renormalizes both in float64, so two runs that compute the same numbers
compare as exactly equal. The scored token's own logprob is also kept in float32, exactly as the run computed it.

Layout (little-endian): MAGIC, u32 VERSION, u64 header bytes, a JSON header (vocab_size, num_tokens, num_scored,
ctx, stride, numerics, model), padding to a multiple of 64 bytes, then int32 token ids [num_tokens], int32 scored
positions [num_scored], float16 rows [num_scored, vocab_size], float32 target logprobs [num_scored].
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from ..errors import FastarError

MAGIC = b"FSTLOGP\0"
VERSION = 1
ALIGN = 64


def _offsets(header: dict, start: int) -> dict[str, int]:
    n, m, v = header["num_tokens"], header["num_scored"], header["vocab_size"]
    ids = start
    positions = ids + 4 * n
    rows = positions + 4 * m
    targets = rows + 2 * m * v
    return {"ids": ids, "positions": positions, "rows": rows, "targets": targets, "end": targets + 4 * m}


class LogitsWriter:
    """Write a run: the header, token ids and scored positions at once, then rows in order (`add`), the scored
    tokens' logprobs at `close`. The file appears under its name only once complete (a temporary file renamed)."""

    def __init__(self, path: str | os.PathLike, ids: list[int], positions: list[int], vocab_size: int, **meta) -> None:
        self.path = Path(path)
        if self.path.exists() and not self.path.is_file():  # a device or FIFO: the rename would replace it
            raise FastarError(f"{self.path}: not a regular file (the logits file is renamed into place over it)")
        header = {
            "vocab_size": vocab_size,
            "num_tokens": len(ids),
            "num_scored": len(positions),
            **meta,
        }
        raw = json.dumps(header, sort_keys=True).encode()
        start = len(MAGIC) + 12 + len(raw)
        start += -start % ALIGN
        self._tmp = self.path.with_name(f".{self.path.name}.partial")
        self._f = None
        self._num_scored, self._vocab = len(positions), vocab_size
        self._targets = np.zeros(len(positions), dtype="<f4")
        self._rows = 0
        with self._writing():
            self._f = open(self._tmp, "wb")  # noqa: SIM115 (closed by close())
            self._f.write(MAGIC + struct.pack("<IQ", VERSION, len(raw)) + raw)
            self._f.write(b"\0" * (start - self._f.tell()))
            self._f.write(np.asarray(ids, dtype="<i4").tobytes())
            self._f.write(np.asarray(positions, dtype="<i4").tobytes())

    @contextmanager
    def _writing(self) -> Iterator[None]:
        """A write that fails (a full disk, a folder that is a file) removes the temporary file and is one line
        naming the file asked for (it was the bare "File too large", the temporary file left behind)."""
        try:
            yield
        except OSError as e:
            self.abort()
            raise FastarError(f"{self.path}: cannot write the logits file ({e.strerror or e})") from None

    def add(self, rows: np.ndarray, targets: np.ndarray) -> None:
        """The next scored positions' float16 log-softmax rows [P, V] and their tokens' float32 logprobs [P]."""
        if rows.shape[1] != self._vocab or self._rows + rows.shape[0] > self._num_scored:
            raise ValueError(f"rows {rows.shape} do not fit the file ({self._num_scored} x {self._vocab})")
        with self._writing():
            self._f.write(np.ascontiguousarray(rows, dtype="<f2").tobytes())
        self._targets[self._rows : self._rows + rows.shape[0]] = targets
        self._rows += rows.shape[0]

    def close(self) -> Path:
        if self._rows != self._num_scored:
            self.abort()
            raise FastarError(f"{self.path}: {self._rows} of {self._num_scored} rows were written")
        with self._writing():
            self._f.write(self._targets.tobytes())
            self._f.close()  # flushes: where a full disk shows
            os.replace(self._tmp, self.path)
        return self.path

    def abort(self) -> None:
        if self._f is not None and not self._f.closed:
            try:
                self._f.close()
            except OSError:  # the flush of what the disk could not take
                pass
        try:
            self._tmp.unlink(missing_ok=True)
        except NotADirectoryError:  # its folder is a file: it was never made
            pass


class LogitsFile:
    """A saved run, memory-mapped: `header`, `ids`, `positions`, `rows` [num_scored, V] float16, `targets`."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                head = f.read(len(MAGIC) + 12)
                if head[: len(MAGIC)] != MAGIC:
                    raise FastarError(f"{self.path}: not a `fastar perplexity --save-logits` file")
                version, hlen = struct.unpack_from("<IQ", head, len(MAGIC))
                if version != VERSION:
                    raise FastarError(f"{self.path}: logits file version {version} is not supported ({VERSION})")
                if len(MAGIC) + 12 + hlen > os.fstat(f.fileno()).st_size:  # read no more than the file holds
                    raise FastarError(f"{self.path}: the logits file is truncated or corrupt (its header length)")
                self.header = json.loads(f.read(hlen).decode())
        except FileNotFoundError:
            raise FastarError(f"{self.path}: no such file") from None
        except (struct.error, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise FastarError(f"{self.path}: the logits file is corrupt ({e})") from None
        start = len(MAGIC) + 12 + hlen
        start += -start % ALIGN
        keys = ("num_tokens", "num_scored", "vocab_size")
        counts = [self.header.get(k) for k in keys] if isinstance(self.header, dict) else [None] * 3
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise FastarError(f"{self.path}: the logits file's header needs {', '.join(keys)} as counts")
        at = _offsets(self.header, start)
        n, m, v = counts
        if self.path.stat().st_size != at["end"]:
            raise FastarError(f"{self.path}: the logits file is truncated or corrupt (size does not match its header)")
        self.ids = np.memmap(self.path, "<i4", "r", at["ids"], (n,))
        self.positions = np.memmap(self.path, "<i4", "r", at["positions"], (m,))
        self.rows = np.memmap(self.path, "<f2", "r", at["rows"], (m, v)) if m else np.zeros((0, v), "<f2")
        self.targets = np.memmap(self.path, "<f4", "r", at["targets"], (m,)) if m else np.zeros(0, "<f4")
