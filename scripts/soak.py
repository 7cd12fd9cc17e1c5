"""A memory soak of `fastar serve`: N clients send a mixed request set for a while; the server's RSS is sampled.

Starts `fastar serve` on a free port (the built-in demo model, or `-m PATH`; its prompt cache in a fresh temporary
folder), then N client threads each loop over a seeded random mix of requests until the duration is over:
chat completions (streamed and not, with tools, with logprobs, n > 1, a JSON schema, a growing multi-turn
conversation), completions (streamed and not, logprobs, n > 1, echo), Anthropic `/v1/messages` (streamed and
not), Responses (stored, chained by `previous_response_id`, streamed), streams the client cuts after their
first event (a disconnect), and long prompts (700-1,600 words: several prefill chunks, which give way to the other
requests between their layers), half of them cut after their first event, while they prefill. Prompts are random
words, so the prompt caches keep meeting new prefixes.

Every `--interval` seconds it samples the server's RSS (and its anonymous and file-backed parts) and prints a
row; at the end a summary: RSS at the start (after `--warmup`) and at the end, and the least-squares slope (MB/min)
over the whole run, over its last half, and of each minute's lowest RSS (the floor: a leak raises it, memory
freed and handed back in a sawtooth does not). A flat server has slopes near zero; a leak keeps a steady one.

Diagnosis (all off by default, each changes what is measured a little):
  --trace N      run the server under tracemalloc (N frames) and, each interval, write to --trace-out the Python
                 heap's size, the top lines of growth against the snapshot taken after the warm-up, and the gc
                 object counts by type that grew the most (the server itself knows nothing of this: the script
                 starts it through a small bootstrap);
  --trim         each interval, also call glibc's malloc_trim(0) in the server (through the same bootstrap) and
                 report the RSS after it: memory that a trim gives back was fragmentation, not live data;
  --arena-max N  run the server with MALLOC_ARENA_MAX=N (fewer glibc arenas for its threads).

Timed runs share the machine with kernel benchmarks: run under `flock /tmp/bench.lock`, and keep it to minutes; a
long soak (hours: users chat for hours) runs best alone, or under `nice` beside other work, which only lowers its
request rate.

    flock /tmp/bench.lock python scripts/soak.py [--clients 8] [--duration 480] [--interval 5] [-m MODEL]
        [--trace 4 --trace-out FILE] [--trim] [--arena-max 2] [--json OUT] [-- FASTAR SERVE ARGUMENTS]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import socket
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path

from hostile_probe import ServerProcess  # scripts/: `fastar serve` on a free port, ready, stopped

MODEL = "deepseek-v4-flash"
WORDS = (
    "the", "engine", "reads", "each", "expert", "once", "per", "step", "and", "keeps", "rest", "on", "disk",
    "while", "a", "cache", "holds", "hot", "ones", "prompt", "of", "many", "turns", "after", "restart", "tail",
    "weather", "city", "tool", "call", "json", "answer", "question", "river", "mountain", "bread", "coffee",
    "paper", "window", "garden", "table", "music", "number", "letter",
)  # fmt: skip

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ANTHROPIC_TOOL = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}

# Runs inside the server process (`--trace`, `--trim`): samples to a JSON-lines file from a daemon thread, then
# hands over to the command line as `python -m fastar` would. Nothing in fastar knows of it.
BOOTSTRAP = r"""
import ctypes, ctypes.util, gc, json, os, sys, threading, time, tracemalloc
from collections import Counter
out, frames, trim, interval = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", float(sys.argv[4])
sys.argv = ["fastar", *sys.argv[5:]]
if frames:
    tracemalloc.start(frames)
libc = ctypes.CDLL(ctypes.util.find_library("c")) if trim else None

def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024

def types():
    return Counter(type(o).__name__ for o in gc.get_objects())

def sampler():
    base = base_types = None
    t0 = time.monotonic()
    with open(out, "a") as f:
        while True:
            time.sleep(interval)
            rec = {"t": round(time.monotonic() - t0, 1), "rss_mb": round(rss(), 1)}
            if frames:
                rec["traced_mb"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 2)
                if base is None and os.path.exists(out + ".baseline"):  # the soak's warm-up is over
                    base, base_types = tracemalloc.take_snapshot(), types()
                elif base is not None:
                    snap = tracemalloc.take_snapshot()
                    diff = snap.compare_to(base, "traceback")[:12]
                    rec["top"] = [
                        {"kb": round(d.size_diff / 1024, 1), "count": d.count_diff,
                         "where": [f"{fr.filename.rsplit('/site-packages/', 1)[-1]}:{fr.lineno}"
                                   for fr in d.traceback][-frames:]}
                        for d in diff if d.size_diff > 0
                    ]
                    now = types()
                    grown = {k: now[k] - base_types.get(k, 0) for k in now}
                    rec["gc_grown"] = dict(sorted(grown.items(), key=lambda kv: -kv[1])[:12])
                    del snap
            if libc is not None:
                libc.malloc_trim(0)
                rec["rss_after_trim_mb"] = round(rss(), 1)
            f.write(json.dumps(rec) + "\n")
            f.flush()

threading.Thread(target=sampler, name="soak-sampler", daemon=True).start()
from fastar.cli import main
raise SystemExit(main())
"""


def memory_mb(pid: int) -> dict[str, float]:
    """VmRSS and its anonymous and file-backed parts, in MB (Linux)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) / 1024
    return out


def floor(samples: list[dict], window: float = 60) -> list[tuple[float, float]]:
    """The lowest RSS of each `window` seconds, at its time: a leak raises the floor, a sawtooth of freed memory
    taken back (heap trims) does not."""
    out: dict[int, tuple[float, float]] = {}
    for s in samples:
        k = int(s["t"] // window)
        if k not in out or s["rss"] < out[k][1]:
            out[k] = (s["t"], s["rss"])
    return [out[k] for k in sorted(out)]


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of (seconds, MB) points, in MB per minute."""
    if len(points) < 2:
        return 0.0
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    den = sum((t - mt) ** 2 for t, _ in points)
    return 60 * sum((t - mt) * (v - mv) for t, v in points) / den if den else 0.0


class Client:
    """One client's loop of mixed requests; counts outcomes by kind."""

    def __init__(
        self, port: int, seed: int, stop_at: float, counts: Counter, lock: threading.Lock, stop: threading.Event
    ) -> None:
        self.port, self.rng, self.stop_at, self.counts, self.lock = port, random.Random(seed), stop_at, counts, lock
        self.stop = stop  # set by Ctrl-C / SIGTERM: no new request
        self.history: list[dict] = []
        self.previous: str | None = None

    def words(self, lo: int, hi: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(self.rng.randint(lo, hi)))

    def tokens(self) -> int:
        return self.rng.randint(4, 24)

    def post(self, path: str, body: dict, cut: bool = False) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=300)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "x-api-key": "soak"})
            r = conn.getresponse()
            if cut:  # a client that goes away after the first event
                r.readline()
                conn.sock.shutdown(socket.SHUT_RDWR)
                return r.status
            data = r.read()
            if r.status == 200 and not body.get("stream"):
                reply = json.loads(data)
                if path == "/v1/responses":
                    self.previous = reply.get("id")
                elif path == "/v1/chat/completions" and body.get("n", 1) == 1 and "tools" not in body:
                    self.history += [body["messages"][-1], {"role": "assistant", "content": "ok"}]
            return r.status
        finally:
            conn.close()

    def one(self) -> tuple[str, int]:
        kind = self.rng.choice(KINDS)
        stream = self.rng.random() < 0.5
        base = {"model": MODEL, "max_tokens": self.tokens(), "temperature": self.rng.choice((0, 0.8))}
        msg = [{"role": "user", "content": self.words(3, 40)}]
        if kind == "chat":
            body = {**base, "messages": msg, "stream": stream}
            if stream:  # the API refuses stream_options on a request that does not stream
                body["stream_options"] = {"include_usage": True}
            if self.rng.random() < 0.3:
                body |= {"logprobs": True, "top_logprobs": self.rng.randint(1, 5)}
            if self.rng.random() < 0.2:
                body["n"] = self.rng.randint(2, 3)
            return kind, self.post("/v1/chat/completions", body)
        if kind == "conversation":  # a growing conversation: the prompt cache's case
            if len(self.history) > 24:
                self.history = []
            body = {**base, "messages": [*self.history, *msg]}
            return kind, self.post("/v1/chat/completions", body)
        if kind == "tools":
            body = {**base, "messages": msg, "tools": [WEATHER_TOOL], "stream": stream}
            body["tool_choice"] = self.rng.choice(("auto", "required", "none"))
            return kind, self.post("/v1/chat/completions", body)
        if kind == "json":
            key = self.rng.choice(WORDS)
            schema = {"type": "object", "properties": {key: {"type": "string"}}, "required": [key]}
            body = {
                **base,
                "messages": msg,
                "response_format": {"type": "json_schema", "json_schema": {"name": "r", "schema": schema}},
            }
            return kind, self.post("/v1/chat/completions", body)
        if kind == "completion":
            body = {**base, "prompt": self.words(3, 60), "stream": stream, "logprobs": self.rng.choice((None, 2))}
            if self.rng.random() < 0.3:
                body["n"] = self.rng.randint(2, 3)
            if not stream and self.rng.random() < 0.2:
                body["echo"] = True
            return kind, self.post("/v1/completions", body)
        if kind == "disconnect":
            path, body = self.rng.choice(
                (
                    ("/v1/chat/completions", {**base, "messages": msg, "stream": True, "max_tokens": 64}),
                    ("/v1/completions", {**base, "prompt": self.words(3, 30), "stream": True, "max_tokens": 64}),
                    ("/v1/messages", {**base, "messages": msg, "stream": True, "max_tokens": 64}),
                )
            )
            return kind, self.post(path, body, cut=True)
        if kind == "long":  # a prompt of several prefill chunks, given way between its layers; half cut mid-prefill
            body = {**base, "messages": [{"role": "user", "content": self.words(700, 1600)}], "stream": True}
            return kind, self.post("/v1/chat/completions", body, cut=self.rng.random() < 0.5)
        if kind == "anthropic":
            body = {**base, "messages": msg, "stream": stream, "system": self.words(2, 10)}
            if self.rng.random() < 0.3:
                body["tools"] = [ANTHROPIC_TOOL]
            return kind, self.post("/v1/messages", body)
        # responses
        body = {"model": MODEL, "input": self.words(3, 30), "max_output_tokens": self.tokens(), "stream": stream}
        if self.previous and self.rng.random() < 0.5:
            body["previous_response_id"] = self.previous
        return kind, self.post("/v1/responses", body)

    def run(self) -> None:
        while time.monotonic() < self.stop_at and not self.stop.is_set():
            try:
                kind, status = self.one()
                key = f"{kind} {status}"
            except (OSError, http.client.HTTPException, json.JSONDecodeError) as err:
                key = f"error {type(err).__name__}"
            with self.lock:
                if not self.stop.is_set():  # a request the stop cut short is not an outcome of the load
                    self.counts[key] += 1


KINDS = ("chat", "chat", "conversation", "tools", "json", "completion", "completion", "disconnect")
KINDS += ("anthropic", "responses", "long")


def start_server(args, log_dir: Path) -> ServerProcess:
    """`fastar serve` with a prompt cache under `log_dir`, through the tracing bootstrap where asked, ready."""
    env = dict(os.environ)
    if args.arena_max:
        env["MALLOC_ARENA_MAX"] = str(args.arena_max)
    launcher = None
    if args.trace or args.trim:
        launcher = [sys.executable, "-c", BOOTSTRAP, args.trace_out, str(args.trace), "1" if args.trim else "0"]
        launcher += [str(args.interval)]
    flags = ("--prompt-cache", str(log_dir / "cache"))
    server = ServerProcess(args.model, args.serve_args, log_dir, flags=flags, launcher=launcher, env=env)
    try:
        server.wait_ready(args.load_timeout)
    except BaseException:
        server.stop(wait=0)
        raise
    return server


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help=".fst to serve (default: the built-in demo model)")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--duration", type=float, default=480, help="seconds of load (at most 86400: a day)")
    ap.add_argument("--interval", type=float, default=5, help="seconds between samples")
    ap.add_argument("--warmup", type=float, default=30, help="seconds before the start figure and trace baseline")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace", type=int, default=0, metavar="FRAMES", help="tracemalloc in the server (0: off)")
    ap.add_argument("--trace-out", default="soak-trace.jsonl")
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) in the server at each sample")
    ap.add_argument("--arena-max", type=int, default=0, help="MALLOC_ARENA_MAX for the server (0: glibc's)")
    ap.add_argument("--load-timeout", type=float, default=300)
    ap.add_argument("--json", default=None, help="write the samples and summary here")
    ap.add_argument("serve_args", nargs="*", help="after --: more fastar serve arguments")
    args = ap.parse_args()
    if not 0 < args.duration <= 86400:
        ap.error(f"--duration must be in (0, 86400] seconds, got {args.duration}")
    if args.clients < 1 or args.interval <= 0:
        ap.error("--clients must be >= 1 and --interval > 0")
    if args.trace or args.trim:
        Path(args.trace_out).write_text("")
        Path(args.trace_out + ".baseline").unlink(missing_ok=True)
    # Ctrl-C or a kill (SIGTERM) during the load ends it early: the summary covers the samples so far, the server is
    # stopped and its folder removed (a second signal meanwhile changes nothing: the stop is bounded). While the
    # server is still loading it stops at once. Installed explicitly, also where SIGINT came ignored (started in the
    # background with `&`, or nohup): the server then starts with the default action, so it too stops when asked.
    stop, caught, loading = threading.Event(), [], []  # loading: non-empty once the clients run

    def on_signal(signum: int, frame) -> None:
        if not caught:
            caught.append(signal.Signals(signum).name)
        if not loading:
            raise KeyboardInterrupt
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    try:
        return soak(args, stop, caught, loading)
    except KeyboardInterrupt:
        why = caught[0] if caught else "SIGINT"
        print(f"soak: stopped by {why} before the load started; the server was stopped", file=sys.stderr, flush=True)
        return 128 + signal.Signals[why].value


def soak(args, stop: threading.Event, caught: list[str], loading: list[bool]) -> int:
    with tempfile.TemporaryDirectory(prefix="fastar-soak-") as tmp:
        server = start_server(args, Path(tmp))
        proc, port = server.proc, server.port
        print(f"fastar serve on port {port} (pid {proc.pid})", flush=True)
        try:
            counts, lock = Counter(), threading.Lock()
            t0 = time.monotonic()
            stop_at = t0 + args.duration
            clients = [Client(port, args.seed * 1000 + i, stop_at, counts, lock, stop) for i in range(args.clients)]
            threads = [threading.Thread(target=c.run, daemon=True) for c in clients]
            loading.append(True)
            for t in threads:
                t.start()
            samples = []
            print(f"{'t (s)':>7} {'RSS MB':>8} {'anon MB':>8} {'file MB':>8} {'requests':>9}")

            def sample() -> None:
                m = memory_mb(proc.pid)
                with lock:
                    done = sum(counts.values())
                t = time.monotonic() - t0
                samples.append(
                    {"t": round(t, 1), "rss": m["VmRSS"], "anon": m["RssAnon"], "file": m["RssFile"], "n": done}
                )
                if args.trace and t >= args.warmup and not Path(args.trace_out + ".baseline").exists():
                    Path(args.trace_out + ".baseline").write_text("")  # the server's sampler takes its baseline
                print(f"{t:7.0f} {m['VmRSS']:8.1f} {m['RssAnon']:8.1f} {m['RssFile']:8.1f} {done:9d}", flush=True)

            while time.monotonic() < stop_at and not stop.is_set():
                if not stop.wait(min(args.interval, max(0.0, stop_at - time.monotonic()))):
                    sample()
            if stop.is_set():
                if not samples and proc.poll() is None:
                    sample()  # stopped before the first interval: the figure at the stop
                with lock:
                    counts = Counter(counts)  # the outcomes up to the stop, not the errors the shutdown makes
            else:  # each client ends after the request it is in (a signal meanwhile: at once)
                deadline = time.monotonic() + 300
                for t in threads:
                    while t.is_alive() and time.monotonic() < deadline and not stop.wait(0.2):
                        pass
            elapsed = time.monotonic() - t0
            if proc.poll() is not None:
                raise SystemExit(f"error: fastar serve died during the soak: {server.log.read_text()[-800:]}")
        finally:
            tracebacks = server.stop(wait=60)  # (time to flush its prompt cache)
    after = [s for s in samples if s["t"] >= args.warmup] or samples
    half = [s for s in samples if s["t"] >= elapsed / 2]
    summary = {
        "clients": args.clients,
        "duration_s": round(elapsed, 1),
        "interrupted": caught[0] if caught else None,
        "requests": sum(counts.values()),
        "rss_start_mb": after[0]["rss"],
        "rss_end_mb": samples[-1]["rss"],
        "slope_mb_per_min": round(slope([(s["t"], s["rss"]) for s in after]), 2),
        "slope_last_half_mb_per_min": round(slope([(s["t"], s["rss"]) for s in half]), 2),
        "anon_slope_last_half_mb_per_min": round(slope([(s["t"], s["anon"]) for s in half]), 2),
        "floor_slope_mb_per_min": round(slope(floor(after)), 2),
        "outcomes": dict(sorted(counts.items())),
        "server_tracebacks": len(tracebacks),
    }
    if caught:
        print(f"\nstopped by {caught[0]} after {elapsed:.0f} s of {args.duration:.0f}: the figures cover that part")
    print(
        f"\n{summary['requests']} requests by {args.clients} clients in {elapsed:.0f} s; RSS "
        f"{summary['rss_start_mb']:.0f} MB (at {after[0]['t']:.0f} s) -> {summary['rss_end_mb']:.0f} MB; slope "
        f"{summary['slope_mb_per_min']:+.2f} MB/min overall, {summary['slope_last_half_mb_per_min']:+.2f} MB/min "
        f"over the last half (anonymous: {summary['anon_slope_last_half_mb_per_min']:+.2f}); the per-minute "
        f"lowest RSS: {summary['floor_slope_mb_per_min']:+.2f} MB/min"
    )
    print("outcomes: " + ", ".join(f"{k}: {v}" for k, v in summary["outcomes"].items()))
    if summary["server_tracebacks"]:
        print(f"the server's log holds {summary['server_tracebacks']} tracebacks")
    if args.json:
        Path(args.json).write_text(json.dumps({"summary": summary, "samples": samples}, indent=1))
    return 128 + signal.Signals[caught[0]].value if caught else 0


if __name__ == "__main__":
    sys.exit(main())
