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
block_rows, ctx, stride, numerics, model), padding to a multiple of 64 bytes, then int32 token ids [num_tokens],
int32 scored positions [num_scored], float16 rows [num_scored, vocab_size], float32 target logprobs [num_scored],
and (version 2) a trailer of u64 xxh64 checksums: one per block of `block_rows` rows (the last block may be
shorter), then one of everything else (the JSON header's bytes, the ids, the positions and the target logprobs).

Integrity: a file shorter or longer than its header says is refused when it is opened, naming both sizes; the
header, ids, positions and targets (a few bytes a token) are checked when it is opened; a block of rows (16 MiB at
V = 129,280 and 64 rows a block) is checked the first time a row of it is read (`rows_at`), so the comparison
that reads every row checks every row once, with no pass of its own; a mismatch is one line naming the file, the
block and its rows. Version 1 files (no trailer, written before the checksums) still read, unchecked.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import xxhash

from ..errors import FastarError

MAGIC = b"FSTLOGP\0"
VERSION = 2  # 2: xxh64 checksums in a trailer; version 1 files (without) still read, unchecked
ALIGN = 64
BLOCK_ROWS = 64  # rows per checksummed block (16 MiB at V = 129,280)


def _offsets(header: dict, start: int, blocks: int) -> dict[str, int]:
    n, m, v = header["num_tokens"], header["num_scored"], header["vocab_size"]
    ids = start
    positions = ids + 4 * n
    rows = positions + 4 * m
    targets = rows + 2 * m * v
    trailer = targets + 4 * m
    return {
        "ids": ids,
        "positions": positions,
        "rows": rows,
        "targets": targets,
        "trailer": trailer,
        "end": trailer + (8 * (blocks + 1) if blocks >= 0 else 0),
    }


def _num_blocks(num_scored: int, block_rows: int) -> int:
    return -(-num_scored // block_rows)


class LogitsWriter:
    """Write a run: the header, token ids and scored positions at once, then rows in order (`add`), the scored
    tokens' logprobs and the checksums at `close`. The file appears under its name only once complete (a temporary
    file renamed). `block_rows`: rows per checksummed block."""

    def __init__(
        self,
        path: str | os.PathLike,
        ids: list[int],
        positions: list[int],
        vocab_size: int,
        block_rows: int = BLOCK_ROWS,
        **meta,
    ) -> None:
        self.path = Path(path)
        if block_rows < 1:
            raise ValueError(f"block_rows must be at least 1, got {block_rows}")
        if self.path.exists() and not self.path.is_file():  # a device or FIFO: the rename would replace it
            raise FastarError(f"{self.path}: not a regular file (the logits file is renamed into place over it)")
        header = {
            "vocab_size": vocab_size,
            "num_tokens": len(ids),
            "num_scored": len(positions),
            "block_rows": block_rows,
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
        self._block_rows = block_rows
        self._digests: list[int] = []  # of the complete row blocks so far
        self._block = xxhash.xxh64()  # the block being written
        self._rest = xxhash.xxh64(raw)  # the header's bytes, the ids, the positions, then the targets
        with self._writing():
            self._f = open(self._tmp, "wb")  # noqa: SIM115 (closed by close())
            self._f.write(MAGIC + struct.pack("<IQ", VERSION, len(raw)) + raw)
            self._f.write(b"\0" * (start - self._f.tell()))
            for part in (np.asarray(ids, dtype="<i4").tobytes(), np.asarray(positions, dtype="<i4").tobytes()):
                self._f.write(part)
                self._rest.update(part)

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
        rows = np.ascontiguousarray(rows, dtype="<f2")
        with self._writing():
            self._f.write(rows)  # (the array's own buffer: no copy, as for the checksum below)
        done = 0
        while done < rows.shape[0]:  # the checksums of the blocks these rows fill
            take = min(rows.shape[0] - done, self._block_rows - (self._rows + done) % self._block_rows)
            self._block.update(rows[done : done + take])
            done += take
            if (self._rows + done) % self._block_rows == 0:
                self._digests.append(self._block.intdigest())
                self._block.reset()
        self._targets[self._rows : self._rows + rows.shape[0]] = targets
        self._rows += rows.shape[0]

    def close(self) -> Path:
        if self._rows != self._num_scored:
            self.abort()
            raise FastarError(f"{self.path}: {self._rows} of {self._num_scored} rows were written")
        if self._rows % self._block_rows:
            self._digests.append(self._block.intdigest())  # the last, shorter block
        self._rest.update(self._targets.tobytes())
        trailer = np.asarray([*self._digests, self._rest.intdigest()], dtype="<u8")
        with self._writing():
            self._f.write(self._targets.tobytes())
            self._f.write(trailer.tobytes())
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
    """A saved run, memory-mapped: `header`, `ids`, `positions`, `rows` [num_scored, V] float16, `targets`.

    `rows_at(k, n)` is how a comparison reads rows: checked against their block's checksum the first time (version
    2); `rows` is the raw map, unchecked. Everything but the rows is checked here, when the file is opened."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                head = f.read(len(MAGIC) + 12)
                if head[: len(MAGIC)] != MAGIC:
                    raise FastarError(f"{self.path}: not a `fastar perplexity --save-logits` file")
                version, hlen = struct.unpack_from("<IQ", head, len(MAGIC))
                if version not in (1, VERSION):
                    raise FastarError(f"{self.path}: logits file version {version} is not supported (1 to {VERSION})")
                size = os.fstat(f.fileno()).st_size
                if len(MAGIC) + 12 + hlen > size:  # read no more than the file holds
                    raise FastarError(f"{self.path}: the logits file is truncated or corrupt (its header length)")
                raw = f.read(hlen)
                self.header = json.loads(raw.decode())
        except FileNotFoundError:
            raise FastarError(f"{self.path}: no such file") from None
        except (struct.error, UnicodeDecodeError, ValueError, RecursionError) as e:
            raise FastarError(f"{self.path}: the logits file is corrupt ({e})") from None
        self.version = version
        start = len(MAGIC) + 12 + hlen
        start += -start % ALIGN
        keys = ("num_tokens", "num_scored", "vocab_size") + (("block_rows",) if version >= 2 else ())
        counts = [self.header.get(k) for k in keys] if isinstance(self.header, dict) else [None] * len(keys)
        if not all(isinstance(c, int) and not isinstance(c, bool) and c >= 0 for c in counts):
            raise FastarError(f"{self.path}: the logits file's header needs {', '.join(keys)} as counts")
        n, m, v = counts[:3]
        self.block_rows = counts[3] if version >= 2 else 0
        if version >= 2 and self.block_rows < 1:
            raise FastarError(f"{self.path}: the logits file's header needs block_rows of at least 1")
        blocks = _num_blocks(m, self.block_rows) if version >= 2 else -1
        at = _offsets(self.header, start, blocks)
        if size != at["end"]:
            why = "truncated" if size < at["end"] else "longer than its header says"
            raise FastarError(
                f"{self.path}: the logits file is {why}: {size:,} bytes, its header ({n:,} tokens, {m:,} scored "
                f"rows of {v:,}) says {at['end']:,}"
            )
        self.ids = np.memmap(self.path, "<i4", "r", at["ids"], (n,))
        self.positions = np.memmap(self.path, "<i4", "r", at["positions"], (m,))
        self.rows = np.memmap(self.path, "<f2", "r", at["rows"], (m, v)) if m else np.zeros((0, v), "<f2")
        self.targets = np.memmap(self.path, "<f4", "r", at["targets"], (m,)) if m else np.zeros(0, "<f4")
        self._digests: np.ndarray | None = None
        self._checked: np.ndarray | None = None
        if version >= 2:
            trailer = np.fromfile(self.path, "<u8", blocks + 1, offset=at["trailer"])
            rest = xxhash.xxh64(raw)
            for part in (self.ids, self.positions, self.targets):
                rest.update(np.ascontiguousarray(part).tobytes())
            if rest.intdigest() != int(trailer[-1]):
                raise FastarError(
                    f"{self.path}: the logits file is corrupt: its header, token ids, scored positions or target "
                    "logprobs do not match their checksum"
                )
            self._digests, self._checked = trailer[:-1], np.zeros(blocks, dtype=bool)

    def rows_at(self, k: int, count: int) -> np.ndarray:
        """Rows [k, k + count), each block they touch checked against its checksum the first time one of its rows is
        read (a FastarError naming the block, its rows and their token positions when it does not match)."""
        if self._digests is not None and count > 0:
            for b in range(k // self.block_rows, (k + count - 1) // self.block_rows + 1):
                if not self._checked[b]:
                    self._check_block(b)
        return self.rows[k : k + count]

    def _check_block(self, b: int) -> None:
        lo, hi = b * self.block_rows, min((b + 1) * self.block_rows, len(self.rows))
        if xxhash.xxh64_intdigest(self.rows[lo:hi]) != int(self._digests[b]):  # (contiguous rows of the map)
            raise FastarError(
                f"{self.path}: the logits file is corrupt: rows {lo:,} to {hi - 1:,} (block {b + 1:,} of "
                f"{len(self._digests):,}; token positions {int(self.positions[lo]):,} to "
                f"{int(self.positions[hi - 1]):,}) do not match their checksum"
            )
        self._checked[b] = True
