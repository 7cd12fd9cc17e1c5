"""The accelerator tier (`fastar.model.device`) through the same torch code on the CPU (`--device torch:cpu`), against
transformers and against the C-kernel path, plus the expert split between the device pool and the CPU.

CUDA runs of the same checks are at the end, marked `gpu` (skipped without CUDA).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastar.engine.engine import load
from fastar.errors import ConfigError
from fastar.model.device import DeviceBackend, cuda_available, resolve_device

TOL = 1e-4

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def hf_model():
    from transformers import DeepseekV4ForCausalLM

    loaded: dict = {}

    def get(path):
        if str(path) not in loaded:
            loaded[str(path)] = DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        return loaded[str(path)]

    return get


@pytest.fixture(scope="module")
def variant_ckpt(tmp_path_factory):
    """test_model's second config: a compressed first layer, 3 hash layers, window 16, top-k 8, 3 experts/token."""
    from fastar.fixtures import write_checkpoint

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


def device_engine(path, numerics="reference", gpu_budget="auto", device="torch:cpu", **kw):
    return load(path, numerics=numerics, device=device, gpu_budget=gpu_budget, **kw)


# --- choosing the device -------------------------------------------------------------------------------------


def test_device_names():
    assert resolve_device("cpu") == "cpu"
    assert resolve_device("torch:cpu") == "torch:cpu"
    assert resolve_device(" Torch:CPU ") == "torch:cpu"
    with pytest.raises(ConfigError, match="expected cpu, torch:cpu, cuda or cuda:N"):
        resolve_device("tpu")
    with pytest.raises(ConfigError, match="expected"):
        resolve_device("cuda:x")


def test_the_default_device_is_the_cpu_even_with_cuda(monkeypatch):
    """Until the accelerator tier has passed a run on a real GPU, no --device means the C kernels, CUDA or not;
    `--device cuda` (or `auto`) opts in."""
    import fastar.model.device as device

    monkeypatch.setattr(device, "cuda_available", lambda: True)
    monkeypatch.setattr(device.torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(device.torch.cuda, "device_count", lambda: 1)
    assert device.resolve_device(None) == "cpu"
    assert device.resolve_device("auto") == "cuda:0"
    assert device.resolve_device("cuda") == "cuda:0"


@pytest.mark.skipif(cuda_available(), reason="checks the machine without CUDA")
def test_cuda_without_cuda_is_one_clear_error(tiny_ckpt):
    assert resolve_device(None) == "cpu"  # the default without CUDA: the C kernels
    with pytest.raises(ConfigError, match=r"^device='cuda': CUDA is not available") as e:
        load(tiny_ckpt, device="cuda")
    assert "\n" not in str(e.value)
    assert load(tiny_ckpt).device == "cpu"


def test_bad_gpu_budget_is_one_clear_error(tiny_ckpt):
    for device in ("cpu", "torch:cpu"):
        with pytest.raises(ConfigError, match="cannot read 'lots' as a size"):
            load(tiny_ckpt, device=device, gpu_budget="lots")


def test_draft_is_refused_on_a_device(tiny_ckpt):
    with pytest.raises(ConfigError, match=r"^draft='mtp': speculative decoding runs on device='cpu' only"):
        load(tiny_ckpt, device="torch:cpu", draft="mtp")


# --- exactness -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny", "variant"])
def test_reference_logits_match_transformers(request, hf_model, which):
    """Every position of a 400-token prefill within 1e-4 of transformers on the torch device path, and the state
    then continued token by token (the decode path: its experts missed the pool and ran on the CPU's C kernels)."""
    path = request.getfixturevalue(f"{which}_ckpt")
    ids = tokens(400, 11)
    eng = device_engine(path, gpu_budget=0 if which == "variant" else "auto")
    state = eng.new_state()
    ours = eng.prefill(ids[:380], state, all_logits=True)
    steps = [eng.prefill([t], state) for t in ids[380:]]
    with torch.no_grad():
        ref = hf_model(path)(torch.tensor([ids])).logits[0]
    diff = (torch.cat([ours, *steps]) - ref).abs().max().item()
    assert diff <= TOL, f"max |logit diff| {diff:.3e}"
    st = eng.stats()
    assert st["device"] == "torch:cpu" and st["device_steps"] > 0
    if which == "variant":  # no pool: every routed expert on the CPU
        assert st["device_experts_device"] == 0 and st["device_experts_cpu"] > 0
    else:  # the prefill streamed its experts to the device; decode hits them there
        assert st["device_experts_streamed"] > 0 and st["device_pool_hits"] > 0


def test_greedy_tokens_equal_the_cpu_path(tiny_ckpt):
    prompt = tokens(300, 12)
    cpu = load(tiny_ckpt, numerics="reference").generate_tokens(prompt, 40)
    dev = device_engine(tiny_ckpt).generate_tokens(prompt, 40)
    assert len(cpu) == 40 and dev == cpu


def test_official_numerics_bound_against_the_cpu_path(variant_ckpt):
    """Official numerics round activations to FP8 after float32 sums whose order differs between torch and the C
    kernels, so a value at a rounding boundary may round the other way (docs/MODEL.md, "Chunking under official").
    The bound: per position, the largest logit difference device vs CPU stays within the quantization noise itself
    (official vs reference on the CPU path), in median over positions. Two fresh engines (the same split) agree
    bitwise; a warm pool moves experts from the CPU's C kernels to the device and only by float32 summation order."""
    ids = tokens(120, 6)
    cpu = load(variant_ckpt).logits(ids)
    dev_engine = device_engine(variant_ckpt, numerics="official")
    dev = dev_engine.logits(ids)
    assert np.array_equal(dev, device_engine(variant_ckpt, numerics="official").logits(ids))
    reference = load(variant_ckpt, numerics="reference").logits(ids)
    device_noise = np.median(np.abs(dev - cpu).max(-1))
    quant_noise = np.median(np.abs(reference - cpu).max(-1))
    assert device_noise <= quant_noise, (device_noise, quant_noise)


# --- the split between the device pool and the CPU -----------------------------------------------------------


def _split_run(path, budget, host_kernels, ids, decode, numerics="official"):
    eng = device_engine(path, numerics=numerics, gpu_budget=budget)
    eng.backend.split.host_kernels = host_kernels
    state = eng.new_state()
    out = [eng.prefill(ids, state, all_logits=True)]
    out += [eng.prefill([t], state) for t in decode]
    return torch.cat(out), eng.stats()


def test_split_policy_does_not_change_the_sum(tiny_ckpt):
    """All experts on the device, all on the CPU, and a pool too small for a layer's experts (mixed) give bitwise
    the same logits when both sides run the same torch math: every expert's output is added in expert-id order
    whatever ran where. With the C kernels on the CPU side the split moves float32 summation order only: a given
    split is deterministic, and in reference numerics the splits agree within 1e-4."""
    from fastar.weights.device_cache import slot_bytes

    slot = slot_bytes(load(tiny_ckpt).config)
    ids, decode = tokens(300, 3), tokens(6, 4)
    runs = {b: _split_run(tiny_ckpt, b, False, ids, decode) for b in ("auto", 0, 3 * slot)}
    all_dev, all_cpu, mixed = (runs[b] for b in ("auto", 0, 3 * slot))
    assert torch.equal(all_dev[0], all_cpu[0]) and torch.equal(all_dev[0], mixed[0])
    assert all_cpu[1]["device_experts_device"] == 0 and all_cpu[1]["device_experts_cpu"] > 0
    assert mixed[1]["device_experts_device"] > 0 and mixed[1]["device_experts_cpu"] > 0
    assert mixed[1]["device_pool_evicted"] > 0
    assert all_dev[1]["device_experts_streamed"] > 0
    c_kernels, _ = _split_run(tiny_ckpt, 3 * slot, True, ids, decode)
    again, _ = _split_run(tiny_ckpt, 3 * slot, True, ids, decode)
    assert torch.equal(c_kernels, again)  # deterministic with the C kernels in the mix too
    reference = [_split_run(tiny_ckpt, b, True, ids, decode, "reference")[0] for b in (0, "auto")]
    assert (reference[0] - reference[1]).abs().max().item() <= TOL


def test_decode_misses_are_admitted_to_the_pool(tiny_ckpt):
    """Decode (chunks under STREAM_TOKENS) runs missing experts on the CPU and copies them into free slots for
    later steps, so the pool warms up."""
    eng = device_engine(tiny_ckpt)
    state = eng.new_state()
    for t in tokens(12, 5):
        eng.prefill([t], state)
    st = eng.stats()
    assert st["device_experts_streamed"] == 0
    assert st["device_pool_admitted"] > 0 and st["device_pool_hits"] > 0
    assert st["device_experts_cpu"] > 0 and st["device_experts_device"] > 0


def test_state_bytes_round_trip_continue_on_the_device(tiny_ckpt):
    """A state saved to bytes comes back on the host; the model moves it to the device and continues exactly."""
    from fastar.model.state import ModelState

    eng = device_engine(tiny_ckpt)
    ids = tokens(60, 7)
    state = eng.new_state()
    eng.prefill(ids[:50], state)
    restored = ModelState.from_bytes(state.to_bytes())
    a = eng.prefill(ids[50:], state)
    b = eng.prefill(ids[50:], restored)
    assert torch.equal(a, b)


def test_public_api_streams_on_the_device(tiny_ckpt):
    eng = device_engine(tiny_ckpt)
    out = [c.token for c in eng.stream(tokens(20, 8), max_tokens=5, ignore_eos=True) if c.token is not None]
    assert out == load(tiny_ckpt, numerics="reference").generate_tokens(tokens(20, 8), 5, ignore_eos=True)


# --- the pool ------------------------------------------------------------------------------------------------


def test_pool_bytes_lru_and_full_layer(tiny_ckpt):
    from fastar.contracts import ExpertWeights
    from fastar.convert.checkpoint import Checkpoint
    from fastar.quant.linear import SourceExperts
    from fastar.weights.device_cache import DeviceExpertCache, slot_bytes
    from fastar.weights.expert_store import CacheFullError

    src = Checkpoint(tiny_ckpt)
    pool = DeviceExpertCache(SourceExperts(src), src.config, 3 * slot_bytes(src.config), "cpu")
    for layer in range(3):
        for e in (0, 3, 5):
            w = pool.get(layer, e)
            assert isinstance(w, ExpertWeights)
            assert all(np.array_equal(t.numpy(), r) for t, r in zip(w, src.expert(layer, e)))
    st = pool.stats()
    assert st["misses"] == 9 and st["hits"] == 0 and st["evicted"] == 6 and st["n_slots"] == 3
    pool.get(2, 3)  # handed out for this layer already: no lookup
    pool.end_layer()
    pool.get(2, 3)
    assert pool.stats()["hits"] == 1
    with pytest.raises(CacheFullError, match=r"raise the budget \(load\(gpu_budget=\.\.\.\), or --gpu-budget\)"):
        for e in range(4):
            pool.get(3, e)
    # a new step of the same layer frees the previous step's slots (a one-layer model streams again)
    pool.begin_layer(3)
    for e in range(4, 7):
        pool.get(3, e)
    # admission: a free slot takes anything; a full pool only an expert used more often than its victim
    pool2 = DeviceExpertCache(SourceExperts(src), src.config, 1 * slot_bytes(src.config), "cpu")
    pool2.note_use(0, [1])
    assert pool2.admit(0, 1) and pool2.holds(0, 1)
    pool2.end_layer()
    pool2.note_use(0, [2])
    assert not pool2.admit(0, 2)  # used once, as often as the resident one
    pool2.note_use(0, [2])
    assert pool2.admit(0, 2) and pool2.holds(0, 2) and not pool2.holds(0, 1)


def test_admissions_into_a_full_pool_are_capped(tiny_ckpt):
    """Once the pool is full, a layer step copies in at most ADMIT_FULL experts that ran on the CPU."""
    from fastar.model.device import ADMIT_FULL
    from fastar.weights.device_cache import slot_bytes

    eng = device_engine(tiny_ckpt, gpu_budget=4 * slot_bytes(load(tiny_ckpt).config))
    state = eng.new_state()
    eng.prefill(tokens(20, 1), state)  # short chunks: every miss on the CPU, admitted while slots are free
    assert eng.stats()["device_pool_held"] == 4
    ids = tokens(30, 2)
    for t in ids:
        before = eng.stats()
        eng.prefill([t], state)
        after = eng.stats()
        steps = after["device_steps"] - before["device_steps"]
        assert after["device_pool_admitted"] - before["device_pool_admitted"] <= ADMIT_FULL * steps
    assert after["device_pool_admitted"] > 4  # replacements did happen


def test_backend_budget_zero_has_no_slots(tiny_ckpt):
    eng = device_engine(tiny_ckpt, gpu_budget=0)
    assert eng.backend.pool.n_slots == 0
    assert isinstance(eng.backend, DeviceBackend)


# --- CUDA ----------------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_reference_matches_transformers(tiny_ckpt, hf_model):
    ids = tokens(400, 11)
    eng = device_engine(tiny_ckpt, device="cuda")
    assert eng.model.layers[0].attn.wq_a.weight.is_cuda
    state = eng.new_state()
    ours = torch.cat([eng.prefill(ids[:390], state, all_logits=True), *(eng.prefill([t], state) for t in ids[390:])])
    assert state.layers[0].kv.device.type == "cuda"
    with torch.no_grad():
        ref = hf_model(tiny_ckpt)(torch.tensor([ids])).logits[0]
    assert (ours - ref).abs().max().item() <= TOL


@pytest.mark.gpu
def test_cuda_greedy_and_split(tiny_ckpt):
    from fastar.weights.device_cache import slot_bytes

    prompt = tokens(300, 12)
    cpu = load(tiny_ckpt, numerics="reference").generate_tokens(prompt, 24)
    slot = slot_bytes(load(tiny_ckpt).config)
    for budget in ("auto", 0, 3 * slot):
        eng = device_engine(tiny_ckpt, device="cuda", gpu_budget=budget)
        assert eng.generate_tokens(prompt, 24) == cpu, budget


@pytest.mark.gpu
def test_cuda_pool_copies_on_the_side_stream(tiny_ckpt):
    from fastar.convert.checkpoint import Checkpoint
    from fastar.quant.linear import SourceExperts
    from fastar.weights.device_cache import DeviceExpertCache, slot_bytes

    src = Checkpoint(tiny_ckpt)
    pool = DeviceExpertCache(SourceExperts(src), src.config, 3 * slot_bytes(src.config), "cuda")
    for layer in range(4):
        for e in (0, 3, 5):
            w = pool.get(layer, e)
            assert all(t.is_cuda for t in w)
            assert all(np.array_equal(t.cpu().numpy(), r) for t, r in zip(w, src.expert(layer, e)))
    torch.cuda.synchronize()
    assert pool.stats()["misses"] == 12


def test_device_linear_dequantizes_as_the_reference(tiny_ckpt):
    """`DeviceLinear` applies the FP8 block scales by broadcast: bitwise the reference `fp8_dequant`, whole and by
    row blocks (what `grouped` and the row-blocked product ask for)."""
    from fastar.convert.checkpoint import Checkpoint
    from fastar.model.device import DeviceLinear
    from fastar.quant.linear import Weights

    w = Weights(Checkpoint(tiny_ckpt), kernels=False)
    for name in ("layers.0.attn.wq_b", "layers.1.attn.wo_a", "layers.2.ffn.shared_experts.w2", "head"):
        lin = w.linear(name)
        dev = DeviceLinear(lin, torch.device("cpu"))
        assert torch.equal(dev.dequant(), lin.dequant())
        half = (lin.out_features // 2) // 128 * 128
        if half:
            assert torch.equal(dev.dequant(half, lin.out_features), lin.dequant(half, lin.out_features))
        x = torch.randn(3, lin.in_features)
        assert torch.equal(dev(x), lin(x))


# --- the command line --------------------------------------------------------------------------------------------


def _fastar(*args: str, timeout: int = 600):
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "FASTAR_DEVICE"}  # the flag under test, not the suite's pin
    return subprocess.run(
        [sys.executable, "-m", "fastar", *args], capture_output=True, text=True, timeout=timeout, env=env
    )


@pytest.mark.skipif(cuda_available(), reason="checks the machine without CUDA")
def test_cli_cuda_without_cuda_is_one_line(tiny_ckpt):
    r = _fastar("run", "-m", str(tiny_ckpt), "--device", "cuda", "-p", "hi", "--raw", "-n", "1")
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("fastar: error: --device cuda: CUDA is not available") and r.stderr.count("\n") == 1


def test_bench_on_the_device_path_reports_the_split(tiny_ckpt, tmp_path):
    """What bench/gpu-check.sh runs on CUDA, here through torch:cpu: a prompt long enough to stream experts to the
    device, a pool of a third of the bank, the split's counters in the JSON."""
    import json

    from fastar.convert.hf import convert
    from fastar.weights.device_cache import slot_bytes

    fst = convert(tiny_ckpt, tmp_path / "t.fst", progress=False)
    budget = str(6 * slot_bytes(load(tiny_ckpt).config))
    args = ["--device", "torch:cpu", "--gpu-budget", budget, "--prompt-tokens", "300", "--decode-tokens", "3"]
    r = _fastar("bench", "-m", str(fst), "--json", "--warmup-tokens", "2", *args)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["device"] == "torch:cpu" and out["decode_tok_s"] > 0 and out["prefill_tok_s"] > 0
    assert out["device_pool_n_slots"] == 6 and out["device_experts_streamed"] > 0
    assert out["device_experts_device"] > 0 and out["device_experts_cpu"] > 0
    # forward passes x layers (the MTP block idle): every expert is in RAM, so the prompt is prefilled twice (the
    # first after load timed apart), then 2 warm-up and 3 timed decode steps
    assert out["runs"][0]["preloaded"] and "prefill_first_tok_s" in out["runs"][0]
    assert out["device_steps"] == (2 * (300 // 512 + 1) + 2 + 3) * 5
