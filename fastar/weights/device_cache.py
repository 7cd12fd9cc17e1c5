"""The device tier of the expert pager: a fixed pool of expert slots in accelerator memory over the RAM tier.

Owns: `DeviceExpertCache` (slots, LRU eviction with use-count admission, the host-to-device copies through pinned
staging buffers on a side stream, hit/miss/copy counters) and `expert_sections` (one expert's byte layout in a
slot). Does not own: the RAM tier it reads through (any `ExpertProvider`: the pager `expert_cache.py`, or a source
read directly), nor which experts of a step run on the device (`fastar.model.device` decides and asks here).

Device-agnostic: on CUDA the copies are queued on a side stream and ordered by events, with no host wait on the
compute stream; on the CPU (`--device torch:cpu`, the tests) the same policy and bookkeeping run with plain copies.
"""

from __future__ import annotations

import collections
from typing import NamedTuple

import numpy as np
import torch

from ..config import ModelConfig
from ..contracts import ExpertProvider, ExpertWeights
from .expert_store import CacheFullError


class Section(NamedTuple):
    offset: int  # bytes into the slot
    nbytes: int
    shape: tuple[int, int]


def expert_sections(cfg: ModelConfig) -> list[Section]:
    """Where each of an expert's six arrays (`ExpertWeights` order) sits in a slot: FP4 packed w1/w3 [I, D/2] with
    per-32 scales [I, D/32], w2 [D, I/2] with [D, I/32], back to back, each 16-byte aligned."""
    D, I = cfg.hidden_size, cfg.moe_intermediate_size
    shapes = [(I, D // 2), (I, D // 32), (I, D // 2), (I, D // 32), (D, I // 2), (D, I // 32)]
    out, off = [], 0
    for shape in shapes:
        n = shape[0] * shape[1]
        out.append(Section(off, n, shape))
        off += -(-n // 16) * 16
    return out


def slot_bytes(cfg: ModelConfig) -> int:
    """Bytes of one slot: an expert's sections, rounded up to a 4 KiB page."""
    last = expert_sections(cfg)[-1]
    return -(-(last.offset + last.nbytes) // 4096) * 4096


class DeviceExpertCache:
    """A fixed pool of `budget_bytes // stride` expert slots on `device`, over a RAM tier `ram` (an `ExpertProvider`).

    An `ExpertProvider`: `get(layer, e)` returns the expert as `ExpertWeights` of uint8 device tensors (loading it
    first on a miss), valid until `end_layer()` and the next layer's loads: slots handed out for the current layer
    are never evicted (`CacheFullError` when the layer wants more than the pool holds; the caller asks `can_load`).
    `admit(layer, e)` decides whether an expert computed elsewhere this step should be copied in for later steps:
    always while a slot is free, else when it was used more often (decayed counts) than the slot it would evict.

    CUDA ordering without host waits on the compute stream: the compute stream waits on each copy's event; a slot is
    overwritten only after the side stream has waited for the event recorded when its last layer ended; a staging
    buffer is refilled only after its previous copy finished (the one host wait, `staging` copies back).
    """

    pages = True

    def __init__(
        self, ram: ExpertProvider, cfg: ModelConfig, budget_bytes: int, device: str | torch.device, staging: int = 2
    ) -> None:
        self.ram, self.device = ram, torch.device(device)
        self.sections, self.stride = expert_sections(cfg), slot_bytes(cfg)
        self.num_experts = cfg.n_routed_experts
        self.n_slots = max(0, int(budget_bytes) // self.stride)
        self.is_cuda = self.device.type == "cuda"
        self.pool = torch.empty((self.n_slots, self.stride), dtype=torch.uint8, device=self.device)
        n_stage = staging if self.is_cuda else 1
        self.staging = [  # host memory whatever the default device (the pool is built inside the device's scope)
            torch.empty(self.stride, dtype=torch.uint8, device="cpu", pin_memory=self.is_cuda) for _ in range(n_stage)
        ]
        self._staging_np = [t.numpy() for t in self.staging]
        self._staging_ev: list = [None] * n_stage
        self._slot_ev: list = [None] * self.n_slots
        self._next = 0
        self.stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self._lru: collections.OrderedDict[int, int] = collections.OrderedDict()  # key -> slot, oldest first
        self._free = list(range(self.n_slots - 1, -1, -1))
        self._layer: int | None = None
        self._in_use: dict[int, int] = {}  # expert -> slot handed out for the current layer
        self._uses: collections.Counter[int] = collections.Counter()  # decayed use counts by key
        self._steps = 0
        self.hits = self.misses = self.bytes_copied = self.admitted = self.evicted = 0

    # --- lookups ----------------------------------------------------------------------------------------------

    def _key(self, layer: int, e: int) -> int:
        return layer * self.num_experts + e

    def begin_layer(self, layer: int) -> None:
        """Start a layer's step: the previous step's slots become evictable (after the device passed them)."""
        self.end_layer()
        self._layer = layer

    def holds(self, layer: int, e: int) -> bool:
        """Whether the expert is in a slot now (a `get` would not copy)."""
        return self._key(layer, e) in self._lru

    def has_free(self) -> bool:
        """Whether a slot is empty (an admission then evicts nothing)."""
        return bool(self._free)

    def can_load(self) -> int:
        """Slots a `get` of an absent expert could still take in the current layer (free or evictable)."""
        return self.n_slots - len(self._in_use)

    def note_use(self, layer: int, ids) -> None:
        """Count one use of each expert of a step (the admission policy's frequencies; halved every 256 steps)."""
        for e in ids:
            self._uses[self._key(layer, e)] += 1
        self._steps += 1
        if self._steps % 256 == 0:
            self._uses = collections.Counter({k: v // 2 for k, v in self._uses.items() if v > 1})

    def get(self, layer: int, e: int) -> ExpertWeights:
        if layer != self._layer:
            self.end_layer()
            self._layer = layer
        slot = self._in_use.get(e)
        if slot is None:
            k = self._key(layer, e)
            slot = self._lru.get(k)
            if slot is not None:
                self._lru.move_to_end(k)
                self.hits += 1
            else:
                slot = self._load(layer, e, k)
                self.misses += 1
            self._in_use[e] = slot
        row = self.pool[slot]
        return ExpertWeights(*(row[s.offset : s.offset + s.nbytes].view(*s.shape) for s in self.sections))

    def each_batch(self, layer: int, ids: list[int], *, scan: bool = False):
        """The `ExpertProvider` call: one list (the copies are queued; the compute stream waits on each)."""
        yield [(e, self.get(layer, e)) for e in ids]

    def prefetch(self, layer: int, ids, source: str = "manual", *, scan: bool = False) -> int:
        """Reads into the RAM tier; the host-to-device copy happens at `get` (it is ~50x faster than the disk)."""
        return self.ram.prefetch(layer, ids, source, scan=scan)

    def prefetch_tokens(self, token_ids, tid2eid) -> int:
        return self.ram.prefetch_tokens(token_ids, tid2eid)

    def admit(self, layer: int, e: int) -> bool:
        """Copy an expert that ran elsewhere this step into the pool for later steps, when a slot is free or its use
        count beats the least recently used evictable slot's. -> whether it was copied."""
        k = self._key(layer, e)
        if k in self._lru or self.can_load() <= 0:
            return False
        if not self._free:
            used = set(self._in_use.values())
            victim = next((v for v, s in self._lru.items() if s not in used), None)
            if victim is None or self._uses[k] <= self._uses[victim]:
                return False
        if layer != self._layer:
            self.end_layer()
            self._layer = layer
        self._load(layer, e, k)
        self.admitted += 1
        return True

    def end_layer(self) -> None:
        """Mark the current layer's slots reusable once the compute stream has passed this point."""
        if self._in_use and self.is_cuda:
            ev = torch.cuda.Event()
            ev.record(torch.cuda.current_stream(self.device))
            for s in self._in_use.values():
                self._slot_ev[s] = ev
        self._in_use = {}

    # --- loading ----------------------------------------------------------------------------------------------

    def _victim(self) -> int:
        if self._free:
            return self._free.pop()
        used = set(self._in_use.values())
        for k, s in self._lru.items():
            if s not in used:
                del self._lru[k]
                self.evicted += 1
                return s
        raise CacheFullError(
            f"device expert budget ({self.n_slots} slots of {self.stride} B) is full with layer "
            f"{self._layer}'s experts; raise the budget (load(gpu_budget=...), or --gpu-budget)"
        )

    def _stage(self, buf: np.ndarray, ew: ExpertWeights) -> None:
        for s, a in zip(self.sections, ew):
            a = np.asarray(a)
            if a.shape != s.shape or a.dtype != np.uint8:
                raise ValueError(f"expert array {a.dtype} {a.shape} does not fit its slot section {s.shape} uint8")
            buf[s.offset : s.offset + s.nbytes] = a.reshape(-1)

    def _load(self, layer: int, e: int, k: int) -> int:
        slot = self._victim()
        i, self._next = self._next, (self._next + 1) % len(self.staging)
        if self._staging_ev[i] is not None:
            self._staging_ev[i].synchronize()
        self._stage(self._staging_np[i], self.ram.get(layer, e))  # host memcpy; the RAM tier pins it meanwhile
        if self.is_cuda:
            with torch.cuda.stream(self.stream):
                if self._slot_ev[slot] is not None:
                    self.stream.wait_event(self._slot_ev[slot])
                self.pool[slot].copy_(self.staging[i], non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.stream)
            self._staging_ev[i] = ev
            torch.cuda.current_stream(self.device).wait_event(ev)
        else:
            self.pool[slot].copy_(self.staging[i])
        self._lru[k] = slot
        self.bytes_copied += self.stride
        return slot

    def stats(self) -> dict:
        n = self.hits + self.misses
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / n if n else 0.0,
            "admitted": self.admitted,
            "evicted": self.evicted,
            "bytes_copied": self.bytes_copied,
            "n_slots": self.n_slots,
            "held": len(self._lru),
            "budget_bytes": self.n_slots * self.stride,
        }
