"""`fastar.model.angles.AngleTable`: a decode step's RoPE cos / sin looked up in blocks computed ahead, bit for bit
what `ops.rope_cos_sin` computes for the same positions (alone or batched), for the plain and the YaRN frequencies
of Flash widths; frequencies whose count is not a multiple of 32 are computed as before (no table)."""

from __future__ import annotations

import pytest
import torch

from fastar.config import ModelConfig
from fastar.fixtures import preset_config
from fastar.model import angles, ops
from fastar.model.deepseek_v4 import layer_inv_freq


@pytest.mark.parametrize("ratio", [0, 4])
def test_table_rows_equal_rope_cos_sin(ratio):
    cfg = ModelConfig.from_hf(preset_config("flash"))
    inv = layer_inv_freq(cfg, ratio)
    table = angles.AngleTable(inv)
    assert table.tabled and inv.shape[0] == 32
    g = torch.Generator().manual_seed(ratio)
    edges = [0, 1, angles.BLOCK - 1, angles.BLOCK, 3 * angles.BLOCK + 7, 1_000_003, 16_777_215]
    batches = [[p] for p in edges] + [torch.randint(0, 70_000, (n,), generator=g).tolist() for n in range(1, 9)]
    batches += [torch.randint(0, 1 << 22, (8,), generator=g).tolist() for _ in range(2 * angles.MAX_BLOCKS)]
    for pos in batches:  # more blocks than the table keeps: it restarts on the way
        want = ops.rope_cos_sin(inv, torch.tensor(pos))
        got = table.rows(pos)
        for a, b in zip(got, want):
            assert a.shape == b.shape == (len(pos), 32) and torch.equal(a, b), pos
        c, s = table.row(pos[0])
        assert torch.equal(torch.from_numpy(c), want[0][:1]) and torch.equal(torch.from_numpy(s), want[1][:1])
    assert len(table._blocks) <= angles.MAX_BLOCKS


def test_frequencies_off_the_simd_width_are_computed_as_before():
    inv = ops.rope_inv_freq(16, 10000.0)  # 8 angles a position: a lone row takes torch's scalar path
    table = angles.AngleTable(inv)
    assert not table.tabled
    for pos in ([5], [3, 900, 77]):
        for a, b in zip(table.rows(pos), ops.rope_cos_sin(inv, torch.tensor(pos))):
            assert torch.equal(a, b)
    assert not table._blocks


def test_torch_only_scope_computes_as_before():
    """Where ops take their torch paths (a device backend's scope makes its tensors on the device), the rows are
    computed there as `ops.rope_cos_sin` does, not looked up in the host's table."""
    inv = ops.rope_inv_freq(64, 10000.0)
    table = angles.AngleTable(inv)
    with ops.torch_only():
        got = table.rows([7, 300])
    assert not table._blocks
    for a, b in zip(got, ops.rope_cos_sin(inv, torch.tensor([7, 300]))):
        assert torch.equal(a, b)


def test_the_last_rows_are_kept_registered_for_the_c_calls():
    """The same positions asked again (the next layer of a step) get the same tensors back, registered with
    `ops.buffer_tensor` (`ops.c_arrays` returns their arrays as they are); new positions take them off the register."""
    if not ops.c_enabled():
        pytest.skip("the register serves the C calls")
    table = angles.AngleTable(ops.rope_inv_freq(64, 10000.0))
    first = table.rows([7, 300])
    assert table.rows([7, 300]) is first
    arrays = ops.c_arrays(*first)
    assert all(a is ops._BUFFERS[id(t)][1] for a, t in zip(arrays, first))  # the registered arrays themselves
    assert all(torch.equal(torch.from_numpy(a), t) for a, t in zip(arrays, first))
    assert all(id(t) in ops._BUFFERS for t in first)
    second = table.rows([8])
    assert second is not first and all(id(t) not in ops._BUFFERS for t in first)
    for a, b in zip(second, ops.rope_cos_sin(table.inv_freq, torch.tensor([8]))):
        assert torch.equal(a, b)


def test_buffer_tensors_come_back_as_their_arrays():
    """`ops.c_arrays` hands a registered buffer's own array back (no copy, no check); a forgotten one is checked and
    converted as any tensor; `buffer_tensor` refuses what the C calls could not take."""
    import numpy as np

    if not ops.c_enabled():
        pytest.skip("the register serves the C calls")
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    t = ops.buffer_tensor(a)
    assert ops.c_arrays(t)[0] is a
    with ops.torch_only():  # the C calls off: c_arrays declines, the register still answers
        assert ops.c_arrays(t) is None and ops.buffer_array(t) is a
    assert ops.buffer_array(torch.from_numpy(a)) is None  # another tensor over the same array is not registered
    ops.forget_buffer(t)
    got = ops.c_arrays(t)[0]
    assert got is not a and np.shares_memory(got, a)
    for bad in (a.astype(np.float64), a.T, np.empty((0, 4), np.float32)):
        with pytest.raises(ValueError, match="buffer_tensor"):
            ops.buffer_tensor(bad)


def test_a_decode_step_looks_each_frequency_set_up_once(tiny_fst_file, monkeypatch):
    """`forward_rows` shares the rows' RoPE angles among its layers (`Attention.rows`' `step`): one table lookup per
    set of frequencies a step, whatever the layer count, and the logits those of `Block.rows` without the chain (each
    layer looking its angles up itself)."""
    from fastar.model.deepseek_v4 import DeepseekV4

    m, apart = DeepseekV4(tiny_fst_file), DeepseekV4(tiny_fst_file)
    apart.hc_chain = None
    kinds = {b.attn.freq_key for b in m.layers}
    assert len(m.layers) > len(kinds)
    calls = []
    real = angles.AngleTable.rows
    monkeypatch.setattr(angles.AngleTable, "rows", lambda self, pos: calls.append(pos) or real(self, pos))
    states = [m.new_state(), m.new_state()]
    others = [apart.new_state(), apart.new_state()]
    for s, o, p in zip(states, others, ([5, 9, 2], [7])):
        m.forward(p, s), apart.forward(p, o)
    ids = [3, 4]
    for _ in range(3):
        calls.clear()
        got = m.forward_rows(ids, states)
        assert calls == [[s.length - 1 for s in states]] * len(kinds)
        calls.clear()
        assert torch.equal(got, apart.forward_rows(ids, others)) and len(calls) == len(apart.layers)
        ids = [int(r.argmax()) for r in got]
