"""The OpenAI-compatible routes: parse and validate, tokenize off the event loop, enqueue, relay the worker's events.

Owns:
  * `OpenAIRoutes(server).routes()`: the Starlette routes of the OpenAI surface (`/v1/chat/completions`,
    `/v1/completions`, `/v1/models`, `/tokenize`, `/detokenize`, `/health`, `/metrics`, with their unversioned
    aliases). Handlers never call the model: they build a `Job` and submit it to the worker's bounded queue.
  * `LoopEvents`: a job's event queue that the worker thread fills and the event loop reads.

Does not own: prompt admission (`fastar.serve.admission`: the text and size checks and tokenizing, shared with
every other route), the guards and error rendering (`fastar.serve.app`), request shapes (`fastar.serve.protocol`),
the worker (`fastar.serve.worker`). Never imports torch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from fastar.encoding import encode_messages
from fastar.serve import protocol as P
from fastar.serve import scoring as S
from fastar.serve.app import JSONResponse, read_json
from fastar.serve.worker import Job


class LoopEvents:
    """`Job.events` for an asyncio handler: `put()` is called by the worker thread and lands on the loop."""

    def __init__(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: tuple[str, Any]) -> None:
        try:
            self._loop.call_soon_threadsafe(self._queue.put_nowait, item)
        except RuntimeError:  # the loop is closed: the server is gone and nobody reads this job
            pass

    async def get(self, timeout: float) -> tuple[str, Any] | None:
        try:
            return await asyncio.wait_for(self._queue.get(), timeout)
        except TimeoutError:
            return None


class _JobStream(StreamingResponse):
    """An SSE response that cancels its job however the response ends (done, client gone, server stopping)."""

    def __init__(self, content: AsyncIterator[bytes], job: Job) -> None:
        super().__init__(
            content,
            media_type="text/event-stream; charset=utf-8",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.job = job

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.job.cancel.set()


class OpenAIRoutes:
    def __init__(self, server: Any) -> None:  # fastar.serve.server.Server, which builds these routes
        self.server = server
        self.admission = server.admission

    def routes(self) -> list[BaseRoute]:
        get, post = ["GET"], ["POST"]
        table = [
            ("/v1/models", self.models, get),
            ("/models", self.models, get),
            ("/metrics", self.metrics, get),
            ("/health", self.health, get),
            ("/v1/health", self.health, get),
            ("/v1/chat/completions", self.chat, post),
            ("/chat/completions", self.chat, post),
            ("/v1/completions", self.completions, post),
            ("/completions", self.completions, post),
            ("/tokenize", self.tokenize, post),
            ("/detokenize", self.detokenize, post),
        ]
        return [Route(path, fn, methods=methods) for path, fn, methods in table]

    # ---- plain routes -----------------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        host = self.server.host
        if host.error is not None:
            err = P.APIError(500, f"model failed to load: {host.error}", "server_error", code="model_load_failed")
            return JSONResponse({**err.to_dict(), "status": "error"}, 500)
        if not host.ready.is_set():
            progress = host.progress()
            err = P.APIError(503, f"model is loading ({progress:.0%})", "unavailable_error", code="model_loading")
            return JSONResponse({**err.to_dict(), "status": "loading", "progress": round(progress, 4)}, 503)
        # the expert cache's warm-up: "loading" (with progress) while requests are already served, then "ready"
        return JSONResponse({"status": "ok", "experts": host.engine.warm_status()})

    async def models(self, request: Request) -> Response:
        engine = self.server.host.require_engine()
        names, ctx = self.server.model_names, engine.context_length
        return JSONResponse(
            {
                "object": "list",
                "data": [
                    {
                        "id": names[0],
                        "object": "model",
                        "created": self.server.started,
                        "owned_by": "fastar",
                        "root": getattr(engine, "model_name_default", names[0]),
                        "max_model_len": ctx,
                        "context_length": ctx,
                    }
                ],
            }
        )

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            self.server.metrics.render(self.server.host), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def tokenize(self, request: Request) -> Response:
        body = await read_json(request, self.server.settings)
        engine = self.server.host.require_engine()
        if not isinstance(body, dict):
            raise P.bad_request("the request body must be a JSON object")
        if "messages" in body:
            req = P.parse_chat_request({**body, "model": None}, self.server.model_names, self.server.default_thinking)
            ids = await self.admission.off_loop(self._encode_chat, req)
        else:
            text = body.get("prompt", body.get("content"))
            if not isinstance(text, str):
                raise P.bad_request("'prompt' (or 'content') must be a string, or send 'messages'", "prompt")
            ids = await self.admission.encode_async(text, "prompt")
        return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": engine.context_length})

    async def detokenize(self, request: Request) -> Response:
        body = await read_json(request, self.server.settings)
        engine = self.server.host.require_engine()
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise P.bad_request("'tokens' must be a list of integers", "tokens")
        P.check_token_ids(tokens, engine.tokenizer.vocab_size, "tokens")
        text = await self.admission.off_loop(engine.tokenizer.decode, tokens)
        return JSONResponse({"prompt": text, "content": text})

    # ---- prompts, through the one admission path ----------------------------------------------------------

    def _chat_text(self, req: P.ChatRequest) -> str:
        try:
            return encode_messages(
                req.messages,
                thinking_mode="thinking" if req.thinking else "chat",
                drop_thinking=req.drop_thinking,
                reasoning_effort=req.reasoning_effort,
            )
        except (ValueError, TypeError) as err:  # EncodingError is a ValueError
            raise P.bad_request(str(err), "messages") from None

    def _encode_chat(self, req: P.ChatRequest) -> list[int]:
        return self.admission.encode(self._chat_text(req), "messages")

    def _submit(
        self, engine: Any, prompt_ids: list[int], sampling: dict, max_tokens: int | None, param: str
    ) -> tuple[Job, int]:
        limit = P.resolve_max_tokens(
            len(prompt_ids), max_tokens, engine.context_length, getattr(engine, "context_note", None), param
        )
        job = Job(prompt_ids, P.make_sampling_params(sampling, limit), events=LoopEvents())
        self.server.host.submit(job)
        return job, limit

    # ---- generation ---------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        body = await read_json(request, self.server.settings)
        req = P.parse_chat_request(body, self.server.model_names, self.server.default_thinking)
        engine = self.server.host.require_engine()
        prompt_ids = await self.admission.off_loop(self._encode_chat, req)
        job, limit = self._submit(engine, prompt_ids, req.sampling, req.max_tokens, "messages")
        turn = P.ChatTurn(req, engine.tokenizer, self.server.reasoning_field)
        rid, created, n_prompt = P.new_id("chatcmpl"), int(time.time()), len(prompt_ids)
        if not req.stream:
            done = await self._collect_finished(job, turn, request, limit)
            if done is None:
                return Response(status_code=499)
            cached, finish = done
            use = P.usage(n_prompt, turn.completion_tokens, cached)
            resp = P.chat_response(rid, req.model, turn.message(), finish, use, turn.logprobs if req.logprobs else None)
            return JSONResponse(S.chat_extras(resp, req, turn, engine.tokenizer))

        def chunk(delta: dict, finish: str | None = None, lp: Any = None) -> bytes:
            return P.sse(P.chat_chunk(rid, created, req.model, delta, finish, lp))

        async def events() -> AsyncIterator[bytes]:
            yield chunk({"role": "assistant", "content": ""})
            async for kind, payload in self._pump(job, turn):
                if kind == "deltas":
                    for delta, lp in payload:
                        yield chunk(delta, None, lp)
                elif kind in ("keepalive", "error"):
                    yield payload
                else:  # end
                    deltas, finish = turn.finish(limit)
                    for delta, lp in deltas:
                        yield chunk(delta, None, lp)
                    self.server.metrics.finished(finish)
                    yield chunk({}, finish, turn.pending.take())
                    if req.include_usage:
                        use = P.usage(n_prompt, turn.completion_tokens, payload)
                        yield P.sse(P.usage_chunk(rid, created, req.model, "chat.completion.chunk", use))
            yield P.SSE_DONE

        return _JobStream(events(), job)

    async def completions(self, request: Request) -> Response:
        body = await read_json(request, self.server.settings)
        req = P.parse_completion_request(body, self.server.model_names)
        engine = self.server.host.require_engine()
        if isinstance(req.prompt, str):
            prompt_text = req.prompt
            prompt_ids = await self.admission.encode_async(req.prompt, "prompt")
        else:
            P.check_token_ids(req.prompt, engine.tokenizer.vocab_size, "prompt")
            prompt_ids = list(req.prompt)
            prompt_text = await self.admission.off_loop(engine.tokenizer.decode, prompt_ids)
        job, limit = self._submit(engine, prompt_ids, req.sampling, req.max_tokens, "prompt")
        prefix = prompt_text if req.echo else ""
        turn = P.CompletionTurn(req, engine.tokenizer, len(prefix))
        rid, created, n_prompt = P.new_id("cmpl"), int(time.time()), len(prompt_ids)
        if not req.stream:
            done = await self._collect_finished(job, turn, request, limit)
            if done is None:
                return Response(status_code=499)
            cached, finish = done
            use = P.usage(n_prompt, turn.completion_tokens, cached)
            resp = P.completion_response(rid, req.model, prefix + turn.text, finish, use, turn.logprobs)
            return JSONResponse(S.completion_extras(resp, req, turn, engine.tokenizer))

        def chunk(text: str, finish: str | None = None, lp: Any = None) -> bytes:
            return P.sse(P.completion_chunk(rid, created, req.model, text, finish, lp))

        async def events() -> AsyncIterator[bytes]:
            held = S.echoes_logprobs(req)  # the echoed prompt waits for its logprobs (they come with the first chunk)
            if prefix and not held:
                yield chunk(prefix)
            async for kind, payload in self._pump(job, turn):
                if held and (turn.prompt_scores is not None or kind == "end"):
                    held = False
                    try:
                        lp = S.echo_logprobs(engine.tokenizer, S.scores(turn), req.logprobs)
                    except P.APIError as err:
                        yield P.sse(err.to_dict())
                        break
                    yield chunk(prefix, None, lp)
                if kind == "deltas":
                    for text, lp in payload:
                        yield chunk(text, None, lp)
                elif kind in ("keepalive", "error"):
                    yield payload
                else:
                    pieces, finish = turn.finish(limit)
                    for text, lp in pieces:
                        yield chunk(text, None, lp)
                    self.server.metrics.finished(finish)
                    yield chunk("", finish)
                    if req.include_usage:
                        use = P.usage(n_prompt, turn.completion_tokens, payload)
                        yield P.sse(P.usage_chunk(rid, created, req.model, "text_completion", use))
            yield P.SSE_DONE

        return _JobStream(events(), job)

    async def _collect_finished(self, job: Job, turn: Any, request: Request, limit: Any) -> tuple[Any, str] | None:
        """A non-streamed reply: (cached prompt tokens, finish reason) once the job ends, None if the client left."""
        try:
            cached = await self._collect(job, turn, request)
        finally:
            job.cancel.set()
        if cached is _GONE:
            return None
        _, finish = turn.finish(limit)
        self.server.metrics.finished(finish)
        return cached, finish

    async def _collect(self, job: Job, turn: Any, request: Request) -> Any:
        """A whole reply for a non-streamed request: the cached-prompt token count, or `_GONE` when the client
        left (its job is cancelled). An engine error is raised as the client's 400 or a 500."""
        while True:
            item = await job.events.get(0.25)
            if item is None:
                if await request.is_disconnected():
                    job.cancel.set()
                    return _GONE
                continue
            kind, payload = item
            if kind == "chunk":
                turn.feed(payload)
                if turn.stopped:
                    job.cancel.set()  # our stop string: the engine need not go on
            elif kind == "error":
                raise _engine_error(*payload)
            elif kind == "end":
                return payload

    async def _pump(self, job: Job, turn: Any) -> AsyncIterator[tuple[str, Any]]:
        """The worker's events for a streamed reply: ("deltas", [...]), ("keepalive", comment bytes) during
        long silences (a prefill of minutes), ("error", SSE error event bytes) and then the stream's end, or
        ("end", cached prompt tokens)."""
        interval = self.server.keepalive_interval
        last_write = time.monotonic()
        while True:
            item = await job.events.get(min(0.25, interval))
            if item is None:
                if time.monotonic() - last_write >= interval:
                    progress = job.progress
                    note = f"keep-alive prefill {progress[0]}/{progress[1]}" if progress else "keep-alive"
                    yield "keepalive", P.sse_comment(note)
                    last_write = time.monotonic()
                continue
            kind, payload = item
            if kind == "chunk":
                deltas = turn.feed(payload)
                if turn.stopped:
                    job.cancel.set()
                if deltas:
                    yield "deltas", deltas
                    last_write = time.monotonic()
            elif kind == "error":
                err = _engine_error(*payload)
                self.server.metrics.error(err.status)
                yield "error", P.sse(err.to_dict())
                return
            elif kind == "end":
                yield "end", payload
                return


_GONE = object()


def _engine_error(status: int, message: str) -> P.APIError:
    if status == 400:
        return P.bad_request(message)
    if status == 503:
        return P.APIError(503, message, "unavailable_error", code="shutting_down")
    return P.APIError(status, message, "server_error", code="generation_failed")
