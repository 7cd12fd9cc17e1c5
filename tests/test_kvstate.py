"""Decode state at the official precision: the packed row formats (FP8 KV + scales, FP4 index keys + scales) are
exact for what official numerics store, so a model's logits do not move by a bit; their byte format round-trips
and old files are refused; one chunking of a prompt against another."""

from __future__ import annotations

import struct

import pytest
import torch

from fastar.engine.engine import load
from fastar.fixtures import write_checkpoint
from fastar.model import ops
from fastar.model.state import MAGIC, VERSION, ModelState, RowBuffer, RowFormat, StateError, StateFormat

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _rows(k: int, width: int, seed: int) -> torch.Tensor:
    """Rows over many magnitudes (tiny, huge, zeros, negative zeros), as a model's rows might be."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(k, width, generator=g) * torch.exp2(torch.randint(-30, 30, (k, 1), generator=g).float())
    x[0] = 0.0
    x[1, : width // 2] = -0.0
    x[2, 3] = 1e-30
    return x


@pytest.mark.parametrize("width,rope", [(512, 64), (128, 64), (40, 8)])
def test_fp8_rows_are_exact_for_fp8_rounded_kv(width, rope):
    x = _rows(37, width, 0)
    kv = torch.cat([ops.fp8_quant_sim(x[:, :-rope], 64), x[:, -rope:]], dim=1)  # what `_fp8_nope` stores
    fmt = RowFormat("fp8", width, rope)
    raw = fmt.encode(kv)
    assert raw.dtype == torch.uint8 and raw.shape == (37, fmt.stored_width) and fmt.row_bytes % 4 == 0
    assert torch.equal(fmt.decode(raw).view(torch.int32), kv.view(torch.int32))  # bit for bit, -0.0 included
    with pytest.raises(StateError, match="fp8 state format"):
        fmt.encode(x)  # not FP8-rounded: refused, never stored approximately


@pytest.mark.parametrize("width", [128, 64, 16])
def test_fp4_rows_are_exact_for_fp4_rounded_index_keys(width):
    x = _rows(41, width, 1)
    keys = ops.fp4_quant_sim(ops.hadamard(x), 32)  # what the indexer's compressor stores under fp4_indexer
    fmt = RowFormat("fp4", width)
    raw = fmt.encode(keys)
    assert raw.shape == (41, fmt.stored_width)
    assert torch.equal(fmt.decode(raw).view(torch.int32), keys.view(torch.int32))
    with pytest.raises(StateError, match="fp4 state format"):
        fmt.encode(x)


@pytest.mark.parametrize("fmt", [RowFormat("fp8", 512, 64), RowFormat("fp8", 40, 8), RowFormat("fp4", 128)])
def test_c_encode_and_decode_are_bit_identical_to_torch(fmt):
    from fastar.quant.kernels import extension as C

    if C is None:
        pytest.skip("the C extension is not built")
    x = _rows(300, fmt.width, 4)
    if fmt.kind == "fp8":
        x = torch.cat([ops.fp8_quant_sim(x[:, : -fmt.rope], 64), x[:, -fmt.rope :]], dim=1)
    else:
        x = ops.fp4_quant_sim(ops.hadamard(x) if fmt.width == 128 else x, 32)
    raw = fmt.encode(x)
    assert torch.equal(raw, fmt.encode_torch(x))  # the same bytes
    ref = fmt.decode_torch(raw)
    out = torch.empty(300, fmt.width)
    C.state_rows_decode(raw.numpy(), 0 if fmt.kind == "fp8" else 1, fmt.rope, out.numpy())
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32)) and torch.equal(fmt.decode(raw), out)
    with pytest.raises(ValueError, match="bytes a row"):
        C.state_rows_decode(raw[:, :-4].contiguous().numpy(), 0 if fmt.kind == "fp8" else 1, fmt.rope, out.numpy())
    bumped = x.clone()
    bumped[7, 0] = torch.nextafter(bumped[7, 0], torch.tensor(float("inf")))  # one ulp off the grid
    with pytest.raises(StateError, match="state format exactly"):
        fmt.encode(bumped)
    with pytest.raises(StateError, match="state format exactly"):
        fmt.encode_torch(bumped)


def test_packed_buffer_reads_like_a_float32_one():
    fmt = RowFormat("fp8", 128, 64)
    x = _rows(50, 128, 2)
    x = torch.cat([ops.fp8_quant_sim(x[:, :64], 64), x[:, 64:]], dim=1)
    a, b = RowBuffer(128), RowBuffer(128, fmt=fmt)
    for i in range(0, 50, 7):
        a.append(x[i : i + 7])
        b.append(x[i : i + 7])
    b.drop_before(9)
    a.drop_before(9)
    idx = torch.tensor([[9, 49], [12, 30]])
    assert torch.equal(b.rows(10, 40), a.rows(10, 40)) and torch.equal(b.take(idx), a.take(idx))
    assert b.nbytes == 41 * fmt.row_bytes < a.nbytes == 41 * 128 * 4
    c = b.copy()
    b.truncate(20)
    assert c.stop == 50 and torch.equal(c.all(), a.all())


@pytest.mark.parametrize("fmt", [RowFormat("fp8", 128, 64), RowFormat("fp4", 64), RowFormat("f32", 48)])
def test_append_stores_the_torch_encoders_bytes_and_refuses_a_misfit_whole(fmt):
    """`RowBuffer.append` (rows encoded straight into the storage where the C extension runs) holds the bytes of
    `encode_torch` through growth and dropped rows, and a batch with one row the format cannot hold is refused
    whole: nothing of it stored."""
    x = _rows(40, fmt.width, 3)
    if fmt.kind == "fp8":
        x = torch.cat([ops.fp8_quant_sim(x[:, :-64], 64), x[:, -64:]], dim=1)
    elif fmt.kind == "fp4":
        x = ops.fp4_quant_sim(x, 32)
    b = RowBuffer(fmt.width, fmt=fmt)
    for i in range(0, 40, 3):
        b.append(x[i : i + 3])
        if i == 21:
            b.drop_before(5)
    assert (b.start, b.stop) == (5, 40) and torch.equal(b.raw(), fmt.encode_torch(x[5:]))
    if fmt.kind != "f32":
        bad = x[:3].clone()
        bad[1, 0] = 0.1234567  # not on the format's grid
        with pytest.raises(StateError, match=f"{fmt.kind} state format"):
            b.append(bad)
        assert b.stop == 40 and torch.equal(b.raw(), fmt.encode_torch(x[5:]))


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """Compressed layers first, window 16, top-k 8: 200 tokens run the indexer's picks on most queries."""
    return write_checkpoint(
        tmp_path_factory.mktemp("ckpt-kvstate"),
        "tiny",
        seed=1,
        tokenizer=False,
        compress_ratios=[4, 128, 0, 4, 128, 0],
        sliding_window=16,
        index_topk=8,
        num_hash_layers=3,
        num_experts_per_tok=3,
    )


def _ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 1024, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_official_logits_are_bit_identical_with_packed_state(variant):
    """The official numerics' packed state (FP8 KV, FP4 index keys) against float32 rows: prefill in chunks,
    then decode steps; every logit equal bit for bit, and the packed state about 3x smaller."""
    model = load(variant, numerics="official").model
    ids = _ids(200, 3)
    packed, plain = model.new_state(), model.new_state(StateFormat())
    assert packed.layers[0].entries.is_packed and packed.layers[0].idx_entries.fmt.kind == "fp4"
    assert not plain.layers[0].entries.is_packed
    for a, b in ((0, 130), (130, 131), (131, 190), *((t, t + 1) for t in range(190, 200))):
        x, y = model.forward(ids[a:b], packed)[0], model.forward(ids[a:b], plain)[0]
        assert torch.equal(x, y), (a, b)
    for p, f in zip(packed.layers, plain.layers):
        for name, buf in p.buffers().items():
            assert torch.equal(buf.all(), f.buffers()[name].all()), name
    assert packed.nbytes() < plain.nbytes()


def test_reference_numerics_keep_float32_rows(variant):
    state = load(variant, numerics="reference").model.new_state()
    assert all(b.fmt.kind == "f32" for s in state.layers for b in s.buffers().values())


def test_packed_state_bytes_round_trip_and_old_versions_are_refused(variant):
    model = load(variant, numerics="official").model
    ids = _ids(90, 5)
    state = model.new_state()
    model.forward(ids[:80], state)
    back = ModelState.from_bytes(state.to_bytes())
    assert back.to_bytes() == state.to_bytes() and back.nbytes() == state.nbytes()
    assert torch.equal(model.forward(ids[80:], back)[0], model.forward(ids[80:], state)[0])
    raw = state.to_bytes()
    old = raw[:8] + struct.pack("<I", VERSION - 1) + raw[12:]
    with pytest.raises(StateError, match=f"version {VERSION - 1} is not supported.*older fastar"):
        ModelState.from_bytes(old)


def test_last_logits_of_a_prompt_do_not_depend_on_the_chunk_size(variant):
    """One-shot prefill against chunks of 64, 37 and 5 tokens (the 64k demo's property on a small model):
    reference numerics within 1e-5; official numerics within the documented bound, the quantization noise
    itself (docs/MODEL.md, "Chunking under official": the FP8/FP4 roundings follow sums whose order depends on
    the chunk shape), measured as the largest |official - reference| of the same logits."""
    ids = _ids(200, 7)
    last = {}
    for numerics in ("reference", "official"):
        for chunk in (200, 64, 37, 5):
            e = load(variant, numerics=numerics, prefill_chunk=chunk)
            last[numerics, chunk] = e.prefill(ids, e.new_state())[-1]
    noise = (last["official", 200] - last["reference", 200]).abs().max().item()
    assert noise > 1e-3  # the bound is not vacuous
    for chunk in (64, 37, 5):
        assert (last["reference", chunk] - last["reference", 200]).abs().max().item() <= 1e-5, chunk
        assert (last["official", chunk] - last["official", 200]).abs().max().item() <= noise, chunk


@pytest.mark.parametrize("fmt", [RowFormat("fp8", 512, 64), RowFormat("fp4", 128)])
def test_non_finite_blocks_are_stored_as_nan(fmt):
    """Garbage in (a corrupt expert read unchecked) must not stop the model: a block holding NaN or inf is stored
    with scale byte 255 and decodes all NaN, as the quantizers would have made it; other blocks stay exact."""
    x = _rows(6, fmt.width, 5)
    x = torch.cat([ops.fp8_quant_sim(x[:, :-64], 64), x[:, -64:]], 1) if fmt.kind == "fp8" else ops.fp4_quant_sim(x, 32)
    bad = x.clone()
    bad[1, 3], bad[4, 40] = float("nan"), float("-inf")
    raw = fmt.encode(bad)
    assert torch.equal(raw, fmt.encode_torch(bad))
    block = 64 if fmt.kind == "fp8" else 32
    lo = 40 // block * block  # the block holding column 40
    for dec in (fmt.decode(raw), fmt.decode_torch(raw)):
        assert dec[1, :block].isnan().all() and dec[4, lo : lo + block].isnan().all()
        assert torch.equal(dec[[0, 2, 3, 5]], x[[0, 2, 3, 5]])


def test_prefix_cache_skips_a_state_of_the_old_format(tmp_path, caplog):
    """A prefix-cache file whose state bytes are version 1 (float32 rows, before the packed formats) is skipped with
    the reason in the log, not read as garbage."""
    import logging

    from fastar.engine.prefix_cache import PrefixCache
    from fastar.model.state import LayerState

    class OldState(ModelState):
        def to_bytes(self) -> bytes:
            raw = super().to_bytes()
            return raw[:8] + struct.pack("<I", 1) + raw[12:]

        def snapshot(self) -> ModelState:  # the cache stores a copy
            s = super().snapshot()
            return OldState(s.layers, s.mtp, s.max_rollback)

    layer = LayerState.new(0, 8, 4, 2)
    layer.kv.append(torch.ones(3, 4))
    layer.length = 3
    cache = PrefixCache(tmp_path, "model", 1 << 20)
    assert cache.store([5, 6, 7], OldState([layer])) is not None
    with caplog.at_level(logging.WARNING):
        assert cache.lookup([5, 6, 7, 8], 4) is None
    assert "decode state version 1 is not supported (expected 2" in caplog.text


def test_official_state_format_is_smaller_than_the_official_inference_at_flash_widths():
    """At the Flash shape an FP8 KV row is 448 codes + 7 scale bytes + 64 float32 rotary dims = 712 bytes (bf16:
    1,024) and an index key 64 bytes of FP4 codes + 4 scale bytes (bf16: 256): 4,206.25 B per token against the
    official inference's 6,880 and float32's 13,760."""
    from fastar.model.state import official_format, state_accounting, state_bytes
    from fastar.synth import synth_config

    cfg = synth_config(43)
    fmt = official_format(cfg)
    assert fmt.kv(cfg.head_dim).row_bytes == 712 and fmt.index(cfg.index_head_dim).row_bytes == 68
    acct = state_accounting(cfg, 2048, fmt=fmt)
    assert acct["per_token"] == 21 * (712 + 68) / 4 + 20 * 712 / 128 == 4206.25
    assert acct["per_token"] < acct["official_per_token"] == 6880 < state_accounting(cfg, 2048)["per_token"]
    small = synth_config(3, mtp=0)  # no MTP block: nothing counted for one
    assert state_bytes(small, 4096, 0, fmt=official_format(small)) == state_bytes(
        small, 4096, 0, mtp_layers=0, fmt=official_format(small)
    )


@pytest.mark.parametrize("width,rope", [(512, 64), (70, 4), (40, 8)])
def test_c_fp8_decode_of_every_code_and_scale_is_the_same_on_every_isa(width, rope):
    """Raw FP8 rows holding every e4m3 code (subnormals, both zeros, both NaN codes) under block scales from 2^-126
    to 2^127 and the NaN scale byte, with ragged blocks (66 = 64 + 2 codes): each ISA's decode (AVX-512 builds the
    values from the code bits) gives the bits of the portable table decode, and the torch decode's values."""
    from fastar.quant import kernels as K
    from fastar.quant.kernels import extension as C

    if C is None:
        pytest.skip("the C extension is not built")
    fmt = RowFormat("fp8", width, rope)
    nb = -(-(width - rope) // 64)
    g = torch.Generator().manual_seed(9)
    raw = torch.randint(0, 256, (64, fmt.stored_width), generator=g, dtype=torch.uint8)
    every = torch.arange(256, dtype=torch.uint8).repeat(-(-64 * 64 * nb // 256))[
        torch.randperm(64 * 64 * nb, generator=g)
    ]
    raw[:, 4 * rope : 4 * rope + 64 * nb] = every.view(64, 64 * nb)  # each code 16 nb times, shuffled
    scales = torch.tensor([1, 2, 100, 127, 128, 200, 253, 254, 255], dtype=torch.uint8)
    raw[:, 4 * rope + 64 * nb : 4 * rope + 65 * nb] = scales[torch.randint(0, 9, (64, nb), generator=g)]
    raw[:, : 4 * rope] = 0  # the float32 rope dims: plain copies (left zero so no NaN pattern hides a difference)
    ref = fmt.decode_torch(raw)
    outs = {}
    for isa in K.cpu_features()["usable_isas"]:
        K.set_isa(isa)
        try:
            out = torch.empty(64, width)
            C.state_rows_decode(raw.numpy(), 0, rope, out.numpy())
        finally:
            K.set_isa("auto")
        outs[isa] = out
        nan = ref.isnan()
        assert torch.equal(out.isnan(), nan) and torch.equal(out[~nan].view(torch.int32), ref[~nan].view(torch.int32))
    first = next(iter(outs.values()))
    assert all(torch.equal(o.view(torch.int32), first.view(torch.int32)) for o in outs.values())  # NaN bits too


@pytest.mark.parametrize("header", [b"[" * 100_000, b'{"layers": ' + b"9" * 5000 + b"}"])
def test_a_state_header_json_cannot_take_is_a_state_error(header):
    """Nesting deeper than the json module recurses, or a number of more digits than Python converts, was a
    RecursionError / ValueError out of `ModelState.from_bytes` instead of its StateError."""
    with pytest.raises(StateError, match="decode state header is corrupt"):
        ModelState.from_bytes(MAGIC + struct.pack("<IQ", VERSION, len(header)) + header)
