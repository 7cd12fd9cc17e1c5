"""The declared contracts of fastar/contracts.py: every expert provider implements the whole `ExpertProvider`
protocol, so the model calls it without probing, and the providers that do not page behave as documented."""

from __future__ import annotations

import inspect
import os

import numpy as np
import pytest
from test_server import FakeTokenizer

from fastar.bench.cache import MmapExperts
from fastar.bench.speculative import SlowExperts
from fastar.contracts import (
    ExpertProvider,
    ExpertWeights,
    PagedSource,
    ServedEngine,
    ServedTokenizer,
    Unpaged,
    WeightSource,
)
from fastar.convert.checkpoint import Checkpoint
from fastar.convert.v2 import FstV2File
from fastar.engine.engine import Engine
from fastar.engine.tokenizer import Tokenizer
from fastar.format.reader import FstFile
from fastar.quant.linear import SourceExperts
from fastar.weights.device_cache import DeviceExpertCache
from fastar.weights.expert_cache import ExpertCache

PROVIDERS = [SourceExperts, ExpertCache, DeviceExpertCache, MmapExperts, SlowExperts]
METHODS = ["get", "each_batch", "prefetch", "prefetch_tokens", "stats"]


def _positional(f) -> list[inspect.Parameter]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p for p in inspect.signature(f).parameters.values() if p.kind in kinds]


@pytest.mark.parametrize("cls", PROVIDERS, ids=lambda c: c.__name__)
def test_every_provider_implements_the_protocol(cls):
    """Each call takes the protocol's positional arguments (no more required), and `prefetch` takes `source=`,
    which the model and the speculative loop pass by keyword."""
    assert isinstance(cls.pages, bool)
    for name in METHODS:
        want, got = _positional(getattr(ExpertProvider, name)), _positional(getattr(cls, name))
        required = [p for p in got if p.default is inspect.Parameter.empty]
        assert len(got) >= len(want) >= len(required), f"{cls.__name__}.{name} does not match the protocol"
    assert "source" in inspect.signature(cls.prefetch).parameters


class _Fake(Unpaged):
    def __init__(self) -> None:
        self.asked: list[tuple[int, int]] = []

    def get(self, layer: int, expert: int) -> ExpertWeights:
        self.asked.append((layer, expert))
        a = np.full((1, 1), expert, np.uint8)
        return ExpertWeights(a, a, a, a, a, a)


def test_unpaged_provider_yields_one_batch_and_ignores_prefetches():
    p = _Fake()
    assert not p.pages and p.stats() == {}
    assert p.prefetch(3, [1, 2], source="hash") == 0
    assert p.prefetch_tokens([5, 6], {0: np.zeros((8, 2), np.int64)}) == 0
    assert p.asked == []  # a prefetch reads nothing
    batches = list(p.each_batch(3, [4, 1, 7]))
    assert len(batches) == 1 and [e for e, _ in batches[0]] == [4, 1, 7]
    assert [int(w.w1[0, 0]) for _, w in batches[0]] == [4, 1, 7] and p.asked == [(3, 4), (3, 1), (3, 7)]


SOURCES = [FstFile, Checkpoint, FstV2File]


@pytest.mark.parametrize("cls", SOURCES, ids=lambda c: c.__name__)
def test_every_source_declares_the_protocol(cls):
    """The sources subclass `WeightSource`, so each has every declared attribute (the engine reads them without
    probing); only a `.fst` reads tensors into memory of its own, and a checkpoint directory has no header."""
    assert WeightSource in cls.__mro__
    for name in ("context_note", "header", "read_tensor", "names", "has", "dtype", "tensor", "expert"):
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
    assert callable(FstFile.read_tensor) and Checkpoint.read_tensor is None and FstV2File.read_tensor is None
    assert Checkpoint.header is None and Checkpoint.context_note is None


@pytest.mark.parametrize("cls", SOURCES, ids=lambda c: c.__name__)
def test_every_file_source_pages(cls):
    """The file sources are `PagedSource`s: the engine pages their experts without probing for the calls; only a
    `.fst` (one aligned extent per record) asks for O_DIRECT by default."""
    assert PagedSource in cls.__mro__ and cls.pageable is True
    for name in ("expert_stride", "resident_bytes", "expert_views", "read_expert_into", "open_direct"):
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
    assert cls.supports_direct_io is (cls is FstFile and hasattr(os, "O_DIRECT"))
    assert WeightSource.pageable is False  # an in-memory source does not page


def test_the_engine_declares_what_the_server_reads():
    """`Engine` has every attribute of `ServedEngine` (the server reads them without probing), its own name a
    string; the V4 tokenizer is a `ServedTokenizer`, EOS and the bytes of a token included."""
    for name in ServedEngine.__annotations__:
        assert hasattr(Engine, name), f"Engine lacks {name}"
    assert isinstance(Engine.model_name_default, str) and isinstance(Engine.context_note, property)
    tok = Tokenizer.default()
    assert isinstance(tok, ServedTokenizer)
    assert tok.decode([tok.eos_id]) == "<｜end▁of▁sentence｜>" and tok.token_bytes(tok.encode("a")[0]) == b"a"
    assert tok.id_to_token(tok.encode("a")[0]) == "a" and tok.vocab_size == 129280


def test_served_tokenizer_declares_what_the_routes_read():
    """The routes read `vocab_size` (token ids checked against it) and `id_to_token` (/tokenize's
    `return_token_strs`): the protocol declares both, so a tokenizer without either is not a `ServedTokenizer`; the
    server tests' fake tokenizer is one."""
    tok = FakeTokenizer()
    assert isinstance(tok, ServedTokenizer)
    del tok.vocab_size
    assert not isinstance(tok, ServedTokenizer)  # no vocab_size
    without_strs = type("WithoutTokenStrs", (), {k: v for k, v in vars(FakeTokenizer).items() if k != "id_to_token"})
    assert not isinstance(without_strs(), ServedTokenizer)  # no id_to_token
