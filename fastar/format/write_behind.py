"""Large aligned writes of one file through O_DIRECT, on a thread of their own, while the caller reads on.

Why: a converter reads a checkpoint of ~160 GB and writes as much. Through the page cache the writes run at the
kernel's writeback pace once its dirty limit fills (0.15-0.3 GB/s on the development disk, whose O_DIRECT writes run
at ~1.3 GB/s), they push the page cache's useful contents out for bytes nobody reads soon, and the caller waits for
each write before it reads the next tensor. `WriteBehind` copies each write into one of a few page-aligned buffers
and returns; its thread writes them with `pwrite` (which releases the GIL), so the next read overlaps this write.

Owns: the O_DIRECT descriptor, the buffers (`BUFFERS` of `CHUNK` bytes), the thread, and the first error a write met
(raised by the next call: `write`, `drain`). A write's bytes are padded with zeros to a multiple of `spec.ALIGN`:
the caller writes only where the space up to the next `ALIGN` boundary is its own (every `.fst` region starts
aligned). Does not own: which writes are direct (`fastar.format.writer.FstWriter`), the file's other descriptor,
fsync (the writer's, after `drain`).
"""

from __future__ import annotations

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
