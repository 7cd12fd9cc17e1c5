"""The compressors' fused decode call (`fastar.model.compress_fused`, C: bind_compress.c) against the op-by-op path it
replaces (`Compressor.gated` + `Compressor.add`, the model with `Attention.comp_fused` off): the same logits and the
same state bytes through prefill and batched decode over many window closes, under both numerics, with trimmed and
restored states; batched rows equal to decoding each alone; an entry the state format cannot hold refused as the
op-by-op path refuses it; and the call's argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastar.model.state import ModelState, StateError, StateFormat
from fastar.quant import kernels, linear

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(linear._kernels() is None, reason="the fused call is a C call (not built here)"),
]

ROWS = (8, 1, 2, 3, 4, 5, 6, 7, 8, 8, 3, 8)  # rows of each decode step: 1..8, the first ones advancing most


def _models(fst, numerics: str, **kw):
    """Two models on one file: the fused compressor calls on, and off (the op-by-op reference)."""
    from fastar.model.deepseek_v4 import DeepseekV4

    fused, apart = DeepseekV4(fst, numerics=numerics, **kw), DeepseekV4(fst, numerics=numerics, **kw)
    for b in apart.layers:
        b.attn.comp_fused = None
    return fused, apart


def _prompts(seed: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 1024, (n,), generator=g).tolist() for n in (120, 9, 3, 33, 62, 1, 17, 126)]


def _run(m, prompts: list[list[int]], restore: bool) -> tuple[list[torch.Tensor], list[ModelState]]:
    """Each prompt prefilled alone (every other state then restored from its bytes: storage of exactly its rows), then
    decode steps of the first ROWS[i] sequences at once -> (every logits row, the states)."""
    states = [m.new_state() for _ in prompts]
    outs = [m.forward(p, s, all_logits=False)[0][-1:] for p, s in zip(prompts, states)]
    if restore:
        states = [ModelState.from_bytes(s.to_bytes()) if i % 2 else s for i, s in enumerate(states)]
    ids = [int(o[-1].argmax()) for o in outs]
    for n in ROWS:
        logits = m.forward_rows(ids[:n], states[:n])
        outs.append(logits)
        ids[:n] = [int(r.argmax()) for r in logits]
    return outs, states


@pytest.mark.parametrize("numerics", ["official", "reference"])
@pytest.mark.parametrize("max_rollback", [None, 2])
def test_fused_compressors_equal_op_by_op(tiny_fst_file, numerics, max_rollback, monkeypatch):
    """Eight sequences prefilled to different positions, then 12 batched decode steps of 1..8 rows: ratio-4 windows
    close every 4th token (the layer's compressor and its indexer's, FP8 / FP4 entries under official numerics,
    float32 under reference), the ratio-128 window at position 127, the indexer scoring past 4 * index_topk
    entries. Logits and every state's bytes are bit for bit those of the op-by-op path, with states keeping every row
    or trimmed to a short rollback (storage views after dropped rows), restored from bytes or not."""
    fused, apart = _models(tiny_fst_file, numerics, max_rollback=max_rollback)
    assert all((b.attn.comp_fused is not None) == bool(b.attn.ratio) for b in fused.layers)
    assert {b.attn.ratio for b in fused.layers} >= {0, 4, 128}
    calls = {"all": 0, "closing": 0}
    real = kernels.extension.compress_row

    def counted(*a):
        calls["all"] += 1
        calls["closing"] += a[14] is not None  # an entry row to store: the token closed its window
        return real(*a)

    monkeypatch.setattr(kernels.extension, "compress_row", counted)
    prompts = _prompts(4)
    for restore in (False, True):
        got, got_states = _run(fused, prompts, restore)
        n = calls["all"]
        want, want_states = _run(apart, prompts, restore)
        assert calls["all"] == n  # the reference never calls it
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        assert [s.to_bytes() for s in got_states] == [s.to_bytes() for s in want_states]
    assert calls["all"] >= 2 * 3 * sum(ROWS)  # every row of every step: 3 compressors
    assert calls["closing"] >= 2 * 3 * sum(ROWS) // 4


@pytest.mark.parametrize("numerics", ["official", "reference"])
def test_fused_rows_equal_decoding_each_alone(tiny_fst_file, numerics):
    """Batch invariance with the fused calls: each row of a batched step (`forward_rows`) gets the logits and the
    state bytes that a one-token `forward` of that sequence alone gives (that path runs `Compressor.add` op by op)."""
    from fastar.model.deepseek_v4 import DeepseekV4

    m = DeepseekV4(tiny_fst_file, numerics=numerics)
    prompts = _prompts(7)[:5]
    states = [m.new_state() for _ in prompts]
    ids = [int(m.forward(p, s, all_logits=False)[0][-1].argmax()) for p, s in zip(prompts, states)]
    alone = [s.snapshot() for s in states]
    for _ in range(9):
        rows = m.forward_rows(ids, states)
        for b, (tok, s) in enumerate(zip(ids, alone)):
            assert torch.equal(rows[b], m.forward([tok], s, all_logits=False)[0][-1]), b
        assert [s.to_bytes() for s in states] == [s.to_bytes() for s in alone]
        ids = [int(r.argmax()) for r in rows]


def test_an_entry_the_format_cannot_hold_is_refused_as_op_by_op(tiny_fst_file):
    """Reference numerics (nothing rounded) on a state that stores index keys as FP4: the first closing window's index
    key does not fit, and the fused path raises the StateError the op-by-op path raises, leaving the same state."""
    fused, apart = _models(tiny_fst_file, "reference")
    fmt = StateFormat(fp4_index=True)
    errors, states = [], []
    for m in (fused, apart):
        s = m.new_state(fmt)
        m.forward([5, 6, 7], s)  # positions 0..2: no window closed yet
        with pytest.raises(StateError, match="fp4 state format") as e:
            m.forward_rows([8], [s])  # position 3 closes window 0
        errors.append(str(e.value))
        states.append(s)
    assert errors[0] == errors[1]
    assert [b.raw().shape for b in states[0].layers[1].buffers().values()] == [
        b.raw().shape for b in states[1].layers[1].buffers().values()
    ]


def test_compress_row_refuses_bad_arguments(tiny_fst_file):
    """Wrong shapes, dtypes and rows get one-line errors naming the argument, never a crash."""
    from fastar.model.deepseek_v4 import DeepseekV4

    attn = next(b.attn for b in DeepseekV4(tiny_fst_file).layers if b.attn.ratio == 4)
    part = attn.comp_fused.parts[0]
    W, hd, m = part.width, part.norm.shape[0], part.ape.shape[0]
    assert (m, W) == (4, 2 * hd)  # the overlapping windows
    y = np.zeros((1, attn.comp_fused.stack.out_features), np.float32)
    rows = np.zeros((16, W), np.float32)
    gates = np.zeros((16, W), np.float32)
    cs = np.zeros((1, attn.rope // 2), np.float32)
    out = np.zeros((4, hd), np.float32)

    def call(**kw):
        a = dict(y=y, t=0, off=0, kv=rows, gate=gates, row=7, ape=part.ape, pos=7, norm=part.norm, eps=1e-6, quant=0)
        a.update(rope=attn.rope, cos=cs, sin=cs, out=out, out_row=1, out_kind=-1)
        a.update(kw)
        return kernels.extension.compress_row(*a.values())

    assert call() is True  # position 7 closes window 1 (ratio 4): rows 0..7 read, entry row 1 written
    assert call(pos=5, cos=None, sin=None, out=None) is True  # no close: nothing but the rows
    for kw, name in (
        (dict(y=y.astype(np.float64)), "y"),
        (dict(off=y.shape[1] - 2 * W + 1), "y"),
        (dict(t=1), "y"),
        (dict(kv=rows[:, :-1]), "kv_rows"),
        (dict(gate=rows), "gate_rows"),
        (dict(row=16), "kv_rows"),
        (dict(row=3), "kv_rows"),  # window 1 needs the 8 rows up to row 3
        (dict(norm=part.norm[:-1]), "ape"),
        (dict(cos=np.zeros((2, attn.rope // 2), np.float32)), "cos"),
        (dict(cos=None), "cos"),
        (dict(out=np.zeros((4, hd), np.uint8)), "out"),
        (dict(out=out[:, 1:]), "out"),
        (dict(out_row=4), "out"),
        (dict(out_kind=0), "out"),  # FP8 rows are bytes
        (dict(quant=3), "quant"),
    ):
        with pytest.raises((ValueError, TypeError), match=name):
            call(**kw)


def test_project_equals_the_stacked_product(tiny_fst_file):
    """`FusedCompressors.project` (the stacked product's C call on x's array, into a buffer per row count) gives the
    bits `stack(x)` gives, for 1 to 8 rows, the registered input as a plain tensor alike; each row count its own
    buffer, reused by the next call of that count."""
    from fastar.model import ops
    from fastar.model.deepseek_v4 import DeepseekV4

    m = DeepseekV4(tiny_fst_file)
    cf = next(b.attn.comp_fused for b in m.layers if b.attn.comp_fused is not None)
    g = torch.Generator().manual_seed(3)
    for T in range(1, 9):
        x = torch.randn(T, cf.stack.in_features, generator=g)
        y, yn = cf.project(x)
        assert torch.equal(y, cf.stack(x)) and np.shares_memory(y.numpy(), yn), T
        registered = ops.buffer_tensor(x.numpy().copy())
        assert cf.project(registered)[0] is y and torch.equal(y, cf.stack(x)), T
    with ops.torch_only():
        assert cf.project(x) is None
