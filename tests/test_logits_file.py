"""`fastar.engine.logits_file`: a saved run's integrity. A truncated file, and one with flipped bytes in its rows,
gave wrong KL numbers without a word (or the size check's 'truncated or corrupt'); each is one line naming the file
and what is wrong now (the sizes; the block, its rows and token positions), found while the comparison reads the
rows. Version 1 files (no checksums) still read."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest

from fastar.cli import main
from fastar.engine.logits_file import ALIGN, MAGIC, LogitsFile, LogitsWriter
from fastar.errors import FastarError

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 16


def _write(path, pieces=(3, 5, 1, 4), block_rows=3) -> tuple[np.ndarray, np.ndarray]:
    """A run of sum(pieces) rows added piece by piece (the pieces cross the blocks' edges); its rows and targets."""
    m = sum(pieces)
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((m, V)).astype(np.float16)
    targets = rng.standard_normal(m).astype(np.float32)
    w = LogitsWriter(path, list(range(m + 1)), list(range(1, m + 1)), V, block_rows=block_rows, ctx=4, stride=2)
    k = 0
    for p in pieces:
        w.add(rows[k : k + p], targets[k : k + p])
        k += p
    w.close()
    return rows, targets


def _layout(raw: bytes) -> tuple[dict, int, int]:
    """(header, the header's length, where the rows start) of a saved file."""
    hlen = struct.unpack_from("<Q", raw, len(MAGIC) + 4)[0]
    header = json.loads(raw[len(MAGIC) + 12 : len(MAGIC) + 12 + hlen])
    start = len(MAGIC) + 12 + hlen
    start += -start % ALIGN
    return header, hlen, start + 4 * header["num_tokens"] + 4 * header["num_scored"]


def test_rows_read_back_each_block_checked_once(tmp_path, monkeypatch):
    rows, targets = _write(tmp_path / "run.logits")
    f = LogitsFile(tmp_path / "run.logits")
    assert f.version == 2 and f.block_rows == 3 and f.header["num_scored"] == 13
    import xxhash

    hashed = []
    real = xxhash.xxh64_intdigest
    monkeypatch.setattr(xxhash, "xxh64_intdigest", lambda b: hashed.append(len(bytes(b))) or real(b))
    got = np.concatenate([f.rows_at(k, n) for k, n in ((0, 2), (2, 5), (7, 6))])
    assert np.array_equal(got, rows) and np.array_equal(f.targets, targets)
    assert hashed == [3 * V * 2] * 4 + [V * 2]  # five blocks (the last of one row), each hashed once
    assert np.array_equal(f.rows_at(4, 9), rows[4:]) and len(hashed) == 5


def test_a_truncated_or_longer_file_names_both_sizes(tmp_path):
    _write(tmp_path / "run.logits")
    raw = (tmp_path / "run.logits").read_bytes()
    for name, data, why in (
        ("short.logits", raw[:-10], "truncated"),
        ("long.logits", raw + b"\0" * 10, "longer than its header says"),
    ):
        (tmp_path / name).write_bytes(data)
        with pytest.raises(FastarError) as err:
            LogitsFile(tmp_path / name)
        assert str(err.value) == (
            f"{tmp_path / name}: the logits file is {why}: {len(data):,} bytes, its header (14 tokens, 13 scored rows "
            f"of 16) says {len(raw):,}"
        )


def test_flipped_bytes_in_the_rows_name_their_block(tmp_path):
    """A flipped byte in row 7 (block 3 of 5, rows 6 to 8): the blocks before it read, its rows do not."""
    rows, _ = _write(tmp_path / "run.logits")
    raw = bytearray((tmp_path / "run.logits").read_bytes())
    _, _, at = _layout(raw)
    raw[at + 7 * V * 2 + 5] ^= 0x10
    (tmp_path / "bad.logits").write_bytes(raw)
    f = LogitsFile(tmp_path / "bad.logits")  # the rows are checked as they are read
    assert np.array_equal(f.rows_at(0, 6), rows[:6])
    with pytest.raises(FastarError) as err:
        f.rows_at(5, 2)
    assert str(err.value) == (
        f"{tmp_path / 'bad.logits'}: the logits file is corrupt: rows 6 to 8 (block 3 of 5; token positions 7 to 9) "
        "do not match their checksum"
    )


@pytest.mark.parametrize("where", ["target logprobs", "token ids", "the header"])
def test_flipped_bytes_elsewhere_are_found_when_it_opens(tmp_path, where):
    _write(tmp_path / "run.logits")
    raw = bytearray((tmp_path / "run.logits").read_bytes())
    header, hlen, rows_at = _layout(raw)
    at = {
        "target logprobs": rows_at + 13 * V * 2 + 9,
        "token ids": rows_at - 4 * 13 - 4 * 14 + 8,
        "the header": raw.index(b'"stride": 2') + len('"stride": '),  # 2 -> 3: still a header, not the one saved
    }[where]
    raw[at] ^= 0x01
    (tmp_path / "bad.logits").write_bytes(raw)
    with pytest.raises(FastarError, match=r"bad\.logits: the logits file is corrupt: its header, token ids, scored"):
        LogitsFile(tmp_path / "bad.logits")


def test_a_version_1_file_reads_unchecked(tmp_path):
    """Written before the checksums: no block_rows, no trailer. It reads as before, rows as saved."""
    rows, targets = _write(tmp_path / "run.logits")
    raw = (tmp_path / "run.logits").read_bytes()
    header, hlen, at = _layout(raw)
    del header["block_rows"]
    body = json.dumps(header, sort_keys=True).encode()
    head = MAGIC + struct.pack("<IQ", 1, len(body)) + body
    head += b"\0" * (-len(head) % ALIGN)
    data_start = at - 4 * 13 - 4 * 14
    v1 = head + raw[data_start : at + 13 * V * 2 + 13 * 4]  # ids, positions, rows, targets; no trailer
    (tmp_path / "v1.logits").write_bytes(v1)
    f = LogitsFile(tmp_path / "v1.logits")
    assert f.version == 1 and np.array_equal(f.rows_at(0, 13), rows) and np.array_equal(f.targets, targets)


def test_kl_divergence_against_a_corrupt_base_is_one_line(vocab_ckpt, tmp_path, capsys):
    """The command: a base with a flipped byte in a row gave KL numbers a little off, without a word; one line
    naming the file and the block now, exit 1, and a --save-logits of the same run is not left looking complete."""
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word {i} of the text, number {i * 7 % 13}." for i in range(40)))
    base = tmp_path / "base.logits"
    assert main(["perplexity", str(text), "-m", str(vocab_ckpt), "--ctx", "64", "--save-logits", str(base)]) == 0
    raw = bytearray(base.read_bytes())
    header, _, at = _layout(raw)
    assert header["num_scored"] > 2 * header["block_rows"] == 128  # blocks of 64 rows: the flip is in the second
    raw[at + 70 * 2 * header["vocab_size"] + 300] ^= 0x20
    bad = tmp_path / "bad.logits"
    bad.write_bytes(raw)
    capsys.readouterr()
    args = ["perplexity", str(text), "-m", str(vocab_ckpt), "--ctx", "64", "--kl-divergence"]
    assert main([*args, str(base)]) == 0
    assert "mean KLD      0.000000" in capsys.readouterr().out
    code = main([*args, str(bad), "--save-logits", str(tmp_path / "again.logits")])
    out, err = capsys.readouterr()
    positions = np.memmap(bad, "<i4", "r", at - 4 * header["num_scored"], (header["num_scored"],))
    assert (code, out) == (1, "")
    assert err == (
        f"fastar: error: {bad}: the logits file is corrupt: rows 64 to 127 (block 2 of "
        f"{-(-header['num_scored'] // 64)}; token positions {positions[64]} to {positions[127]}) do not match their "
        "checksum\n"
    )
    assert not (tmp_path / "again.logits").exists() and not list(tmp_path.glob(".again.logits*"))
