"""The hostile-client probe (`scripts/hostile_probe.py --quick`, issue 32) against `fastar serve` on the demo
model (the `vocab` fixture converted, which is what the demo model is) and against the command line: no answer
is a 5xx, no answer, server log or CLI run holds a traceback, the CLI's bad input gets a one-line error, every
real request is served while ~130 idle connections are held, and every expectation the probe checks holds
(absolute-form targets, Host parsing, the header limit, static file names, control tokens in content, ...).

The probe runs once (a few hundred requests, seven CLI runs); each test reads one part of its JSON summary."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "hostile_probe.py"


@pytest.fixture(scope="module")
def probe(vocab_ckpt, tmp_path_factory) -> dict:
    from fastar.convert.hf import convert

    work = tmp_path_factory.mktemp("hostile-probe")
    model = convert(vocab_ckpt, work / "demo.fst", progress=False)
    out = work / "probe.json"
    r = subprocess.run(
        [sys.executable, str(SCRIPT), "--quick", "-m", str(model), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.is_file(), (r.returncode, r.stdout[-3000:], r.stderr[-3000:])
    summary = json.loads(out.read_text())
    summary["stdout"] = r.stdout
    return summary


def test_the_probe_ran(probe):
    assert probe["requests"]["tried"] >= 500, probe["requests"]
    assert probe["cli"]["runs"] >= 7, probe["cli"]
    assert set(probe["categories"]) >= {"bad_unicode", "over_context", "static_files", "framing", "idle_connections"}


def test_no_answer_is_a_5xx(probe):
    assert probe["five_xx"] == [], "\n".join(probe["five_xx"])


def test_no_traceback_in_answers_or_the_server_log(probe):
    assert probe["body_tracebacks"] == [], "\n".join(probe["body_tracebacks"])
    assert probe["log_tracebacks"] == [], "\n".join(probe["log_tracebacks"])


def test_cli_bad_input_gets_a_one_line_error_not_a_traceback(probe):
    bad = [r for r in probe["cli_runs"] if not r["ok"]]
    assert probe["cli"]["traceback"] == 0 and not bad, "\n".join(
        f"{r['label']}: {r['kind']} (rc {r['rc']}): {r['traceback'] or r['last_line']}" for r in bad
    )


def test_idle_connections_do_not_lock_out_real_requests(probe):
    idle = probe["idle"]
    assert idle["idle"] >= 128 and idle["real_requests"] > 0, idle
    assert idle["served"] == idle["real_requests"], idle


def test_every_expectation_holds(probe):
    assert probe["violations"] == [], "\n".join(probe["violations"])
    assert probe["passed"], probe["stdout"][-3000:]
