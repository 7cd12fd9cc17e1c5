"""The DeepSeek-V4 forward pass against transformers 5.24 on the same official-format weights (float32,
`reference` numerics), plus the decode-state contract (chunking, decode, truncation), MTP and the `official`
numerics switches.

Sequences are 400 tokens: they cross the sliding window many times, close 100 ratio-4 windows and 3 ratio-128
windows, and run through the hash-routed layers on every token. The fixtures have 16 indexer heads.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fastar.engine.engine import load
from fastar.fixtures import write_checkpoint
from fastar.model.deepseek_v4 import Numerics
from fastar.model.state import StateError

SEQ = 400
TOL = 1e-4


@pytest.fixture(scope="module")
def hf_model():
    """transformers' model of a checkpoint directory, loaded once per directory for this module's tests."""
    from transformers import DeepseekV4ForCausalLM

    loaded: dict[str, DeepseekV4ForCausalLM] = {}

    def get(path):
        key = str(path)
        if key not in loaded:
            loaded[key] = DeepseekV4ForCausalLM.from_pretrained(key, dtype=torch.float32).eval()
        return loaded[key]

    return get


def engine(path, numerics="reference", **kw):
    return load(path, numerics=numerics, kernels=kw.pop("kernels", True), **kw)


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def variant_ckpt(tmp_path_factory):
    """A second config (seed 1): a compressed first layer, 3 hash layers, window 16, top-k 8, 3 experts/token."""
    return write_checkpoint(
        tmp_path_factory.mktemp("ckpt-variant"),
        "tiny",
        seed=1,
        tokenizer=False,
        compress_ratios=[4, 128, 0, 4, 128, 0],
        sliding_window=16,
        index_topk=8,
        num_hash_layers=3,
        num_experts_per_tok=3,
    )


@pytest.fixture(scope="module")
def seed2_ckpt(tmp_path_factory):
    """The `tiny` config with other random weights (seed 2)."""
    return write_checkpoint(tmp_path_factory.mktemp("ckpt-seed2"), "tiny", seed=2, tokenizer=False)


@pytest.fixture(params=["tiny", "variant"])
def ckpt(request, tiny_ckpt, variant_ckpt):
    return tiny_ckpt if request.param == "tiny" else variant_ckpt


@pytest.fixture(scope="module")
def tiny_full(tiny_ckpt):
    """(tokens, full-prefill reference logits) for the chunking/truncation tests."""
    ids = tokens(SEQ, 7)
    return ids, torch.from_numpy(engine(tiny_ckpt).logits(ids))


# --- against transformers ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "which,kernels", [("tiny", True), ("tiny", False), ("variant", True), ("seed2", True), ("dspark", True)]
)
def test_logits_match_transformers(request, hf_model, which, kernels):
    """Every position of a 400-token sequence within 1e-4 of transformers (both product paths on `tiny`;
    `dspark` checks that a checkpoint with DSpark stages still runs the main model exactly)."""
    path = request.getfixturevalue(
        {"tiny": "tiny_ckpt", "variant": "variant_ckpt", "seed2": "seed2_ckpt", "dspark": "dspark_ckpt"}[which]
    )
    ids = tokens(SEQ, 11)
    eng = engine(path, kernels=kernels)
    state = eng.new_state()
    ours = eng.prefill(ids, state, all_logits=True)
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    diff = (ours - ref).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff:.3e} over {SEQ} positions"
    ratios = eng.config.compress_ratios
    entries = [s.entries.stop for s, r in zip(state.layers, ratios) if r == 128]
    assert entries and min(entries) == SEQ // 128 >= 3  # several ratio-128 entries were used
    assert any(s.entries.stop == SEQ // 4 for s, r in zip(state.layers, ratios) if r == 4)
    assert eng.config.num_hash_layers >= 2


def test_greedy_generation_matches_transformers(ckpt, hf_model):
    prompt = tokens(330, 12)  # 64 more tokens close a ratio-128 window during decode
    with torch.no_grad():
        ref = hf_model(ckpt).generate(torch.tensor([prompt]), max_new_tokens=64, do_sample=False)[0, 330:]
    ours = engine(ckpt).generate_tokens(prompt, 64)
    assert len(ours) == 64 and ours == ref.tolist()


def test_audit_reports_every_layer(tiny_ckpt):
    from fastar.audit import run

    report = run(tiny_ckpt, tiny_ckpt, tokens=tokens(40, 3))
    assert [r.name for r in report.rows] == [f"layer {i}" for i in range(5)] + ["logits"]
    assert report.ok and all(r.cosine > 0.999999 for r in report.rows)
    assert "logits OK" in report.table()


# --- decode state --------------------------------------------------------------------------------------------


def test_chunked_prefill_and_token_by_token_decode_match_full_prefill(tiny_ckpt, tiny_full):
    ids, full = tiny_full
    model = engine(tiny_ckpt).model
    for chunk in (7, 64, 133):
        state, outs = model.new_state(), []
        for a in range(0, SEQ, chunk):
            outs.append(model.forward(ids[a : a + chunk], state)[0])
        diff = (torch.cat(outs) - full).abs().max().item()
        assert diff <= TOL, f"chunk {chunk}: max |diff| {diff:.3e}"
    # token by token from the first token to the last ...
    state = model.new_state()
    steps = torch.cat([model.forward(ids[t : t + 1], state)[0] for t in range(SEQ)])
    assert (steps - full).abs().max().item() <= TOL
    # ... and decode after a prefill, across the ratio-128 boundary at 384
    state = model.new_state()
    model.forward(ids[:300], state)
    steps = torch.cat([model.forward(ids[t : t + 1], state)[0] for t in range(300, SEQ)])
    assert (steps - full[300:]).abs().max().item() <= TOL


def test_engine_prefill_chunk_option(variant_ckpt):
    ids = tokens(300, 5)
    a = engine(variant_ckpt, prefill_chunk=37).logits(ids)
    b = engine(variant_ckpt, prefill_chunk=1000).logits(ids)
    assert np.abs(a - b).max() <= TOL


@pytest.mark.parametrize("p", [203, 256, 257, 383])
def test_truncate_then_continue_equals_fresh_run(tiny_ckpt, tiny_full, p):
    ids, full = tiny_full
    model = engine(tiny_ckpt).model
    state = model.new_state()
    model.forward(ids, state)
    state.truncate(p)
    cont = model.forward(ids[p : p + 17], state)[0]
    assert (cont - full[p : p + 17]).abs().max().item() <= TOL


def test_bounded_rollback_and_snapshot_restore(tiny_ckpt, tiny_full):
    ids, full = tiny_full
    model = engine(tiny_ckpt, max_rollback=40).model
    state = model.new_state()
    model.forward(ids[:300], state)
    snap = state.snapshot()
    with pytest.raises(StateError):
        state.truncate(200)  # 100 back: beyond the horizon
    state.truncate(262)  # 38 back: inside it
    assert (model.forward(ids[262:280], state)[0] - full[262:280]).abs().max().item() <= TOL
    state.restore(snap)
    assert (model.forward(ids[300:310], state)[0] - full[300:310]).abs().max().item() <= TOL


# --- MTP -----------------------------------------------------------------------------------------------------


def _dequant(ck, name):
    from fastar.quant.reference import bf16_decode, fp8_block_dequant

    dt = ck.dtype(name + ".weight")
    w = ck.tensor(name + ".weight")
    if dt == "F8_E4M3":
        return torch.from_numpy(fp8_block_dequant(w, ck.tensor(name + ".scale")))
    return torch.from_numpy(bf16_decode(w) if dt == "BF16" else w)


def test_mtp_logits_match_independent_computation(tiny_ckpt, hf_model):
    """MTP logits vs transformers' own decoder layer + hyper head built from the mtp.0 weights."""
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import (
        DeepseekV4DecoderLayer,
        DeepseekV4HyperHead,
        DeepseekV4RMSNorm,
    )

    from fastar.convert.checkpoint import Checkpoint
    from fastar.quant.reference import bf16_decode, fp4_decode

    hf = hf_model(tiny_ckpt)
    ck = Checkpoint(tiny_ckpt)
    cfg = ck.config
    T = 60
    ids = tokens(T, 21)
    streams = []  # main-model streams after the last block, from transformers
    hook = hf.model.layers[-1].register_forward_hook(lambda _m, _i, out: streams.append(out[0]))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    hook.remove()
    X = streams[0][: T - 1]  # [T-1, n, d]

    # the MTP block as a transformers decoder layer: sliding attention, score-routed MoE
    hcfg = (
        dataclasses.replace(hf.config)
        if dataclasses.is_dataclass(hf.config)
        else hf.config.__class__(**hf.config.to_dict())
    )
    hcfg.layer_types = ["sliding_attention"] + list(hcfg.layer_types[1:])
    hcfg.mlp_layer_types = ["moe"] + list(hcfg.mlp_layer_types[1:])
    layer = DeepseekV4DecoderLayer(hcfg, 0).float().eval()
    p = "mtp.0."
    n_exp = cfg.n_routed_experts

    def expert(e, w):
        ew = ck.expert(cfg.num_hidden_layers, e)
        return torch.from_numpy(fp4_decode(getattr(ew, w), getattr(ew, w + "_scale")))

    sd = {
        "self_attn.sinks": torch.from_numpy(ck.tensor(p + "attn.attn_sink")),
        "self_attn.q_a_proj.weight": _dequant(ck, p + "attn.wq_a"),
        "self_attn.q_a_norm.weight": _dequant(ck, p + "attn.q_norm"),
        "self_attn.q_b_proj.weight": _dequant(ck, p + "attn.wq_b"),
        "self_attn.kv_proj.weight": _dequant(ck, p + "attn.wkv"),
        "self_attn.kv_norm.weight": _dequant(ck, p + "attn.kv_norm"),
        "self_attn.o_a_proj.weight": _dequant(ck, p + "attn.wo_a"),
        "self_attn.o_b_proj.weight": _dequant(ck, p + "attn.wo_b"),
        "mlp.gate.weight": _dequant(ck, p + "ffn.gate"),
        "mlp.gate.e_score_correction_bias": torch.from_numpy(ck.tensor(p + "ffn.gate.bias")),
        "mlp.experts.gate_up_proj": torch.stack([torch.cat([expert(e, "w1"), expert(e, "w3")]) for e in range(n_exp)]),
        "mlp.experts.down_proj": torch.stack([expert(e, "w2") for e in range(n_exp)]),
        "mlp.shared_experts.gate_proj.weight": _dequant(ck, p + "ffn.shared_experts.w1"),
        "mlp.shared_experts.up_proj.weight": _dequant(ck, p + "ffn.shared_experts.w3"),
        "mlp.shared_experts.down_proj.weight": _dequant(ck, p + "ffn.shared_experts.w2"),
        "input_layernorm.weight": _dequant(ck, p + "attn_norm"),
        "post_attention_layernorm.weight": _dequant(ck, p + "ffn_norm"),
    }
    for site in ("attn", "ffn"):
        for part in ("fn", "base", "scale"):
            sd[f"{site}_hc.{part}"] = torch.from_numpy(ck.tensor(f"{p}hc_{site}_{part}"))
    layer.load_state_dict(sd)
    head = DeepseekV4HyperHead(hcfg).float()
    head.load_state_dict(
        {
            k: torch.from_numpy(ck.tensor(p + "hc_head_" + k.removeprefix("hc_")))
            for k in ("hc_fn", "hc_base", "hc_scale")
        }
    )

    def norm(name, x):
        n = DeepseekV4RMSNorm(x.shape[-1], eps=cfg.rms_norm_eps)
        n.weight.data = _dequant(ck, name)
        return n(x)

    with torch.no_grad():
        nxt = torch.tensor(ids[1:])
        e = norm(p + "enorm", torch.from_numpy(bf16_decode(ck.tensor("embed.weight")))[nxt])
        x = (e @ _dequant(ck, p + "e_proj").T)[:, None] + norm(p + "hnorm", X) @ _dequant(ck, p + "h_proj").T
        pos = torch.arange(T - 1)[None]
        rope = {k: hf.model.rotary_emb(x, position_ids=pos, layer_type=k) for k in ("main", "compress")}
        q, k = pos[0][:, None], pos[0][None, :]
        mask = torch.where((k <= q) & (k > q - cfg.sliding_window), 0.0, float("-inf"))[None, None]
        y = layer(
            x[None], input_ids=nxt[None], position_embeddings=rope, position_ids=pos, attention_mask=mask, cache=None
        )[0]
        ref = norm(p + "norm", head(y[None])[0]) @ _dequant(ck, "head").T  # [T-1, V]

    model = engine(tiny_ckpt).model
    state = model.new_state()
    _, ours_X = model.forward(ids, state)
    ours = model.mtp_logits(ours_X[: T - 1], ids[1:], state)
    assert (ours - ref).abs().max().item() <= TOL
    # incremental MTP (one position at a time, own state) equals the batched call
    state2 = model.new_state()
    _, X2 = model.forward(ids, state2)
    step = torch.cat([model.mtp_logits(X2[i : i + 1], ids[i + 1 : i + 2], state2) for i in range(T - 1)])
    assert (step - ours).abs().max().item() <= TOL


# --- official numerics: each switch changes what it should and nothing else -----------------------------------

SWITCHES = [f.name for f in dataclasses.fields(Numerics)]


def only(name: str | None) -> Numerics:
    return Numerics(**{s: s == name for s in SWITCHES})


def _run(ckpt_path, numerics, ids, topk=None):
    model = engine(ckpt_path, numerics=numerics).model
    if topk is not None:
        for b in model.layers:
            if b.attn.indexer is not None:
                b.attn.indexer.topk = topk
    state = model.new_state()
    return model.forward(ids, state)[0], state


def test_official_is_the_default_and_differs_from_reference(variant_ckpt):
    assert load(variant_ckpt, kernels=False).model.numerics == Numerics.named("official")
    ids = tokens(120, 4)
    ref, _ = _run(variant_ckpt, "reference", ids)
    off, _ = _run(variant_ckpt, "official", ids)
    assert (ref - off).abs().max().item() > 1e-3


def test_switch_fp8_kv(variant_ckpt):
    from fastar.model import ops

    ids = tokens(120, 4)
    _, ref = _run(variant_ckpt, only(None), ids)
    _, sw = _run(variant_ckpt, only("fp8_kv"), ids)
    r, a, b = 64, ref.layers[0], sw.layers[0]  # layer 0 is a ratio-4 layer: nothing upstream changed
    for name in ("kv", "entries"):  # window KV and compressed KV: non-RoPE dims FP8-rounded, RoPE dims exact
        x, y = a.buffers()[name].all(), b.buffers()[name].all()
        assert torch.equal(y[:, -r:], x[:, -r:])
        assert torch.equal(y[:, :-r], ops.fp8_quant_sim(x[:, :-r], 64))
        assert not torch.equal(y, x)
    for name in ("comp_kv", "comp_gate", "idx_kv", "idx_gate", "idx_entries"):  # untouched
        assert torch.equal(a.buffers()[name].all(), b.buffers()[name].all())


def test_switch_fp4_indexer(variant_ckpt):
    from fastar.model import ops

    ids = tokens(120, 4)
    ref_logits, ref = _run(variant_ckpt, only(None), ids, topk=10_000)
    sw_logits, sw = _run(variant_ckpt, only("fp4_indexer"), ids, topk=10_000)
    a, b = ref.layers[0], sw.layers[0]
    assert torch.equal(b.idx_entries.all(), ops.fp4_quant_sim(ops.hadamard(a.idx_entries.all()), 32))
    for name in ("kv", "entries", "comp_kv", "idx_kv"):
        assert torch.equal(a.buffers()[name].all(), b.buffers()[name].all())
    # with top-k >= #entries the indexer selects everything visible: only index scores changed, not logits
    assert (sw_logits - ref_logits).abs().max().item() <= 1e-5
    # with the real top-k the selection (and so the logits) changes
    assert (_run(variant_ckpt, only("fp4_indexer"), ids)[0] - _run(variant_ckpt, only(None), ids)[0]).abs().max() > 1e-4


def test_switch_fp8_activations(variant_ckpt):
    ids = tokens(120, 4)
    _, ref = _run(variant_ckpt, only(None), ids)
    _, sw = _run(variant_ckpt, only("fp8_activations"), ids)
    a, b = ref.layers[0], sw.layers[0]
    assert not torch.equal(a.kv.all(), b.kv.all())  # wkv (FP8) input is quantized
    for name in ("comp_kv", "comp_gate", "idx_kv", "idx_gate"):  # BF16 projections of the same x: exact
        assert torch.equal(a.buffers()[name].all(), b.buffers()[name].all())


def test_switch_official_routing(variant_ckpt):
    ids = tokens(120, 4)
    ref, _ = _run(variant_ckpt, only(None), ids)
    sw, _ = _run(variant_ckpt, only("official_routing"), ids)
    # without activation quantization, weighting before or after w2 is the same math (and +1e-20 is nothing)
    assert (sw - ref).abs().max().item() <= 1e-5
    both = Numerics(fp8_kv=False, fp4_indexer=False, fp8_activations=True, official_routing=True)
    act = Numerics(fp8_kv=False, fp4_indexer=False, fp8_activations=True, official_routing=False)
    # with it, the routing weight is inside the mid-activation quantization: results move
    assert (_run(variant_ckpt, both, ids)[0] - _run(variant_ckpt, act, ids)[0]).abs().max().item() > 1e-5


def test_switch_bf16_wo_a(variant_ckpt, monkeypatch):
    from fastar.quant.linear import Linear

    seen: dict[str, list[torch.Tensor]] = {}
    grouped = Linear.grouped

    def spy(self, x):
        if self.name.startswith("layers.0."):
            seen.setdefault(tag, []).append(x.clone())
        return grouped(self, x)

    monkeypatch.setattr(Linear, "grouped", spy)
    ids = tokens(120, 4)
    runs = {}
    for tag, numerics in (("ref", only(None)), ("sw", only("bf16_wo_a"))):
        runs[tag] = _run(variant_ckpt, numerics, ids)
    (a,), (b,) = seen["ref"], seen["sw"]  # layer 0's wo_a input: the attention output, rounded to bf16 by the switch
    assert torch.equal(b, a.to(torch.bfloat16).float()) and not torch.equal(a, b)
    ref, sw = runs["ref"][1].layers[0].buffers(), runs["sw"][1].layers[0].buffers()
    for name in ("kv", "entries", "comp_kv", "idx_kv"):  # upstream of wo_a in layer 0: untouched
        assert torch.equal(ref[name].all(), sw[name].all())
    assert (runs["sw"][0] - runs["ref"][0]).abs().max().item() > 0


def test_official_numerics_are_deterministic_and_chunking_moves_only_rounding(variant_ckpt):
    """Official numerics round (FP8/FP4) after float32 sums whose order depends on the chunk shape, so a
    value near a rounding boundary can land on the other side and the change travels on (documented in the
    model docstring). Same chunking -> bitwise the same; other chunkings -> differences no larger than the
    quantization noise itself (official vs reference)."""
    ids = tokens(120, 6)
    model = engine(variant_ckpt, numerics="official").model
    full = model.forward(ids, model.new_state())[0]
    assert torch.equal(full, model.forward(ids, model.new_state())[0])
    state = model.new_state()
    steps = torch.cat([model.forward(ids[t : t + 1], state)[0] for t in range(120)])
    ref = engine(variant_ckpt).model
    reference = ref.forward(ids, ref.new_state())[0]
    chunk_noise = (steps - full).abs().max(-1).values.median()
    quant_noise = (reference - full).abs().max(-1).values.median()
    assert chunk_noise <= quant_noise


def test_small_chunks_are_bit_identical_to_decode(ckpt):
    """Batch invariance (model docstring): under official numerics with the C kernels, a chunk of T = 2..8 tokens
    (a speculative verify pass) gives logits and every state buffer bit-identical to T one-token steps. Starts:
    4*topk - 3, where the chunk runs from queries that attend to every visible entry into ones the indexer
    scores, and 125, where it closes the first ratio-128 entry (window 127) and more ratio-4 ones, all scored;
    both past the sliding window, so each query's window starts at its own offset. Then the MTP block."""
    from fastar.model import ops
    from fastar.quant import kernels, linear

    if linear._kernels() is None or kernels.get_isa() == "scalar":
        pytest.skip("batch invariance is a promise of the C kernels' SIMD dot path")
    model = engine(ckpt, numerics="official").model
    cfg = model.config
    ids = tokens(140, 13)
    starts = (4 * cfg.index_topk - 3, 125)
    assert ops.SMALL_CHUNK == 8 and starts[0] > cfg.sliding_window
    for p0 in starts:
        state = model.new_state()
        model.forward(ids[:p0], state)
        steps, logits, after = state.snapshot(), [], [None]  # after[t]: the state after t steps
        for t in range(8):
            logits.append(model.forward(ids[p0 + t : p0 + t + 1], steps)[0])
            after.append(steps.snapshot())
        for T in range(2, 9):
            chunk = state.snapshot()
            out = model.forward(ids[p0 : p0 + T], chunk)[0]
            assert torch.equal(out, torch.cat(logits[:T])), (p0, T)
            for i, (a, b) in enumerate(zip(chunk.layers, after[T].layers)):
                assert a.length == b.length == p0 + T
                for name, buf in a.buffers().items():
                    other = b.buffers()[name]
                    assert buf.start == other.start and torch.equal(buf.all(), other.all()), (p0, T, i, name)
    # the MTP block, on its own positions past its window: T rows at once as T single rows
    state = model.new_state()
    _, X = model.forward(ids[:40], state)
    model.mtp_logits(X[:30], ids[1:31], state)
    for T in range(2, 9):
        a, b = state.snapshot(), state.snapshot()
        chunk = model.mtp_logits(X[30 : 30 + T], ids[31 : 31 + T], a)
        steps = torch.cat([model.mtp_logits(X[30 + t : 31 + t], ids[31 + t : 32 + t], b) for t in range(T)])
        assert torch.equal(chunk, steps) and torch.equal(a.mtp[0].kv.all(), b.mtp[0].kv.all()), T
    ratios = cfg.compress_ratios[: cfg.num_hidden_layers]
    assert (
        128 in ratios
        and 4 in ratios
        and all(b.attn.indexer is not None for b, r in zip(model.layers, ratios) if r == 4)
    )
    assert (125 + 8) // 128 > 125 // 128 and (starts[0] + 8) // 4 > cfg.index_topk >= (starts[0] + 1) // 4


# --- engine API ----------------------------------------------------------------------------------------------


def test_generate_tokens_sampling_is_seeded(tiny_ckpt):
    eng = engine(tiny_ckpt)
    prompt = tokens(20, 8)
    a = eng.generate_tokens(prompt, 12, temperature=1.0, seed=3, ignore_eos=True)
    assert a == eng.generate_tokens(prompt, 12, temperature=1.0, seed=3, ignore_eos=True)
    assert len(a) == 12 and a != eng.generate_tokens(prompt, 12, temperature=1.0, seed=4, ignore_eos=True)
    assert eng.generate_tokens(prompt, 0) == []
    with pytest.raises(ValueError):
        eng.logits([5, 1024])


def test_load_fst_equals_checkpoint_directory(tiny_ckpt, tmp_path):
    from fastar.convert.hf import convert

    fst = convert(tiny_ckpt, tmp_path / "tiny.fst", progress=False)
    ids = tokens(50, 9)
    assert np.array_equal(engine(fst).logits(ids), engine(tiny_ckpt).logits(ids))


def test_kernel_path_matches_torch_reference(tiny_ckpt):
    from fastar.quant import linear

    if linear._kernels() is None:
        pytest.skip("fastar.quant.kernels is not built here")
    ids = tokens(150, 10)
    fast = engine(tiny_ckpt, kernels=True).logits(ids)
    slow = engine(tiny_ckpt, kernels=False).logits(ids)
    assert np.abs(fast - slow).max() <= TOL


def test_stacked_compressor_products_equal_one_call_each(tiny_ckpt, tmp_path):
    """The compressors' BF16 products (a layer's kv and gate, and its indexer's) stacked into one kernel call
    (`Attention.comp_stack`, from a .fst) give the bits of one call each: a 140-token prefill (the GEMM path,
    closing ratio-4 and ratio-128 windows), then batched decode rows; logits bit for bit."""
    from fastar.convert.hf import convert
    from fastar.format.reader import FstFile
    from fastar.model.deepseek_v4 import DeepseekV4
    from fastar.quant import linear

    if linear._kernels() is None:
        pytest.skip("stacking is a kernel-path saving (no kernels: nothing stacks)")
    fst = FstFile(convert(tiny_ckpt, tmp_path / "t.fst", progress=False))
    stacked, apart = DeepseekV4(fst), DeepseekV4(fst)
    compressed = [b.attn for b in stacked.layers if b.attn.compressors]
    assert compressed and all(a.comp_stack is not None for a in compressed)
    assert any(a.indexer is not None for a in compressed)
    for b in apart.layers:
        b.attn.comp_stack = None
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, 1024, (n,), generator=g).tolist() for n in (140, 9)]
    logits = {}
    for name, m in (("stacked", stacked), ("apart", apart)):
        states = [m.new_state() for _ in prompts]
        outs = [m.forward(p, s, all_logits=False)[0] for p, s in zip(prompts, states)]
        ids = [int(o[-1].argmax()) for o in outs]
        for _ in range(6):  # decode steps of both rows at once (the scheduler's path)
            step = m.forward_rows(ids, states)
            outs.append(step)
            ids = [int(r.argmax()) for r in step]
        logits[name] = outs
    for a, b in zip(logits["stacked"], logits["apart"]):
        assert torch.equal(a, b)
