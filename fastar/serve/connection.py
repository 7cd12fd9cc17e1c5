"""One HTTP connection: uvicorn's h11 protocol with the limits `fastar.serve.server.Limits` sets on the head of
each request (its request line and headers).

Owns `Connection` (made per server by `Connection.configured(...)`):
  * the header timeout: a connection whose request head has not all arrived within `header_timeout` seconds
    (after connecting, or after its previous response) is closed. uvicorn's own keep-alive timer only covers a
    connection that sends nothing at all;
  * room for requests: a server holds at most `max_connections` connections. When one more arrives, the
    connection that has waited longest for a request head (one that never sent a complete request, or a
    keep-alive connection between requests) is closed to make room; only when every other connection has a
    request in flight is the newcomer's request answered 503. So connections that send nothing (or a head a
    byte at a time) cannot keep a real request out: each arrival pushes the oldest of them out, and a
    connection whose request is complete is never pushed out;
  * the head size, exactly: a request line plus headers of more than `max_header_bytes` is answered
    `431 Request Header Fields Too Large` (h11's own bound only looks at what is buffered and still incomplete,
    so one read that completes a 100 KB head passed it). The rest of what the client sends is read and dropped
    for a moment before the close, so the answer is not lost to a reset.

Also `fit_connections()`: the connection limit the process's open-file limit allows (each connection is a
descriptor; the soft limit is raised toward the hard one first, and `FD_RESERVE` are kept for the engine).

Does not own: the app, the server's socket and thread (`fastar.serve.server`). Never imports torch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Any, ClassVar

from uvicorn.protocols.http.h11_impl import H11Protocol

from fastar.serve.api_error import APIError

_DRAIN_SECONDS = 2.0  # how long a refused connection's remaining input is read and dropped before the close
FD_RESERVE = 256  # descriptors kept for the engine: the model and expert files, prompt cache, logs, threads

log = logging.getLogger("fastar.serve")


def fit_connections(wanted: int) -> int:
    """`wanted`, or fewer if the open-file limit cannot hold that many sockets beside `FD_RESERVE` others. The
    soft limit is first raised as far as the hard limit allows (no privilege needed)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    need = wanted + FD_RESERVE
    if soft != resource.RLIM_INFINITY and soft < need:
        raised = need if hard == resource.RLIM_INFINITY else min(need, hard)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
            soft = raised
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY or soft >= need:
        return wanted
    room = max(1, soft - FD_RESERVE)
    log.warning("open-file limit %d holds %d connections beside the engine's files, not %d", soft, room, wanted)
    return room


class Connection(H11Protocol):
    header_timeout: float = 10.0
    max_header_bytes: int = 64 * 1024
    max_connections: int = 4096
    _waiting: ClassVar[dict[Connection, None]] = {}  # one per server (`configured`): waiting for a head, oldest first
    _timer: asyncio.TimerHandle | None = None
    _head_seen = 0  # bytes of the head being received so far
    _tail = b""  # the last bytes fed, to find a blank line split across two reads
    _refused = False

    @classmethod
    def configured(cls, header_timeout: float, max_header_bytes: int, max_connections: int) -> type[Connection]:
        """The protocol class for one server, with its limits (uvicorn instantiates it per connection).
        uvicorn's own `limit_concurrency` must be `max_connections + 1`: it answers 503 to a request that
        arrives while `limit_concurrency` connections are open, which after the eviction here means only when
        every other connection is busy."""
        limits = {"header_timeout": header_timeout, "max_header_bytes": max_header_bytes}
        return type("Connection", (cls,), {**limits, "max_connections": max_connections, "_waiting": {}})

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()
        if len(self.connections) > self.max_connections:
            self._make_room()

    def _make_room(self) -> None:
        """Close the connection that has waited longest for a request head (not this new one)."""
        victim = next((c for c in self._waiting if c is not self), None)
        if victim is None:  # every other connection has a request in flight: this one's request gets the 503
            return
        victim._disarm()
        self.connections.discard(victim)  # before its connection_lost runs: the count is right at once
        victim.transport.close()

    # ---- waiting for a request head ------------------------------------------------------------------------

    @property
    def waiting_for_head(self) -> bool:
        return self._timer is not None

    def _arm(self) -> None:
        self._disarm()
        self._head_seen, self._tail = 0, b""
        self._timer = self.loop.call_later(self.header_timeout, self._expired)
        self._waiting[self] = None

    def _disarm(self) -> None:
        self._waiting.pop(self, None)
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self) -> None:
        self._timer = None
        self._waiting.pop(self, None)
        if not self.transport.is_closing():
            self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # drained until the close
        if self.waiting_for_head and not self._count_head(data):
            self._refuse_head()
            return
        super().data_received(data)

    def _count_head(self, data: bytes) -> bool:
        """Add `data` to the head being received; False once the head is longer than `max_header_bytes`."""
        seen = self._tail + data
        ends = [i + len(sep) for sep in (b"\r\n\r\n", b"\n\n") if (i := seen.find(sep)) >= 0]
        if ends:  # the head ends in this read: count up to its blank line
            head = self._head_seen + min(ends) - len(self._tail)
            self._head_seen, self._tail = 0, b""
            return head <= self.max_header_bytes
        self._head_seen += len(data)
        self._tail = seen[-3:]
        return self._head_seen <= self.max_header_bytes

    def _refuse_head(self) -> None:
        self._disarm()
        self._refused = True
        err = APIError(
            431,
            f"the request line and headers exceed {self.max_header_bytes} bytes",
            code="request_header_fields_too_large",
        )
        body = json.dumps(err.to_dict()).encode()
        self.transport.write(
            b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
            b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body)
        )
        self.loop.call_later(_DRAIN_SECONDS, self.transport.close)

    # ---- the request's life --------------------------------------------------------------------------------

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head is complete
            self._disarm()

    def on_response_complete(self) -> None:
        self._arm()  # before: a pipelined request handled inside disarms it again
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)
