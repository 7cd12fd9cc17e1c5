"""A decode step's mHC sites chained (`fastar.model.hc_chain`, C: bind_hc.c's `hc_post_pre`) against the calls they
replace: `ops.hc_post` then `ops.hc_pre` / `ops.hc_head` with the norm, bit for bit on every instruction set this CPU
runs, with the collapse's outputs over the mix back's inputs; batched rows as each row alone; `forward_rows` with
the chain and without it (`Block.rows`' calls) through a model's decode steps; and the call's argument checks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_mhc import EPS, HC_EPS, ISAS, ITERS, SHAPES, params, streams

from fastar.model import ops
from fastar.quant import kernels as K

pytestmark = pytest.mark.skipif(not K.available(), reason="C extension not built")


@pytest.fixture(params=ISAS)
def isa(request):
    K.set_isa(request.param)
    yield request.param
    K.set_isa("auto")


def _two_calls(f, X, post, comb, fn, base, scale, norm, head: bool):
    """The reference: `ops.hc_post`, then the next site's collapse (`ops.hc_pre`, or `ops.hc_head`) with its norm."""
    Y = ops.hc_post(f, X, post, comb)
    if head:
        return Y, (ops.hc_head(Y, fn, base, scale, HC_EPS, EPS, norm),)
    return Y, ops.hc_pre(Y, fn, base, scale, ITERS, HC_EPS, EPS, norm)


def _chained(f, X, post, comb, fn, base, scale, norm, head: bool, in_place: bool):
    """`hc_post_pre` over numpy buffers; `in_place`: the collapse writes post and comb over the mix back's, and u over
    f (what `HCChain` does)."""
    T, n, d = X.shape
    fa, pa, ca = f.numpy().copy(), post.numpy().copy(), comb.reshape(T, n * n).numpy().copy()
    out = np.empty((T, n * d), np.float32)
    u = fa if in_place else np.empty((T, d), np.float32)
    po, co = (pa, ca) if in_place else (np.empty((T, n), np.float32), np.empty((T, n * n), np.float32))
    K.extension.hc_post_pre(
        fa, X.reshape(T, n * d).numpy(), pa, ca, out, fn.numpy(), base.numpy(), scale.numpy(), 1 if head else ITERS,
        HC_EPS, EPS, u, None if head else po, None if head else co,
        norm=None if norm is None else norm.numpy(), norm_eps=EPS,
    )  # fmt: skip
    got = (torch.from_numpy(u),) if head else (torch.from_numpy(u), torch.from_numpy(po), torch.from_numpy(co))
    return torch.from_numpy(out).reshape(T, n, d), got


@pytest.mark.parametrize("n,d", SHAPES)
@pytest.mark.parametrize("head", [False, True])
def test_hc_post_pre_equals_the_two_calls(isa, n, d, head):
    """The chained call's streams and collapse against `ops.hc_post` then `ops.hc_pre` / `ops.hc_head` (the same ISA),
    bit for bit, with the norm and without, with fresh outputs and with the collapse writing over the mix back's
    inputs, for 1 to 8 rows and a prefill chunk."""
    fn, base, scale = params(n, d, seed=n + d, head=head)
    g = torch.Generator().manual_seed(d)
    for T in (1, 2, 3, 4, 5, 8, 33):
        X = streams(T, n, d, seed=T)
        f = torch.randn(T, d, generator=g) * 3
        post = torch.rand(T, n, generator=g) * 2
        comb = torch.softmax(torch.randn(T, n, n, generator=g), -1)
        for norm in (None, torch.rand(d, generator=g) + 0.5):
            want_Y, want = _two_calls(f, X, post, comb, fn, base, scale, norm, head)
            for in_place in (False, True):
                Y, got = _chained(f, X, post, comb, fn, base, scale, norm, head, in_place)
                assert torch.equal(Y, want_Y), (T, in_place)
                for a, b in zip(got, want):
                    assert torch.equal(a, b.reshape(a.shape)), (T, in_place, norm is None)


@pytest.mark.parametrize("head", [False, True])
def test_hc_post_pre_rows_equal_each_row_alone(isa, head):
    """Batch invariance: each row of an 8-row call is that row's call alone, bit for bit."""
    n, d = 4, 4096
    fn, base, scale = params(n, d, seed=7, head=head)
    g = torch.Generator().manual_seed(9)
    T = 8
    X, f = streams(T, n, d, seed=3), torch.randn(T, d, generator=g)
    post, comb = torch.rand(T, n, generator=g), torch.softmax(torch.randn(T, n, n, generator=g), -1)
    norm = torch.rand(d, generator=g) + 0.5
    Y, got = _chained(f, X, post, comb, fn, base, scale, norm, head, True)
    for t in range(T):
        one = slice(t, t + 1)
        Yt, got_t = _chained(f[one], X[one], post[one], comb[one], fn, base, scale, norm, head, True)
        assert torch.equal(Yt, Y[one])
        for a, b in zip(got_t, got):
            assert torch.equal(a, b[one])


def test_hc_post_pre_refuses_bad_arguments():
    """Wrong shapes, dtypes and overlaps get one-line errors naming the argument, never a crash."""
    n, d, T = 4, 64, 2
    fn, base, scale = (a.numpy() for a in params(n, d, seed=1))
    f, x, post, comb = (np.zeros(s, np.float32) for s in ((T, d), (T, n * d), (T, n), (T, n * n)))
    out, u, norm = np.zeros((T, n * d), np.float32), np.zeros((T, d), np.float32), np.ones(d, np.float32)

    def call(**kw):
        a = dict(f=f, x=x, post=post, comb=comb, out=out, fn=fn, base=base, scale=scale, iters=ITERS, hc_eps=HC_EPS)
        a |= dict(eps=EPS, u=u, post_out=post, comb_out=comb, norm=norm, norm_eps=EPS)
        a.update(kw)
        K.extension.hc_post_pre(**a)

    call()  # the good call runs, its collapse over the mix back's post and comb
    for kw, name in (
        (dict(f=f.astype(np.float64)), "f must"),
        (dict(x=np.zeros((T, n * d + 1), np.float32)), "x"),
        (dict(out=x), "out"),  # the mix back's output over its input
        (dict(fn=fn[:-1]), "fn"),
        (dict(base=base[:-1]), "base"),
        (dict(u=out[:, :d].copy()[:1]), "u"),
        (dict(u=out[:, :d]), "u"),  # not contiguous
        (dict(norm=np.ones(d + 1, np.float32)), "norm"),
        (dict(post_out=None), "post_out"),
        (dict(comb_out=u[:, : n * n]), "comb_out"),
        (dict(iters=0), "iters"),
        (dict(post=np.zeros((T, 0), np.float32)), "post"),
    ):
        with pytest.raises((ValueError, TypeError), match=name):
            call(**kw)
    whole = np.zeros((T, n * d), np.float32)
    with pytest.raises(ValueError, match="u must not overlap"):  # the collapse writing over the streams it reads
        call(out=whole, u=whole.reshape(-1)[: T * d].reshape(T, d))


def _prefill_and_decode(m, prompts: list[list[int]], steps: int, argmax_only: bool = False):
    """Each prompt prefilled on its own state, then `steps` greedy decode steps of all of them at once
    (`forward_rows`) -> (the logits of every step, the states)."""
    states = [m.new_state() for _ in prompts]
    outs = [m.forward(p, s, all_logits=False)[0] for p, s in zip(prompts, states)]
    ids = [int(o[-1].argmax()) for o in outs]
    for _ in range(steps):
        outs.append(m.forward_rows(ids, states, [argmax_only] * len(ids)))
        ids = [int(r.argmax()) for r in outs[-1]]
    return outs, states


@pytest.mark.parametrize("numerics", ["official", "reference"])
def test_forward_rows_chained_equals_block_rows(tiny_fst_file, numerics):
    """`forward_rows` with the chain (`HCChain`) and without it (`Block.rows`' calls): the logits of every decode step
    bit for bit, for 1, 2 and 3 rows (1 and 3 after 2: the buffers of each row count apart), and the states alike."""
    from fastar.model.deepseek_v4 import DeepseekV4

    chained, apart = DeepseekV4(tiny_fst_file, numerics=numerics), DeepseekV4(tiny_fst_file, numerics=numerics)
    assert chained.hc_chain is not None
    apart.hc_chain = None
    g = torch.Generator().manual_seed(4)
    for lengths in ((7, 140), (9,), (3, 20, 5)):
        prompts = [torch.randint(2, 1024, (n,), generator=g).tolist() for n in lengths]
        got, sg = _prefill_and_decode(chained, prompts, 5)
        want, sw = _prefill_and_decode(apart, prompts, 5)
        for a, b in zip(got, want):
            assert torch.equal(a, b)
        for a, b in zip(sg, sw):
            assert a.length == b.length
            # the next token through the plain path on each: equal only if every layer's state is
            assert torch.equal(chained.forward([5], a)[0], apart.forward([5], b)[0])


def test_hc_chain_leaves_torch_only_to_block_rows(tiny_fst_file):
    """Under `ops.torch_only()` the chain does nothing and `forward_rows` takes `Block.rows`' path."""
    from fastar.model.deepseek_v4 import DeepseekV4

    m = DeepseekV4(tiny_fst_file)
    emb = torch.zeros(2, m.config.hidden_size)
    with ops.torch_only():
        assert m.hc_chain.begin(emb) is None
    assert m.hc_chain.begin(emb.double()) is None
    assert m.hc_chain.begin(emb) is not None
    with ops.torch_only():
        assert m.hc_chain.begin_ids([1, 2]) is None


def test_begin_ids_equals_begin_of_the_embedded_rows(tiny_fst_file):
    """`HCChain.begin_ids` (the embedding's bfloat16 rows widened into the streams in C) against `begin` of
    `embed.rows(ids)`: the first sub-layer's input and the streams bit for bit, for 1 to 8 rows (repeated ids too);
    and `embed_streams` refuses ids outside the embedding and mismatched outputs."""
    from fastar.model.deepseek_v4 import DeepseekV4

    m = DeepseekV4(tiny_fst_file)
    chain = m.hc_chain
    assert chain.embed is not None
    g = torch.Generator().manual_seed(2)
    V = m.config.vocab_size
    for B in (1, 2, 3, 8):
        ids = torch.randint(0, V, (B,), generator=g).tolist()
        ids[-1] = ids[0]
        want = chain.begin(m.embed.rows(torch.tensor(ids))).clone()
        want_X = chain._b.X[0].copy()
        chain._b.X[0].fill(np.nan)
        got = chain.begin_ids(ids)
        assert torch.equal(got, want), B
        assert np.array_equal(chain._b.X[0], want_X), B
    out = np.empty((2, chain.n * chain.d), np.float32)
    with pytest.raises(ValueError, match=rf"ids\[1\] = {V} is outside the embedding's {V} rows"):
        K.extension.embed_streams(chain.embed, [0, V], out)
    with pytest.raises(ValueError, match="ids\\[0\\] = -1"):
        K.extension.embed_streams(chain.embed, [-1, 0], out)
    with pytest.raises(ValueError, match="expected \\(3, a multiple of"):
        K.extension.embed_streams(chain.embed, [0, 1, 2], out)
    with pytest.raises(TypeError, match="sequence"):
        K.extension.embed_streams(chain.embed, 5, out)
