"""Outputs that exist: every command that writes a model or data file (`convert`, `convert --indexer-sidecar`,
`synth -o`, `synth --hf-dir`, `export`, `fixture`, `perplexity --save-logits`, chat's `/save`) refuses one with one
line naming it and `--force`, before any work and leaving it byte for byte; `--force` replaces it, and a forced run
that fails midway leaves the old output as it was. `convert` and `synth` replaced a file silently before."""

from __future__ import annotations

import errno
import importlib
from pathlib import Path

import pytest
from test_cli_hostile import _cli, one_line_error

from fastar.cli import main
from fastar.format.reader import FstFile

pytestmark = pytest.mark.usefixtures("one_torch_thread")

SMALL_SYNTH = ["--layers", "1", "--experts", "2", "--vocab", "1024", "--hidden", "256", "--inter", "256"]
HINT = "already exists; add --force to replace it, or remove it first"
OLD = b"an hour of conversion"


def _contents(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())} if path.is_dir() else {"": path.read_bytes()}


def _old_output(out: Path, folder: bool) -> dict[str, bytes]:
    """An output of an earlier run at `out` (a checkpoint folder, or a file): its bytes, to compare with after."""
    if folder:
        out.mkdir()
        (out / "config.json").write_text('{"old": true}')
        (out / "model-00001-of-00001.safetensors").write_bytes(OLD)
    else:
        out.write_bytes(OLD)
    return _contents(out)


def _temporaries(folder: Path) -> list[str]:
    return [p.name for p in folder.iterdir() if ".partial" in p.name or ".old-" in p.name]


def _commands(tiny_ckpt: Path, tiny_fst_path: Path, vocab_ckpt: Path, tmp: Path) -> list[tuple]:
    """(arguments, the output, the flag naming it, whether it is a folder, the function whose call is the work)."""
    text = tmp / "text.txt"
    text.write_text("the cat sat on the mat " * 10)
    hub = "fastar.convert.hf.resolve_source"  # reading the checkpoint (a hub id: downloading it) starts here
    return [
        (["convert", tiny_ckpt, "-o", tmp / "m.fst"], tmp / "m.fst", "-o", False, hub),
        (
            ["convert", tiny_ckpt, "--indexer-sidecar", "-o", tmp / "m.fst.indexer"],
            tmp / "m.fst.indexer",
            "-o",
            False,
            hub,
        ),
        (["synth", "-o", tmp / "s.fst", *SMALL_SYNTH], tmp / "s.fst", "-o", False, "fastar.synth.FstWriter"),
        (
            ["synth", "--hf-dir", tmp / "hf", *SMALL_SYNTH],
            tmp / "hf",
            "--hf-dir",
            True,
            "fastar.fixtures._write_checkpoint",
        ),
        (
            ["export", tiny_fst_path, "-o", tmp / "ex", "--shard-size", "4M"],
            tmp / "ex",
            "-o",
            True,
            "fastar.convert.export._open",
        ),
        (["fixture", "-o", tmp / "fx"], tmp / "fx", "-o", True, "fastar.fixtures._write_checkpoint"),
        (
            ["perplexity", text, "-m", vocab_ckpt, "--ctx", "32", "--save-logits", tmp / "run.logits"],
            tmp / "run.logits",
            "--save-logits",
            False,
            "fastar.console.open_engine",
        ),
    ]


def test_an_existing_output_is_refused_before_any_work(
    tiny_ckpt, tiny_fst_path, vocab_ckpt, tmp_path, monkeypatch, capsys
):
    """Each command, its output there: one line naming the flag, the path and --force; the work never started (the
    checkpoint not opened, nothing generated, the model not loaded); the old output byte for byte as it was."""
    for args, out, flag, folder, work in _commands(tiny_ckpt, tiny_fst_path, vocab_ckpt, tmp_path):
        before = _old_output(out, folder)

        def started(*a, work=work, **kw):
            raise AssertionError(f"{work} ran before the existing output was refused")

        with monkeypatch.context() as m:
            m.setattr(work, started)
            code = main([str(x) for x in args])
        err = capsys.readouterr().err
        assert (code, err) == (1, f"fastar: error: {flag} {out}: {HINT}\n"), (args, code, err)
        assert _contents(out) == before, args
        assert not _temporaries(tmp_path), args


def test_force_replaces_the_output(tiny_ckpt, tiny_fst_path, vocab_ckpt, tmp_path, capsys):
    """With --force each command writes its output over the old one (the old bytes gone, the new output whole); a
    stale temporary file of a crashed earlier run blocks nothing and is gone after."""
    for args, out, _, folder, _ in _commands(tiny_ckpt, tiny_fst_path, vocab_ckpt, tmp_path):
        before = _old_output(out, folder)
        if not folder:  # where each file writer puts its temporary file
            stale = out.with_name(f".{out.name}.partial" if args[0] == "perplexity" else f"{out.name}.partial")
            stale.write_bytes(b"a crashed run's partial file")
        code = main([str(x) for x in [*args, "--force"]])
        err = capsys.readouterr().err
        assert code == 0, (args, err)
        after = _contents(out)
        assert after != before and OLD not in after.values(), args
        if folder:
            assert after["config.json"] != before["config.json"] and "model.safetensors.index.json" in after, args
        elif args[0] != "perplexity":
            with FstFile(out) as f:
                assert not f.verify(), args
        assert not _temporaries(tmp_path), (args, _temporaries(tmp_path))


def _fail_after(m: pytest.MonkeyPatch, target: str, after: int) -> list:
    """`target` ("module:Class.method" or "module:function"), a step of a writer, runs `after` times and then
    fails as a full disk would. Returns the list of its calls."""
    module, _, attr = target.partition(":")
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for part in path:
        owner = getattr(owner, part)
    real, calls = getattr(owner, name), []

    def fails(*a, **kw):
        calls.append(1)
        if len(calls) > after:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(*a, **kw)

    m.setattr(owner, name, fails)
    return calls


def test_a_forced_run_that_fails_midway_leaves_the_old_output(
    tiny_ckpt, tiny_fst_path, vocab_ckpt, tmp_path, monkeypatch, capsys
):
    """--force, and the disk fills after part of the new output is written: the old output is still there, byte
    for byte, and nothing temporary is left."""
    failing = {  # the write step that fails, after how many calls
        "convert": ("fastar.format.writer:FstWriter.write_expert", 1),
        "--indexer-sidecar": ("fastar.format.writer:FstWriter.write_tensor", 2),  # no experts there
        "synth": ("fastar.format.writer:FstWriter.write_expert", 1),
        "--hf-dir": ("fastar.fixtures:save_file", 1),
        "export": ("fastar.convert.export:_write_shard", 2),
        "fixture": ("fastar.fixtures:save_file", 1),
        "perplexity": ("fastar.engine.logits_file:LogitsWriter.add", 0),  # the header is written by then
    }
    for args, out, _, folder, _ in _commands(tiny_ckpt, tiny_fst_path, vocab_ckpt, tmp_path):
        before = _old_output(out, folder)
        key = next((k for k in ("--indexer-sidecar", "--hf-dir") if k in args), args[0])
        with monkeypatch.context() as m:
            calls = _fail_after(m, *failing[key])
            code = main([str(x) for x in [*args, "--force"]])
        err = capsys.readouterr().err
        assert code == 1 and "No space left on device" in err and err.count("\n") == 1, (args, err)
        assert len(calls) > failing[key][1], (args, "the write never reached the failure")
        assert _contents(out) == before, args
        assert not _temporaries(tmp_path), args


def test_chat_save_refuses_an_existing_file_unless_forced(tmp_path):
    from test_cli_run_chat import make_repl

    repl, _, out = make_repl(["Hi.", "Again."])
    repl.handle("Hello")
    target = tmp_path / "c.json"
    target.write_text("another conversation")
    repl.handle(f"/save {target}")
    assert f"(cannot save: {target}: already exists; /save --force {target} replaces it)" in out.getvalue()
    assert target.read_text() == "another conversation" and repl.failures == 1
    repl.handle(f"/save --force {target}")
    assert "Hello" in target.read_text() and repl.failures == 1
    repl.handle("/save --force")
    assert "usage: /save [--force] FILE" in out.getvalue()


def test_the_demo_model_is_built_without_force(tmp_path):
    """`fastar run` with no -m builds the demo model into the cache when missing, and uses it when there: neither
    asks for --force."""
    env = {"FASTAR_CACHE_DIR": str(tmp_path / "cache")}
    for _ in range(2):
        r = _cli("run", "-p", "Hello", "-n", "2", env=env)
        assert r.returncode == 0, r.stderr[-2000:]
    assert len(list((tmp_path / "cache").glob("demo-*.fst"))) == 1


def test_force_never_writes_over_the_files_being_converted(tiny_ckpt, tmp_path):
    """`--force` replaces an earlier output, never the source: `convert CKPT -o CKPT/config.json --force` is still
    refused as a file of the model being converted, the file untouched."""
    import shutil

    ck = tmp_path / "ck"
    shutil.copytree(tiny_ckpt, ck)
    before = (ck / "config.json").read_bytes()
    line = one_line_error(_cli("convert", ck, "-o", ck / "config.json", "--force"), 1)
    assert "is config.json, a file of the model being converted" in line
    assert (ck / "config.json").read_bytes() == before


def test_export_force_never_replaces_the_folder_holding_its_source(tiny_fst_path, tmp_path):
    """`export ck/m.fst -o ck --force` would have replaced the folder and the model in it: refused, all untouched."""
    import shutil

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "config.json").write_text("{}")
    shutil.copyfile(tiny_fst_path, ck / "m.fst")
    before = _contents(ck)
    line = one_line_error(_cli("export", ck / "m.fst", "-o", ck, "--force"), 1)
    assert f"-o {ck}: it holds {ck / 'm.fst'}, the model being exported" in line
    assert _contents(ck) == before


def test_the_library_writers_refuse_an_existing_output_unless_forced(tiny_ckpt, tiny_fst_path, tmp_path):
    """The functions the command line calls (`convert`, `convert_indexer`, `synth`, `export`, `write_checkpoint`)
    replaced an existing output silently (the command line checked first, the library did not): each refuses one
    now with a FileExistsError (the project's OutputExists, a FastarError) saying what the command line says, the
    old output byte for byte; an empty folder is no output yet; `force=True` replaces it."""
    from synth_widths import SMALL

    from fastar.convert.export import export
    from fastar.convert.hf import convert, convert_indexer
    from fastar.errors import FastarError, OutputExists
    from fastar.fixtures import write_checkpoint
    from fastar.synth import synth

    small = dict(layers=1, experts=2, vocab=1024, hidden=256, inter=256, **SMALL)
    writers = [  # (write(out, force), the output, whether it is a folder)
        (lambda o, f: convert(tiny_ckpt, o, progress=False, force=f), tmp_path / "m.fst", False),
        (lambda o, f: convert_indexer(tiny_ckpt, o, progress=False, force=f), tmp_path / "m.fst.indexer", False),
        (lambda o, f: synth(o, force=f, **small), tmp_path / "s.fst", False),
        (lambda o, f: export(tiny_fst_path, o, progress=False, force=f), tmp_path / "ex", True),
        (lambda o, f: write_checkpoint(o, "tiny", tokenizer=False, force=f), tmp_path / "fx", True),
    ]
    for write, out, folder in writers:
        before = _old_output(out, folder)
        with pytest.raises(FileExistsError) as err:
            write(out, False)
        assert isinstance(err.value, OutputExists) and isinstance(err.value, FastarError)
        assert str(err.value) == f"{out}: {HINT}"
        assert _contents(out) == before, out
        assert write(out, True) == out
        after = _contents(out)
        assert after != before and OLD not in after.values(), out
        assert not _temporaries(tmp_path), out
    for write, out, folder in writers:
        if folder:  # an empty folder: written into without force
            empty = out.with_name(out.name + "-empty")
            empty.mkdir()
            assert write(empty, False) == empty and (empty / "config.json").is_file()


def test_bench_plot_refuses_an_existing_file_unless_forced(tiny_fst_path, tmp_path):
    """`bench --plot curve.png` saved the PNG over an existing curve.png (an earlier run's figure) without a word.
    Refused now like every other output, one line naming the flag and --force, before the benchmark runs (nothing
    printed), the old file byte for byte; `--force` replaces it with the new PNG, written whole and renamed."""
    png = tmp_path / "curve.png"
    png.write_bytes(OLD)
    small = ("--prompt-tokens", "2", "--decode-tokens", "1", "--ram-budget", "none")
    r = _cli("bench", "-m", tiny_fst_path, *small, "--plot", png)
    assert one_line_error(r, 1) == f"fastar: error: --plot {png}: {HINT}" and r.stdout == ""
    assert png.read_bytes() == OLD
    r = _cli("bench", "-m", tiny_fst_path, *small, "--plot", png, "--force")
    assert r.returncode == 0, r.stderr[-2000:]
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["curve.png"]  # no temporary file left
