"""Large aligned writes of one file through O_DIRECT, on a thread of their own, while the caller reads on.

Why: a converter reads a checkpoint of ~160 GB and writes as much. Through the page cache the writes run at the
kernel's writeback pace once its dirty limit fills (0.15-0.3 GB/s on the development disk, whose O_DIRECT writes run
at ~1.3 GB/s), they push the page cache's useful contents out for bytes nobody reads soon, and the caller waits for
each write before it reads the next tensor. `WriteBehind` copies each write into one of a few page-aligned buffers
and returns; its thread writes them with `pwrite` (which releases the GIL), so the next read overlaps this write.

Owns: the O_DIRECT descriptor, the buffers (`BUFFERS` of `CHUNK` bytes), the thread, and the first error a write met
(raised by the next call: `write`, `drain`). A write's bytes are padded with zeros to a multiple of `spec.ALIGN`: the
caller writes only where the space up to the next `ALIGN` boundary is its own (every `.fst` region starts aligned).
Also `DirectStream`: a file written front to back through it (the safetensors shards of `fastar export`, whose
tensors are not aligned), its last buffer padded and the file cut back at the end. Does not own: which writes are
direct (`fastar.format.writer.FstWriter`), the file's other descriptor, fsync (the writer's, after `drain`).
"""

from __future__ import annotations

import errno
import mmap
import os
import queue
import threading

from . import spec

CHUNK = 16 << 20  # bytes a buffer holds: one pwrite each
BUFFERS = 4  # buffers in flight: the caller fills one while the thread writes the others


def open_direct(path: os.PathLike | str) -> int | None:
    """A write descriptor of `path` (existing) with O_DIRECT, or None where the OS or the filesystem has none
    (macOS, tmpfs): the caller then writes through the page cache."""
    flag = getattr(os, "O_DIRECT", 0)  # an OS feature probe: Linux and the BSDs have it
    if not flag:
        return None
    try:
        return os.open(path, os.O_WRONLY | flag)
    except OSError:
        return None


class WriteBehind:
    """`write(offset, data)`: queue data for the file at offset (a multiple of `spec.ALIGN`) through O_DIRECT;
    `take()` and `put(buf, n, offset)`: the same, the caller filling one of the buffers in place (no copy);
    `write_plain(offset, data)`: queue a small write through the page cache, in order with the others (a buffered
    write on the caller's thread would wait for the file's lock while a direct write is in flight); `drain()`: wait
    for every queued write and raise the first error; `close()`: stop the thread and close the descriptors (the
    queued writes that have not started are dropped). Used by one thread (the caller) besides its own."""

    @classmethod
    def open(cls, path: os.PathLike | str) -> WriteBehind | None:
        """One over the existing file `path`, or None where it has no O_DIRECT (`open_direct`)."""
        fd = open_direct(path)
        return cls(fd, path) if fd is not None else None

    def __init__(self, fd: int, path: os.PathLike | str) -> None:
        """fd: `open_direct(path)`'s descriptor, which this now owns."""
        self._fd = fd
        self._plain = os.open(path, os.O_WRONLY)
        self._free: queue.SimpleQueue[memoryview] = queue.SimpleQueue()
        for _ in range(BUFFERS):
            self._free.put(memoryview(mmap.mmap(-1, CHUNK)))  # page-aligned, as O_DIRECT requires
        self._jobs: queue.SimpleQueue[tuple[memoryview | bytes, int, int] | None] = queue.SimpleQueue()
        self._error: Exception | None = None
        self._pending = 0  # writes queued and not yet done (the caller's count; the thread signals `_done`)
        self._done = threading.Semaphore(0)
        self._thread = threading.Thread(target=self._run, name="fst-write-behind", daemon=True)
        self._thread.start()

    def write(self, offset: int, data: memoryview) -> None:
        src = data.cast("B") if data.format != "B" or data.ndim != 1 else data
        n = len(src)
        for a in range(0, n, CHUNK):
            m = min(CHUNK, n - a)
            buf = self.take()
            buf[:m] = src[a : a + m]
            self.put(buf, m, offset + a)

    def take(self) -> memoryview:
        """A free buffer of `CHUNK` bytes for the caller to fill and `put` (waits while every buffer is queued)."""
        self._raise()
        return self._free.get()

    def put(self, buf: memoryview, n: int, offset: int) -> None:
        """Queue buf[:n] (from `take`) for the file at offset (a multiple of `spec.ALIGN`), zero-padded."""
        if offset % spec.ALIGN:
            raise ValueError(f"direct write at offset {offset}: not a multiple of {spec.ALIGN}")
        padded = spec.align(n)
        if padded > n:
            buf[n:padded] = bytes(padded - n)
        self._pending += 1
        self._jobs.put((buf, padded, offset))
        self._raise()

    def write_plain(self, offset: int, data: memoryview) -> None:
        self._raise()
        self._pending += 1
        self._jobs.put((bytes(data), len(data), offset))

    def drain(self) -> None:
        """Wait for every queued write; raise the first error one met (an OSError, as a write's)."""
        while self._pending:
            self._done.acquire()
            self._pending -= 1
        self._raise()

    def accepted(self) -> bool:
        """Wait for the writes queued so far (the first ones: the probe of the filesystem). False where it refused
        them as O_DIRECT writes (EINVAL: it wants other alignment), this then closed, so the caller writes through
        the page cache from there; any other error is raised."""
        try:
            self.drain()
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            self.close()
            return False
        return True

    def close(self) -> None:
        if self._thread.is_alive():
            self._jobs.put(None)
            self._thread.join()
        for fd in (self._fd, self._plain):
            if fd >= 0:
                os.close(fd)
        self._fd = self._plain = -1

    def _raise(self) -> None:
        if self._error is not None:
            raise self._error

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            buf, n, offset = job
            direct = isinstance(buf, memoryview)  # one of the aligned buffers; a plain write's bytes otherwise
            try:
                if self._error is None:  # after an error, the rest is dropped: the file is being abandoned
                    done, fd = 0, self._fd if direct else self._plain
                    while done < n:
                        done += os.pwrite(fd, buf[done:n], offset + done)
            except Exception as e:  # any: kept for the caller to raise, and the thread goes on (else drain would hang)
                self._error = e
            finally:
                if direct:
                    self._free.put(buf)
                self._done.release()


class DirectStream:
    """A new file written front to back (`write(data)`, then `close()`), through `WriteBehind` where the filesystem
    has O_DIRECT (the buffers filled in order, the last one padded and the file cut back to the bytes written at
    `close`), else through the page cache. A first direct write the filesystem refuses (EINVAL) goes through the page
    cache with everything after it. Raises OSError as a file's writes do."""

    def __init__(self, path: os.PathLike | str) -> None:
        self._f = open(path, "wb")  # noqa: SIM115 (closed by `close`)
        self._direct = WriteBehind.open(path)
        self._probed = False  # the first direct write waited for (EINVAL: the page cache from then on)
        self._buf: memoryview | None = None
        self._fill = self._base = 0  # bytes in the buffer being filled; the file offset it goes to
        self.size = 0

    def write(self, data) -> None:
        src = memoryview(data).cast("B")
        self.size += len(src)
        if self._direct is None:
            self._f.write(src)
            return
        i = 0
        while i < len(src):
            if self._buf is None:
                self._buf, self._fill = self._direct.take(), 0
            m = min(CHUNK - self._fill, len(src) - i)
            self._buf[self._fill : self._fill + m] = src[i : i + m]
            self._fill, i = self._fill + m, i + m
            if self._fill == CHUNK:
                self._flush()
                if self._direct is None:  # refused: the rest of this write through the page cache
                    self._f.write(src[i:])
                    return

    def _flush(self) -> None:
        """Queue the buffer being filled (the first one waited for: a refusal falls back to the page cache)."""
        buf, n, self._buf = self._buf, self._fill, None
        self._direct.put(buf, n, self._base)
        self._base += n
        if self._probed:
            return
        self._probed = True
        if not self._direct.accepted():
            self._direct = None
            self._f.seek(self._base - n)
            self._f.write(buf[:n])

    def close(self) -> None:
        """Write what is left, wait for every write, cut the padding off and close (raises a write's OSError)."""
        try:
            if self._direct is not None and self._buf is not None and self._fill:
                self._flush()
            if self._direct is not None:
                self._direct.drain()
                self._f.truncate(self.size)
        finally:
            self.abort()

    def abort(self) -> None:
        """Stop and close without finishing (the caller removes the file)."""
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        self._f.close()

    def __enter__(self) -> DirectStream:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()
