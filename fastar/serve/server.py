"""The HTTP server: uvicorn (h11) serving the Starlette app of `fastar.serve.app` over one engine worker.

Owns:
  * `Server`: binds the socket itself (so a taken port is an error at `start()` and port 0 works for tests),
    runs uvicorn on its own thread and event loop, loads the engine in the background (`/health` answers 503
    with the load progress meanwhile) and starts the one worker thread that owns the engine. Request handlers
    only parse, validate, tokenize (off the event loop) and enqueue; they never call the model. Usable from
    tests: port 0, `.port`, `.shutdown()`. `extra_routes` and `error_shapes` mount other APIs on the same app.
  * `Limits`: the HTTP limits (listen backlog, concurrent connections, header/keep-alive/body timeouts, header
    and body sizes), documented in docs/serving.md.
  * The web UI's static files, served only from `static/`: traversal, encoded traversal and symlinks that leave
    the folder all answer 404.
  * `serve()`, `add_arguments()`, `run_from_args()`: what `fastar serve` delegates to.

Why uvicorn + Starlette: uvicorn is the well-kept ASGI server (h11 parsing of request lines and headers,
keep-alive timeouts, a real listen backlog, a connection limit, graceful shutdown); Starlette is the small
router/response layer under FastAPI, with streaming responses that notice a client leaving. FastAPI adds
pydantic models and OpenAPI pages we do not need (the OpenAI shapes are validated by hand in `openai_request`).

Does not own: routes (`fastar.serve.routes`), guards and errors (`fastar.serve.app`), request shapes
(`fastar.serve.openai_request`, `fastar.serve.shapes`), the worker (`fastar.serve.worker`),
metrics (`fastar.serve.metrics`). Never imports torch.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import re
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

import uvicorn
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from fastar.config import float_flag, int_flag
from fastar.contracts import ServedEngine
from fastar.engine.pacing import MAX_STALL
from fastar.errors import FastarError
from fastar.serve import thinking_mode
from fastar.serve.admission import Admission
from fastar.serve.agent_routes import ERROR_SHAPES, AgentRoutes
from fastar.serve.api_error import APIError
from fastar.serve.app import ErrorShape, Settings, build_app
from fastar.serve.connection import Connection, fit_connections
from fastar.serve.heap import HeapTrimmer
from fastar.serve.metrics import Metrics
from fastar.serve.routes import OpenAIRoutes
from fastar.serve.turn import ReplayCache
from fastar.serve.worker import Batching, EngineHost

log = logging.getLogger("fastar.serve")

STATIC_DIR = Path(__file__).resolve().parent / "static"
REASONING_FIELDS = ("reasoning_content", "reasoning")
# A 1M-token prompt is ~4 MB of text; JSON escaping and a long tool history fit well inside this.
DEFAULT_MAX_BODY = 32 * 1024 * 1024
_UI_HEADERS = {
    # Model output is rendered as HTML by the UI; the CSP is the second wall behind its escaping.
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Cache-Control": "no-cache",
}
# Fixed, not mimetypes: the system's table may lack or mislabel .js, and module scripts need a JS type.
_CONTENT_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
    ".json": "application/json",
    ".txt": "text/plain; charset=utf-8",
}


@dataclass(frozen=True)
class Limits:
    """HTTP limits. A connection costs a socket and a little memory on the event loop, never a thread."""

    backlog: int = 2048  # connections the kernel queues before accept(); 5 dropped clients at 16
    # Open connections. One more closes the one that has waited longest for a request head; a plain 503 only
    # when all the others have a request in flight. ~7 KB each when idle; capped by the open-file limit.
    max_connections: int = 4096
    max_requests: int = 128  # requests in flight, bodies being read included (32 MiB each at most); more get 503
    header_timeout: float = 10.0  # seconds for a request line and headers to arrive (slowloris)
    keep_alive_timeout: int = 5  # seconds an idle keep-alive connection is kept
    body_timeout: float = 60.0  # seconds for a whole request body to arrive
    max_header_bytes: int = 64 * 1024  # request line plus headers, exactly (431 beyond)
    max_body_bytes: int = DEFAULT_MAX_BODY
    graceful_shutdown: int = 5  # seconds open responses get to finish on shutdown


def _static_path(path: str) -> Path | None:
    """The file under STATIC_DIR that `path` names, or None; anything that could leave the folder is None."""
    if path in ("/", "/index.html"):
        rel = "index.html"
    elif path.startswith("/static/"):
        rel = path[len("/static/") :]
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
    if (
        not rel
        or "\\" in rel
        or "\x00" in rel
        or ":" in rel
        or rel.startswith("/")
        or any(p in ("", ".", "..") for p in parts)
    ):
        return None
    root = STATIC_DIR.resolve()
    try:
        full = (root / rel).resolve()  # resolves symlinks: one that points out of the folder fails the next check
        if not full.is_relative_to(root) or not full.is_file():
            return None
    except (OSError, ValueError):  # a name too long for the file system, a symlink loop: no such file
        return None
    return full


async def _ui(request: Request) -> Response:
    raw = request.scope.get("raw_path") or request.url.path.encode()
    full = _static_path(raw.decode("latin-1").split("?", 1)[0])
    try:
        data = full.read_bytes() if full is not None else None
    except OSError:  # removed or unreadable since it was found
        data = None
    if full is None or data is None:
        raise APIError(404, "not found", code="not_found")
    ctype = _CONTENT_TYPES.get(full.suffix.lower(), "application/octet-stream")
    return Response(data, media_type=ctype, headers=_UI_HEADERS)


UI_ROUTES: list[BaseRoute] = [Route("/", _ui), Route("/index.html", _ui), Route("/static/{rest:path}", _ui)]


class Server:
    """The API server. `start()` binds and returns at once; the model loads in the background."""

    def __init__(
        self,
        engine_factory: Callable[..., Any],
        host: str = "127.0.0.1",
        port: int = 8080,
        api_key: str | None = None,
        cors_origin: str | None = None,
        served_model_name: str = "deepseek-v4-flash",
        max_queue: int = 16,
        reasoning_field: str = "reasoning_content",
        max_sessions: int = 4,
        default_thinking: bool = True,
        reasoning_default: str | None = None,
        keepalive_interval: float = 5.0,
        max_batch: int = 8,
        prompt_cache: str | None = None,
        prompt_cache_size: int | str = "20G",
        prefill_share: float = 0.5,
        max_stall: float = MAX_STALL,
        max_body_bytes: int | None = None,
        allowed_hosts: str | Sequence[str] | None = None,
        limits: Limits | None = None,
        extra_routes: Sequence[BaseRoute] = (),
        error_shapes: dict[str, ErrorShape] | None = None,
    ) -> None:
        if reasoning_field not in REASONING_FIELDS:
            raise ValueError(f"reasoning_field must be one of {REASONING_FIELDS}, got {reasoning_field!r}")
        if reasoning_default is not None and reasoning_default not in thinking_mode.REASONING_DEFAULTS:
            raise ValueError(
                f"reasoning_default must be one of {tuple(thinking_mode.REASONING_DEFAULTS)}, got {reasoning_default!r}"
            )
        if api_key is not None and not api_key.strip():
            raise ValueError("api_key is empty: give a key, or None for no authentication")
        limits = limits or Limits()
        if max_body_bytes is not None:
            limits = Limits(**{**limits.__dict__, "max_body_bytes": max_body_bytes})
        self.limits = limits
        self.bind = (host, port)
        if isinstance(allowed_hosts, str):
            allowed_hosts = allowed_hosts.split(",")
        self.settings = Settings(
            api_key=api_key,
            cors_origins=tuple(o.strip().rstrip("/") for o in (cors_origin or "").split(",") if o.strip()),
            allowed_hosts=tuple(h.strip() for h in allowed_hosts or () if h.strip()),
            bound_host=host,
            max_body_bytes=limits.max_body_bytes,
            max_requests=limits.max_requests,
            body_timeout=limits.body_timeout,
            error_shapes={**ERROR_SHAPES, **(error_shapes or {})},
        )
        self.reasoning_field = reasoning_field
        # the thinking mode of a request that does not choose one (`--reasoning-default`; default: thinking on)
        self.default_thinking, self.default_effort = (
            (default_thinking, None)
            if reasoning_default is None
            else thinking_mode.REASONING_DEFAULTS[reasoning_default]
        )
        self.keepalive_interval = keepalive_interval
        self.metrics = Metrics()
        batching = Batching(
            max_batch, max_queue, max_sessions, prompt_cache, prompt_cache_size, prefill_share, max_stall
        )
        self.heap = HeapTrimmer()  # freed heap back to the OS: between worker steps, after a long prompt
        self.host = EngineHost(engine_factory, batching, self.metrics, self.heap)
        self.model_names: tuple[str, ...] = (served_model_name,)
        # every route's prompt checks and tokenizing
        self.admission = Admission(self.host.require_engine, heap=self.heap)
        # the ids the model holds for each recent conversation's text, shared by chat completions and the agent APIs
        self.replay = ReplayCache()
        self.started = int(time.time())
        self.app = build_app(
            self.settings,
            [*OpenAIRoutes(self).routes(), *AgentRoutes(self).routes(), *extra_routes, *UI_ROUTES],
            on_error=self.metrics.error,
        )
        self._uvicorn: uvicorn.Server | None = None
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> Server:
        host, port = self.bind
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        sock = socket.create_server((host, port), family=family, backlog=self.limits.backlog)
        connections = fit_connections(self.limits.max_connections)
        config = uvicorn.Config(
            self.app,
            http=Connection.configured(self.limits.header_timeout, self.limits.max_header_bytes, connections),
            lifespan="off",
            log_config=None,
            server_header=False,
            date_header=True,
            backlog=self.limits.backlog,
            limit_concurrency=connections + 1,  # see Connection.configured
            timeout_keep_alive=self.limits.keep_alive_timeout,
            timeout_graceful_shutdown=self.limits.graceful_shutdown,
            h11_max_incomplete_event_size=self.limits.max_header_bytes,
        )
        self._uvicorn = uvicorn.Server(config)
        self._sock = sock
        self._thread = threading.Thread(
            target=lambda: asyncio.run(self._uvicorn.serve(sockets=[sock])), name="fastar-http", daemon=True
        )
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self._uvicorn.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._uvicorn.started:
            sock.close()
            raise FastarError("the HTTP server did not start")
        self.start_engine()
        return self

    def start_engine(self) -> Server:
        """Load the engine and start its worker, without the HTTP server: for driving `self.app` in-process."""
        self.host.start(on_ready=self._on_ready)
        return self

    def _on_ready(self, engine: ServedEngine) -> None:
        default = engine.model_name_default
        if default not in self.model_names:
            self.model_names = (*self.model_names, default)  # accepted in requests, never listed

    @property
    def port(self) -> int:
        assert self._sock is not None, "start() first"
        return self._sock.getsockname()[1]

    @property
    def url(self) -> str:
        host = self.bind[0]
        host = f"[{host}]" if ":" in host else host
        return f"http://{host}:{self.port}"

    def wait_ready(self, timeout: float | None = None) -> bool:
        """True once the engine is loaded; raises FastarError if loading failed."""
        return self.host.wait_ready(timeout)

    def shutdown(self) -> None:
        """Stop the worker first (a stream in flight gets a `shutting_down` error event, not a clean stop),
        then uvicorn, which lets open responses finish for `Limits.graceful_shutdown` seconds."""
        self.host.shutdown()
        if self._uvicorn is not None:
            self._uvicorn.should_exit = True
            if self._thread is not None:
                self._thread.join(self.limits.graceful_shutdown + 5)
            self._uvicorn = None
        if self._sock is not None:
            self._sock.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


# ---------------------------------------------------------------------------------------------------------
# Command line: `fastar serve` (the lead's cli.py adds -m and the engine flags, then delegates here)
# ---------------------------------------------------------------------------------------------------------


def serve(
    engine_factory: Callable[..., Any],
    host: str = "127.0.0.1",
    port: int = 8080,
    api_key: str | None = None,
    cors_origin: str | None = None,
    served_model_name: str = "deepseek-v4-flash",
    max_queue: int = 16,
    reasoning_field: str = "reasoning_content",
    max_sessions: int = 4,
    default_thinking: bool = True,
    reasoning_default: str | None = None,
    allowed_hosts: str | None = None,
    max_connections: int = Limits.max_connections,
    max_batch: int = 8,
    prompt_cache: str | None = None,
    prompt_cache_size: int | str = "20G",
    prefill_share: float = 0.5,
    max_stall: float = MAX_STALL,
) -> int:
    """Run the server until Ctrl-C. Returns 0; raises FastarError if the port is taken or the model fails to load."""
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    server = Server(
        engine_factory,
        host=host,
        port=port,
        api_key=api_key,
        cors_origin=cors_origin,
        served_model_name=served_model_name,
        max_queue=max_queue,
        reasoning_field=reasoning_field,
        max_sessions=max_sessions,
        default_thinking=default_thinking,
        reasoning_default=reasoning_default,
        allowed_hosts=allowed_hosts,
        limits=Limits(max_connections=max_connections),
        max_batch=max_batch,
        prompt_cache=prompt_cache,
        prompt_cache_size=prompt_cache_size,
        prefill_share=prefill_share,
        max_stall=max_stall,
    )
    try:
        server.start()
    except OSError as err:  # socket.create_server appends "(while attempting to bind on address ('h', p))"
        reason = re.sub(r" \(while attempting to bind on address .*\)$", "", str(err.strerror or err))
        raise FastarError(f"cannot listen on {host}:{port}: {reason}") from None
    log.info("serving '%s' at %s (web UI at /, API at /v1); loading the model...", served_model_name, server.url)
    if prompt_cache:
        from fastar.config import parse_size

        log.info("prompt cache: %s (up to %.1f GiB)", prompt_cache, parse_size(prompt_cache_size) / (1 << 30))
    else:
        log.info("prompt cache: off")
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
    parser.add_argument(
        "--host", type=host_flag, default="127.0.0.1", help="address to bind (default 127.0.0.1, this machine only)"
    )
    parser.add_argument("--port", type=int_flag(0, 65535, "a port"), default=8080, help="port (default 8080)")
    parser.add_argument(
        "--api-key",
        type=api_key_flag,
        default=None,
        help="require the key on every route but /health: 'Authorization: Bearer KEY', 'x-api-key: KEY' or, from a "
        "browser (the web UI), Basic with KEY as the password",
    )
    parser.add_argument(
        "--cors-origin", default=None, help="allow browser pages from this origin (comma-separated list, or '*')"
    )
    parser.add_argument(
        "--served-model-name",
        type=model_name_flag,
        default="deepseek-v4-flash",
        help="model id the API reports and accepts (default deepseek-v4-flash, which stays accepted beside another)",
    )
    parser.add_argument(
        "--max-queue",
        type=int_flag(1, None, "--max-queue"),
        default=16,
        help="requests that may wait; more get 503 (default 16)",
    )
    parser.add_argument(
        "--max-sessions",
        type=int_flag(0, None, "--max-sessions"),
        default=4,
        help="finished requests whose model state is kept in RAM for prefix reuse (default 4)",
    )
    parser.add_argument(
        "--max-batch",
        "--max-num-seqs",
        dest="max_batch",
        type=int_flag(1, None, "--max-batch"),
        default=8,
        help="requests generated together, one token each per step (default 8)",
    )
    parser.add_argument(
        "--prefill-share",
        type=float_flag(0, 1, "--prefill-share", open_lo=True),
        default=0.5,
        help="the part of the time a prompt's prefill may take while other requests generate, in (0, 1]: after "
        "each layer of a long prompt's prefill chunk (a chunk takes seconds on a CPU) they generate for as long "
        "before the next, so a long prompt does not stall their replies; a prompt's last chunk is never held back, "
        "and a prompt within one chunk gives them a step only once they have waited --max-stall seconds; 1: a "
        "chunk every step, unbroken (default 0.5)",
    )
    parser.add_argument(
        "--max-stall",
        type=float_flag(0, math.inf, "--max-stall", open_lo=True),
        default=MAX_STALL,
        metavar="SECONDS",
        help="while a prompt within one prefill chunk runs (a short request; a chunk takes seconds on a CPU), "
        "the requests generating meanwhile get a decode step between two of its layers once they have waited this "
        "long since their last token: lower streams their replies more smoothly, higher gives the short prompt "
        f"its first token sooner (default {MAX_STALL:g})",
    )
    add_prompt_cache_arguments(parser)
    parser.add_argument(
        "--reasoning-field",
        default="reasoning_content",
        choices=REASONING_FIELDS,
        help="response field for the thinking text (default reasoning_content, as DeepSeek's API)",
    )
    parser.add_argument(
        "--reasoning-default",
        default="thinking",
        choices=tuple(thinking_mode.REASONING_DEFAULTS),
        help="thinking mode of a request that does not choose one: thinking (default; V4's high effort), none "
        "(answer at once), low / medium (think within 1,024 / 8,192 tokens, then answer), high, max",
    )
    parser.add_argument(
        "--allowed-hosts",
        default=None,
        help="extra host names the server answers to (comma-separated; '*' for any). The bound "
        "address, localhost names and IP addresses are always allowed",
    )
    parser.add_argument(
        "--max-connections",
        type=int_flag(1, None, "--max-connections"),
        default=Limits.max_connections,
        help="open connections at once; one more closes the connection that has waited longest for a request, "
        f"and gets a 503 only when all the others have one in flight (default {Limits.max_connections})",
    )


def run_from_args(args: argparse.Namespace, engine_factory: Callable[..., Any]) -> int:
    return serve(
        engine_factory,
        host=args.host,
        port=args.port,
        api_key=args.api_key,
        cors_origin=args.cors_origin,
        served_model_name=args.served_model_name,
        max_queue=args.max_queue,
        reasoning_field=args.reasoning_field,
        reasoning_default=args.reasoning_default,
        max_sessions=args.max_sessions,
        allowed_hosts=args.allowed_hosts,
        max_connections=args.max_connections,
        max_batch=args.max_batch,
        prompt_cache=prompt_cache_dir(args),
        prompt_cache_size=args.prompt_cache_size,
        prefill_share=args.prefill_share,
        max_stall=args.max_stall,
    )


def default_prompt_cache() -> str:
    """The prompt cache folder when no --prompt-cache is given: 'prompt-cache' in `FASTAR_CACHE_DIR` if set, else
    in the user cache directory (the demo model's folder too)."""
    import os

    import platformdirs

    base = os.environ.get("FASTAR_CACHE_DIR") or platformdirs.user_cache_dir("fastar")
    return str(Path(base).expanduser() / "prompt-cache")


def add_prompt_cache_arguments(parser: argparse.ArgumentParser) -> None:
    """--prompt-cache DIR, --prompt-cache-size, --no-prompt-cache (for `serve` and `chat`)."""
    parser.add_argument(
        "--prompt-cache",
        default=None,
        metavar="DIR",
        help="folder of prompt states saved at the end of each prompt and reply, so a resent conversation or a "
        "restarted server prefills only the new tail (default: 'prompt-cache' in the user cache directory)",
    )
    parser.add_argument(
        "--prompt-cache-size",
        type=size_flag,
        default="20G",
        help="size cap of the prompt cache folder; least recently used states go first (default 20G)",
    )
    parser.add_argument("--no-prompt-cache", action="store_true", help="keep no prompt states on disk")


def host_flag(text: str) -> str:
    """--host: an empty address binds every interface (as 0.0.0.0 does), so an unset variable in a service file
    would open the server to the network without a word: a usage error; 0.0.0.0 says it on purpose."""
    if not text.strip():
        raise argparse.ArgumentTypeError(
            "--host is empty: give an address such as 127.0.0.1 (this machine only), or 0.0.0.0 for every interface"
        )
    return text.strip()


def model_name_flag(text: str) -> str:
    """--served-model-name: the id clients send back in `model`; an empty one is no name."""
    if not text.strip():
        raise argparse.ArgumentTypeError("--served-model-name is empty: give the model id the API should report")
    return text


def api_key_flag(text: str) -> str:
    """--api-key: an empty key would turn authentication off without a word, so it is a usage error."""
    if not text.strip():
        raise argparse.ArgumentTypeError("--api-key is empty: give a key (or leave the flag out to serve without one)")
    return text


def size_flag(text: str) -> int:
    """A byte size such as 20G or 512M, for argparse."""
    from fastar.config import parse_size

    try:
        n = parse_size(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None
    if n is None or n <= 0:
        raise argparse.ArgumentTypeError(f"a size must be positive, such as 20G, got {text!r}")
    return n


def prompt_cache_dir(args: argparse.Namespace) -> str | None:
    """The prompt cache folder (--prompt-cache, else the default), made here, before the model loads and the port
    is bound: a path that cannot be a folder is one line naming the flag. None with --no-prompt-cache."""
    if args.no_prompt_cache:
        return None
    folder = args.prompt_cache or default_prompt_cache()
    path = Path(folder).expanduser()
    try:
        if path.exists() and not path.is_dir():
            raise NotADirectoryError(20, "not a folder")
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FastarError(
            f"--prompt-cache {folder}: cannot hold the prompt cache ({e.strerror}); give another folder, "
            "or --no-prompt-cache"
        ) from None
    return folder
