"""The prompt cache on disk under faults: a process killed with SIGKILL mid-write (a bare writer and a whole server),
damaged, truncated, foreign-format and non-state files, a full disk (injected, and a real small filesystem), and
processes sharing one folder; `/metrics` counting rejected and evicted states.

The children are this file run as a script (`python tests/test_prefix_cache_faults.py ROLE ...`, see `child`): a
writer paused mid-write by a `DiskHooks.after_chunk` that blocks, a server, a process sharing the folder.
"""

from __future__ import annotations

import errno
import hashlib
import http.client
import json
import logging
import os
import re
import shutil
import signal
import struct
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from batch_helpers import prefilled, prompt

from fastar.engine.cache_folder import CacheFolder, DiskHooks
from fastar.engine.prefix_cache import PrefixCache
from fastar.model.state import LayerState, ModelState

pytestmark = pytest.mark.usefixtures("one_torch_thread")
HERE = Path(__file__).resolve()
FP = "synthetic"  # the fingerprint of the synthetic states' caches


# --- synthetic states (no model: a child process needs only the cache) -----------------------------------------


def synthetic_state(ids: list[int], width: int = 256) -> ModelState:
    """A one-layer state that has processed `ids`, its rows a function of the ids (a reader can check them)."""
    seed = int.from_bytes(hashlib.sha256(json.dumps(ids).encode()).digest()[:8], "little")
    layer = LayerState.new(0, 8, width, 2)
    layer.kv.append(torch.randn(len(ids), width, generator=torch.Generator().manual_seed(seed)))
    layer.length = len(ids)
    return ModelState([layer])


def stored_bytes(ids: list[int], width: int = 256) -> bytes:
    """The bytes of the state the cache stores for `ids` (compacted as the cache does), what a lookup must give."""
    state = synthetic_state(ids, width)
    for s in state.layers:
        s.trim(1)
    return state.to_bytes()


def child_env() -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(HERE.parent.parent), env.get("PYTHONPATH", "")])
    return env


def spawn(*args: str, stdin=subprocess.DEVNULL, stderr=None) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, str(HERE), *args],
        stdin=stdin,
        stdout=subprocess.PIPE,
        stderr=stderr if stderr is not None else subprocess.PIPE,
        text=True,
        env=child_env(),
    )


def partials(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.partial"))


# --- killed mid-write -----------------------------------------------------------------------------------------


def test_a_writer_killed_mid_write_leaves_nothing_that_is_ever_read(tmp_path, caplog):
    """A process stopped (by its `after_chunk` hook) after the header and the first bytes of a state: its temporary
    file has them and no name of a cache file; a peer opening the folder meanwhile keeps it (its writer lives);
    after SIGKILL, the next cache to open the folder removes it, finds nothing for those tokens, logs no damage,
    and stores and reads the same state whole."""
    folder, ids = tmp_path / "pc", list(range(5, 40))
    proc = spawn("writer", str(folder), json.dumps(ids))
    try:
        line = proc.stdout.readline()
        assert line.startswith("partial "), (line, proc.stderr.read() if proc.poll() is not None else "")
        _, tmp, written = line.split()
        tmp = Path(tmp)
        assert tmp.parent == folder and tmp.stat().st_size == int(written) > 20
        assert list(folder.glob("*.fpc")) == []
        peer = PrefixCache(folder, FP, 1 << 30)  # opening the folder while the writer lives: its file stays
        assert partials(folder) == [tmp] and peer.lookup(ids, limit=len(ids)) is None
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL and partials(folder) == [tmp]

    with caplog.at_level(logging.INFO, logger="fastar.prefix_cache"):
        cache = PrefixCache(folder, FP, 1 << 30)
        assert cache.lookup(ids + [1], limit=len(ids)) is None
    assert partials(folder) == [] and list(folder.iterdir()) == []
    assert [r.getMessage() for r in caplog.records] == [
        f"prefix cache: removed {tmp}, left by a writer that stopped mid-write"
    ]
    path = cache.store(ids, synthetic_state(ids))
    state, n = cache.lookup(ids + [1], limit=len(ids))
    assert path.exists() and n == len(ids) and state.to_bytes() == stored_bytes(ids)


def test_a_server_killed_while_writing_a_state_restarts_on_the_folder_and_answers(tiny_ckpt, tmp_path):
    """`kill -9` of a server whose writer is mid-way through the state of the prompt it just answered; a new
    server on the same folder removes the temporary file, starts, loads nothing (no state was completely
    written) and answers the same request with the same text."""
    folder = tmp_path / "pc"
    body = {"prompt": list(range(3, 43)), "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    log1, log2 = open(tmp_path / "first.log", "w"), open(tmp_path / "second.log", "w")  # noqa: SIM115
    first = spawn("serve", str(tiny_ckpt), str(folder), "pause", stdin=subprocess.PIPE, stderr=log1)
    try:
        port = server_port(first)
        status, reply = completion(port, body)
        assert status == 200, reply
        line = first.stdout.readline()  # the writer, paused inside the prompt's state file
        assert line.startswith("partial "), line
        tmp = Path(line.split()[1])
        assert tmp.exists() and list(folder.glob("*.fpc")) == []
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate(timeout=60)
    assert first.returncode == -signal.SIGKILL and tmp.exists()

    second = spawn("serve", str(tiny_ckpt), str(folder), "run", stdin=subprocess.PIPE, stderr=log2)
    try:
        port = server_port(second)
        assert not tmp.exists() and list(folder.glob("*.fpc")) == []
        status, again = completion(port, body)
        assert status == 200, again
        assert again["choices"][0]["text"] == reply["choices"][0]["text"]
        details = again["usage"].get("prompt_tokens_details") or {}
        assert not details.get("cached_tokens")
    finally:
        second.communicate(input="", timeout=60)  # stdin closed: the child shuts its server down
        log1.close(), log2.close()
    assert second.returncode == 0, (tmp_path / "second.log").read_text()


def server_port(proc: subprocess.Popen) -> int:
    line = proc.stdout.readline()
    assert line.startswith("port "), (line, proc.poll())
    return int(line.split()[1])


def completion(port: int, body: dict) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


# --- damaged files ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def eng(tiny_ckpt):
    from fastar.engine.engine import load

    return load(tiny_ckpt)


def damage(raw: bytes, kind: str) -> bytes:
    """`raw` (a whole cache file) damaged as `kind` says."""
    hlen = struct.unpack_from("<Q", raw, 12)[0]
    if kind == "flipped":
        out = bytearray(raw)
        out[20 + hlen + (len(raw) - 20 - hlen) // 2] ^= 0x10
        return bytes(out)
    if kind == "truncated":
        return raw[: len(raw) - 1000]
    if kind == "other-file-version":
        return raw[:8] + struct.pack("<I", 2) + raw[12:]
    if kind == "other-state-version":  # intact, its checksum right: a state format this fastar does not read
        header = json.loads(raw[20 : 20 + hlen])
        body = raw[20 + hlen :]
        body = body[:8] + struct.pack("<I", 3) + body[12:]
        header["state_sha256"] = hashlib.sha256(body).hexdigest()
        hb = json.dumps(header).encode()
        return raw[:12] + struct.pack("<Q", len(hb)) + hb + body
    if kind == "deep-header":  # JSON nested past the decoder's recursion limit, where the header stands
        hb = b"[" * 100_000 + b"]" * 100_000
        return raw[:12] + struct.pack("<Q", len(hb)) + hb + raw[20 + hlen :]
    assert kind == "not-a-state"
    return bytes(range(256)) * (len(raw) // 256)


REASONS = {
    "flipped": "its tokens or checksum do not match",
    "truncated": "truncated or padded (state of",
    "other-file-version": "version 2, expected 1",
    "other-state-version": "decode state version 3 is not supported",
    "not-a-state": "not a prefix cache file",
    "deep-header": "corrupt header",
}


@pytest.mark.parametrize("kind", list(REASONS))
def test_a_damaged_state_is_rejected_once_removed_counted_and_never_loaded(eng, tmp_path, caplog, kind):
    """A stored state of the prompt's first 24 tokens, damaged: the scheduler's answer is the one it gives with no
    cache at all (no token taken from the file), one log line names the file and the reason, the file is gone and
    the scheduler counts one rejected state."""
    from fastar.engine.sampling import SamplingParams

    ids, params = prompt(30, 32), SamplingParams(max_tokens=8, ignore_eos=True)
    folder = tmp_path / "pc"
    path = eng.open_prefix_cache(folder, "1G").store(ids[:24], prefilled(eng, ids[:24]))
    bad = damage(path.read_bytes(), kind)
    path.write_bytes(bad)

    plain = eng.scheduler()
    ref = plain.submit(ids, params)
    plain.run_until_idle()
    ref = list(ref)

    with caplog.at_level(logging.WARNING, logger="fastar.prefix_cache"):
        sched = eng.scheduler(prefix_cache=folder)
        h = sched.submit(ids, params)
        sched.run_until_idle()
        got = list(h)
    assert [c.token for c in got] == [c.token for c in ref] and got[-1].usage["cached_tokens"] == 0
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"prefix cache: skipping {path}: {REASONS[kind]}"), lines
    assert lines[0].endswith("; removed") and not path.exists()
    assert sched.metrics()["prefix_disk_rejected"] == 1


def test_no_flipped_bit_of_a_stored_state_is_ever_loaded(eng, tmp_path):
    """One bit flipped at a time, in every byte of the magic, version, header length and JSON header and in every
    97th byte of the state: no lookup returns a state, and each damaged file is removed."""
    ids = prompt(31, 6)
    cache = eng.open_prefix_cache(tmp_path, "1G")
    path = cache.store(ids, prefilled(eng, ids))
    good = path.read_bytes()
    hlen = struct.unpack_from("<Q", good, 12)[0]
    positions = list(range(20 + hlen)) + list(range(20 + hlen, len(good), 97))
    for i in positions:
        bad = bytearray(good)
        bad[i] ^= 1 << (i % 8)
        path.write_bytes(bytes(bad))
        assert cache.lookup(ids + [1], limit=len(ids)) is None, f"byte {i} flipped: a state was loaded"
        assert not path.exists(), f"byte {i} flipped: the file was kept"
    assert cache.stats()["rejected"] == len(positions)
    path.write_bytes(good)
    assert cache.lookup(ids + [1], limit=len(ids))[1] == len(ids)  # the intact file is read


# --- a full disk -----------------------------------------------------------------------------------------------


def test_a_full_disk_pauses_writing_logs_once_and_the_requests_go_on(eng, tmp_path, caplog):
    """Writes fail with ENOSPC (injected after the first chunk of a file): each request still gets the tokens it
    gets with no cache, the partial file is removed, one warning is logged, and no further write is tried while
    the disk has no room (not per request); once `free_bytes` reports room, the next request's states are saved
    (one line says so) and found."""
    from fastar.engine.sampling import SamplingParams
    from fastar.engine.scheduler import Scheduler

    started: list[Path] = []
    free, full = [0], [True]

    def after_chunk(tmp: Path, written: int) -> None:
        if tmp not in started:
            started.append(tmp)
        if full[0]:
            raise OSError(errno.ENOSPC, "No space left on device")

    folder = tmp_path / "pc"
    hooks = DiskHooks(after_chunk=after_chunk, free_bytes=lambda f: free[0])
    cache = PrefixCache(folder, eng.open_prefix_cache(folder).fingerprint, 1 << 30, background=True, hooks=hooks)
    sched = Scheduler(eng, prefix_cache=cache)
    params = SamplingParams(max_tokens=5, ignore_eos=True)
    prompts = [prompt(40 + i, 20) for i in range(4)]
    ref = [[c.token for c in chunks] for chunks in eng.serve_batch([(p, params) for p in prompts])]

    def ask(ids):
        h = sched.submit(ids, params)
        sched.run_until_idle()
        return [c.token for c in h]

    with caplog.at_level(logging.INFO, logger="fastar.prefix_cache"):
        assert [ask(p) for p in prompts[:3]] == ref[:3]
        assert len(started) == 1 and not started[0].exists() and list(folder.iterdir()) == []
        assert sched.metrics()["prefix_disk_writes_paused"] == 1
        full[0], free[0] = False, 1 << 40  # space is back
        assert ask(prompts[3]) == ref[3]
    assert len(started) == 3 and sched.metrics()["prefix_disk_writes_paused"] == 0  # prompt and reply states
    assert cache.lookup(prompts[3] + [9], limit=20)[1] >= 19 and partials(folder) == []
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert lines[0].startswith(f"prefix cache: the disk of {folder} is full (No space left on device)")
    assert lines[1] == f"prefix cache: {folder} has room again: saving prompt states"


def test_a_real_full_filesystem(tmp_path):
    """The same on a real 256 KiB tmpfs (mounted in a user and mount namespace): a state that does not fit fails
    with the kernel's ENOSPC, leaves no file, pauses writing (no further attempt, one warning) until the ballast
    filling the filesystem is deleted; then states are saved and read back whole."""
    if shutil.which("unshare") is None:
        pytest.skip("needs util-linux's unshare to mount a small tmpfs")
    probe = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "true"], capture_output=True, text=True, timeout=60
    )
    if probe.returncode != 0:
        pytest.skip(f"user namespaces are not available here: {probe.stderr.strip()}")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = 'mount -t tmpfs -o size=256k fastar-test "$0" && exec "$1" "$2" fullfs "$0"'
    out = subprocess.run(
        ["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script, str(mnt), sys.executable, str(HERE)],
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["free_before"] < r["state_bytes"] < r["free_after"]
    assert r["stored"] == [False, False, False, True] and r["attempts"] == [1, 1, 1, 2]
    assert r["listings"][:3] == [["ballast"]] * 3 and r["paused"] == [True, True, True, False]
    assert r["found_whole"] is True
    assert len(r["log"]) == 2 and "is full (No space left on device)" in r["log"][0] and "room again" in r["log"][1]


# --- processes sharing a folder --------------------------------------------------------------------------------


def test_processes_sharing_a_folder_never_tear_lose_or_overflow_it(tmp_path):
    """Three processes each store 40 states into one folder capped at 5 states' bytes and look up their own and
    another's, all at once: every state found is exactly the one stored for its tokens, nothing is rejected or
    fails, the folder never exceeds the cap when looked at, and the files left are exactly the stores less the
    evictions of all three (none lost, none evicted twice), with no temporary file."""
    folder, k, n = tmp_path / "pc", 3, 40
    size = len(stored_bytes([1, 1, 1])) + 400  # one file, with its header
    cap = 5 * size
    procs = [spawn("share", str(folder), str(i), str(k), str(n), str(cap), stdin=subprocess.PIPE) for i in range(k)]
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n", p.stderr.read() if p.poll() is not None else ""
        for p in procs:  # all start together
            p.stdin.write("go\n")
            p.stdin.flush()
        outs = [p.communicate(timeout=300) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.communicate()
    reports = []
    for p, (out, err) in zip(procs, outs, strict=True):
        assert p.returncode == 0, err
        reports.append(json.loads(out))
    for r in reports:
        assert r["errors"] == [] and r["wrong"] == 0 and r["rejected"] == 0 and r["log"] == []
        assert r["max_seen"] <= cap
    files = list(folder.glob("*.fpc"))
    assert len(files) == sum(r["stores"] for r in reports) - sum(r["evictions"] for r in reports)
    assert sum(f.stat().st_size for f in files) <= cap and partials(folder) == []
    assert sum(r["evictions"] for r in reports) > 0 and sum(r["hits"] for r in reports) > 0


# --- /metrics --------------------------------------------------------------------------------------------------


def metrics_text(port: int) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.request("GET", "/metrics")
    text = conn.getresponse().read().decode()
    conn.close()
    return text


def sample(text: str, name: str) -> float:
    m = re.search(rf"^fastar:{re.escape(name)} (\S+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


def test_metrics_count_rejected_and_evicted_states(tiny_ckpt, tmp_path):
    """A server on a folder holding one damaged state of its prompt's prefix and capped at about two states:
    /metrics counts the rejected file and the evictions (stores less the files left), and no paused writes."""
    from fastar.engine.engine import load
    from fastar.serve.server import Server

    engine = load(tiny_ckpt)
    folder, ids = tmp_path / "pc", prompt(50, 40)
    path = engine.open_prefix_cache(folder, "1G").store(ids[:30], prefilled(engine, ids[:30]))
    path.write_bytes(damage(path.read_bytes(), "flipped"))
    cap = int(2.5 * path.stat().st_size)
    srv = Server(lambda: engine, port=0, prompt_cache=str(folder), prompt_cache_size=cap).start()
    try:
        assert srv.wait_ready(60)
        for i in range(3):
            body = {"prompt": ids + prompt(51 + i, 5), "max_tokens": 3, "temperature": 0, "ignore_eos": True}
            assert completion(srv.port, body)[0] == 200
        srv.host.scheduler.flush()
        text = metrics_text(srv.port)
    finally:
        srv.shutdown()
    files = list(folder.glob("*.fpc"))
    assert sample(text, "prefix_cache_disk_rejected_total") == 1 and not path.exists()
    stores = sample(text, "prefix_cache_disk_stores_total")
    assert sample(text, "prefix_cache_disk_evictions_total") == stores - len(files) > 0
    assert sample(text, "prefix_cache_disk_writes_paused") == 0


# --- the children ------------------------------------------------------------------------------------------------


class Recorder(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def child(args: list[str]) -> None:
    torch.set_num_threads(1)
    role = args[0]

    def pause(tmp: Path, written: int) -> None:  # the first chunk is on disk: announce it, then never go on
        print(f"partial {tmp} {written}", flush=True)
        threading.Event().wait()

    if role == "writer":  # FOLDER IDS: store the state of IDS, stopping after its first chunk
        folder, ids = Path(args[1]), json.loads(args[2])
        PrefixCache(folder, FP, 1 << 30, hooks=DiskHooks(after_chunk=pause)).store(ids, synthetic_state(ids))
    elif role == "serve":  # CKPT FOLDER pause|run: a server; its writer stops mid-file with "pause"
        from fastar.engine.engine import load
        from fastar.serve.server import Server

        if args[3] == "pause":
            CacheFolder.hooks = DiskHooks(after_chunk=pause)
        srv = Server(lambda: load(args[1]), port=0, prompt_cache=args[2], prompt_cache_size="1G").start()
        assert srv.wait_ready(120)
        print(f"port {srv.port}", flush=True)
        sys.stdin.read()  # until the test closes stdin (or kills this process)
        srv.shutdown()
    elif role == "share":
        share(Path(args[1]), *(int(a) for a in args[2:]))
    elif role == "fullfs":
        full_filesystem(Path(args[1]))
    else:
        raise SystemExit(f"unknown role {role}")


def share(folder: Path, me: int, procs: int, n: int, cap: int) -> None:
    """Store n states and look up this process's and the next one's, printing a JSON report."""
    rec = Recorder()
    logging.getLogger("fastar.prefix_cache").addHandler(rec)
    logging.getLogger("fastar.prefix_cache").setLevel(logging.INFO)
    cache = PrefixCache(folder, FP, cap)
    tokens = {(p, i): [p + 1, i + 1] + [7] * (i % 5) for p in range(procs) for i in range(n)}
    expect = {key: stored_bytes(ids) for key, ids in tokens.items() if key[0] in (me, (me + 1) % procs)}
    report = {"errors": [], "wrong": 0, "hits": 0, "max_seen": 0}
    print("ready", flush=True)
    sys.stdin.readline()
    for i in range(n):
        try:
            cache.store(tokens[me, i], synthetic_state(tokens[me, i]))
            report["max_seen"] = max(report["max_seen"], cache.size())
            for key in ((me, i), ((me + 1) % procs, i), ((me + 1) % procs, max(0, i - 1))):
                found = cache.lookup(tokens[key] + [0], limit=len(tokens[key]))
                if found is not None:
                    report["hits"] += 1
                    report["wrong"] += found[0].to_bytes() != expect[key]
        except Exception as e:  # reported, not raised: the test shows every process's failures
            report["errors"].append(repr(e))
    report.update({k: cache.stats()[k] for k in ("stores", "evictions", "rejected")}, log=rec.lines)
    print(json.dumps(report), flush=True)


def full_filesystem(mnt: Path) -> None:
    """In a 256 KiB tmpfs at `mnt`: fill it but for less than a state, store (ENOSPC), store twice more (paused),
    delete the ballast, store again; a JSON report of each step."""
    rec = Recorder()
    logging.getLogger("fastar.prefix_cache").addHandler(rec)
    logging.getLogger("fastar.prefix_cache").setLevel(logging.INFO)
    attempts: list[Path] = []
    count = DiskHooks(after_chunk=lambda tmp, n: tmp in attempts or attempts.append(tmp))
    cache = PrefixCache(mnt / "c", FP, 1 << 30, hooks=count)
    width = 2048  # 8 rows of 8 KiB: a 64 KiB state
    state_bytes = len(stored_bytes([1], width))
    free = count.free_bytes(mnt)
    with open(mnt / "ballast", "wb") as f:
        f.write(b"\0" * (free - state_bytes // 2))
    report: dict = {"free_before": count.free_bytes(mnt), "state_bytes": state_bytes, "stored": [], "attempts": []}
    report.update(listings=[], paused=[])
    ids = [[i + 1] * 12 for i in range(4)]
    for i, x in enumerate(ids):
        if i == 3:
            (mnt / "ballast").unlink()
            report["free_after"] = count.free_bytes(mnt)
        report["stored"].append(cache.store(x, synthetic_state(x, width)) is not None)
        report["attempts"].append(len(attempts))
        report["listings"].append(sorted(p.name for p in mnt.iterdir() if p.name != "c") + os.listdir(mnt / "c"))
        report["paused"].append(cache.disk.paused)
    found = cache.lookup(ids[3] + [0], limit=12)
    report["found_whole"] = found is not None and found[0].to_bytes() == stored_bytes(ids[3], width)
    report["log"] = rec.lines
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    child(sys.argv[1:])


# --- a state's name taken by something that is no file ----------------------------------------------------------


def test_a_folder_or_fifo_under_a_states_name_is_a_miss_not_an_error(tmp_path, caplog):
    """A folder under a state's file name ended `fastar chat --prompt-cache DIR` at its first turn ("fastar: error:
    ...fpc: Is a directory"), and a FIFO there blocked the lookup forever (the open waits for a writer). Both are
    now a miss logged once; eviction passes them by, and a state stored over the cap still evicts a real one."""
    ids_a, ids_b = list(range(10, 30)), list(range(40, 60))
    old = PrefixCache(tmp_path, FP, 1 << 30).store(ids_a, synthetic_state(ids_a))
    cache = PrefixCache(tmp_path, FP, int(1.5 * old.stat().st_size))  # room for one state of this length
    for name, make in (("folder", os.mkdir), ("fifo", os.mkfifo)):
        ids = list(range(100, 110)) if name == "folder" else list(range(200, 212))
        make(cache._path(ids))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fastar.prefix_cache"):
            result: list = []
            t = threading.Thread(
                target=lambda ids=ids: result.append(cache.lookup(ids + [1], limit=len(ids))), daemon=True
            )
            t.start()
            t.join(30)
            assert not t.is_alive(), f"a {name} under a state's name blocked the lookup"
            assert result == [None] and cache.lookup(ids + [1], limit=len(ids)) is None
        lines = [r.getMessage() for r in caplog.records]
        why = "Is a directory" if name == "folder" else "not a regular file"
        assert len(lines) == 1 and f"cannot read ({why})" in lines[0], lines
        assert cache._path(ids).exists()  # not ours to remove
    new = cache.store(ids_b, synthetic_state(ids_b))  # over the cap: the real state goes, not the folder
    assert new is not None and new.exists() and not old.exists()
    assert cache.lookup(ids_b + [1], limit=len(ids_b))[1] == len(ids_b)
