"""Running straight from the official checkpoint directory: the `Checkpoint` weight source gives exactly the
outputs of the `.fst` converted from it (default engine: `official` numerics, kernels when built), reads
experts by byte range (six tensors, nothing else), and `fastar run -m DIR` works like `fastar run -m FILE`."""

from __future__ import annotations

import numpy as np
import pytest

from fastar import cli
from fastar.convert import checkpoint as ckmod
from fastar.convert.checkpoint import Checkpoint
from fastar.convert.hf import convert
from fastar.convert.names import expert_tensor_names
from fastar.engine.engine import load, open_source
from fastar.format.reader import FstFile

IDS = [3, 17, 250, 999, 4, 4, 4, 61, 700, 12, 0, 1, 512, 300, 301, 302, 9, 88, 1023, 5, 6, 7, 8, 900]


@pytest.fixture(scope="module")
def converted(tiny_ckpt, tmp_path_factory):
    return convert(tiny_ckpt, tmp_path_factory.mktemp("hf-src") / "tiny.fst", progress=False)


def test_open_source_dispatches_on_the_path(tiny_ckpt, converted):
    assert isinstance(open_source(tiny_ckpt), Checkpoint)
    assert isinstance(open_source(converted), FstFile)


def test_directory_logits_and_generation_equal_the_converted_fst(tiny_ckpt, converted):
    a, b = load(tiny_ckpt), load(converted)
    assert np.array_equal(a.logits(IDS), b.logits(IDS))  # exactly: same bytes, same kernels
    assert a.generate_tokens(IDS[:9], 4, ignore_eos=True) == b.generate_tokens(IDS[:9], 4, ignore_eos=True)


def test_experts_are_read_by_byte_range(tiny_ckpt, monkeypatch):
    ck = Checkpoint(tiny_ckpt)
    reads: list[tuple[str, int, int]] = []
    real = ckmod._pread_into

    def spy(fd, buf, offset):
        n = real(fd, buf, offset)
        reads.append((fd, offset, n))
        return n

    monkeypatch.setattr(ckmod, "_pread_into", spy)
    ew = ck.expert(3, 5)
    names = expert_tensor_names(3, 5, ck.config)
    want = sorted((ck.tensor_info(n).offset, ck.tensor_info(n).nbytes) for n in names.values())
    assert sorted((off, n) for _, off, n in reads) == want  # six preads, exactly the six tensors
    for field, name in names.items():
        assert np.array_equal(getattr(ew, field), np.asarray(ck.read(name)))


def test_fastar_run_from_the_directory_equals_the_fst(vocab_ckpt, tmp_path, capsys):
    fst = convert(vocab_ckpt, tmp_path / "vocab.fst", progress=False)
    outs = []
    for model in (vocab_ckpt, fst):
        assert cli.main(["run", "-m", str(model), "-p", "Hello", "-n", "4", "--temp", "0"]) == 0
        outs.append(capsys.readouterr().out)
    assert outs[0] == outs[1] and outs[0].strip()
