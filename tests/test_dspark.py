"""The DSpark draft model (`fastar.model.dspark`) on the `tiny-dspark` fixture: the target-state capture, the
context projection, the stage attention (context window + bidirectional block) and the Markov and confidence
heads against direct formulas from the checkpoint tensors, incremental context against a fresh one, and the
`.fst` path. Reference numerics throughout (exact to float32 rounding)."""

from __future__ import annotations

import pytest
import torch

from fastar.convert.checkpoint import Checkpoint
from fastar.engine import speculative as sp
from fastar.engine.engine import load
from fastar.model import ops
from fastar.quant.reference import bf16_decode

TOL = 1e-4


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def eng(dspark_ckpt):
    return load(dspark_ckpt, numerics="reference", draft="dspark")


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(2, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def greedy(logits):
    return int(logits.argmax()), None


def bf16(ck: Checkpoint, name: str) -> torch.Tensor:
    return torch.from_numpy(bf16_decode(ck.tensor(name)))


def test_config_and_loading(eng, dspark_ckpt):
    cfg = eng.config
    d = eng.drafter.draft
    assert cfg.has_dspark and d.block_size == 5 and d.targets == (2, 3, 4) and d.noise == 1000
    assert len(d.stages) == 3 and not eng.model.mtp  # the stages replace the classic MTP block
    assert sp.available(eng.model) == ["dspark"]
    state = eng.new_state()
    assert len(state.mtp) == 3 and all(s.ratio == 0 and s.window == cfg.sliding_window for s in state.mtp)


def test_capture_is_the_state_entering_each_layer(eng):
    ids = tokens(12, 1)
    after = []
    cap = {2: None, 4: None}
    eng.model.forward(ids, eng.model.new_state(), collect=after, capture=cap)
    assert torch.equal(cap[2], after[1]) and torch.equal(cap[4], after[3])


def test_context_rows_follow_the_formula(eng, dspark_ckpt):
    """main_x = main_norm(main_proj(concat of stream means entering layers 2, 3, 4)); a stage's context row is
    RoPE(kv_norm(wkv(main_x))) at the target position (reference numerics: no FP8 simulation)."""
    ck = Checkpoint(dspark_ckpt)
    cfg = ck.config
    ids = tokens(20, 2)
    state = eng.new_state()
    eng.prefill(ids, state)
    after = []
    eng.model.forward(ids, eng.model.new_state(), collect=after)
    h = torch.cat([after[t - 1].mean(1) for t in (2, 3, 4)], dim=-1)  # [T, 3d]
    mp = eng.drafter.draft.main_proj.dequant()  # FP8 dequantized by the tested `Linear` path
    main_x = ops.rms_norm(h @ mp.T, bf16(ck, "mtp.0.main_norm.weight"), cfg.rms_norm_eps)
    for k, s in enumerate(state.mtp):
        a = eng.drafter.draft.stages[k].attn
        kv = ops.rms_norm(main_x @ a.wkv.dequant().T, bf16(ck, f"mtp.{k}.attn.kv_norm.weight"), cfg.rms_norm_eps)
        kv = ops.apply_rope(
            kv, *ops.rope_cos_sin(ops.rope_inv_freq(cfg.qk_rope_head_dim, cfg.rope_theta), torch.arange(20))
        )
        assert s.length == 20 and (s.kv.rows(0, 20) - kv).abs().max() <= TOL


def test_block_attention_is_bidirectional_and_windowed(eng):
    """Slot 0's output depends on slot 4's input (a causal block would not); context rows older than the window
    do not matter, rows inside it do."""
    d = eng.drafter.draft
    W = eng.config.sliding_window
    state = eng.new_state()
    eng.prefill(tokens(3 * W, 3), state)
    stages = state.mtp
    stage, s = d.stages[0], stages[0]
    p = s.length
    X = d.embed.rows(torch.tensor([7, 1000, 1000, 1000, 1000]))[:, None, :].expand(5, 4, -1)
    ctx = s.kv.rows(p - W, p)
    base = stage(X, torch.tensor([7, 1000, 1000, 1000, 1000]), ctx, p)
    X2 = X.clone()
    X2[4] = d.embed.rows(torch.tensor([9]))[0]
    assert (stage(X2, torch.tensor([7, 1000, 1000, 1000, 9]), ctx, p)[0] - base[0]).abs().max() > 1e-4
    older = torch.cat([s.kv.rows(p - W - 3, p - W), ctx])  # rows beyond the window, if given, change things
    assert (stage(X, torch.tensor([7, 1000, 1000, 1000, 1000]), older, p) - base).abs().max() > 1e-5
    U, _ = d.base(stages, 7)  # `base` itself takes exactly the last W rows: moving older rows changes nothing
    with torch.inference_mode():  # the state's rows are inference tensors
        s.kv.rows(p - W - 3, p - W).mul_(0.5)
    U2, _ = d.base(stages, 7)
    assert torch.equal(U, U2)


def test_heads_follow_the_formulas(eng, dspark_ckpt):
    """logits_k = U_k + markov_w2 . markov_w1[x_prev] and c_k = sigmoid(proj . [h_k ; markov_w1[x_prev]]);
    drafting picks left to right, each Markov term from the previous pick (the anchor for the first)."""
    ck = Checkpoint(dspark_ckpt)
    w1, w2 = bf16(ck, "mtp.2.markov_head.markov_w1.weight"), bf16(ck, "mtp.2.markov_head.markov_w2.weight")
    proj = bf16(ck, "mtp.2.confidence_head.proj.weight")
    state = eng.new_state()
    eng.prefill(tokens(30, 4), state)
    anchor = 42
    U, h = eng.drafter.draft.base(state.mtp, anchor)
    assert U.shape == (5, eng.config.vocab_size)
    block = eng.drafter.draft.draft(state.mtp, anchor, 5, greedy)
    prev = anchor
    for k in range(5):
        logits = U[k] + w2 @ w1[prev]
        c = torch.sigmoid(proj @ torch.cat([h[k], w1[prev]]))[0]
        assert int(logits.argmax()) == block.tokens[k] and abs(float(c) - block.confidence[k]) < 1e-5
        assert (block.logits[k] - logits).abs().max() <= TOL
        prev = block.tokens[k]


def test_incremental_context_equals_fresh_after_rollbacks(eng, dspark_ckpt):
    """A context built pass by pass with rejected drafts rolled back equals the one-shot context, and so do the
    drafts made from it; a context row the engine cannot know is zero (masked), not garbage."""
    ids = tokens(40, 5)
    state = eng.new_state()
    eng.prefill(ids[:10], state)
    pos = 10
    while pos < 40:  # verify passes of 4 (anchor + 3 drafts), keeping 1 or 2 of them: roll back the rest
        chunk = ids[pos : pos + 4]
        eng.prefill(chunk + [3] * (4 - len(chunk)), state)
        keep = min(1 + pos % 2, len(chunk))
        state.truncate(pos + keep)
        pos += keep
    fresh = eng.new_state()
    eng.prefill(ids[:pos], fresh)
    a = sp.DSparkDrafter.propose(eng.drafter, state, 11, 5, greedy)
    for s, f in zip(state.mtp, fresh.mtp):
        assert s.length == f.length == pos
        lo = max(s.kv.start, f.kv.start)
        assert (s.kv.rows(lo, pos) - f.kv.rows(lo, pos)).abs().max() <= TOL
    b = sp.DSparkDrafter.propose(eng.drafter, fresh, 11, 5, greedy)
    assert a.tokens == b.tokens
    # a state restored without the last pass's hiddens: the missing row is zeros and drafting still works
    snap = fresh.snapshot()
    snap.truncate(pos - 1)
    eng.prefill([ids[pos - 1]], snap)
    assert all(float(s.kv.rows(pos - 2, pos - 1).abs().max()) == 0 for s in snap.mtp)
    assert len(sp.DSparkDrafter.propose(eng.drafter, snap, 11, 5, greedy).tokens) == 5


def test_fst_carries_dspark(dspark_ckpt, tmp_path, eng):
    from fastar.convert.hf import convert

    fst = convert(dspark_ckpt, tmp_path / "dspark.fst", progress=False)
    other = load(fst, numerics="reference", draft="dspark")
    ids = tokens(16, 6)
    sa, sb = eng.new_state(), other.new_state()
    eng.prefill(ids, sa)
    other.prefill(ids, sb)
    a = sp.DSparkDrafter.propose(eng.drafter, sa, 11, 5, greedy)
    b = sp.DSparkDrafter.propose(other.drafter, sb, 11, 5, greedy)
    assert a.tokens == b.tokens and a.confidence == pytest.approx(b.confidence, abs=1e-6)


def test_sampled_generation_with_dspark(dspark_ckpt):
    """The sampling path with DSpark drafts (temperature, top-k/top-p/min-p on both sides, logprobs): runs, and a
    seed pins the tokens for the same history."""

    def run():
        eng = load(dspark_ckpt, draft="dspark")
        eng.draft_schedule.fixed = 5
        chunks = list(
            eng.stream(
                tokens(20, 7),
                max_tokens=16,
                ignore_eos=True,
                temperature=1.0,
                top_k=50,
                top_p=0.9,
                min_p=0.02,
                seed=3,
                logprobs=2,
            )
        )
        assert all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in chunks)
        return [c.token for c in chunks], eng.stats()

    (a, st), (b, _) = run(), run()
    assert a == b and len(a) == 16 and st["draft_tokens_verified"] > 0
