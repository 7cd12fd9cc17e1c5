"""Sampling: the parameters of one generation and the pure functions that turn logits into a token.

Owns: `SamplingParams` (validated once, at the boundary), the logits processors (temperature, top-k, top-p,
min-p; a request's logit bias and penalties, `fastar.engine.logit_adjust`, come before them all) and `Sampler`,
which turns one position's logits into `(token, logprob, top_logprobs)`. Does not touch the model, the tokenizer or
text: stop strings and stop tokens are decided by `fastar.engine.generate`.

Logprobs are those of the model's own distribution (log-softmax of the raw logits, before temperature and
truncation), as vLLM and the OpenAI API report them, so they do not change when sampling settings do. That holds
under a grammar too (`grammar`, constrained decoding): the mask sets the tokens it forbids to -inf before
temperature, top-k/top-p/min-p and the draw (greedy: the argmax of what is allowed), and the logprobs and
top_logprobs reported are still the unmasked model's, so a token the grammar forced shows how likely the model
found it, and an alternative listed may be one the grammar ruled out. A request without a grammar does no mask work.
Sampling draws on the CPU from a `torch.Generator` seeded by `seed`: the same seed gives the same tokens on
any device, and two generations never share random state. The draw is `fastar.engine.draw.race`'s (the argmax of
the processed logits plus Gumbel noise, one uniform per vocabulary entry and token) and the top-p nucleus
`fastar.engine.nucleus`'s (found among the largest probabilities); `apply_top_p` here is the nucleus by a sort of the
whole vocabulary, the reference its tests compare with. `min_tokens` (vLLM's): until that many tokens are generated, the
tokens that would end the generation (`ending_ids`: EOS and the request's stop token ids) are set to -inf with the
logit adjustments, before the grammar mask (a grammar that allows nothing else keeps them: it must end).
`banned_token_ids` are set to -inf for every token of the reply, before the grammar mask and whatever it allows
(a grammar that allows only banned tokens is a `SamplingError`, not a token outside it). A
screenable request with tokens banned keeps the LM head screen (`Sampler.head_request` gives a
`fastar.model.head_screen.Ban`: a row whose banned tokens could win takes the full head), so its tokens are the
same with or without it. A request sampled at a temperature, perhaps with a top-k, and
no top-p or min-p draws each token's noise before the step that computes its logits (`Sampler.head_request`), so the
model may screen its LM head for the rows that can win the race (`fastar.model.head_screen.Race`); the generator
gives the same numbers to the same tokens either way, so a seed's tokens do not depend on it.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, fields

import numpy as np
import torch

from ..errors import FastarError
from ..model.head_screen import MAX_RACE_TEMPERATURE, MAX_RACE_TOP_K, MIN_RACE_TEMPERATURE, Ban, HeadRequest, Race
from .constraint import CompiledGrammar
from .draw import gumbel, race
from .logit_adjust import LogitAdjust
from .nucleus import top_p

MAX_TOP_LOGPROBS = 20  # the OpenAI API's own cap on top_logprobs


def argmax(logits: torch.Tensor) -> int:
    """`int(torch.argmax(logits))` (one position's logits: the first largest value; NaN counts as largest). CPU
    float32 goes through numpy, whose SIMD argmax takes ~7 us over the 129k-entry vocabulary where torch's takes
    ~140 us (the greedy token of every decode step)."""
    if logits.dtype == torch.float32 and logits.is_cpu and not logits.requires_grad and logits.numel():
        return int(logits.detach().contiguous().numpy().argmax())
    return int(torch.argmax(logits))


class SamplingError(FastarError, ValueError):
    """A sampling parameter has a value no generation can run with (names the field and the value)."""


class UnknownParameter(SamplingError, TypeError):
    """A sampling keyword that is no parameter (a typo such as `max_token=`): a TypeError, as Python's own for an
    unexpected keyword argument (and mlx-lm's and llama-cpp-python's), and still a `SamplingError`."""


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    logprobs: int | None = None  # None = off; k >= 0 = chosen token's logprob plus k alternatives
    ignore_eos: bool = False
    # None = off; k >= 0 = every prompt token's logprob plus k alternatives (vLLM's name; the scheduler computes
    # them from its prefill, on the first chunk: `fastar.engine.prompt_logprobs`)
    prompt_logprobs: int | None = None
    grammar: CompiledGrammar | None = None  # constrained decoding (`fastar.engine.constraint`); None = free
    # thinking tokens before `</think>` is forced (None: no limit; `fastar.engine.thinking_budget`)
    thinking_budget: int | None = None
    # token id -> a number added to its logit before the draw (OpenAI's `logit_bias`; -100 all but bans a token,
    # +100 all but forces it); the logprobs reported stay the model's own
    logit_bias: dict[int, float] = field(default_factory=dict)
    # OpenAI's penalties over the generated tokens, and vLLM's over the prompt's and the generated ones (1 = off);
    # applied as `fastar.engine.logit_adjust` says, before the draw (greedy too)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # the tokens tokenizer.json marks special (BOS, EOS, pad, placeholders) give no text (vLLM's default)
    skip_special_tokens: bool = True
    # vLLM's: until this many tokens are generated, EOS and the stop token ids are not drawn and stop strings do not
    # end the generation (`ending_ids`; `fastar.engine.generate.ChunkMaker`)
    min_tokens: int = 0
    # tokens never drawn in this reply, thinking included (the server's `tool_choice` "none" bans the DSML marker
    # every tool call starts with); the LM head screen keeps serving such a request (`head_screen.Ban`)
    banned_token_ids: list[int] = field(default_factory=list)
    # the reply opens with reasoning (its prompt ends in thinking mode's `<think>`): stop strings are matched in the
    # answer only, from the end of the reasoning on (`fastar.engine.stops.StopStrings`); the reasoning is never cut
    thinking: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):  # OpenAI's `stop` is a string or a list
            self.stop = [self.stop]
        for name, kinds, want in (
            ("stop", (list, tuple), "a non-empty string or a list of non-empty strings"),
            ("stop_token_ids", (list, tuple), "a list of token ids"),
            ("logit_bias", (dict,), "a dict of token id -> finite number"),
            ("banned_token_ids", (list, tuple), "a list of token ids"),
        ):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), kinds):
                raise SamplingError(f"{name} must be {want}, got {getattr(self, name)!r}")
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        self.logit_bias = dict(self.logit_bias or {})
        self.banned_token_ids = list(self.banned_token_ids or [])

        def bad(name: str, want: str) -> None:
            raise SamplingError(f"{name} must be {want}, got {getattr(self, name)!r}")

        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v) -> bool:
            return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)

        if not is_int(self.max_tokens) or self.max_tokens < 0:
            bad("max_tokens", "an integer >= 0")
        if not is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            bad("min_tokens", f"an integer in [0, max_tokens ({self.max_tokens})]")
        if not is_num(self.temperature) or not 0 <= self.temperature < math.inf:
            bad("temperature", "a finite number >= 0")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            bad("top_p", "a number in (0, 1]")
        if not is_int(self.top_k) or self.top_k < 0:
            bad("top_k", "an integer >= 0 (0 = off)")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            bad("min_p", "a number in [0, 1]")
        if self.seed is not None and (not is_int(self.seed) or not -(2**63) <= self.seed < 2**64):
            bad("seed", "None or an integer in [-2**63, 2**64)")  # what a torch.Generator takes
        if not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "a non-empty string or a list of non-empty strings")
        if not all(is_int(t) and t >= 0 for t in self.stop_token_ids):
            bad("stop_token_ids", "a list of token ids")
        if not all(is_int(t) and t >= 0 for t in self.banned_token_ids):
            bad("banned_token_ids", "a list of token ids")
        self.banned_token_ids = sorted(set(self.banned_token_ids))
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_TOP_LOGPROBS):
            bad("logprobs", f"None or an integer in [0, {MAX_TOP_LOGPROBS}]")
        if self.thinking_budget is not None and (not is_int(self.thinking_budget) or self.thinking_budget < 0):
            bad("thinking_budget", "None or an integer >= 0")
        if not all(is_int(t) and t >= 0 and is_num(b) and math.isfinite(b) for t, b in self.logit_bias.items()):
            bad("logit_bias", "a dict of token id -> finite number")
        for name in ("presence_penalty", "frequency_penalty"):
            if not is_num(getattr(self, name)) or not -2.0 <= getattr(self, name) <= 2.0:
                bad(name, "a number in [-2, 2]")
        if not is_num(self.repetition_penalty) or not 0 < self.repetition_penalty < math.inf:
            bad("repetition_penalty", "a number > 0 (1 = off)")
        if self.grammar is not None and not isinstance(self.grammar, CompiledGrammar):
            bad("grammar", "None or a compiled grammar (Engine.compile_grammar)")
        for name in ("ignore_eos", "skip_special_tokens", "thinking"):
            if not isinstance(getattr(self, name), bool):
                bad(name, "true or false")
        if self.prompt_logprobs is not None and (
            not is_int(self.prompt_logprobs) or not 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS
        ):
            bad("prompt_logprobs", f"None or an integer in [0, {MAX_TOP_LOGPROBS}]")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @property
    def raced(self) -> bool:
        """Sampled at a temperature, perhaps among the top k, with nothing else that reshapes the distribution (top-p,
        min-p): the race's winner is decided by the logits of the rows that can win it (`Sampler.head_request`)."""
        return (
            not self.is_greedy
            and MIN_RACE_TEMPERATURE <= self.temperature <= MAX_RACE_TEMPERATURE
            and self.top_k <= MAX_RACE_TOP_K
            and self.top_p >= 1.0
            and self.min_p == 0.0
        )

    @property
    def adjusts_logits(self) -> bool:
        """A logit bias or a penalty: the tokens are drawn from logits other than the model's own."""
        return (
            bool(self.logit_bias)
            or bool(self.presence_penalty or self.frequency_penalty)
            or (self.repetition_penalty != 1.0)
        )

    @classmethod
    def from_kwargs(cls, **kw) -> SamplingParams:
        """Build from keyword arguments (the `Engine.generate(text, **sampling)` style). Accepts the common
        aliases `temp`, `max_new_tokens` and `max_completion_tokens`; an unknown name is an error, not ignored,
        because a typo in a library call should not silently sample differently."""
        aliases = {"temp": "temperature", "max_new_tokens": "max_tokens", "max_completion_tokens": "max_tokens"}
        names = {f.name for f in fields(cls)}
        args = {}
        for k, v in kw.items():
            k = aliases.get(k, k)
            if k not in names:
                near = difflib.get_close_matches(k, [*names, *aliases], n=1, cutoff=0.8)
                hint = f"did you mean {aliases.get(near[0], near[0])!r}? " if near else ""
                raise UnknownParameter(f"unknown sampling parameter {k!r} ({hint}known: {', '.join(sorted(names))})")
            args[k] = v
        return cls(**args)

    def check_vocabulary(self, vocab_size: int) -> None:
        """The token ids this request names (`logit_bias`, `stop_token_ids`, `banned_token_ids`) lie in the model's
        vocabulary [0, vocab_size): checked when the request is made, before its prompt runs (a `logit_bias` id
        beyond it was found only at the first token's draw, after the prefill; a stop or banned id was ignored)."""
        for name, ids in (
            ("logit_bias", self.logit_bias),
            ("stop_token_ids", self.stop_token_ids),
            ("banned_token_ids", self.banned_token_ids),
        ):
            bad = next((t for t in ids if t >= vocab_size), None)
            if bad is not None:
                raise SamplingError(f"{name} names token {bad}, beyond the {vocab_size} of the vocabulary")


# --- logits processors: [V] float32 -> [V] float32 with -inf where a token may not be drawn ---------------


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, float("-inf"))


def apply_top_p(logits: torch.Tensor, p: float) -> torch.Tensor:
    """Keep the smallest set of most likely tokens whose probability reaches p (the top token always stays): the
    reference, by a sort of the whole vocabulary (`fastar.engine.nucleus.top_p` finds the same set among the largest
    probabilities, and is what `processed_logits` takes)."""
    if p >= 1.0:
        return logits
    order = torch.sort(logits, descending=True).indices  # the logits' order: probabilities may round to ties
    probs = torch.softmax(logits, dim=-1)[order]
    # drop a token when the tokens before it already reach p (their running sum in float64), so the one that
    # crosses p is kept
    drop_sorted = (probs.double().cumsum(dim=-1) - probs.double()) >= p
    drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
    return logits.masked_fill(drop, float("-inf"))


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    if min_p <= 0.0:
        return logits
    logp = torch.log_softmax(logits, dim=-1)
    threshold = logp.max() + torch.log(torch.tensor(min_p))
    return logits.masked_fill(logp < threshold, float("-inf"))


def processed_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution actually sampled from (temperature, then top-k, top-p, min-p; vLLM's order)."""
    x = logits.float() / params.temperature
    if not torch.isfinite(x.max()):  # a temperature so small the division overflowed: its limit, the argmax
        x = torch.where(logits == logits.max(), 0.0, float("-inf"))
    x = apply_top_k(x, params.top_k)
    x = top_p(x, params.top_p)
    return apply_min_p(x, params.min_p)


class Sampler:
    """Turns one position's logits [V] into (token, logprob, top_logprobs), with its own random stream."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: Sequence[int] = (),
        eos_token_id: int | None = None,
        vocab_size: int | None = None,
    ) -> None:
        """`prompt_ids`: the prompt's tokens, which a repetition penalty counts as seen; `eos_token_id`: the model's
        EOS, which `min_tokens` bans with the stop token ids (`ending_ids`); `vocab_size`: the logits' length, where
        the caller knows it (the model's vocabulary): a race's noise can then be drawn before the first token's
        logits too (`head_request`), else from the second token on; the request's token ids are checked against
        it (`SamplingParams.check_vocabulary`)."""
        if vocab_size is not None:
            params.check_vocabulary(vocab_size)
        self.params = params
        self.taken = 0  # tokens drawn or forced so far
        self._ending = np.array(sorted(ending_ids(params, eos_token_id)) if params.min_tokens else [], np.int64)
        self._always = np.array(params.banned_token_ids, np.int64)  # `banned_token_ids`, sorted
        seed = params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1
        self.generator = torch.Generator(device="cpu").manual_seed(seed)  # this generation's random stream
        self.constraint = params.grammar.start() if params.grammar is not None else None
        self._vocab: int | None = vocab_size  # the logits' length, known from the first token on if not given
        self._noise: np.ndarray | None = None  # the next token's noise, drawn early by `head_request`
        self.adjust = None
        if params.adjusts_logits:
            self.adjust = LogitAdjust(
                prompt_ids,
                logit_bias=params.logit_bias,
                presence_penalty=params.presence_penalty,
                frequency_penalty=params.frequency_penalty,
                repetition_penalty=params.repetition_penalty,
            )

    def head_request(self) -> HeadRequest:
        """What the next token needs of the step that computes its logits (`DeepseekV4.forward`'s `argmax_only`):
        False, every logit; True, their argmax alone (greedy, `screenable`); a `Race` (sampled at a temperature,
        perhaps among the top k, once the vocabulary's size is known: given, or from the second token on), the argmax
        of its race, whose noise this draws now and the next call uses; a `Ban` of either where tokens are banned now
        (`banned_token_ids`, and `min_tokens`' ending tokens until it is reached): the argmax or race over the others.
        The model may then screen its LM head. The noise comes from the generator where the call would have drawn it
        (no other number is drawn between), so the tokens are the same whether or not the step asks."""
        p = self.params
        if not screenable(p):
            return False
        want: bool | Race = True
        if not p.is_greedy:
            if self._vocab is None:
                return False
            if self._noise is None:
                self._noise = gumbel(self._vocab, self.generator)
            want = Race(p.temperature, self._noise, p.top_k)
        banned = self._banned_now()
        return Ban(banned, want if isinstance(want, Race) else None) if banned.size else want

    def __call__(self, logits: torch.Tensor) -> tuple[int, float | None, list[tuple[int, float]]]:
        """Raises `ConstraintError` when the request's grammar parser fails (it ran out of its per-token fuel), and
        `SamplingError` when `logit_bias` names a token beyond the vocabulary or the grammar allows only banned
        tokens (`banned_token_ids`)."""
        logits = logits.reshape(-1).float().cpu()  # [V]; one host copy per token, needed for the text anyway
        p = self.params
        drawn = logits
        if self.adjust is not None:
            if self.adjust.largest_bias_id >= logits.numel():
                raise SamplingError(
                    f"logit_bias names token {self.adjust.largest_bias_id}, beyond the {logits.numel()} of the "
                    "vocabulary"
                )
            drawn = self.adjust.apply(logits)  # a new tensor: `logits` stays the model's
        if self._always.size:  # before the grammar's fallback below: these stay banned whatever it allows
            drawn = self._ban(drawn, self._always)
        free = drawn
        if self.banning:
            drawn = self._ban(drawn, self._ending)
        if self.constraint is not None:
            # np.where: the same values as masked_fill, measured several times faster on the 129k vocabulary
            allowed = self.constraint.allowed()
            masked = np.where(allowed, drawn.numpy(), np.float32(-np.inf))
            if drawn is not free and masked.max() == -np.inf:  # the grammar allows only what min_tokens bans
                masked = np.where(allowed, free.numpy(), np.float32(-np.inf))
            if self._always.size and masked.max() == -np.inf:  # not a token outside the grammar: a clear error
                raise SamplingError(
                    f"token {self.taken + 1}: the grammar allows only tokens this request bans (banned_token_ids)"
                )
            drawn = torch.from_numpy(masked)
        if p.is_greedy:
            token = argmax(drawn)
        else:
            token = race(processed_logits(drawn, p), self._take_noise(logits.numel()))
        self._advance(token)
        return report(logits, token, p)

    @property
    def banning(self) -> bool:
        """`min_tokens` not reached yet: the tokens that would end the generation may not be drawn."""
        return self.taken < self.params.min_tokens and self._ending.size > 0

    def _banned_now(self) -> np.ndarray:
        """The token ids the next draw may not take, sorted: `banned_token_ids`, and the ending ones while `banning`."""
        return np.union1d(self._always, self._ending) if self.banning else self._always

    @staticmethod
    def _ban(drawn: torch.Tensor, ids: np.ndarray) -> torch.Tensor:
        """A copy of `drawn` with the tokens `ids` (those within the vocabulary) at -inf."""
        out = drawn.clone()
        out[torch.from_numpy(ids[ids < out.numel()])] = float("-inf")
        return out

    def _take_noise(self, n: int) -> np.ndarray:
        """The noise of the token drawn now: `head_request`'s, or n values drawn here."""
        self._vocab = n
        noise, self._noise = self._noise, None
        if noise is None:
            return gumbel(n, self.generator)
        if noise.shape[0] != n:
            raise ValueError(f"{n} logits for a token whose noise has {noise.shape[0]} values")
        return noise

    def forced(self, logits: torch.Tensor, token: int) -> tuple[int, float | None, list[tuple[int, float]]]:
        """`token` put in place of a draw (a thinking budget's `</think>`): no random number is drawn (noise that
        `head_request` drew stays for the next token, which would have drawn it); the grammar, if any, advances over
        it as over a sampled token, and the penalties count it."""
        self._advance(token)
        return report(logits, token, self.params)

    def _advance(self, token: int) -> None:
        self.taken += 1
        if self.constraint is not None:
            self.constraint.advance(token)
        if self.adjust is not None:
            self.adjust.observe(token)


def ending_ids(params: SamplingParams, eos_token_id: int | None) -> set[int]:
    """The tokens that end a generation: the request's stop token ids, and EOS (when known) unless `ignore_eos`.
    Under a grammar EOS always ends the request, `ignore_eos` or not: the grammar allows EOS only where it may end,
    and once EOS is taken it is complete and allows nothing but EOS (which would repeat to max_tokens)."""
    free_eos = params.ignore_eos and params.grammar is None
    return set(params.stop_token_ids) | (set() if free_eos or eos_token_id is None else {eos_token_id})


def screenable(params: SamplingParams) -> bool:
    """A request whose tokens come from the logits' argmax, or a race over the logits at a temperature, perhaps among
    the top k (`SamplingParams.raced`), and that reports no logprob: no `logprobs`, nothing that adjusts the logits
    (bias, penalties), no grammar. Its decode steps may screen the LM head (`fastar.model.head_screen`), whose
    logits are exact only where they can hold the argmax or win the race; its chunks carry no logprob (None), on
    every path alike."""
    return (
        (params.is_greedy or params.raced)
        and params.logprobs is None
        and not params.adjusts_logits
        and params.grammar is None
    )


def report(
    logits: torch.Tensor, token: int, params: SamplingParams
) -> tuple[int, float | None, list[tuple[int, float]]]:
    """(token, its logprob, the top `params.logprobs` (id, logprob)) from one position's raw logits [V]: the model's
    own distribution, whatever chose the token (a `Sampler`, or speculative sampling's acceptance). No logprob
    (None) for a `screenable` request: its logits may be screened."""
    if screenable(params):
        return token, None, []
    logp = torch.log_softmax(logits.reshape(-1).float().cpu(), dim=-1)
    top: list[tuple[int, float]] = []
    if params.logprobs:
        vals, ids = torch.topk(logp, params.logprobs)
        top = [(int(i), float(v)) for i, v in zip(ids, vals)]
    return token, float(logp[token]), top
