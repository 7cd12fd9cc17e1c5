"""Prompt admission: the one path from a request's prompt text to token ids, for every route that tokenizes.

Owns `Admission`, which chat completions, completions, `/tokenize`, Responses, Anthropic Messages and
`count_tokens` all go through, in this order:
  1. the text boundary (`fastar.engine.tokenizer.check_text`): a prompt that is not valid Unicode (a lone
     surrogate, sent as its UTF-8 bytes or as an escape) is a `400 invalid_unicode` naming the character;
  2. the size bound, before tokenizing: a prompt of more characters than the context length times the
     tokenizer's longest token (in bytes) cannot fit whatever it says, and is a `400 context_length_exceeded`;
  3. tokenizing in a worker thread, at most `at_once` prompts at a time across every route (a semaphore the
     blocking agent routes share with the async OpenAI routes), and the freed heap handed back to the OS after
     a prompt of a megabyte or more.

Does not own: rendering a conversation into prompt text (`fastar.encoding`, `fastar.serve.turn`), the replay
cache (`fastar.serve.turn`), the token count against the context after tokenizing (`fields.resolve_max_tokens`).
Never imports torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from functools import partial
from typing import Any

import anyio

from fastar.engine.tokenizer import InvalidText, check_text
from fastar.serve.api_error import ContextOverflow, bad_request
from fastar.serve.heap import HeapTrimmer

TRIM_AFTER_CHARS = 1 << 20  # give the heap back after tokenizing a prompt this long
TOKENIZE_AT_ONCE = 2  # prompts tokenized at the same time, all routes together: bounds their peak memory


class Admission:
    """Checks and tokenizes prompts for one engine.

    Args:
        engine: returns the loaded engine (`tokenizer` with `encode` and `max_token_bytes()`, `context_length`)
            or raises `APIError` 503 while it loads.
        at_once: prompts tokenized at the same time, whichever routes they came from.
        heap: trims the heap after a long prompt (the server's, shared with its worker).
    """

    def __init__(
        self, engine: Callable[[], Any], at_once: int = TOKENIZE_AT_ONCE, heap: HeapTrimmer | None = None
    ) -> None:
        self._engine = engine
        self._heap = heap if heap is not None else HeapTrimmer()
        self._at_once = at_once
        self._slots = threading.BoundedSemaphore(at_once)
        self._limiter: anyio.CapacityLimiter | None = None
        self._longest: int | None = None

    def max_token_bytes(self) -> int:
        if self._longest is None:
            self._longest = int(self._engine().tokenizer.max_token_bytes())
        return self._longest

    def check(self, text: str, param: str) -> None:
        """The checks that need no tokenizer run: valid Unicode, and no more characters than could fit."""
        try:
            check_text(text, f"'{param}'")
        except InvalidText as err:
            raise bad_request(str(err), param, "invalid_unicode") from None
        ctx, longest = self._engine().context_length, self.max_token_bytes()
        # Every character is at least one UTF-8 byte and no token covers more than `longest` bytes, so a
        # prompt of more than ctx * longest characters needs more than ctx tokens: no need to tokenize it.
        if len(text) > ctx * longest:
            raise ContextOverflow(
                f"This model's maximum context length is {ctx} tokens, but the prompt is {len(text)} characters "
                f"(more than {ctx} tokens of at most {longest} bytes each). Please shorten the prompt.",
                param,
                None,
                ctx,
            )

    def encode(self, text: str, param: str, encode: Callable[[str], list[int]] | None = None) -> list[int]:
        """Blocking (call it from a worker thread): `check`, then the ids of `text` by `encode` (default: the
        engine's tokenizer; the agent routes pass their replay cache's), at most `at_once` at a time."""
        self.check(text, param)
        tokenize = encode or self._engine().tokenizer.encode
        with self._slots:
            ids = list(tokenize(text))
        if len(text) >= TRIM_AFTER_CHARS:
            self._heap.now()
        return ids

    async def encode_async(self, text: str, param: str, encode: Callable[[str], list[int]] | None = None) -> list[int]:
        """`encode` off the event loop. The limiter keeps waiting prompts from holding threads of the pool."""
        return await self.off_loop(self.encode, text, param, encode)

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` in a worker thread, under the same bound (rendering a conversation, decoding ids)."""
        if self._limiter is None:  # created on the loop's thread
            self._limiter = anyio.CapacityLimiter(self._at_once)
        return await anyio.to_thread.run_sync(partial(fn, *args), limiter=self._limiter)
