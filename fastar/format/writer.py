"""Streaming `.fst` writer: plan every region, then write them in order, then seal the header.

Owns: the write order (a state machine), checksums, the temporary file and the final atomic rename.
Does not own: where tensors come from (the converter and the synthetic-model generator feed it).

States: PLAN (declare tensors, blobs, the expert bank) -> DATA (write each region in planned order) ->
CLOSED (header rewritten with checksums, fsynced, renamed into place) or ABORTED (temporary file removed).
Until CLOSED the output exists only as `<name>.partial`, so an interrupted run never leaves a file that looks
complete; the header of the partial file also carries zero checksums, which `verify` rejects.

Writes of `DIRECT_MIN` bytes or more (the big tensors, every expert record) go through O_DIRECT on a thread of their
own (`fastar.format.write_behind`), so they run at the disk's pace rather than the page cache's writeback and the
caller's next read overlaps them; the header and small tensors go through the page cache. Where O_DIRECT is missing
or its first write is refused (EINVAL: the filesystem wants other alignment), everything goes through the page
cache; the bytes are the same either way.
"""

from __future__ import annotations

import contextlib
import enum
import errno
import json
import os
import shutil
import struct
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..errors import FastarError, FormatError
from . import spec, write_behind
from .write_behind import WriteBehind

_ZERO_DIGEST = "0" * 16
# the most expert records whose checksums fit the header's cap (each digest is `"…", ` in the JSON header)
MAX_EXPERT_RECORDS = spec.MAX_HEADER_SIZE // (len(_ZERO_DIGEST) + 4)
DIRECT_MIN = 64 << 10  # bytes from which a write goes through O_DIRECT


class WriterState(enum.Enum):
    PLAN = "plan"
    DATA = "data"
    CLOSED = "closed"
    ABORTED = "aborted"


class FstWriter:
    """Usage: add_tensor/add_blob/set_expert_bank, begin(), write_* in planned order, finish().

    Used as a context manager, an exception inside the block aborts and removes the partial file.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        config: dict,
        source: dict | None = None,
        converter_version: str = "0",
        direct_io: bool = True,
    ) -> None:
        """direct_io: write the large regions through O_DIRECT where the filesystem allows (module docstring)."""
        self.path = Path(path)
        self._direct: WriteBehind | None = None
        self._direct_tried = not direct_io  # O_DIRECT opened (or given up) once, at the first large write
        if self.path.exists() and not self.path.is_file():  # `-o /dev/null` as root: the rename would replace it
            raise FormatError(f"{self.path}: not a regular file (the output is renamed into place over it)")
        self.tmp_path = self.path.with_name(self.path.name + ".partial")
        self.state = WriterState.PLAN
        self._header: dict[str, Any] = {
            "format": spec.FORMAT_NAME,
            "version": spec.VERSION,
            "converter": {"name": "fastar", "version": converter_version},
            "source": source or {},
            "config": config,
            "tensors": [],
            "blobs": [],
            "experts": None,
        }
        self._regions: list[dict] = []  # tensors and blobs in write order
        self._names: set[str] = set()
        self._next = 0  # index of the next region to write
        self._next_record = 0
        self._f = None
        self.bytes_written = 0

    # --- planning ------------------------------------------------------------------------------------------

    def _expect(self, state: WriterState) -> None:
        if self.state is not state:
            raise FastarError(f"writer is in state {self.state.value}, expected {state.value}")

    def add_tensor(self, name: str, dtype: str, shape: list[int] | tuple[int, ...]) -> None:
        self._expect(WriterState.PLAN)
        if dtype not in spec.DTYPE_SIZES:
            raise FormatError(f"tensor {name}: unsupported storage dtype {dtype}")
        self._add(
            {"name": name, "dtype": dtype, "shape": [int(s) for s in shape], "nbytes": spec.nbytes_of(dtype, shape)},
            "tensors",
        )

    def add_blob(self, name: str, nbytes: int) -> None:
        self._expect(WriterState.PLAN)
        self._add({"name": name, "nbytes": int(nbytes)}, "blobs")

    def _add(self, entry: dict, kind: str) -> None:
        if entry["name"] in self._names:
            raise FormatError(f"duplicate tensor name {entry['name']!r}")
        self._names.add(entry["name"])
        entry.update(offset=0, xxh64=_ZERO_DIGEST)
        self._header[kind].append(entry)
        self._regions.append(entry)

    def set_expert_bank(self, slots: int, experts: int, hidden: int, inter: int) -> None:
        self._expect(WriterState.PLAN)
        records = slots * experts
        if records > MAX_EXPERT_RECORDS:
            raise FormatError(  # (said before a list of that many digests is built: a MemoryError, or minutes)
                f"{self.path}: an expert bank of {records:,} records ({slots} layers x {experts} experts) needs more "
                f"checksums than the header's {spec.MAX_HEADER_SIZE:,}-byte cap holds"
            )
        sections = spec.expert_sections(hidden, inter)
        self._header["experts"] = {
            "offset": 0,
            "stride": spec.expert_stride(sections),
            "slots": slots,
            "experts": experts,
            "sections": sections,
            "xxh64": [_ZERO_DIGEST] * (slots * experts),
        }

    # --- layout --------------------------------------------------------------------------------------------

    def _header_bytes(self) -> bytes:
        return json.dumps(self._header, separators=(",", ":"), sort_keys=False).encode()

    def _layout(self) -> int:
        # Offsets are fixed-width in the JSON only once they are known, so iterate until the header length
        # (which moves data_offset) stops changing; digests are fixed-width placeholders already.
        data_offset = 0
        for _ in range(8):
            off = data_offset
            for r in self._regions:
                r["offset"] = off
                off = spec.align(off + r["nbytes"])
            bank = self._header["experts"]
            if bank is not None:
                bank["offset"] = off
                off += bank["stride"] * bank["slots"] * bank["experts"]
            self._file_size = off
            new = spec.align(spec.PREAMBLE_SIZE + len(self._header_bytes()))
            if new == data_offset:
                break
            data_offset = new
        else:  # pragma: no cover - converges in two rounds
            raise FormatError("header layout did not converge")
        if len(self._header_bytes()) > spec.MAX_HEADER_SIZE:
            raise FormatError(f"header exceeds {spec.MAX_HEADER_SIZE} bytes")
        self._data_offset = data_offset
        return data_offset

    @property
    def file_size(self) -> int:
        """Total size of the finished file (known after begin())."""
        return self._file_size

    def _write_header(self) -> None:
        hb = self._header_bytes()
        pre = struct.pack(
            spec.PREAMBLE_FMT,
            spec.MAGIC,
            spec.VERSION,
            len(hb),
            xxhash.xxh64_intdigest(hb),
            self._data_offset,
            self._file_size,
        )
        self._f.seek(0)
        self._f.write(pre + hb + b"\0" * (self._data_offset - len(pre) - len(hb)))

    # --- data ----------------------------------------------------------------------------------------------

    def begin(self) -> None:
        self._expect(WriterState.PLAN)
        self._layout()
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._f = open(self.tmp_path, "wb")  # noqa: SIM115 (the writer state machine owns it until close)
        except OSError as e:  # a file where a folder should be, a read-only folder: say so of the path asked for
            why = f"{self.path.parent} is not a folder" if isinstance(e, FileExistsError) else e.strerror or e
            if isinstance(e, PermissionError) or e.errno == errno.EROFS:
                why = f"the folder {self.path.parent} is not writable: {e.strerror}"
            raise FormatError(f"{self.path}: cannot write ({why})") from None
        self.state = WriterState.DATA
        try:
            free = shutil.disk_usage(self.tmp_path.parent).free
        except OSError:  # a filesystem that does not say: the writes will tell
            free = self._file_size
        if free < self._file_size:  # said now, not after minutes of writing (a full disk later is still an error)
            self.abort()
            raise FormatError(
                f"{self.path}: needs {self._file_size / 1e9:.2f} GB, {self.path.parent} has {free / 1e9:.2f} GB free"
            )
        # the file at its full size (sparse) first: direct writes inside it do not extend it, which ext4 serializes
        self._guard(self._f.truncate, self._file_size)
        self._guard(self._write_header)

    def _guard(self, fn, *a):
        try:
            return fn(*a)
        except OSError as e:
            self.abort()
            raise FastarError(f"writing {self.tmp_path} failed: {e.strerror or e}") from e

    def _write_at(self, offset: int, data: memoryview) -> None:
        # A direct write is padded with zeros to a multiple of ALIGN: every region starts aligned and owns the bytes
        # up to the next ALIGN boundary (the layout's), an expert record is a whole stride (a multiple of ALIGN)
        n = len(data)
        big = n >= DIRECT_MIN and offset % spec.ALIGN == 0
        if self._direct is not None and big:
            self._direct.write(offset, data)
        elif self._direct is not None:  # through the same thread, in order with the direct writes
            self._direct.write_plain(offset, data)
        elif not (big and self._open_direct(offset, data)):
            self._f.seek(offset)
            self._f.write(data)
        self.bytes_written += n

    def _open_direct(self, offset: int, data: memoryview) -> bool:
        """Whether the write of data at offset went to the write-behind thread (its first one: written and waited
        for here, so a filesystem that refuses O_DIRECT writes falls back to the page cache)."""
        if self._direct_tried:
            return False
        self._direct_tried = True
        self._f.flush()  # the page cache's writes so far reach the file before the other descriptor's
        direct = WriteBehind.open(self.tmp_path)
        if direct is None:
            return False
        try:
            with contextlib.suppress(OSError):  # a write's error stays: `accepted` calls it a refusal or raises it
                direct.write(offset, data)
            if not direct.accepted():
                return False
        except BaseException:
            direct.close()
            raise
        self._direct = direct
        return True

    def _close_direct(self, drain: bool) -> None:
        direct, self._direct = self._direct, None
        if direct is None:
            return
        try:
            if drain:
                direct.drain()
        finally:
            direct.close()

    def write_tensor(self, name: str, array: np.ndarray | bytes) -> None:
        """Write the next planned tensor or blob; `array` holds exactly its bytes (any numpy dtype)."""
        self._expect(WriterState.DATA)
        if self._next >= len(self._regions):
            raise FastarError(f"{name}: all planned tensors are already written")
        r = self._regions[self._next]
        if r["name"] != name:
            raise FastarError(f"expected tensor {r['name']!r} next, got {name!r}")
        buf = memoryview(np.ascontiguousarray(array) if isinstance(array, np.ndarray) else array).cast("B")
        if isinstance(array, np.ndarray) and "shape" in r and list(array.shape) != r["shape"]:
            raise FormatError(f"tensor {name}: shape {list(array.shape)} differs from planned {r['shape']}")
        if len(buf) != r["nbytes"]:
            raise FormatError(f"tensor {name}: {len(buf)} bytes given, {r['nbytes']} planned")
        r["xxh64"] = xxhash.xxh64_hexdigest(buf)
        self._guard(self._write_at, r["offset"], buf)
        self._next += 1

    def write_expert(self, slot: int, e: int, parts) -> None:
        """Write the next expert record; `parts` has the six fields of `ExpertWeights` in checkpoint layout."""
        self._expect(WriterState.DATA)
        bank = self._header["experts"]
        if self._next != len(self._regions):
            raise FastarError("resident tensors must be written before experts")
        want = self._next_record
        if bank is None or slot * bank["experts"] + e != want:
            raise FastarError(
                f"expected expert record {divmod(want, bank['experts']) if bank else None}, got ({slot}, {e})"
            )
        arrays = []
        for sec, arr in zip(bank["sections"], parts):
            a = np.ascontiguousarray(arr)
            if list(a.shape) != sec["shape"] or a.nbytes != sec["nbytes"]:
                raise FormatError(
                    f"expert (layer {slot}, id {e}) {sec['field']}: shape {list(a.shape)}, expected {sec['shape']}"
                )
            arrays.append(a.view(np.uint8).reshape(-1).data)
        stride, offset = bank["stride"], spec.expert_offset(bank["offset"], bank["stride"], bank["experts"], slot, e)
        direct = self._direct is not None and stride <= write_behind.CHUNK
        # built in one of the write-behind's buffers where it runs (no copy of 13 MB a record), else in its own
        buf = self._guard(self._direct.take) if direct else memoryview(bytearray(stride))
        rec = buf[:stride]
        end = 0
        for sec, a in zip(bank["sections"], arrays):
            rec[end : sec["offset"]] = bytes(sec["offset"] - end)  # the gaps are zero, whatever the buffer held
            end = sec["offset"] + sec["nbytes"]
            rec[sec["offset"] : end] = a
        rec[end:stride] = bytes(stride - end)
        bank["xxh64"][want] = xxhash.xxh64_hexdigest(rec)
        if direct:
            self._guard(self._direct.put, buf, stride, offset)
            self.bytes_written += stride
        else:
            self._guard(self._write_at, offset, rec)
        self._next_record += 1

    def finish(self) -> Path:
        """Check that everything planned was written, seal the header, fsync, and rename into place."""
        self._expect(WriterState.DATA)
        bank = self._header["experts"]
        missing = len(self._regions) - self._next
        if missing:
            self.abort()
            raise FastarError(f"{missing} planned tensors were never written (next: {self._regions[-missing]['name']})")
        if bank is not None and self._next_record != bank["slots"] * bank["experts"]:
            self.abort()
            raise FastarError(f"only {self._next_record} of {bank['slots'] * bank['experts']} expert records written")

        def seal():
            self._close_direct(drain=True)  # every record on disk before the header says the file is whole
            self._f.truncate(self._file_size)
            self._write_header()
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            os.replace(self.tmp_path, self.path)

        self._guard(seal)
        self.state = WriterState.CLOSED
        return self.path

    def abort(self) -> None:
        if self.state in (WriterState.CLOSED, WriterState.ABORTED):
            return
        self.state = WriterState.ABORTED
        try:
            self._close_direct(drain=False)
        except OSError:
            pass
        if self._f is not None:
            try:
                self._f.close()
            except OSError:
                pass
        if self._f is None:  # never made: on a read-only filesystem the unlink would say EROFS of the .partial
            return  # name, in place of the error that stopped the write
        with contextlib.suppress(OSError):  # a cleanup that fails must not hide the error that called it
            os.unlink(self.tmp_path)

    def __enter__(self) -> FstWriter:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self.abort()
        elif self.state is WriterState.DATA:
            self.abort()
            raise FastarError("writer closed without finish()")
