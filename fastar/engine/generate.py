"""Generation as a stack of generators: step -> stream -> text. CLI, library and server all consume `stream`.

Owns:
  * `GenerationChunk`, the one yield contract of streaming generation;
  * `generate_step(session, ids, params)` -> `(token, logprob, top_logprobs)`: prefill (with prefix reuse),
    then sample/decode forever; the consumer decides when to stop, so the last token is never run needlessly;
  * `stream_generate(...)` -> `GenerationChunk`: detokenizes (UTF-8 split across tokens is held until whole),
    applies stop tokens, stop strings (`StopStrings`: held back until decided, never leaked), max tokens, the
    context limit and cancellation, and reports usage on the last chunk;
  * `generate_token_ids`, a bare token loop from a fresh state (`Engine.generate_tokens`: no session, no
    detokenizing);
  * `generate_text` -> str, and `chat` -> `ChatResult` (the DeepSeek-V4 chat encoding in, reasoning / content /
    tool calls out).
Does not own: logits -> token (`sampling`), the timeline and prefix reuse (`session`), the chat format
(`fastar.encoding`), the forward pass.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Self

from ..encoding import ChatPrompt, EncodingError, StreamParser, encode_messages
from .sampling import Sampler, SamplingParams, ending_ids
from .session import Runner, Session
from .stops import StopStrings
from .thinking_budget import ThinkingBudget, next_token

if TYPE_CHECKING:
    from .prompt_logprobs import PromptLogprobs


@dataclass(slots=True)
class GenerationChunk:
    text: str  # newly completed text ("" while a UTF-8 sequence or stop string is pending)
    token: int | None = None  # the token that produced it (None on the final flush)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)
    finish_reason: str | None = None  # None while running; "stop" | "length" | "cancelled" on the last chunk
    # last chunk only: {"prompt_tokens", "completion_tokens", "cached_tokens"} (OpenAI usage names)
    usage: dict[str, int] | None = None
    stop_string: str | None = None  # last chunk only: the stop string that ended it (its text is not in any chunk)
    # first chunk only, when `SamplingParams.prompt_logprobs` asked for them (the scheduler computes them)
    prompt_logprobs: PromptLogprobs | None = None


def generate_step(
    session: Session,
    prompt_ids: list[int],
    params: SamplingParams,
    cancel: threading.Event | None = None,
    on_prefill_progress: Callable[[int, int], None] | None = None,
    eos_token_id: int | None = None,
) -> Iterator[tuple[int, float, list[tuple[int, float]]]]:
    """Yields `(token, logprob, top_logprobs)` forever (the caller stops). Each sampled token is appended to
    the session before it is yielded and only run through the model when the next one is asked for. Yields
    nothing when `cancel` is set during prefill. `eos_token_id`: what `min_tokens` bans with the stop token ids."""
    sampler = Sampler(params, prompt_ids, eos_token_id, session.vocab_size)
    budget = ThinkingBudget.of(params, session.tokenizer)
    logits = session.prefill(prompt_ids, cancel, on_prefill_progress, sampler.head_request())
    if logits is None:
        return
    while True:
        token, logprob, top = next_token(budget, sampler, logits)
        session.append(token)
        yield token, logprob, top
        logits = session.decode(sampler.head_request())


def stream_generate(
    session: Session,
    prompt: str | list[int],
    params: SamplingParams,
    *,
    eos_token_id: int,
    cancel: threading.Event | None = None,
    on_prefill_progress: Callable[[int, int], None] | None = None,
    steps: Callable | None = None,
) -> Iterator[GenerationChunk]:
    """Stream the continuation of `prompt` (text or ids) as chunks; the last chunk has `finish_reason` and
    `usage`. The prompt is checked when this is called, not at the first chunk: `PromptError` (empty, longer
    than the context, ids outside the vocabulary) comes before anything is sent. `steps` replaces
    `generate_step` (same signature and yields; `speculative.speculative_generate_step` with its drafter bound).
    A `SamplingError` for a token id beyond the vocabulary in `params` comes at the call as well."""
    ids = session.encode_prompt(prompt)
    session.check_prompt(ids)
    params.check_vocabulary(session.vocab_size)  # at the call too, as the prompt is (the `Sampler` checks it again)
    steps = steps or functools.partial(generate_step, eos_token_id=eos_token_id)
    return _stream(session, ids, params, eos_token_id, cancel, on_prefill_progress, steps)


def _stream(
    session: Session,
    ids: list[int],
    params: SamplingParams,
    eos_token_id: int,
    cancel: threading.Event | None,
    on_prefill_progress: Callable[[int, int], None] | None,
    step_fn: Callable,
) -> Iterator[GenerationChunk]:
    stats = session.stats
    stats.requests += 1
    stats.prompt_tokens += len(ids)
    chunks = ChunkMaker(session.tokenizer, params, eos_token_id, len(ids), session.context_length)
    if params.max_tokens == 0:
        yield chunks.empty()
        return
    claim = session.claim()
    steps = step_fn(session, ids, params, cancel, on_prefill_progress)
    try:
        for token, logprob, top in steps:
            stats.generated_tokens += 1
            chunk = chunks.feed(
                token,
                logprob,
                top,
                session.num_tokens,
                cancel is not None and cancel.is_set(),
                session.last_cached_tokens,
            )
            yield chunk
            if chunk.finish_reason is not None:
                return
            session.check_claim(claim)  # resumed: nothing else ran on the session meanwhile
        # generate_step ended without a token: cancelled during prefill
        yield chunks.cancelled(session.last_cached_tokens)
    finally:
        steps.close()
        session.release(claim)  # the timeline is the user's again (`Session.rewind`)


class ChunkMaker:
    """One request's sampled tokens -> `GenerationChunk`s: detokenizes (holding an unfinished UTF-8 character),
    applies stop tokens, stop strings, max tokens, the context limit and cancellation, and puts `usage` on the
    last chunk. Shared by `stream_generate` (one caller) and the step scheduler (`fastar.engine.scheduler`), so a
    request's chunks are the same whichever ran it."""

    def __init__(
        self, tokenizer, params: SamplingParams, eos_token_id: int, prompt_tokens: int, context_length: int
    ) -> None:
        self.params, self.prompt_tokens, self.context_length = params, prompt_tokens, context_length
        self.decoder = tokenizer.stream_decoder(params.skip_special_tokens) if tokenizer is not None else None
        self.stops = StopStrings(params.stop, params.thinking)  # in thinking mode, the answer's only
        self.stop_ids = ending_ids(params, eos_token_id)
        self.n = 0  # tokens fed

    def usage(self, cached_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.n, "cached_tokens": cached_tokens}

    def empty(self) -> GenerationChunk:
        """The only chunk of a request with max_tokens 0."""
        return GenerationChunk("", finish_reason="length", usage=self.usage(0))

    def cancelled(self, cached_tokens: int) -> GenerationChunk:
        """The last chunk of a request cancelled before its first token."""
        return GenerationChunk("", None, finish_reason="cancelled", usage=self.usage(cached_tokens))

    def feed(
        self,
        token: int,
        logprob: float,
        top: list[tuple[int, float]],
        num_tokens: int,
        cancel: bool,
        cached_tokens: int,
    ) -> GenerationChunk:
        """The chunk of a new token; `finish_reason` is set when it ends the request. `num_tokens`: the timeline's
        length with this token; `cancel`: whether cancellation was asked for."""
        self.n += 1
        reason = None
        if token in self.stop_ids:  # the stop token's own text is not part of the output
            text, reason = "", "stop"
        else:
            # the first `min_tokens` tokens' text cannot end the generation (a stop string in it is kept)
            text, hit = self.stops.feed(
                self.decoder.push(token) if self.decoder else "", self.n > self.params.min_tokens
            )
            if hit:
                return GenerationChunk(text, token, logprob, top, "stop", self.usage(cached_tokens), self.stops.matched)
            if self.n >= self.params.max_tokens or num_tokens >= self.context_length:
                reason = "length"
            elif cancel:
                reason = "cancelled"
        if reason is None:
            return GenerationChunk(text, token, logprob, top)
        # the end: release what is held (an unfinished character, a tail that did not become a stop string)
        more, hit = self.stops.feed(self.decoder.flush() if self.decoder else "", self.n > self.params.min_tokens)
        text += more + ("" if hit else self.stops.flush())
        return GenerationChunk(
            text,
            token,
            logprob,
            top,
            "stop" if self.stops.hit else reason,
            self.usage(cached_tokens),
            self.stops.matched,
        )

    def finish_cancelled(self, cached_tokens: int) -> GenerationChunk:
        """The last chunk of a request cancelled between tokens (after at least one): what was held back."""
        more, hit = self.stops.feed(self.decoder.flush() if self.decoder else "")
        text = more + ("" if hit else self.stops.flush())
        return GenerationChunk(
            text,
            None,
            finish_reason="stop" if self.stops.hit else "cancelled",
            usage=self.usage(cached_tokens),
            stop_string=self.stops.matched,
        )


def generate_token_ids(
    runner: Runner,
    prompt_ids: list[int],
    max_tokens: int,
    temperature: float,
    seed: int | None,
    eos_token_id: int,
    ignore_eos: bool = False,
    vocab_size: int | None = None,
) -> list[int]:
    """Greedy (temperature 0) or sampled continuation of `prompt_ids` from a fresh state; stops after `max_tokens`
    or at EOS (included in the output) unless `ignore_eos`. The tokens are a `Sampler`'s, as `stream_generate`'s
    with the same temperature and seed, and the steps ask the model for what it needs (`Sampler.head_request`)."""
    sampler = Sampler(SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed), vocab_size=vocab_size)
    state = runner.new_state()
    out: list[int] = []
    if max_tokens <= 0:
        return out
    logits = runner.prefill(list(prompt_ids), state, argmax_only=sampler.head_request())[-1]  # [V]
    while True:
        tok = sampler(logits)[0]
        out.append(tok)
        if len(out) >= max_tokens or (tok == eos_token_id and not ignore_eos):
            return out
        logits = runner.prefill([tok], state, argmax_only=sampler.head_request())[-1]


def generate_text(chunks: Iterator[GenerationChunk]) -> str:
    return "".join(c.text for c in chunks)


class ChatResult(str):
    """The assistant's reply: a `str` (the content) that also carries `.content`, `.reasoning` (None in chat
    mode), `.tool_calls`, `.finish_reason` and `.usage`; `to_message()` gives the OpenAI-style message."""

    content: str
    reasoning: str | None
    tool_calls: list[dict]
    finish_reason: str | None
    usage: dict[str, int] | None

    def __new__(
        cls,
        content: str,
        reasoning: str | None = None,
        tool_calls: list[dict] | None = None,
        finish_reason: str | None = None,
        usage: dict[str, int] | None = None,
    ) -> Self:
        self = super().__new__(cls, content)
        self.content, self.reasoning, self.tool_calls = content, reasoning, list(tool_calls or [])
        self.finish_reason, self.usage = finish_reason, usage
        return self

    def to_message(self) -> dict:
        msg: dict = {"role": "assistant", "content": self.content}
        if self.reasoning is not None:
            msg["reasoning_content"] = self.reasoning
        if self.tool_calls:
            msg["tool_calls"] = self.tool_calls
        return msg


def chat_prompt(
    messages: list[dict], thinking: bool = False, reasoning_effort: str | None = None, drop_thinking: bool = True
) -> ChatPrompt:
    """The DeepSeek-V4 prompt text of a conversation (BOS included, ending with the generation prompt), as a
    `ChatPrompt`: the tokenizer reads its content as plain text."""
    return encode_messages(
        messages,
        thinking_mode="thinking" if thinking else "chat",
        drop_thinking=drop_thinking,
        reasoning_effort=reasoning_effort,
    )


def chat(
    stream: Callable[[str], Iterator[GenerationChunk]],
    messages: list[dict],
    thinking: bool = False,
    reasoning_effort: str | None = None,
    drop_thinking: bool = True,
) -> ChatResult:
    """Encode `messages`, run them through `stream(prompt_text)` and parse the reply. A conversation must end with
    a user or tool message: V4 opens the reply after one, so after an assistant or system message the model would
    write on after its own EOS (an `EncodingError`, as the server's 400)."""
    prompt = chat_prompt(messages, thinking, reasoning_effort, drop_thinking)  # checks the messages
    role = messages[-1].get("role")
    if role in ("assistant", "system"):
        raise EncodingError(
            f"the conversation must end with a user or tool message, not {role!r} (the chat format has no reply "
            f"after it; assistant prefill is not supported)"
        )
    parser = StreamParser(thinking)
    last = None
    for chunk in stream(prompt):
        parser.feed(chunk.text)
        last = chunk
    parsed = parser.finish()
    return ChatResult(
        parsed.content,
        parsed.reasoning,
        parsed.tool_calls,
        last.finish_reason if last else None,
        last.usage if last else None,
    )
