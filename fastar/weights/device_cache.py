"""The GPU tier of the expert pager: a fixed pool of device slots over the RAM tier (`ExpertCache`).

Owns: `DeviceExpertCache`. Does not own: the RAM tier it reads through (`expert_cache.py`) nor its eviction
policies and slab (`expert_store.py`). Used by tests on CUDA machines only; the engine does not build it yet.
"""

from __future__ import annotations

import collections

import numpy as np

from ..contracts import ExpertWeights
from .expert_store import CacheFullError


class DeviceExpertCache:
    """GPU tier over a RAM tier (`ExpertCache`): a fixed pool of expert slots in device memory, LRU, filled
    through pinned host staging buffers on a side stream. An `ExpertProvider`: `get(layer, e)` returns
    `ExpertWeights` of uint8 CUDA tensors, valid until the caller asks for another layer.

    Ordering without host syncs: the compute stream waits on each copy's event; a slot is overwritten only after
    the side stream has waited for the event recorded on the compute stream when the slot's layer ended; a
    staging buffer is refilled only after its previous copy finished (the one host wait, two copies back).
    """

    pages = True

    def __init__(self, ram, budget_bytes: int, device: str = "cuda", staging: int = 2) -> None:
        import torch

        if not torch.cuda.is_available():
            raise RuntimeError("the device expert tier needs CUDA (torch.cuda.is_available() is false)")
        self.torch, self.ram, self.stride = torch, ram, ram.stride
        self.n_slots = int(budget_bytes) // self.stride
        if self.n_slots < 1:
            raise ValueError(f"device expert budget {budget_bytes} B is smaller than one expert ({self.stride} B)")
        self.device = torch.device(device)
        self.sections = ram.fst.bank["sections"]
        self.pool = torch.empty((self.n_slots, self.stride), dtype=torch.uint8, device=self.device)
        self.staging = [torch.empty(self.stride, dtype=torch.uint8, pin_memory=True) for _ in range(staging)]
        self._staging_np = [t.numpy() for t in self.staging]
        self._staging_ev: list = [None] * staging
        self._slot_ev: list = [None] * self.n_slots
        self._next = 0
        self.stream = torch.cuda.Stream(self.device)
        self._lru: collections.OrderedDict[int, int] = collections.OrderedDict()
        self._free = list(range(self.n_slots - 1, -1, -1))
        self._layer: int | None = None
        self._in_use: dict[int, int] = {}
        self.hits = self.misses = self.bytes_copied = 0

    def get(self, layer: int, e: int) -> ExpertWeights:
        if layer != self._layer:
            self.end_layer()
            self._layer = layer
        slot = self._in_use.get(e)
        if slot is None:
            k = layer * self.ram.num_experts + e
            slot = self._lru.get(k)
            if slot is not None:
                self._lru.move_to_end(k)
                self.hits += 1
            else:
                slot = self._load(layer, e, k)
                self.misses += 1
            self._in_use[e] = slot
        row = self.pool[slot]
        return ExpertWeights(*(row[s["offset"] : s["offset"] + s["nbytes"]].view(*s["shape"]) for s in self.sections))

    def prefetch(self, layer: int, ids, source: str = "manual", *, scan: bool = False) -> int:
        """Reads into the RAM tier; the host-to-device copy happens at `get` (it is ~50x faster than the disk)."""
        return self.ram.prefetch(layer, ids, source, scan=scan)

    def prefetch_tokens(self, token_ids, tid2eid) -> int:
        return self.ram.prefetch_tokens(token_ids, tid2eid)

    def each_batch(self, layer: int, ids: list[int], *, scan: bool = False):
        """One list: the copies are queued on the side stream, the compute stream waits for each by its event."""
        yield [(e, self.get(layer, e)) for e in ids]

    def end_layer(self) -> None:
        """Mark the current layer's slots reusable once the compute stream has passed this point."""
        if self._in_use:
            ev = self.torch.cuda.Event()
            ev.record(self.torch.cuda.current_stream(self.device))
            for s in self._in_use.values():
                self._slot_ev[s] = ev
            self._in_use = {}

    def _victim(self) -> int:
        if self._free:
            return self._free.pop()
        used = set(self._in_use.values())
        for k, s in self._lru.items():
            if s not in used:
                del self._lru[k]
                return s
        raise CacheFullError(
            f"device expert budget ({self.n_slots} slots of {self.stride} B) is full with layer "
            f"{self._layer}'s experts; raise it"
        )

    def _load(self, layer: int, e: int, k: int) -> int:
        torch = self.torch
        slot = self._victim()
        i, self._next = self._next, (self._next + 1) % len(self.staging)
        if self._staging_ev[i] is not None:
            self._staging_ev[i].synchronize()
        with self.ram.acquire(layer, [e]) as hs:  # pinned in RAM only for the memcpy into staging
            self._staging_np[i][:] = np.frombuffer(hs[0].buffer, np.uint8)
        with torch.cuda.stream(self.stream):
            if self._slot_ev[slot] is not None:
                self.stream.wait_event(self._slot_ev[slot])
            self.pool[slot].copy_(self.staging[i], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(self.stream)
        self._staging_ev[i] = ev
        torch.cuda.current_stream(self.device).wait_event(ev)
        self._lru[k] = slot
        self.bytes_copied += self.stride
        return slot

    def stats(self) -> dict:
        n = self.hits + self.misses
        return {
            "hits": self.hits,
            "misses": self.misses,
            "hit_rate": self.hits / n if n else 0.0,
            "bytes_copied": self.bytes_copied,
            "n_slots": self.n_slots,
            "budget_bytes": self.n_slots * self.stride,
        }
