"""Time to first token of a resent conversation, cold and from the prompt cache on disk after a restart (issue 17).

Starts `fastar serve -m MODEL --prompt-cache DIR` (a fresh folder unless --cache-dir names one), sends an unrelated
short prompt (--warm-up: the experts' first reads from disk are not what this measures), then a chat
conversation whose prompt is about --tokens long (streamed, greedy), stops the server, starts a new one on the
same folder, and sends the same conversation again with the reply and one more user turn appended. Prints, for
each request, the prompt tokens, the cached tokens the server reported, the prompt tokens it actually prefilled
(from /metrics) and the time to the first streamed token; the second should prefill only the new tail.

    python scripts/restart_ttft.py MODEL [--tokens 2000] [--warm-up 64] [--json] [-- FASTAR SERVE ARGUMENTS]
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time

WORDS = ("the", "engine", "reads", "each", "expert", "once", "per", "step", "and", "keeps", "rest", "on", "disk")
WORDS += ("while", "cache", "holds", "hot", "ones", "a", "prompt", "of", "many", "turns", "after", "restart", "tail")


def _request(port: int, method: str, path: str, body: dict | None = None, timeout: float = 3600):
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    conn.request(method, path, json.dumps(body) if body is not None else None, {"Content-Type": "application/json"})
    return conn, conn.getresponse()


def _metric(port: int, name: str) -> float:
    conn, r = _request(port, "GET", "/metrics")
    text = r.read().decode()
    conn.close()
    for line in text.splitlines():
        if line.startswith(f"fastar:{name} ") or line.startswith(f"fastar:{name}{{"):
            return float(line.rsplit(" ", 1)[1])
    raise SystemExit(f"error: /metrics has no fastar:{name}")


def _start(args, cache: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fastar", "serve", "-m", args.model, "--port", str(args.port)]
    cmd += ["--prompt-cache", cache, *args.serve_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    t0 = time.monotonic()
    while time.monotonic() - t0 < args.load_timeout:
        if proc.poll() is not None:
            raise SystemExit(f"error: fastar serve exited with {proc.returncode}: {proc.stderr.read().strip()[-500:]}")
        try:
            conn, r = _request(args.port, "GET", "/health", timeout=2)
            ok = r.status == 200
            conn.close()
            if ok:
                return proc
        except OSError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise SystemExit(f"error: fastar serve did not answer /health within {args.load_timeout:.0f} s")


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGINT)  # a graceful stop: the prompt cache's writer finishes its files
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise SystemExit("error: fastar serve did not stop within 120 s of SIGINT") from None


def _model_id(port: int) -> str:
    conn, r = _request(port, "GET", "/v1/models")
    data = json.loads(r.read())
    conn.close()
    return data["data"][0]["id"]


def _chat(port: int, messages: list[dict], max_tokens: int) -> dict:
    """One streamed greedy chat request -> its reply text, usage and time to the first token."""
    body = {
        "model": _model_id(port),
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    before = _metric(port, "engine_prefill_tokens_computed")
    t0 = time.perf_counter()
    conn, r = _request(port, "POST", "/v1/chat/completions", body)
    if r.status != 200:
        raise SystemExit(f"error: HTTP {r.status}: {r.read().decode()[:300]}")
    ttft, text, usage = None, [], None
    for raw in r:
        line = raw.decode().strip()
        if not line.startswith("data:") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[5:])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            piece = (delta.get("content") or "") + (delta.get("reasoning_content") or "")
            if ttft is None and (piece or choice.get("finish_reason")):
                ttft = time.perf_counter() - t0
            text.append(delta.get("content") or "")
    conn.close()
    details = (usage or {}).get("prompt_tokens_details") or {}
    return {
        "prompt_tokens": (usage or {}).get("prompt_tokens"),
        "cached_tokens": details.get("cached_tokens", 0),
        "prefilled_tokens": int(_metric(port, "engine_prefill_tokens_computed") - before),
        "ttft_s": round(ttft if ttft is not None else time.perf_counter() - t0, 3),
        "reply": "".join(text),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=2000, help="the first prompt's length, roughly (default 2000)")
    ap.add_argument("--port", type=int, default=8093)
    ap.add_argument("--cache-dir", help="prompt cache folder (default: a new temporary one)")
    ap.add_argument("--load-timeout", type=float, default=1800)
    ap.add_argument(
        "--warm-up",
        type=int,
        default=64,
        help="tokens of an unrelated prompt sent first after each start, so that both timings start with the "
        "experts it routes to in RAM, as on a server that has been running (0: none; default 64)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)  # after --: more `fastar serve` arguments
    args = ap.parse_args(argv[:cut])
    args.serve_args = argv[cut + 1 :]
    if not os.path.exists(args.model):
        raise SystemExit(f"error: no model at {args.model}")
    cache = args.cache_dir or tempfile.mkdtemp(prefix="fastar-pc-")
    rng = random.Random(0)
    # these words are one token each; the template adds a dozen; the first request reports the real count
    words = " ".join(rng.choice(WORDS) for _ in range(max(1, args.tokens - 12)))
    first = [{"role": "system", "content": "You review code."}, {"role": "user", "content": words}]

    def warm_up() -> None:  # an unrelated prompt, so the timed one does not pay the first reads of the experts
        if args.warm_up > 0:
            text = " ".join(rng.choice(WORDS) for _ in range(args.warm_up))
            _chat(args.port, [{"role": "user", "content": text}], 1)

    proc = _start(args, cache)
    try:
        warm_up()
        cold = _chat(args.port, first, 8)
    finally:
        _stop(proc)
    proc = _start(args, cache)
    try:
        warm_up()
        resent = first + [
            {"role": "assistant", "content": cold["reply"]},
            {"role": "user", "content": "And the tail of the file?"},
        ]
        warm = _chat(args.port, resent, 8)
    finally:
        _stop(proc)
    out = {"model": args.model, "cache_dir": cache, "cold": cold, "after_restart": warm}
    for r in (cold, warm):
        r.pop("reply")
    if args.json:
        print(json.dumps(out))
        return
    for label, r in (("cold", cold), ("after restart", warm)):
        print(
            f"{label}: {r['prompt_tokens']} prompt tokens, {r['cached_tokens']} from the cache, "
            f"{r['prefilled_tokens']} prefilled, time to first token {r['ttft_s']:.2f} s"
        )


if __name__ == "__main__":
    main()
