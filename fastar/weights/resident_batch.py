"""A decode step's routed experts claimed together: one lock, one pass, no handles.

A decode step asks the expert cache for each layer's few experts (top-k of one row, a few more for a few rows),
43 times a token, and on a paged model most are in RAM already. The general path for that request
(`ExpertCache.iter_ready(batch=True)`) streams any number of experts through any budget: a generator with a dict of
keys, deques of ready and missing ids, a handle object per expert whose pin is taken and given back one at a time,
the budget counted again for each read, a trip through the lock per step. From the cold caches a step's weight
streaming leaves, that bookkeeping cost ~0.1 ms a layer. Here, where the budget holds the layer's experts pinned at
once (always at decode), they are claimed in one pass under the lock: the resident ones pinned, the others' reads
started or joined, every access counted as `iter_ready` counts it (hits and misses, the policy's access, a prefetched
record's first use, the recency tick); the resident ones come as one list, the reads as they land, and the pins go
back together when the layer has run.

Owns: `ResidentBatches`, a mixin of `ExpertCache` (fastar/weights/expert_cache.py, whose state, lock and helpers it
uses): `_claim_layer`, `_claimed_batches`.
Does not own: the cache's state and its other paths (`expert_cache`), the policies (`expert_store`).

Pins: a claimed slot stays pinned until the iteration ends, so no loader thread (a demand read, a prefetch, the
warm-up) can take it meanwhile: `_alloc` evicts only slots with no pin.
"""

from __future__ import annotations

from collections.abc import Iterator

from ..contracts import ExpertWeights


class ResidentBatches:
    """`ExpertCache.each_batch`'s path for a layer claimed together (mixed into `ExpertCache`)."""

    def _init_resident(self) -> None:
        """Once the cache's per-slot arrays exist (they are only ever changed in place): memoryviews of the ones a
        claim updates. Their element access makes no numpy scalars: from cold caches ~3x cheaper than indexing the
        arrays, and numpy's fancy indexing of a handful of slots measured slower still."""
        self._slot_elems = tuple(memoryview(a) for a in (self._pins, self._shield, self._unused, self._last_use))

    def _claim_layer(self, layer: int, uniq: list[int]) -> tuple[list, list[int], list] | None:
        """Claim `layer`'s experts `uniq` (distinct, in range) together: the resident ones pinned -> (their (id,
        weights) pairs in the order of `uniq`, their slots, (id, load) of the others, whose reads were started or
        joined and whose slots arrive pinned), each access counted as `iter_ready` counts it. None, having changed
        nothing, where some are missing and the budget cannot hold them all pinned at once (`acquire`'s check): the
        caller then streams them (`iter_ready`)."""
        base = layer * self.num_experts
        with self._cond:
            self._check_open()
            slots = []
            for e in uniq:
                s = self._key_slot.get(base + e)
                # absent, or still being read (a key has a slot from its read's start, and leaves `_inflight` as
                # its slot turns ready, under this lock)
                slots.append(None if s is None or base + e in self._inflight else s)
            if None in slots and self._committed() + self._pins_needed([base + e for e in uniq]) > self.n_slots:
                return None
            self._enter_layer(layer)
            access, (pins, shield, unused, last_use) = self.policy.access, self._slot_elems
            for e in uniq:
                access(base + e)
            present, held, loads = [], [], []
            tick = self._tick
            for e, s in zip(uniq, slots):
                if s is None:
                    loads.append((e, self._claim(base + e, layer, e)))  # a miss: a read started, or one joined
                    continue
                pins[s] += 1
                shield[s] = False
                if unused[s] >= 0:  # a prefetched record's first use
                    self._src[unused[s]]["used"] += 1
                    unused[s] = -1
                tick += 1
                last_use[s] = tick
                held.append(s)
                present.append((e, self._views(s)[1]))
            self._tick = tick
            self._stats["hits"] += len(held)
        return present, held, loads

    def _claimed_batches(
        self, present: list, held: list[int], loads: list
    ) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """What `_claim_layer` claimed as `each_batch`'s lists: the resident ones at once, then the reads as they land;
        every pin and claim given back when the iteration ends (its last step, or closed early)."""
        try:
            if present:
                yield present
            pending = loads
            while pending:
                with self._cond:
                    self._wait([ld for _, ld in pending], every=False)
                    batch = []
                    for e, ld in pending:
                        if ld.done:
                            if ld.error is not None:
                                raise type(ld.error)(str(ld.error))  # a fresh exception per requesting thread
                            self._tick += 1
                            self._last_use[ld.slot] = self._tick
                            batch.append((e, self._views(ld.slot)[1]))
                    pending = [p for p in pending if not p[1].done]
                yield batch
        finally:
            with self._cond:
                for s in held:
                    self._unpin_locked(s)  # wakes a loader starved for an evictable slot
                for _, ld in loads:  # a landed read's pin, or the claim on one still in flight
                    self._drop_claim(ld)
                if not all(ld.done for _, ld in loads):
                    self._cond.notify_all()  # a claim on a read in flight went (as `iter_ready` ends)
