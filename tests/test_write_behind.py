"""The writer's O_DIRECT path (fastar.format.write_behind): the same bytes as the page cache's path, a filesystem
that refuses it falls back, and a write that fails on its thread ends the file with one error and no partial file."""

from __future__ import annotations

import dataclasses
import errno
import os

import numpy as np
import pytest
from test_format import CFG

from fastar.errors import FastarError
from fastar.format import spec, write_behind
from fastar.format.reader import FstFile
from fastar.format.writer import DIRECT_MIN, FstWriter

BIG = (write_behind.CHUNK + 3 * 4096 + 37) // 2  # bf16 values: more than one buffer, a length off the alignment
MID = (DIRECT_MIN + 4096 + 10, 3)  # uint8 [N, 3]: above DIRECT_MIN, an odd length
EXPERT_SHAPES = [(256, 128), (256, 8), (256, 128), (256, 8), (256, 128), (256, 8)]  # hidden 256, inter 256
WIDE = dataclasses.replace(CFG, hidden_size=256, moe_intermediate_size=256)  # 64 KiB+ expert records


def write_big(path, direct_io: bool):
    """A file whose large regions take the direct path (a multi-buffer tensor, an odd-length one, 64 KiB+ expert
    records) beside small ones that do not; returns the bytes written."""
    rng = np.random.default_rng(5)
    tensors = {
        "embed.weight": ("BF16", rng.integers(0, 65535, (BIG,), dtype=np.uint16)),
        "hc_head_base": ("F32", rng.standard_normal(4).astype(np.float32)),
        "layers.0.ffn.gate.tid2eid": ("I64", rng.integers(0, 3, (100, 2), dtype=np.int64)),
        "layers.0.attn.wq_a.weight": ("F8_E4M3", rng.integers(0, 255, MID, dtype=np.uint8)),
    }
    w = FstWriter(path, WIDE.to_dict(), source={"test": True}, direct_io=direct_io)
    with w:
        for n, (dt, a) in tensors.items():
            w.add_tensor(n, dt, a.shape)
        w.set_expert_bank(3, 3, 256, 256)
        w.begin()
        for n, (_, a) in tensors.items():
            w.write_tensor(n, a)
        for s in range(3):
            for e in range(3):
                w.write_expert(s, e, [rng.integers(0, 256, sh, dtype=np.uint8) for sh in EXPERT_SHAPES])
        w.finish()
    return path.read_bytes()


class Counted(write_behind.WriteBehind):
    bytes = 0

    def put(self, buf, n, offset):
        Counted.bytes += n
        super().put(buf, n, offset)


def needs_direct(folder) -> None:
    probe = folder / "probe"
    probe.write_bytes(b"")
    fd = write_behind.open_direct(probe)
    probe.unlink()
    if fd is None:
        pytest.skip(f"the filesystem of {folder} has no O_DIRECT: the writer takes the page cache alone there")
    os.close(fd)


def test_direct_and_page_cache_writes_give_the_same_file(tmp_path, monkeypatch):
    needs_direct(tmp_path)
    monkeypatch.setattr("fastar.format.writer.WriteBehind", Counted)
    direct = write_big(tmp_path / "direct.fst", direct_io=True)
    records = 9 * spec.expert_stride(spec.expert_sections(256, 256))
    assert Counted.bytes == 2 * BIG + MID[0] * 3 + records  # the big tensors and every expert record, directly
    Counted.bytes = 0
    assert write_big(tmp_path / "cached.fst", direct_io=False) == direct and Counted.bytes == 0
    with FstFile(tmp_path / "direct.fst") as f:
        assert f.verify() == []


def test_a_filesystem_refusing_direct_writes_takes_the_page_cache(tmp_path, monkeypatch):
    needs_direct(tmp_path)
    calls = []

    def refuse(fd, data, offset):  # what a filesystem wanting other alignment answers (page-cache writes: no pwrite)
        calls.append(offset)
        raise OSError(errno.EINVAL, "Invalid argument")

    want = write_big(tmp_path / "cached.fst", direct_io=False)
    monkeypatch.setattr(os, "pwrite", refuse)
    assert write_big(tmp_path / "direct.fst", direct_io=True) == want
    assert len(calls) == 1  # tried once, then never again


def disk_fills_after(writes: int, monkeypatch) -> list[int]:
    """os.pwrite (the direct writes' call) failing with ENOSPC after `writes` of them; returns the offsets tried."""
    real, seen = os.pwrite, []

    def pwrite(fd, data, offset):
        seen.append(offset)
        if len(seen) > writes:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    return seen


def test_a_direct_write_failing_on_its_thread_is_one_error_and_no_file(tmp_path, monkeypatch):
    needs_direct(tmp_path)
    seen = disk_fills_after(2, monkeypatch)
    with pytest.raises(FastarError, match=r"failed: No space left on device$"):
        write_big(tmp_path / "m.fst", direct_io=True)
    assert list(tmp_path.iterdir()) == [] and len(seen) == 3  # the rest dropped once one failed


def test_a_disk_without_room_for_the_file_is_said_before_writing(tmp_path, monkeypatch):
    """The free space is checked against the planned file's size at `begin`: one error naming both, before
    minutes of writing, and nothing left behind."""
    import shutil

    from fastar.errors import FormatError

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1 << 20))
    with pytest.raises(FormatError, match=r"m\.fst: needs 0\.0[0-9] GB, .* has 0\.00 GB free$"):
        write_big(tmp_path / "m.fst", direct_io=True)
    assert list(tmp_path.iterdir()) == []


def test_an_unexpected_error_on_the_thread_is_raised_not_waited_for(tmp_path, monkeypatch):
    """Whatever a write raises on the thread (here a TypeError, as a bug would) reaches the caller at its next
    call; the thread goes on answering, so `drain` returns rather than waiting for ever."""
    needs_direct(tmp_path)
    p = tmp_path / "x"
    p.write_bytes(b"")

    def bug(fd, data, offset):
        raise TypeError("a bug")

    w = write_behind.WriteBehind(write_behind.open_direct(p), p)
    monkeypatch.setattr(os, "pwrite", bug)
    try:
        with pytest.raises(TypeError, match="a bug"):  # at the write's later buffers, or else at the drain
            w.write(0, memoryview(bytes(3 * write_behind.CHUNK)))
            w.drain()
        with pytest.raises(TypeError, match="a bug"):  # it stays: the file is being abandoned
            w.drain()
    finally:
        w.close()


def stream_pieces():
    """Writes of odd sizes that cross the buffers' edges, more than two buffers in all."""
    rng = np.random.default_rng(9)
    sizes = [8, 1000, write_behind.CHUNK - 3, 5, write_behind.CHUNK + 4097, 77]
    return [rng.integers(0, 256, n, dtype=np.uint8) for n in sizes]


def test_a_direct_stream_writes_the_bytes_it_is_given(tmp_path):
    needs_direct(tmp_path)
    pieces = stream_pieces()
    with write_behind.DirectStream(tmp_path / "s") as f:
        for a in pieces:
            f.write(a)
    assert (tmp_path / "s").read_bytes() == b"".join(a.tobytes() for a in pieces)


def test_a_direct_stream_refused_by_the_filesystem_takes_the_page_cache(tmp_path, monkeypatch):
    needs_direct(tmp_path)
    refused = []

    def refuse(fd, data, offset):
        refused.append(offset)
        raise OSError(errno.EINVAL, "Invalid argument")

    monkeypatch.setattr(os, "pwrite", refuse)  # the page cache's writes do not use pwrite
    pieces = stream_pieces()
    with write_behind.DirectStream(tmp_path / "s") as f:
        for a in pieces:
            f.write(a)
    assert (tmp_path / "s").read_bytes() == b"".join(a.tobytes() for a in pieces) and refused == [0]


def test_a_direct_stream_failing_raises_and_an_abort_stops_quietly(tmp_path, monkeypatch):
    needs_direct(tmp_path)
    disk_fills_after(1, monkeypatch)
    with pytest.raises(OSError, match="No space left"), write_behind.DirectStream(tmp_path / "s") as f:
        for a in stream_pieces():
            f.write(a)
    with pytest.raises(RuntimeError, match="killed"), write_behind.DirectStream(tmp_path / "t") as f:
        f.write(stream_pieces()[2])
        raise RuntimeError("killed")  # the exit aborts: no drain, no second error over the first


def test_a_filesystem_that_does_not_say_its_free_space_is_written_to(tmp_path, monkeypatch):
    import shutil

    def unknown(path):
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(shutil, "disk_usage", unknown)
    write_big(tmp_path / "m.fst", direct_io=False)
    with FstFile(tmp_path / "m.fst") as f:
        assert f.verify() == []
