"""The contracts every layer shares, at the bottom of the package: imports no torch and nothing of fastar's but
`config`, so `format/`, `quant/` and `convert/` can implement them without importing upward.

Owns:
- `WeightSource`: what the model asks of wherever weights live (a `.fst` file, an official checkpoint directory,
  a FaStar v2 file, a synthetic model), and `ExpertWeights`, the record one routed expert comes back as.
- `PagedSource`: a source the expert pager can read records from (`pageable` True); the three file sources are.
- `Closing`: the file-holding sources' lifetime (`with source:` and close-on-collect).
- `ServedEngine` and `ServedTokenizer`: what the server reads of the engine it serves and of its tokenizer
  (names, context, EOS, token bytes), which `fastar.engine.Engine` and the tests' scripted engines declare.
- `ExpertProvider`: where the model gets routed experts during a forward (`get`, `each_batch`, `prefetch`,
  `prefetch_tokens`) and its counters (`stats`), and `Unpaged`, the base of providers that do not page
  (prefetches are no-ops, no counters).
Does not own: any implementation: the sources (`fastar.format.reader`, `fastar.convert`), the expert pager
(`fastar.weights`), the arithmetic on weights (`fastar.quant`).

Tensor names are the official checkpoint names, verbatim (`layers.3.attn.wq_a.weight`, `.scale`, `embed.weight`,
`mtp.0.e_proj.weight`, ...). Arrays come back in storage precision, never widened:
  F8_E4M3, F8_E8M0, I8 (packed FP4) -> uint8;  BF16 -> uint16 (bit patterns);  F32 -> float32;  I64 -> int64.
Routed experts are addressed by (layer slot, expert id); slots 0..L-1 are the main layers and L.. the MTP
blocks (mtp.0 is slot L).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import ClassVar, NamedTuple, Protocol, runtime_checkable

import numpy as np

from .config import ModelConfig


class ExpertWeights(NamedTuple):
    """One routed expert in checkpoint layout: FP4 packed [rows, cols/2] + UE8M0 scales [rows, cols/32]."""

    w1: np.ndarray  # gate  [I, D/2]  uint8
    w1_scale: np.ndarray  # [I, D/32] uint8
    w3: np.ndarray  # up    [I, D/2]
    w3_scale: np.ndarray  # [I, D/32]
    w2: np.ndarray  # down  [D, I/2]
    w2_scale: np.ndarray  # [D, I/32]


class Closing:
    """`with source:` and close-on-collect for sources that hold files; subclasses define an idempotent `close`."""

    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # half-constructed, or at interpreter exit
            pass


@runtime_checkable  # `load` tells a source from a path, and names anything that is neither
class WeightSource(Protocol):
    """Every source declares the attributes below; one that subclasses `WeightSource` inherits the defaults."""

    config: ModelConfig
    path: Path | None  # the file or directory read (a chat's `/save` never writes over it); None: built in memory
    # why only a short context runs, and how to lift that (a v2 file without its indexer sidecar); None: it does not
    context_note: str | None = None
    # the file's own parsed header (tensors, checksums), what identifies the weights in saved sessions and expert
    # usage profiles; None where there is none (a checkpoint directory), and the config identifies them
    header: object | None = None
    # where the big resident weights can be read into memory of their own rather than viewed in a mapping (a
    # `.fst`): `read_tensor(name)` is then that read; None where the source cannot
    read_tensor: Callable[[str], np.ndarray] | None = None
    pageable: ClassVar[bool] = False  # True: a `PagedSource`, whose routed experts the expert cache can page

    def names(self) -> list[str]:
        """Every tensor name the source holds (what a loading progress bar counts)."""
        ...

    def has(self, name: str) -> bool: ...

    def dtype(self, name: str) -> str:
        """Checkpoint dtype string of a resident tensor: F8_E4M3, F8_E8M0, BF16, F32, I64."""
        ...

    def nbytes(self, name: str) -> int:
        """Bytes of a resident tensor, without handing it out (a `.fst` that checks what it hands out reads it
        then): here from `tensor`, which a source with a header answers from that instead."""
        return self.tensor(name).nbytes

    def tensor(self, name: str) -> np.ndarray:
        """A resident (non-routed-expert) tensor in storage precision, as described above."""
        ...

    def expert(self, layer: int, expert: int) -> ExpertWeights: ...

    def tokenizer_json(self) -> bytes | None: ...


class PagedSource(WeightSource, Protocol):
    """A `WeightSource` the expert pager (`fastar.weights.expert_cache`) reads routed experts from, one record
    (the six arrays of `ExpertWeights` in `bank["sections"]` layout, `expert_stride` bytes) at a time."""

    pageable: ClassVar[bool] = True
    # `open_direct` gives an O_DIRECT descriptor that `read_expert_into` can read whole records through (one
    # aligned extent per record): the engine then pages with O_DIRECT unless told otherwise
    supports_direct_io: ClassVar[bool] = False
    bank: dict  # offset (bytes before the bank), stride, slots, experts, sections

    @property
    def expert_stride(self) -> int: ...

    @property
    def resident_bytes(self) -> int:
        """Bytes of everything but the routed experts (read every token)."""
        ...

    def expert_views(self, buf, base: int = 0) -> ExpertWeights:
        """One record's bytes (any buffer, from `base`) as the six arrays, without copying."""
        ...

    def read_expert_into(self, slot: int, e: int, buf, fd: int | None = None) -> ExpertWeights:
        """Read expert (slot, e) into `buf` (>= stride bytes) as one record; `fd`: from `open_direct`."""
        ...

    def open_direct(self) -> int | None:
        """A descriptor that bypasses the page cache, or None where the source has none."""
        ...


class ExpertProvider(Protocol):
    """Where the model gets routed experts. Every provider implements all five calls; one that does not page
    (`pages` False) answers `each_batch` with one list, treats the prefetches as no-ops and counts nothing."""

    pages: ClassVar[bool]  # True when prefetches can make later requests faster (the model then computes guesses)

    def get(self, layer: int, expert: int) -> ExpertWeights:
        """One expert's arrays, valid at least until this thread asks for another layer."""
        ...

    def each_batch(
        self, layer: int, ids: list[int], *, scan: bool = False
    ) -> Iterator[list[tuple[int, ExpertWeights]]]:
        """The experts `ids` of `layer` as lists of (id, weights), each list as it becomes available (every id
        exactly once over all lists; a list's arrays are valid until the next one is asked for). `scan`: the call
        belongs to a prefill pass that visits (nearly) every expert of every layer in turn; a pager then evicts
        what that pass used last, not what it needs next."""
        ...

    def prefetch(self, layer: int, ids: Iterable[int], source: str = "manual", *, scan: bool = False) -> int:
        """Start reading the experts `ids` of `layer` and return at once; returns how many reads were queued.
        `source` ("manual", "hash", "lookahead") keys the provider's accounting; `scan` as in `each_batch`."""
        ...

    def prefetch_tokens(self, token_ids: Iterable[int], tid2eid: Mapping[int, np.ndarray]) -> int:
        """Prefetch the hash-routed layers' experts of `token_ids` (`tid2eid[layer]` [vocab, k]); returns the count
        queued."""
        ...

    def stats(self) -> dict:
        """The provider's counters (hits, misses, reads, ...: `Engine.stats` reports the numeric ones as
        `expert_cache_*`); {} where it keeps none."""
        ...


class Unpaged:
    """Base of expert providers that do not page: subclasses define `get`; everything is present on request."""

    pages: ClassVar[bool] = False

    def get(self, layer: int, expert: int) -> ExpertWeights:
        raise NotImplementedError

    def each_batch(
        self, layer: int, ids: list[int], *, scan: bool = False
    ) -> Iterator[list[tuple[int, ExpertWeights]]]:
        yield [(e, self.get(layer, e)) for e in ids]

    def prefetch(self, layer: int, ids: Iterable[int], source: str = "manual", *, scan: bool = False) -> int:
        return 0

    def prefetch_tokens(self, token_ids: Iterable[int], tid2eid: Mapping[int, np.ndarray]) -> int:
        return 0

    def stats(self) -> dict:
        return {}


@runtime_checkable
class ServedTokenizer(Protocol):
    """The tokenizer the server encodes and decodes with (`fastar.engine.tokenizer.Tokenizer`)."""

    eos_id: int
    vocab_size: int  # token ids the routes accept are below it (/detokenize, prompts of ids, logit_bias)

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str: ...

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes of one token (part of a character, maybe): logprobs report them."""
        ...

    def max_token_bytes(self) -> int: ...

    def id_to_token(self, token_id: int) -> str | None:
        """The vocabulary's string of one token (/tokenize's `return_token_strs`), None for an id it lacks."""
        ...

    def token_to_id(self, token: str) -> int | None:
        """The id of a token given as the vocabulary's string (the DSML marker `tool_choice` "none" bans), None
        where the vocabulary lacks it."""
        ...


class ServedEngine(Protocol):
    """What the server reads of the engine it serves besides its scheduler (`fastar.serve.worker`)."""

    # the model's own name: /v1/models reports it as `root`, and requests may name it besides the served names
    model_name_default: str
    context_length: int
    context_note: str | None  # why `context_length` is capped below what was asked, or None
    tokenizer: ServedTokenizer
