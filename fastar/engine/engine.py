"""The engine: owns the weights, the model and the expert pager, and is the only object front-ends hold.

Owns: `load(path, numerics=..., **options) -> Engine`, and `Engine`: the public calls (`logits`, `prompt_logprobs`,
`perplexity`, `generate_tokens`, `generate`, `stream`, `chat`, `open_session`, `compile_grammar`, `stats`,
`warm_experts`, `close`), the state-level primitives sessions and drafters run on (`new_state`, `prefill`), the
tokenizer, the context length and the engine's own session. Does not own: opening the path (`source.py`), the
parts built from `load`'s options (`build.py`: the device, thread settings, the pager, the model), the expert pager's
budget, warm-up and usage profile (`pager.py`), the session's timeline and prefix reuse
(`session.py`), the generation loop and chat encoding (`generate.py`), speculative decoding (`speculative.py`), the
forward pass (`fastar.model`), the prompt scorer (`prompt_logprobs.py`), perplexity windows (`perplexity.py`)."""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable, Iterator

import numpy as np
import torch

from ..config import MAX_DEFAULT_CONTEXT
from ..contracts import ExpertProvider, WeightSource
from ..errors import ConfigError, EngineClosed, FastarError
from ..model.deepseek_v4 import PREFILL_SPAN_BYTES, Numerics, span_bytes_per_token
from ..model.head_screen import HeadRequest
from ..model.state import ModelState
from . import arguments, build, speculative
from .constraint import CompiledGrammar, Grammar, GrammarCompiler
from .generate import ChatResult, GenerationChunk, chat, generate_text, generate_token_ids, stream_generate
from .pacing import MAX_STALL
from .pager import ExpertWarming
from .perplexity import Perplexity, perplexity
from .prefix_cache import PrefixCache
from .prompt_logprobs import PromptLogprobs, check_prompt, score_prompt
from .sampling import SamplingParams
from .scheduler import Scheduler
from .session import IDS_ONLY, PromptError, Session, Stats
from .session import token_ids as token_ids_of
from .source import checked_reads, open_source
from .tokenizer import Tokenizer

log = logging.getLogger("fastar.engine")

# Positions a state can be truncated back by (prefix reuse, speculative rollback). Each retained position
# keeps its raw KV/compressor rows: ~384 KB for the full model in float32, so 2048 positions ~ 0.8 GB.
# Beyond it `truncate` raises StateError and the caller prefills again. None keeps everything.
DEFAULT_MAX_ROLLBACK = 2048


def load(path: str | os.PathLike | WeightSource, numerics: str | Numerics = "official", **options) -> Engine:
    """Open a model (`.fst` file, official checkpoint directory, or a `WeightSource`) as an `Engine`.

    Options:
      kernels: use the C kernels (default True).
      experts: an expert provider (default: the budgeted pager below).
      max_rollback: positions a state can be truncated back by (default DEFAULT_MAX_ROLLBACK; None: all).
      prefill_chunk: prompt tokens per forward (default 512: more tokens per expert per read; ~0.3 GB of
        temporaries at Flash widths). When the expert bank does not fit the RAM budget, a prefill forward takes a
        span of several chunks (`Engine.prefill_span`) whose experts are read once, with the same numbers.
      threads: the kernels' pool size, process-wide. With the kernels in use torch runs single-threaded (and
        glibc's malloc keeps freed memory for reuse); without them `threads` sets torch's.
      ram_budget: bytes (or "24G") of RAM for routed experts paged from the source; "auto" (default) derives
        it from available memory; None maps the whole file instead.
      cache_policy: "lrfu" (default) or "lru".
      direct_io: O_DIRECT expert reads, so the page cache holds no second copy (None, the default: wherever
        the file system supports it).
      lookahead: prefetch each next layer's experts guessed by its router.
      draft: "none" (default), "mtp", "dspark" or "auto": speculative decoding for `stream`
        (see `fastar.engine.speculative`).
      verify: check a `.fst`'s resident tensors against their xxh64 before use, and each expert record the
        first time it is read (default True); a mismatch is a FormatError naming the tensor or expert.
      device: "cpu" (the C kernels), "torch:cpu" (the accelerator tier's torch code on the CPU), "cuda" or
        "cuda:N" (experimental), "auto" (CUDA when present); None (default): "cpu" (`fastar.model.device`,
        docs/DEVICE.md).
      gpu_budget: bytes (or "20G") of device memory for routed experts on a device; "auto" (default): what is
        free after the resident weights less a reserve; 0: every routed expert on the CPU.
      head_screen: keep the LM head also as int8 so greedy decode steps (and those sampled without top-p or min-p)
        compute only the logits that can be the argmax (win the draw), exactly (default True; the C kernels on the
        CPU; +0.5 GB on Flash, taken from the "auto" RAM budget; `fastar.model.head_screen`).
      warm_experts: start the expert cache's warm-up (`Engine.warm_experts`) as soon as the cache exists, so the
        budget's worth of experts is read while the resident weights are read and checked, not after: True in
        file order, a folder following the usage profile saved there first; False (default): not during the load.
    """
    arguments.check_model(path)
    arguments.check_option_names(options, Engine.__init__)
    source = path if isinstance(path, WeightSource) else open_source(path)
    return Engine(source, numerics=numerics, **options)


def _digest(ident) -> str:
    return hashlib.sha256(json.dumps(ident, sort_keys=True, default=str).encode()).hexdigest()


class Engine:
    """A loaded model plus the decode loop."""

    def __init__(
        self,
        source: WeightSource,
        numerics: str | Numerics = "official",
        kernels: bool = True,
        experts: ExpertProvider | None = None,
        max_rollback: int | None = DEFAULT_MAX_ROLLBACK,
        prefill_chunk: int = 512,
        threads: int | None = None,
        draft: str | None = "none",
        ram_budget: int | str | None = "auto",
        cache_policy: str = "lrfu",
        direct_io: bool | None = None,
        lookahead: bool = False,
        verify: bool = True,
        device: str | None = None,
        gpu_budget: int | str | None = "auto",
        head_screen: bool = True,
        warm_experts: bool | str | os.PathLike = False,
    ) -> None:
        if not isinstance(source, WeightSource):
            raise TypeError(f"Engine takes an opened WeightSource, got {type(source).__name__}: use fastar.load(path)")
        arguments.check_load_options(
            {"kernels": kernels, "lookahead": lookahead, "verify": verify, "head_screen": head_screen},
            direct_io,
            {
                "max_rollback": (max_rollback, 0, True),
                "prefill_chunk": (prefill_chunk, 1, False),
                "threads": (threads, 1, True),
            },
            {"ram_budget": ram_budget, "gpu_budget": gpu_budget},
            {"draft": draft, "cache_policy": cache_policy},
        )
        arguments.check_warm_experts(warm_experts)
        arguments.check_load_names(numerics, draft, cache_policy)
        self.device = build.resolve_device(device, gpu_budget, draft)
        build.set_threads(kernels, threads)
        self.source = source
        self.config = source.config
        self.expert_cache = None
        self._closed = False
        # generation-side state, made on first use: the tokenizer, the engine's own session, its counters
        self._tokenizer: Tokenizer | None = None
        self._grammars: GrammarCompiler | None = None
        self._grammars_lock = threading.Lock()
        self._session: Session | None = None
        self._context_length: int | None = None  # None: the default (see `context_length`)
        self._stats = Stats()
        self._fingerprint_hex: str | None = None
        if experts is None:  # the budgeted pager, where the source pages
            screen = head_screen and kernels and self.device == "cpu"
            experts = build.paged_experts(source, ram_budget, cache_policy, direct_io, verify, screen)
            self.expert_cache = experts
        # the usage profile belongs to the weights, known before the model is built: the warm-up can start now
        self._warming = ExpertWarming(self.expert_cache, self._weights_fingerprint)
        try:
            if warm_experts is not False:
                # The experts read (O_DIRECT, into the slab) while the resident weights are read and checked below
                # (buffered, and checksummed): the load waits on the file, not on the disk, so the two overlap and the
                # first request finds the experts in RAM (docs/SERVING.md, start-up).
                self._warming.start(None if warm_experts is True else warm_experts)
            # each resident tensor checked as it is read to be built (the drafter's too), the rest after: one read
            with checked_reads(source) if verify else contextlib.nullcontext():
                self.backend, self.model = build.build_model(
                    source, self.device, numerics, kernels, experts, max_rollback, lookahead, gpu_budget, head_screen
                )
                drafting = speculative.resolve(draft, self.model, source, kernels)
        except BaseException:
            self._warming.close(save=False)  # a failed load leaves no thread reading and no profile written
            if self.expert_cache is not None:
                self.expert_cache.close()
            raise
        self.prefill_chunk = prefill_chunk
        self.use_draft(*drafting)
        build.keep_freed_memory(kernels)

    def use_draft(
        self, drafter: speculative.Drafter | None, schedule: speculative.Schedule | None = None, mode: str | None = None
    ) -> None:
        """Install a drafter (`speculative.resolve` makes the standard ones; tests and benchmarks pass their own);
        None turns drafting off. With a drafter, every target pass goes through it and `stream` speculates."""
        self.check_open()
        self.drafter = drafter
        self.draft_schedule = schedule or speculative.Schedule()
        self.draft_stats = speculative.SpeculativeStats(mode=mode or (drafter.kind if drafter else "none"))

    # --- state-level primitives ---------------------------------------------------------------------------

    def new_state(self) -> ModelState:
        self.check_open()
        return self.drafter.new_state() if self.drafter is not None else self.model.new_state()

    @property
    def paged_chunk(self) -> int | None:
        """`prefill_chunk` where the routed experts are paged from a bank larger than the RAM budget (and no drafter
        follows the passes), else None: the `chunk` a prefill forward passes (`DeepseekV4.forward`), which then runs
        its tokens as a span whose experts are read once per layer, evicted as a scan, the next layer read behind
        the current one. The numbers are those of the chunks one by one, so no output depends on the budget."""
        cache = self.expert_cache
        if cache is None or self.drafter is not None or cache.n_slots >= cache.num_layers * cache.num_experts:
            return None
        return self.prefill_chunk

    @property
    def prefill_span(self) -> int:
        """Prompt tokens per prefill forward: `prefill_chunk`, or when paging (`paged_chunk`) as many chunks as keep
        the span's activations within `PREFILL_SPAN_BYTES` (`span_bytes_per_token` each)."""
        chunk = self.prefill_chunk
        if self.paged_chunk is None:
            return chunk
        return chunk * max(1, PREFILL_SPAN_BYTES // (chunk * span_bytes_per_token(self.config)))

    def prefill(
        self, token_ids: list[int], state: ModelState, argmax_only: HeadRequest = False, all_logits: bool = False
    ) -> torch.Tensor:
        """Run `token_ids` in spans of `prefill_span` (chunks of `prefill_chunk`); returns logits [T, V] (or
        [1, V] for the last; `argmax_only`: the caller reads the last one's argmax, or a race's, alone, see
        `DeepseekV4.forward`). One token (a decode step: `Session.decode`, `generate_tokens`) takes the scheduler's
        one-row step, `DeepseekV4.forward_rows`, where it gives `forward`'s bits (`rows_match_forward`)."""
        self.check_open()
        if not token_ids:
            raise ValueError("prefill needs at least one token")
        self._check_ids(token_ids)
        self._check_positions(state.length + len(token_ids))
        if len(token_ids) == 1 and not all_logits and self.drafter is None and self.model.rows_match_forward():
            # a decode step: the scheduler's one-row step, `forward`'s bits (tests/test_scheduler.py)
            return self.model.forward_rows(token_ids, [state], [argmax_only])
        out = []
        span = self.prefill_span
        for a in range(0, len(token_ids), span):
            chunk = token_ids[a : a + span]
            last = a + span >= len(token_ids)
            # a middle chunk's logits are not kept
            if self.drafter is not None:
                logits, _ = self.drafter.forward(chunk, state, all_logits=all_logits)
            else:
                want = argmax_only if last else False
                logits, _ = self.model.forward(
                    chunk, state, all_logits=all_logits, chunk=self.paged_chunk, argmax_only=want
                )
            if all_logits or last:
                out.append(logits)
        return torch.cat(out) if all_logits else out[-1]

    def _check_positions(self, n: int) -> None:
        """Refuse to run past the positions the model computes exactly (`model.max_positions`)."""
        if self.model.max_positions is not None and n > self.model.max_positions:
            raise PromptError(f"{n} positions asked, but {self._cap_note()}")

    def _cap_note(self) -> str:
        why = self.source.context_note or "the model has no lightning-indexer weights"
        return f"the context is capped at {self.model.max_positions} tokens: {why}"

    def check_open(self) -> None:
        """Raise `EngineClosed` after `close()`: every call that runs the model, opens, changes or saves a session
        or sets the engine up checks it first (its sessions too, through their `Runner`). What the engine reports
        (`stats()`, `counters`, `warm_status()`, `load_progress()`, `context_length`, `tokenizer`) stays readable."""
        if self._closed:
            raise EngineClosed("this engine is closed (Engine.close() was called): load the model again")

    def _check_ids(self, token_ids: list[int]) -> None:
        v = self.config.vocab_size
        bad = [t for t in token_ids if not 0 <= int(t) < v]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the vocabulary [0, {v})")

    # --- public API ---------------------------------------------------------------------------------------

    def logits(self, token_ids: list[int]) -> np.ndarray:
        """Logits at every position of `token_ids` from a fresh state: float32 [len, vocab]. Raises `PromptError` for
        an empty prompt, one longer than `context_length` or an id outside the vocabulary."""
        self.check_open()
        ids = token_ids_of(token_ids, f"logits {IDS_ONLY}")
        check_prompt(self, ids)  # (positions past the context ran, to numbers no generation would compute)
        return self.prefill(ids, self.new_state(), all_logits=True).float().numpy()

    def prompt_logprobs(self, prompt: str | list[int], top: int = 0) -> PromptLogprobs:
        """Every prompt token's logprob given the tokens before it (None for the first), its rank and the `top` most
        likely alternatives at its position, from a fresh state (`fastar.engine.prompt_logprobs`: the prefill's
        streams, the LM head a few positions at a time). Raises `PromptError` for an empty or too long prompt."""
        self.check_open()
        return score_prompt(self, prompt, top)

    def perplexity(self, text: str | list[int], ctx: int = 512, stride: int | None = None, **options) -> Perplexity:
        """Perplexity of a text (or token ids) over windows of `ctx` tokens moved by `stride` (default ctx // 2),
        each token scored once, in the first window that holds it after at least one token (`fastar.engine.
        perplexity`; `options`: save_logits, compare, on_window). `.ppl`, `.nll`, `.summary()`."""
        self.check_open()
        arguments.check_window(ctx, stride)
        ids = self.tokenizer.encode(text) if isinstance(text, str) else token_ids_of(text)
        return perplexity(self, ids, ctx, stride, **options)

    def generate_tokens(
        self,
        prompt_ids: list[int],
        max_tokens: int,
        temperature: float = 0.0,
        seed: int | None = None,
        ignore_eos: bool = False,
    ) -> list[int]:
        """Greedy (temperature 0) or sampled continuation of `prompt_ids`; stops after `max_tokens`, at EOS
        (included in the output) unless `ignore_eos`, or at `context_length` as `stream` does. Raises `SamplingError`
        (a ValueError) for a value of the wrong kind or range and `PromptError` for an empty prompt, one not shorter
        than the context or an id outside the vocabulary, as `stream` does."""
        self.check_open()
        # checked as `stream`'s are (a NaN temperature or a str seed failed inside torch; ignore_eos="no" was true)
        SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed, ignore_eos=ignore_eos)
        prompt_ids = token_ids_of(prompt_ids, f"generate_tokens {IDS_ONLY}")
        check_prompt(self, prompt_ids, reply=True)  # (a longer one ran past the context, and so did its tokens)
        cfg = self.config
        return generate_token_ids(
            self,
            prompt_ids,
            min(max_tokens, self.context_length - len(prompt_ids)),
            temperature,
            seed,
            cfg.eos_token_id,
            ignore_eos,
            cfg.vocab_size,
        )

    # --- sessions and generation: the API the front-ends use (fastar.engine.session / generate) -------------
    # The CLI and the server hold only these and never touch tensors. Not thread-safe: one worker owns the
    # engine and its sessions.

    model_name_default = "deepseek-v4-flash"
    # -c/--ctx-size (the `context_length` setter) raises it up to max_position_embeddings
    MAX_DEFAULT_CONTEXT = MAX_DEFAULT_CONTEXT

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer embedded in the model file, else the installed DeepSeek-V4 tokenizer.json."""
        if self._tokenizer is None:
            raw = self.source.tokenizer_json()
            try:
                self._tokenizer = Tokenizer.from_bytes(raw) if raw else Tokenizer.default()
            except (FileNotFoundError, ValueError) as e:
                raise FastarError(f"no usable tokenizer: {e}") from None
        return self._tokenizer

    def compile_grammar(self, grammar: Grammar) -> CompiledGrammar:
        """`grammar` (`constraint.output_grammar`) compiled for this model's tokenizer, for `SamplingParams.grammar`.
        The llguidance tokenizer is built on the first call (~1 s); compiled grammars are cached. Any thread.
        Raises `ConstraintError` (a ValueError) for a grammar that cannot be enforced within the parser limits."""
        if not isinstance(grammar, Grammar):
            raise TypeError(f"compile_grammar takes a constraint.Grammar (constraint.output_grammar), got {grammar!r}")
        self.check_open()
        with self._grammars_lock:
            if self._grammars is None:
                tok = self.tokenizer
                self._grammars = GrammarCompiler(tok.hf.to_str(), self.config.vocab_size, tok.eos_id)
        return self._grammars.compile(grammar)

    @property
    def context_length(self) -> int:
        """Positions a session may hold: `max_position_embeddings` capped to `MAX_DEFAULT_CONTEXT` unless set, and
        always to the positions the model computes exactly (`context_note` says why when that is lower)."""
        n = self._context_length
        n = n if n else min(self.config.max_position_embeddings, self.MAX_DEFAULT_CONTEXT)
        return n if self.model.max_positions is None else min(n, self.model.max_positions)

    @property
    def context_note(self) -> str | None:
        """Why `context_length` is capped below what was asked (a model file without the lightning indexer,
        which names the file and the fix), or None."""
        cap = self.model.max_positions
        return self._cap_note() if cap is not None and self.context_length >= cap else None

    @context_length.setter
    def context_length(self, n: int) -> None:
        self.check_open()
        limit = self.config.max_position_embeddings
        if not isinstance(n, int) or isinstance(n, bool) or not 2 <= n <= limit:
            raise ConfigError(f"context length must be between 2 and the model's {limit} positions, got {n}")
        self._context_length = n
        if self._session is not None:  # sessions opened earlier keep their own limit
            self._session.context_length, self._session.context_note = self.context_length, self.context_note

    def _fingerprint(self) -> str:
        """Identifies the model in saved sessions: the .fst header (tensors, checksums), else the config; and the
        positions it computes exactly where those are capped."""
        if self._fingerprint_hex is None:
            if self.model.max_positions is None:
                self._fingerprint_hex = self._weights_fingerprint()
            else:  # its states lack index keys: never resumed with an indexer
                self._fingerprint_hex = _digest([self._weights_ident(), self.model.max_positions])
        return self._fingerprint_hex

    def _weights_ident(self):
        return self.source.header or self.config.to_dict()

    def _weights_fingerprint(self) -> str:
        """Identifies the weights alone (the .fst header, else the config), known before the model is built: what
        the expert usage profile belongs to (`warm_experts`). `_fingerprint` where the positions are not capped."""
        return _digest(self._weights_ident())

    def open_session(self, anchor: bool = True) -> Session:
        """A new, empty `Session` (one conversation's tokens + model state; `anchor`: see `session.py`)."""
        self.check_open()
        if not isinstance(anchor, bool):  # "no" is true
            raise TypeError(f"anchor must be True or False, got {anchor!r}")
        return Session(
            self,
            context_length=self.context_length,
            vocab_size=self.config.vocab_size,
            tokenizer=self.tokenizer,
            stats=self._stats,
            fingerprint=self._fingerprint(),
            anchor=anchor,
            context_note=self.context_note,
        )

    def stream(
        self,
        prompt_ids: list[int] | str,
        params: SamplingParams | None = None,
        session: Session | None = None,
        cancel: threading.Event | None = None,
        on_prefill_progress: Callable[[int, int], None] | None = None,
        **sampling,
    ) -> Iterator[GenerationChunk]:
        """Stream the continuation of `prompt_ids` (token ids, or raw text) as `GenerationChunk`s.

        Args:
            params: a `SamplingParams`, or keyword arguments (`max_tokens`, `temperature`, ...) instead. With
                `prompt_logprobs`, the prompt runs from a fresh state through a one-request scheduler (no session,
                no prefix reuse) and the first chunk carries its `PromptLogprobs`.
            session: the conversation to continue; its longest common token prefix with the prompt is reused.
                None uses the engine's own session (so consecutive calls reuse their common prefix too).
            cancel: set it to stop at the next token (the last chunk then has finish_reason "cancelled").
            on_prefill_progress: called as (done, total) with the prompt tokens computed so far.
        Raises:
            PromptError (a ValueError), from this call itself: empty prompt, longer than the context, bad ids.
            SamplingError (a ValueError): a bad sampling value, or a token id in `logit_bias`, `stop_token_ids` or
                `banned_token_ids` outside the vocabulary; `UnknownParameter` (also a TypeError): a keyword that is
                no sampling parameter.
            TypeError / ValueError: a prompt that is neither text nor int ids, an argument of the wrong kind, a
                session of another engine (`fastar.engine.arguments`); EngineClosed after `close()`.
            SessionInUse, from the iterator when it is resumed after another generation ran on its session.
        """
        self.check_open()
        if params is None:
            params = SamplingParams.from_kwargs(**sampling)
        elif sampling:
            raise TypeError("pass either params or sampling keyword arguments, not both")
        arguments.check_stream(self, params, session, cancel, on_prefill_progress)
        if params.prompt_logprobs is not None:  # scored from a fresh state, as the server's scheduler scores it
            return self._scheduled(prompt_ids, params, cancel)
        if session is None:
            if self._session is None:
                self._session = self.open_session()
            session = self._session
        steps = None
        # a constrained request decodes plainly, and so do one whose thinking budget may force a token and one with a
        # logit bias or a penalty (drafting verifies against the model's own logits), or with `min_tokens` or
        # `banned_token_ids` (drafts are not checked against a ban)
        plain = (
            params.grammar is not None
            or params.thinking_budget is not None
            or params.adjusts_logits
            or params.min_tokens > 0
            or bool(params.banned_token_ids)
        )
        if self.drafter is not None and not plain:
            steps = functools.partial(
                speculative.speculative_generate_step,
                drafter=self.drafter,
                schedule=self.draft_schedule,
                stats=self.draft_stats,
            )
        return stream_generate(
            session,
            prompt_ids,
            params,
            eos_token_id=self.config.eos_token_id,
            cancel=cancel,
            on_prefill_progress=on_prefill_progress,
            steps=steps,
        )

    def _scheduled(
        self, prompt: list[int] | str, params: SamplingParams, cancel: threading.Event | None
    ) -> Iterator[GenerationChunk]:
        """`stream` through a one-request scheduler on this thread (the prompt is checked here, at the call)."""
        out: list[GenerationChunk] = []
        sched = self.scheduler(max_batch=1, max_queue=1)
        sched.submit(prompt, params, on_chunk=out.append, cancel=cancel)

        def chunks() -> Iterator[GenerationChunk]:
            busy = True
            while busy:
                busy = sched.step()
                yield from out
                out.clear()

        return chunks()

    def generate(self, prompt: str | list[int], session: Session | None = None, **sampling) -> str:
        """The continuation of `prompt` (raw text or ids, no chat encoding) as one string."""
        return generate_text(self.stream(prompt, session=session, **sampling))

    def chat(
        self,
        messages: list[dict],
        thinking: bool = False,
        reasoning_effort: str | None = None,
        drop_thinking: bool = True,
        session: Session | None = None,
        **sampling,
    ) -> ChatResult:
        """Reply to an OpenAI-style conversation with the DeepSeek-V4 chat encoding. Returns a `ChatResult`:
        a str (the content) that also has `.reasoning`, `.tool_calls`, `.finish_reason` and `.usage`. Raises
        `EncodingError` (a ValueError) for a conversation that does not end with a user or tool message."""
        for name, value in (("thinking", thinking), ("drop_thinking", drop_thinking)):
            if not isinstance(value, bool):  # "no" is true
                raise TypeError(f"{name} must be True or False, got {value!r}")
        return chat(
            lambda text: self.stream(text, session=session, thinking=thinking, **sampling),
            messages,
            thinking,
            reasoning_effort,
            drop_thinking,
        )

    @property
    def counters(self) -> Stats:
        """The generation counters `stats()` reports (prefill/decode tokens and times); the scheduler adds to them."""
        return self._stats

    def stats(self) -> dict:
        """Counters since load: prompt/generated tokens, `prefill_tokens_computed` (what prefix reuse did not
        save), prefill/decode seconds and tok/s, speculative decoding's as `draft_*` (mode, verify passes,
        acceptance rate, tokens per verify pass, estimated speedup), plus the expert cache's as `expert_cache_*`."""
        d = self._stats.as_dict()
        d.update(self.draft_stats.as_dict(self.draft_schedule.pass_time()))
        for k, v in self.model.experts.stats().items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                d[f"expert_cache_{k}"] = v
        d["device"] = self.device
        if self.backend is not None:
            d.update({f"device_{k}": v for k, v in self.backend.stats().items() if k != "device"})
        return d

    def load_progress(self) -> float:
        """Fraction of the model loaded: an `Engine` exists only once `load()` has returned, so 1.0."""
        return 1.0

    def warm_experts(self, profile_dir: str | os.PathLike | None = None) -> None:
        """Start reading the expert cache's budget's worth of experts in the background (`weights.warmup`), so the
        first requests find them in RAM; requests run meanwhile. With `profile_dir`, the experts the cache held
        when this model's engine last closed come first (saved there by `close`), then the file order. Nothing
        to do without an expert cache (every expert is mapped from the file, or on a device)."""
        self.check_open()
        if profile_dir is not None:
            arguments.check_path(profile_dir, "the usage profile folder (profile_dir)")
        self._warming.start(profile_dir)

    def warm_status(self) -> dict:
        """The warm-up's state: {"status": "off"} without one, else `ExpertWarmup.status()` (loading / ready,
        experts loaded of the target, progress, source)."""
        return self._warming.status()

    def close(self) -> None:
        """Stop the expert pager's loader threads and free its RAM slab. Idempotent. The weight source stays open
        (the caller opened it, or `load` did and it closes when collected); arrays handed out stay valid."""
        if self._closed:
            return
        self._closed = True
        if self.backend is not None:
            self.backend.close()
        self._warming.close()  # and the usage profile the next start warms from
        if self.expert_cache is not None:
            self.expert_cache.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # --- many callers: continuous batching (fastar.engine.scheduler) and the prefix cache on disk ------------

    def scheduler(
        self,
        max_batch: int = 8,
        max_queue: int = 64,
        token_budget: int | None = None,
        prefix_cache: str | os.PathLike | None = None,
        prefix_cache_size: int | str = "20G",
        keep_states: int = 0,
        draft: bool = True,
        prefill_share: float = 0.5,
        max_stall: float = MAX_STALL,
    ) -> Scheduler:
        """A `Scheduler` serving many requests at once on this engine, each bit-identical to `stream` alone:
        `submit(prompt, params)` from any thread -> a `Handle` (iterate its chunks, `cancel()`); the one worker
        thread calls `step()` or `run(stop_event)`. `prefix_cache`: a folder of prefix states on disk (see
        `open_prefix_cache`); `keep_states`: finished requests' states kept in RAM for prefix reuse; `draft`: a lone
        greedy sequence decodes with the engine's drafter (when it has one), the same tokens as without;
        `prefill_share`: the part of the time prompts' prefill chunks may take while others decode (`PrefillPacer`);
        `max_stall`: seconds the decoding sequences wait at most for a step while a prompt within one chunk
        prefills (`Scheduler`)."""
        self.check_open()
        cache = self.open_prefix_cache(prefix_cache, prefix_cache_size, True) if prefix_cache is not None else None
        return Scheduler(
            self,
            max_batch=max_batch,
            max_queue=max_queue,
            token_budget=token_budget,
            prefix_cache=cache,
            keep_states=keep_states,
            draft=draft,
            prefill_share=prefill_share,
            max_stall=max_stall,
        )

    def serve_batch(
        self, requests: list[tuple[str | list[int], SamplingParams | dict]], **options
    ) -> list[list[GenerationChunk]]:
        """Run `requests` ((prompt, params or a dict of sampling keywords) pairs) together on this thread;
        returns each one's chunks, in order. `options`: as `scheduler`."""
        self.check_open()
        arguments.check_pairs(requests)
        # a dict as `stream`'s keywords: the aliases taken, a typo an `UnknownParameter` (was SamplingParams' own)
        params = [kw if isinstance(kw, SamplingParams) else SamplingParams.from_kwargs(**kw) for _, kw in requests]
        sched = self.scheduler(**{"max_queue": max(64, len(requests)), **options})
        handles = [sched.submit(prompt, p) for (prompt, _), p in zip(requests, params, strict=True)]
        sched.run_until_idle()
        return [list(h) for h in handles]

    def open_prefix_cache(
        self, folder: str | os.PathLike, size: int | str = "20G", background: bool = False
    ) -> PrefixCache:
        """A `PrefixCache` in `folder` capped at `size` bytes (or "20G"), keyed to this model and numerics;
        `background`: files are written on a writer thread (the scheduler's)."""
        from ..config import parse_size

        self.check_open()
        arguments.check_path(folder, "the prefix cache folder")
        fingerprint = f"{self._fingerprint()}/{self.model.numerics}/{self.model.max_rollback}"
        return PrefixCache(folder, fingerprint, parse_size(size), background=background)
