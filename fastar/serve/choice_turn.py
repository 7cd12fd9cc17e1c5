"""One choice's reply as its chunks arrive: `ChatTurn` (stop strings, then the DSV4 parser splitting reasoning
from content, and the DSML tool calls streamed as the model writes them: `fastar.serve.cut_calls`) and
`CompletionTurn` (raw text, logprobs, the cumulative logprob `best_of` ranks by), each giving deltas and the
finish reason; `StopFilter` holds back streamed text that could start a stop string, so a partial one never
reaches the client, and cuts the text at the first complete one.

Does not own: the shapes the deltas go into (`fastar.serve.shapes`), the request (`fastar.serve.openai_request`).
Pure Python; never imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from fastar.encoding import EOS, THINK_END, StreamParser
from fastar.engine.stops import StopStrings
from fastar.serve import openai_request, shapes
from fastar.serve.cut_calls import ToolBlock


class StopFilter(StopStrings):
    """`StopStrings` for the response builders: `feed` returns just the text now safe to emit (the stop string is
    never shown, and after a hit everything is swallowed); `hit` says whether one was found."""

    def feed(self, text: str, match: bool = True) -> str:
        return super().feed(text, match)[0]


@dataclass(slots=True)
class PendingLogprobs:
    """Logprob entries of tokens whose text is still held back; they ride on the next emitted delta."""

    entries: list[dict] = field(default_factory=list)

    def take(self) -> list[dict] | None:
        out, self.entries = self.entries, []
        return out or None


def _finish_reason(engine_finish: str | None, stopped: bool, tokens: int, max_tokens: int) -> str:
    if stopped:
        return "stop"
    if engine_finish == "length" or (engine_finish != "stop" and tokens >= max_tokens):
        return "length"
    return "stop"


class ChatTurn:
    """An assistant turn as it streams: stop strings first, then the DSV4 parser that splits reasoning from
    content, and the tool-call block followed by a `ToolBlock` (each call's name, then its argument JSON piece by
    piece, as OpenAI streams them). `feed()`/`finish()` return `[(delta, logprobs | None)]`."""

    def __init__(self, req: openai_request.ChatRequest, tokenizer: Any, reasoning_field: str) -> None:
        self.req, self.tokenizer, self.reasoning_field = req, tokenizer, reasoning_field
        self.stops = StopFilter(req.sampling["stop"], req.thinking)  # the answer's, as the engine matches them
        self.parser = StreamParser(req.thinking, single_call=not req.parallel_tool_calls)
        self.pending = PendingLogprobs()
        self.logprobs: list[dict] = []
        self.prompt_scores: Any = None  # `PromptLogprobs` from the first chunk, when asked for
        self.generated: list[int] = []  # the sampled ids up to the stop (the replay cache records them)
        self.reasoning_tokens = 0  # of the completion tokens, those up to and including `</think>`
        self._in_reasoning = req.thinking
        self._tail = ""  # the last generated text, where `</think>` is looked for
        self.engine_finish: str | None = None
        self.engine_stop: str | None = None  # the stop string the engine cut (its text never reaches us)
        self.block = ToolBlock()
        self.content = ""
        self.reasoning: str | None = None
        self.tool_calls: list[dict] = []

    @property
    def stopped(self) -> bool:
        """A stop string was hit, or the one tool call allowed is complete: the engine need not go on."""
        return self.stops.hit or self.parser.cut

    def feed(self, chunk: Any) -> list[tuple[dict, list[dict] | None]]:
        if chunk.prompt_logprobs is not None:
            self.prompt_scores = chunk.prompt_logprobs
        if self.stopped:
            return []  # the engine may run a token past the stop before it sees the cancel
        if chunk.token is not None:
            self.generated.append(chunk.token)
            self.reasoning_tokens += self._in_reasoning
            if self.req.logprobs:
                entry = shapes.chat_logprob_entry(
                    self.tokenizer, chunk.token, chunk.logprob, chunk.top_logprobs, self.req.top_logprobs
                )
                self.pending.entries.append(entry)
                self.logprobs.append(entry)
        if self._in_reasoning:
            self._tail = (self._tail + chunk.text)[-len(THINK_END) - len(chunk.text) :]
            self._in_reasoning = THINK_END not in self._tail
        if chunk.finish_reason:
            self.engine_finish = chunk.finish_reason
            self.engine_stop = chunk.stop_string
        # the first `min_tokens` tokens' text cannot end the reply (vLLM's `min_tokens`), as in the engine
        match = len(self.generated) > self.req.sampling.get("min_tokens", 0)
        events = self.parser.feed(self.stops.feed(chunk.text, match))
        return self._deltas([*events, *self.block.feed(self.parser)])

    def _deltas(self, events: list[tuple[str, Any]]) -> list[tuple[dict, list[dict] | None]]:
        """The parser's and the tool block's events as chat deltas, each with the logprobs held until then: text
        as `content` / the reasoning field; a tool call's start (index, id, type, name, empty arguments), then
        its argument pieces (one delta per run of pieces of one call)."""
        out: list[tuple[dict, list[dict] | None]] = []
        args_of = None  # the call whose argument pieces the last delta holds
        for kind, value in events:
            if kind == "tool_args":
                index, piece = value
                if index == args_of:
                    out[-1][0]["tool_calls"][0]["function"]["arguments"] += piece
                    continue
                delta, args_of = shapes.chat_tool_call_args(index, piece), index
            elif kind == "tool_start":
                delta, args_of = shapes.chat_tool_call_start(value["index"], value["id"], value["name"]), None
            elif kind == "tool_done":
                continue
            else:
                delta, args_of = {self.reasoning_field if kind == "reasoning" else "content": value}, None
            out.append((delta, self.pending.take()))
        return out

    def finish(self, max_tokens: int) -> tuple[list[tuple[dict, list[dict] | None]], str]:
        """The deltas still held back, what completes the streamed tool calls (a call the reply was cut inside is
        given with the arguments written so far, unclosed: `fastar.serve.cut_calls`), and the finish reason."""
        events = self.parser.feed(self.stops.flush())
        events += self.block.feed(self.parser)
        released = self.parser.flush()  # a block that does not parse comes back as content
        result = self.parser.finish()
        ended = self.engine_finish == "stop" and self.engine_stop is None and not self.stops.hit
        settled = self.block.settle(result.content, result.tool_calls, released, not ended)
        if not settled.dropped:  # held-back text, or a block's text that stands for no call
            events += released
        events += self.block.close(settled.tool_calls)
        self.content, self.reasoning, self.tool_calls = settled.content, result.reasoning, settled.tool_calls
        deltas = self._deltas(events)
        if settled.parsed:
            return deltas, "tool_calls"
        stopped = self.stops.hit or self.engine_stop is not None
        return deltas, _finish_reason(self.engine_finish, stopped, self.completion_tokens, max_tokens)

    @property
    def completion_tokens(self) -> int:
        return len(self.generated)

    def message(self) -> dict:
        return shapes.chat_message(self.content, self.reasoning, self.tool_calls, self.reasoning_field)


class CompletionTurn:
    """A raw completion as it streams: stop strings (EOS among them, so its text never shows) and logprobs."""

    def __init__(self, req: openai_request.CompletionRequest, tokenizer: Any, offset: int) -> None:
        self.req, self.tokenizer = req, tokenizer
        self.stops = StopFilter([*req.sampling["stop"], EOS])
        self.offset = offset
        self._pending: list[tuple[int, float | None, list]] = []
        self.logprobs: dict | None = (
            None
            if req.logprobs is None
            else {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        )
        self.prompt_scores: Any = None  # `PromptLogprobs` from the first chunk, when asked for
        self.completion_tokens = 0
        self.cumulative_logprob = 0.0  # of the generated tokens: what best_of ranks choices by
        self.engine_finish: str | None = None
        self.text = ""

    @property
    def stopped(self) -> bool:
        return self.stops.hit

    def _emit(self, text: str) -> list[tuple[str, dict | None]]:
        lp = None
        if self.req.logprobs is not None and self._pending:
            lp = shapes.completion_logprobs(self.tokenizer, self._pending, self.req.logprobs, self.offset)
            self._pending = []
            for key, values in lp.items():
                self.logprobs[key].extend(values)
        if not text and lp is None:
            return []
        self.text += text
        self.offset += len(text)
        return [(text, lp)]

    def feed(self, chunk: Any) -> list[tuple[str, dict | None]]:
        if chunk.prompt_logprobs is not None:
            self.prompt_scores = chunk.prompt_logprobs
        if self.stops.hit:
            return []
        if chunk.token is not None:
            self.completion_tokens += 1
            self.cumulative_logprob += chunk.logprob or 0.0
            self._pending.append((chunk.token, chunk.logprob, chunk.top_logprobs))
        if chunk.finish_reason:
            self.engine_finish = chunk.finish_reason
        text = self.stops.feed(chunk.text, self.completion_tokens > self.req.sampling.get("min_tokens", 0))
        return self._emit(text) if text else []

    def finish(self, max_tokens: int) -> tuple[list[tuple[str, dict | None]], str]:
        out = self._emit(self.stops.flush())
        return out, _finish_reason(self.engine_finish, self.stops.hit, self.completion_tokens, max_tokens)
