"""The HTTP front-end: OpenAI-compatible API, metrics and the web UI over one engine.

Owns:
  * `Server`: binds a `ThreadingHTTPServer`, loads the engine in the background (`/health` answers 503 with the
    load progress meanwhile) and runs the one worker thread that owns the engine. Handler threads only parse,
    validate, tokenize and enqueue; they never call the model. Usable from tests: port 0, `.port`, `.shutdown()`.
  * `serve()`, `add_arguments()`, `run_from_args()`: what `fastar serve` delegates to.
  * Client disconnects: a failed write (or a closed socket seen while waiting) sets the job's cancel event; the
    worker stops at the next token.
  * Static files of the web UI, served only from `static/`: traversal, encoded traversal and symlinks that leave
    the folder all answer 404.

Does not own: request/response shapes and stop strings (`fastar.serve.protocol`), the prefix cache pool and
metrics (`fastar.serve.worker`), or anything with tensors. Never imports torch.
"""
from __future__ import annotations

import argparse
import base64
import binascii
import hmac
import json
import logging
import queue
import re
import select
import socket
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

from fastar.errors import FastarError
from fastar.serve import protocol as P
from fastar.serve.worker import EngineHost, Job, Metrics

log = logging.getLogger("fastar.serve")

STATIC_DIR = Path(__file__).resolve().parent / "static"
REASONING_FIELDS = ("reasoning_content", "reasoning")
# A 1M-token prompt is ~4 MB of text; JSON escaping and a long tool history fit well inside this.
DEFAULT_MAX_BODY = 32 * 1024 * 1024
_UI_HEADERS = {
    # Model output is rendered as HTML by the UI; the CSP is the second wall behind its escaping.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
# Fixed, not mimetypes: the system's table may lack or mislabel .js, and module scripts need a JS type.
_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
                  ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml", ".png": "image/png",
                  ".ico": "image/x-icon", ".json": "application/json", ".txt": "text/plain; charset=utf-8"}
_TOKEN_LIST = re.compile(r"^[A-Za-z0-9_\-, ]*$")


class ClientGone(Exception):
    """The client closed its connection; its generation has been cancelled."""


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True   # a stuck client never blocks shutdown
    app: Server


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"   # keep-alive: the openai client reuses connections
    server_version = "fastar"
    timeout = 600                   # idle keep-alive connections and stalled readers are dropped after this
    server: _HTTPServer

    # ---- plumbing ---------------------------------------------------------------------------------------

    @property
    def app(self) -> Server:
        return self.server.app

    def log_message(self, format: str, *args: Any) -> None:
        log.info("%s %s", self.address_string(), format % args)

    def _cors_headers(self) -> dict[str, str]:
        headers = getattr(self, "headers", None)  # absent when the request line itself was malformed
        origin = headers.get("Origin") if headers is not None else None
        allowed = self.app.cors_origins
        if not origin or not allowed:
            return {}
        if "*" in allowed:
            return {"Access-Control-Allow-Origin": "*"}
        return {"Access-Control-Allow-Origin": origin, "Vary": "Origin"} if origin in allowed else {}

    def _send(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        for key, value in {**self._cors_headers(), **(headers or {})}.items():
            self.send_header(key, value)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _send_json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
        self._send(status, json.dumps(obj).encode(), "application/json", headers)

    def _send_error(self, err: P.APIError, headers: dict[str, str] | None = None) -> None:
        self.app.metrics.error(err.status)
        self._send_json(err.status, err.to_dict(), headers)

    def _write(self, data: bytes, job: Job | None = None) -> None:
        """One chunk of a chunked response; a dead client cancels its job."""
        try:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        except (OSError, ValueError):  # BrokenPipe, ConnectionReset, timeouts, a closed wfile
            if job is not None:
                job.cancel.set()
            raise ClientGone from None

    def _start_sse(self, job: Job) -> None:
        self.send_response(200)
        for key, value in {"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache",
                           "Transfer-Encoding": "chunked", "X-Accel-Buffering": "no",
                           **self._cors_headers()}.items():
            self.send_header(key, value)
        self._streaming = True
        try:
            self.end_headers()
        except OSError:
            job.cancel.set()
            raise ClientGone from None

    def _end_sse(self, job: Job) -> None:
        self._write(P.SSE_DONE, job)
        self._write(b"", job)  # the zero-length chunk ends the chunked body

    def _client_gone(self) -> bool:
        """True when the peer has closed: the socket reads as EOF (pipelined bytes do not count)."""
        try:
            poller = select.poll()  # not select(): no FD_SETSIZE limit on busy servers
            poller.register(self.connection, select.POLLIN | select.POLLERR | select.POLLHUP)
            return bool(poller.poll(0)) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    # ---- dispatch ---------------------------------------------------------------------------------------

    def _authorized(self) -> bool:
        key = self.app.api_key
        if not key:
            return True
        header = self.headers.get("Authorization", "")
        scheme, _, value = header.partition(" ")
        token = value.strip()
        if scheme.lower() == "basic":
            # Browsers cannot attach a Bearer header to page loads; the UI is reached with Basic auth, the
            # key as the password, and the browser then sends the same credentials on the UI's API calls.
            try:
                token = base64.b64decode(token, validate=True).decode().partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                return False
        elif scheme.lower() != "bearer":
            token = self.headers.get("X-Api-Key", "")
        return hmac.compare_digest(token.encode(), key.encode())

    def _route(self, method: str) -> None:
        path = urlsplit(self.path).path
        api_path = path.rstrip("/") or "/"
        is_ui = method == "GET" and not (api_path.startswith("/v1/") or api_path in _API_GET)
        if api_path not in _PUBLIC and not self._authorized():
            scheme = 'Basic realm="fastar", charset="UTF-8"' if is_ui else "Bearer"
            # "Connection: close": the body stays unread, so it must not be taken for the next request.
            return self._send_error(P.APIError(401, "Invalid or missing API key (send 'Authorization: Bearer "
                                                    "<key>')", "invalid_request_error", None, "invalid_api_key"),
                                    {"WWW-Authenticate": scheme, "Connection": "close"})
        if method == "POST":
            self._raw = self._read_body()  # read before routing, so no answer leaves a body unread
        routes = _API_POST if method == "POST" else _API_GET
        name = routes.get(api_path)
        if name is not None:
            return getattr(self, name)()
        other = _API_GET if method == "POST" else _API_POST
        if api_path in other:
            err = P.APIError(405, f"{method} is not allowed on {api_path}", code="method_not_allowed")
            return self._send_error(err, {"Allow": "GET" if method == "POST" else "POST"})
        if method == "GET":
            return self._static(path)
        self._send_error(P.APIError(404, f"no route {method} {api_path}", code="not_found"))

    def do_GET(self) -> None:
        self._handle("GET")

    def do_HEAD(self) -> None:
        self._handle("GET")

    def do_POST(self) -> None:
        self._handle("POST")

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own errors (malformed request line, oversized headers) in the OpenAI JSON shape."""
        self.close_connection = True
        err = P.APIError(code, message or explain or "bad request", code="bad_http_request")
        try:
            self._send_json(code, err.to_dict(), {"Connection": "close"})
        except OSError:
            pass

    def _handle(self, method: str) -> None:
        self._streaming = False
        try:
            self._route(method)
        except ClientGone:
            self.close_connection = True
        except P.APIError as err:
            self._send_error(err, {"Connection": "close"} if self.close_connection else None)
        except (BrokenPipeError, ConnectionResetError):
            self.close_connection = True
        except Exception:
            log.exception("unhandled error in %s %s", method, self.path)
            if self._streaming:  # headers are out: an error body would corrupt the stream; just hang up
                self.close_connection = True
                return
            try:
                self._send_error(P.APIError(500, "internal server error", "server_error"), {"Connection": "close"})
            except OSError:
                self.close_connection = True

    def do_OPTIONS(self) -> None:
        """CORS preflight: answered without auth (browsers never send credentials on it)."""
        origin = self.headers.get("Origin")
        if origin and self.headers.get("Access-Control-Request-Method"):
            cors = self._cors_headers()
            if not cors:
                return self._send_error(P.APIError(403, f"origin {origin} is not allowed", code="cors_forbidden"))
            requested = self.headers.get("Access-Control-Request-Headers", "")
            allow_headers = requested if _TOKEN_LIST.match(requested) and requested else "Authorization, Content-Type"
            return self._send(204, b"", "text/plain", {
                "Access-Control-Allow-Methods": "GET, POST, OPTIONS",
                "Access-Control-Allow-Headers": allow_headers, "Access-Control-Max-Age": "600"})
        self._send(204, b"", "text/plain", {"Allow": "GET, POST, OPTIONS"})

    def _read_body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            self.close_connection = True
            raise P.APIError(411, "chunked request bodies are not supported; send Content-Length",
                             code="length_required")
        try:
            length = int(self.headers.get("Content-Length", "0"))
        except ValueError:
            self.close_connection = True
            raise P.bad_request("invalid Content-Length header") from None
        if length > self.app.max_body_bytes:
            self.close_connection = True  # the body stays unread
            raise P.APIError(413, f"request body of {length} bytes exceeds the limit of {self.app.max_body_bytes}",
                             code="request_too_large")
        return self.rfile.read(length) if length > 0 else b""

    def _body(self) -> Any:
        try:
            return json.loads(self._raw)
        except (UnicodeDecodeError, ValueError) as err:
            raise P.bad_request(f"the request body is not valid JSON: {err}", code="invalid_json") from None

    # ---- routes -----------------------------------------------------------------------------------------

    def _health(self) -> None:
        host = self.app.host
        if host.error is not None:
            return self._send_json(500, {**P.APIError(500, f"model failed to load: {host.error}", "server_error",
                                                      code="model_load_failed").to_dict(), "status": "error"})
        if not host.ready.is_set():
            progress = host.progress()
            err = P.APIError(503, f"model is loading ({progress:.0%})", "unavailable_error", code="model_loading")
            return self._send_json(503, {**err.to_dict(), "status": "loading", "progress": round(progress, 4)})
        self._send_json(200, {"status": "ok"})

    def _engine(self) -> Any:
        return self.app.host.require_engine()

    def _models(self) -> None:
        engine = self._engine()
        ctx = engine.context_length
        self._send_json(200, {"object": "list", "data": [{
            "id": self.app.model_names[0], "object": "model", "created": self.app.started, "owned_by": "fastar",
            "root": getattr(engine, "model_name_default", self.app.model_names[0]),
            "max_model_len": ctx, "context_length": ctx}]})

    def _metrics(self) -> None:
        text = self.app.metrics.render(self.app.host)
        self._send(200, text.encode(), "text/plain; version=0.0.4; charset=utf-8")

    def _tokenize(self) -> None:
        body = self._body()
        engine = self._engine()
        if not isinstance(body, dict):
            raise P.bad_request("the request body must be a JSON object")
        if "messages" in body:
            req = P.parse_chat_request({**body, "model": None}, self.app.model_names, self.app.default_thinking)
            ids = self._encode_chat(engine, req)
        else:
            text = body.get("prompt", body.get("content"))
            if not isinstance(text, str):
                raise P.bad_request("'prompt' (or 'content') must be a string, or send 'messages'", "prompt")
            ids = engine.tokenizer.encode(text)
        self._send_json(200, {"tokens": ids, "count": len(ids), "max_model_len": engine.context_length})

    def _detokenize(self) -> None:
        body = self._body()
        engine = self._engine()
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise P.bad_request("'tokens' must be a list of integers", "tokens")
        P.check_token_ids(tokens, getattr(engine.tokenizer, "vocab_size", None), "tokens")
        text = engine.tokenizer.decode(tokens)
        self._send_json(200, {"prompt": text, "content": text})

    def _encode_chat(self, engine: Any, req: P.ChatRequest) -> list[int]:
        try:
            return list(engine.tokenizer.encode_chat(
                req.messages, thinking_mode="thinking" if req.thinking else "chat",
                drop_thinking=req.drop_thinking, reasoning_effort=req.reasoning_effort))
        except (ValueError, TypeError) as err:  # EncodingError is a ValueError
            raise P.bad_request(str(err), "messages") from None

    def _submit(self, engine: Any, prompt_ids: list[int], sampling: dict, max_tokens: int | None) -> tuple[Job, int]:
        limit = P.resolve_max_tokens(len(prompt_ids), max_tokens, engine.context_length,
                                      getattr(engine, "context_note", None))
        job = Job(prompt_ids, P.make_sampling_params(sampling, limit))
        self.app.host.submit(job)
        return job, limit

    def _chat(self) -> None:
        body = self._body()
        req = P.parse_chat_request(body, self.app.model_names, self.app.default_thinking)
        engine = self._engine()
        prompt_ids = self._encode_chat(engine, req)
        job, limit = self._submit(engine, prompt_ids, req.sampling, req.max_tokens)
        try:
            self._chat_reply(req, engine, job, limit, len(prompt_ids))
        finally:
            job.cancel.set()  # whatever ended this reply (done, client gone, a bug), nobody reads the job now

    def _chat_reply(self, req: P.ChatRequest, engine: Any, job: Job, limit: int, n_prompt: int) -> None:
        turn = P.ChatTurn(req, engine.tokenizer, self.app.reasoning_field)
        rid, created = P.new_id("chatcmpl"), int(time.time())
        if not req.stream:
            cached = self._drive(job, turn, None)
            _, finish = turn.finish(limit)
            self.app.metrics.finished(finish)
            use = P.usage(n_prompt, turn.completion_tokens, cached)
            return self._send_json(200, P.chat_response(rid, req.model, turn.message(), finish, use,
                                                        turn.logprobs if req.logprobs else None))

        def emit(deltas: list) -> None:
            for delta, lp in deltas:
                self._write(P.sse(P.chat_chunk(rid, created, req.model, delta, None, lp)), job)

        self._start_sse(job)
        self._write(P.sse(P.chat_chunk(rid, created, req.model, {"role": "assistant", "content": ""})), job)
        cached = self._drive(job, turn, emit)
        if cached is _FAILED:
            return
        deltas, finish = turn.finish(limit)
        emit(deltas)
        self.app.metrics.finished(finish)
        self._write(P.sse(P.chat_chunk(rid, created, req.model, {}, finish, turn.pending.take())), job)
        if req.include_usage:
            use = P.usage(n_prompt, turn.completion_tokens, cached)
            self._write(P.sse(P.usage_chunk(rid, created, req.model, "chat.completion.chunk", use)), job)
        self._end_sse(job)

    def _completions(self) -> None:
        body = self._body()
        req = P.parse_completion_request(body, self.app.model_names)
        engine = self._engine()
        if isinstance(req.prompt, str):
            prompt_text, prompt_ids = req.prompt, list(engine.tokenizer.encode(req.prompt))
        else:
            P.check_token_ids(req.prompt, getattr(engine.tokenizer, "vocab_size", None), "prompt")
            prompt_text, prompt_ids = engine.tokenizer.decode(req.prompt), list(req.prompt)
        job, limit = self._submit(engine, prompt_ids, req.sampling, req.max_tokens)
        try:
            self._completion_reply(req, engine, job, limit, len(prompt_ids), prompt_text if req.echo else "")
        finally:
            job.cancel.set()

    def _completion_reply(self, req: P.CompletionRequest, engine: Any, job: Job, limit: int, n_prompt: int,
                          prefix: str) -> None:
        turn = P.CompletionTurn(req, engine.tokenizer, len(prefix))
        rid, created = P.new_id("cmpl"), int(time.time())
        if not req.stream:
            cached = self._drive(job, turn, None)
            _, finish = turn.finish(limit)
            self.app.metrics.finished(finish)
            use = P.usage(n_prompt, turn.completion_tokens, cached)
            return self._send_json(200, P.completion_response(rid, req.model, prefix + turn.text, finish, use,
                                                              turn.logprobs))

        def emit(pieces: list) -> None:
            for text, lp in pieces:
                self._write(P.sse(P.completion_chunk(rid, created, req.model, text, None, lp)), job)

        self._start_sse(job)
        if prefix:
            emit([(prefix, None)])
        cached = self._drive(job, turn, emit)
        if cached is _FAILED:
            return
        pieces, finish = turn.finish(limit)
        emit(pieces)
        self.app.metrics.finished(finish)
        self._write(P.sse(P.completion_chunk(rid, created, req.model, "", finish)), job)
        if req.include_usage:
            use = P.usage(n_prompt, turn.completion_tokens, cached)
            self._write(P.sse(P.usage_chunk(rid, created, req.model, "text_completion", use)), job)
        self._end_sse(job)

    def _static(self, path: str) -> None:
        full = _static_path(path)
        if full is None:
            return self._send_error(P.APIError(404, "not found", code="not_found"))
        ctype = _CONTENT_TYPES.get(full.suffix.lower(), "application/octet-stream")
        self._send(200, full.read_bytes(), ctype, _UI_HEADERS)

    def _drive(self, job: Job, turn: Any, emit: Callable[[list], None] | None) -> Any:
        """Pump the worker's events through `turn` until the job ends; returns the cached-prompt token count.

        Streaming (`emit` set): deltas go out as they come, `: keep-alive` comments fill long silences (a
        prefill of minutes), and an engine error becomes an SSE error event (then `_FAILED`). Not streaming:
        an engine error is raised as a 500. Either way a closed client cancels the job."""
        interval = self.app.keepalive_interval
        last_write = time.monotonic()
        while True:
            try:
                kind, payload = job.events.get(timeout=min(0.25, interval))
            except queue.Empty:
                if self._client_gone():
                    job.cancel.set()
                    raise ClientGone from None
                if emit is not None and time.monotonic() - last_write >= interval:
                    progress = job.progress
                    note = f"keep-alive prefill {progress[0]}/{progress[1]}" if progress else "keep-alive"
                    self._write(P.sse_comment(note), job)
                    last_write = time.monotonic()
                continue
            if kind == "chunk":
                if self._client_gone():  # a FIN is seen at once; a failed write would take a token or two more
                    job.cancel.set()
                    raise ClientGone
                deltas = turn.feed(payload)
                if turn.stopped:
                    job.cancel.set()  # our stop string: the engine need not go on
                if deltas and emit is not None:
                    emit(deltas)
                    last_write = time.monotonic()
            elif kind == "error":
                status, message = payload
                err = (P.bad_request(message) if status == 400 else
                       P.APIError(status, message, "server_error", code="generation_failed"))
                if emit is None:
                    raise err
                self.app.metrics.error(status)
                self._write(P.sse(err.to_dict()), job)
                self._end_sse(job)
                return _FAILED
            elif kind == "end":
                return payload


_FAILED = object()
_PUBLIC = ("/health", "/v1/health")   # load balancers and the UI's status dot probe these without a key
_API_GET = {"/v1/models": "_models", "/models": "_models", "/metrics": "_metrics",
            "/health": "_health", "/v1/health": "_health"}
_API_POST = {"/v1/chat/completions": "_chat", "/chat/completions": "_chat",
             "/v1/completions": "_completions", "/completions": "_completions",
             "/tokenize": "_tokenize", "/detokenize": "_detokenize"}


def _static_path(path: str) -> Path | None:
    """The file under STATIC_DIR that `path` names, or None; anything that could leave the folder is None."""
    if path in ("/", "/index.html"):
        rel = "index.html"
    elif path.startswith("/static/"):
        rel = path[len("/static/"):]
    else:
        return None
    # Decode until stable, so "%252e%252e" cannot become ".." after a later, second decoding.
    for _ in range(4):
        decoded = unquote(rel)
        if decoded == rel:
            break
        rel = decoded
    else:
        return None
    parts = rel.split("/")
    if (not rel or "\\" in rel or "\x00" in rel or ":" in rel or rel.startswith("/")
            or any(p in ("", ".", "..") for p in parts)):
        return None
    root = STATIC_DIR.resolve()
    full = (root / rel).resolve()   # resolves symlinks: one that points out of the folder fails the next check
    if not full.is_relative_to(root) or not full.is_file():
        return None
    return full


class Server:
    """The API server. `start()` binds and returns at once; the model loads in the background."""

    def __init__(self, engine_factory: Callable[..., Any], host: str = "127.0.0.1", port: int = 8080,
                 api_key: str | None = None, cors_origin: str | None = None,
                 served_model_name: str = "deepseek-v4-flash", max_queue: int = 16,
                 reasoning_field: str = "reasoning_content", max_sessions: int = 4,
                 default_thinking: bool = True, keepalive_interval: float = 5.0,
                 max_body_bytes: int = DEFAULT_MAX_BODY) -> None:
        if reasoning_field not in REASONING_FIELDS:
            raise ValueError(f"reasoning_field must be one of {REASONING_FIELDS}, got {reasoning_field!r}")
        if max_queue < 1:
            raise ValueError(f"max_queue must be at least 1, got {max_queue}")
        self.bind = (host, port)
        self.api_key = api_key or None
        self.cors_origins = tuple(o.strip().rstrip("/") for o in (cors_origin or "").split(",") if o.strip())
        self.reasoning_field = reasoning_field
        self.default_thinking = default_thinking
        self.keepalive_interval = keepalive_interval
        self.max_body_bytes = max_body_bytes
        self.metrics = Metrics()
        self.host = EngineHost(engine_factory, max_queue, max_sessions, self.metrics)
        self.model_names: tuple[str, ...] = (served_model_name,)
        self.started = int(time.time())
        self._httpd: _HTTPServer | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Server:
        httpd = _HTTPServer(self.bind, Handler)
        httpd.app = self
        self._httpd = httpd
        self._thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.2},
                                        name="fastar-http", daemon=True)
        self._thread.start()
        self.host.start(on_ready=self._on_ready)
        return self

    def _on_ready(self, engine: Any) -> None:
        default = getattr(engine, "model_name_default", None)
        if isinstance(default, str) and default not in self.model_names:
            self.model_names = (*self.model_names, default)  # accepted in requests, never listed

    @property
    def port(self) -> int:
        assert self._httpd is not None, "start() first"
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        host = self.bind[0]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the engine is loaded; raises FastarError if loading failed."""
        return self.host.wait_ready(timeout)

    def shutdown(self) -> None:
        self.host.shutdown()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


# ---------------------------------------------------------------------------------------------------------
# Command line: `fastar serve` (the lead's cli.py adds -m and the engine flags, then delegates here)
# ---------------------------------------------------------------------------------------------------------

def serve(engine_factory: Callable[..., Any], host: str = "127.0.0.1", port: int = 8080,
          api_key: str | None = None, cors_origin: str | None = None,
          served_model_name: str = "deepseek-v4-flash", max_queue: int = 16,
          reasoning_field: str = "reasoning_content", max_sessions: int = 4,
          default_thinking: bool = True) -> int:
    """Run the server until Ctrl-C. Returns 0; raises FastarError if the port is taken or the model fails to load."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    server = Server(engine_factory, host=host, port=port, api_key=api_key, cors_origin=cors_origin,
                    served_model_name=served_model_name, max_queue=max_queue, reasoning_field=reasoning_field,
                    max_sessions=max_sessions, default_thinking=default_thinking)
    try:
        server.start()
    except OSError as err:
        raise FastarError(f"cannot listen on {host}:{port}: {err.strerror or err}") from None
    log.info("serving '%s' at %s (web UI at /, API at /v1); loading the model...", served_model_name, server.url)
    if host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        log.warning("listening on %s without --api-key: anyone who can reach this port can use the model", host)
    try:
        while not server.wait_ready(timeout=1.0):
            pass
        log.info("model loaded; ready at %s", server.url)
        threading.Event().wait()
    except KeyboardInterrupt:
        log.info("shutting down")
    finally:
        server.shutdown()
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The server's flags, for `fastar serve` (the caller adds -m/--model and the engine's own flags)."""
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)")
    parser.add_argument("--port", type=int, default=8080, help="port (default 8080)")
    parser.add_argument("--api-key", default=None,
                        help="require 'Authorization: Bearer KEY' on every route but /health")
    parser.add_argument("--cors-origin", default=None,
                        help="allow browser pages from this origin (comma-separated list, or '*')")
    parser.add_argument("--served-model-name", default="deepseek-v4-flash", help="model id the API reports and accepts")
    parser.add_argument("--max-queue", type=int, default=16, help="requests that may wait; more get 503 (default 16)")
    parser.add_argument("--max-sessions", type=int, default=4,
                        help="conversations whose model state is kept for prefix reuse (default 4)")
    parser.add_argument("--reasoning-field", default="reasoning_content", choices=REASONING_FIELDS,
                        help="response field for the thinking text (default reasoning_content, as DeepSeek's API)")


def run_from_args(args: argparse.Namespace, engine_factory: Callable[..., Any]) -> int:
    return serve(engine_factory, host=args.host, port=args.port, api_key=args.api_key, cors_origin=args.cors_origin,
                 served_model_name=args.served_model_name, max_queue=args.max_queue,
                 reasoning_field=args.reasoning_field, max_sessions=args.max_sessions)
