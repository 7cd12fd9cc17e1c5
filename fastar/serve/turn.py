"""One assistant turn run through the worker, in API-neutral events, and the replay cache that keeps the
session prefix valid across tool calls. Shared by the Anthropic Messages and OpenAI Responses front-ends.

Owns:
  * `Backend`: what a front-end needs from the server, as plain values and callables (no HTTP framework):
    the engine getter, the worker's `submit`, the served model names, the thinking default, the keep-alive
    interval, the `ReplayCache`, and optionally the server's `Metrics`.
  * `ReplayCache`: exact replay. After a turn, the conversation text as the encoder would render it on the
    next request (prompt + the parsed assistant turn) is stored with the token ids the model really holds
    (prompt ids + the generated ids). A later prompt whose rendered text starts with a stored text is
    tokenized as those stored ids + the new tail. So a tool call the model wrote as `[1,2]` (re-rendered
    `[1, 2]`), or text it sampled in a non-canonical tokenization, still reuses the whole session prefix. The
    cut always falls at EOS, a special token, so the tail tokenizes on its own.
  * `prompt_ids()` / `record_reply()`: the two calls any route (chat completions too) makes to take part in
    exact replay: tokenize the rendered prompt through the cache, and record the finished reply.
  * `AssistantTurn`: encodes the conversation (through the replay cache), enqueues a `Job`, and turns the
    worker's events into `("reasoning", text)`, `("content", text)`, the tool-call events `("tool_start",
    {"index", "id", "name"})`, `("tool_args", (index, json_piece))`, `("tool_done", call)` (arguments streamed
    as the model writes them, `fastar.serve.toolstream`) and `("keepalive", progress)`; afterwards it holds the
    finish reason, the stop sequence hit, the usage numbers and the parsed reasoning/content/tool calls, and it
    records the turn in the replay cache.

Does not own: the API shapes (`fastar.serve.anthropic`, `fastar.serve.responses`, `fastar.serve.shapes`),
the chat encoding (`fastar.encoding`), the engine or its thread (`fastar.serve.worker`). Never imports torch.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from fastar.encoding import (
    BLOCK_CLOSE,
    EOS,
    INVOKE_END,
    THINK_END,
    TOOL_CALLS_START,
    ChatPrompt,
    StreamParser,
    encode_messages,
)
from fastar.serve import choice_turn, fields, grammar_fields
from fastar.serve.admission import Admission
from fastar.serve.api_error import APIError, bad_request
from fastar.serve.cut_calls import ToolBlock
from fastar.serve.metrics import Metrics
from fastar.serve.worker import Job

MAX_REPLAY_ENTRIES = 32


@dataclass(slots=True)
class Backend:
    """The server as the API front-ends see it.

    Args:
        engine: returns the loaded engine (`tokenizer`, `context_length`, optional `context_note`) or raises
            `APIError` 503 while it loads (the server's `EngineHost.require_engine`).
        submit: enqueues a `Job` on the one worker, or raises `APIError` 503 when the queue is full
            (`EngineHost.submit`).
        model_names: the served model name first; requests may name any of them.
        admission: the server's prompt admission (text and size checks, bounded tokenizing), shared with the
            OpenAI routes; by default one of its own over `engine`.
    """

    engine: Callable[[], Any]
    submit: Callable[[Job], None]
    model_names: tuple[str, ...] = ("deepseek-v4-flash",)
    default_thinking: bool = True
    default_effort: str | None = None  # with thinking on and no effort asked (`fastar serve --reasoning-default`)
    keepalive_interval: float = 5.0
    replay: ReplayCache = field(default_factory=lambda: ReplayCache())
    metrics: Metrics | None = None
    admission: Admission | None = None

    def __post_init__(self) -> None:
        if self.admission is None:
            self.admission = Admission(self.engine)


class ReplayCache:
    """Rendered conversation text -> the token ids the model holds for it; the last `size` turns, thread-safe."""

    def __init__(self, size: int = MAX_REPLAY_ENTRIES) -> None:
        self.size = size
        self._entries: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def encode(self, tokenizer: Any, text: str) -> list[int]:
        """Token ids of a rendered prompt: the longest stored prefix's real ids, then the tail tokenized. A
        prefix is used only where the cut falls at EOS (a special token), so the tail tokenizes on its own, and
        where the prompt has the stored text's template and content parts there, not only its characters (a
        message spelling a recorded conversation is content, never the control tokens the model held for it)."""
        with self._lock:
            usable = [
                t
                for t in self._entries
                if text.startswith(t)
                and (t.endswith(EOS) or text.startswith(EOS, len(t)))
                and _parts(text[: len(t)]) == _parts(t)
            ]
            best = max(usable, key=len, default="")
            if best:
                self._entries.move_to_end(best)
                ids = list(self._entries[best])
        if not best:
            return list(tokenizer.encode(text))
        return ids + (list(tokenizer.encode(text[len(best) :])) if len(text) > len(best) else [])

    def record(self, text: str, ids: list[int]) -> None:
        with self._lock:
            self._entries.pop(text, None)  # a dict keeps its old key: the same text with other parts would stay
            self._entries[text] = list(ids)
            self._entries.move_to_end(text)
            while len(self._entries) > self.size:
                self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


def _parts(text: str) -> tuple[tuple[str, bool], ...]:
    """A text's template and content parts, as the tokenizer reads them (a plain `str` is all template)."""
    return text.segments if isinstance(text, ChatPrompt) else ((str(text), False),)


@dataclass(slots=True)
class Conversation:
    """A request in the encoder's terms: OpenAI-style messages (tools on the system message) and the mode."""

    messages: list[dict]
    thinking: bool
    reasoning_effort: str | None = None
    drop_thinking: bool = True
    param: str = "messages"  # the request field the conversation came from, for errors

    def render(self, extra: list[dict] | None = None) -> str:
        try:
            return encode_messages(
                self.messages + (extra or []),
                "thinking" if self.thinking else "chat",
                self.drop_thinking,
                self.reasoning_effort,
            )
        except (ValueError, TypeError) as err:  # EncodingError is a ValueError
            raise bad_request(str(err), self.param) from None


class ClientDisconnected(Exception):
    """The client of a non-streaming request went away; its generation was cancelled."""


class GenerationFailed(Exception):
    """The worker reported an error for this turn (status 400: the engine refused the prompt)."""

    def __init__(self, status: int, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param

    def api_error(self) -> APIError:
        if self.status == 400:
            return bad_request(self.message, self.param)
        return APIError(self.status, self.message, "server_error", code="generation_failed")


def prompt_ids(backend: Backend, conv: Conversation) -> tuple[str, list[int]]:
    """The rendered prompt and its ids: admitted (`fastar.serve.admission`), then tokenized through the replay
    cache (`count_tokens` uses this too). Blocking: the agent routes call it from the thread pool."""
    text = conv.render()
    tokenizer = backend.engine().tokenizer
    assert backend.admission is not None  # set in __post_init__
    return text, backend.admission.encode(text, conv.param, lambda t: backend.replay.encode(tokenizer, t))


class AssistantTurn:
    """One generation: `events()` streams it; afterwards the fields below describe the finished turn."""

    def __init__(
        self,
        backend: Backend,
        conv: Conversation,
        sampling: dict[str, Any],
        max_tokens: int | None,
        fit_context: bool = False,
        parallel_tool_calls: bool = True,
        max_tokens_param: str = "max_tokens",
        prompt: tuple[str, list[int]] | None = None,
    ) -> None:
        """`fit_context`: a `max_tokens` beyond the room the prompt leaves is cut to that room (the API then says
        the context ended the reply); otherwise it is a 400. A prompt that does not fit is a 400 either way.
        `parallel_tool_calls` False: the reply ends once its first tool call is complete (at most one call).
        `max_tokens_param`: the request's name for `max_tokens` (Responses: `max_output_tokens`), for errors.
        `prompt`: `conv`'s rendered text and ids where the caller has them (`prompt_ids`), else they are made here."""
        engine = backend.engine()
        self.backend, self.conv, self.tokenizer = backend, conv, engine.tokenizer
        self.prompt_text, self.prompt_ids = prompt if prompt is not None else prompt_ids(backend, conv)
        room = engine.context_length - len(self.prompt_ids)
        self.cut_to_context = fit_context and max_tokens is not None and 0 < room < max_tokens
        if self.cut_to_context:
            max_tokens = room
        self.limit = fields.resolve_max_tokens(
            len(self.prompt_ids),
            max_tokens,
            engine.context_length,
            engine.context_note,
            param=conv.param,
            budget_param=max_tokens_param,
        )
        self.stop_strings = list(sampling.get("stop") or [])
        self.stops = choice_turn.StopFilter(self.stop_strings, conv.thinking)  # the answer's, as the engine's
        self.parser = StreamParser(conv.thinking, single_call=not parallel_tool_calls)
        self.block = ToolBlock()
        self.generated: list[int] = []
        self.raw = ""  # the text as generated, stop strings included
        self.released = 0  # characters of `raw` passed by the stop filter
        self.reasoning_tokens = 0
        self._in_reasoning = conv.thinking
        self.engine_finish: str | None = None
        self.engine_stop: str | None = None
        self.cached_tokens: int | None = None
        self.finish_reason = "stop"  # "stop" | "length" | "tool_calls" | "stop_sequence"
        self.stop_sequence: str | None = None
        self.content, self.reasoning, self.tool_calls = "", None, []
        self.cut_input: dict | None = None  # the parameters written of a last tool call the cut left incomplete
        self.cut_call_id: str | None = None  # that call's id
        self.job = Job(
            self.prompt_ids, fields.make_sampling_params(grammar_fields.compiled_sampling(engine, sampling), self.limit)
        )
        backend.submit(self.job)

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def completion_tokens(self) -> int:
        return len(self.generated)

    def cancel(self) -> None:
        self.job.cancel.set()

    def events(self) -> Iterator[tuple[str, Any]]:
        """`("reasoning" | "content", text)`; per tool call `("tool_start", {"index", "id", "name"})`, then
        `("tool_args", (index, piece))` as the model writes it, then `("tool_done", call)` at the end (`call` as
        in `tool_calls`, complete or, where the reply was cut inside it, the incomplete call `cut_call_id`
        names: `fastar.serve.cut_calls`); and `("keepalive", (done, total) | None)` after each silent
        `keepalive_interval`. Raises `GenerationFailed`
        when the worker reports an error. Closing the iterator early cancels the generation."""
        try:
            while True:
                try:
                    kind, payload = self.job.events.get(timeout=self.backend.keepalive_interval)
                except queue.Empty:
                    yield "keepalive", self.job.progress
                    continue
                if kind == "chunk":
                    yield from self._feed(payload)
                elif kind == "error":
                    if self.backend.metrics is not None:
                        self.backend.metrics.error(payload[0])
                    raise GenerationFailed(*payload)
                elif kind == "end":
                    self.cached_tokens = payload
                    break
            yield from self._finish()
        finally:
            self.job.cancel.set()  # done, failed or abandoned: nobody reads this job any more

    def run(self, disconnected: Callable[[], bool] | None = None) -> AssistantTurn:
        """Drain `events()` (the non-streaming replies). `disconnected`, asked at most every 0.25 s, says the
        client has gone: the generation is cancelled and `ClientDisconnected` raised."""
        last = time.monotonic()
        for _ in self.events():
            if disconnected is not None and time.monotonic() - last >= 0.25:
                last = time.monotonic()
                if disconnected():
                    self.cancel()
                    raise ClientDisconnected
        return self

    @property
    def stopped(self) -> bool:
        """A stop string was hit, or the one tool call allowed is complete: the engine need not go on."""
        return self.stops.hit or self.parser.cut

    def _feed(self, chunk: Any) -> Iterator[tuple[str, str]]:
        if self.stopped:
            return  # the engine may run a token past the stop before it sees the cancel
        if chunk.token is not None:
            self.generated.append(chunk.token)
            self.reasoning_tokens += self._in_reasoning
        if chunk.finish_reason:
            self.engine_finish = chunk.finish_reason
            self.engine_stop = chunk.stop_string  # the engine cut a stop string (its text never reaches us)
        self.raw += chunk.text
        if self._in_reasoning and THINK_END in self.raw[-len(chunk.text) - len(THINK_END) :]:
            self._in_reasoning = False
        text = self.stops.feed(chunk.text)
        self.released += len(text)
        yield from self.parser.feed(text)
        if self.stopped:
            self.job.cancel.set()
        yield from self.block.feed(self.parser)

    def _finish(self) -> Iterator[tuple[str, Any]]:
        tail = self.stops.flush()
        self.released += len(tail)
        yield from self.parser.feed(tail)
        yield from self.block.feed(self.parser)
        released = self.parser.flush()  # a block that does not parse comes back as content
        result = self.parser.finish()
        stop_sequence = None
        if self.stops.hit:
            rest = self.raw[self.released :]
            stop_sequence = next((s for s in self.stop_strings if rest.startswith(s)), None)
        elif self.engine_stop is not None:
            stop_sequence = self.engine_stop
        ended = self.engine_finish == "stop" and stop_sequence is None and not self.stops.hit
        settled = self.block.settle(result.content, result.tool_calls, released, not ended)
        self.content, self.reasoning, self.tool_calls = settled.content, result.reasoning, settled.tool_calls
        self.cut_input, self.cut_call_id = settled.cut_input, settled.cut_call_id
        yield from self.block.close(self.tool_calls)  # the streamed calls, completed and closed
        if not settled.dropped:  # held-back text, or a block's text that stands for no call
            yield from released
        if settled.parsed:  # (a stop string after the closed block is no stop reason: the calls are)
            self.finish_reason = "tool_calls"
        elif self.stops.hit or stop_sequence is not None:
            self.finish_reason, self.stop_sequence = "stop_sequence", stop_sequence
        elif self.engine_finish == "length" or (self.engine_finish != "stop" and self.completion_tokens >= self.limit):
            self.finish_reason = "length"
        else:
            self.finish_reason = "stop"
        if self.backend.metrics is not None:
            self.backend.metrics.finished("stop" if self.finish_reason == "stop_sequence" else self.finish_reason)
        self._record()

    def message(self) -> dict:
        """The assistant message in the encoder's (OpenAI) shape, as a client would send it back."""
        msg: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg

    def _record(self) -> None:
        record_reply(
            self.backend.replay,
            self.tokenizer,
            self.conv,
            self.prompt_text,
            self.prompt_ids,
            self.generated,
            self.message(),
            stopped=self.stops.hit,
            cut_after_call=self.parser.cut,
        )


def record_reply(
    replay: ReplayCache,
    tokenizer: Any,
    conv: Conversation,
    prompt_text: str,
    prompt_ids: list[int],
    generated: list[int],
    message: dict,
    stopped: bool = False,
    cut_after_call: bool = False,
) -> None:
    """Remember the real ids of a finished reply under the text its conversation's next request will render.

    For any route that tokenizes through `replay` (`prompt_ids(backend, conv)`; chat completions through the
    server's `replay`, which its `Backend` shares): `message`
    is the assistant message as returned to the client (encoder shape), `generated` the sampled token ids,
    `stopped` whether a stop string cut the text. A turn that ended with EOS is stored under its canonical
    rendering even where that differs from what was generated (DSML spacing): the parsed turn means the same.
    A turn cut short (max_tokens) is stored without the EOS the rendering adds, and only when the rendering is
    the generated text itself (a cut thinking block or tool call renders differently from what the model
    holds), with or without the special tokens a reply skips (`skip_special_tokens`: the model holds them where
    the client saw no text, as it holds the canonical DSML). A stop-string cut is not stored: the model holds
    tokens the client never saw. A turn `cut_after_call` (parallel tool calls disabled: the reply ended with its
    first call's `</｜DSML｜invoke>`, the block closed there) is stored under its canonical rendering with the ids
    the model holds, then those of the block's closing markup and EOS, which it never wrote (less what the token
    that ended the call already held of it; a token that held anything else is not stored)."""
    if stopped or not generated:
        return
    try:
        text = conv.render([message])
    except APIError:
        return
    if not text.startswith(prompt_text) or not text.endswith(EOS):
        return
    ids = prompt_ids + generated
    if cut_after_call:
        held = tokenizer.decode(generated)
        block = held.find(TOOL_CALLS_START)
        end = held.find(INVOKE_END, block) if block >= 0 else -1
        past = held[end + len(INVOKE_END) :]  # what the call's last token held beyond it
        if end >= 0 and text.endswith(BLOCK_CLOSE + EOS) and BLOCK_CLOSE.startswith(past):
            rest = text[len(text) - len(EOS) - len(BLOCK_CLOSE) + len(past) :]  # template parts: their tokens
            replay.record(text, ids + list(tokenizer.encode(rest)))
        return
    if generated[-1] == tokenizer.eos_id:
        replay.record(text, ids)
    else:  # the reply as the client got it: with its special tokens' text, or without (skip_special_tokens)
        tail = text[len(prompt_text) : -len(EOS)]
        if tail in (tokenizer.decode(generated), tokenizer.decode(generated, skip_special_tokens=True)):
            replay.record(text[: -len(EOS)], ids)
