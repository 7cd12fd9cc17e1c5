"""The prefix cache's folder on disk, shared by threads and processes: what carries a cache file's name is whole.

Owns: `CacheFolder`, the file protocol under `PrefixCache`: publishing a file (written in chunks to a temporary
`.<random>.partial`, fsynced, renamed to its name, the folder fsynced), least-recently-used eviction under the size
cap, removing a file a reader found bad (only the very file it read), removing the temporary files of writers that
died, and pausing writes while the disk is full; `DiskHooks`, the declared seams the fault tests use. Does not own
what a file holds or how it is checked (`fastar.engine.prefix_cache`).

Several processes may share one folder (two servers, a server and `fastar chat`). Every change to the folder's
names (a rename into place, an eviction, a removal, a temporary file's creation) runs under an exclusive `flock`
of the folder itself, so:
- a file is evicted or removed by one process only, and counted once;
- eviction runs before the rename, for the new file's bytes: the files under their names never add up to more than
  the cap, at any moment;
- a bad file is removed only while its reader still has it open and the name still points at that inode (an open
  file's inode number cannot be reused), so a good file a peer has just written under the same name survives;
- a writer holds an `flock` on its temporary file until the rename: a temporary file whose lock can be taken was
  left by a writer that died (`kill -9`, a crash), and is removed when a cache next opens the folder or writes.
Files are never changed in place (they appear by rename, get their mtime touched, disappear), so a reader holding
one open reads all of it whatever its peers do. `flock` is advisory and needs a local filesystem (not NFS).

Full disk: a write that fails with ENOSPC or EDQUOT removes its temporary file, logs one warning and pauses
writing until the filesystem has twice that write's bytes free (one `statvfs` per attempted store while paused);
the first write that then succeeds logs one line. The requests themselves never fail on it.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from ..errors import FastarError

log = logging.getLogger("fastar.prefix_cache")

PARTIAL = ".partial"  # temporary files: "." + random + PARTIAL (never matched by a cache file's glob)
CHUNK = 1 << 20  # bytes written between two `after_chunk` calls
_FULL = (errno.ENOSPC, errno.EDQUOT)


def free_bytes(folder: Path) -> int:
    """Bytes an unprivileged writer may still use on `folder`'s filesystem."""
    st = os.statvfs(folder)
    return st.f_bavail * st.f_frsize


@dataclass
class DiskHooks:
    """Seams between the cache and the disk, for fault tests.

    after_chunk(temporary path, bytes written so far): runs after each chunk of a file is written (the header, then
        every CHUNK bytes of the state); it may raise OSError (a full disk) or block (a process killed mid-write).
    free_bytes(folder): the space left on the folder's filesystem (what ends a full-disk pause).
    """

    after_chunk: Callable[[Path, int], None] | None = None
    free_bytes: Callable[[Path], int] = free_bytes


class CacheFolder:
    """Files named `*<suffix>` in `folder`, at most `max_bytes` in all (see the module docstring).

    `hooks` defaults to the class attribute `CacheFolder.hooks` (a test running a whole server in a child process
    sets that before the server opens its cache)."""

    hooks: DiskHooks = DiskHooks()

    def __init__(self, folder: Path, max_bytes: int, suffix: str, hooks: DiskHooks | None = None) -> None:
        self.folder, self.max_bytes, self.suffix = folder, max_bytes, suffix
        if hooks is not None:
            self.hooks = hooks
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            self._dir = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)  # the lock, and fsync of the names
        except OSError as e:  # a file in its place (FileExistsError), a read-only parent
            raise FastarError(f"{self.folder}: cannot be the cache folder ({e.strerror or e})") from None
        weakref.finalize(self, os.close, self._dir)
        self._thread_lock = threading.Lock()  # flock on one descriptor does not exclude this process's threads
        self.evictions = 0
        self._full_at: int | None = None  # bytes of the write that found the disk full (None: writing)
        self._full_warned = False
        self._errors_warned: set[int] = set()
        with self.locked():
            self._sweep()

    # --- the folder's lock ------------------------------------------------------------------------------------

    @contextmanager
    def locked(self) -> Iterator[None]:
        """Exclusive over every thread and process using the folder (the names' changes happen under it)."""
        with self._thread_lock:
            fcntl.flock(self._dir, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(self._dir, fcntl.LOCK_UN)

    def _sweep(self) -> None:
        """(Locked.) Remove the temporary files of writers that died: those whose flock can be taken."""
        for p in self.folder.glob(f".*{PARTIAL}"):
            try:
                fd = os.open(p, os.O_RDONLY)
            except FileNotFoundError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # a live writer's (this process's or another's)
            else:
                p.unlink(missing_ok=True)
                log.info("prefix cache: removed %s, left by a writer that stopped mid-write", p)
            finally:
                os.close(fd)

    # --- reading ------------------------------------------------------------------------------------------------

    def files(self) -> list[tuple[int, int, Path]]:
        """(mtime ns, bytes, path) of the cache files now present."""
        out = []
        for p in self.folder.glob(f"*{self.suffix}"):
            try:
                st = p.stat()
            except FileNotFoundError:  # evicted meanwhile
                continue
            if stat.S_ISREG(st.st_mode):  # no folder to count, nor to evict
                out.append((st.st_mtime_ns, st.st_size, p))
        return out

    def size(self) -> int:
        return sum(size for _, size, _ in self.files())

    @contextmanager
    def opened(self, path: Path) -> Iterator[BinaryIO | None]:
        """`path` open for reading, or None when it is gone (evicted by a peer since it was listed)."""
        try:  # O_NONBLOCK: a FIFO under a state's name must not block the open (and the loader) forever
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            yield None
            return
        with os.fdopen(fd, "rb") as f:
            if not stat.S_ISREG(os.fstat(fd).st_mode):  # a folder or a device under a state's name: no state
                raise OSError(errno.EINVAL, "not a regular file", str(path))
            yield f

    @staticmethod
    def touch(f: BinaryIO) -> None:
        """Mark the open file as just used (its mtime is its recency; harmless if a peer evicted it meanwhile)."""
        try:
            os.utime(f.fileno())
        except OSError:  # a read-only folder: no recency to keep
            pass

    def remove(self, path: Path, f: BinaryIO) -> bool:
        """Remove `path` if it is still the file `f` (open) was read from; True when removed."""
        st = os.fstat(f.fileno())
        with self.locked():
            try:
                now = os.stat(path)
            except FileNotFoundError:
                return False
            if (now.st_dev, now.st_ino) != (st.st_dev, st.st_ino):
                return False  # a peer has written a new file under this name since
            path.unlink()
            return True

    # --- writing ------------------------------------------------------------------------------------------------

    def writable(self) -> bool:
        """False while a full disk pauses writing (until it has room for twice the write that failed)."""
        need = self._full_at
        if need is None:
            return True
        try:
            if self.hooks.free_bytes(self.folder) < 2 * need:
                return False
        except OSError:
            return False
        self._full_at = None
        return True

    @property
    def paused(self) -> bool:
        return self._full_at is not None

    def publish(self, path: Path, parts: Sequence[bytes]) -> bool:
        """Write `parts` back to back as the file `path`: False when a file of that name was there already (a peer
        wrote it: it is kept, this copy dropped). The caller checks the cap first (`fits`). Raises OSError with
        nothing left behind; a full disk also pauses writing (`writable`)."""
        size = sum(len(p) for p in parts)
        try:
            with self.locked():
                fd, name = tempfile.mkstemp(prefix=".", suffix=PARTIAL, dir=self.folder)
                fcntl.flock(fd, fcntl.LOCK_EX)  # held until closed: the sweep's sign of a live writer
        except OSError as e:  # no inode or no room for one
            self._failed(e, size)
            raise
        tmp = Path(name)
        try:
            with os.fdopen(fd, "wb") as f:
                written = 0
                for part in parts:
                    view = memoryview(part)
                    for a in range(0, max(len(view), 1), CHUNK):
                        f.write(view[a : a + CHUNK])
                        written += len(view[a : a + CHUNK])
                        if self.hooks.after_chunk is not None:
                            f.flush()
                            self.hooks.after_chunk(tmp, written)
                f.flush()
                os.fsync(f.fileno())
                with self.locked():
                    if path.exists():
                        tmp.unlink()
                        return False
                    self._make_room(size)
                    os.replace(tmp, path)
                    os.fsync(self._dir)
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if isinstance(e, OSError):
                self._failed(e, size)
            raise
        if self._full_warned:
            self._full_warned = False
            log.info("prefix cache: %s has room again: saving prompt states", self.folder)
        return True

    def fits(self, size: int) -> bool:
        return size <= self.max_bytes

    def _make_room(self, size: int) -> None:
        """(Locked.) Evict the least recently used files until `size` more bytes stay within the cap; and remove
        what dead writers left."""
        self._sweep()
        files = self.files()
        total = sum(s for _, s, _ in files)
        for _, s, p in sorted(files, key=lambda f: f[0]):
            if total + size <= self.max_bytes:
                break
            p.unlink(missing_ok=True)
            total -= s
            self.evictions += 1

    def _failed(self, e: OSError, size: int) -> None:
        if e.errno in _FULL:
            self._full_at = max(size, self._full_at or 0)
            if not self._full_warned:
                self._full_warned = True
                log.warning(
                    "prefix cache: the disk of %s is full (%s): prompt states are not saved until %d bytes are free",
                    self.folder,
                    e.strerror or e,
                    2 * self._full_at,
                )
        elif e.errno not in self._errors_warned:
            self._errors_warned.add(e.errno)
            log.warning("prefix cache: cannot write in %s (%s): prompt states are not saved", self.folder, e)
