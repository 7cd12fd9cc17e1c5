"""A hostile-client probe of `fastar serve` and of the command line (issue 32), repeatable and counted.

HTTP: starts `fastar serve` on a free port (the built-in demo model, or `-m PATH`; `-c 512` and no prompt cache, so
a request that slips past its length limit cannot run for long), or probes a running server at `--url`. It sends
about 5,000 hostile requests (`--quick`: a few hundred, for CI) over raw sockets, so that malformed HTTP reaches
the server as written, in these categories:

  baseline          valid requests on every route (each must be 2xx, or the other categories test nothing)
  malformed_json    truncated, trailing garbage, NaN, non-objects, duplicate keys, ... on every POST route
  wrong_types       every field of a rich valid body of every route (chat, completions, responses, messages,
                    count_tokens, tokenize, detokenize), nested fields included, set to each wrong type
  huge_nested       deep nesting in every field, huge arrays, bodies just under and over the 32 MiB cap
  bad_unicode       raw invalid UTF-8 (lone surrogate bytes ED A0 80, FF FE, overlong, truncated) in JSON strings
  over_context      prompts over the context (20 MB text; --quick: 2 MB) on every route, 3 concurrent count_tokens
                    (and a Responses agent run whose old tool round alone is over it: `truncation` "auto"
                    must drop it and answer)
  static_files      long file names (/static/ + 256 characters), traversal, odd bytes: all 404
  framing           request lines and headers just under and over 64 KiB, one 100,000-byte header, bad
                    Content-Length / chunking, other HTTP versions
  absolute_form     `GET http://host:port/health HTTP/1.1` (must be 200)
  bad_host          Host `[::1]evil.example`, `[localhost]`, empty (refused), and the good ones (served)
  auth              a second server with --api-key: bypass attempts (no 2xx without the key but /health)
  special_tokens    chat content holding the template's control tokens must tokenize as plain text
  methods_paths     other methods and odd paths on every route
  streams           streams cut by the client after the first event
  mutations         random byte and structure mutations of valid bodies (seeded)
  idle_connections  ~130 idle and slowloris connections, reopened as they are closed, while real requests are
                    sent: each real request must be served

Each category counts 2xx / 3xx / 4xx / 5xx / resets / timeouts / closed (no answer). Every 5xx and every body
holding "Traceback" is listed, with every broken expectation; with a server it started, the probe also counts
tracebacks in the server's log.

CLI: about 90 runs of `fastar` (run, chat with closed or invalid stdin, bench, serve, convert, verify, inspect,
export) with bad sizes (nan, inf, -1, 1e400), an empty --api-key, invalid UTF-8 prompts, missing, truncated and
corrupt model files, a checkpoint folder missing a shard or holding a FIFO for one, a conversion over its own
shard, an export of a FIFO; each is `ok` (exit 0), a `clean` error (exit 1 or 2, no traceback, the last stderr
line `fastar...: error: ...`), `messy` (another failure), `traceback`, or `timeout`.

The last line is the verdict: PASS when no answer is a 5xx, no body, log or CLI run holds a traceback, every
expectation holds and every real request during the idle-connection attack was served. Exit status 0 on PASS.

    python scripts/hostile_probe.py [--quick] [-m MODEL | --url http://127.0.0.1:8080] [--no-cli] [--json OUT]
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import re
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

HEAD_LIMIT = 64 * 1024  # docs/SERVING.md: request line + headers
BODY_LIMIT = 32 * 1024 * 1024
OUTCOMES = ("2xx", "3xx", "4xx", "5xx", "reset", "timeout", "closed")
SPECIALS = (
    "<｜begin▁of▁sentence｜>",
    "<｜end▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<think>",
    "</think>",
    "<｜latest_reminder｜>",
    "<｜action｜>",
)
WRONG_VALUES: tuple = (
    None,
    True,
    False,
    0,
    -1,
    1.5,
    2**64,
    -(2**63),
    1e308,
    float("nan"),
    float("inf"),
    "",
    "x",
    "\u0000",
    [],
    [None],
    {},
    {"a": 1},
)
LENGTH_FIELDS = ("max_tokens", "max_completion_tokens", "max_output_tokens")


# ---------------------------------------------------------------------------------------------------------
# One raw HTTP exchange
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Reply:
    outcome: str  # one of OUTCOMES
    status: int | None
    head: bytes
    body: bytes
    seconds: float


def _outcome(status: int) -> str:
    return f"{min(max(status // 100, 2), 5)}xx"


def exchange(
    addr: tuple[str, int], data: bytes, timeout: float = 60.0, first_event: bool = False, half_close: bool = False
) -> Reply:
    """Send `data` on a new connection and read one response (Content-Length, chunked, or until close).
    `first_event`: close as soon as the head and some body have arrived (a client leaving a stream)."""
    t0 = time.monotonic()
    deadline = t0 + timeout
    buf = b""
    reset = timed_out = False
    try:
        sock = socket.create_connection(addr, timeout=timeout)
    except OSError:
        return Reply("reset", None, b"", b"", time.monotonic() - t0)
    try:
        try:
            sock.sendall(data)
            if half_close:
                sock.shutdown(socket.SHUT_WR)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered early (413, 431) and closed: its answer may still be readable
        except TimeoutError:
            timed_out = True
        while not timed_out:
            left = deadline - time.monotonic()
            if left <= 0:
                timed_out = True
                break
            sock.settimeout(left)
            try:
                chunk = sock.recv(1 << 16)
            except ConnectionResetError:
                reset = True
                break
            except TimeoutError:
                timed_out = True
                break
            if not chunk:
                break
            buf += chunk
            buf = _INTERIM.sub(b"", buf)  # 100 Continue
            if _complete(buf) or (first_event and b"\r\n\r\n" in buf and len(buf.split(b"\r\n\r\n", 1)[1]) > 0):
                break
            if len(buf) > 64 << 20:
                break
    finally:
        sock.close()
    seconds = time.monotonic() - t0
    m = re.match(rb"HTTP/1\.[01] (\d{3})", buf)
    head, _, body = buf.partition(b"\r\n\r\n")
    if m:
        status = int(m.group(1))
        return Reply(_outcome(status), status, head, _dechunk(head, body), seconds)
    return Reply("reset" if reset else "timeout" if timed_out else "closed", None, head, body, seconds)


_INTERIM = re.compile(rb"^HTTP/1\.[01] 1\d\d[^\r\n]*\r\n(?:[^\r\n]+\r\n)*\r\n")


def _complete(buf: bytes) -> bool:
    head, sep, body = buf.partition(b"\r\n\r\n")
    if not sep:
        return False
    h = head.lower()
    m = re.search(rb"\r\ncontent-length:\s*(\d+)", h)
    if m:
        return len(body) >= int(m.group(1))
    if b"\r\ntransfer-encoding: chunked" in h:
        return body.endswith(b"0\r\n\r\n")
    return h.startswith((b"http/1.1 204", b"http/1.1 304"))


def _dechunk(head: bytes, body: bytes) -> bytes:
    if b"\r\ntransfer-encoding: chunked" not in head.lower():
        return body
    out, rest = b"", body
    while rest:
        size_line, _, rest = rest.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            return out + rest
        if size == 0:
            break
        out, rest = out + rest[:size], rest[size + 2 :]
    return out


def request_bytes(
    method: str,
    target: str,
    host: str | bytes | None,
    body: bytes | None = None,
    headers: list[tuple[str, str | bytes]] | None = None,
    ctype: str | None = "application/json",
    version: str = "HTTP/1.1",
) -> bytes:
    lines = [f"{method} {target} {version}".encode("latin-1", "replace")]
    if host is not None:
        lines.append(b"Host: " + (host if isinstance(host, bytes) else host.encode("latin-1", "replace")))
    for k, v in headers or []:
        lines.append(k.encode("latin-1") + b": " + (v if isinstance(v, bytes) else v.encode("latin-1", "replace")))
    if body is not None:
        if ctype is not None:
            lines.append(b"Content-Type: " + ctype.encode())
        lines.append(b"Content-Length: " + str(len(body)).encode())
    lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n" + (body or b"")


def dumps(value: object) -> bytes:
    """JSON as a client might send it: NaN and Infinity literals allowed, non-ASCII raw (UTF-8)."""
    return json.dumps(value, ensure_ascii=False, allow_nan=True).encode("utf-8", "surrogatepass")


# ---------------------------------------------------------------------------------------------------------
# Cases, expectations, tallies
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Case:
    category: str
    label: str
    data: bytes
    expect: Callable[[Reply], str | None] | None = None  # a broken expectation's description, or None
    timeout: float = 60.0
    first_event: bool = False
    half_close: bool = False  # shut down the sending side after the request: the server sees EOF


def status_in(*allowed: int | str) -> Callable[[Reply], str | None]:
    """An expectation: the status is one of `allowed` (ints, or classes such as "4xx")."""

    def check(r: Reply) -> str | None:
        if r.status in allowed or r.outcome in allowed:
            return None
        return f"expected {'/'.join(map(str, allowed))}, got {r.status or r.outcome}"

    return check


@dataclass
class Tally:
    counts: dict[str, Counter] = field(default_factory=lambda: defaultdict(Counter))
    five_xx: list[str] = field(default_factory=list)
    tracebacks: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    resets: list[str] = field(default_factory=list)
    slowest: list[tuple[float, str]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, case: Case, r: Reply) -> None:
        with self.lock:
            self.counts[case.category][r.outcome] += 1
            self.counts[case.category]["tried"] += 1
            if r.status is not None and r.status >= 500:
                self.counts[case.category][str(r.status)] += 1
            where = f"[{case.category}] {case.label}"
            self.slowest = sorted([*self.slowest, (r.seconds, f"{where}: {r.status or r.outcome}")], reverse=True)[:12]
            if r.outcome == "5xx" and (case.expect is None or case.expect(r) is not None):
                self.five_xx.append(f"{where}: {r.status} {_snippet(r.body)}")
            if b"Traceback" in r.body:
                self.tracebacks.append(f"{where}: {r.status} {_snippet(r.body[r.body.find(b'Traceback') :], 400)}")
            if r.outcome in ("reset", "timeout", "closed"):
                self.resets.append(f"{where}: {r.outcome} after {r.seconds:.1f} s")
            if case.expect is not None and (why := case.expect(r)):
                self.violations.append(f"{where}: {why} ({_snippet(r.body, 160)})")

    def totals(self) -> Counter:
        out: Counter = Counter()
        for c in self.counts.values():
            out.update(c)
        return out


def _snippet(b: bytes, n: int = 240) -> str:
    return b[:n].decode("utf-8", "replace").replace("\n", "\\n")


# ---------------------------------------------------------------------------------------------------------
# The HTTP categories
# ---------------------------------------------------------------------------------------------------------


class Target:
    """The server under test: its address, Host header and served model name."""

    def __init__(self, host: str, port: int, model: str = "deepseek-v4-flash") -> None:
        self.addr = (host, port)
        self.host = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.model = model

    def post(self, path: str, body: bytes | object, headers: list | None = None, host: str | None = None) -> bytes:
        raw = body if isinstance(body, bytes) else dumps(body)
        return request_bytes("POST", path, self.host if host is None else host, raw, headers)

    def get(self, path: str, headers: list | None = None, host: str | bytes | None = None) -> bytes:
        return request_bytes("GET", path, self.host if host is None else host, None, headers)


ROUTES = {  # name: (path, the text field a prompt goes in)
    "chat": "/v1/chat/completions",
    "completions": "/v1/completions",
    "responses": "/v1/responses",
    "messages": "/v1/messages",
    "count_tokens": "/v1/messages/count_tokens",
    "tokenize": "/tokenize",
    "detokenize": "/detokenize",
}


def simple_bodies(model: str, text: str = "hi") -> dict[str, dict]:
    """One small valid body per route, the prompt text `text`, at most 2 tokens generated."""
    msgs = [{"role": "user", "content": text}]
    return {
        "chat": {"model": model, "messages": msgs, "max_tokens": 2},
        "completions": {"model": model, "prompt": text, "max_tokens": 2},
        "responses": {"model": model, "input": text, "max_output_tokens": 2},
        "messages": {"model": model, "max_tokens": 2, "messages": msgs},
        "count_tokens": {"model": model, "messages": msgs},
        "tokenize": {"prompt": text},
        "detokenize": {"tokens": [1, 2, 3]},
    }


def rich_bodies(model: str) -> dict[str, dict]:
    """A valid body per route with most of its fields set, for `wrong_types` to spoil one at a time."""
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "the weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
    call = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    chat_msgs = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {"role": "assistant", "content": "", "reasoning_content": "look it up", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "user", "content": "thanks", "name": "ann"},
    ]
    a_tool = {
        "name": "get_weather",
        "description": "the weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    a_msgs = [
        {"role": "user", "content": [{"type": "text", "text": "Weather in Oslo?"}]},
        {
            "role": "assistant",
            "content": [
                {"type": "thinking", "thinking": "look it up", "signature": "s"},
                {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Oslo"}},
            ],
        },
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]},
    ]
    return {
        "chat": {
            "model": model,
            "messages": chat_msgs,
            "max_tokens": 2,
            "temperature": 0.7,
            "top_p": 0.9,
            "top_k": 20,
            "seed": 7,
            "stop": ["\n\n"],
            "stream": False,
            "logprobs": True,
            "top_logprobs": 2,
            "tools": [tool],
            "tool_choice": "auto",
            "response_format": {"type": "text"},
            "thinking": {"type": "enabled"},
            "reasoning_effort": "high",
            "chat_template_kwargs": {"thinking": True},
            "n": 1,
            "user": "u1",
        },
        "completions": {
            "model": model,
            "prompt": "Once upon a time",
            "max_tokens": 2,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "seed": 3,
            "stop": ["."],
            "stream": False,
            "logprobs": 2,
            "echo": False,
            "n": 1,
        },
        "responses": {
            "model": model,
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {"type": "function_call", "call_id": "f1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
                {"type": "function_call_output", "call_id": "f1", "output": "sunny"},
            ],
            "instructions": "Be brief.",
            "max_output_tokens": 2,
            "temperature": 0.5,
            "top_p": 0.9,
            "tools": [{"type": "function", "name": "get_weather", "parameters": tool["function"]["parameters"]}],
            "tool_choice": "auto",
            "reasoning": {"effort": "high"},
            "text": {"format": {"type": "text"}},
            "stream": False,
            "store": True,
            "metadata": {"k": "v"},
            "truncation": "auto",
        },
        "messages": {
            "model": model,
            "max_tokens": 2,
            "system": [{"type": "text", "text": "Be brief."}],
            "messages": a_msgs,
            "tools": [a_tool],
            "tool_choice": {"type": "auto"},
            "thinking": {"type": "disabled"},
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "stop_sequences": ["\n\n"],
            "stream": False,
            "metadata": {"user_id": "u1"},
        },
        "count_tokens": {"model": model, "system": "Be brief.", "messages": a_msgs, "tools": [a_tool]},
        "tokenize": {"messages": chat_msgs[:2], "add_generation_prompt": True},
        "detokenize": {"tokens": [1, 2, 3, 100]},
    }


def json_paths(value: object, prefix: tuple = ()) -> Iterator[tuple]:
    """Every path (keys and list indices) inside `value`, parents before children."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield (*prefix, k)
            yield from json_paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield (*prefix, i)
            yield from json_paths(v, (*prefix, i))


def replaced(value: object, path: tuple, new: object, delete: bool = False) -> object:
    """A deep copy of `value` with the node at `path` set to `new` (or removed)."""
    out = json.loads(json.dumps(value))
    node = out
    for p in path[:-1]:
        node = node[p]
    if delete:
        del node[path[-1]]
    else:
        node[path[-1]] = new
    return out


def _path_name(path: tuple) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".")


def cases_baseline(t: Target) -> list[Case]:
    out = [
        Case("baseline", f"{r} (simple)", t.post(ROUTES[r], b), status_in("2xx"))
        for r, b in simple_bodies(t.model).items()
    ]
    out += [
        Case("baseline", f"{r} (rich)", t.post(ROUTES[r], b), status_in("2xx")) for r, b in rich_bodies(t.model).items()
    ]
    for path in ("/health", "/v1/health", "/v1/models", "/models", "/metrics", "/", "/index.html"):
        out.append(Case("baseline", f"GET {path}", t.get(path), status_in("2xx")))
    return out


def cases_malformed_json(t: Target, quick: bool) -> list[Case]:
    invalid = [  # not JSON, or not an object: a 4xx
        b"",
        b"{",
        b"}",
        b"{bad",
        b'{"messages": [',
        b'{"model": "x",}',
        b"{'model': 'x'}",
        b"null",
        b"true",
        b"0",
        b"-1e999",
        b"NaN",
        b'"a string"',
        b"[]",
        b"[{}]",
        b'{"a": 1} {"b": 2}',
        b'{"a": 1}garbage',
        b"\x00\x01\x02\x03",
        b"\xff\xfe{\x00}\x00",
        b'{"prompt": "\\x41"}',
        b'{"prompt": "\\u12"}',
        b'{"prompt": "tab\tinside"}',
    ]
    odd = [  # JSON a strict parser might refuse or take: a 2xx or a 4xx
        b"\xef\xbb\xbf{}",
        b'{"messages": "hi", "messages": [{"role": "user", "content": "dup"}], "max_tokens": 2}',
        b'{"prompt": "hi", "max_tokens": 2, "max_tokens": 2}',
        b'{"max_tokens": 1' + b"0" * 5000 + b"}",
        b'{"max_tokens": 1e400, "prompt": "x"}',
        b" " * 10000 + b"{}",
    ]
    out = []
    for i, r in enumerate(ROUTES):
        for body in invalid if not quick or i == 0 else invalid[i::7]:
            out.append(
                Case("malformed_json", f"{r}: {_snippet(body, 40)!r}", t.post(ROUTES[r], body), status_in("4xx"))
            )
        for body in odd if not quick else odd[i % 6 : i % 6 + 1]:
            label = f"{r}: {_snippet(body, 40)!r}"
            out.append(Case("malformed_json", label, t.post(ROUTES[r], body), status_in("2xx", "4xx")))
    return out


def cases_wrong_types(t: Target, rng: random.Random, quick: bool) -> list[Case]:
    out = []
    for route, body in rich_bodies(t.model).items():
        paths = list(json_paths(body))
        pairs = [(p, v) for p in paths for v in WRONG_VALUES]
        pairs += [(p, "<delete>") for p in paths]
        extra = ("n", "best_of", "logit_bias", "presence_penalty", "frequency_penalty", "min_p", "suffix")
        pairs += [((k,), v) for k in extra if k not in body for v in WRONG_VALUES]
        pairs = rng.sample(pairs, min(len(pairs), 25 if quick else 330))
        for p, v in pairs:
            if p[-1] in LENGTH_FIELDS and (v is None or v == "<delete>"):
                continue  # the default reply length: a valid request, and a long one
            new = replaced(body, p, None, delete=True) if v == "<delete>" else replaced(body, p, v)
            label = f"{route}.{_path_name(p)} = {'<deleted>' if v == '<delete>' else repr(v)[:30]}"
            out.append(Case("wrong_types", label, t.post(ROUTES[route], new), status_in("2xx", "4xx")))
    return out


def cases_huge_nested(t: Target, quick: bool) -> list[Case]:
    out = []
    simple = simple_bodies(t.model)
    depths = (100, 10_000) if quick else (65, 100, 1_000, 10_000, 100_000)
    for route, body in simple.items():
        text_key = {"chat": "messages", "messages": "messages", "count_tokens": "messages", "detokenize": "tokens"}
        key = text_key.get(route, "prompt" if route != "responses" else "input")
        for depth in depths:
            nested = b"[" * depth + b"]" * depth
            raw = dumps({**body, key: "__N__"}).replace(b'"__N__"', nested)
            out.append(Case("huge_nested", f"{route}.{key} nested {depth} deep", t.post(ROUTES[route], raw)))
            raw = dumps({**body, "tools": "__N__"}).replace(b'"__N__"', b'{"a":' * depth + b"1" + b"}" * depth)
            out.append(Case("huge_nested", f"{route}.tools objects nested {depth} deep", t.post(ROUTES[route], raw)))
    big = 100 if quick else 100_000
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": "hi"} for i in range(big | 1)]
    for route in ("chat", "messages", "count_tokens"):
        out.append(
            Case(
                "huge_nested",
                f"{route}: {len(msgs)} messages",
                t.post(ROUTES[route], {**simple[route], "messages": msgs}),
            )
        )
    out.append(
        Case(
            "huge_nested",
            f"responses: {big} input items",
            t.post(ROUTES["responses"], {**simple["responses"], "input": [{"role": "user", "content": "hi"}] * big}),
        )
    )
    n_tok = 10_000 if quick else 1_000_000
    out.append(Case("huge_nested", f"detokenize {n_tok} tokens", t.post(ROUTES["detokenize"], {"tokens": [5] * n_tok})))
    out.append(
        Case(
            "huge_nested",
            f"completions: {n_tok} token ids",
            t.post(ROUTES["completions"], {"prompt": [5] * n_tok, "max_tokens": 2}),
        )
    )
    out.append(
        Case(
            "huge_nested",
            "completions: 10,000 prompts",
            t.post(ROUTES["completions"], {"prompt": ["hi"] * 10_000, "max_tokens": 2}),
        )
    )
    out.append(
        Case(
            "huge_nested",
            "chat: 10,000 stop strings",
            t.post(ROUTES["chat"], {**simple["chat"], "stop": ["x"] * 10_000}),
        )
    )
    out.append(
        Case(
            "huge_nested",
            "chat: 1,000 tools",
            t.post(ROUTES["chat"], {**simple["chat"], "tools": [rich_bodies(t.model)["chat"]["tools"][0]] * 1000}),
        )
    )
    out.append(
        Case(
            "huge_nested",
            "chat: a 1 MB model name",
            t.post(ROUTES["chat"], {**simple["chat"], "model": "m" * (1 << 20)}),
            status_in("4xx"),
        )
    )
    out.append(
        Case(
            "huge_nested",
            "chat: a 1 MB role",
            t.post(ROUTES["chat"], {**simple["chat"], "messages": [{"role": "r" * (1 << 20), "content": "x"}]}),
            status_in("4xx"),
        )
    )
    out.append(
        Case(
            "huge_nested",
            "chat: 100,000 keys",
            t.post(ROUTES["chat"], {**simple["chat"], **{f"k{i}": i for i in range(100_000)}}),
        )
    )
    if not quick:
        under = BODY_LIMIT - 4096
        pad = {"model": t.model, "prompt": "hi", "max_tokens": 2, "metadata_padding": "p" * (under - 100)}
        out.append(
            Case(
                "huge_nested", "completions: a body just under 32 MiB", t.post(ROUTES["completions"], pad), timeout=120
            )
        )
        over = b'{"prompt": "' + b"o" * (BODY_LIMIT + 4096) + b'"}'
        out.append(
            Case(
                "huge_nested",
                "completions: a body just over 32 MiB",
                t.post(ROUTES["completions"], over),
                status_in(413, "reset"),
                timeout=120,
            )
        )
        out.append(
            Case(
                "huge_nested",
                "chat: Content-Length 10^12 with a small body",
                request_bytes(
                    "POST",
                    ROUTES["chat"],
                    t.host,
                    None,
                    [("Content-Type", "application/json"), ("Content-Length", "1000000000000")],
                )
                + b"{}",
                status_in(413),
            )
        )
    return out


BAD_UTF8 = {
    "lone surrogate ED A0 80": b"\xed\xa0\x80",
    "low surrogate ED BF BF": b"\xed\xbf\xbf",
    "surrogate pair as two 3-byte runs": b"\xed\xa0\xbd\xed\xb8\x80",
    "FF FE": b"\xff\xfe",
    "overlong C0 AF": b"\xc0\xaf",
    "5-byte F8 88 80 80 80": b"\xf8\x88\x80\x80\x80",
    "lone continuation 80": b"\x80",
    "truncated E2 82": b"\xe2\x82",
    "beyond U+10FFFF F4 90 80 80": b"\xf4\x90\x80\x80",
    "escaped \\ud800": b"\\ud800",
    "escaped \\udfff\\ud800": b"\\udfff\\ud800",
}


def cases_bad_unicode(t: Target, quick: bool) -> list[Case]:
    out = []
    marker = "ZZMARKZZ"
    fields = {  # route: bodies with the marker in each text field
        "chat": [
            {"model": t.model, "max_tokens": 2, "messages": [{"role": "user", "content": marker}]},
            {
                "model": t.model,
                "max_tokens": 2,
                "messages": [{"role": "system", "content": marker}, {"role": "user", "content": "x"}],
            },
            {
                "model": t.model,
                "max_tokens": 2,
                "messages": [{"role": "user", "content": [{"type": "text", "text": marker}]}],
            },
            {"model": t.model, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}], "stop": [marker]},
            {"model": marker, "max_tokens": 2, "messages": [{"role": "user", "content": "x"}]},
        ],
        "completions": [
            {"model": t.model, "prompt": marker, "max_tokens": 2},
            {"prompt": "x", "max_tokens": 2, "stop": marker},
        ],
        "responses": [
            {"model": t.model, "input": marker, "max_output_tokens": 2},
            {"model": t.model, "input": "x", "instructions": marker, "max_output_tokens": 2},
        ],
        "messages": [
            {"model": t.model, "max_tokens": 2, "messages": [{"role": "user", "content": marker}]},
            {"model": t.model, "max_tokens": 2, "system": marker, "messages": [{"role": "user", "content": "x"}]},
        ],
        "count_tokens": [
            {"model": t.model, "messages": [{"role": "user", "content": marker}]},
            {"model": t.model, "system": marker, "messages": [{"role": "user", "content": "x"}]},
        ],
        "tokenize": [{"prompt": marker}, {"messages": [{"role": "user", "content": marker}]}],
        "detokenize": [{"tokens": [1], marker: 1}],
    }
    kinds = BAD_UTF8 if not quick else {k: BAD_UTF8[k] for k in ("lone surrogate ED A0 80", "FF FE", "escaped \\ud800")}
    for route, bodies in fields.items():
        for i, body in enumerate(bodies):
            for name, bad in kinds.items():
                raw = dumps(body).replace(marker.encode(), b"a" + bad + b"b")
                out.append(
                    Case("bad_unicode", f"{route} #{i}: {name}", t.post(ROUTES[route], raw), status_in("2xx", "4xx"))
                )
    return out


def cases_over_context(t: Target, quick: bool) -> list[Case]:
    size = 2_000_000 if quick else 20_000_000
    text = "word " * (size // 5)
    s = simple_bodies(t.model, text)
    bodies = {
        "chat": s["chat"],
        "completions": s["completions"],
        "responses": s["responses"],
        "responses (items)": {**s["responses"], "input": [{"role": "user", "content": text}]},
        "responses (instructions)": {**simple_bodies(t.model)["responses"], "instructions": text},
        "responses (truncation auto)": {**s["responses"], "truncation": "auto"},
        "messages": s["messages"],
        "messages (system)": {**simple_bodies(t.model)["messages"], "system": text},
        "count_tokens": s["count_tokens"],
        "tokenize": s["tokenize"],
        "tokenize (messages)": {"messages": [{"role": "user", "content": text}]},
    }
    out = []
    for name, body in bodies.items():
        route = name.split(" ")[0]
        out.append(
            Case(
                "over_context",
                f"{name}: a {len(text) / 1e6:.0f} MB prompt",
                t.post(ROUTES[route], body),
                status_in("4xx"),
                timeout=180,
            )
        )
    agent_run = [  # an agent run whose old tool round is too long: "auto" drops it, the rest fits
        {"type": "function_call", "call_id": "f1", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "f1", "output": text},
        {"type": "function_call", "call_id": "f2", "name": "read", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "f2", "output": "short"},
    ]
    auto = {**simple_bodies(t.model)["responses"], "input": [{"role": "user", "content": "hi"}, *agent_run]}
    out.append(
        Case(
            "over_context",
            f"responses (truncation auto): a {len(text) / 1e6:.0f} MB old tool round",
            t.post(ROUTES["responses"], {**auto, "truncation": "auto"}),
            status_in("2xx"),
            timeout=180,
        )
    )
    out.append(
        Case(
            "over_context",
            "completions: 100,000 token ids",
            t.post(ROUTES["completions"], {"prompt": [5] * 100_000, "max_tokens": 2}),
            status_in("4xx"),
        )
    )
    out.append(
        Case(
            "over_context",
            "chat: max_tokens 10^9",
            t.post(ROUTES["chat"], {**simple_bodies(t.model)["chat"], "max_tokens": 10**9}),
            status_in("4xx"),
        )
    )
    return out


def cases_static(t: Target) -> list[Case]:
    names = [
        "a" * 255,
        "a" * 256,
        "a" * 1000,
        "a" * 5000,
        "a" * 256 + ".js",
        "/".join(["b" * 256] * 4),
        "%61" * 256,
        "%C3%A9" * 200,
        "x/" * 2000 + "y",
        "../../../../etc/passwd",
        "..%2f..%2f..%2fetc%2fpasswd",
        "%2e%2e/%2e%2e/etc/passwd",
        "%252e%252e/%252e%252e/etc/passwd",
        "....//....//etc/passwd",
        "app.js%00.html",
        "%ff%fe",
        "%ed%a0%80",
        "\\..\\..\\etc\\passwd",
        "C:/windows/win.ini",
        "/etc/passwd",
        "nul",
        "con.js",
        "a:b",
        ".",
        "",
    ]
    out = []
    for n in names:
        target = "/static/" + n
        out.append(
            Case(
                "static_files",
                f"GET /static/{n[:40]}{'...' if len(n) > 40 else ''} ({len(n)} chars)",
                t.get(target),
                _static_expect,
            )
        )
    return out


def _static_expect(r: Reply) -> str | None:
    if b"root:" in r.body or b"[fonts]" in r.body:
        return "a file outside static/ was served"
    return None if r.status == 404 else f"expected 404, got {r.status or r.outcome}"


def cases_framing(t: Target) -> list[Case]:
    host_line = f"Host: {t.host}\r\n".encode()

    def health_with(header: bytes) -> bytes:  # a GET /health with one more header line (its own CRLF included)
        return b"GET /health HTTP/1.1\r\n" + host_line + header + b"Connection: close\r\n\r\n"

    def head_of(total: int) -> bytes:  # a GET /health whose request line + headers are `total` bytes
        start = b"GET /health HTTP/1.1\r\n" + host_line + b"Connection: close\r\n"
        pad = total - len(start) - len(b"X-Pad: \r\n\r\n")
        return start + b"X-Pad: " + b"p" * pad + b"\r\n\r\n"

    def line_of(total: int) -> bytes:  # the request line alone makes up most of `total`
        rest = host_line + b"Connection: close\r\n\r\n"
        q = total - len(rest) - len(b"GET /health?q= HTTP/1.1\r\n")
        return b"GET /health?q=" + b"q" * q + b" HTTP/1.1\r\n" + rest

    many = b"GET /health HTTP/1.1\r\n" + host_line + b"".join(b"X-H%d: v\r\n" % i for i in range(6000))
    many += b"Connection: close\r\n\r\n"  # about 77 KB of 13-byte headers
    refused = status_in(400, 413, 414, 431)
    cases = [
        ("request line + headers 1 KiB under 64 KiB", head_of(HEAD_LIMIT - 1024), status_in(200)),
        ("request line + headers 1 KiB over 64 KiB", head_of(HEAD_LIMIT + 1024), refused),
        ("one 100,000-byte header", head_of(100_000), refused),
        ("one 200,000-byte header", head_of(200_000), refused),
        ("a 60 KB request line", line_of(60_000), status_in(200)),
        ("a 70 KB request line", line_of(70_000), refused),
        ("a 1 MB request line", line_of(1_000_000), refused),
        ("6,000 small headers past 64 KiB", many, refused),
        ("a 100 KB header name", b"GET /health HTTP/1.1\r\n" + host_line + b"X" * 100_000 + b": v\r\n\r\n", refused),
        ("HTTP/2.0", b"GET /health HTTP/2.0\r\n" + host_line + b"\r\n", status_in("4xx", 505)),
        ("HTTP/0.9", b"GET /health\r\n\r\n", status_in("4xx", "closed")),
        ("HTTP/1.0 without Host", b"GET /health HTTP/1.0\r\n\r\n", status_in(200)),
        ("garbage", b"\x16\x03\x01\x00\xa5\x01\x00\x00\xa1\x03\x03" + b"\x00" * 40, status_in("4xx", "closed")),
        ("lowercase method", b"get /health HTTP/1.1\r\n" + host_line + b"Connection: close\r\n\r\n", None),
        ("unknown method", b"BREW /health HTTP/1.1\r\n" + host_line + b"Connection: close\r\n\r\n", status_in("4xx")),
        ("OPTIONS *", b"OPTIONS * HTTP/1.1\r\n" + host_line + b"Connection: close\r\n\r\n", None),
        (
            "target without slash",
            b"GET health HTTP/1.1\r\n" + host_line + b"Connection: close\r\n\r\n",
            status_in("4xx"),
        ),
        (
            "10,000 empty lines first",
            b"\r\n" * 10_000 + b"GET /health HTTP/1.1\r\n" + host_line + b"Connection: close\r\n\r\n",
            None,
        ),
        (
            "obs-fold header",
            health_with(b"X-A: a\r\n b\r\n"),
            status_in("2xx", "4xx"),
        ),
        (
            "NUL in a header",
            health_with(b"X-A: a\x00b\r\n"),
            status_in("2xx", "4xx"),
        ),
        (
            "bytes 0x80-0xff in a header",
            health_with(b"X-A: \xff\xfe\xed\xa0\x80\r\n"),
            status_in("2xx", "4xx"),
        ),
        (
            "space before colon",
            health_with(b"X-A : b\r\n"),
            status_in("2xx", "4xx"),
        ),
        (
            "bare LF line ends",
            b"GET /health HTTP/1.1\n" + host_line.replace(b"\r", b"") + b"Connection: close\n\n",
            status_in("2xx", "4xx"),
        ),
    ]
    post_head = (
        b"POST /v1/completions HTTP/1.1\r\n" + host_line + b"Content-Type: application/json\r\nConnection: close\r\n"
    )
    body = b'{"prompt": "hi!", "max_tokens": 2}'  # 34 bytes, 0x22
    cases += [
        ("Content-Length: abc", post_head + b"Content-Length: abc\r\n\r\n" + body, status_in("4xx")),
        ("Content-Length: -1", post_head + b"Content-Length: -1\r\n\r\n" + body, status_in("4xx")),
        ("Content-Length: +34", post_head + b"Content-Length: +34\r\n\r\n" + body, status_in("4xx")),
        ("Content-Length 2^64", post_head + b"Content-Length: 18446744073709551616\r\n\r\n" + body, status_in("4xx")),
        (
            "two different Content-Lengths",
            post_head + b"Content-Length: 34\r\nContent-Length: 5\r\n\r\n" + body,
            status_in("4xx"),
        ),
        (
            "Content-Length and chunked",
            post_head + b"Content-Length: 34\r\nTransfer-Encoding: chunked\r\n\r\n22\r\n" + body + b"\r\n0\r\n\r\n",
            status_in("2xx", "4xx"),
        ),
        (
            "chunked, good",
            post_head + b"Transfer-Encoding: chunked\r\n\r\n22\r\n" + body + b"\r\n0\r\n\r\n",
            status_in("2xx"),
        ),
        (
            "chunked, bad size",
            post_head + b"Transfer-Encoding: chunked\r\n\r\nzz\r\n" + body + b"\r\n0\r\n\r\n",
            status_in("4xx", "closed"),
        ),
        (
            "chunked, 2^64 size",
            post_head + b"Transfer-Encoding: chunked\r\n\r\n10000000000000000\r\n" + body + b"\r\n0\r\n\r\n",
            status_in("4xx", "closed"),
        ),
        (
            "chunked, 100 KB extension",
            post_head + b"Transfer-Encoding: chunked\r\n\r\n22;" + b"e" * 100_000 + b"\r\n" + body + b"\r\n0\r\n\r\n",
            status_in("2xx", "4xx", "closed"),
        ),
        ("Transfer-Encoding: gzip", post_head + b"Transfer-Encoding: gzip\r\n\r\n" + body, status_in("4xx", "closed")),
        (
            "Content-Encoding: gzip",
            post_head + b"Content-Encoding: gzip\r\nContent-Length: 34\r\n\r\n" + body,
            status_in("2xx", "4xx"),
        ),
        (
            "short body (length 50, 34 sent, then EOF)",
            post_head + b"Content-Length: 50\r\n\r\n" + body,
            status_in("4xx", "closed"),
        ),
        (
            "Expect: 100-continue",
            post_head + b"Expect: 100-continue\r\nContent-Length: 34\r\n\r\n" + body,
            status_in("2xx"),
        ),
        (
            "content type text/plain",
            post_head.replace(b"application/json", b"text/plain") + b"Content-Length: 34\r\n\r\n" + body,
            status_in(415),
        ),
        (
            "content type with charset latin-1",
            post_head.replace(b"application/json", b"application/json; charset=latin-1")
            + b"Content-Length: 34\r\n\r\n"
            + body,
            status_in("2xx", "4xx"),
        ),
        (
            "pipelined: two requests",
            (b"GET /health HTTP/1.1\r\n" + host_line + b"\r\n") * 2
            + b"GET /health HTTP/1.1\r\n"
            + host_line
            + b"Connection: close\r\n\r\n",
            status_in(200),
        ),
    ]
    half = ("short body", "chunked, 2^64", "chunked, bad", "Transfer-Encoding: gzip")  # then EOF: nothing more comes
    return [
        Case("framing", label, data, expect, timeout=20, half_close=label.startswith(half))
        for label, data, expect in cases
    ]


def cases_absolute_form(t: Target) -> list[Case]:
    h, p = t.addr
    own = f"{h}:{p}" if ":" not in h else f"[{h}]:{p}"
    good = [
        (f"GET http://{own}/health", request_bytes("GET", f"http://{own}/health", t.host)),
        (f"GET http://localhost:{p}/health", request_bytes("GET", f"http://localhost:{p}/health", t.host)),
        (f"GET http://{own}/v1/models", request_bytes("GET", f"http://{own}/v1/models", t.host)),
        (f"GET http://{own}/health?x=1", request_bytes("GET", f"http://{own}/health?x=1", t.host)),
        (
            f"POST http://{own}/v1/completions",
            request_bytes("POST", f"http://{own}/v1/completions", t.host, dumps(simple_bodies(t.model)["completions"])),
        ),
        (
            f"GET http://{own}/health, HTTP/1.0 without Host",
            request_bytes("GET", f"http://{own}/health", None, version="HTTP/1.0"),
        ),
    ]
    out = [Case("absolute_form", label, data, status_in(200)) for label, data in good]
    other = [
        (
            "GET http://evil.example/v1/models (Host: the server)",
            request_bytes("GET", "http://evil.example/v1/models", t.host),
        ),
        ("GET https://host/health", request_bytes("GET", f"https://{own}/health", t.host)),
        ("GET http:///health", request_bytes("GET", "http:///health", t.host)),
        ("GET http://host (no path)", request_bytes("GET", f"http://{own}", t.host)),
        ("CONNECT host:port", request_bytes("CONNECT", own, t.host)),
        ("GET ftp://host/health", request_bytes("GET", f"ftp://{own}/health", t.host)),
    ]
    out += [Case("absolute_form", label, data, status_in("2xx", "4xx")) for label, data in other]
    return out


def cases_bad_host(t: Target) -> list[Case]:
    _, p = t.addr
    refuse = [
        "[::1]evil.example",
        "[localhost]",
        "",
        "[::1",
        "[]",
        "evil.example",
        f"evil.example:{p}",
        "localhost.evil.example",
        "127.0.0.1.evil.example",
        "localhost@evil.example",
        "[::1]:80evil",
        "evil.example:80:80",
    ]
    accept = [
        "localhost",
        f"localhost:{p}",
        f"127.0.0.1:{p}",
        f"[::1]:{p}",
        "[::1]",
        "LOCALHOST",
        "app.localhost",
        "[::ffff:127.0.0.1]",
    ]
    out = []
    for h in refuse:
        for path in ("/v1/models", "/health"):
            out.append(Case("bad_host", f"GET {path}, Host {h!r}", t.get(path, host=h), status_in("4xx")))
        out.append(
            Case(
                "bad_host",
                f"POST completions, Host {h!r}",
                t.post(ROUTES["completions"], simple_bodies(t.model)["completions"], host=h),
                status_in("4xx"),
            )
        )
    for h in accept:
        out.append(Case("bad_host", f"GET /v1/models, Host {h!r}", t.get("/v1/models", host=h), status_in(200)))
    two = request_bytes("GET", "/v1/models", t.host, None, [("Host", "evil.example")])
    out.append(Case("bad_host", "two Host headers, the second evil", two, status_in("2xx", "4xx")))
    out.append(
        Case("bad_host", "Host with bytes 0x80-0xff", t.get("/v1/models", host=b"loc\xffalhost"), status_in("4xx"))
    )
    return out


def cases_auth(t: Target, key: str) -> list[Case]:
    def basic(user: str, pw: str) -> str:
        return "Basic " + base64.b64encode(f"{user}:{pw}".encode()).decode()

    attempts = [
        ("no key", []),
        ("wrong Bearer", [("Authorization", "Bearer wrong")]),
        ("empty Bearer", [("Authorization", "Bearer ")]),
        ("Bearer with the key's prefix", [("Authorization", f"Bearer {key[:-1]}")]),
        ("Bearer with the key and more", [("Authorization", f"Bearer {key}x")]),
        ("Basic, wrong password", [("Authorization", basic("u", "wrong"))]),
        ("Basic, the key as user", [("Authorization", basic(key, ""))]),
        ("Basic, bad base64", [("Authorization", "Basic !!!")]),
        ("Basic, non-UTF-8", [("Authorization", "Basic " + base64.b64encode(b"u:\xff\xfe").decode())]),
        ("X-Api-Key wrong", [("X-Api-Key", "wrong")]),
        ("X-Api-Key empty", [("X-Api-Key", "")]),
        ("wrong Bearer and right X-Api-Key? no: wrong both", [("Authorization", "Bearer a"), ("X-Api-Key", "b")]),
        ("Authorization with bytes 0x80-0xff", [("Authorization", b"Bearer \xff\xfe")]),
        ("Token scheme", [("Authorization", f"Token {key[:-1]}")]),
    ]
    paths = [
        "/v1/models",
        "/v1/models/",
        "//v1/models",
        "/V1/models",
        "/v1/./models",
        "/v1/%6dodels",
        "/health/../v1/models",
        "/health%2f..%2fv1%2fmodels",
        "/metrics",
        "/",
        "/static/app.js",
    ]
    out = []

    def no_bypass(r: Reply) -> str | None:
        if r.outcome == "2xx" and b'"status":"ok"' not in r.body.replace(b" ", b""):
            return f"served {r.status} without the key"
        return None

    for label, headers in attempts:
        for path in paths:
            out.append(Case("auth", f"GET {path}, {label}", t.get(path, headers), no_bypass))
        body = simple_bodies(t.model)["completions"]
        out.append(Case("auth", f"POST completions, {label}", t.post(ROUTES["completions"], body, headers), no_bypass))
        out.append(
            Case(
                "auth",
                f"POST messages, {label}",
                t.post(ROUTES["messages"], simple_bodies(t.model)["messages"], headers),
                no_bypass,
            )
        )
    out.append(Case("auth", "GET /health, no key", t.get("/health"), status_in(200)))
    out.append(
        Case(
            "auth", "GET /v1/models, the key", t.get("/v1/models", [("Authorization", f"Bearer {key}")]), status_in(200)
        )
    )
    out.append(
        Case("auth", "GET /v1/models, the key as X-Api-Key", t.get("/v1/models", [("X-Api-Key", key)]), status_in(200))
    )
    out.append(
        Case(
            "auth", "GET /, the key as Basic password", t.get("/", [("Authorization", basic("u", key))]), status_in(200)
        )
    )
    return out


def cases_methods_paths(t: Target) -> list[Case]:
    out = []
    for path in [*ROUTES.values(), "/v1/models", "/health", "/metrics", "/v1/responses/resp_x"]:
        for method in ("PUT", "DELETE", "PATCH", "TRACE", "HEAD", "OPTIONS", "GET", "POST"):
            data = request_bytes(method, path, t.host, b"{}")
            out.append(Case("methods_paths", f"{method} {path}", data))
    odd = [
        "/v1/responses/" + "a" * 5000,
        "/v1/responses/%00",
        "/v1/responses/%ff",
        "/v1/responses/../../etc/passwd",
        "/v1/models?x=" + "a" * 30_000,
        "/v1/models?%ff=%fe",
        "/%ff",
        "/v1/chat/completions%00",
        "/v1/chat/completions/",
        "/v1//chat/completions",
        "/" + "a" * 8000,
        "/v1/" + "/" * 5000,
        "/%2e%2e/%2e%2e/etc/passwd",
        "/v1/models#frag",
        "/v1/models;param",
    ]
    out += [Case("methods_paths", f"GET {p[:50]}", t.get(p), status_in("2xx", "3xx", "4xx")) for p in odd]
    return out


def cases_streams(t: Target) -> list[Case]:
    out = []
    s = simple_bodies(t.model)
    for route in ("chat", "completions", "responses", "messages"):
        body = {**s[route], "stream": True}
        for cut in (True, False):
            label = f"{route} stream, {'cut after the first bytes' if cut else 'read to the end'}"
            out.append(Case("streams", label, t.post(ROUTES[route], body), status_in("2xx"), first_event=cut))
    out.append(
        Case(
            "streams",
            "chat stream with usage",
            t.post(ROUTES["chat"], {**s["chat"], "stream": True, "stream_options": {"include_usage": True}}),
            status_in("2xx"),
        )
    )
    out.append(
        Case(
            "streams",
            "chat stream_options without stream",  # refused, as OpenAI and vLLM refuse it
            t.post(ROUTES["chat"], {**s["chat"], "stream_options": {"include_usage": True}}),
            status_in("4xx"),
        )
    )
    return out


def special_token_cases(tally: Tally, t: Target, quick: bool) -> None:
    """Content holding the template's control-token text must tokenize as plain text: as several tokens, and
    never as the control token's id. Checked through /tokenize (messages) and count_tokens."""
    cat = "special_tokens"

    def ask(path: str, body: object) -> tuple[Reply, dict | None]:
        case = Case(
            cat, f"{path} {json.dumps(body, ensure_ascii=False)[:80]}", t.post(path, body), status_in("2xx", "4xx")
        )
        r = exchange(t.addr, case.data)
        tally.add(case, r)
        try:
            return r, json.loads(r.body) if r.outcome == "2xx" else None
        except ValueError:
            return r, None

    def broken(label: str, why: str) -> None:
        with tally.lock:
            tally.violations.append(f"[{cat}] {label}: {why}")

    specials = {}
    for s in SPECIALS[1:3] if quick else SPECIALS:
        _, out = ask("/tokenize", {"prompt": s})
        if out and len(out.get("tokens", [])) == 1:
            specials[s] = out["tokens"][0]
    ids = set(specials.values())

    def user(content: str) -> list[dict]:
        return [{"role": "user", "content": content}]

    places = {
        "user content": lambda c: user(c),
        "system content": lambda c: [{"role": "system", "content": c}, *user("x")],
        "assistant content": lambda c: [*user("x"), {"role": "assistant", "content": c}, *user("y")],
        "tool result": lambda c: [
            *user("x"),
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "c1", "content": c},
        ],
        "content part": lambda c: [{"role": "user", "content": [{"type": "text", "text": c}]}],
    }
    for s, sid in specials.items():
        for place, build in places.items():
            label = f"/tokenize messages, {s} in the {place}"
            _, plain = ask("/tokenize", {"messages": build("ab")})
            _, inj = ask("/tokenize", {"messages": build("a" + s + "b")})
            if plain and inj:
                n_plain = sum(x in ids for x in plain["tokens"])
                n_inj = sum(x in ids for x in inj["tokens"])
                if n_inj != n_plain:
                    broken(label, f"{n_inj - n_plain} more control token(s) than with plain text (id {sid})")
        a_places = {  # "x" + the control text against "x": one token more only if it became the control token
            "user content": {"messages": user("x" + s)},
            "system": {"system": "x" + s, "messages": user("x")},
            "tool_result": {
                "messages": [
                    *user("x"),
                    {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "f", "input": {}}]},
                    {
                        "role": "user",
                        "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "x" + s}],
                    },
                ]
            },
        }
        for place, body in a_places.items():
            base = json.loads(json.dumps(body).replace(json.dumps("x" + s)[1:-1], "x"))
            _, n0 = ask(ROUTES["count_tokens"], {"model": t.model, **base})
            _, n1 = ask(ROUTES["count_tokens"], {"model": t.model, **body})
            if n0 and n1 and n1.get("input_tokens", 0) - n0.get("input_tokens", 0) == 1:
                broken(f"count_tokens, {s} in the {place}", "counted as one token: the control token itself")
        ask(ROUTES["chat"], {**simple_bodies(t.model)["chat"], "messages": user(f"{s}<｜Assistant｜>{s}")})
        ask(ROUTES["responses"], {**simple_bodies(t.model)["responses"], "input": f"{s}x{s}"})
        ask(ROUTES["messages"], {**simple_bodies(t.model)["messages"], "messages": user(f"{s}x{s}")})


def cases_mutations(t: Target, rng: random.Random, n: int) -> list[Case]:
    pool = [(r, b) for r, b in {**simple_bodies(t.model)}.items()] + list(rich_bodies(t.model).items())
    out = []
    for i in range(n):
        route, body = rng.choice(pool)
        kind = rng.choice(("bytes", "bytes", "tree", "tree", "tree", "text"))
        if kind == "tree":
            paths = [p for p in json_paths(body) if p[-1] not in LENGTH_FIELDS]
            p = rng.choice(paths)
            op = rng.choice(("value", "delete", "wrap", "dup"))
            if op == "value":
                new = replaced(body, p, _random_json(rng, 3))
            elif op == "delete":
                new = replaced(body, p, None, delete=True)
            else:
                node = body
                for q in p:
                    node = node[q]
                new = replaced(body, p, [node] if op == "wrap" else [node, node])
            raw = dumps(new)
            label = f"{route}.{_path_name(p)} {op}"
        elif kind == "text":
            raw, tail = _length_last(body)
            inserts = [
                b"\\u0000",
                b"\xed\xa0\x80",
                b"<\xef\xbd\x9cUser\xef\xbd\x9c>",
                b"\\ud83d",
                b"\xff",
                b"\\n" * 100,
                b"\\",
            ]
            spots = [m.start() + 1 for m in re.finditer(rb'"', raw)]
            at = rng.choice(spots)
            raw = raw[:at] + rng.choice(inserts) + raw[at:] + tail
            label = f"{route} string insert at {at}"
        else:
            head, tail = _length_last(body)
            raw = bytearray(head)
            for _ in range(rng.randint(1, 4)):
                op = rng.choice(("flip", "delete", "insert", "dup", "truncate"))
                at = rng.randrange(max(1, len(raw)))
                if op == "flip":
                    raw[at % len(raw)] ^= 1 << rng.randrange(8)
                elif op == "delete":
                    del raw[at : at + rng.randint(1, 8)]
                elif op == "insert":
                    raw[at:at] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 4)))
                elif op == "dup":
                    raw[at:at] = raw[at : at + rng.randint(1, 16)]
                else:
                    del raw[at:]
                if not raw:
                    raw = bytearray(b"{")
            raw = bytes(raw) + tail
            label = f"{route} bytes #{i}"
        out.append(Case("mutations", label, t.post(ROUTES[route], raw), status_in("2xx", "4xx")))
    return out


def _length_last(body: dict) -> tuple[bytes, bytes]:
    """`body` as JSON cut in two, the reply-length field alone in the second part: mutations of the first part
    cannot drop it (a request of the default length would run for the whole context)."""
    lengths = {k: v for k, v in body.items() if k in LENGTH_FIELDS}
    raw = dumps({**{k: v for k, v in body.items() if k not in LENGTH_FIELDS}, **lengths})
    if not lengths:
        return raw, b""
    cut = raw.rfind(b', "max_')
    return raw[:cut], raw[cut:]


def _random_json(rng: random.Random, depth: int) -> object:
    r = rng.random()
    if depth <= 0 or r < 0.6:
        return rng.choice([*WRONG_VALUES, "user", "assistant", "function", "text", 2, 0.0, "\u2028", "<｜User｜>"])
    if r < 0.8:
        return [_random_json(rng, depth - 1) for _ in range(rng.randint(0, 3))]
    keys = ("type", "role", "content", "text", "name", "id", "input", "arguments", "x")
    return {rng.choice(keys): _random_json(rng, depth - 1) for _ in range(rng.randint(0, 3))}


def idle_connections(tally: Tally, t: Target, n: int, seconds: float) -> dict:
    """`n` connections that send nothing (or a few bytes, slowly), each reopened as soon as the server closes
    it, while one real request goes out every 0.25 s. Every real request must be served (2xx)."""
    cat = "idle_connections"
    sel = selectors.DefaultSelector()
    stop = threading.Event()
    opened = reopened = refused = 0

    def open_one(i: int) -> None:
        nonlocal opened, refused
        try:
            s = socket.create_connection(t.addr, timeout=5)
        except OSError:
            refused += 1
            return
        s.setblocking(False)
        if i % 10 == 0:  # slowloris: a request line, a byte at a time
            try:
                s.send(b"GET /health HTTP/1.1\r\nHost: " + t.host.encode() + b"\r\nX-Slow: ")
            except OSError:
                pass
        sel.register(s, selectors.EVENT_READ, i)
        opened += 1

    def attacker() -> None:
        nonlocal reopened
        last_trickle = time.monotonic()
        while not stop.is_set():
            for key, _ in sel.select(timeout=0.1):
                s, i = key.fileobj, key.data
                try:
                    data = s.recv(4096)
                except (BlockingIOError, InterruptedError):
                    continue
                except OSError:
                    data = b""
                if data:  # an answer (a 503, a 408): the server will close it; we close and reopen now
                    pass
                sel.unregister(s)
                s.close()
                if not stop.is_set():
                    open_one(i)
                    reopened += 1
            if time.monotonic() - last_trickle > 2:
                last_trickle = time.monotonic()
                for key in list(sel.get_map().values()):
                    if key.data % 10 == 0:
                        try:
                            key.fileobj.send(b"x")
                        except OSError:
                            pass

    for i in range(n):
        open_one(i)
    th = threading.Thread(target=attacker, daemon=True)
    th.start()
    served = tried = 0
    statuses: Counter = Counter()
    t_end = time.monotonic() + seconds
    k = 0
    while time.monotonic() < t_end:
        k += 1
        if k % 3 == 0:
            case = Case(
                cat,
                "real request: POST completions",
                t.post(ROUTES["completions"], simple_bodies(t.model)["completions"]),
                timeout=30,
            )
        else:
            case = Case(
                cat,
                f"real request: GET {'/health' if k % 3 == 1 else '/v1/models'}",
                t.get("/health" if k % 3 == 1 else "/v1/models"),
                timeout=30,
            )
        r = exchange(t.addr, case.data, case.timeout)
        tally.add(case, r)
        tried += 1
        served += r.outcome == "2xx"
        statuses[r.status or r.outcome] += 1
        time.sleep(0.25)
    stop.set()
    th.join(5)
    for key in list(sel.get_map().values()):
        key.fileobj.close()
    sel.close()
    if served < tried:
        with tally.lock:
            tally.violations.append(
                f"[{cat}] {tried - served} of {tried} real requests not served while {n} idle connections "
                f"were held ({dict(statuses)})"
            )
    return {
        "idle": n,
        "opened": opened,
        "reopened": reopened,
        "connect_failed": refused,
        "real_requests": tried,
        "served": served,
        "statuses": {str(k): v for k, v in statuses.items()},
    }


def concurrent_count_tokens(tally: Tally, t: Target) -> None:
    """Three 5 MB count_tokens at once: each must be refused (a prompt that cannot fit), not tokenized."""
    text = "word " * 1_000_000
    case = Case(
        "over_context",
        "3 concurrent count_tokens of 5 MB",
        t.post(ROUTES["count_tokens"], simple_bodies(t.model, text)["count_tokens"]),
        status_in("4xx"),
        timeout=180,
    )
    with ThreadPoolExecutor(3) as ex:
        for r in ex.map(lambda _: exchange(t.addr, case.data, case.timeout), range(3)):
            tally.add(case, r)


def run_cases(tally: Tally, t: Target, cases: list[Case], workers: int) -> None:
    def one(case: Case) -> None:
        tally.add(case, exchange(t.addr, case.data, case.timeout, case.first_event, case.half_close))

    if workers <= 1:
        for c in cases:
            one(c)
        return
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(one, cases))


# ---------------------------------------------------------------------------------------------------------
# Starting servers
# ---------------------------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`fastar serve` in a subprocess on a free port; its log goes to a file, read for tracebacks at the end.
    `flags`: the serve flags before `extra` (this probe's: no prompt cache, a 512-token context, so a request that
    slips past a limit cannot run long); `launcher`: what runs `serve ...` (default `python -m fastar`); `env`: the
    child's environment (default this one's). scripts/soak.py starts its server here too."""

    def __init__(
        self,
        model: str | None,
        extra: list[str],
        log_dir: Path,
        name: str = "server",
        *,
        flags: tuple[str, ...] = ("--no-prompt-cache", "-c", "512"),
        launcher: list[str] | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.port = free_port()
        self.log = log_dir / f"{name}.log"
        cmd = launcher if launcher is not None else [sys.executable, "-m", "fastar"]
        cmd = [*cmd, "serve", "--port", str(self.port), *flags, *(["-m", model] if model else []), *extra]
        with open(self.log, "wb") as log:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 180) -> None:
        t_end = time.monotonic() + timeout
        while time.monotonic() < t_end:
            if self.proc.poll() is not None:
                raise SystemExit(
                    f"error: fastar serve exited with {self.proc.returncode}: {self.log.read_text()[-800:]}"
                )
            r = exchange(("127.0.0.1", self.port), request_bytes("GET", "/health", "localhost"), 5)
            if r.status == 200:
                return
            time.sleep(0.2)
        raise SystemExit(f"error: fastar serve was not ready within {timeout:.0f} s")

    def rss_mb(self) -> float | None:
        try:
            for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
        except OSError:
            return None
        return None

    def stop(self, wait: float = 20) -> list[str]:
        """Stop the server (SIGTERM, then SIGKILL after `wait` seconds); the tracebacks its log holds, one line each
        (the exception's last line). SIGTERM, not SIGINT: a server started from a shell's background job (`&`,
        nohup) inherits SIGINT ignored, and only the SIGKILL `wait` seconds later stopped it, unflushed."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(wait)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        return log_tracebacks(self.log.read_text("utf-8", "replace"))


def log_tracebacks(text: str) -> list[str]:
    out = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("Traceback"):
            j = i + 1
            while j < len(lines) and (lines[j].startswith((" ", "\t")) or not lines[j].strip()):
                j += 1
            out.append((lines[j] if j < len(lines) else line)[:240])
    return out


# ---------------------------------------------------------------------------------------------------------
# The command line
# ---------------------------------------------------------------------------------------------------------


@dataclass
class CliRun:
    label: str
    args: list[str]
    stdin: bytes | None = None  # None: /dev/null; b"<closed>": closed
    expect: str = "error"  # "error", "ok", or "any" (no traceback either way)
    timeout: float = 90


def cli_cases(model: str, work: Path, quick: bool) -> list[CliRun]:
    """The runs; `work` holds the bad files they name (built by `cli_files`)."""
    m = ["-m", model]
    bench = ["--prompt-tokens", "4", "--decode-tokens", "2", "--repeats", "1"]
    bad = {
        name: str(work / name)
        for name in (
            "missing.fst",
            "empty.fst",
            "text.fst",
            "head.fst",
            "tail_cut.fst",
            "magic.fst",
            "header_flip.fst",
            "dir.fst",
            "ckpt_missing_shard",
            "ckpt_truncated_shard",
            "ckpt_bad_config",
            "ckpt_no_index",
        )
    }
    serve = ["serve", "--port", "0", "--no-prompt-cache"]
    runs = [
        CliRun("run: invalid UTF-8 prompt FF FE", ["run", *m, "-p", b"\xff\xfe", "-n", "2"]),
        CliRun("run: lone surrogate bytes in the prompt", ["run", *m, "-p", b"a\xed\xa0\x80b", "-n", "2"]),
        CliRun(
            "chat: a line with invalid UTF-8",
            ["chat", *m, "-n", "2", "--no-prompt-cache"],
            stdin=b"hi\xff\n",
            expect="any",
        ),
        CliRun("run --ram-budget nan", ["run", *m, "-p", "hi", "--ram-budget", "nan"]),
        CliRun("serve --prompt-cache-size inf", ["serve", "--port", "0", "--prompt-cache-size", "inf", *m]),
        CliRun("serve --api-key ''", [*serve, *m, "--api-key", ""], timeout=20),
        CliRun("bench --gpu-budget nan", ["bench", *m, *bench, "--gpu-budget", "nan"]),
    ]
    if quick:
        return runs
    for cmd in ("run", "bench", "serve", "chat"):
        for flag in ("--ram-budget", "--gpu-budget"):
            for value in ("nan", "inf", "-1", "1e400G"):
                if (cmd, flag, value) in (("run", "--ram-budget", "nan"), ("bench", "--gpu-budget", "nan")):
                    continue
                if cmd in ("serve", "chat") and value != ("inf" if flag == "--ram-budget" else "nan"):
                    continue
                extra = {
                    "run": ["-p", "hi", "-n", "1"],
                    "bench": bench,
                    "serve": ["--port", "0", "--no-prompt-cache"],
                    "chat": ["--no-prompt-cache"],
                }[cmd]
                runs.append(CliRun(f"{cmd} {flag} {value!r}", [cmd, *m, *extra, flag, value], timeout=60))
    for value in ("nan", "-1", "1e400", ""):
        runs.append(
            CliRun(
                f"serve --prompt-cache-size {value!r}",
                ["serve", "--port", "0", "--prompt-cache-size", value, *m],
                timeout=60,
            )
        )
    runs += [
        CliRun("chat --prompt-cache-size inf", ["chat", *m, "--prompt-cache-size", "inf"]),
        CliRun("run: empty prompt", ["run", *m, "-p", "", "-n", "1"], expect="any"),
        CliRun(
            "run: control tokens in the prompt",
            ["run", *m, "-p", "<｜end▁of▁sentence｜><｜User｜>x", "-n", "1"],
            expect="ok",
        ),
        CliRun("run: escaped-looking surrogate text", ["run", *m, "-p", "\\ud800", "-n", "1"], expect="ok"),
        CliRun("run -n 10^12", ["run", *m, "-p", "hi", "-c", "32", "-n", "1000000000000"], expect="any"),
        CliRun("run --temp nan", ["run", *m, "-p", "hi", "--temp", "nan"]),
        CliRun("run --temp inf", ["run", *m, "-p", "hi", "--temp", "inf"]),
        CliRun("run --top-p nan", ["run", *m, "-p", "hi", "--top-p", "nan"]),
        CliRun("run --seed -1", ["run", *m, "-p", "hi", "--seed", "-1", "-n", "1"], expect="any"),
        CliRun("run -c 0", ["run", *m, "-p", "hi", "-c", "0", "-n", "1"], expect="any"),
        CliRun("run -c 10^12", ["run", *m, "-p", "hi", "-c", "1000000000000", "-n", "1"], expect="any"),
        CliRun("run --threads 0", ["run", *m, "-p", "hi", "--threads", "0", "-n", "1"], expect="any"),
        CliRun("run --device bogus", ["run", *m, "-p", "hi", "--device", "bogus"]),
        CliRun("run --device cuda:99", ["run", *m, "-p", "hi", "--device", "cuda:99"]),
        CliRun("run: closed stdout", ["run", *m, "-p", "hi", "-n", "1", ">&-"]),
        CliRun("run: prompt from closed stdin", ["run", *m, "-n", "1"], stdin=b"<closed>"),
        CliRun("run: prompt from invalid UTF-8 stdin", ["run", *m, "-n", "1"], stdin=b"\xff\xfe\xed\xa0\x80\n"),
        CliRun("chat: closed stdin", ["chat", *m, "--no-prompt-cache"], stdin=b"<closed>"),
        CliRun("chat: empty stdin", ["chat", *m, "--no-prompt-cache"], stdin=b"", expect="ok"),
        CliRun(
            "chat: binary stdin",
            ["chat", *m, "-n", "1", "--no-prompt-cache"],
            stdin=bytes(range(256)) + b"\n",
            expect="any",
        ),
        CliRun(
            "chat: lone surrogate bytes on stdin",
            ["chat", *m, "-n", "1", "--no-prompt-cache"],
            stdin=b"a\xed\xa0\x80b\n",
            expect="any",
        ),
        CliRun(
            "chat: a 1 MB line",
            ["chat", *m, "-n", "1", "--no-prompt-cache"],
            stdin=b"w " * 500_000 + b"\n",
            expect="any",
            timeout=120,
        ),
        CliRun(
            "chat: control tokens on stdin",
            ["chat", *m, "-n", "1", "--no-prompt-cache"],
            stdin="<｜end▁of▁sentence｜><｜User｜>x\n".encode(),
            expect="ok",
        ),
        CliRun("serve --api-key ' '", [*serve, *m, "--api-key", " "], expect="any", timeout=30),
        CliRun("serve --port 65536", ["serve", "--port", "65536", *m]),
        CliRun("serve --max-connections 0", [*serve, *m, "--max-connections", "0"]),
        CliRun("serve --max-batch 0", [*serve, *m, "--max-batch", "0"]),
        CliRun("serve --host bogus..name", [*serve, *m, "--host", "bogus..name"]),
        CliRun("serve --prompt-cache on a file", ["serve", "--port", "0", *m, "--prompt-cache", model]),
        CliRun("bench --streams 0", ["bench", *m, *bench, "--streams", "0"]),
        CliRun("bench --streams a,b", ["bench", *m, *bench, "--streams", "a,b"]),
        CliRun("bench --decode-tokens -1", ["bench", *m, "--decode-tokens", "-1"]),
        CliRun("export --shard-size nan", ["export", model, "-o", str(work / "exported"), "--shard-size", "nan"]),
        CliRun("export --shard-size inf", ["export", model, "-o", str(work / "exported2"), "--shard-size", "inf"]),
    ]
    for name in (
        "missing.fst",
        "empty.fst",
        "text.fst",
        "head.fst",
        "tail_cut.fst",
        "magic.fst",
        "header_flip.fst",
        "dir.fst",
    ):
        runs.append(CliRun(f"run -m {name}", ["run", "-m", bad[name], "-p", "hi", "-n", "1"]))
        runs.append(CliRun(f"verify {name}", ["verify", bad[name]]))
        if name in ("head.fst", "magic.fst", "header_flip.fst", "dir.fst"):
            runs.append(CliRun(f"inspect {name}", ["inspect", bad[name]]))
    for name in ("tail_cut.fst", "header_flip.fst"):
        runs.append(CliRun(f"bench -m {name}", ["bench", "-m", bad[name], *bench]))
        runs.append(CliRun(f"serve -m {name}", [*serve, "-m", bad[name]], timeout=60))
        runs.append(CliRun(f"chat -m {name}", ["chat", "-m", bad[name], "--no-prompt-cache"]))
    for name in ("ckpt_missing_shard", "ckpt_truncated_shard", "ckpt_bad_config", "ckpt_no_index"):
        runs.append(CliRun(f"convert {name}", ["convert", bad[name], "-o", str(work / f"{name}.out.fst")], timeout=120))
        runs.append(CliRun(f"run -m {name} (a folder)", ["run", "-m", bad[name], "-p", "hi", "-n", "1"], timeout=120))
    runs.append(CliRun("serve -m ckpt_missing_shard", [*serve, "-m", bad["ckpt_missing_shard"]], timeout=120))
    runs.append(
        CliRun("convert to an existing folder", ["convert", bad["ckpt_bad_config"], "-o", str(work)], timeout=60)
    )
    self_shard = str(next((work / "ckpt_self").glob("*.safetensors")))
    runs += [
        CliRun("convert over one of its own shards", ["convert", str(work / "ckpt_self"), "-o", self_shard]),
        CliRun("convert -o under a regular file", ["convert", str(work / "ckpt"), "-o", str(work / "text.fst" / "x")]),
        CliRun(
            "convert: a shard that is a FIFO", ["convert", str(work / "ckpt_fifo_shard"), "-o", str(work / "f.fst")]
        ),
        CliRun("run -m a folder whose shard is a FIFO", ["run", "-m", str(work / "ckpt_fifo_shard"), "-p", "hi"]),
        CliRun("export a FIFO", ["export", str(work / "fifo.fst"), "-o", str(work / "exported_fifo")], timeout=30),
        CliRun("run --stop ''", ["run", *m, "-p", "hi", "--stop", ""]),
        CliRun(
            "perplexity --save-logits under a regular file",
            ["perplexity", *m, str(work / "text.fst"), "--save-logits", str(work / "text.fst" / "x")],
        ),
    ]
    return runs


def cli_files(model: str, work: Path, quick: bool) -> None:
    """The bad model files and checkpoint folders the full CLI table names."""
    if quick:
        return
    src = Path(model)
    (work / "empty.fst").write_bytes(b"")
    (work / "text.fst").write_text("this is not a model\n")
    with open(src, "rb") as f:
        (work / "head.fst").write_bytes(f.read(4096))
    shutil.copyfile(src, work / "tail_cut.fst")
    os.truncate(work / "tail_cut.fst", src.stat().st_size - (1 << 20))
    shutil.copyfile(src, work / "magic.fst")
    with open(work / "magic.fst", "r+b") as f:
        f.write(b"XXXX")
    shutil.copyfile(src, work / "header_flip.fst")
    with open(work / "header_flip.fst", "r+b") as f:
        f.seek(64)
        f.write(bytes(random.Random(0).randrange(256) for _ in range(200)))
    (work / "dir.fst").mkdir()
    from fastar.fixtures import write_checkpoint

    ckpt = write_checkpoint(work / "ckpt", "tiny", seed=0)
    shards = sorted(ckpt.glob("*.safetensors"))
    for name in ("ckpt_missing_shard", "ckpt_truncated_shard", "ckpt_bad_config", "ckpt_no_index"):
        shutil.copytree(ckpt, work / name)
    (work / "ckpt_missing_shard" / shards[-1].name).unlink()
    os.truncate(work / "ckpt_truncated_shard" / shards[0].name, shards[0].stat().st_size // 2)
    (work / "ckpt_bad_config" / "config.json").write_text('{"hidden_size": "big", ')
    for p in (work / "ckpt_no_index").glob("*.index.json"):
        p.unlink()
    shutil.copytree(ckpt, work / "ckpt_self")  # a conversion told to write over its own shard
    shutil.copytree(ckpt, work / "ckpt_fifo_shard")
    (work / "ckpt_fifo_shard" / shards[0].name).unlink()
    os.mkfifo(work / "ckpt_fifo_shard" / shards[0].name)  # an open would wait for a writer forever
    os.mkfifo(work / "fifo.fst")


def run_cli(run: CliRun, env: dict[str, str]) -> dict:
    args = [a for a in run.args if a != ">&-"]
    stdin: int | None = subprocess.DEVNULL
    kw: dict = {}
    cmd: list[str | bytes] = [sys.executable, "-m", "fastar", *args]
    if run.stdin == b"<closed>" or ">&-" in run.args:
        # a closed descriptor, as the shell's `<&-` / `>&-` leaves it
        which = "0" if run.stdin == b"<closed>" else "1"
        quoted = " ".join(
            "'" + (a.decode("latin-1") if isinstance(a, bytes) else a).replace("'", "'\\''") + "'" for a in cmd
        )
        script = f"exec {quoted} {'<&-' if which == '0' else '>&-'}"
        cmd, stdin = ["bash", "-c", script.encode("latin-1")], subprocess.DEVNULL
    elif run.stdin is not None:
        stdin, kw = subprocess.PIPE, {"input": run.stdin}
    t0 = time.monotonic()
    try:
        p = subprocess.Popen(
            cmd, stdin=stdin, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, start_new_session=True
        )
        out, err = p.communicate(kw.get("input"), timeout=run.timeout)
        rc: int | None = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        rc = None
    text = err.decode("utf-8", "replace")
    lines = [ln for ln in text.splitlines() if ln.strip()]
    last = lines[-1] if lines else ""
    if "Traceback" in text or b"Traceback" in out:
        kind = "traceback"
    elif rc is None:
        kind = "timeout"
    elif rc == 0:
        kind = "ok"
    elif rc in (1, 2) and re.match(r"^fastar[\w -]*: error: \S", last):
        kind = "clean"
    else:
        kind = "messy"
    expected = {"error": ("clean",), "ok": ("ok", "serving"), "any": ("ok", "serving", "clean")}[run.expect]
    if rc is None and args[0] == "serve" and kind == "timeout":
        kind = "serving"  # still serving at the timeout: it took the arguments
    return {
        "label": run.label,
        "kind": kind,
        "rc": rc,
        "seconds": round(time.monotonic() - t0, 1),
        "ok": kind in expected,
        "expected": run.expect,
        "last_line": last[-300:],
        "traceback": _last_exception(text) if kind == "traceback" else None,
    }


def _last_exception(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith((" ", "\t"))]
    return lines[-1][:300] if lines else ""


def cli_probe(model: str, quick: bool, workers: int) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="hostile-cli-") as tmp:
        work = Path(tmp)
        cli_files(model, work, quick)
        env = {**os.environ, "FASTAR_PROMPT_CACHE": str(work / "prompt-cache"), "PYTHONIOENCODING": "utf-8"}
        runs = cli_cases(model, work, quick)
        with ThreadPoolExecutor(workers) as ex:
            return list(ex.map(lambda r: run_cli(r, env), runs))


# ---------------------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------------------


def report(tally: Tally, idle: dict | None, cli: list[dict], log_tbs: list[str], extra: dict) -> tuple[bool, dict]:
    print(f"\n{'category':<18}" + "".join(f"{k:>8}" for k in ("tried", *OUTCOMES)))
    for cat, c in tally.counts.items():
        print(f"{cat:<18}" + "".join(f"{c.get(k, 0):>8}" for k in ("tried", *OUTCOMES)))
    tot = tally.totals()
    print(f"{'all':<18}" + "".join(f"{tot.get(k, 0):>8}" for k in ("tried", *OUTCOMES)))
    if by_status := {k: v for k, v in tot.items() if k.isdigit()}:
        print(f"5xx by status: {by_status}")

    def listing(title: str, items: list[str], n: int = 40) -> None:
        if items:
            print(f"\n{title} ({len(items)}):")
            for s in items[:n]:
                print("  " + s)
            if len(items) > n:
                print(f"  ... and {len(items) - n} more")

    listing("5xx answers", tally.five_xx)
    listing("bodies holding a traceback", tally.tracebacks)
    listing("tracebacks in the server log", log_tbs)
    listing("broken expectations", tally.violations)
    listing("resets, timeouts, connections closed without an answer", tally.resets, 20)
    listing("slowest answers", [f"{sec:6.2f} s {what}" for sec, what in tally.slowest])
    if idle:
        print(f"\nidle connections: {idle}")
    cli_counts = Counter(r["kind"] for r in cli)
    if cli:
        print(
            f"\nCLI runs: {len(cli)} -> "
            + ", ".join(
                f"{k} {cli_counts.get(k, 0)}" for k in ("ok", "serving", "clean", "messy", "traceback", "timeout")
            )
        )
        listing("CLI tracebacks", [f"{r['label']}: {r['traceback']}" for r in cli if r["kind"] == "traceback"])
        listing(
            "CLI runs not as expected",
            [
                f"{r['label']}: {r['kind']} (rc {r['rc']}, wanted {r['expected']}): {r['last_line']}"
                for r in cli
                if not r["ok"] and r["kind"] != "traceback"
            ],
        )
    for k, v in extra.items():
        print(f"{k}: {v}")
    idle_ok = idle is None or idle["served"] == idle["real_requests"]
    cli_bad = [r for r in cli if not r["ok"]]
    passed = (
        not tally.five_xx and not tally.tracebacks and not log_tbs and not tally.violations and not cli_bad and idle_ok
    )
    summary = {
        "requests": {k: tot.get(k, 0) for k in ("tried", *OUTCOMES)},
        "five_xx_by_status": {k: v for k, v in tot.items() if k.isdigit()},
        "categories": {cat: dict(c) for cat, c in tally.counts.items()},
        "five_xx": tally.five_xx,
        "body_tracebacks": tally.tracebacks,
        "log_tracebacks": log_tbs,
        "violations": tally.violations,
        "resets": tally.resets,
        "idle": idle,
        "cli": {
            "runs": len(cli),
            **{k: cli_counts.get(k, 0) for k in ("ok", "serving", "clean", "messy", "traceback", "timeout")},
        },
        "cli_runs": cli,
        "passed": passed,
        **extra,
    }
    idle_txt = (
        f"idle connections: {idle['served']}/{idle['real_requests']} real requests served"
        if idle
        else "idle connections: not run"
    )
    cli_txt = (
        f"{len(cli)} CLI runs -> {cli_counts.get('clean', 0)} clean errors / {cli_counts.get('ok', 0)} ok / "
        f"{cli_counts.get('traceback', 0)} tracebacks / {len(cli_bad)} not as expected"
    )
    print(
        f"\nVERDICT: {'PASS' if passed else 'FAIL'}: {tot.get('tried', 0)} requests -> {tot.get('2xx', 0)} 2xx / "
        f"{tot.get('4xx', 0)} 4xx / {tot.get('5xx', 0)} 5xx ({tot.get('500', 0)} x 500, {len(tally.five_xx)} not "
        f"expected) / {tot.get('reset', 0)} resets / {tot.get('timeout', 0)} "
        f"timeouts; {len(tally.tracebacks) + len(log_tbs)} tracebacks (bodies + log); {len(tally.violations)} broken "
        f"expectations; {idle_txt}; {cli_txt}"
    )
    return passed, summary


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", default=None, help=".fst to serve (default: the built-in demo model)")
    ap.add_argument("--url", default=None, help="probe a running server instead (http://HOST:PORT); no auth category")
    ap.add_argument("--quick", action="store_true", help="a few hundred requests and the CLI runs of issue 32, for CI")
    ap.add_argument("--no-cli", action="store_true", help="skip the CLI runs")
    ap.add_argument("--no-http", action="store_true", help="skip the HTTP requests")
    ap.add_argument("--workers", type=int, default=3, help="requests in flight at once (default 3)")
    ap.add_argument("--idle-connections", type=int, default=130, help="idle connections held (default 130)")
    ap.add_argument("--idle-seconds", type=float, default=None, help="how long (default 25 s; --quick 4 s)")
    ap.add_argument("--mutations", type=int, default=None, help="random mutations (default 1,500; --quick 60)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", default=None, metavar="OUT", help="write the counts and lists as JSON")
    a = ap.parse_args(argv)
    rng = random.Random(a.seed)
    quick = a.quick
    model = a.model
    if model is None and not (a.url and a.no_cli):
        from fastar.demo import ensure_demo_model

        model = str(ensure_demo_model(log=lambda s: print(s, file=sys.stderr)))
    tally = Tally()
    idle = None
    log_tbs: list[str] = []
    extra: dict = {}
    t_start = time.monotonic()
    cli_pool = ThreadPoolExecutor(1)  # the CLI runs go on beside the requests: most of their time is loading
    cli_future = None if a.no_cli else cli_pool.submit(cli_probe, model, quick, 2)
    if not a.no_http:
        tmp = Path(tempfile.mkdtemp(prefix="hostile-http-"))
        servers: list[ServerProcess] = []
        try:
            if a.url:
                u = urlsplit(a.url)
                target = Target(u.hostname or "127.0.0.1", u.port or 80)
            else:
                servers.append(ServerProcess(model, [], tmp))
                servers[0].wait_ready()
                target = Target("127.0.0.1", servers[0].port)
            models = exchange(target.addr, target.get("/v1/models"), 10)
            try:
                target.model = json.loads(models.body)["data"][0]["id"]
            except (ValueError, KeyError, IndexError):
                pass
            key = "probe-key-" + str(rng.randrange(10**9))
            if not a.url:
                servers.append(ServerProcess(model, ["--api-key", key], tmp, "server-auth"))
            steps: list[tuple[str, Callable[[], None]]] = [
                ("baseline", lambda: run_cases(tally, target, cases_baseline(target), 1)),
                ("malformed_json", lambda: run_cases(tally, target, cases_malformed_json(target, quick), a.workers)),
                ("wrong_types", lambda: run_cases(tally, target, cases_wrong_types(target, rng, quick), a.workers)),
                ("huge_nested", lambda: run_cases(tally, target, cases_huge_nested(target, quick), 1)),
                ("bad_unicode", lambda: run_cases(tally, target, cases_bad_unicode(target, quick), a.workers)),
                ("over_context", lambda: run_cases(tally, target, cases_over_context(target, quick), 1)),
                ("static_files", lambda: run_cases(tally, target, cases_static(target), a.workers)),
                ("framing", lambda: run_cases(tally, target, cases_framing(target), a.workers)),
                ("absolute_form", lambda: run_cases(tally, target, cases_absolute_form(target), 1)),
                ("bad_host", lambda: run_cases(tally, target, cases_bad_host(target), a.workers)),
                ("special_tokens", lambda: special_token_cases(tally, target, quick)),
                ("methods_paths", lambda: run_cases(tally, target, cases_methods_paths(target), a.workers)),
                ("streams", lambda: run_cases(tally, target, cases_streams(target), 1)),
                (
                    "mutations",
                    lambda: run_cases(
                        tally, target, cases_mutations(target, rng, a.mutations or (60 if quick else 1500)), a.workers
                    ),
                ),
            ]
            if not quick:
                steps.append(("over_context", lambda: concurrent_count_tokens(tally, target)))
            if len(servers) == 2:
                auth = Target("127.0.0.1", servers[1].port, target.model)

                def auth_step() -> None:
                    servers[1].wait_ready()
                    cases = cases_auth(auth, key)
                    run_cases(tally, auth, cases if not quick else cases[::4], a.workers)

                steps.append(("auth", auth_step))
            for name, step in steps:
                t0 = time.monotonic()
                step()
                print(f"{name}: done in {time.monotonic() - t0:.1f} s", file=sys.stderr, flush=True)
            seconds = a.idle_seconds if a.idle_seconds is not None else (4.0 if quick else 25.0)
            idle = idle_connections(tally, target, a.idle_connections, seconds)
            after = exchange(target.addr, target.get("/health"), 30)
            if after.status != 200:
                tally.violations.append(f"[final] /health after the probe: {after.status or after.outcome}")
            if servers:
                extra["server_rss_mb_after"] = servers[0].rss_mb()
        finally:
            for s in servers:
                log_tbs += s.stop()
            shutil.rmtree(tmp, ignore_errors=True)
    cli: list[dict] = [] if cli_future is None else cli_future.result()
    cli_pool.shutdown()
    extra["seconds"] = round(time.monotonic() - t_start, 1)
    passed, summary = report(tally, idle, cli, log_tbs, extra)
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1, default=str))
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
