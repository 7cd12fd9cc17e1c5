"""Per-layer decode state of DeepSeek-V4: everything a forward pass needs to continue a sequence.

Owns: the row formats (`RowFormat`: float32, or FP8/FP4 codes + power-of-two scales for rows the official numerics
have rounded so, stored exactly; `StateFormat`: which buffers use which), `RowBuffer` (an append-only row store
addressed by absolute index, with amortised growth), `LayerState`
(one layer's sliding-window KV, compressed entries, index keys, and the raw compressor/indexer projections of the
tokens of the still-open windows), `ModelState` (all layers + MTP blocks), truncation to an earlier position,
snapshot/restore and a pickle-free byte serialisation. Does not own: the math that fills these buffers
(`fastar.model.deepseek_v4`) or sessions/prefix matching (the engine).

Why raw projections: the compressed entry of window w is a softmax over the raw `(kv, gate)` rows of its tokens
(plus the previous window's rows for ratio 4), so it can only be built once the window closes; keeping the raw
rows of open windows is what lets a prompt in chunks, token-by-token decode and one full prefill agree exactly.

Retention: rows older than what the next token needs are dropped, except for `max_rollback` extra positions
(None = keep every row: truncation to any position works, memory grows with the sequence). Truncating to p
needs the window rows of [p-W+1, p) and the compressor rows from the start of p's window (minus one window for
ratio 4); `truncate` raises `StateError` when they were dropped.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from ..errors import FastarError
from ..quant.kernels import extension as _C  # the packed rows' C decode (None: not built)

MAGIC = b"FSTSTATE"
VERSION = 2  # 2: packed row formats (a "format" per buffer); 1: float32 rows only


class StateError(FastarError):
    """A decode state cannot do what was asked (truncate past dropped history, corrupt bytes)."""


# --- row formats: how a buffer stores its rows -------------------------------------------------------------------
#
# A format turns float32 rows [k, width] into stored rows [k, stored_width] of its dtype and back. `F32` stores them
# as they are. The packed formats store rows that the official numerics have already rounded, so they are exact:
# `encode` checks that decoding gives back the same bits and raises otherwise (a row the format cannot hold, e.g. a
# format picked for numerics that do not round that way). Byte layout of one packed row (little-endian, every row a
# multiple of 4 bytes so the float32 part of a row can be viewed in place):
#   FP8:  [rope dims float32: 4r][nope codes e4m3: 64*nb][nb UE8M0 scale bytes][zero pad to 4]   nb = ceil(nope/64)
#   FP4:  [codes e2m1, two per byte, low nibble = even column: 16*nb][nb UE8M0 scale bytes]       nb = ceil(width/32)
# A UE8M0 byte b is the scale 2^(b-127); a block's value is code * scale (DeepSeek's power-of-two scales).

_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_SIGNED = torch.cat([_E2M1, -_E2M1])  # code 8 is -0.0: a rounded -0.0 comes back as -0.0


def _ceil_log2(v: torch.Tensor) -> torch.Tensor:
    """Exact ceil(log2(v)) of positive float32 values, as int32 (the exponent of `ops.pow2_ceil`)."""
    mant, exp = torch.frexp(v)  # v = mant * 2^exp, mant in [0.5, 1)
    return torch.where(mant == 0.5, exp - 1, exp)


def _pow2(e: torch.Tensor) -> torch.Tensor:
    """2^e as float32 for integer exponents in [-126, 127], built from the bits (exact)."""
    return ((e.to(torch.int32) + 127) << 23).view(torch.float32)


def _scales(b: torch.Tensor) -> torch.Tensor:
    """UE8M0 scale bytes -> float32 scales; 255 is NaN (a block that held a non-finite value)."""
    return torch.where(b == 255, float("nan"), _pow2(b.int() - 127))


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [k, n] -> [k, ceil(n/block), block], zero-padded."""
    pad = -x.shape[1] % block
    return torch.nn.functional.pad(x, (0, pad)).view(x.shape[0], -1, block) if pad else x.view(x.shape[0], -1, block)


@dataclass(frozen=True)
class RowFormat:
    """Rows of `width` float32 values, stored as they are (`kind` "f32") or packed ("fp8": the first width - rope
    values as FP8 e4m3 in blocks of 64 with UE8M0 scales, the last `rope` values float32; "fp4": FP4 e2m1 in
    blocks of 32 with UE8M0 scales). See the byte layouts above."""

    kind: str
    width: int
    rope: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("f32", "fp8", "fp4") or self.width < 1 or not 0 <= self.rope < self.width:
            raise StateError(f"unknown row format {self.kind!r} (width {self.width}, rope {self.rope})")

    @property
    def dtype(self) -> torch.dtype:
        return torch.float32 if self.kind == "f32" else torch.uint8

    @property
    def stored_width(self) -> int:
        """Elements of `dtype` per stored row."""
        if self.kind == "f32":
            return self.width
        if self.kind == "fp4":
            nb = -(-self.width // 32)
            return 16 * nb + nb
        nb = -(-(self.width - self.rope) // 64)
        return -(-(4 * self.rope + 65 * nb) // 4) * 4

    @property
    def c_kind(self) -> int:
        """A packed format's kind in the C extension's state-row calls (0 FP8, 1 FP4)."""
        return 0 if self.kind == "fp8" else 1

    @property
    def row_bytes(self) -> int:
        return self.stored_width * (4 if self.kind == "f32" else 1)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """Float32 rows x [k, width] -> stored rows [k, stored_width], exact (raises unless they decode to x). One C
        call when the extension is built (the same bytes as `encode_torch`, tested; ~1 us a row instead of ~300)."""
        x = x.float().reshape(-1, self.width)
        if self.kind == "f32":
            return x
        if _C is not None and x.is_cpu and x.shape[0]:
            raw = torch.empty(x.shape[0], self.stored_width, dtype=torch.uint8)
            if _C.state_rows_encode(x.contiguous().numpy(), self.c_kind, self.rope, raw.numpy()) >= 0:
                raise StateError(self.misfit())
            return raw
        return self.encode_torch(x)

    def misfit(self) -> str:
        """The error of rows this format cannot hold exactly."""
        return f"rows do not fit the {self.kind} state format exactly (numerics that do not round them)"

    def encode_torch(self, x: torch.Tensor) -> torch.Tensor:
        """`encode` in torch: the reference the C version is tested against (the same bytes)."""
        x = x.float().reshape(-1, self.width)
        if self.kind == "f32":
            return x
        # a block holding a non-finite value is stored as scale byte 255 and decodes all NaN (the quantizers make
        # such a block NaN anyway; only garbage, e.g. a corrupt weight read unchecked, meets this)
        if self.kind == "fp8":
            nope, r = self.width - self.rope, self.rope
            g = _blocks(x[:, :nope], 64)  # [k, nb, 64]
        else:
            g = _blocks(x, 32)  # [k, nb, 32]
        finite = g.isfinite().all(-1)  # [k, nb]
        g = torch.where(finite[..., None], g, 0.0)
        floor, qmax = (1e-4, 448.0) if self.kind == "fp8" else (6.0 * 2.0**-126, 6.0)
        e = _ceil_log2(g.abs().amax(-1).clamp_min(floor) / qmax)  # [k, nb] (the quantizer's scale or a finer one)
        v = g * _pow2(-e)[..., None]
        scales = torch.where(finite, e + 127, 255).to(torch.uint8)
        if self.kind == "fp8":
            codes = v.to(torch.float8_e4m3fn).view(torch.uint8).flatten(1)
            parts = [x[:, nope:].contiguous().view(torch.uint8), codes, scales]
            pad = self.stored_width - 4 * r - codes.shape[1] - e.shape[1]
        else:
            code = torch.searchsorted(_E2M1.to(v.device), v.abs().contiguous()).clamp(max=7) | (v.signbit().long() << 3)
            code = code.to(torch.uint8).flatten(1)
            parts = [code[:, 0::2] | (code[:, 1::2] << 4), scales]
            pad = 0
        if pad:
            parts.append(torch.zeros(x.shape[0], pad, dtype=torch.uint8))
        raw = torch.cat(parts, dim=1)
        back = self.decode_torch(raw)
        if not ((back.view(torch.int32) == x.view(torch.int32)) | back.isnan()).all():
            raise StateError(self.misfit())
        return raw

    def decode(self, raw: torch.Tensor) -> torch.Tensor:
        """Stored rows [k, stored_width] -> float32 rows [k, width]. One C call over the kernels' pool when the
        extension is built (bit-identical to `decode_torch`: every value is an exact product; tested)."""
        if self.kind == "f32":
            return raw
        if _C is not None and raw.is_cpu and raw.shape[0]:
            out = torch.empty(raw.shape[0], self.width)
            _C.state_rows_decode(raw.contiguous().numpy(), self.c_kind, self.rope, out.numpy())
            return out
        return self.decode_torch(raw)

    def decode_torch(self, raw: torch.Tensor) -> torch.Tensor:
        """`decode` in torch: the reference the C version is tested against."""
        if self.kind == "f32":
            return raw
        k = raw.shape[0]
        if k == 0:
            return torch.empty(0, self.width, device=raw.device)
        if self.kind == "fp8":
            nope, r = self.width - self.rope, self.rope
            nb = -(-nope // 64)
            a = 4 * r + 64 * nb
            codes = raw[:, 4 * r : a].contiguous().view(torch.float8_e4m3fn).float().view(k, nb, 64)
            vals = (codes * _scales(raw[:, a : a + nb])[..., None]).view(k, 64 * nb)[:, :nope]
            return torch.cat([vals, raw[:, : 4 * r].contiguous().view(torch.float32)], dim=1)
        nb = -(-self.width // 32)
        packed = raw[:, : 16 * nb].long()
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).view(k, nb, 32)
        vals = _E2M1_SIGNED.to(codes.device)[codes] * _scales(raw[:, 16 * nb :])[..., None]
        return vals.view(k, 32 * nb)[:, : self.width]

    def to_json(self) -> dict:
        return {"kind": self.kind, "width": self.width, "rope": self.rope}


@dataclass(frozen=True)
class StateFormat:
    """How a model's decode state stores the rows that official numerics round: `fp8_kv` (window rows and
    compressed entries: FP8 + scales for the non-rotary dims, float32 for the `rope` rotary ones) and `fp4_index`
    (index keys: FP4 + scales). Everything else (and everything when off) is float32."""

    fp8_kv: bool = False
    fp4_index: bool = False
    rope: int = 0  # rotary dims of a KV row, kept float32 (fp8_kv)

    def kv(self, width: int) -> RowFormat:
        return RowFormat("fp8", width, self.rope) if self.fp8_kv else RowFormat("f32", width)

    def index(self, width: int) -> RowFormat:
        return RowFormat("fp4", width) if self.fp4_index else RowFormat("f32", width)


class RowBuffer:
    """Rows [start, stop) of a [N, width] float32 table addressed by absolute row index, stored in `fmt` (float32
    unless given): rows go in and come out as float32; packed formats decode on every read."""

    def __init__(
        self, width: int, start: int = 0, data: torch.Tensor | None = None, fmt: RowFormat | None = None
    ) -> None:
        self.fmt = RowFormat("f32", width) if fmt is None else fmt
        self.width = width
        self.start = start  # absolute index of data row 0
        empty = torch.empty(0, self.fmt.stored_width, dtype=self.fmt.dtype)
        self._data = empty if data is None else self.fmt.encode(data)
        self._n = 0 if data is None else self._data.shape[0]
        self._view: tuple[torch.Tensor, np.ndarray] | None = None  # (the storage, its array): `append_array`'s

    @classmethod
    def stored(cls, fmt: RowFormat, start: int, raw: torch.Tensor) -> RowBuffer:
        """A buffer over already-stored rows raw [k, fmt.stored_width] (restoring bytes; no check)."""
        b = cls(fmt.width, start, fmt=fmt)
        b._data, b._n = raw, raw.shape[0]
        return b

    @property
    def stop(self) -> int:
        return self.start + self._n

    @property
    def is_packed(self) -> bool:
        return self.fmt.kind != "f32"

    def append(self, rows: torch.Tensor) -> None:
        """Append rows [k, width] at the end (amortised: capacity doubles). On the CPU with the C extension built the
        rows go straight into the storage (packed rows encoded there by `fmt.encode`'s C call, float32 rows copied by
        numpy): the same bytes without a temporary and a torch copy, which cost more than the encoding at decode."""
        x = rows.float().reshape(-1, self.width)
        k = x.shape[0]
        if _C is not None and k and x.is_cpu and self._data.is_cpu:
            self._room(k)
            dst = self._data[self._n : self._n + k].numpy()
            if not self.is_packed:
                dst[...] = x.numpy()
            elif _C.state_rows_encode(x.contiguous().numpy(), self.fmt.c_kind, self.fmt.rope, dst) >= 0:
                raise StateError(self.fmt.misfit())
            self._n += k
            return
        enc = self.fmt.encode(x)
        self._room(k)
        self._data[self._n : self._n + k] = enc
        self._n += k

    def append_array(self, rows: np.ndarray) -> bool:
        """`append` of float32 rows [k, width] already a C-contiguous numpy array (a decode step's KV rows, made by a C
        call): the same bytes written the same way, without the tensor conversions and slicing, which at decode cost
        more than the encoding. -> False, having done nothing, where `append`'s C path does not apply (not built, the
        storage not on the CPU). The storage's array is kept beside it until the storage changes (`_room`,
        `drop_before`, `to` replace it; seen here by identity)."""
        view, k = self._view, rows.shape[0]
        if view is None or view[0] is not self._data or self._n + k > view[1].shape[0]:
            if _C is None or not self._data.is_cpu:
                self._view = None
                return False
            self._room(k)
            view = self._view = (self._data, self._data.numpy())
        dst = view[1][self._n : self._n + k]
        if not self.is_packed:
            dst[...] = rows
        elif _C.state_rows_encode(rows, self.fmt.c_kind, self.fmt.rope, dst) >= 0:
            raise StateError(self.fmt.misfit())
        self._n += k
        return True

    def _array(self) -> np.ndarray:
        """The storage's array (CPU storage only), kept beside it as `append_array` keeps it: from the cold caches of a
        decode step a tensor's slice and conversion cost tens of microseconds, and each row and layer asks."""
        view = self._view
        if view is None or view[0] is not self._data:
            view = self._view = (self._data, self._data.numpy())
        return view[1]

    def raw_array(self) -> np.ndarray:
        """`raw()` as a numpy array (CPU storage only): the same bytes, without the tensor calls."""
        return self._array()[: self._n]

    def grow_array(self, k: int) -> np.ndarray:
        """`grow(k)` as a numpy array of the storage (CPU storage only)."""
        self._room(k)
        self._n += k
        return self._array()

    def grow(self, k: int) -> torch.Tensor:
        """Count k more rows at the end that the caller writes in place, as stored rows (`append` without the rows:
        a C call fills them, `fastar.model.compress_fused`) -> the storage [capacity, fmt.stored_width] (a view; the
        new rows are its rows stop - start - k .. stop - start). `truncate` takes back rows never written."""
        self._room(k)
        self._n += k
        return self._data

    def _room(self, k: int) -> None:
        """Capacity for k more rows (amortised: it doubles)."""
        if self._n + k > self._data.shape[0]:
            grown = torch.empty(
                max(2 * self._data.shape[0], self._n + k, 16), self.fmt.stored_width, dtype=self.fmt.dtype
            )
            grown[: self._n] = self._data[: self._n]
            self._data = grown

    def rows(self, a: int, b: int) -> torch.Tensor:
        """Rows with absolute index in [a, b) (float32 rows a view: callers must not write to it)."""
        if a < self.start or b > self.stop:
            raise StateError(f"rows [{a}, {b}) requested, only [{self.start}, {self.stop}) are kept")
        return self.fmt.decode(self._data[a - self.start : b - self.start])

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """Rows at absolute indices `index` (any shape) -> [*index.shape, width]."""
        picked = self._data[: self._n].index_select(0, (index - self.start).reshape(-1))  # [k, stored]
        return self.fmt.decode(picked).view(*index.shape, self.width)

    def all(self) -> torch.Tensor:
        return self.fmt.decode(self._data[: self._n])

    def raw(self) -> torch.Tensor:
        """The stored rows [stop - start, fmt.stored_width] (a view)."""
        return self._data[: self._n]

    @property
    def nbytes(self) -> int:
        """Bytes of the rows held (not the spare capacity)."""
        return self._n * self.fmt.row_bytes

    def truncate(self, stop: int) -> None:
        """Forget rows >= stop."""
        if stop < self.start:
            raise StateError(f"cannot truncate to {stop}: rows before {self.start} were dropped")
        self._n = min(self._n, stop - self.start)

    def drop_before(self, a: int) -> None:
        """Forget rows < a (compacts the storage when more than half of it is dead)."""
        k = min(max(0, a - self.start), self._n)
        if k == 0:
            return
        self._data = self._data[k : self._n].clone() if k * 2 >= self._data.shape[0] else self._data[k:]
        self._n -= k
        self.start += k

    def copy(self, since: int | None = None) -> RowBuffer:
        """An independent copy; with `since`, of the rows from absolute index `since` on only."""
        a = self.start if since is None else min(max(since, self.start), self.stop)
        return RowBuffer.stored(self.fmt, a, self._data[a - self.start : self._n].clone())

    @property
    def device(self) -> torch.device:
        return self._data.device

    def to(self, device: torch.device) -> None:
        """Move the rows to `device` (a state read from bytes comes back on the host: `fastar.model.device`)."""
        self._data = self._data[: self._n].to(device)


@dataclass
class LayerState:
    """Decode state of one block. `ratio` 0: window only; 4: + compressor/indexer; 128: + compressor."""

    ratio: int
    window: int
    kv: RowBuffer  # sliding-window KV rows, by position [P, D]
    comp_kv: RowBuffer | None = None  # compressor raw kv rows, by position [P, c*D]
    comp_gate: RowBuffer | None = None  # compressor gate rows (+ ape), by position [P, c*D]
    entries: RowBuffer | None = None  # compressed KV, by entry id [E, D]
    idx_kv: RowBuffer | None = None  # indexer compressor raw rows [P, 2*Di]
    idx_gate: RowBuffer | None = None
    idx_entries: RowBuffer | None = None  # index keys [E, Di]
    length: int = 0

    @classmethod
    def new(
        cls, ratio: int, window: int, head_dim: int, index_head_dim: int, fmt: StateFormat | None = None
    ) -> LayerState:
        """An empty state; `fmt` says how window rows, entries and index keys are stored (default float32). The raw
        compressor rows are float32 always (they are sums the official inference keeps in float32 too)."""
        fmt = StateFormat() if fmt is None else fmt
        s = cls(ratio, window, RowBuffer(head_dim, fmt=fmt.kv(head_dim)))
        if ratio:
            c = 2 if ratio == 4 else 1
            s.comp_kv, s.comp_gate = RowBuffer(c * head_dim), RowBuffer(c * head_dim)
            s.entries = RowBuffer(head_dim, fmt=fmt.kv(head_dim))
        if ratio == 4:
            s.idx_kv, s.idx_gate = RowBuffer(2 * index_head_dim), RowBuffer(2 * index_head_dim)
            s.idx_entries = RowBuffer(index_head_dim, fmt=fmt.index(index_head_dim))
        return s

    def buffers(self) -> dict[str, RowBuffer]:
        names = ("kv", "comp_kv", "comp_gate", "entries", "idx_kv", "idx_gate", "idx_entries")
        return {n: getattr(self, n) for n in names if getattr(self, n) is not None}

    def first_needed(self, p: int) -> tuple[int, int]:
        """(first window row, first compressor row) that continuing from position p needs."""
        first_kv = max(0, p - self.window + 1)
        if not self.ratio:
            return first_kv, p
        w = p // self.ratio
        return first_kv, max(0, (w - (1 if self.ratio == 4 else 0)) * self.ratio)

    def trim(self, max_rollback: int | None) -> None:
        """Drop rows no longer needed by the next token nor by a truncation of up to `max_rollback` positions."""
        if max_rollback is None or self.length <= max_rollback:  # first_needed(0) is (0, 0): nothing to drop
            return
        first_kv, first_comp = self.first_needed(self.length - max_rollback)
        self.kv.drop_before(first_kv)
        for b in (self.comp_kv, self.comp_gate, self.idx_kv, self.idx_gate):
            if b is not None:
                b.drop_before(first_comp)

    def truncate(self, p: int) -> None:
        if p > self.length:
            raise StateError(f"cannot truncate a state of length {self.length} to {p}")
        first_kv, first_comp = self.first_needed(p)
        if self.kv.start > first_kv or (self.comp_kv is not None and self.comp_kv.start > first_comp):
            raise StateError(
                f"cannot truncate to position {p}: the rows it needs were dropped (raise max_rollback or prefill again)"
            )
        for name, b in self.buffers().items():
            b.truncate(p // self.ratio if name.endswith("entries") else p)
        self.length = p

    def copy(self, rollback: int | None = None) -> LayerState:
        """An independent copy; with `rollback`, without the rows only a truncation by more than that many
        positions would need (`trim` on a copy, without copying those rows first)."""
        firsts = None if rollback is None else self.first_needed(max(0, self.length - rollback))
        s = LayerState(self.ratio, self.window, self.kv.copy(), length=self.length)
        for name, b in self.buffers().items():
            since = None
            if firsts is not None and not name.endswith("entries"):  # entries are kept for good
                since = firsts[0] if name == "kv" else firsts[1]
            setattr(s, name, b.copy(since))
        return s


@dataclass
class ModelState:
    """The decode state of a whole model: `layers` (main blocks) and `mtp` (MTP blocks, own positions)."""

    layers: list[LayerState]
    mtp: list[LayerState] = field(default_factory=list)
    max_rollback: int | None = None
    # Called as on_layer(blocks done, blocks) after each main block of a forward pass (prefill progress within
    # a chunk; the scheduler's decode steps between a chunk's layers, `pacing.SlicedChunk`); not part of the
    # state's contents (snapshots do not copy it).
    on_layer: Callable[[int, int], None] | None = field(default=None, repr=False, compare=False)

    @property
    def length(self) -> int:
        """Number of positions the main model has processed."""
        return self.layers[0].length if self.layers else 0

    def truncate(self, p: int) -> None:
        """Forget positions >= p, as if only the first p tokens had been processed (MTP states follow,
        keeping at most p - 1 positions: MTP position i needs token i+1)."""
        for s in self.layers:
            s.truncate(p)
        for s in self.mtp:
            s.truncate(min(s.length, max(0, p - 1)))

    def snapshot(self) -> ModelState:
        """An independent copy (restore it with `restore`, or keep using it directly)."""
        return ModelState([s.copy() for s in self.layers], [s.copy() for s in self.mtp], self.max_rollback)

    def fork(self, rollback: int) -> ModelState:
        """An independent copy that goes on from the same position and can be truncated back by at most `rollback`
        positions: the rows the live state keeps only for longer rollbacks are not copied, so a fork costs the
        window, the compressor tails and the compressed entries (the next tokens read nothing else)."""
        return ModelState(
            [s.copy(rollback) for s in self.layers], [s.copy(rollback) for s in self.mtp], self.max_rollback
        )

    def restore(self, snap: ModelState) -> None:
        """Make this state equal to `snap` (which stays usable)."""
        other = snap.snapshot()
        self.layers, self.mtp, self.max_rollback = other.layers, other.mtp, other.max_rollback

    def nbytes(self) -> int:
        """Bytes of the rows held, as stored (packed rows count their packed size)."""
        return sum(b.nbytes for s in self.layers + self.mtp for b in s.buffers().values())

    def to(self, device: torch.device) -> None:
        """Move every buffer to `device` where it is not there already."""
        for s in self.layers + self.mtp:
            for b in s.buffers().values():
                if b.device != device:
                    b.to(device)

    # --- bytes: MAGIC, u32 version, u64 header length, JSON header, then each buffer's stored rows back to back
    # (little-endian: float32 for "f32" buffers, the packed bytes of state.py's row formats otherwise). Version 2
    # added the per-buffer "format"; version 1 files (float32 everywhere) are refused, not guessed at. ---

    def to_bytes(self) -> bytes:
        header: dict = {"max_rollback": self.max_rollback, "layers": [], "mtp": []}
        blobs: list[bytes] = []
        offset = 0
        for key, group in (("layers", self.layers), ("mtp", self.mtp)):
            for s in group:
                entry = {"ratio": s.ratio, "window": s.window, "length": s.length, "buffers": {}}
                for name, b in s.buffers().items():
                    raw = b.raw().cpu().contiguous().numpy()
                    data = (raw.astype("<f4") if b.fmt.kind == "f32" else raw).tobytes()
                    entry["buffers"][name] = {
                        "format": b.fmt.to_json(),
                        "width": b.width,
                        "start": b.start,
                        "rows": b.raw().shape[0],
                        "offset": offset,
                    }
                    blobs.append(data)
                    offset += len(data)
                header[key].append(entry)
        hb = json.dumps(header, separators=(",", ":")).encode()
        return MAGIC + struct.pack("<IQ", VERSION, len(hb)) + hb + b"".join(blobs)

    @classmethod
    def from_bytes(cls, raw: bytes) -> ModelState:
        if len(raw) < 20 or raw[:8] != MAGIC:
            raise StateError("not a fastar decode state (bad magic)")
        version, hlen = struct.unpack_from("<IQ", raw, 8)
        if version != VERSION:
            raise StateError(
                f"decode state version {version} is not supported (expected {VERSION}; it was written by "
                f"{'an older' if version < VERSION else 'a newer'} fastar: prefill the prompt again)"
            )
        base = 8 + 12 + hlen
        try:
            header = json.loads(raw[20:base].decode())
        except (UnicodeDecodeError, ValueError, RecursionError) as e:  # (too many digits; nested too deep)
            raise StateError(f"decode state header is corrupt ({e})") from None
        groups: dict[str, list[LayerState]] = {"layers": [], "mtp": []}
        try:
            for key, group in groups.items():
                for entry in header[key]:
                    bufs = {name: cls._rows(raw, base, m) for name, m in entry["buffers"].items()}
                    kv = bufs.pop("kv")
                    group.append(LayerState(entry["ratio"], entry["window"], kv, length=entry["length"], **bufs))
            max_rollback = header["max_rollback"]
        except (KeyError, TypeError, ValueError) as e:
            raise StateError(f"decode state header is malformed ({e!r})") from None
        return cls(groups["layers"], groups["mtp"], max_rollback)

    @staticmethod
    def _rows(raw: bytes, base: int, m: dict) -> RowBuffer:
        fmt = RowFormat(**m["format"])
        if fmt.width != m["width"]:
            raise StateError(f"decode state header is malformed (format width {fmt.width}, buffer {m['width']})")
        a = base + m["offset"]
        b = a + m["rows"] * fmt.row_bytes
        if m["rows"] < 0 or b > len(raw):
            raise StateError("decode state is truncated")
        dtype = "<f4" if fmt.kind == "f32" else np.uint8
        rows = np.frombuffer(raw[a:b], dtype=dtype).reshape(m["rows"], fmt.stored_width)
        return RowBuffer.stored(fmt, m["start"], torch.from_numpy(rows.copy()))


# --- accounting ------------------------------------------------------------------------------------------------


def official_format(cfg) -> StateFormat:
    """The state format of `official` numerics (`Numerics.state_format`): their window rows and compressed entries
    are FP8-rounded in blocks of 64 except the rotary dims, their index keys FP4-rounded in blocks of 32, so both
    are stored packed, exactly."""
    return StateFormat(fp8_kv=True, fp4_index=True, rope=cfg.qk_rope_head_dim)


def state_bytes(
    cfg, n: int, max_rollback: int | None, mtp_layers: int | None = None, fmt: StateFormat | None = None
) -> int:
    """Bytes of the rows a `ModelState` of `cfg` in format `fmt` (default float32 everywhere) holds after `n`
    positions (what `ModelState.nbytes()` reports: live rows as stored; a buffer's capacity may be up to twice its
    rows). Follows `LayerState.trim`: window rows back to `max_rollback` positions before the end (all of them when
    None), the raw compressor rows of the windows still needed, every compressed entry and index key. MTP blocks
    (`mtp_layers`, default the config's) are counted at the same length; they hold one position less in a real
    run."""
    L = cfg.num_hidden_layers
    mtp = cfg.num_mtp_layers if mtp_layers is None else mtp_layers  # the MTP blocks the model has
    total = 0
    for i in range(L + mtp):
        s = LayerState.new(cfg.ratio(i), cfg.sliding_window, cfg.head_dim, cfg.index_head_dim, fmt)
        first_kv, first_comp = s.first_needed(max(0, n - max_rollback)) if max_rollback is not None else (0, 0)
        for name, b in s.buffers().items():
            rows = n // s.ratio if name.endswith("entries") else n - (first_kv if name == "kv" else first_comp)
            total += b.fmt.row_bytes * rows
    return total


def state_accounting(
    cfg, max_rollback: int | None, mtp_layers: int | None = None, fmt: StateFormat | None = None
) -> dict:
    """One accounting of decode-state bytes in format `fmt` (default float32; `official_format(cfg)` for official
    numerics): `per_token` (what each further position adds: compressed entries and index keys as stored), `fixed`
    (the bounded rest at a long context: window rows, open compressor windows and the `max_rollback` margin),
    `per_1k` and `at_1m` (a 1,048,576-token context), and the same growth in the official inference's layout
    (`official_per_token`: bf16 compressed KV and index keys; its window ring and compressor states are fixed) for
    comparison. With max_rollback None every window row is kept and the growth includes them."""
    ratios = [cfg.ratio(i) for i in range(cfg.num_hidden_layers)]
    big = 1 << 20
    step = 128 * 1024  # a multiple of every ratio
    a = state_bytes(cfg, big, max_rollback, mtp_layers, fmt)
    b = state_bytes(cfg, big + step, max_rollback, mtp_layers, fmt)
    per_token = (b - a) / step
    official = sum(2 * (cfg.head_dim + (cfg.index_head_dim if r == 4 else 0)) / r for r in ratios if r)
    return {
        "format": "float32" if fmt is None or fmt == StateFormat(rope=fmt.rope) else _format_name(fmt),
        "per_token": per_token,
        "fixed": a - per_token * big,
        "per_1k": 1000 * per_token,
        "at_1m": a,
        "official_per_token": official,
        "official_at_1m": official * big,
        "max_rollback": max_rollback,
    }


def _format_name(fmt: StateFormat) -> str:
    kv = ["KV fp8+scales, rope float32"] if fmt.fp8_kv else []
    parts = kv + (["index keys fp4+scales"] if fmt.fp4_index else [])
    return "; ".join(parts) + "; the rest float32"
