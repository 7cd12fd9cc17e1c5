"""The attention block's fused decode calls (`fastar.model.fused`, C: bind_blocks.c) against the op-by-op path they
replace (`Attention._project` / `_output` and `Indexer.queries` with the fused calls off): the same bits, per call
and through a model's prefill and batched decode steps, under both numerics; and their argument checks. Also the
indexer scoring its stored keys packed (`Indexer.pick_stored`) against decoding them first."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastar.model import ops
from fastar.quant import kernels, linear

pytestmark = [
    pytest.mark.usefixtures("one_torch_thread"),
    pytest.mark.skipif(linear._kernels() is None, reason="the fused calls are C calls (not built here)"),
]


def _models(fst, numerics: str):
    """Two models on one file: fused calls on, and off (the op-by-op reference)."""
    from fastar.model.deepseek_v4 import DeepseekV4

    fused, apart = DeepseekV4(fst, numerics=numerics), DeepseekV4(fst, numerics=numerics)
    for b in apart.layers:
        b.attn.fused = None
        if b.attn.indexer is not None:
            b.attn.indexer.fused = None
    return fused, apart


@pytest.mark.parametrize("numerics", ["official", "reference"])
def test_fused_attention_calls_equal_op_by_op(tiny_fst_file, numerics):
    """`FusedAttention.project` / `.output` against `Attention._project` / `_output` op by op: bit for bit for 1..8
    rows at their own positions (a strided x too), on every layer (compressed and plain RoPE alike)."""
    fused, apart = _models(tiny_fst_file, numerics)
    assert all(b.attn.fused is not None for b in fused.layers)
    assert any(b.attn.indexer is not None and b.attn.indexer.fused is not None for b in fused.layers)
    g = torch.Generator().manual_seed(5)
    for fb, ab in zip(fused.layers, apart.layers):
        f, a = fb.attn, ab.attn
        d = f.wq_a.in_features
        for T in (1, 2, 3, 5, 8):
            x = torch.randn(T, 2 * d, generator=g)[:, ::2] * 3  # strided: the call takes a contiguous copy
            pos = torch.randint(0, 5000, (T,), generator=g)
            cos, sin = ops.rope_cos_sin(f.inv_freq, pos)
            got, want = f._project(x, cos, sin), a._project(x, cos, sin)
            for u, v in zip(got, want):
                assert u.shape == v.shape and torch.equal(u, v)
            o = torch.randn(T, f.H, f.D, generator=g)
            assert torch.equal(f._output(o, cos, sin), a._output(o, cos, sin))
            if f.indexer is not None:  # the indexer's queries and head weights (`FusedIndexer`)
                qr = torch.randn(T, f.wq_a.out_features, generator=g)
                got, want = f.indexer.queries(x, qr, pos, (cos, sin)), a.indexer.queries(x, qr, pos, (cos, sin))
                for u, v in zip(got, want):
                    assert u.shape == v.shape and torch.equal(u, v)
        x = torch.randn(ops.SMALL_CHUNK + 1, d, generator=g)  # a prefill chunk: not a decode step's, not fused
        cos, sin = ops.rope_cos_sin(f.inv_freq, torch.arange(x.shape[0]))
        assert f.fused.project(x, cos, sin) is None


def _prefill_and_decode(m, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list, list[int]]:
    """Each prompt prefilled on its own state, then `steps` greedy decode steps of all of them at once
    (`forward_rows`, the scheduler's path) -> (the logits of every call, the states, the next tokens)."""
    states = [m.new_state() for _ in prompts]
    outs = [m.forward(p, s, all_logits=False)[0] for p, s in zip(prompts, states)]
    ids = [int(o[-1].argmax()) for o in outs]
    for _ in range(steps):
        outs.append(m.forward_rows(ids, states))
        ids = [int(r.argmax()) for r in outs[-1]]
    return outs, states, ids


def test_fused_attention_model_equals_op_by_op(tiny_fst_file):
    """A prefill and six batched decode steps of two sequences (`forward_rows`, the scheduler's path), and a
    speculative-style 3-token chunk: logits bit for bit with the fused calls on and off."""
    fused, apart = _models(tiny_fst_file, "official")
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 1024, (n,), generator=g).tolist() for n in (140, 9)]
    logits = {}
    for name, m in (("fused", fused), ("apart", apart)):
        outs, states, ids = _prefill_and_decode(m, prompts, 6)
        outs.append(m.forward(ids + ids[:2], states[0])[0])
        logits[name] = outs
    for a, b in zip(logits["fused"], logits["apart"]):
        assert torch.equal(a, b)


def test_fused_attention_refuses_bad_arguments(tiny_fst_file):
    """Wrong shapes and dtypes get one-line errors naming the argument, never a crash."""
    from fastar.model.deepseek_v4 import DeepseekV4

    attn = DeepseekV4(tiny_fst_file).layers[0].attn
    f, half = attn.fused, attn.rope // 2
    (wa, sa), (wb, sb) = f.a, f.b
    d, T = wa.shape[1], 2
    x = np.zeros((T, d), np.float32)
    cs = np.zeros((T, half), np.float32)
    q = np.zeros((T, f.heads * f.head_dim), np.float32)
    qr, kv = np.zeros((T, f.q_lora), np.float32), np.zeros((T, f.head_dim), np.float32)

    def project(**kw):
        a = dict(x=x, wa=wa, sa=sa, q_lora=f.q_lora, wb=wb, sb=sb, qn=f.q_norm, kn=f.kv_norm, cos=cs, sin=cs)
        a.update(kw)
        o = dict(q=q, qr=qr, kv=kv) | {k: a.pop(k) for k in ("q", "qr", "kv") if k in a}
        kernels.extension.attn_project(*a.values(), f.eps, 128, 64, o["q"], o["qr"], o["kv"])

    project()  # the good call runs
    for kw, name in (
        (dict(q=np.zeros((T, 3), np.float32)), "q"),
        (dict(kv=q), "kv"),
        (dict(x=x.astype(np.float64)), "x"),
        (dict(qn=f.q_norm[:-1]), "q_norm"),
        (dict(cos=np.zeros((T + 1, half), np.float32)), "cos"),
        (dict(q=x), "q"),
    ):
        with pytest.raises((ValueError, TypeError), match=name):
            project(**kw)
    whole = np.zeros(max(q.size, x.size), np.float32)
    with pytest.raises(ValueError, match="q"):  # an output over an input
        project(q=whole[: q.size].reshape(q.shape), x=whole[: x.size].reshape(x.shape))
    (oa, soa), (ob, sob) = f.oa, f.ob
    o = np.zeros((T, f.heads * f.head_dim), np.float32)
    out = np.zeros((T, f.d), np.float32)
    kernels.extension.attn_output(o, cs, cs, f.heads, True, oa, soa, f.groups, 128, ob, sob, out)
    with pytest.raises(ValueError, match="out"):
        kernels.extension.attn_output(o, cs, cs, f.heads, True, oa, soa, f.groups, 128, ob, sob, out[:, 1:])
    with pytest.raises(ValueError, match="heads"):
        kernels.extension.attn_output(o, cs, cs, 7, True, oa, soa, f.groups, 128, ob, sob, out)


def test_fused_indexer_refuses_bad_arguments(tiny_fst_file):
    """`index_queries` with wrong shapes or heads gets one-line errors naming the problem, never a crash."""
    from fastar.model.deepseek_v4 import DeepseekV4

    attn = next(b.attn for b in DeepseekV4(tiny_fst_file).layers if b.attn.indexer is not None)
    f = attn.indexer.fused
    (wb, sb), (ww, sw) = f.b, f.w
    T, Hi = 2, f.heads
    qr, x = np.zeros((T, wb.shape[1]), np.float32), np.zeros((T, ww.shape[1]), np.float32)
    cs = np.zeros((T, attn.rope // 2), np.float32)
    q, w = np.zeros((T, f.width), np.float32), np.zeros((T, Hi), np.float32)

    def call(**kw):
        a = dict(qr=qr, wb=wb, sb=sb, x=x, ww=ww, sw=sw, cos=cs, sin=cs, heads=Hi, act=128, rot=True, scale=0.25)
        a.update(q=q, w=w)
        a.update(kw)
        kernels.extension.index_queries(*a.values())

    call()
    for kw, name in (
        (dict(x=x[:1]), "x"),
        (dict(heads=Hi + 1), "heads"),
        (dict(q=np.zeros((T, 3), np.float32)), "q"),
        (dict(w=np.zeros((T, Hi + 1), np.float32)), "w"),
        (dict(cos=np.zeros((T + 1, attn.rope // 2), np.float32)), "cos"),
        (dict(qr=x), "w_b"),
    ):
        with pytest.raises((ValueError, TypeError), match=name):
            call(**kw)


def test_indexer_scoring_packed_keys_equals_decoding_them(tiny_fst_file, monkeypatch):
    """Decode steps far past index_topk entries (every step of a ratio-4 layer scores its stored index keys): the
    logits with the keys scored from their packed rows equal those with the rows decoded first (the packed kernel
    turned off), bit for bit, for one row and for batched rows."""
    from fastar.model.deepseek_v4 import DeepseekV4

    m = DeepseekV4(tiny_fst_file)
    assert any(b.attn.indexer is not None for b in m.layers)
    g = torch.Generator().manual_seed(9)
    prompts = [torch.randint(2, 1024, (n,), generator=g).tolist() for n in (90, 61)]

    def run() -> list[torch.Tensor]:
        outs, states, ids = _prefill_and_decode(m, prompts, 5)
        return outs + [m.forward_rows(ids[:1], states[:1])]

    calls = []
    real = ops.index_scores_fp4
    monkeypatch.setattr(ops, "index_scores_fp4", lambda *a: calls.append(1) or real(*a))
    packed = run()
    assert calls  # the packed kernel ran (or declined, returning None, where this CPU has no vdpbf16ps)
    monkeypatch.setattr(ops, "index_scores_fp4", lambda *a: None)
    for a, b in zip(packed, run()):
        assert torch.equal(a, b)
