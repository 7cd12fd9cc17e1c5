"""Prefix caches: decode states of token prefixes, so a resent conversation (or a restarted server) prefills
only its new tail.

Owns: `PrefixCache` on disk (store a state under a hash of the model fingerprint and the token ids it has
processed, find the longest stored prefix of a prompt, LRU eviction under a size cap) and its file format, with
its own threads so a scheduler's worker does no file I/O or (de)serialization: a loader for `lookup_async` and, in
background mode, a writer; `PrefixMemory`, the states of the last few finished requests kept in RAM and matched by
longest common token prefix. Does not own: the state's bytes (`ModelState.to_bytes`/`from_bytes`), when to store
(the scheduler: at the end of a prompt and of a reply), the folder's file protocol (locks, atomic publication,
eviction, a full disk: `fastar.engine.cache_folder`).

File `<n>-<sha256 of the fingerprint and the n ids>.fpc`: MAGIC, u32 version, u64 header length, a JSON header
(model fingerprint, the token ids, the state's length in bytes and its SHA-256), then the state's bytes. It appears
under its name only once complete and synced (`CacheFolder.publish`). A file is used only if every check passes
(magic, version, fingerprint, the ids equal the prompt's, the state's length and checksum, the state's own format);
a file that fails one is rejected: logged (one line), counted (`stats()["rejected"]`) and removed, never trusted.
Recency is the file's mtime (touched on every hit), so it survives restarts.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import queue
import struct
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from ..errors import FastarError
from ..model.state import ModelState, StateError
from .cache_folder import CacheFolder, DiskHooks
from .session import common_prefix

MAGIC = b"FSTPFX\0\0"
VERSION = 1
SUFFIX = ".fpc"

log = logging.getLogger("fastar.prefix_cache")


# Positions a stored state keeps rows for rolling back: `lookup` rolls one back at most (a resent identical prompt
# runs its last token again). A live state keeps rows for `max_rollback` positions (2,048 by default): at a few
# thousand tokens those are most of its bytes (~330 KB a position on DeepSeek-V4-Flash against ~4 KB held for good).
STORED_ROLLBACK = 1


def _compact(state: ModelState) -> None:
    """Drop the rows `state` (a copy) keeps only for rolling back further than STORED_ROLLBACK positions."""
    for s in state.layers + state.mtp:
        s.trim(STORED_ROLLBACK)


def prefix_key(ids: list[int], fingerprint: str = "") -> str:
    """The SHA-256 naming the state of `ids` under a model's `fingerprint` (models sharing a folder never meet)."""
    h = hashlib.sha256(fingerprint.encode() + b"\0")
    h.update(struct.pack(f"<{len(ids)}I", *ids))
    return h.hexdigest()


class PrefixCache:
    """States of token prefixes under `folder`, at most `max_bytes` in all (least recently used evicted first).

    Args:
        folder: created if missing; other processes may use it at the same time (`fastar.engine.cache_folder`).
        fingerprint: identifies the model and numerics; it is part of every file's name and header.
        max_bytes: size cap of the folder's cache files.
        state_type: the state class whose `from_bytes` reads a stored state (`ModelState`).
        background: write files on a writer thread (`store` only snapshots the state; the writer serializes
            it), so a scheduler's step does not wait on the disk; `flush()` waits for the writes. A state whose
            write is still pending is not found by `lookup` (a miss, never a wrong state).
        hooks: the disk seams fault tests use (`DiskHooks`); default `CacheFolder.hooks`.
    """

    def __init__(
        self,
        folder: str | os.PathLike,
        fingerprint: str,
        max_bytes: int,
        state_type=ModelState,
        background: bool = False,
        hooks: DiskHooks | None = None,
    ) -> None:
        if max_bytes <= 0:
            raise ValueError(f"the prefix cache size must be positive, got {max_bytes}")
        self.folder = Path(folder).expanduser()
        self.disk = CacheFolder(self.folder, max_bytes, SUFFIX, hooks)
        self.fingerprint, self.max_bytes, self.state_type = fingerprint, max_bytes, state_type
        self._skipped: set[str] = set()  # files already reported as unreadable
        self.hits = self.misses = self.stores = self.rejected = 0
        # at most 2 state snapshots wait for the writer: a step blocks beyond that rather than grow RAM
        self._writes: queue.Queue | None = queue.Queue(maxsize=2) if background else None
        self._pending: set[Path] = set()
        if background:
            threading.Thread(target=self._writer, name="fastar-prefix-cache", daemon=True).start()
        self._loader: ThreadPoolExecutor | None = None  # made on the first `lookup_async`

    @property
    def evictions(self) -> int:
        return self.disk.evictions

    # --- lookup ---------------------------------------------------------------------------------------------

    def candidates(self, ids: list[int], limit: int, better_than: int = 0) -> list[tuple[int, Path]]:
        """The stored files that could serve `ids` (longest first), from their names only: no file is read, so a
        caller on the worker thread learns a miss without waiting for the loader."""
        out = []
        for n in sorted(self._lengths(), reverse=True):
            if n > len(ids) or min(n, limit) <= better_than:
                continue
            path = self._path(ids[:n])
            if path.exists():
                out.append((n, path))
        return out

    def note_miss(self) -> None:
        """Count a lookup its caller settled from `candidates` alone (nothing on disk could serve it)."""
        self.misses += 1

    def lookup(self, ids: list[int], limit: int, better_than: int = 0) -> tuple[ModelState, int] | None:
        """The state of the longest stored prefix of `ids`, rolled back to at most `limit` positions (a prompt's
        last token must run: limit = len(ids) - 1) -> (state, positions), or None. Prefixes that would give no
        more than `better_than` positions are not read (the caller has those already)."""
        for n, path in self.candidates(ids, limit, better_than):
            state = self._read(path, ids[:n])
            if state is None:
                continue
            keep = min(n, limit)
            if state.length > keep:
                try:
                    state.truncate(keep)
                except FastarError:
                    continue
            self.hits += 1
            return state, keep
        self.misses += 1
        return None

    def lookup_async(self, ids: list[int], limit: int, better_than: int = 0) -> Future:
        """`lookup` on the cache's loader thread (one: loads run in the order asked): a Future of its result.
        The caller gets a state nobody else holds, so it may adopt it on its own thread."""
        if self._loader is None:
            self._loader = ThreadPoolExecutor(1, thread_name_prefix="fastar-prefix-load")
        return self._loader.submit(self.lookup, list(ids), limit, better_than)

    def _lengths(self) -> set[int]:
        out = set()
        for p in self.folder.glob(f"*{SUFFIX}"):
            head = p.name.split("-", 1)[0]
            if head.isdigit():
                out.add(int(head))
        return out

    def _read(self, path: Path, ids: list[int]) -> ModelState | None:
        """The state in `path` if it passes every check (its recency is then refreshed); else None, the file
        rejected. A file a peer evicted since it was listed is a plain miss."""
        try:  # a file that cannot be opened or read (a folder, a FIFO under its name, an I/O error): a miss
            with self.disk.opened(path) as f:
                if f is None:
                    return None
                raw = f.read()
                state, why = self._parse(raw, ids)
                if state is None:
                    return self._reject(path, f, why)
                self.disk.touch(f)
                return state
        except OSError as e:
            if path.name not in self._skipped:
                self._skipped.add(path.name)
                log.warning("prefix cache: skipping %s: cannot read (%s)", path, e.strerror or e)
            return None

    def _parse(self, raw: bytes, ids: list[int]) -> tuple[ModelState | None, str]:
        """(the state, "") when `raw` is a whole, intact file of this cache holding the state of `ids`, else
        (None, why not)."""
        if len(raw) < 20 or raw[:8] != MAGIC:
            return None, "not a prefix cache file"
        version, hlen = struct.unpack_from("<IQ", raw, 8)
        if version != VERSION:
            return None, f"version {version}, expected {VERSION}"
        if 20 + hlen > len(raw):
            return None, "truncated (its header is cut short)"
        try:
            header = json.loads(raw[20 : 20 + hlen].decode())
            tokens, size, digest = header["tokens"], int(header["state_bytes"]), header["state_sha256"]
        except (UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as e:  # (nested too deep)
            return None, f"corrupt header ({e})"
        if header.get("fingerprint") != self.fingerprint:
            return None, "saved with another model or numerics"
        body = raw[20 + hlen :]
        if len(body) != size:
            return None, f"truncated or padded (state of {len(body)} bytes, its header says {size})"
        if tokens != ids or hashlib.sha256(body).hexdigest() != digest:
            return None, "its tokens or checksum do not match"
        try:
            state = self.state_type.from_bytes(body)
        except FastarError as e:
            return None, str(e)
        if state.length != len(ids):
            return None, "its state does not hold its tokens"
        return state, ""

    def _reject(self, path: Path, f: BinaryIO, why: str) -> None:
        """Count, log (one line) and remove a file that failed its checks (unless a peer replaced it meanwhile)."""
        self.rejected += 1
        removed = self.disk.remove(path, f)
        log.warning("prefix cache: skipping %s: %s%s", path, why, "; removed" if removed else "")
        return None

    # --- store ----------------------------------------------------------------------------------------------

    def store(self, ids: list[int], state: ModelState, keep: int | None = None) -> Path | None:
        """Save `state`, which has processed exactly `ids`, evicting least recently used files beyond the cap.
        With `keep` < len(ids), a copy rolled back to its first `keep` positions is saved instead, under
        ids[:keep] (the whole state where it cannot roll back that far). A state bigger than the whole cap is not
        stored (None), nor anything while a full disk pauses writing (None), nor where the write fails (None,
        logged once; the request goes on). In background mode only the snapshot is taken here; the serialization,
        the checksum, the write and the eviction run on the writer thread (which also drops a state bigger than
        the cap)."""
        if state.length != len(ids) or not ids:
            raise ValueError(f"a state of {state.length} positions does not hold {len(ids)} tokens")
        snap = None
        if keep is not None and 0 < keep < len(ids):
            if self._held(ids[:keep]):  # stored already: no copy to make
                return self._path(ids[:keep])
            if not self.disk.writable():
                return None
            rolled = state.snapshot()
            try:
                rolled.truncate(keep)
                ids, snap = ids[:keep], rolled
            except StateError:
                pass
        path = self._path(ids)
        if self._held(ids):
            return path
        if not self.disk.writable():
            return None
        # a copy (the live state goes on changing once this returns; a rolled-back one is a copy already), without
        # the rows for long rollbacks; in background mode its bytes are made on the writer thread
        snap = state.snapshot() if snap is None else snap
        _compact(snap)
        if self._writes is None:
            return path if self._write(path, ids, snap.to_bytes()) else None
        self._pending.add(path)
        self._writes.put((path, list(ids), snap))
        return path

    def _path(self, ids: list[int]) -> Path:
        return self.folder / f"{len(ids)}-{prefix_key(ids, self.fingerprint)}{SUFFIX}"

    def _held(self, ids: list[int]) -> bool:
        """Whether the state of `ids` is stored or being written (a stored file's recency is refreshed)."""
        path = self._path(ids)
        if path in self._pending:
            return True
        try:
            os.utime(path)
        except FileNotFoundError:  # not stored (or evicted by a peer a moment ago)
            return False
        except OSError:  # a read-only folder: no recency to keep
            return path.exists()
        return True

    def _write(self, path: Path, ids: list[int], body: bytes) -> bool:
        """Write one file (on the writer thread in background mode); False when it exceeds the whole cap or the
        write failed (the folder logs why, once)."""
        header = json.dumps(
            {
                "fingerprint": self.fingerprint,
                "tokens": [int(t) for t in ids],
                "state_bytes": len(body),
                "state_sha256": hashlib.sha256(body).hexdigest(),
            }
        ).encode()
        head = MAGIC + struct.pack("<IQ", VERSION, len(header)) + header
        if not self.disk.fits(len(head) + len(body)):
            return False
        try:
            if self.disk.publish(path, [head, body]):
                self.stores += 1
        except OSError:
            return False
        return True

    def _writer(self) -> None:
        assert self._writes is not None
        while True:
            path, ids, snap = self._writes.get()
            try:
                if self.disk.writable():  # queued before the disk filled: dropped
                    self._write(path, ids, snap.to_bytes())
            except Exception:  # the writer must outlive one bad state (`flush` waits for it)
                log.exception("prefix cache: cannot save %s", path)
            finally:
                self._pending.discard(path)
                self._writes.task_done()

    def flush(self) -> None:
        """Wait until every stored state is on disk (background mode; a no-op otherwise)."""
        if self._writes is not None:
            self._writes.join()

    def size(self) -> int:
        return self.disk.size()

    def stats(self) -> dict:
        return {
            "hits": self.hits,
            "misses": self.misses,
            "stores": self.stores,
            "evictions": self.evictions,
            "rejected": self.rejected,
            "writes_paused": int(self.disk.paused),
            "bytes": self.size(),
        }


class _Kept:
    __slots__ = ("tokens", "state", "prompt_len")

    def __init__(self, tokens: list[int], state: ModelState, prompt_len: int) -> None:
        self.tokens, self.state, self.prompt_len = tokens, state, prompt_len


class PrefixMemory:
    """The states of the last `capacity` finished requests, in RAM, each with the tokens it has processed.

    A new prompt takes the state with the longest common token prefix. The state is handed over (no copy) when the
    prompt continues that request's conversation: the match covers all the state holds, or at least the request's
    whole prompt (a regenerated or edited last reply, thinking mode dropping the last reasoning). A shorter match
    of at least `min_shared` tokens (a shared system prompt) gets a copy, so the other conversation keeps its
    state. Rolling a state back fails beyond its `max_rollback` positions; then nothing is reused from it (the
    disk cache holds the state at the end of each prompt for that case). Only the worker thread touches it.
    """

    def __init__(self, capacity: int, min_shared: int = 64) -> None:
        if capacity < 0:
            raise ValueError(f"the number of kept states must be >= 0, got {capacity}")
        self.capacity, self.min_shared = capacity, min_shared
        self._kept: list[_Kept] = []  # least recently used first
        self.hits = self.misses = 0

    def _best(self, ids: list[int], limit: int) -> tuple[_Kept | None, int, bool]:
        """(the kept entry to start from, the positions it gives, whether it is handed over) or (None, 0, False)."""
        best, best_n, best_hand = None, 0, False
        for kept in self._kept:  # later entries are more recent: they win ties
            shared = common_prefix(kept.tokens, ids)
            n, hand = min(shared, limit), shared >= len(kept.tokens) or shared >= kept.prompt_len
            # an entry counts only if it can be used: handed over, or copied for at least `min_shared` tokens
            if n > 0 and (hand or n >= self.min_shared) and (n, hand) >= (best_n, best_hand):
                best, best_n, best_hand = kept, n, hand
        return best, best_n, best_hand

    def match(self, ids: list[int], limit: int) -> int:
        """The positions `take` would give (0: none), without taking anything."""
        return self._best(ids, limit)[1]

    def take(self, ids: list[int], limit: int) -> tuple[ModelState, int] | None:
        """(a state of the first n tokens of `ids`, n) with n <= `limit` as large as kept states allow, or None."""
        best, n, hand_over = self._best(ids, limit)
        if best is None:
            self.misses += 1
            return None
        if hand_over:
            self._kept.remove(best)
            state = best.state
        else:
            state = best.state.snapshot()
        if state.length > n:
            try:
                state.truncate(n)
            except StateError:
                self.misses += 1
                return None
        self.hits += 1
        return state, n

    def put(self, tokens: list[int], state: ModelState, prompt_len: int) -> None:
        """Keep `state`, which has processed exactly `tokens` (a request's prompt and part of its reply);
        `prompt_len`: how much of the prompt the conversation's next turn sends again (a prompt ending in `<think>`
        comes back with `</think>` there: the scheduler passes the tokens before it), a match that long hands the
        state over. The least recently used beyond the capacity are dropped."""
        if self.capacity == 0 or not tokens:
            return
        assert state.length == len(tokens), (state.length, len(tokens))
        self._kept = [k for k in self._kept if k.tokens != tokens]
        self._kept.append(_Kept(tokens, state, prompt_len))
        del self._kept[: max(0, len(self._kept) - self.capacity)]

    def __len__(self) -> int:
        return len(self._kept)

    def nbytes(self) -> int:
        return sum(k.state.nbytes() for k in self._kept)
