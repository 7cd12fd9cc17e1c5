"""The kernels' thread pool under ThreadSanitizer: tests/csrc/pool_stress.c built alone with pool.c and
`-fsanitize=thread` (many small jobs of changing sizes, jobs posted while workers start, the race-widening test
hooks on, jobs in a forked child), each job checking that every chunk ran exactly once before pool_run returned.
Any data race ThreadSanitizer sees fails the test with its report."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "fastar" / "quant" / "csrc"


def _cc() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _build(tmp_path: Path, flags: list[str]) -> tuple[Path | None, str]:
    exe = tmp_path / "pool_stress"
    r = subprocess.run(
        [
            _cc(),
            "-O1",
            "-g",
            "-std=gnu11",
            "-pthread",
            *flags,
            f"-I{CSRC}",
            str(ROOT / "tests" / "csrc" / "pool_stress.c"),
            str(CSRC / "pool.c"),
            "-o",
            str(exe),
        ],
        capture_output=True,
        text=True,
    )
    return (exe if r.returncode == 0 else None), r.stderr


@pytest.mark.skipif(_cc() is None, reason="no C compiler on PATH")
def test_pool_stress_without_sanitizer(tmp_path):
    exe, err = _build(tmp_path, [])
    assert exe is not None, err
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "pool stress: ok" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(_cc() is None, reason="no C compiler on PATH")
def test_pool_has_no_data_race_under_thread_sanitizer(tmp_path):
    exe, err = _build(tmp_path, ["-fsanitize=thread"])
    if exe is None:
        pytest.skip(f"this compiler cannot build with -fsanitize=thread (no libtsan): {err.strip()[-200:]}")
    env = dict(os.environ, TSAN_OPTIONS="die_after_fork=0 exitcode=66")
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600, env=env)
    assert "ThreadSanitizer" not in r.stderr, r.stderr[-4000:]
    assert r.returncode == 0 and "pool stress: ok" in r.stdout, r.stdout + r.stderr[-2000:]
