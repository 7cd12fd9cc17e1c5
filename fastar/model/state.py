"""Per-layer decode state of DeepSeek-V4: everything a forward pass needs to continue a sequence.

Owns: `RowBuffer` (an append-only row store addressed by absolute index, with amortised growth), `LayerState`
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

MAGIC = b"FSTSTATE"
VERSION = 1


class StateError(FastarError):
    """A decode state cannot do what was asked (truncate past dropped history, corrupt bytes)."""


class RowBuffer:
    """Rows [start, stop) of a [N, width] float32 table addressed by absolute row index."""

    def __init__(self, width: int, start: int = 0, data: torch.Tensor | None = None) -> None:
        self.width = width
        self.start = start  # absolute index of data row 0
        self._data = torch.empty(0, width) if data is None else data.clone()
        self._n = 0 if data is None else data.shape[0]

    @property
    def stop(self) -> int:
        return self.start + self._n

    def append(self, rows: torch.Tensor) -> None:
        """Append rows [k, width] at the end (amortised: capacity doubles)."""
        k = rows.shape[0]
        if self._n + k > self._data.shape[0]:
            grown = torch.empty(max(2 * self._data.shape[0], self._n + k, 16), self.width)
            grown[: self._n] = self._data[: self._n]
            self._data = grown
        self._data[self._n : self._n + k] = rows
        self._n += k

    def rows(self, a: int, b: int) -> torch.Tensor:
        """Rows with absolute index in [a, b) (a view: callers must not write to it)."""
        if a < self.start or b > self.stop:
            raise StateError(f"rows [{a}, {b}) requested, only [{self.start}, {self.stop}) are kept")
        return self._data[a - self.start : b - self.start]

    def take(self, index: torch.Tensor) -> torch.Tensor:
        """Rows at absolute indices `index` (any shape) -> [*index.shape, width]."""
        return self._data[: self._n][index - self.start]

    def all(self) -> torch.Tensor:
        return self._data[: self._n]

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

    def copy(self) -> RowBuffer:
        return RowBuffer(self.width, self.start, self.all())

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
    def new(cls, ratio: int, window: int, head_dim: int, index_head_dim: int) -> LayerState:
        s = cls(ratio, window, RowBuffer(head_dim))
        if ratio:
            c = 2 if ratio == 4 else 1
            s.comp_kv, s.comp_gate = RowBuffer(c * head_dim), RowBuffer(c * head_dim)
            s.entries = RowBuffer(head_dim)
        if ratio == 4:
            s.idx_kv, s.idx_gate = RowBuffer(2 * index_head_dim), RowBuffer(2 * index_head_dim)
            s.idx_entries = RowBuffer(index_head_dim)
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
        if max_rollback is None:
            return
        first_kv, first_comp = self.first_needed(max(0, self.length - max_rollback))
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

    def copy(self) -> LayerState:
        s = LayerState(self.ratio, self.window, self.kv.copy(), length=self.length)
        for name, b in self.buffers().items():
            setattr(s, name, b.copy())
        return s


@dataclass
class ModelState:
    """The decode state of a whole model: `layers` (main blocks) and `mtp` (MTP blocks, own positions)."""

    layers: list[LayerState]
    mtp: list[LayerState] = field(default_factory=list)
    max_rollback: int | None = None
    # Called as on_layer(blocks done, blocks) after each main block of a forward pass (prefill progress within
    # a chunk); not part of the state's contents (snapshots do not copy it).
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

    def restore(self, snap: ModelState) -> None:
        """Make this state equal to `snap` (which stays usable)."""
        other = snap.snapshot()
        self.layers, self.mtp, self.max_rollback = other.layers, other.mtp, other.max_rollback

    def nbytes(self) -> int:
        return sum(b.all().numel() * 4 for s in self.layers + self.mtp for b in s.buffers().values())

    def to(self, device: torch.device) -> None:
        """Move every buffer to `device` where it is not there already."""
        for s in self.layers + self.mtp:
            for b in s.buffers().values():
                if b.device != device:
                    b.to(device)

    # --- bytes: MAGIC, u32 version, u64 header length, JSON header, then float32 row data back to back ---

    def to_bytes(self) -> bytes:
        header: dict = {"max_rollback": self.max_rollback, "layers": [], "mtp": []}
        blobs: list[bytes] = []
        offset = 0
        for key, group in (("layers", self.layers), ("mtp", self.mtp)):
            for s in group:
                entry = {"ratio": s.ratio, "window": s.window, "length": s.length, "buffers": {}}
                for name, b in s.buffers().items():
                    data = b.all().cpu().contiguous().numpy().astype("<f4").tobytes()
                    entry["buffers"][name] = {
                        "width": b.width,
                        "start": b.start,
                        "rows": b.all().shape[0],
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
            raise StateError(f"decode state version {version} is not supported (expected {VERSION})")
        base = 8 + 12 + hlen
        try:
            header = json.loads(raw[20:base].decode())
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
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
        a = base + m["offset"]
        b = a + m["rows"] * m["width"] * 4
        if b > len(raw):
            raise StateError("decode state is truncated")
        rows = np.frombuffer(raw[a:b], dtype="<f4").reshape(m["rows"], m["width"])
        return RowBuffer(m["width"], m["start"], torch.from_numpy(rows.copy()))


# --- accounting ------------------------------------------------------------------------------------------------


def state_bytes(cfg, n: int, max_rollback: int | None, mtp_layers: int | None = None) -> int:
    """Bytes of the rows a `ModelState` of `cfg` holds after `n` positions (what `ModelState.nbytes()` reports:
    live rows, float32 as stored; a buffer's capacity may be up to twice its rows). Follows `LayerState.trim`:
    window rows back to `max_rollback` positions before the end (all of them when None), the raw compressor rows
    of the windows still needed, every compressed entry and index key. MTP blocks (`mtp_layers`, default the
    config's) are counted at the same length; they hold one position less in a real run."""
    L = cfg.num_hidden_layers
    mtp = cfg.num_nextn_predict_layers if mtp_layers is None else mtp_layers
    total = 0
    for i in range(L + mtp):
        s = LayerState.new(cfg.ratio(i), cfg.sliding_window, cfg.head_dim, cfg.index_head_dim)
        first_kv, first_comp = s.first_needed(max(0, n - max_rollback)) if max_rollback is not None else (0, 0)
        for name, b in s.buffers().items():
            rows = n // s.ratio if name.endswith("entries") else n - (first_kv if name == "kv" else first_comp)
            total += 4 * b.width * rows
    return total


def state_accounting(cfg, max_rollback: int | None, mtp_layers: int | None = None) -> dict:
    """One accounting of decode-state bytes: `per_token` (what each further position adds, float32 rows as
    stored), `fixed` (the bounded rest at a long context: window rows, open compressor windows and the
    `max_rollback` margin), `per_1k` and `at_1m` (a 1,048,576-token context), and the same growth in the official
    inference's layout (`official_per_token`: bf16 compressed KV and index keys; its window ring and compressor
    states are fixed) for comparison. With max_rollback None every window row is kept and the growth includes them."""
    ratios = [cfg.ratio(i) for i in range(cfg.num_hidden_layers)]
    big = 1 << 20
    step = 128 * 1024  # a multiple of every ratio
    a, b = state_bytes(cfg, big, max_rollback, mtp_layers), state_bytes(cfg, big + step, max_rollback, mtp_layers)
    per_token = (b - a) / step
    official = sum(2 * (cfg.head_dim + (cfg.index_head_dim if r == 4 else 0)) / r for r in ratios if r)
    return {
        "per_token": per_token,
        "fixed": a - per_token * big,
        "per_1k": 1000 * per_token,
        "at_1m": a,
        "official_per_token": official,
        "official_at_1m": official * big,
        "max_rollback": max_rollback,
    }
