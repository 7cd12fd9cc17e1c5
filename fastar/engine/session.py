"""Session: one conversation's timeline — its tokens and the model state that has processed them.

Owns: `Session` (prefix reuse: given a new full prompt it keeps the longest common token prefix, rolls the state
back to it and prefills only the rest; pending tokens; save/restore to disk), `Stats` (the counters behind
`Engine.stats()`), and the prompt checks every front-end relies on (`PromptError`: empty, longer than the
context, ids outside the vocabulary; `token_ids`) and a session file's path (`file_path`). Does not own: sampling,
stop strings or text streaming (`fastar.engine.generate`), the forward pass or the state layout (`fastar.model`).

Invariant: `tokens[:num_processed]` have been run through the model (the state's length); the tokens after
that are pending: sampled but not yet run (after a generation, its last token). Pending tokens cost nothing
until the timeline continues, and a prompt that shares them reuses them like any other prefix.

Anchor: a state keeps only `max_rollback` positions of history, so rolling back over a long reply fails. Yet
that is the common case: in thinking mode the next turn's prompt drops the reply's reasoning (so it diverges
right after the previous prompt), and "regenerate" discards the whole reply. So after each prefill the session
keeps a snapshot of the state at the end of the prompt (the anchor) and rolls back from it when truncating the
live state fails. It costs one state copy per request in time and memory; `anchor=False` turns it off.

The session talks to its runner (the `Engine`) through the `Runner` protocol: `new_state()`,
`prefill(ids, state) -> logits [1, V]`, `prefill_chunk` and `check_open()` (after `Engine.close()` every session
call that runs, changes, reads out or saves the timeline raises `EngineClosed`, as the engine's own calls do); and
to the state (`ModelState`) through `length`, `max_rollback`, `truncate`, `snapshot`, `to_bytes`/`from_bytes`.
Tests drive it with fakes on those names.
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import struct
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Set
from dataclasses import dataclass, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from ..errors import FastarError
from ..outputs import unwritable

if TYPE_CHECKING:
    from ..model.head_screen import HeadRequest
    from ..model.state import ModelState

MAGIC = b"FSTSESS\0"
VERSION = 2  # 2: a checksum after the state; version 1 files (written without one) still load, unchecked
DIGEST_SIZE = 32  # BLAKE2b-256 of every byte before it


class PromptError(FastarError, ValueError):
    """A prompt that cannot run: empty, longer than the context, or holding ids outside the vocabulary."""


class SessionError(FastarError):
    """A saved session cannot be restored (missing, corrupt, or saved from another model)."""


class SessionNotFound(SessionError, FileNotFoundError):
    """`Session.load` of a path that names no file: a FileNotFoundError too, as `open()` of it raises (as a missing
    model is `fastar.errors.ModelNotFound`)."""


class SessionInUse(FastarError, RuntimeError):
    """A generation was resumed after another one ran on its session (their tokens would mix)."""


@dataclass(slots=True)
class Stats:
    """Counters since the engine was loaded. `prefill_tokens_computed` counts tokens actually run through
    prefill; the gap to `prompt_tokens` is what prefix reuse saved."""

    requests: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens_computed: int = 0
    prefill_seconds: float = 0.0
    generated_tokens: int = 0
    decode_tokens_computed: int = 0
    decode_seconds: float = 0.0

    def copy(self) -> Stats:
        return Stats(*(getattr(self, f.name) for f in fields(self)))

    def since(self, earlier: Stats) -> Stats:
        """The counts between `earlier` (a copy taken before) and now: one request's numbers."""
        return Stats(*(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self)))

    def as_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["prefill_tokens_per_s"] = self.prefill_tokens_computed / self.prefill_seconds if self.prefill_seconds else 0.0
        d["decode_tokens_per_s"] = self.decode_tokens_computed / self.decode_seconds if self.decode_seconds else 0.0
        return d


IDS_ONLY = "takes token ids (a list of int; encode text with the engine's tokenizer first)"


def token_ids(prompt: Any, what: str = "a prompt is text (str) or token ids (a list of int)") -> list[int]:
    """A prompt given as token ids (a list, tuple or array of integers) as a list of ints. Raises TypeError naming
    what it got instead (None, a number, bytes, a dict or set, floats, strings): a float id is never rounded into a
    token.
    `what`: the message's start (`IDS_ONLY` after the caller's name where text is not taken)."""
    # a dict iterated as its keys and a set in no order: neither is a sequence of tokens
    if isinstance(prompt, (str, bytes, bytearray, Mapping, Set)) or not isinstance(prompt, Iterable):
        raise TypeError(f"{what}, got {type(prompt).__name__}")
    ids = []
    for t in prompt:
        try:
            if isinstance(t, bool):
                raise TypeError
            ids.append(operator.index(t))
        except TypeError:
            raise TypeError(f"token ids must be integers, got {t!r} ({type(t).__name__})") from None
    return ids


def file_path(path: Any, what: str) -> Path:
    """A session file's path (`what`: the call, for the message) as a Path: a non-empty str or os.PathLike. Pathlib
    said only that its "argument should be a str or an os.PathLike object", and "" was the current directory. (The
    engine's own path arguments: `arguments.check_path`, a module above this one.)"""
    text = os.fspath(path) if isinstance(path, str | os.PathLike) else None
    if not isinstance(text, str) or not text:
        raise TypeError(f"{what} takes the session file's path (a non-empty str or os.PathLike), got {path!r}")
    return Path(text)


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class Runner(Protocol):
    """What a session needs of its engine: a fresh state, and a prefill of `token_ids` that advances a state and
    returns the last position's logits [1, V], run in chunks of at most `prefill_chunk` tokens; a session hands it
    `prefill_span` tokens at a time (a multiple of `prefill_chunk`: see `Engine.prefill_span`). `check_open()`
    raises once the runner is closed (`EngineClosed`), before any session call that needs it."""

    prefill_chunk: int
    prefill_span: int

    def check_open(self) -> None: ...

    def new_state(self) -> ModelState: ...

    def prefill(self, token_ids: list[int], state: ModelState, argmax_only: HeadRequest = False) -> torch.Tensor: ...


class Session:
    """One conversation's tokens and model state. Not thread-safe: one worker owns the engine and its sessions.

    Args:
        runner: the engine (a `Runner`).
        context_length: positions this session may hold; a longer prompt is a `PromptError`.
        context_note: why the context is shorter than usual, if it is (added to that error).
        vocab_size: token ids must lie in [0, vocab_size).
        tokenizer: for text prompts (`encode_prompt`); optional for id-only use.
        stats: counters to add to (the engine's); a private `Stats` by default.
        fingerprint: identifies the model in saved sessions, so a session never loads into another model.
        anchor: keep a snapshot of the state at the end of the last prompt (see the module docstring).
    """

    def __init__(
        self,
        runner: Runner,
        *,
        context_length: int,
        vocab_size: int,
        tokenizer=None,
        stats: Stats | None = None,
        fingerprint: str = "",
        anchor: bool = True,
        context_note: str | None = None,
    ) -> None:
        self._runner = runner
        self.context_length, self.context_note = context_length, context_note
        self.vocab_size = vocab_size
        self.tokenizer = tokenizer
        self.stats = stats if stats is not None else Stats()
        self.fingerprint = fingerprint
        self.meta: dict[str, Any] = {}  # front-end data saved with the session (the chat REPL keeps its history here)
        self.last_cached_tokens = 0  # prompt tokens the last prefill reused
        self._tokens: list[int] = []
        self._state = None
        self._dirty = False  # a forward pass was interrupted: the state may be half-updated
        self._boundary_ids: frozenset[int] | None = None
        self._keep_anchor = anchor
        self._anchor: tuple[list[int], Any] | None = None  # (prompt ids, state snapshot after them)
        self._generation: object | None = None  # the token of the generation running on this session (`claim`)

    @property
    def runner(self) -> Runner:
        """The engine this session runs on (a session's state is only meaningful to its own engine)."""
        return self._runner

    def claim(self) -> object:
        """Make a new generation this session's user; returns its token for `check_claim`. A generation still
        suspended (an unfinished stream, one a loop broken out of) loses the session to it."""
        self._runner.check_open()
        self._generation = object()
        return self._generation

    def check_claim(self, token: object) -> None:
        """Raise `SessionInUse` when another generation claimed this session since `token`'s did."""
        if self._generation is not token:
            raise SessionInUse(
                "another generation ran on this session since this one started, so their tokens would mix: "
                "give each generation you interleave its own session (engine.open_session())"
            )

    @property
    def generation(self) -> object | None:
        """The token of the generation that holds this session (`claim`), or None while it is free."""
        return self._generation

    def holds(self, token: object) -> bool:
        """Whether the generation of `token` still holds this session (no other claimed it since)."""
        return self._generation is token

    def release(self, token: object) -> None:
        """The generation of `token` has ended (exhausted or closed): the session is free, unless another took it."""
        if self._generation is token:
            self._generation = None

    def _check_idle(self, what: str) -> None:
        """Refuse to change the timeline under a generation that is still suspended on it (its next token would
        come from a state it did not leave)."""
        if self._generation is not None:
            raise SessionInUse(
                f"cannot {what} this session while a generation on it is unfinished: exhaust its stream or close() "
                "it first (or give the generation its own session: engine.open_session())"
            )

    # --- the timeline -------------------------------------------------------------------------------------

    @property
    def tokens(self) -> list[int]:
        return list(self._tokens)

    @property
    def num_tokens(self) -> int:
        return len(self._tokens)

    @property
    def num_processed(self) -> int:
        return 0 if self._state is None else self._state.length

    def resume(self, tokens: list[int], state) -> None:
        """Take over a model state that has processed tokens[:state.length] (the rest are pending), e.g. to
        continue from the exact state a benchmark or another loop reached. Raises `SessionInUse` while a generation
        on it is unfinished."""
        self._runner.check_open()
        if not 0 <= state.length <= len(tokens):
            raise ValueError(f"a state of {state.length} positions cannot hold a timeline of {len(tokens)} tokens")
        self.reset()
        self._tokens, self._state = [int(t) for t in tokens], state

    def processed(self) -> tuple[list[int], ModelState] | None:
        """(the tokens the state has processed, the state itself), e.g. to save it in a prefix cache; None when
        there is no usable state."""
        self._runner.check_open()
        if self._state is None or self._dirty or self._state.length == 0:
            return None
        return self._tokens[: self._state.length], self._state

    def reset(self) -> None:
        """Forget everything (tokens, state and meta). Raises `SessionInUse` while a generation on it is unfinished."""
        self._runner.check_open()
        self._check_idle("reset")
        self._tokens, self._state, self._dirty, self.meta, self._anchor = [], None, False, {}, None

    def rewind(self, n: int) -> None:
        """Keep only the first `n` tokens (the state rolls back with them; if it cannot, it is dropped and the
        next prefill starts over). Raises `SessionInUse` while a generation on it is unfinished."""
        self._runner.check_open()
        self._check_idle("rewind")
        self.roll_back(n)

    def roll_back(self, n: int) -> None:
        """`rewind` for the generation that holds the session (speculative decoding drops its rejected drafts with
        it, mid-generation), without the guard."""
        self._runner.check_open()
        if not isinstance(n, int) or isinstance(n, bool) or not 0 <= n <= len(self._tokens):
            raise ValueError(f"cannot rewind a session of {len(self._tokens)} tokens to {n!r}")
        del self._tokens[n:]
        if self._state is not None and self._state.length > n:
            self._truncate(n)

    def _truncate(self, n: int) -> None:
        try:
            self._state.truncate(n)
        except FastarError:  # StateError: the rows needed were dropped (max_rollback); start over
            self._state = None

    # --- prompts ------------------------------------------------------------------------------------------

    def encode_prompt(self, prompt: str | list[int]) -> list[int]:
        """Token ids of a prompt (ids pass through).

        For text that starts with the decoded text of this session's tokens, the session's own tokens are
        kept and only the rest is encoded, provided the split falls next to an added token (EOS, a role
        marker: the session ends on one, or the rest starts with one). Why: the tokens a model generates often
        differ from a re-encoding of their text, so re-encoding a conversation would end prefix reuse at the
        first reply. Added tokens are split out before BPE runs, so at such a split the rest encodes exactly
        as it would inside the whole text. Special tokens of a reply that are missing from the text (its shown
        text skips them, so the conversation resent has none) are kept too: the rest of the reply still matches.
        """
        self._runner.check_open()
        if not isinstance(prompt, str):
            return token_ids(prompt)
        if self.tokenizer is None:
            raise PromptError("this session has no tokenizer: pass token ids")
        if self._tokens:
            known = self.tokenizer.decode(self._tokens)
            spelled = len(known) if prompt.startswith(known) else self._spelled(prompt)
            if spelled is not None:
                rest = self.tokenizer.encode(prompt[spelled:])
                added = self._added_ids()
                if self._tokens[-1] in added or not rest or rest[0] in added:
                    return self._tokens + rest
        return self.tokenizer.encode(prompt)

    def _spelled(self, prompt: str) -> int | None:
        """How many characters of `prompt` this session's tokens spell when a special token (pad, BOS, EOS: what
        `skip_special_tokens` hides from a reply's text) may be missing from it: a reply shown and resent without
        them still matches the ids the model holds. None where the tokens spell something else."""
        pos, run = 0, []
        for t in [*self._tokens, None]:
            if t is not None and not self.tokenizer.is_special(t):
                run.append(t)
                continue
            if run:  # text between special tokens decodes on its own (the byte-level decoder has no state across)
                text = self.tokenizer.decode(run)
                if not prompt.startswith(text, pos):
                    return None
                pos, run = pos + len(text), []
            if t is not None and prompt.startswith(text := self.tokenizer.decode([t]), pos):
                pos += len(text)  # spelled out in the prompt (the template's BOS and EOS); else hidden: skipped
        return pos

    def _added_ids(self) -> frozenset[int]:
        if self._boundary_ids is None:
            self._boundary_ids = frozenset(self.tokenizer.hf.get_added_tokens_decoder())
        return self._boundary_ids

    def check_prompt(self, ids: list[int]) -> None:
        """Raise `PromptError` for a prompt no generation can start from. Never truncates."""
        self._runner.check_open()
        if not ids:
            raise PromptError("the prompt is empty")
        if len(ids) >= self.context_length:
            raise PromptError(
                f"the prompt is {len(ids)} tokens, but the context length is {self.context_length} "
                f"tokens (it must be shorter, to leave room for the reply)"
                + (f"; {self.context_note}" if self.context_note else "")
            )
        bad = next((t for t in ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise PromptError(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")

    # --- running the model --------------------------------------------------------------------------------

    def prefill(
        self,
        prompt_ids: list[int],
        cancel: threading.Event | None = None,
        on_progress: Callable[[int, int], None] | None = None,
        argmax_only: HeadRequest = False,
    ) -> torch.Tensor | None:
        """Make the timeline equal `prompt_ids` and return the logits [V] after its last token.

        Reuses the longest common prefix with the current tokens; the last prompt token is always run (its
        logits are the output). Returns None when `cancel` is set between chunks; the session then holds the
        part of the prompt already processed. `on_progress(done, total)` follows the tokens to compute.
        `argmax_only`: the caller reads the logits' argmax, or a race's, alone (the last chunk's head may be
        screened, see `DeepseekV4.forward`).
        """
        self._runner.check_open()
        prompt_ids = token_ids(prompt_ids, f"Session.prefill {IDS_ONLY}")
        self.check_prompt(prompt_ids)
        if self._dirty:
            self._state, self._dirty = None, False
        keep = min(common_prefix(self._tokens, prompt_ids), len(prompt_ids) - 1, self.num_processed)
        if self._state is not None and self._state.length > keep:
            self._truncate(keep)
            if self._state is None:
                keep = self._from_anchor(prompt_ids)
        if self._state is None:
            self._state, keep = self._runner.new_state(), 0
        self.last_cached_tokens = keep
        self.stats.cached_tokens += keep
        self._tokens = list(prompt_ids[:keep])
        todo = prompt_ids[keep:]
        chunk = max(1, int(self._runner.prefill_span))
        logits = None
        done = 0
        if on_progress is not None:
            on_progress(0, len(todo))
        for a in range(0, len(todo), chunk):
            if cancel is not None and cancel.is_set():
                return None
            part = todo[a : a + chunk]
            t = time.perf_counter()
            if on_progress is not None:  # progress inside a chunk, block by block (a chunk can take minutes)
                m = len(part)
                self._state.on_layer = lambda i, n, base=done, m=m: on_progress(base + m * i // n, len(todo))
            try:
                logits = self._forward(part, argmax_only if a + chunk >= len(todo) else False)
            finally:
                self._state.on_layer = None
            self.stats.prefill_seconds += time.perf_counter() - t
            self.stats.prefill_tokens_computed += len(part)
            done += len(part)
            if on_progress is not None:
                on_progress(done, len(todo))
        if self._keep_anchor and self._state.max_rollback is not None:
            self._anchor = (list(prompt_ids), self._state.snapshot())
        return logits

    def _from_anchor(self, prompt_ids: list[int]) -> int:
        """Continue from the anchor when it shares a prefix with `prompt_ids`; returns the positions kept."""
        if self._anchor is None:
            return 0
        tokens, snap = self._anchor
        keep = min(common_prefix(tokens, prompt_ids), len(prompt_ids) - 1, snap.length)
        if keep <= 0:
            return 0
        state = snap.snapshot()  # the anchor stays intact for the next rollback
        try:
            state.truncate(keep)
        except FastarError:
            return 0
        self._state = state
        return keep

    def append(self, token: int) -> None:
        """Add a sampled token to the timeline (pending: `decode` runs it)."""
        self._runner.check_open()
        (token,) = token_ids([token], f"Session.append {IDS_ONLY}")
        if not 0 <= token < self.vocab_size:
            raise PromptError(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
        self._tokens.append(token)

    def decode(self, argmax_only: HeadRequest = False) -> torch.Tensor:
        """Run the pending tokens (normally the one just sampled); returns the logits [V] after the last
        (`argmax_only`: the caller reads their argmax, or a race's, alone, see `DeepseekV4.forward`)."""
        self._runner.check_open()
        n = self.num_processed
        if self._state is None or self._dirty or n >= len(self._tokens):
            raise RuntimeError("decode() needs a prefilled session with a pending token")
        part = self._tokens[n:]
        t = time.perf_counter()
        logits = self._forward(part, argmax_only)
        self.stats.decode_seconds += time.perf_counter() - t
        self.stats.decode_tokens_computed += len(part)
        return logits

    def _forward(self, ids: list[int], argmax_only: HeadRequest = False) -> torch.Tensor:
        """Run `ids` at the state's position. An exception or Ctrl-C inside may leave the layers at different
        lengths, so the state is marked dirty until the pass completes (and dropped by the next prefill)."""
        self._dirty = True
        logits = self._runner.prefill(ids, self._state, argmax_only)
        self._dirty = False
        start = self._state.length - len(ids)
        self._tokens[start:] = ids
        return logits.reshape(-1, logits.shape[-1])[-1]

    # --- disk ---------------------------------------------------------------------------------------------
    # MAGIC, u32 version, u64 header length, JSON header (fingerprint, tokens, meta), the state's bytes, then
    # (version 2) the BLAKE2b-256 digest of all that: a truncated or damaged file is refused, never half-loaded.

    def save(self, path: str | os.PathLike) -> Path:
        """Write tokens, meta and model state to `path` (atomically: a temp file renamed into place). Raises
        `SessionError` naming `path` when it cannot be written (what was there before is left as it was), and
        `EngineClosed` after `Engine.close()`."""
        self._runner.check_open()
        path = file_path(path, "Session.save")
        state = b"" if self._state is None or self._dirty else self._state.to_bytes()
        tokens = self._tokens if state else []  # without a state, pending tokens would be recomputed anyway
        try:
            header = json.dumps(
                {"fingerprint": self.fingerprint, "tokens": tokens, "meta": self.meta, "has_state": bool(state)},
                ensure_ascii=False,
            ).encode()
        except (TypeError, ValueError) as e:  # meta is the caller's: a set, an object, a circular reference
            raise SessionError(f"{path}: cannot save: the session's meta is not JSON ({e})") from None
        if path.exists() and not path.is_file():  # `/save /dev/null` as root: the rename would replace the device
            raise SessionError(f"{path}: not a regular file (a session is renamed into place over it)")
        why = unwritable(path, parents=True)  # a read-only folder: said as that, not as the OS's word for it
        if why is not None:
            raise SessionError(f"{path}: cannot write ({why})")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
        except OSError as e:  # a read-only folder, a path under a regular file: say so of the path asked for
            # mkdir of a folder that is a file says "File exists"
            why = f"{path.parent} is not a folder" if isinstance(e, FileExistsError) else e.strerror
            raise SessionError(f"{path}: cannot write ({why})") from None
        try:
            with os.fdopen(fd, "wb") as f:
                head = MAGIC + struct.pack("<IQ", VERSION, len(header)) + header
                f.write(head)
                f.write(state)
                f.write(_digest(head, state))
                f.flush()
                os.fsync(f.fileno())  # the data is on disk before the name says the file is complete
            os.replace(tmp, path)
        except BaseException as e:
            Path(tmp).unlink(missing_ok=True)
            if isinstance(e, OSError):  # a full disk, a folder of that name: not the temporary file's name
                raise SessionError(f"{path}: cannot write ({e.strerror})") from None
            raise
        return path

    def load(self, path: str | os.PathLike) -> None:
        """Replace this session's contents with a saved one. Raises `SessionError` with the reason, `SessionInUse`
        while a generation on it is unfinished, `EngineClosed` after `Engine.close()`."""
        self._runner.check_open()
        path = file_path(path, "Session.load")
        self._check_idle("load into")
        try:
            if path.exists() and not path.is_file():  # /dev/zero would be read to the end of memory, a FIFO forever
                raise SessionError(f"{path}: not a regular file")
            raw = path.read_bytes()
        except FileNotFoundError:
            raise SessionNotFound(f"{path}: no such file") from None
        except OSError as e:
            raise SessionError(f"{path}: cannot read ({e.strerror})") from None
        if raw[:8] != MAGIC:
            raise SessionError(f"{path}: not a fastar session file")
        if len(raw) < 20:  # (struct's own words named buffer sizes and offsets, not the file)
            raise SessionError(f"{path}: session file is truncated ({len(raw)} bytes, its preamble is 20)")
        version, hlen = struct.unpack_from("<IQ", raw, 8)
        if version not in (1, VERSION):
            raise SessionError(f"{path}: session version {version} is not supported (expected {VERSION})")
        end = len(raw)
        if version >= 2:
            end -= DIGEST_SIZE
            if end < 20 or raw[end:] != _digest(memoryview(raw)[:end]):
                raise SessionError(f"{path}: session file is corrupt (checksum mismatch)")
        try:
            header = json.loads(raw[20 : 20 + hlen].decode())
            tokens = [int(t) for t in header["tokens"]]
        except (struct.error, UnicodeDecodeError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise SessionError(f"{path}: session file is corrupt ({e})") from None
        if header.get("fingerprint") != self.fingerprint:
            raise SessionError(f"{path}: this session was saved with a different model")
        state = None
        if header.get("has_state"):
            try:
                state = type(self._runner.new_state()).from_bytes(raw[20 + hlen : end])
            except FastarError as e:
                raise SessionError(f"{path}: {e}") from None
            if state.length > len(tokens):
                raise SessionError(f"{path}: session file is corrupt (state longer than its tokens)")
        self._tokens, self._state, self._dirty, self._anchor = tokens, state, False, None
        self.meta = dict(header.get("meta") or {})


def _digest(*parts: bytes | memoryview) -> bytes:
    """A session file's checksum: BLAKE2b-256 over `parts` in order, fed piece by piece (no joined copy)."""
    h = hashlib.blake2b(digest_size=DIGEST_SIZE)
    for part in parts:
        h.update(part)
    return h.digest()
