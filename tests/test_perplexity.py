"""`fastar perplexity` and `Engine.perplexity`: the windows, the number against exp(mean NLL) of the engine's own
logits, the token-by-token comparison of two runs (exactly 0 for runs that compute the same numbers, above 0 for
`reference` against `official` numerics), and one-line errors for files and windows that cannot be scored."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch

from fastar.cli import build_parser, main
from fastar.engine.engine import load
from fastar.engine.perplexity import windows

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = " ".join(f"line {i}: the quick brown fox jumps over the lazy dog number {i * 7 % 13}." for i in range(12))


@pytest.fixture(scope="module")
def text_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("ppl") / "text.txt"
    path.write_text(TEXT, encoding="utf-8")
    return path


def run(capsys, *args) -> tuple[int, str, str]:
    code = main([str(a) for a in args])
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize("n,ctx,stride", [(100, 32, 16), (100, 32, 31), (100, 32, 32), (33, 32, 8), (10, 32, 5)])
def test_windows_score_each_token_once(n, ctx, stride):
    spans = windows(n, ctx, stride)
    scored = [p for _, e, first in spans for p in range(first, e)]
    assert len(scored) == len(set(scored)) and all(e - b <= ctx for b, e, _ in spans) and spans[-1][1] == n
    assert all(b < first for b, _, first in spans)  # every scored token has at least one token before it
    if stride < ctx:
        assert scored == list(range(1, n))  # all but the first
        assert all(first - b >= min(ctx - stride, first) for b, _, first in spans[1:])
    else:  # windows side by side: each window's first token has nothing before it in its window
        assert len(scored) == n - len(spans)


def test_perplexity_is_exp_mean_nll_of_the_engine_logits(vocab_ckpt, text_file, capsys):
    code, out, err = run(capsys, "perplexity", text_file, "-m", vocab_ckpt, "--ctx", 64, "--stride", 24, "--json")
    assert code == 0, err
    got = json.loads(out)
    eng = load(vocab_ckpt)
    ids = eng.tokenizer.encode(TEXT)
    nll = []
    for b, e, first in windows(len(ids), 64, 24):  # each window from a fresh state, its new tokens scored
        logp = torch.log_softmax(torch.from_numpy(eng.logits(ids[b:e])), dim=-1)
        nll += [-float(logp[p - b - 1, ids[p]]) for p in range(first, e)]
    assert got["tokens"] == len(ids) and got["scored"] == len(ids) - 1 == len(nll) and got["windows"] > 3
    assert got["nll"] == pytest.approx(np.mean(nll), rel=1e-12)
    assert got["ppl"] == pytest.approx(math.exp(np.mean(nll)), rel=1e-12)
    assert got["nll_stderr"] == pytest.approx(np.std(nll, ddof=1) / math.sqrt(len(nll)), rel=1e-9)
    assert got["tokens_per_s"] > 0 and got["evaluated_tokens"] > len(ids)
    api = eng.perplexity(TEXT, ctx=64, stride=24)  # the same from Python
    assert api.ppl == got["ppl"] and api.summary()["scored"] == got["scored"]


def test_the_parser_declares_the_engine_options_perplexity_has_no_flag_for():
    """open_engine reads ctx_size and draft: the perplexity parser declares them (no context override, no draft)
    rather than cmd_perplexity writing them into the parsed namespace."""
    a = build_parser().parse_args(["perplexity", "text.txt"])
    assert (a.ctx_size, a.draft) == (0, "none")


def test_kl_divergence_of_two_runs(vocab_ckpt, text_file, tmp_path, capsys):
    """A run against itself and a run paging its experts through a small RAM budget compare as exactly equal;
    `reference` numerics against `official` do not (the comparison sees a difference)."""
    base = tmp_path / "base.logits"
    args = ("perplexity", text_file, "-m", vocab_ckpt, "--ctx", 48, "--json")
    code, out, err = run(capsys, *args, "--save-logits", base)
    assert code == 0, err
    saved = json.loads(out)
    for extra in ([], ["--ram-budget", "1M"]):
        code, out, err = run(capsys, *args, "--kl-divergence", base, *extra)
        assert code == 0, err
        kl = json.loads(out)["kl_divergence"]
        assert kl["tokens"] == saved["scored"] and kl["base_ppl"] == saved["ppl"]
        assert kl["kl_mean"] == kl["kl_max"] == kl["max_abs_delta_logprob"] == 0.0 and kl["top1_agreement"] == 1.0
    assert load(vocab_ckpt, ram_budget="1M").paged_chunk is not None  # 1M really pages (spans of chunks)
    code, out, err = run(capsys, *args, "--kl-divergence", base, "--numerics", "reference")
    assert code == 0, err
    got = json.loads(out)
    kl = got["kl_divergence"]
    assert kl["kl_mean"] > 0 and kl["max_abs_delta_logprob"] > 0 and kl["kl_max"] >= kl["kl_p99"] >= kl["kl_p50"]
    assert 0 < kl["top1_agreement"] <= 1 and got["ppl"] != saved["ppl"]
    # the plain report names each number
    code, out, _ = run(capsys, "perplexity", text_file, "-m", vocab_ckpt, "--ctx", 48, "--kl-divergence", base)
    assert code == 0 and "Final estimate: PPL = " in out and "mean KLD" in out and "same top-1    100.000 %" in out


def test_the_text_file_may_be_given_with_f_as_llama_perplexity_takes_it(vocab_ckpt, text_file, capsys):
    """`fastar perplexity -m MODEL -f wiki.txt`, llama-perplexity's spelling, was `unrecognized arguments: -f`."""
    args = ("-m", vocab_ckpt, "--ctx", 64, "--json")
    code, out, err = run(capsys, "perplexity", "-f", text_file, *args)
    assert code == 0, err
    assert json.loads(out)["ppl"] == json.loads(run(capsys, "perplexity", text_file, *args)[1])["ppl"]
    code, out, err = run(capsys, "perplexity", *args)
    assert code == 1 and err == "fastar: error: no text file: give it as `fastar perplexity FILE` or with -f FILE\n"
    code, out, err = run(capsys, "perplexity", text_file, "-f", str(text_file) + ".other", *args)
    assert code == 1 and "two text files" in err and err.count("\n") == 1


def test_save_logits_refuses_to_write_over_its_own_inputs(vocab_ckpt, text_file, tmp_path, capsys):
    """`--save-logits` naming the text being scored, the --kl-divergence base or a file of the model renamed the
    logits over it and said "saved": the text, the base or the model was gone. Refused before the model loads,
    and the file is untouched; a new name beside them is fine."""
    import shutil

    text, model = tmp_path / "text.txt", tmp_path / "model"
    shutil.copy(text_file, text)
    shutil.copytree(vocab_ckpt, model, copy_function=os.link)  # (links: nothing of the shared fixture is written)
    base = tmp_path / "base.logits"
    args = ("-m", model, "--ctx", 48)
    assert run(capsys, "perplexity", text, *args, "--save-logits", base)[0] == 0
    before = {p: p.read_bytes() for p in (text, base, model / "config.json")}
    for out, what in (
        (text, "the text file being scored"),
        (tmp_path / "." / "text.txt", "the text file being scored"),
        (base, "the --kl-divergence base"),
        (model / "config.json", "a file of the model"),
    ):
        code, _, err = run(capsys, "perplexity", text, *args, "--kl-divergence", base, "--save-logits", out)
        assert code == 1 and err.count("\n") == 1 and f"--save-logits {out}: it is {what}" in err, err
    assert all(p.read_bytes() == data for p, data in before.items())
    assert run(capsys, "perplexity", text, *args, "--save-logits", tmp_path / "new.logits")[0] == 0


def test_one_line_errors(vocab_ckpt, text_file, tmp_path, capsys):
    empty, binary, latin1, short = (tmp_path / n for n in ("empty.txt", "bin.dat", "latin1.txt", "short.txt"))
    empty.write_text("  \n")
    binary.write_bytes(b"ELF\0\x01\x02text")
    latin1.write_bytes("caf\xe9".encode("latin-1"))
    short.write_text("a")
    base = tmp_path / "b.logits"
    assert run(capsys, "perplexity", text_file, "-m", vocab_ckpt, "--ctx", 40, "--save-logits", base)[0] == 0
    cases = [
        ((tmp_path / "missing.txt",), "no such file"),
        ((tmp_path,), "not a regular file"),
        ((empty,), "empty"),
        ((binary,), "binary file (a NUL byte at offset 3)"),
        ((latin1,), "not UTF-8 text (byte 0xe9 at offset 3)"),
        ((short, "-m", vocab_ckpt), "nothing to score"),
        ((text_file, "-m", vocab_ckpt, "--ctx", 10**9), "larger than the model's context"),
        ((text_file, "--ctx", 32, "--stride", 40), "--stride 40 is larger than --ctx 32"),
        (
            (text_file, "-m", vocab_ckpt, "--ctx", 48, "--kl-divergence", base),
            "(ctx 40, stride 20; this run's: ctx 48, stride 24): score with the same",
        ),
        ((text_file, "-m", vocab_ckpt, "--kl-divergence", text_file), "not a `fastar perplexity --save-logits` file"),
    ]
    for args, message in cases:
        code, out, err = run(capsys, "perplexity", *args)
        assert code == 1 and out == "" and err.count("\n") == 1 and err.startswith("fastar: error: "), (args, err)
        assert message in err, (args, err)


@pytest.mark.parametrize(
    "damage",
    ["header length 2**63", "header length 2**40", "negative counts", "counts as text", "header a list", "deep"],
)
def test_damaged_logits_file_is_a_one_line_error(tmp_path, damage):
    """A --kl-divergence file damaged in its header is a FastarError naming it, never a traceback (an overflowing
    or memory-exhausting header read, or a negative count reaching np.memmap)."""
    import struct

    from fastar.engine.logits_file import MAGIC, VERSION, LogitsFile, LogitsWriter
    from fastar.errors import FastarError

    path = tmp_path / "run.logits"
    w = LogitsWriter(path, [1, 2, 3], [1, 2], 4, ctx=3, stride=1)
    w.add(np.zeros((2, 4), np.float16), np.zeros(2, np.float32))
    w.close()
    assert LogitsFile(path).rows.shape == (2, 4)  # the undamaged file reads
    raw = path.read_bytes()
    hlen = struct.unpack_from("<Q", raw, len(MAGIC) + 4)[0]
    header = json.loads(raw[len(MAGIC) + 12 : len(MAGIC) + 12 + hlen])
    headers = {
        "negative counts": {**header, "num_tokens": -3, "num_scored": 0},
        "counts as text": {**header, "vocab_size": "4"},
        "header a list": [header],
        "deep": json.loads("[" * 50 + "]" * 50),  # nested, not a header
    }
    lengths = {"header length 2**63": 2**63, "header length 2**40": 2**40}
    if damage in lengths:
        bad = raw[: len(MAGIC) + 4] + struct.pack("<Q", lengths[damage]) + raw[len(MAGIC) + 12 :]
    else:
        body = json.dumps(headers[damage]).encode()
        bad = MAGIC + struct.pack("<IQ", VERSION, len(body)) + body + raw[len(MAGIC) + 12 + hlen :]
    path.write_bytes(bad)
    with pytest.raises(FastarError, match=r"run\.logits: the logits file"):
        LogitsFile(path)


def test_save_logits_over_a_fifo_or_device_is_refused(tmp_path):
    """--save-logits naming a FIFO or device (/dev/null, as root) replaced it with the logits file when it was
    renamed into place: refused, naming it, and nothing is written beside it."""
    from fastar.engine.logits_file import LogitsWriter
    from fastar.errors import FastarError

    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(FastarError, match=f"{fifo}: not a regular file"):
        LogitsWriter(fifo, [1, 2, 3], [1, 2], 4, ctx=3, stride=1)
    assert fifo.is_fifo() and [p.name for p in tmp_path.iterdir()] == ["fifo"]


def test_save_logits_that_cannot_be_written_is_one_line_and_leaves_nothing(vocab_ckpt, text_file, tmp_path):
    """--save-logits on a full disk (here a file-size limit: EFBIG, as ENOSPC would be) said only "File too large",
    and when the header already failed left the `.partial` file behind; a folder that is a file named the temporary
    file. Now each is one line naming the file asked for, and nothing is left."""
    import resource
    import subprocess
    import sys

    from fastar.engine.logits_file import LogitsWriter
    from fastar.errors import FastarError

    for limit, where in ((1024, "the header"), (1 << 20, "the rows")):
        out = tmp_path / f"limit-{limit}"
        out.mkdir()

        def small_files(limit=limit):
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

        r = subprocess.run(
            [sys.executable, "-m", "fastar", "perplexity", "-m", str(vocab_ckpt), "--ctx", "40", str(text_file)]
            + ["--save-logits", str(out / "run.logits")],
            capture_output=True,
            text=True,
            timeout=120,
            preexec_fn=small_files,
        )
        assert r.returncode == 1 and "Traceback" not in r.stderr, (where, r.stderr[-2000:])
        assert r.stderr == f"fastar: error: {out / 'run.logits'}: cannot write the logits file (File too large)\n", (
            where
        )
        assert list(out.iterdir()) == [], where
    folder = tmp_path / "a-file"
    folder.write_text("x")
    with pytest.raises(
        FastarError, match=f"^{folder / 'x.logits'}: cannot write the logits file \\(Not a directory\\)$"
    ):
        LogitsWriter(folder / "x.logits", [1, 2, 3], [1, 2], 4, ctx=3, stride=1)
