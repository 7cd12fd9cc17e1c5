"""The ASGI application: Starlette routing, the guards every request passes, error shapes and body reading.

Owns:
  * `build_app(settings, routes)`: a Starlette app from a list of routes (the OpenAI routes of
    `fastar.serve.routes`, and any other API the caller mounts), with `Guard` in front and every error,
    Starlette's own 404/405 included, rendered through the error shape of the route's API.
  * `Guard`: the checks before a route runs, in order: the Host header against the allowlist (DNS rebinding),
    CORS preflights, the API key, `application/json` on POST (a cross-site form or `text/plain` fetch cannot
    reach the model); and the headers after: security headers on every response, CORS where allowed.
  * `read_json()`: the body under the size cap and a read deadline, parsed with nesting and Unicode checks, so
    a hostile body is a 400/408/413 and never a 500.
  * `ErrorShape`, `error_response()`: APIError -> response body. OpenAI's `{"error": {...}}` by default; another
    API (say, Anthropic's `{"type": "error", "error": {...}}`) registers its own for its path prefix.

Does not own: the routes' logic (`fastar.serve.routes`), the worker (`fastar.serve.worker`), the HTTP server and
its connection limits (`fastar.serve.server`). Never imports torch.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hmac
import ipaddress
import json
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import anyio
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse as StarletteJSONResponse
from starlette.responses import Response
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fastar.serve.api_error import APIError, bad_request

ErrorShape = Callable[[APIError], dict]
# Lone UTF-16 surrogates are legal JSON escapes but not Unicode text; a pair (an emoji) is fine.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89abcdefABCDEF]")
MAX_JSON_DEPTH = 64
PARSE_OFF_LOOP_FROM = 1 << 20  # bytes
LOCAL_NAMES = ("localhost", "127.0.0.1", "::1")
PUBLIC_PATHS = ("/health", "/v1/health")  # load balancers and the UI's status dot probe these without a key
SECURITY_HEADERS = {
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "x-frame-options": "DENY",
    "cross-origin-resource-policy": "same-origin",
}
API_HEADERS = {  # on everything that is not the UI's own pages, which set theirs
    "content-security-policy": "default-src 'none'; frame-ancestors 'none'",
    "cache-control": "no-store",
}
_TOKEN_LIST = re.compile(r"^[A-Za-z0-9_\-, ]*$")
# A Host header (RFC 9110 7.2): an IPv6 literal in brackets, or a name / IPv4 address; an optional port.
_HOST_IPV6 = re.compile(r"\[([0-9A-Fa-f:.]+)\](?::[0-9]{0,5})?")
_HOST_NAME = re.compile(r"([A-Za-z0-9._~!$&'()*+,;=%-]+)(?::[0-9]{0,5})?")
_ABSOLUTE_TARGET = re.compile(r"(?i)https?://([^/?#]*)([^#]*)")


def parse_host(value: str) -> str | None:
    """The host name in a Host header (lower case, an IPv6 literal without its brackets), or None when the value is
    not one: empty, brackets around anything but an IPv6 address, text after the closing bracket, a bad port."""
    value = value.strip()
    if m := _HOST_IPV6.fullmatch(value):
        try:
            return str(ipaddress.IPv6Address(m.group(1)))
        except ValueError:
            return None
    if m := _HOST_NAME.fullmatch(value):
        return m.group(1).lower()
    return None


def origin_form(scope: Scope) -> tuple[Scope, str | None]:
    """A request target in absolute form (`GET http://host:port/health`, which HTTP/1.1 servers must accept) as
    the origin-form path the routes match, and the target's authority, which stands in for the Host header
    (RFC 9112 3.2.2). Any other target is returned as it is, with no authority."""
    raw = scope.get("raw_path") or scope["path"].encode()
    m = _ABSOLUTE_TARGET.fullmatch(raw.decode("latin-1"))
    if m is None:
        return scope, None
    path = m.group(2) or "/"
    raw_path = path.encode("latin-1")
    return {**scope, "path": unquote(path), "raw_path": raw_path}, m.group(1)


class JSONResponse(StarletteJSONResponse):
    """ASCII-escaped JSON: text the model or a tokenizer produced that is not valid Unicode (a lone surrogate
    from decoding a partial character) still encodes, as the SSE events already do."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode()


def openai_error(err: APIError) -> dict:
    return err.to_dict()


@dataclass
class Settings:
    """What the guards and the body reader need; `fastar.serve.server.Server` fills it from its flags."""

    api_key: str | None = None
    cors_origins: tuple[str, ...] = ()
    allowed_hosts: tuple[str, ...] = ()  # beyond the bound host, the localhost names and IP literals
    bound_host: str = "127.0.0.1"
    max_body_bytes: int = 32 * 1024 * 1024
    body_timeout: float = 60.0  # seconds to receive a whole request body
    max_requests: int = 128  # requests in flight (bodies being read included); more get a 503
    error_shapes: dict[str, ErrorShape] = field(default_factory=dict)  # path prefix -> shape

    def error_shape(self, path: str) -> ErrorShape:
        best = ""
        for prefix in self.error_shapes:
            if path.startswith(prefix) and len(prefix) > len(best):
                best = prefix
        return self.error_shapes[best] if best else openai_error

    def host_allowed(self, host_header: str | None) -> bool:
        """DNS rebinding defence: a page on evil.example whose name later resolves to 127.0.0.1 still sends
        `Host: evil.example`. IP literals cannot be rebound, so they pass; names must be local or listed."""
        if host_header is None:
            return True  # HTTP/1.0 tools send none (h11 requires one in HTTP/1.1); browsers always do
        host = parse_host(host_header)
        if host is None:
            return False  # empty or malformed: nothing to check it against
        if "*" in self.allowed_hosts:
            return True
        try:
            ipaddress.ip_address(host)
            return True
        except ValueError:
            pass
        host = host.rstrip(".")
        names = {*LOCAL_NAMES, self.bound_host.lower(), *(h.lower() for h in self.allowed_hosts)}
        return host in names or host.endswith(".localhost")


def error_response(err: APIError, shape: ErrorShape = openai_error, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(shape(err), status_code=err.status, headers={**err.headers, **(headers or {})})


# ---------------------------------------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------------------------------------


async def read_body(request: Request, settings: Settings) -> bytes:
    """The raw body, at most `max_body_bytes`, received within `body_timeout` seconds."""
    limit = settings.max_body_bytes
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise bad_request("invalid Content-Length header")
        if int(declared) > limit:
            raise APIError(
                413, f"request body of {declared} bytes exceeds the limit of {limit}", code="request_too_large"
            )
    chunks, size = [], 0
    try:
        async with asyncio.timeout(settings.body_timeout):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"request body exceeds the limit of {limit} bytes", code="request_too_large")
                chunks.append(chunk)
    except ClientDisconnect:  # the client left or broke the framing mid-body: nobody reads the answer
        raise APIError(400, "the request body ended before its declared length", code="incomplete_body") from None
    except TimeoutError:
        raise APIError(
            408, f"the request body did not arrive within {settings.body_timeout:g} s", code="request_timeout"
        ) from None
    return b"".join(chunks)


def parse_json(raw: bytes) -> Any:
    """A JSON body, or a 400 naming what is wrong with it (never a RecursionError or a later UnicodeError)."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise bad_request(
            f"the request body is not valid JSON: nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json"
        ) from None
    except UnicodeDecodeError as err:  # the codec's words name Python's decoder, not the client's mistake
        raise bad_request(
            f"the request body is not UTF-8 text: byte 0x{err.object[err.start]:02x} at offset {err.start}",
            code="invalid_json",
        ) from None
    except ValueError as err:
        if "integer string conversion" in str(err):  # Python's digit limit, with its advice to call sys.*
            limit = sys.get_int_max_str_digits()
            message = f"a number of more than {limit} digits"
        else:
            message = str(err)
        raise bad_request(f"the request body is not valid JSON: {message}", code="invalid_json") from None
    # A lone surrogate arrives as an escape (\ud800) or as its UTF-8 bytes (ED A0 80), which json.loads
    # decodes with "surrogatepass"; 0xED also leads Hangul, so such a body is walked in full.
    check_json(body, surrogates=b"\xed" in raw or _SURROGATE_ESCAPE.search(raw) is not None)
    return body


def check_json(body: Any, surrogates: bool = True) -> None:
    """Nesting at most MAX_JSON_DEPTH deep (later code recurses over tool schemas), and, when `surrogates`,
    no string holding a lone UTF-16 surrogate (it cannot be encoded, nor tokenized). Iterative: no recursion."""
    stack: list[tuple[Any, int, str]] = [(body, 0, "")]
    while stack:
        value, depth, where = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise bad_request(f"the request body is nested deeper than {MAX_JSON_DEPTH} levels", code="invalid_json")
        if isinstance(value, dict):
            stack.extend((v, depth + 1, f"{where}.{k}" if where else str(k)) for k, v in value.items())
            if surrogates:
                stack.extend((k, depth + 1, where or "body") for k in value)
        elif isinstance(value, list):
            stack.extend((v, depth + 1, f"{where}[{i}]") for i, v in enumerate(value))
        elif surrogates and isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as err:
                bad = value[err.start]
                raise bad_request(
                    f"{where or 'body'!r} holds an unpaired UTF-16 surrogate (\\u{ord(bad):04x}) "
                    f"at character {err.start}: text must be valid Unicode",
                    where or None,
                    "invalid_unicode",
                ) from None


async def read_json(request: Request, settings: Settings) -> Any:
    raw = await read_body(request, settings)
    if len(raw) > PARSE_OFF_LOOP_FROM:  # megabytes of JSON take a noticeable while: keep the loop free
        return await anyio.to_thread.run_sync(parse_json, raw)
    return parse_json(raw)


# ---------------------------------------------------------------------------------------------------------
# The guard in front of every route (plain ASGI, so streaming responses pass through untouched)
# ---------------------------------------------------------------------------------------------------------


class Guard:
    def __init__(self, app: ASGIApp, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self._active = 0  # requests in flight past the guard (on the event loop's thread only)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        s = self.settings
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        scope, authority = origin_form(scope)
        host = authority if authority is not None else headers.get("host")
        path, method = scope["path"], scope["method"]
        shape = s.error_shape(path)
        cors = self._cors(headers.get("origin"))
        ui_page = method in ("GET", "HEAD") and not (path.startswith("/v1/") or path in _API_GET_PATHS)

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", [])}
                extra = {**SECURITY_HEADERS, **({} if ui_page and message["status"] < 400 else API_HEADERS), **cors}
                message["headers"] = [
                    *message.get("headers", []),
                    *((k.encode(), v.encode()) for k, v in extra.items() if k.encode() not in have),
                ]
            await send(message)

        def refuse(err: APIError, extra: dict[str, str] | None = None) -> Response:
            return error_response(err, shape, extra)

        if scope.get("http_version") not in ("1.0", "1.1"):  # h11 parses any HTTP/x.y request line
            resp = refuse(
                APIError(
                    505,
                    f"HTTP/{scope.get('http_version')} is not supported; send HTTP/1.1",
                    code="http_version_not_supported",
                ),
                {"Connection": "close"},
            )
            return await resp(scope, receive, send_with_headers)
        if not s.host_allowed(host):
            shown = (host or "")[:100]
            resp = refuse(
                APIError(
                    400,
                    f"Host '{shown}' is not allowed; start the server with --allowed-hosts to serve other names"
                    if parse_host(shown) is not None
                    else f"Host '{shown}' is not a host name, an IP address or [an IPv6 address], with a port",
                    code="host_not_allowed",
                ),
                {"Connection": "close"},
            )
            return await resp(scope, receive, send_with_headers)
        if method == "OPTIONS":
            return await self._options(headers, scope, receive, send_with_headers, shape, cors)
        if path.rstrip("/") not in PUBLIC_PATHS and not self._authorized(headers):
            scheme = 'Basic realm="fastar", charset="UTF-8"' if ui_page else "Bearer"
            # "Connection: close": the body stays unread, so it must not be taken for the next request.
            how = (
                "reload the page and give the key as the password (any user name)"
                if ui_page  # what a browser shows when its password prompt is cancelled
                else "send 'Authorization: Bearer <key>' or 'x-api-key: <key>'"
            )
            resp = refuse(
                APIError(
                    401,
                    f"Invalid or missing API key ({how})",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                ),
                {"WWW-Authenticate": scheme, "Connection": "close"},
            )
            return await resp(scope, receive, send_with_headers)
        if method == "POST":
            ctype = headers.get("content-type", "").split(";", 1)[0].strip().lower()
            if ctype != "application/json":
                resp = refuse(
                    APIError(
                        415,
                        f"POST bodies must be sent as 'Content-Type: application/json', got '{ctype or 'none'}'",
                        code="unsupported_media_type",
                    ),
                    {"Connection": "close"},
                )
                return await resp(scope, receive, send_with_headers)
            coding = headers.get("content-encoding", "").strip().lower()
            if coding not in ("", "identity"):  # the body would be read as JSON bytes it is not
                resp = refuse(
                    APIError(
                        415,
                        f"request bodies are read uncompressed; Content-Encoding '{coding}' is not supported",
                        code="unsupported_content_encoding",
                    ),
                    {"Accept-Encoding": "identity", "Connection": "close"},
                )
                return await resp(scope, receive, send_with_headers)
        if self._active >= s.max_requests:  # bounds the memory of bodies being read, however many connections
            resp = refuse(
                APIError(
                    503,
                    f"the server is handling {s.max_requests} requests at once; try again shortly",
                    "unavailable_error",
                    code="server_busy",
                ),
                {"Retry-After": "1", "Connection": "close"},
            )
            return await resp(scope, receive, send_with_headers)
        self._active += 1
        try:
            await self.app(scope, receive, send_with_headers)
        finally:
            self._active -= 1

    def _cors(self, origin: str | None) -> dict[str, str]:
        allowed = self.settings.cors_origins
        if not origin or not allowed:
            return {}
        if "*" in allowed:
            return {"access-control-allow-origin": "*"}
        return {"access-control-allow-origin": origin, "vary": "Origin"} if origin in allowed else {}

    def _authorized(self, headers: dict[str, str]) -> bool:
        key = self.settings.api_key
        if not key:
            return True
        scheme, _, value = headers.get("authorization", "").partition(" ")
        token = value.strip()
        if scheme.lower() == "basic":
            # Browsers cannot attach a Bearer header to page loads; the UI is reached with Basic auth, the
            # key as the password, and the browser then sends the same credentials on the UI's API calls.
            try:
                token = base64.b64decode(token, validate=True).decode().partition(":")[2]
            except (binascii.Error, UnicodeDecodeError):
                return False
        elif scheme.lower() != "bearer":
            token = headers.get("x-api-key", "")
        return hmac.compare_digest(token.encode(), key.encode())

    async def _options(
        self,
        headers: dict[str, str],
        scope: Scope,
        receive: Receive,
        send: Send,
        shape: ErrorShape,
        cors: dict[str, str],
    ) -> None:
        """CORS preflight: answered without auth (browsers never send credentials on it)."""
        origin = headers.get("origin")
        if origin and headers.get("access-control-request-method"):
            if not cors:
                resp = error_response(
                    APIError(403, f"origin {origin[:100]} is not allowed", code="cors_forbidden"), shape
                )
                return await resp(scope, receive, send)
            requested = headers.get("access-control-request-headers", "")
            allow = requested if requested and _TOKEN_LIST.match(requested) else "Authorization, Content-Type"
            resp = Response(
                status_code=204,
                headers={
                    "Access-Control-Allow-Methods": "GET, POST, DELETE, OPTIONS",
                    "Access-Control-Allow-Headers": allow,
                    "Access-Control-Max-Age": "600",
                },
            )
            return await resp(scope, receive, send)
        await Response(status_code=204, headers={"Allow": "GET, POST, DELETE, OPTIONS"})(scope, receive, send)


_API_GET_PATHS = ("/v1/models", "/models", "/metrics", "/health", "/v1/health")


# ---------------------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------------------


def build_app(
    settings: Settings, routes: Sequence[BaseRoute], on_error: Callable[[int], None] | None = None
) -> ASGIApp:
    """Starlette over `routes`, behind `Guard`. Every APIError and every Starlette HTTP error (404, 405 with
    its `Allow` header) is answered in the error shape registered for the path; `on_error(status)` counts it."""

    def render(request: Request, err: APIError, headers: dict[str, str] | None = None) -> Response:
        if on_error is not None:
            on_error(err.status)
        return error_response(err, settings.error_shape(request.url.path), headers)

    async def api_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return render(request, exc, {"Connection": "close"} if exc.status in (408, 413) else None)

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "bad_request")
        message = (
            f"{request.method} is not allowed on {request.url.path}"
            if exc.status_code == 405
            else f"no route {request.method} {request.url.path}"
            if exc.status_code == 404
            else str(exc.detail)
        )
        return render(request, APIError(exc.status_code, message, code=code), dict(exc.headers or {}))

    async def server_error(request: Request, exc: Exception) -> Response:
        return render(request, APIError(500, "internal server error", "server_error"), {"Connection": "close"})

    app = Starlette(
        routes=list(routes),
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: server_error},
    )
    return Guard(app, settings)
