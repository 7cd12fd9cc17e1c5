"""`.fst` v3 reader: validates the preamble and header, memory-maps the file, hands out zero-copy views.

Owns: parsing and structural validation (header size cap, checksum of the header, no duplicate names, no holes
or overlaps, every extent inside the file), `WeightSource` over the file, `pread` of one expert record into a
caller's buffer (optionally through O_DIRECT), full checksum verification, and checked reads (each resident tensor
checked the first time it is handed out, from the bytes handed out: `check_reads`, `check_unread`). Imports no torch.
Does not own: caching experts (`fastar.weights.expert_cache`).
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import xxhash

from ..config import ModelConfig
from ..contracts import Closing, ExpertWeights, PagedSource
from ..errors import ConfigError, FormatError
from . import spec


def _fail(path, msg: str) -> FormatError:
    return FormatError(f"{path}: {msg}")


def _what_it_is(head: bytes) -> str:
    """A hint naming the format a file that is no .fst starts like, for the files a user is likely to give instead:
    a shard or the config of the official checkpoint (give its folder), or a GGUF file."""
    if head.startswith(b"GGUF"):
        return ": a GGUF file; fastar runs .fst files (`fastar convert` makes one from the official checkpoint)"
    if len(head) > 8 and head[8:9] == b"{" and 2 <= int.from_bytes(head[:8], "little") < 1 << 30:
        return ": a safetensors file; give the checkpoint folder it belongs to (or `fastar convert` that folder)"
    if head.lstrip()[:1] == b"{":
        return ": a JSON file; give the checkpoint folder it belongs to (or `fastar convert` that folder)"
    return ""


def read_preamble(path: str | os.PathLike, f) -> tuple[int, int, int, int, int]:
    raw = f.read(spec.PREAMBLE_SIZE)
    if len(raw) < spec.PREAMBLE_SIZE:
        raise _fail(path, f"file is {len(raw)} bytes, too short for a .fst preamble")
    magic, version, hlen, hsum, data_offset, file_size = struct.unpack(spec.PREAMBLE_FMT, raw)
    if magic != spec.MAGIC:
        raise _fail(path, f"not a .fst file (bad magic){_what_it_is(raw)}")
    return version, hlen, hsum, data_offset, file_size


def _check_int(path, v, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise _fail(path, f"header: {what} must be a non-negative integer, got {v!r}")
    return v


def parse_header(path, hb: bytes, data_offset: int, file_size: int) -> dict:
    """Validate the JSON header against the layout rules; raise FormatError on anything ambiguous."""
    try:
        h = json.loads(hb.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # (too many digits; nested too deep)
        raise _fail(path, f"header is not valid JSON ({e})") from None
    if not isinstance(h, dict) or h.get("format") != spec.FORMAT_NAME or h.get("version") != spec.VERSION:
        raise _fail(path, "header does not describe a fastar.fst v3 file")
    for key, typ in (("config", dict), ("tensors", list), ("blobs", list), ("source", dict), ("converter", dict)):
        if not isinstance(h.get(key), typ):
            raise _fail(path, f"header field {key!r} missing or not a {typ.__name__}")
    names: set[str] = set()
    expect = data_offset
    for kind in ("tensors", "blobs"):
        for t in h[kind]:
            if not isinstance(t, dict) or not isinstance(t.get("name"), str):
                raise _fail(path, f"header: malformed {kind} entry {t!r}"[:200])
            name = t["name"]
            if name in names:
                raise _fail(path, f"duplicate tensor name {name!r}")
            names.add(name)
            off = _check_int(path, t.get("offset"), f"{name} offset")
            n = _check_int(path, t.get("nbytes"), f"{name} nbytes")
            if kind == "tensors":
                dt, shape = t.get("dtype"), t.get("shape")
                if not isinstance(dt, str) or dt not in spec.DTYPE_SIZES:
                    raise _fail(path, f"tensor {name}: unknown dtype {dt!r}")
                if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
                    raise _fail(path, f"tensor {name}: malformed shape {shape!r}")
                if spec.nbytes_of(dt, shape) != n:
                    raise _fail(path, f"tensor {name}: {n} bytes do not match {dt}{shape}")
            if not isinstance(t.get("xxh64"), str) or len(t["xxh64"]) != 16:
                raise _fail(path, f"tensor {name}: malformed checksum")
            if off != expect:
                what = "overlaps the previous region" if off < expect else "leaves a hole before it"
                raise _fail(path, f"tensor {name} at offset {off} {what} (expected {expect})")
            if off + n > file_size:
                raise _fail(path, f"tensor {name} extends past the end of the file")
            expect = spec.align(off + n)
    bank = h.get("experts")
    if bank is not None:
        if not isinstance(bank, dict):
            raise _fail(path, "header: malformed expert bank")
        for k in ("offset", "stride", "slots", "experts"):
            _check_int(path, bank.get(k), f"experts.{k}")
        if bank["offset"] != expect:
            raise _fail(path, f"expert bank at {bank['offset']} does not follow the resident region ({expect})")
        secs = bank.get("sections")
        fields = [s.get("field") if isinstance(s, dict) else None for s in secs] if isinstance(secs, list) else None
        if fields != list(spec.EXPERT_FIELDS):
            raise _fail(path, "header: expert sections malformed")
        end = 0
        for s in secs:
            if (
                not isinstance(s.get("dtype"), str)
                or s["dtype"] not in spec.DTYPE_SIZES
                or not isinstance(s.get("shape"), list)
                or not all(isinstance(d, int) and d >= 0 for d in s["shape"])
            ):
                raise _fail(path, f"expert section {s.get('field')}: malformed")
            if _check_int(path, s.get("offset"), "section offset") < end or spec.nbytes_of(
                s["dtype"], s["shape"]
            ) != _check_int(path, s.get("nbytes"), "section nbytes"):
                raise _fail(path, f"expert section {s['field']}: bad offset or size")
            end = s["offset"] + s["nbytes"]
        if end > bank["stride"] or bank["stride"] % spec.ALIGN:
            raise _fail(path, "expert stride smaller than a record or not page-aligned")
        n_rec = bank["slots"] * bank["experts"]
        if (
            not isinstance(bank.get("xxh64"), list)
            or len(bank["xxh64"]) != n_rec
            or not all(isinstance(d, str) and len(d) == 16 for d in bank["xxh64"])
        ):
            raise _fail(path, "expert checksums missing")
        expect = bank["offset"] + n_rec * bank["stride"]
    if expect != file_size:
        raise _fail(path, f"regions end at {expect} but the preamble says the file is {file_size} bytes")
    return h


def expert_views(sections: list[dict], buf, base: int = 0) -> ExpertWeights:
    """Split one expert record's bytes (any buffer) into the six arrays of `ExpertWeights`, without copying."""
    parts = []
    for s in sections:
        a = np.frombuffer(buf, dtype=np.uint8, count=s["nbytes"], offset=base + s["offset"])
        parts.append(a.reshape(s["shape"]))
    return ExpertWeights(*parts)


class MappedFile(Closing):
    """A file held open as a descriptor (`_fd`) and a read-only mapping (`_mm`, None for an empty file)."""

    _fd: int = -1
    _mm: mmap.mmap | None = None

    def close(self) -> None:
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # views still alive; the mapping goes when they do
                pass
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class FstFile(MappedFile, PagedSource):
    """A `.fst` v3 file opened for reading: a `fastar.contracts.PagedSource` (with `header`, `read_tensor`)."""

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self._fd = -1
        # checked reads (`check_reads`): the resident regions not yet checked, by name; None: reads are not checked
        self._unchecked: dict[str, dict] | None = None
        self._check_note = ""
        if self.path.is_dir():
            raise FormatError(f"{self.path}: is a directory, not a .fst file")
        if self.path.exists() and not self.path.is_file():  # a FIFO would block the open forever
            raise FormatError(f"{self.path}: not a regular file")
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            raise FormatError(f"{self.path}: no such file") from None
        except OSError as e:
            raise FormatError(f"{self.path}: cannot open ({e.strerror})") from None
        try:
            self._open()
        except BaseException:
            self.close()  # resets _fd: nothing is closed twice
            raise

    def _open(self) -> None:
        path = self.path
        actual = os.fstat(self._fd).st_size
        with open(self._fd, "rb", closefd=False) as f:
            version, hlen, hsum, data_offset, file_size = read_preamble(path, f)
            if version != spec.VERSION:
                raise _fail(path, f"unsupported .fst version {version} (this reader handles {spec.VERSION})")
            if hlen > spec.MAX_HEADER_SIZE:
                raise _fail(path, f"header length {hlen} exceeds the {spec.MAX_HEADER_SIZE}-byte cap")
            if data_offset != spec.align(spec.PREAMBLE_SIZE + hlen):
                raise _fail(path, f"data offset {data_offset} does not follow the header")
            if actual < file_size:
                raise _fail(path, f"file is truncated: {actual} bytes, expected {file_size}")
            if actual > file_size:
                raise _fail(path, f"file has {actual - file_size} trailing bytes past its declared end")
            hb = f.read(hlen)
        if len(hb) != hlen:
            raise _fail(path, "file is truncated inside the header")
        if xxhash.xxh64_intdigest(hb) != hsum:
            raise _fail(path, "header checksum mismatch (the header is corrupt)")
        try:
            self.header = parse_header(path, hb, data_offset, file_size)
        except (TypeError, KeyError, AttributeError, ValueError) as e:
            if isinstance(e, FormatError):
                raise
            raise _fail(path, f"malformed header ({type(e).__name__}: {e})") from None
        self.file_size = file_size
        try:
            self.config = ModelConfig.from_dict(self.header["config"])
        except ConfigError as e:
            raise _fail(path, str(e)) from None
        self._tensors = {t["name"]: t for t in self.header["tensors"]}
        self._blobs = {b["name"]: b for b in self.header["blobs"]}
        self.bank = self.header["experts"]
        self._mm = mmap.mmap(self._fd, 0, access=mmap.ACCESS_READ) if file_size else None
        if self.bank is not None:
            c = self.config
            if self.bank["slots"] != c.num_layer_slots or self.bank["experts"] != c.n_routed_experts:
                raise _fail(path, "expert bank geometry does not match the config")
            want = spec.expert_sections(c.hidden_size, c.moe_intermediate_size)
            if self.bank["sections"] != want:
                raise _fail(path, "expert sections do not match the config's widths")

    # --- WeightSource --------------------------------------------------------------------------------------

    def has(self, name: str) -> bool:
        return name in self._tensors

    def names(self) -> list[str]:
        return list(self._tensors)

    def dtype(self, name: str) -> str:
        return self._entry(name)["dtype"]

    def nbytes(self, name: str) -> int:
        return self._entry(name)["nbytes"]

    def _entry(self, name: str) -> dict:
        try:
            return self._tensors[name]
        except KeyError:
            raise FormatError(f"{self.path}: no tensor named {name!r}") from None

    def tensor(self, name: str) -> np.ndarray:
        t = self._entry(name)
        if self._unchecked and name in self._unchecked:
            self._check_mapped(t)
        a = np.frombuffer(
            self._mm,
            dtype=spec.NUMPY_DTYPES[t["dtype"]],
            count=t["nbytes"] // spec.DTYPE_SIZES[t["dtype"]],
            offset=t["offset"],
        )
        return a.reshape(t["shape"])

    def read_tensor(self, name: str) -> np.ndarray:
        """A tensor read into its own anonymous memory (numpy maps arrays this big with transparent huge pages) instead
        of viewed through the file's mapping: streamed every token, it then costs a TLB entry per 2 MB, not per 4 KB
        (the LM head read 5 % faster, measured), and the page cache does not keep a second copy (dropped after)."""
        t = self._entry(name)
        out = np.empty(t["nbytes"] // spec.DTYPE_SIZES[t["dtype"]], spec.NUMPY_DTYPES[t["dtype"]])
        mv, done = memoryview(out).cast("B"), 0
        while done < t["nbytes"]:
            got = os.preadv(self._fd, [mv[done : done + (1 << 30)]], t["offset"] + done)
            if got <= 0:
                raise FormatError(f"{self.path}: short read of tensor {name!r} (file truncated?)")
            done += got
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(self._fd, t["offset"], t["nbytes"], os.POSIX_FADV_DONTNEED)
        self._check(t, out)  # the bytes just read, which the caller keeps
        return out.reshape(t["shape"])

    def blob(self, name: str) -> bytes | None:
        b = self._blobs.get(name)
        if b is None:
            return None
        out = bytes(self._mm[b["offset"] : b["offset"] + b["nbytes"]])
        self._check(b, out)
        return out

    def tokenizer_json(self) -> bytes | None:
        return self.blob("tokenizer.json")

    def expert_offset(self, slot: int, e: int) -> int:
        b = self.bank
        if b is None or not (0 <= slot < b["slots"] and 0 <= e < b["experts"]):
            raise FormatError(f"{self.path}: no expert (layer {slot}, id {e})")
        return spec.expert_offset(b["offset"], b["stride"], b["experts"], slot, e)

    @property
    def expert_stride(self) -> int:
        return self.bank["stride"]

    @property
    def resident_bytes(self) -> int:
        """Bytes of everything but the routed experts (read every token)."""
        return self.bank["offset"] if self.bank is not None else self.file_size

    def expert_views(self, buf, base: int = 0) -> ExpertWeights:
        """Split one record's bytes (any buffer) into the six arrays of `ExpertWeights`, without copying."""
        return expert_views(self.bank["sections"], buf, base)

    def expert(self, slot: int, e: int) -> ExpertWeights:
        return self.expert_views(self._mm, self.expert_offset(slot, e))

    def read_expert_into(self, slot: int, e: int, buf, fd: int | None = None) -> ExpertWeights:
        """`pread` one record into `buf` (writable, >= stride bytes; page-aligned when `fd` is O_DIRECT)."""
        off = self.expert_offset(slot, e)
        mv = memoryview(buf).cast("B")[: self.bank["stride"]]
        got = os.preadv(self._fd if fd is None else fd, [mv], off)
        if got != len(mv):
            raise FormatError(
                f"{self.path}: short read of expert (layer {slot}, id {e}): {got} of {len(mv)} bytes (file truncated?)"
            )
        return self.expert_views(mv)

    supports_direct_io = hasattr(os, "O_DIRECT")  # one record is one aligned extent of the file

    def open_direct(self) -> int | None:
        """A second descriptor with O_DIRECT (bypasses the page cache), or None where unsupported."""
        flag = getattr(os, "O_DIRECT", 0)
        if not flag:
            return None
        try:
            return os.open(self.path, os.O_RDONLY | flag)
        except OSError:
            return None

    # --- checked reads -------------------------------------------------------------------------------------

    def check_reads(self, note: str = "") -> None:
        """From now on each resident tensor and blob is checked against its xxh64 the first time `tensor`,
        `read_tensor` or `blob` hands it out, from the bytes handed out (the memory `read_tensor` read into, the
        page cache's pages a view maps): what is built on them is checked, and the file is read once, not once to
        check and again to build. A mismatch is a FormatError naming the region (`note` appended: what the caller's user
        can do); `check_unread` then checks those never handed out."""
        self._unchecked = {t["name"]: t for t in self.header["tensors"] + self.header["blobs"]}
        self._check_note = note

    def check_unread(self, progress: Callable[[int], None] | None = None) -> None:
        """Check the resident regions `check_reads` has not yet seen handed out (read as `verify` reads), so that
        with those handed out every resident byte has been checked once; raises FormatError naming the first bad
        one (and how many more)."""
        if self._unchecked is None:
            raise RuntimeError("check_unread without check_reads")
        rest = list(self._unchecked.values())
        bad = self._verify_regions([(t["name"], t["offset"], t["nbytes"], t["xxh64"]) for t in rest], progress)
        if bad:
            raise self._corrupt(bad)
        for t in rest:
            self._unchecked.pop(t["name"], None)

    def check_expert(self, slot: int, e: int) -> None:
        """Raise a FormatError naming record (slot, e) when its bytes fail its xxh64 (read with `pread`, as `verify`
        reads: through the page cache a following `expert` view maps). For whole-file readers such as `export`."""
        b = self.bank
        label = f"expert (layer {slot}, id {e})"
        digest = b["xxh64"][slot * b["experts"] + e] if b is not None else ""
        if self._verify_regions([(label, self.expert_offset(slot, e), b["stride"], digest)], None):
            raise FormatError(f"{self.path}: {label} fails its checksum: the file is corrupt{self._check_note}")

    def _corrupt(self, bad: list[str]) -> FormatError:
        more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
        note = self._check_note
        return FormatError(f"{self.path}: tensor {bad[0]!r}{more} fails its checksum: the file is corrupt{note}")

    def _check(self, t: dict, buf) -> None:
        """`buf` (the bytes of region `t` about to be handed out) against its checksum, where reads are checked and
        it has not been yet. Several threads may check one region at once: each hashes its own bytes."""
        if self._unchecked and t["name"] in self._unchecked:
            if xxhash.xxh64_hexdigest(buf) != t["xxh64"]:
                raise self._corrupt([t["name"]])
            self._unchecked.pop(t["name"], None)

    def _check_mapped(self, t: dict) -> None:
        """`_check` of a region about to be handed out as a view of the mapping: read with `pread` (as `verify`
        reads, through the page cache whose pages the view then maps), not hashed through the mapping itself, which
        would map every page into this process (+1.3 GB of RSS on the 4-layer Flash-width model, the embedding's
        rows included, which a lookup reads a few at a time)."""
        if self._unchecked and t["name"] in self._unchecked:
            if self._verify_regions([(t["name"], t["offset"], t["nbytes"], t["xxh64"])], None):
                raise self._corrupt([t["name"]])
            self._unchecked.pop(t["name"], None)

    # --- verification --------------------------------------------------------------------------------------

    def regions(self, experts: bool = True) -> Iterator[tuple[str, int, int, str]]:
        """(label, offset, nbytes, expected xxh64) for every checksummed region, in file order; `experts=False`:
        the resident tensors and blobs only."""
        for t in self.header["tensors"] + self.header["blobs"]:
            yield t["name"], t["offset"], t["nbytes"], t["xxh64"]
        b = self.bank
        if b is not None and experts:
            for i, digest in enumerate(b["xxh64"]):
                slot, e = divmod(i, b["experts"])
                offset = spec.expert_offset(b["offset"], b["stride"], b["experts"], slot, e)
                yield f"expert (layer {slot}, id {e})", offset, b["stride"], digest

    def verify(self, progress: Callable[[int], None] | None = None, experts: bool = True) -> list[str]:
        """Check every checksum (`experts=False`: all but the expert bank's). Returns the labels of bad regions
        (empty when the file is intact)."""
        return self._verify_regions(self.regions(experts), progress)

    def _verify_regions(
        self, regions: Iterable[tuple[str, int, int, str]], progress: Callable[[int], None] | None
    ) -> list[str]:
        """The labels of `regions` (label, offset, nbytes, xxh64) whose bytes fail their checksum.

        Reads with `pread` into two reusable buffers of up to 64 MiB, the next chunk read on a helper thread while
        this one hashes (both release the GIL), so verification runs near the disk's sequential speed.
        """
        from concurrent.futures import ThreadPoolExecutor

        regions = list(regions)
        chunk = max(1, min(64 << 20, max((n for _, _, n, _ in regions), default=0)))  # one region: its size
        jobs = [
            (label, digest, pos, min(chunk, off + n - pos))
            for label, off, n, digest in regions
            for pos in range(off, off + max(n, 1), chunk)
        ]
        bufs = [bytearray(chunk) for _ in jobs[:2]]  # one for a region of one chunk, read on this thread below
        bad: list[str] = []
        hashers: dict[str, xxhash.xxh64] = {}
        ends = {}
        for i, (label, *_rest) in enumerate(jobs):
            ends[label] = i

        def read(i: int) -> memoryview:
            _, _, pos, size = jobs[i]
            mv = memoryview(bufs[i % 2])[:size]
            got = os.preadv(self._fd, [mv], pos) if size else 0
            if got != size:
                raise FormatError(f"{self.path}: short read at offset {pos} (file truncated?)")
            return mv

        if hasattr(os, "posix_fadvise"):  # doubles kernel readahead on a cold file
            os.posix_fadvise(self._fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        # one chunk (a tensor checked as the engine reads it, most of them): read here, no thread to start for it
        pool = ThreadPoolExecutor(1) if len(jobs) > 1 else None
        try:
            nxt = pool.submit(read, 0) if pool is not None else None
            for i, (label, digest, _pos, size) in enumerate(jobs):
                mv = nxt.result() if pool is not None else read(i)
                nxt = pool.submit(read, i + 1) if pool is not None and i + 1 < len(jobs) else None
                h = hashers.setdefault(label, xxhash.xxh64())
                h.update(mv)
                if progress:
                    progress(size)
                if ends[label] == i and hashers.pop(label).hexdigest() != digest:
                    bad.append(label)
        finally:
            if pool is not None:
                pool.shutdown()
        return bad
