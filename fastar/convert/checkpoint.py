"""Reader for an official DeepSeek-V4 checkpoint directory (HF layout), by byte ranges.

Owns: `Checkpoint` — parsing `config.json`, `model.safetensors.index.json` (or a single `model.safetensors`)
and every shard's safetensors header ourselves; `read()` of one tensor with `os.pread` (never a whole shard);
`validate()` against the official manifest (`fastar.convert.names`) touching headers only; and the
`WeightSource` protocol so the engine can run straight from a checkpoint. Does not own: the manifest itself
(`names`), decoding of FP8/FP4 values (`fastar.quant`), or writing `.fst` files.

Arrays come back in storage precision (see `fastar.weights.source`): F8_*/I8/U8 -> uint8, BF16 -> uint16,
F32 -> float32, I64 -> int64, shaped as stored.
"""

from __future__ import annotations

import hashlib
import json
import os
import stat
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..contracts import Closing, ExpertWeights, PagedSource
from ..errors import CheckpointError
from ..format import spec
from ..format.reader import expert_views
from .names import (
    DTYPE_SIZES,
    expected_tensors,
    expert_tensor_names,
    highest_layer_and_expert,
    is_routed_expert,
    mtp_blocks_in,
    tensor_nbytes,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
# Real V4-Flash shards carry ~1,500 tensors each (headers of a few hundred KB); anything near this cap is
# corrupt, and the cap keeps a bad length field from making us allocate gigabytes.
MAX_HEADER_BYTES = 100 * 1024 * 1024
# pread/preadv are capped near 2 GiB per call on Linux; read big tensors in pieces.
_READ_CHUNK = 1 << 30

_NP_DTYPES: dict[str, np.dtype] = {
    "BOOL": np.dtype(np.uint8),
    "U8": np.dtype(np.uint8),
    "I8": np.dtype(np.uint8),
    "F8_E4M3": np.dtype(np.uint8),
    "F8_E5M2": np.dtype(np.uint8),
    "F8_E8M0": np.dtype(np.uint8),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<u2"),
    "BF16": np.dtype("<u2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "F64": np.dtype("<f8"),
}


@dataclass(frozen=True, slots=True)
class TensorInfo:
    """Where one tensor lives: dtype string, shape, shard file and absolute byte range in that file."""

    dtype: str
    shape: tuple[int, ...]
    shard: Path
    offset: int
    nbytes: int


def _pread_into(fd: int, buf: memoryview, offset: int) -> int:
    """Read at `offset` into `buf` without moving the file position (safe across threads)."""
    if hasattr(os, "preadv"):
        return os.preadv(fd, [buf], offset)
    data = os.pread(fd, len(buf), offset)  # platforms without preadv: one extra copy
    buf[: len(data)] = data
    return len(data)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def parse_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check one shard's header: size cap, JSON shape, dtypes, offsets inside the file, no overlap."""
    try:
        st = path.stat()
        if not stat.S_ISREG(st.st_mode):  # a FIFO would block the open forever, a device read without end
            raise CheckpointError(f"shard {path.name}: not a regular file ({path})")
        size = st.st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CheckpointError(f"shard {path.name}: truncated ({size} bytes, no safetensors header)")
            n = int.from_bytes(head, "little")
            if n > MAX_HEADER_BYTES:
                raise CheckpointError(f"shard {path.name}: corrupt safetensors header (claims {n} bytes)")
            if 8 + n > size:
                raise CheckpointError(f"shard {path.name}: truncated (header of {n} bytes, file of {size})")
            raw = f.read(n)
    except FileNotFoundError:
        raise CheckpointError(f"shard {path.name} is missing (expected at {path})") from None
    except OSError as e:
        raise CheckpointError(f"shard {path.name}: cannot read: {e}") from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as e:  # (too many digits; nested too deep)
        raise CheckpointError(f"shard {path.name}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"shard {path.name}: corrupt safetensors header (not a JSON object)")
    data_start, data_len = 8 + n, size - 8 - n
    out: dict[str, TensorInfo] = {}
    spans: list[tuple[int, int, str]] = []
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        where = f"tensor {name} in shard {path.name}"
        if not isinstance(entry, dict):
            raise CheckpointError(f"{where}: corrupt header entry")
        dtype, shape, offs = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
        if dtype not in DTYPE_SIZES:
            raise CheckpointError(f"{where}: unknown dtype {dtype!r}")
        if not isinstance(shape, list) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in shape
        ):
            raise CheckpointError(f"{where}: corrupt shape {shape!r}")
        if (
            not isinstance(offs, list)
            or len(offs) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offs)
        ):
            raise CheckpointError(f"{where}: corrupt data_offsets {offs!r}")
        begin, end = offs
        nbytes = tensor_nbytes(dtype, tuple(shape))
        if not 0 <= begin <= end or end - begin != nbytes:
            raise CheckpointError(f"{where}: data_offsets {offs} do not match {dtype} {shape} ({nbytes} bytes)")
        if end > data_len:
            raise CheckpointError(
                f"{where}: shard is truncated (tensor ends at byte {data_start + end}, file has {size})"
            )
        spans.append((begin, end, name))
        out[name] = TensorInfo(dtype, tuple(shape), path, data_start + begin, nbytes)
    # sorted by start, any overlap shows up against the furthest-reaching earlier span; empty tensors never overlap
    spans = sorted(s for s in spans if s[1] > s[0])
    reach, reach_name = 0, ""
    for begin, end, name in spans:
        if begin < reach:
            raise CheckpointError(f"shard {path.name}: tensors {reach_name} and {name} overlap")
        if end > reach:
            reach, reach_name = end, name
    return out


class Checkpoint(Closing, PagedSource):
    """An official DeepSeek-V4 checkpoint directory, read tensor by tensor. Also a `PagedSource` (no `header`:
    the config identifies it; no `read_tensor`: `tensor` already reads into memory of its own)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        if not self.path.is_dir():
            raise CheckpointError(f"checkpoint directory {self.path} does not exist")
        cfg_path = self.path / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(f"{cfg_path} {'is not a regular file' if cfg_path.exists() else 'is missing'}")
        try:
            self.hf_config: dict[str, Any] = json.loads(cfg_path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # (too many digits; nested too deep)
            raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from None
        if not isinstance(self.hf_config, dict):
            raise CheckpointError(f"{cfg_path} is not a JSON object")
        self._lock = threading.Lock()
        self._headers: dict[str, dict[str, TensorInfo]] = {}
        self._fds: dict[Path, int] = {}
        index = self.path / INDEX_FILE
        if index.exists() and not index.is_file():  # a FIFO or a folder: not "no index"
            raise CheckpointError(f"{index} is not a regular file")
        if index.is_file():
            self.index_path: Path | None = index
            try:
                doc = json.loads(index.read_text(encoding="utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError) as e:  # (too many digits; nested too deep)
                raise CheckpointError(f"{index} is not a valid index: {e}") from None
            if not isinstance(doc, dict):
                raise CheckpointError(f"{index} is not a JSON object (with a weight_map)")
            wm = doc.get("weight_map")
            if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
                raise CheckpointError(f"{index} has no valid weight_map")
            for shard in set(wm.values()):
                if Path(shard).name != shard:  # an index must not point outside the directory
                    raise CheckpointError(f"{index}: shard name {shard!r} is not a plain file name")
            self._weight_map: dict[str, str] = dict(wm)
        elif (self.path / SINGLE_FILE).is_file():
            self.index_path = None
            self._weight_map = {name: SINGLE_FILE for name in self._header(SINGLE_FILE)}
        else:
            raise CheckpointError(f"{self.path} has neither {INDEX_FILE} nor {SINGLE_FILE}")

    # --- files -----------------------------------------------------------------------------------------------

    @property
    def shard_names(self) -> list[str]:
        return sorted(set(self._weight_map.values()))

    def _header(self, shard: str) -> dict[str, TensorInfo]:
        h = self._headers.get(shard)
        if h is None:
            h = parse_safetensors_header(self.path / shard)
            self._headers[shard] = h
        return h

    def _fd(self, shard: Path) -> int:
        with self._lock:
            fd = self._fds.get(shard)
            if fd is None:
                fd = os.open(shard, os.O_RDONLY | getattr(os, "O_BINARY", 0))
                self._fds[shard] = fd
            return fd

    def close(self) -> None:
        with self._lock:
            for fd in self._fds.values():
                os.close(fd)
            self._fds.clear()

    # --- config ----------------------------------------------------------------------------------------------

    @cached_property
    def config(self) -> ModelConfig:
        """ModelConfig from config.json; the MTP/DSpark block count is taken from the tensors present. A config
        claiming more layers or routed experts than the index names any tensor of is refused here, before a
        manifest of that size is built (a million layers took minutes and gigabytes to be found missing)."""
        cfg = ModelConfig.from_hf(self.hf_config, num_mtp_layers=mtp_blocks_in(self._weight_map))
        layers, experts = highest_layer_and_expert(self._weight_map)
        for field, said, top in (
            ("num_hidden_layers", cfg.num_hidden_layers, layers),
            ("n_routed_experts", cfg.n_routed_experts, experts),
        ):
            if said > top + 1:
                held = f"ids 0..{top}" if top >= 0 else "none"
                raise CheckpointError(
                    f"{self.path / 'config.json'} says {field} = {said}, but the checkpoint's tensors name {held}"
                )
        return cfg

    def tokenizer_json(self) -> bytes | None:
        """The checkpoint's tokenizer.json (None without one). One that is no regular file (a FIFO would block the
        read, a folder holds none) is a CheckpointError naming it, not a model converted without its tokenizer."""
        p = self.path / "tokenizer.json"
        if not p.exists():
            return None
        if not p.is_file():
            raise CheckpointError(f"{p} is not a regular file")
        return p.read_bytes()

    def identity(self) -> dict[str, Any]:
        """What identifies this checkpoint cheaply: hashes of config and index, shard names and sizes."""
        shards = []
        for s in self.shard_names:
            p = self.path / s
            shards.append({"name": s, "size": p.stat().st_size if p.exists() else None})
        return {
            "config_sha256": _sha256(self.path / "config.json"),
            "index_sha256": _sha256(self.index_path) if self.index_path else None,
            "shards": shards,
        }

    # --- tensors ---------------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        return list(self._weight_map)

    def has(self, name: str) -> bool:
        return name in self._weight_map

    def shard_of(self, name: str) -> str | None:
        """The shard file the index places `name` in (its header is not read: the shard may be absent)."""
        return self._weight_map.get(name)

    def tensor_info(self, name: str) -> TensorInfo:
        shard = self._weight_map.get(name)
        if shard is None:
            raise CheckpointError(f"tensor {name} is not in checkpoint {self.path}")
        ti = self._header(shard).get(name)
        if ti is None:
            raise CheckpointError(f"tensor {name}: the index places it in shard {shard}, whose header lacks it")
        return ti

    def info(self, name: str) -> tuple[str, tuple[int, ...], Path]:
        ti = self.tensor_info(name)
        return ti.dtype, ti.shape, ti.shard

    def dtype(self, name: str) -> str:
        return self.tensor_info(name).dtype

    def read(self, name: str) -> np.ndarray:
        """One tensor's bytes as a fresh array in storage precision (see module docstring)."""
        ti = self.tensor_info(name)
        out = np.empty(ti.shape, dtype=_NP_DTYPES[ti.dtype])
        buf = memoryview(out.reshape(-1).view(np.uint8))
        fd, done = self._fd(ti.shard), 0
        while done < ti.nbytes:
            n = _pread_into(fd, buf[done : done + _READ_CHUNK], ti.offset + done)
            if n <= 0:
                raise CheckpointError(
                    f"tensor {name} in shard {ti.shard.name}: shard is truncated "
                    f"(short read at byte {ti.offset + done})"
                )
            done += n
        return out

    tensor = read

    def expert(self, layer: int, expert: int) -> ExpertWeights:
        """Routed expert `expert` of layer slot `layer` (mtp.k is slot num_hidden_layers + k)."""
        names = expert_tensor_names(layer, expert, self.config)
        return ExpertWeights(**{f: self.read(n) for f, n in names.items()})

    # --- paging: the same record interface as FstFile, so the expert cache pages straight from the shards ---

    @cached_property
    def bank(self) -> dict:
        """Expert-record geometry in the `.fst` layout (records assembled from six byte ranges on read)."""
        cfg = self.config
        sections = spec.expert_sections(cfg.hidden_size, cfg.moe_intermediate_size)
        return {
            "slots": cfg.num_layer_slots,
            "experts": cfg.n_routed_experts,
            "stride": spec.expert_stride(sections),
            "sections": sections,
        }

    @property
    def expert_stride(self) -> int:
        return self.bank["stride"]

    @cached_property
    def resident_bytes(self) -> int:
        return sum(self.tensor_info(n).nbytes for n in self.names() if not is_routed_expert(n))

    def expert_views(self, buf, base: int = 0) -> ExpertWeights:
        return expert_views(self.bank["sections"], buf, base)

    def read_expert_into(self, slot: int, e: int, buf, fd: int | None = None) -> ExpertWeights:
        """Read expert (slot, e) into `buf` (>= stride bytes) in `.fst` record layout: one pread per tensor."""
        names = expert_tensor_names(slot, e, self.config)
        mv = memoryview(buf).cast("B")
        for sec in self.bank["sections"]:
            ti = self.tensor_info(names[sec["field"]])
            dst, done = mv[sec["offset"] : sec["offset"] + sec["nbytes"]], 0
            fdesc = self._fd(ti.shard)
            while done < ti.nbytes:
                n = _pread_into(fdesc, dst[done:], ti.offset + done)
                if n <= 0:
                    raise CheckpointError(
                        f"expert (layer {slot}, id {e}): shard {ti.shard.name} is truncated "
                        f"(short read of {names[sec['field']]})"
                    )
                done += n
        return self.expert_views(mv)

    def open_direct(self) -> None:
        return None  # records are gathered from six tensors per expert: no single aligned extent to bypass with

    # --- validation ------------------------------------------------------------------------------------------

    def validate(self) -> dict[str, int]:
        """Check every expected tensor is present with the right dtype and shape, and nothing else exists.

        Reads headers only. Raises ConfigError (config.json) or CheckpointError naming tensor and shard.
        Returns {"tensors": count, "bytes": total tensor bytes}.
        """
        cfg = self.config
        expected = expected_tensors(cfg)
        by_shard: dict[str, list[str]] = {}
        for name, shard in self._weight_map.items():
            by_shard.setdefault(shard, []).append(name)
        found: dict[str, TensorInfo] = {}
        for shard in sorted(by_shard):  # every shard the index names is there first: a missing one is the error
            self._header(shard)  # (it was "unexpected tensor X in shard A" when the index moved X to a lost shard B)
        for shard in sorted(by_shard):
            header = self._header(shard)
            for name in by_shard[shard]:
                if name not in header:
                    raise CheckpointError(f"tensor {name}: the index places it in shard {shard}, whose header lacks it")
                found[name] = header[name]
            stray = sorted(set(header) - set(by_shard[shard]))
            if stray:
                raise CheckpointError(
                    f"unexpected tensor {stray[0]} in shard {shard} (present in the shard but not in the index)"
                )
        total = 0
        for name, (dtype, shape) in expected.items():
            ti = found.get(name)
            if ti is None:
                raise CheckpointError(
                    f"missing tensor {name} (expected {dtype} {list(shape)}; not in any shard of {self.path})"
                )
            if ti.dtype != dtype:
                raise CheckpointError(f"tensor {name} in shard {ti.shard.name}: dtype {ti.dtype}, expected {dtype}")
            if ti.shape != shape:
                raise CheckpointError(
                    f"tensor {name} in shard {ti.shard.name}: shape {list(ti.shape)}, expected {list(shape)}"
                )
            total += ti.nbytes
        extra = [n for n in found if n not in expected]
        if extra:
            n = sorted(extra)[0]
            raise CheckpointError(
                f"unexpected tensor {n} in shard {found[n].shard.name} "
                f"({len(extra)} tensor(s) not in the DeepSeek-V4 manifest for this config)"
            )
        return {"tensors": len(expected), "bytes": total}


__all__ = ["Checkpoint", "TensorInfo", "parse_safetensors_header"]
