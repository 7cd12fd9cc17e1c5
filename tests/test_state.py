"""Decode state: row buffers, retention, truncation, snapshot/restore and the byte format."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastar.model import ops
from fastar.model.state import LayerState, ModelState, RowBuffer, RowFormat, StateError
from fastar.quant import kernels


def test_row_buffer_append_rows_take_truncate_drop():
    b = RowBuffer(3)
    for i in range(40):
        b.append(torch.full((1, 3), float(i)))
    b.append(torch.arange(6.0).view(2, 3) + 100)
    assert (b.start, b.stop) == (0, 42)
    assert torch.equal(b.rows(5, 7)[:, 0], torch.tensor([5.0, 6.0]))
    assert torch.equal(b.take(torch.tensor([[1, 39]]))[..., 0], torch.tensor([[1.0, 39.0]]))
    b.drop_before(30)
    assert (b.start, b.stop) == (30, 42)
    assert b.rows(30, 31)[0, 0] == 30
    with pytest.raises(StateError):
        b.rows(29, 31)
    b.truncate(35)
    assert b.stop == 35
    b.append(torch.zeros(1, 3))
    assert b.rows(35, 36)[0, 0] == 0
    with pytest.raises(StateError):
        b.truncate(10)


@pytest.mark.skipif(not kernels.available(), reason="the array path is the C extension's")
@pytest.mark.parametrize("fmt", [None, RowFormat("fp8", 128, 64), RowFormat("fp4", 64)])
def test_append_array_stores_what_append_stores(fmt):
    """`append_array` (a decode step's KV rows as numpy) against `append`: the same stored bytes and rows through
    growth, `drop_before` (a view, then a compacting copy), `truncate` and a move to another buffer."""
    width = 3 if fmt is None else fmt.width
    a, b = RowBuffer(width, fmt=fmt), RowBuffer(width, fmt=fmt)
    g = torch.Generator().manual_seed(0)
    for i in range(70):
        rows = torch.randn(1 + i % 2, width, generator=g) * 4
        if fmt is not None and fmt.kind == "fp8":  # what each packed format stores exactly (`_fp8_nope`, the indexer)
            rows = torch.cat([ops.fp8_quant_sim(rows[:, : -fmt.rope], 64), rows[:, -fmt.rope :]], dim=1)
        elif fmt is not None:
            rows = ops.fp4_quant_sim(rows, 32)
        a.append(rows)
        assert b.append_array(rows.numpy())
        if i == 20:
            a.drop_before(5), b.drop_before(5)  # a view of the same storage
        if i == 40:
            a.drop_before(a.stop - 3), b.drop_before(b.stop - 3)  # compacted: a new storage
        if i == 50:
            a.truncate(a.stop - 2), b.truncate(b.stop - 2)
        assert (a.start, a.stop) == (b.start, b.stop)
        assert torch.equal(a.raw(), b.raw())
        assert np.array_equal(b.raw_array(), b.raw().numpy())  # the cached array follows the storage's changes
        assert np.shares_memory(b.raw_array(), b.raw().numpy())
    assert torch.equal(a.rows(a.start, a.stop), b.rows(b.start, b.stop))
    stored = b.raw().clone()
    grown = b.grow_array(2)  # `grow` as the storage's array: the caller writes the new rows in place
    grown[b.stop - b.start - 2 : b.stop - b.start] = 7
    assert torch.equal(b.raw()[:-2], stored) and bool((b.raw()[-2:] == 7).all())
    c = b.copy()
    assert c.append_array(np.ones((1, width), np.float32)) and c.stop == b.stop + 1
    assert torch.equal(c.raw()[:-1], b.raw())  # the copy's storage apart from b's


def _fill(s: LayerState, n: int) -> None:
    """Pretend the model processed n positions: one row per position, one entry per closed window."""
    for p in range(s.length, n):
        row = torch.full((1, s.kv.width), float(p))
        s.kv.append(row)
        if s.ratio:
            s.comp_kv.append(torch.full((1, s.comp_kv.width), float(p)))
            s.comp_gate.append(torch.full((1, s.comp_gate.width), float(p)))
            if (p + 1) % s.ratio == 0:
                s.entries.append(torch.full((1, s.entries.width), float(p)))
        if s.ratio == 4:
            s.idx_kv.append(torch.full((1, s.idx_kv.width), float(p)))
            s.idx_gate.append(torch.full((1, s.idx_gate.width), float(p)))
            if (p + 1) % 4 == 0:
                s.idx_entries.append(torch.full((1, s.idx_entries.width), float(p)))
    s.length = n


@pytest.mark.parametrize("ratio", [0, 4, 128])
def test_trim_keeps_what_the_next_token_needs(ratio):
    s = LayerState.new(ratio, 8, 4, 2)
    _fill(s, 300)
    s.trim(0)
    first_kv, first_comp = s.first_needed(300)
    assert s.kv.start == first_kv == 293  # window rows 293..299 for the next query (W - 1 of them)
    if ratio:
        assert s.comp_kv.start == first_comp == {4: 296, 128: 256}[ratio]  # open window (+ previous Ca for 4)
        assert s.entries.stop == 300 // ratio  # entries are never trimmed
    s.copy().truncate(300)  # a no-op truncation is always fine
    with pytest.raises(StateError):
        s.copy().truncate(299)  # needs window row 292, dropped with max_rollback 0
    s2 = LayerState.new(ratio, 8, 4, 2)
    _fill(s2, 300)
    s2.trim(1)
    s2.truncate(299)


@pytest.mark.parametrize("ratio", [4, 128])
def test_truncate_cuts_rows_and_entries(ratio):
    s = LayerState.new(ratio, 8, 4, 2)
    _fill(s, 300)
    s.truncate(131)
    assert s.length == 131 and s.kv.stop == 131 and s.comp_kv.stop == 131
    assert s.entries.stop == 131 // ratio
    if ratio == 4:
        assert s.idx_entries.stop == 32 and s.idx_kv.stop == 131
    with pytest.raises(StateError):
        s.truncate(200)  # cannot grow by truncation


def test_max_rollback_bounds_retention():
    s = LayerState.new(4, 8, 4, 2)
    _fill(s, 300)
    s.trim(50)
    s.copy().truncate(250)  # exactly max_rollback back: allowed
    with pytest.raises(StateError):
        s.copy().truncate(200)


def _model_state() -> ModelState:
    layers = [LayerState.new(r, 8, 4, 2) for r in (0, 4, 128)]
    mtp = [LayerState.new(0, 8, 4, 2)]
    for s in layers:
        _fill(s, 140)
    _fill(mtp[0], 139)
    return ModelState(layers, mtp, max_rollback=None)


def test_snapshot_is_independent_and_restore_round_trips():
    st = _model_state()
    snap = st.snapshot()
    for s in st.layers:
        _fill(s, 150)
    st.truncate(100)
    assert st.length == 100 and st.mtp[0].length == 99
    assert snap.length == 140 and snap.layers[2].entries.stop == 1
    st.restore(snap)
    assert st.length == 140 and st.layers[1].entries.stop == 35
    assert torch.equal(st.layers[1].kv.all(), snap.layers[1].kv.all())
    st.layers[1].kv.truncate(0)  # restoring copied: the snapshot is untouched
    assert snap.layers[1].kv.stop == 140


def test_fork_holds_what_trim_keeps_and_is_independent():
    """A fork copies the rows a trimmed copy keeps (the same rows, bit for bit), not the long-rollback ones."""
    st = _model_state()
    fork = st.fork(3)
    trimmed = st.snapshot()
    for s in trimmed.layers + trimmed.mtp:
        s.trim(3)
    for a, b in zip(fork.layers + fork.mtp, trimmed.layers + trimmed.mtp, strict=True):
        assert a.length == b.length
        for name, buf in a.buffers().items():
            other = b.buffers()[name]
            assert (buf.start, buf.stop) == (other.start, other.stop) and torch.equal(buf.raw(), other.raw()), name
    assert fork.nbytes() < st.nbytes() and fork.layers[0].kv.start == 140 - 3 - 8 + 1
    fork.truncate(137)  # its rollback is allowed ...
    with pytest.raises(StateError):
        st.fork(3).truncate(136)  # ... no further
    assert st.length == 140 and st.layers[0].kv.start == 0  # the original is untouched


def test_bytes_round_trip_and_rejects_garbage():
    st = _model_state()
    st.layers[0].trim(5)
    raw = st.to_bytes()
    back = ModelState.from_bytes(raw)
    assert back.length == 140 and back.max_rollback is None
    for a, b in zip(st.layers + st.mtp, back.layers + back.mtp):
        assert a.ratio == b.ratio and a.length == b.length
        for name, buf in a.buffers().items():
            other = b.buffers()[name]
            assert (buf.start, buf.stop) == (other.start, other.stop)
            assert torch.equal(buf.all(), other.all())
    with pytest.raises(StateError):
        ModelState.from_bytes(b"NOTSTATE" + raw[8:])
    with pytest.raises(StateError):
        ModelState.from_bytes(raw[:-4])


def test_state_bytes_accounts_for_what_a_state_holds(tmp_path) -> None:
    """fastar.model.state.state_bytes equals ModelState.nbytes() after prefills of any length, with and without a
    rollback bound (the MTP blocks stay empty without a draft), in both numerics' state formats; in float32 the
    growth per token is twice the official inference's bf16 layout."""
    from fastar.convert.hf import convert
    from fastar.engine.engine import load
    from fastar.fixtures import write_checkpoint
    from fastar.model.state import state_accounting, state_bytes

    fst = convert(write_checkpoint(tmp_path / "ck", "tiny", seed=0), tmp_path / "t.fst", progress=False)
    for numerics in ("official", "reference"):
        for mr in (None, 3, 20):
            e = load(str(fst), max_rollback=mr, numerics=numerics)
            fmt = e.model.numerics.state_format(e.config)
            for n in (1, 5, 37, 130):
                st = e.new_state()
                e.prefill(list(range(3, 3 + n)), st)
                assert st.nbytes() == state_bytes(e.config, n, mr, mtp_layers=0, fmt=fmt), (numerics, mr, n)
    cfg = e.config
    acct = state_accounting(cfg, 20)
    grow = sum(
        4 * (cfg.head_dim + (cfg.index_head_dim if r == 4 else 0)) / r
        for r in (cfg.ratio(i) for i in range(cfg.num_hidden_layers))
        if r
    )
    assert acct["per_token"] == grow == 2 * acct["official_per_token"]
    assert acct["at_1m"] == state_bytes(cfg, 1 << 20, 20) and acct["fixed"] > 0
