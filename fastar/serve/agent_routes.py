"""The agent APIs on the server's app: Anthropic Messages (`/v1/messages`, `/v1/messages/count_tokens`) and OpenAI
Responses (`/v1/responses`, `GET` and `DELETE /v1/responses/{id}`, `GET /v1/responses/{id}/input_items`), mounted
beside the OpenAI routes behind the same guard (Host allowlist, JSON content type, API key: `Authorization: Bearer`
or Anthropic's `x-api-key`).

Owns: the Starlette glue only. The translation, validation, streaming event sequences and the response store
live in `fastar.serve.anthropic`, `fastar.serve.responses` (`fastar.serve.response_items`) and `fastar.serve.turn`;
both submit jobs to the one engine worker through `EngineHost.submit`, like every other route. Their calls block
(they wait on the worker), so they run in the thread pool; when a stream's client goes, its jobs are cancelled at
once and its iterator is closed, and a non-streamed call asks the event loop from its thread whether the client is
still there (`disconnected`), so a client that leaves cancels its generation too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator
from typing import Any

import anyio.from_thread
from starlette.concurrency import iterate_in_threadpool, run_in_threadpool
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive

from fastar.serve import anthropic as A
from fastar.serve import response_items
from fastar.serve import responses as R
from fastar.serve.app import ErrorShape, JSONResponse, read_json
from fastar.serve.turn import Backend, ClientDisconnected
from fastar.serve.worker import Job

ERROR_SHAPES: dict[str, ErrorShape] = {"/v1/messages": A.error_body}  # Responses errors are OpenAI-shaped


class _ClosingStream(StreamingResponse):
    """SSE from a blocking iterator run in the thread pool; closing it (done or client gone) cancels the job. A
    client that leaves cancels `jobs` at once: the iterator's thread may be waiting on the worker for seconds (a
    long prefill sends nothing but a keep-alive every few seconds), and it is closed only once that wait ends."""

    def __init__(self, it: Generator[bytes, None, None], jobs: list[Job]) -> None:  # `_stream`s: close() cancels
        super().__init__(
            iterate_in_threadpool(it),
            media_type="text/event-stream; charset=utf-8",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._it = it
        self._jobs = jobs

    async def listen_for_disconnect(self, receive: Receive) -> None:
        await super().listen_for_disconnect(receive)
        for job in self._jobs:
            job.cancel.set()

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await run_in_threadpool(self._it.close)


class AgentRoutes:
    """`AgentRoutes(server).routes()`: the Messages and Responses routes for `Server(extra_routes=...)`."""

    def __init__(self, server: Any) -> None:  # fastar.serve.server.Server
        self.server = server
        self.store = R.ResponseStore(size=256)
        self._backend: Backend | None = None

    def backend(self) -> Backend:
        if self._backend is None:  # after Server.__init__ set host, metrics and model names
            s = self.server
            self._backend = Backend(
                engine=s.host.require_engine,
                submit=s.host.submit,
                model_names=s.model_names,
                default_thinking=s.default_thinking,
                default_effort=s.default_effort,
                keepalive_interval=s.keepalive_interval,
                metrics=s.metrics,
                admission=s.admission,
                replay=s.replay,
            )
        return self._backend

    def routes(self) -> list[BaseRoute]:
        return [
            Route("/v1/messages", self.messages, methods=["POST"]),
            Route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"]),
            Route("/v1/responses", self.create, methods=["POST"]),
            Route("/v1/responses/{rid}", self.retrieve, methods=["GET"]),
            Route("/v1/responses/{rid}", self.delete, methods=["DELETE"]),
            Route("/v1/responses/{rid}/input_items", self.input_items, methods=["GET"]),
        ]

    async def _run(self, request: Request, fn: Callable[[Any, Backend, Callable[[], bool]], Any]) -> Response:
        body = await read_json(request, self.server.settings)
        jobs: list[Job] = []  # what this request submits, for the stream to cancel when its client leaves
        shared = self.backend()

        def submit(job: Job) -> None:
            shared.submit(job)
            jobs.append(job)

        def disconnected() -> bool:  # asked from the thread pool; the event loop reads the connection
            return anyio.from_thread.run(request.is_disconnected)

        try:
            out = await run_in_threadpool(fn, body, dataclasses.replace(shared, submit=submit), disconnected)
        except ClientDisconnected:  # its generation was cancelled; nobody reads an answer
            return Response(status_code=499)
        return JSONResponse(out) if isinstance(out, dict) else _ClosingStream(out, jobs)

    async def messages(self, request: Request) -> Response:
        return await self._run(request, A.messages)

    async def count_tokens(self, request: Request) -> Response:
        return await self._run(request, lambda b, backend, gone: A.count_tokens(b, backend))

    async def create(self, request: Request) -> Response:
        return await self._run(request, lambda b, backend, gone: R.create(b, backend, self.store, gone))

    async def retrieve(self, request: Request) -> Response:
        return JSONResponse(R.retrieve(request.path_params["rid"], self.store))

    async def delete(self, request: Request) -> Response:
        return JSONResponse(response_items.delete(request.path_params["rid"], self.store))

    async def input_items(self, request: Request) -> Response:
        return JSONResponse(
            response_items.list_input_items(request.path_params["rid"], self.store, request.query_params)
        )
