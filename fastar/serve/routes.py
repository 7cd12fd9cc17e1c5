"""The OpenAI-compatible routes: parse and validate, tokenize off the event loop, enqueue, relay the worker's events.

Owns:
  * `OpenAIRoutes(server).routes()`: the Starlette routes of the OpenAI surface (`/v1/chat/completions`,
    `/v1/completions`, `/v1/models`, `/v1/models/{model}`, `/tokenize`, `/detokenize`, `/health`, `/metrics`,
    with their unversioned aliases). Handlers never call the model: they build a `Job` and submit it to the
    worker's bounded queue.
  * `LoopEvents`: a job's event queue that the worker thread fills and the event loop reads.

Does not own: prompt admission (`fastar.serve.admission`: the text and size checks and tokenizing, shared with
every other route), the guards and error rendering (`fastar.serve.app`), request parsing
(`fastar.serve.openai_request`), response shapes (`fastar.serve.shapes`), one choice's reply
(`fastar.serve.choice_turn`), the worker (`fastar.serve.worker`). Never imports torch.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.routing import BaseRoute, Route
from starlette.types import Receive, Scope, Send

from fastar.encoding import encode_messages
from fastar.serve import choice_turn, fields, grammar_fields, openai_request, shapes
from fastar.serve import scoring as S
from fastar.serve.api_error import APIError, bad_request
from fastar.serve.app import JSONResponse, read_json
from fastar.serve.turn import Conversation, record_reply
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


class _Tagged:
    """One choice's `Job.events`: what the worker puts lands on the request's shared queue as (index, item)."""

    def __init__(self, shared: LoopEvents, index: int) -> None:
        self.shared, self.index = shared, index

    def put(self, item: tuple[str, Any]) -> None:
        self.shared.put((self.index, item))


class _JobStream(StreamingResponse):
    """An SSE response that cancels its jobs however the response ends (done, client gone, server stopping)."""

    def __init__(self, content: AsyncIterator[bytes], jobs: list[Job]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream; charset=utf-8",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.jobs = jobs

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            for job in self.jobs:
                job.cancel.set()


class OpenAIRoutes:
    def __init__(self, server: Any) -> None:  # fastar.serve.server.Server, which builds these routes
        self.server = server
        self.admission = server.admission

    def routes(self) -> list[BaseRoute]:
        get, post = ["GET"], ["POST"]
        table = [
            ("/v1/models", self.models, get),
            ("/models", self.models, get),
            ("/v1/models/{model:path}", self.model, get),
            ("/models/{model:path}", self.model, get),
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
            err = APIError(500, f"model failed to load: {host.error}", "server_error", code="model_load_failed")
            return JSONResponse({**err.to_dict(), "status": "error"}, 500)
        if not host.ready.is_set():
            progress = host.progress()
            err = APIError(503, f"model is loading ({progress:.0%})", "unavailable_error", code="model_loading")
            return JSONResponse({**err.to_dict(), "status": "loading", "progress": round(progress, 4)}, 503)
        # the expert cache's warm-up: "loading" (with progress) while requests are already served, then "ready"
        return JSONResponse({"status": "ok", "experts": host.engine.warm_status()})

    def _model_entry(self) -> dict:
        engine = self.server.host.require_engine()
        name, ctx = self.server.model_names[0], engine.context_length
        return {
            "id": name,
            "object": "model",
            "created": self.server.started,
            "owned_by": "fastar",
            "root": engine.model_name_default,
            "max_model_len": ctx,
            "context_length": ctx,
        }

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_entry()]})

    async def model(self, request: Request) -> Response:
        """`GET /v1/models/{model}` (the `openai` client's `models.retrieve`): the served model, or a 404."""
        fields.check_model({"model": request.path_params["model"]}, self.server.model_names)
        return JSONResponse(self._model_entry())

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(
            self.server.metrics.render(self.server.host), media_type="text/plain; version=0.0.4; charset=utf-8"
        )

    async def tokenize(self, request: Request) -> Response:
        """vLLM's `/tokenize`. A `prompt` is tokenized as `/v1/completions` reads it; `add_special_tokens` (default
        true) adds what the tokenizer adds around a text, which for V4's is nothing (its tokenizer_config.json has
        `add_bos_token: false` and tokenizer.json no template), so the ids are the ones a completion is fed.
        `messages` are rendered as chat completions render them (the same thinking options), with the reply's
        opening tokens unless `add_generation_prompt` is false, the last message left open with
        `continue_final_message`; there `add_special_tokens` defaults to false (the template has its BOS)."""
        body = await read_json(request, self.server.settings)
        engine = self.server.host.require_engine()
        if not isinstance(body, dict):
            raise bad_request("the request body must be a JSON object")
        fields.check_model(body, self.server.model_names)  # another model's ids would be a wrong count
        chat = "messages" in body
        fields.boolean(body, "add_special_tokens", not chat)  # checked; V4's tokenizer adds no tokens either way
        token_strs = fields.boolean(body, "return_token_strs", False)
        if chat:
            generation_prompt = fields.boolean(body, "add_generation_prompt", True)
            if fields.boolean(body, "continue_final_message", False):
                if generation_prompt and "add_generation_prompt" in body:
                    raise bad_request(
                        "'continue_final_message' and 'add_generation_prompt' cannot both be true: the last message "
                        "is left open, so no reply is opened after it",
                        "continue_final_message",
                    )
                generation_prompt = False
                if isinstance(body["messages"], list) and body["messages"]:
                    body = {**body, "messages": [*body["messages"][:-1], _left_open(body["messages"])]}
            req = openai_request.parse_chat_request(
                {**body, "model": None},
                self.server.model_names,
                self.server.default_thinking,
                self.server.default_effort,
            )
            ids = await self.admission.off_loop(self._encode_chat, req, generation_prompt)
        else:
            text = body.get("prompt", body.get("content"))
            if not isinstance(text, str):
                raise bad_request("'prompt' (or 'content') must be a string, or send 'messages'", "prompt")
            ids = await self.admission.encode_async(text, "prompt")
        out = {"tokens": ids, "count": len(ids), "max_model_len": engine.context_length}
        if token_strs:
            out["token_strs"] = await self.admission.off_loop(_token_strs, engine.tokenizer, ids)
        return JSONResponse(out)

    async def detokenize(self, request: Request) -> Response:
        body = await read_json(request, self.server.settings)
        engine = self.server.host.require_engine()
        if isinstance(body, dict):
            fields.check_model(body, self.server.model_names)
        tokens = body.get("tokens") if isinstance(body, dict) else None
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            raise bad_request("'tokens' must be a list of integers", "tokens")
        fields.check_token_ids(tokens, engine.tokenizer.vocab_size, "tokens")
        text = await self.admission.off_loop(engine.tokenizer.decode, tokens)
        return JSONResponse({"prompt": text, "content": text})

    # ---- prompts, through the one admission path ----------------------------------------------------------

    def _chat_text(self, req: openai_request.ChatRequest, generation_prompt: bool = True) -> str:
        def render(messages: list[dict]) -> str:
            return encode_messages(
                messages,
                thinking_mode="thinking" if req.thinking else "chat",
                drop_thinking=req.drop_thinking,
                reasoning_effort=req.reasoning_effort,
                add_generation_prompt=generation_prompt,
            )

        try:
            return render(req.messages)
        except (ValueError, TypeError) as err:  # EncodingError is a ValueError
            message = str(err)
        if req.added_system:  # the error names the encoder's index: say it of the client's own messages
            try:
                render(req.messages[1:])
            except (ValueError, TypeError) as err:
                message = str(err)
        raise bad_request(message, "messages")

    def _encode_chat(self, req: openai_request.ChatRequest, generation_prompt: bool = True) -> list[int]:
        return self._chat_prompt(req, generation_prompt)[1]

    def _chat_prompt(self, req: openai_request.ChatRequest, generation_prompt: bool = True) -> tuple[str, list[int]]:
        """The rendered prompt and its ids, tokenized through the server's replay cache: a resent conversation
        gets the ids the model holds for its replies (a tool call written `[1,2]`, text sampled in another
        tokenization), so its whole prefix is reused (`fastar.serve.turn.ReplayCache`)."""
        text = self._chat_text(req, generation_prompt)
        tokenizer = self.server.host.require_engine().tokenizer
        return text, self.admission.encode(text, "messages", partial(self.server.replay.encode, tokenizer))

    def _record_chat(
        self, req: openai_request.ChatRequest, prompt: tuple[str, list[int]], turn: choice_turn.ChatTurn
    ) -> None:
        """Remember a finished reply's ids under the text its conversation's next request renders. Only a request
        of one choice (`n` 1): which of several comes back is unknown, and `n` entries would push the other
        conversations' replies out of the cache."""
        conv = Conversation(req.messages, req.thinking, req.reasoning_effort, req.drop_thinking)
        tokenizer = self.server.host.require_engine().tokenizer
        record_reply(
            self.server.replay,
            tokenizer,
            conv,
            *prompt,
            turn.generated,
            turn.message(),
            stopped=turn.stops.hit,
            cut_after_call=turn.parser.cut,
        )

    def _submit(
        self,
        engine: Any,
        prompts: list[list[int]],
        sampling: dict,
        max_tokens: int | None,
        param: str,
        choices: int = 1,
        default_max_tokens: int | None = None,
    ) -> tuple[list[Job], list[int], LoopEvents]:
        """Submit `choices` choices of each prompt (choice j samples with seed + j); returns the jobs (prompt by
        prompt, the choices of each in order: job k is choice k % choices of prompt k // choices), each prompt's
        max_tokens, and the queue on which every job's events arrive tagged with its index. A prompt given more
        than once is one group (prefilled once). All or none: a prompt refused undoes the ones queued before it."""
        events = LoopEvents()
        fields.check_token_ids(list(sampling.get("logit_bias") or ()), engine.tokenizer.vocab_size, "logit_bias")
        limits = [
            fields.resolve_max_tokens(
                len(ids),
                max_tokens,
                engine.context_length,
                engine.context_note,
                param,
                default_max_tokens,
            )
            for ids in prompts
        ]
        params = [
            fields.make_sampling_params(fields.choice_sampling(sampling, j), limit)
            for limit in limits
            for j in range(choices)
        ]
        jobs = [Job(prompts[k // choices], p, events=_Tagged(events, k)) for k, p in enumerate(params)]
        groups: dict[tuple[int, ...], list[Job]] = {}
        for k, job in enumerate(jobs):
            groups.setdefault(tuple(prompts[k // choices]), []).append(job)
        queued: list[Job] = []
        try:
            for group in groups.values():
                self.server.host.submit_choices(group)
                queued.extend(group)
        except BaseException:
            for job in queued:
                job.cancel.set()
            raise
        return jobs, limits, events

    # ---- generation ---------------------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        body = await read_json(request, self.server.settings)
        req = openai_request.parse_chat_request(
            body, self.server.model_names, self.server.default_thinking, self.server.default_effort
        )
        grammar_fields.check_last_turn(body["messages"])  # (/tokenize counts any conversation)
        engine = self.server.host.require_engine()
        prompt = await self.admission.off_loop(self._chat_prompt, req)  # (text, ids)
        prompt_ids = prompt[1]
        sampling = req.sampling
        if sampling.get("grammar") is not None:  # compiling is blocking work (the first one ~1 s); none: no hop
            sampling = await self.admission.off_loop(grammar_fields.compiled_sampling, engine, sampling)
        else:  # (tool_choice "none": a token ban, a dict lookup)
            sampling = grammar_fields.compiled_sampling(engine, sampling)
        jobs, (limit,), shared = self._submit(engine, [prompt_ids], sampling, req.max_tokens, "messages", req.n)
        turns = [choice_turn.ChatTurn(req, engine.tokenizer, self.server.reasoning_field) for _ in jobs]
        rid, created, n_prompt = shapes.new_id("chatcmpl"), int(time.time()), len(prompt_ids)
        if not req.stream:
            done = await self._collect_finished(jobs, turns, shared, request, [limit] * len(jobs))
            if done is None:
                return Response(status_code=499)
            cached, finishes = done
            if req.n == 1:  # (not behind the prompts being tokenized: it takes a millisecond)
                await run_in_threadpool(self._record_chat, req, prompt, turns[0])
            choices = [
                shapes.chat_choice(i, t.message(), f, t.logprobs if req.logprobs else None)
                for i, (t, f) in enumerate(zip(turns, finishes))
            ]
            use = shapes.usage(
                n_prompt, sum(t.completion_tokens for t in turns), cached, sum(t.reasoning_tokens for t in turns)
            )
            resp = shapes.chat_response_choices(rid, req.model, choices, use)
            return JSONResponse(S.chat_extras(resp, req, turns[0], engine.tokenizer))  # (every choice has the scores)

        def chunk(i: int, delta: dict, finish: str | None = None, lp: Any = None) -> bytes:
            return shapes.sse(
                shapes.chat_chunk(rid, created, req.model, delta, finish, lp, index=i, null_usage=req.include_usage)
            )

        async def events() -> AsyncIterator[bytes]:
            for i in range(len(jobs)):
                yield chunk(i, {"role": "assistant", "content": ""})
            async for kind, i, payload in self._pump(jobs, turns, shared):
                if kind == "deltas":
                    for delta, lp in payload:
                        yield chunk(i, delta, None, lp)
                elif kind in ("keepalive", "error"):
                    yield payload
                elif kind == "end":
                    deltas, finish = turns[i].finish(limit)
                    for delta, lp in deltas:
                        yield chunk(i, delta, None, lp)
                    self.server.metrics.finished(finish)
                    if req.n == 1:  # before the client has the whole reply (and can send the next turn)
                        await run_in_threadpool(self._record_chat, req, prompt, turns[i])
                    yield chunk(i, {}, finish, turns[i].pending.take())
                elif req.include_usage:  # all ended
                    use = shapes.usage(
                        n_prompt,
                        sum(t.completion_tokens for t in turns),
                        payload,
                        sum(t.reasoning_tokens for t in turns),
                    )
                    yield shapes.sse(shapes.usage_chunk(rid, created, req.model, "chat.completion.chunk", use))
            yield shapes.SSE_DONE

        return _JobStream(events(), jobs)

    async def completions(self, request: Request) -> Response:
        body = await read_json(request, self.server.settings)
        req = openai_request.parse_completion_request(body, self.server.model_names)
        engine = self.server.host.require_engine()
        texts, prompts = [], []
        for i, prompt in enumerate(req.prompts):
            param = "prompt" if len(req.prompts) == 1 else f"prompt[{i}]"
            if isinstance(prompt, str):
                texts.append(prompt)
                prompts.append(await self.admission.encode_async(prompt, param))
            else:
                fields.check_token_ids(prompt, engine.tokenizer.vocab_size, param)
                prompts.append(list(prompt))
                # the text is only needed to echo the prompt
                texts.append(await self.admission.off_loop(engine.tokenizer.decode, prompts[-1]) if req.echo else "")
        k = req.best_of  # generated per prompt; the best req.n of them are returned
        sampling = req.sampling
        if k > req.n and sampling.get("logprobs") is None:  # ranked by their logprobs: computed, not shown
            sampling = {**sampling, "logprobs": 0}
        jobs, limits, shared = self._submit(
            engine, prompts, sampling, req.max_tokens, "prompt", k, openai_request.COMPLETION_DEFAULT_MAX_TOKENS
        )
        prefixes = [texts[j // k] if req.echo else "" for j in range(len(jobs))]
        turns = [choice_turn.CompletionTurn(req, engine.tokenizer, len(prefix)) for prefix in prefixes]
        # each distinct prompt counted once (one given twice is prefilled once)
        rid, created, n_prompt = (
            shapes.new_id("cmpl"),
            int(time.time()),
            sum(len(ids) for ids in {tuple(p) for p in prompts}),
        )
        if not req.stream:
            done = await self._collect_finished(
                jobs, turns, shared, request, [limits[j // k] for j in range(len(jobs))]
            )
            if done is None:
                return Response(status_code=499)
            cached, finishes = done
            choices = []
            for i in range(len(prompts)):  # best_of: the n of highest cumulative logprob, best first
                group = range(i * k, (i + 1) * k)
                best = sorted(group, key=lambda j: -turns[j].cumulative_logprob)[: req.n] if k > req.n else group
                for rank, j in enumerate(best):
                    text = prefixes[j] + turns[j].text
                    choice = shapes.completion_choice(i * req.n + rank, text, finishes[j], turns[j].logprobs)
                    S.completion_extras({"choices": [choice]}, req, turns[j], engine.tokenizer)  # prompt logprobs
                    choices.append(choice)
            use = shapes.usage(n_prompt, sum(t.completion_tokens for t in turns), cached)
            return JSONResponse(shapes.completion_response_choices(rid, req.model, choices, use))

        def chunk(i: int, text: str, finish: str | None = None, lp: Any = None) -> bytes:
            return shapes.sse(
                shapes.completion_chunk(
                    rid, created, req.model, text, finish, lp, index=i, null_usage=req.include_usage
                )
            )

        async def events() -> AsyncIterator[bytes]:  # (streamed only with best_of == n: every job is a choice)
            # an echoed prompt waits for its logprobs (they come with the choice's first chunk)
            held = set(range(len(jobs))) if S.echoes_logprobs(req) else set()
            for i, prefix in enumerate(prefixes):
                if prefix and i not in held:
                    yield chunk(i, prefix)
            async for kind, i, payload in self._pump(jobs, turns, shared):
                if i in held and (turns[i].prompt_scores is not None or kind == "end"):
                    held.discard(i)
                    try:
                        lp = S.echo_logprobs(engine.tokenizer, S.scores(turns[i]), req.logprobs)
                    except APIError as err:
                        yield shapes.sse(err.to_dict())
                        break
                    yield chunk(i, prefixes[i], None, lp)
                if kind == "deltas":
                    for text, lp in payload:
                        yield chunk(i, text, None, lp)
                elif kind in ("keepalive", "error"):
                    yield payload
                elif kind == "end":
                    pieces, finish = turns[i].finish(limits[i // k])
                    for text, lp in pieces:
                        yield chunk(i, text, None, lp)
                    self.server.metrics.finished(finish)
                    yield chunk(i, "", finish)
                elif req.include_usage:  # all ended
                    use = shapes.usage(n_prompt, sum(t.completion_tokens for t in turns), payload)
                    yield shapes.sse(shapes.usage_chunk(rid, created, req.model, "text_completion", use))
            yield shapes.SSE_DONE

        return _JobStream(events(), jobs)

    async def _collect_finished(
        self, jobs: list[Job], turns: list[Any], events: LoopEvents, request: Request, limits: list[int]
    ) -> tuple[Any, list[str]] | None:
        """A non-streamed reply: (cached prompt tokens, each choice's finish reason) once every job has ended,
        None if the client left."""
        try:
            cached = await self._collect(jobs, turns, events, request)
        finally:
            for job in jobs:
                job.cancel.set()
        if cached is _GONE:
            return None
        finishes = [turn.finish(limit)[1] for turn, limit in zip(turns, limits)]
        for finish in finishes:
            self.server.metrics.finished(finish)
        return cached, finishes

    async def _collect(self, jobs: list[Job], turns: list[Any], events: LoopEvents, request: Request) -> Any:
        """Whole replies for a non-streamed request: the cached-prompt token count (`_cached`), or `_GONE`
        when the client left (its jobs are cancelled). An engine error is raised as the client's 400 or a 500."""
        ended: dict[int, Any] = {}
        asked = time.monotonic()
        while len(ended) < len(jobs):
            item = await events.get(0.25)
            if time.monotonic() - asked >= 0.25:  # every 0.25 s, also while tokens keep coming
                if await request.is_disconnected():
                    return _GONE
                asked = time.monotonic()
            if item is None:
                continue
            i, (kind, payload) = item
            if kind == "chunk":
                turns[i].feed(payload)
                if turns[i].stopped:
                    jobs[i].cancel.set()  # our stop string: the engine need not go on
            elif kind == "error":
                raise _engine_error(*payload)
            elif kind == "end":
                ended[i] = payload
        return _cached(jobs, ended)

    async def _pump(self, jobs: list[Job], turns: list[Any], events: LoopEvents) -> AsyncIterator[tuple[str, int, Any]]:
        """The worker's events for a streamed reply, as (kind, choice index, payload): ("deltas", i, [...]),
        ("keepalive", -1, comment bytes) during long silences (a prefill of minutes), ("error", -1, SSE error event
        bytes) and then the stream's end, or ("end", i, cached prompt tokens) as each choice ends and then
        ("done", -1, the cached prompt tokens, `_cached`) once all have."""
        interval = self.server.keepalive_interval
        last_write = time.monotonic()
        ended: dict[int, Any] = {}
        while len(ended) < len(jobs):
            item = await events.get(min(0.25, interval))
            if item is None:
                if time.monotonic() - last_write >= interval:
                    progress = next((job.progress for job in jobs if job.progress), None)
                    note = f"keep-alive prefill {progress[0]}/{progress[1]}" if progress else "keep-alive"
                    yield "keepalive", -1, shapes.sse_comment(note)
                    last_write = time.monotonic()
                continue
            i, (kind, payload) = item
            if kind == "chunk":
                deltas = turns[i].feed(payload)
                if turns[i].stopped:
                    jobs[i].cancel.set()
                if deltas:
                    yield "deltas", i, deltas
                    last_write = time.monotonic()
            elif kind == "error":
                err = _engine_error(*payload)
                self.server.metrics.error(err.status)
                yield "error", -1, shapes.sse(err.to_dict())
                return
            elif kind == "end":
                ended[i] = payload
                yield "end", i, payload
        yield "done", -1, _cached(jobs, ended)


_GONE = object()


def _cached(jobs: list[Job], ended: dict[int, Any]) -> int | None:
    """Cached prompt tokens of a request: those of each prompt's first choice (the one that ran the prompt)."""
    firsts = [ended[k] for k, job in enumerate(jobs) if job.choice == 0]
    return None if all(c is None for c in firsts) else sum(c or 0 for c in firsts)


def _engine_error(status: int, message: str, param: str | None = None) -> APIError:
    if status == 400:
        return bad_request(message, param)
    if status == 503:
        return APIError(503, message, "unavailable_error", code="shutting_down")
    return APIError(status, message, "server_error", code="generation_failed")


def _left_open(messages: Any) -> Any:
    """`/tokenize`'s `continue_final_message`: the last message, an assistant one rendered without its EOS (the
    encoder's prefix completion), so the ids end where the model would go on writing it."""
    last = messages[-1] if isinstance(messages, list) and messages else None
    return {**last, "prefix": True} if isinstance(last, dict) and last.get("role") == "assistant" else last


def _token_strs(tokenizer: Any, ids: list[int]) -> list[str | None]:
    """vLLM's `return_token_strs`: each id's vocabulary entry (byte-level, as `convert_ids_to_tokens` gives it)."""
    return [tokenizer.id_to_token(i) for i in ids]
