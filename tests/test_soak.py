"""`scripts/soak.py` stopped early: Ctrl-C or SIGTERM during the load ends it at once with the summary of the samples
so far (marked as stopped early), the server it started stopped, and the exit status of the signal. SIGINT is sent
to a soak started with SIGINT ignored, as a shell's `&` or nohup starts it: it must still stop."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "soak.py"


@pytest.fixture(scope="module")
def demo_model(vocab_ckpt, tmp_path_factory) -> Path:
    from fastar.convert.hf import convert

    return convert(vocab_ckpt, tmp_path_factory.mktemp("soak") / "demo.fst", progress=False)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_ends_the_soak_with_its_summary_and_stops_the_server(demo_model: Path, tmp_path: Path, sig) -> None:
    out = tmp_path / "soak.json"
    cmd = [sys.executable, str(SCRIPT), "-m", str(demo_model), "--clients", "1", "--duration", "600"]
    proc = subprocess.Popen(
        [*cmd, "--interval", "0.5", "--warmup", "0", "--json", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),  # as `soak.py &` starts it
    )
    server = None
    try:
        lines: list[str] = []
        deadline = time.monotonic() + 120
        while sum(line.split()[0].isdigit() for line in lines if line.strip()) < 2:  # two samples taken
            line = proc.stdout.readline()
            assert line and time.monotonic() < deadline, "".join(lines)
            lines.append(line)
        (server,) = map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())
        sent = time.monotonic()
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:  # a soak that did not stop: it and its server go (the server has its own session)
            proc.kill()
            proc.wait()
            if server is not None:
                os.killpg(server, signal.SIGKILL)
    took = time.monotonic() - sent
    text = "".join(lines) + rest
    assert proc.returncode == 128 + sig, text
    assert took < 30, took  # not the rest of the 600 s
    assert f"stopped by {sig.name} after" in rest and "requests by 1 clients in" in rest and "Traceback" not in text
    summary = json.loads(out.read_text())["summary"]
    assert summary["interrupted"] == sig.name and summary["duration_s"] < 120
    with pytest.raises(ProcessLookupError):
        os.kill(server, 0)


def test_the_scripts_stop_a_server_that_inherited_sigint_ignored(demo_model: Path, tmp_path: Path) -> None:
    """`ServerProcess.stop` (scripts/hostile_probe.py, which scripts/soak.py uses): a server started where SIGINT is
    ignored (the scripts run from a background job) stops gracefully at once, not at the SIGKILL after `wait`."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from hostile_probe import ServerProcess
    finally:
        sys.path.remove(str(SCRIPT.parent))
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)  # what the child inherits
    try:
        server = ServerProcess(str(demo_model), [], tmp_path)
    finally:
        signal.signal(signal.SIGINT, before)
    try:
        server.wait_ready(120)
        t = time.monotonic()
        assert server.stop(wait=30) == []
        assert time.monotonic() - t < 20 and server.proc.returncode is not None
        assert "shutting down" in server.log.read_text()  # its own shutdown, not a SIGKILL
    finally:
        if server.proc.poll() is None:
            os.killpg(server.proc.pid, signal.SIGKILL)


def test_the_soak_client_sends_stream_options_only_when_streaming() -> None:
    """The API refuses `stream_options` on a request that does not stream (a 400 naming it): the soak's chat
    requests, streamed or not, are ones the server's own parser accepts."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        import soak
    finally:
        sys.path.remove(str(SCRIPT.parent))
    from fastar.serve.openai_request import parse_chat_request

    sent: list[dict] = []
    client = soak.Client(0, 7, 0.0, None, None, None)
    client.post = lambda path, body, cut=False: sent.append(body) if path == "/v1/chat/completions" else None
    for _ in range(200):
        client.one()
    assert {b.get("stream", False) for b in sent} == {True, False}
    for body in sent:
        parse_chat_request(body, (body["model"],))  # raises the 400 the server would answer
        assert ("stream_options" in body) <= body.get("stream", False)
