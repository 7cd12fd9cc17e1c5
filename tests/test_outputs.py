"""`fastar.outputs`: an output whose folder cannot be written is said as that, before anything is made, by the
library's writers and the commands that call them (`fixture -o`, `synth --hf-dir`, `export -o`, chat's `/save`).

`fixture -o RO/x` said `RO/x: Read-only file system` (or `Permission denied`), chat's `/save RO/c.json` `cannot
write (Read-only file system)`: the OS's words for the file, not what is wrong. Root writes through a chmod, so
the decision is tested with `os.access` answering for a folder, and once for real where a folder can be made
read-only (a chmod, or as root a read-only mount in a mount namespace)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli_hostile import one_line_error
from test_session import make

from fastar.cli import main
from fastar.engine.session import SessionError
from fastar.errors import OutputError
from fastar.outputs import refuse_unwritable_output, unwritable


@pytest.fixture
def read_only(tmp_path, monkeypatch) -> Path:
    """A folder `os.access` says this process cannot write (whoever runs the test)."""
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access

    def access(path, mode, *a, **kw):
        if mode & os.W_OK and os.path.abspath(path) == str(ro):
            return False
        return real(path, mode, *a, **kw)

    monkeypatch.setattr(os, "access", access)
    return ro


def test_the_folder_that_would_get_the_new_entry_is_named(read_only, tmp_path):
    """A file goes in its folder (or, made with its parents, in the nearest folder there); a checkpoint folder is
    written into when it is empty, else made beside it: the one of those that cannot be written is named."""
    ro = read_only
    said = f"the directory {ro} is not writable"
    assert unwritable(ro / "c.json") == said
    assert unwritable(ro / "a" / "b" / "c.json", parents=True) == said  # a and b would be made in ro
    assert unwritable(ro / "x", folder=True) == said
    assert unwritable(ro / "a" / "b", folder=True) == said
    assert unwritable(ro, folder=True) == said  # empty: written into
    assert unwritable(ro / "a" / "c.json") == f"no such directory {ro / 'a'}"  # a file whose folder is not made
    assert unwritable(tmp_path / "ok" / "x", folder=True) is None and unwritable(tmp_path / "c.json") is None
    (tmp_path / "ok").mkdir()
    (tmp_path / "ok" / "config.json").write_text("{}")
    assert unwritable(tmp_path / "ok", folder=True) is None  # not empty: replaced from its parent, which is writable
    plain = tmp_path / "plain"
    plain.write_text("a file, not a folder")
    assert unwritable(plain / "x", folder=True) == f"{plain} is not a directory"
    assert unwritable(plain / "a" / "c.json", parents=True) == f"{plain} is not a directory"
    with pytest.raises(OutputError, match=rf"^-o {ro / 'x'}: the directory {ro} is not writable$"):
        refuse_unwritable_output(ro / "x", "-o", folder=True)


def test_fixture_into_a_folder_it_cannot_write_says_so(read_only, capsys):
    for out in (read_only / "x", read_only / "a" / "b"):
        code = main(["fixture", "-o", str(out)])
        err = capsys.readouterr().err
        assert (code, err) == (1, f"fastar: error: -o {out}: the directory {read_only} is not writable\n")
        assert not list(read_only.iterdir())  # nothing made


def test_a_session_saved_into_a_folder_it_cannot_write_says_so(read_only):
    """`Session.save` (chat's `/save`) names the folder; the chat prints it after `cannot save:`."""
    from test_cli_run_chat import make_repl

    s, _ = make(fingerprint="model-a")
    s.prefill([1, 2, 3])
    for target in (read_only / "c.json", read_only / "sub" / "c.json"):
        with pytest.raises(SessionError) as err:
            s.save(target)
        assert str(err.value) == f"{target}: cannot write (the directory {read_only} is not writable)"
    repl, _, out = make_repl(["Hi."])
    repl.session = s  # the real Session.save behind /save
    repl.handle("Hello")
    repl.handle(f"/save {read_only / 'c.json'}")
    said = f"(cannot save: {read_only / 'c.json'}: cannot write (the directory {read_only} is not writable))"
    assert said in out.getvalue()
    assert repl.failures == 1 and not list(read_only.iterdir())


def test_a_really_read_only_folder(tmp_path):
    """The same with no stand-in: a folder chmod 0o555, or as root (who writes through that) a read-only mount in a
    mount namespace. `fixture -o` in a fresh process, and a session's save."""
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    cmd = [sys.executable, "-m", "fastar", "fixture", "-o", str(ro / "x")]
    if os.access(ro, os.W_OK):  # root: a chmod restricts nothing
        probe = subprocess.run(["unshare", "-m", "mount", "-t", "tmpfs", "-o", "ro", "tmpfs", str(ro)], check=False)
        if probe.returncode != 0:
            pytest.skip("chmod does not restrict this user (root) and no mount namespace can be made here")
        cmd = ["unshare", "-m", "sh", "-c", f'mount -t tmpfs -o ro tmpfs "{ro}" && exec "$@"', "sh", *cmd]
    else:
        s, _ = make(fingerprint="model-a")
        with pytest.raises(SessionError) as err:
            s.save(ro / "c.json")
        assert str(err.value) == f"{ro / 'c.json'}: cannot write (the directory {ro} is not writable)"
    line = one_line_error(subprocess.run(cmd, capture_output=True, text=True, timeout=120), 1)
    assert line == f"fastar: error: -o {ro / 'x'}: the directory {ro} is not writable"
    ro.chmod(0o755)
    assert not list(ro.iterdir())
