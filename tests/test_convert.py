"""`fastar convert` on official-format fixtures: lossless, validated, atomic; `verify` names what is broken."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from fastar.convert.checkpoint import Checkpoint
from fastar.convert.hf import convert
from fastar.convert.names import expected_tensors, is_routed_expert
from fastar.errors import CheckpointError, ConfigError
from fastar.fixtures import write_checkpoint
from fastar.format.reader import FstFile
from fastar.quant import reference as ref


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    d = tmp_path_factory.mktemp("conv")
    ck = write_checkpoint(d / "ckpt", preset="tiny", seed=1)
    out = convert(ck, d / "tiny.fst", progress=False)
    return ck, out


def _dequant(dtype, a, scale=None):
    if dtype == "F8_E4M3":
        return ref.fp8_block_dequant(a, scale)
    if dtype == "BF16":
        return ref.bf16_decode(a)
    return a


def test_lossless_every_tensor_and_expert(converted):
    ck_dir, out = converted
    ck = Checkpoint(ck_dir)
    cfg = ck.config
    with FstFile(out) as f:
        assert f.config == cfg
        resident = [n for n in expected_tensors(cfg) if not is_routed_expert(n)]
        assert sorted(f.names()) == sorted(resident)
        for name in resident:
            a, b = ck.read(name), f.tensor(name)
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert a.tobytes() == b.tobytes(), name  # bit-for-bit, hence equal after any dequantization
            if ck.dtype(name) == "F8_E4M3":
                s = name[: -len("weight")] + "scale"
                np.testing.assert_array_equal(_dequant("F8_E4M3", b, f.tensor(s)), _dequant("F8_E4M3", a, ck.read(s)))
        for slot in range(cfg.num_layer_slots):
            for e in range(cfg.n_routed_experts):
                x, y = ck.expert(slot, e), f.expert(slot, e)
                for u, v in zip(x, y):
                    np.testing.assert_array_equal(u, v)
                np.testing.assert_array_equal(ref.fp4_decode(x.w2, x.w2_scale), ref.fp4_decode(y.w2, y.w2_scale))
        assert f.tokenizer_json() == ck.tokenizer_json()
        assert f.verify() == []


def test_dspark_and_config_revisions(tmp_path):
    ck = write_checkpoint(tmp_path / "ds", preset="tiny-dspark", seed=2)
    out = convert(ck, tmp_path / "ds.fst", progress=False)
    with FstFile(out) as f:
        assert f.config.has_dspark and f.config.num_mtp_layers == 3
        assert f.has("mtp.2.markov_head.markov_w1.weight")
        assert f.verify() == []
    # the initial upstream revision has no expert_dtype field
    cfg_path = tmp_path / "ds" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("expert_dtype", None)
    cfg.get("quantization_config", {}).pop("expert_dtype", None)
    cfg_path.write_text(json.dumps(cfg))
    out2 = convert(ck, tmp_path / "ds2.fst", progress=False)
    with FstFile(out2) as f:
        assert f.config.expert_dtype == "fp4"


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def _shards(d):
    return sorted(p for p in os.listdir(d) if p.endswith(".safetensors"))


def test_missing_shard(converted, tmp_path):
    d = _copy(converted[0], tmp_path / "c")
    victim = _shards(d)[-1]
    os.unlink(d / victim)
    with pytest.raises(CheckpointError, match=victim):
        convert(d, tmp_path / "o.fst", progress=False)
    assert not (tmp_path / "o.fst").exists() and not (tmp_path / "o.fst.partial").exists()


def _find(d, name):
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    return d / idx["weight_map"][name]


@pytest.mark.parametrize(
    "change,msg",
    [
        ({"shape": [7, 7]}, "shape"),
        ({"dtype": "F8_E5M2"}, "dtype"),
    ],
)
def test_wrong_shape_or_dtype(converted, tmp_path, change, msg):
    d = _copy(converted[0], tmp_path / "c")
    name = "layers.1.attn.wkv.weight"
    shard = _find(d, name)
    raw = shard.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    h = json.loads(raw[8 : 8 + n])
    if "shape" in change:  # keep the byte extent consistent, so only the shape is wrong
        h[name]["shape"] = [int(np.prod(h[name]["shape"]))]
    else:
        assert h[name]["dtype"] == "F8_E4M3"
        h[name]["dtype"] = "F8_E5M2"  # same size, wrong encoding
    hb = json.dumps(h).encode()
    hb += b" " * (-len(hb) % 8)
    shard.write_bytes(len(hb).to_bytes(8, "little") + hb + raw[8 + n :])
    with pytest.raises(CheckpointError) as ei:
        convert(d, tmp_path / "o.fst", progress=False)
    assert name in str(ei.value) and shard.name in str(ei.value) and msg in str(ei.value)
    assert not (tmp_path / "o.fst").exists()


def test_missing_config_field(converted, tmp_path):
    d = _copy(converted[0], tmp_path / "c")
    cfg = json.loads((d / "config.json").read_text())
    del cfg["moe_intermediate_size"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ConfigError, match="moe_intermediate_size"):
        convert(d, tmp_path / "o.fst", progress=False)


def test_interrupted_conversion_leaves_no_valid_file(converted, tmp_path, monkeypatch):
    """A failure mid-way (here: a read error on an expert) removes the partial output; a rerun works."""
    d = converted[0]
    calls = {"n": 0}
    orig = Checkpoint.expert

    def flaky(self, slot, e):
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(5, "Input/output error")
        return orig(self, slot, e)

    monkeypatch.setattr(Checkpoint, "expert", flaky)
    with pytest.raises(OSError):
        convert(d, tmp_path / "o.fst", progress=False)
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(Checkpoint, "expert", orig)
    out = convert(d, tmp_path / "o.fst", progress=False)
    with FstFile(out) as f:
        assert f.verify() == []


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "fastar", *map(str, args)], capture_output=True, text=True)


def test_verify_cli_names_bad_tensor_and_expert(converted, tmp_path):
    out = tmp_path / "m.fst"
    shutil.copy(converted[1], out)
    r = _cli("verify", out)
    assert r.returncode == 0 and "OK" in r.stdout
    with FstFile(out) as f:
        t = next(t for t in f.header["tensors"] if t["name"] == "layers.2.attn.wq_b.weight")
        e_off = f.expert_offset(3, 5) + 77
    with open(out, "r+b") as fh:
        fh.seek(t["offset"] + 10)
        b = fh.read(1)
        fh.seek(t["offset"] + 10)
        fh.write(bytes([b[0] ^ 1]))
    r = _cli("verify", out)
    assert r.returncode == 1 and "layers.2.attn.wq_b.weight" in r.stderr and "Traceback" not in r.stderr
    with open(out, "r+b") as fh:  # undo, then break an expert
        fh.seek(t["offset"] + 10)
        fh.write(b)
        fh.seek(e_off)
        fh.write(b"\xaa")
    r = _cli("verify", out)
    assert r.returncode == 1 and "expert (layer 3, id 5)" in r.stderr
    assert _cli("verify", "--quick", out).returncode == 0
    os.truncate(out, os.path.getsize(out) - 4096)
    r = _cli("verify", "--quick", out)
    assert r.returncode == 1 and "truncated" in r.stderr and "Traceback" not in r.stderr


def test_inspect_cli(converted):
    r = _cli("inspect", converted[1])
    assert r.returncode == 0
    assert "expert bank" in r.stdout and "FP4X2" in r.stdout and "F8_E4M3" in r.stdout
    r = _cli("inspect", "--json", converted[1])
    info = json.loads(r.stdout)
    assert info["experts"]["slots"] == info["config"]["num_hidden_layers"] + info["config"]["num_mtp_layers"]
    st = info["decode_state"]  # fastar.model.state.state_accounting at the default rollback bound
    assert st["at_1m"] == st["fixed"] + st["per_token"] * (1 << 20) and st["format"].startswith("KV fp8")
    assert st["reference"]["per_token"] == 2 * st["official_per_token"] > st["per_token"]
    r = _cli("inspect", converted[1])
    assert "decode state, official numerics (KV fp8" in r.stdout and "per 1k tokens" in r.stdout and "at 1M" in r.stdout
    assert "reference numerics (float32 rows)" in r.stdout


def test_convert_cli_errors(tmp_path):
    r = _cli("convert", tmp_path / "nope", "-o", tmp_path / "x.fst")
    assert r.returncode == 1 and "nope" in r.stderr and "Traceback" not in r.stderr


def test_a_hub_failure_is_one_line(monkeypatch, tmp_path):
    """A hub id that cannot be fetched: the hub's message (several lines when the network is down) is one line."""
    import huggingface_hub

    def offline(*a, **kw):
        raise OSError("Got: ConnectError: [Errno -2] Name or service not known\nAn error happened while trying")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", offline)
    with pytest.raises(CheckpointError) as err:
        convert("someone/no-such-model", tmp_path / "x.fst", progress=False)
    assert str(err.value) == (
        "could not fetch someone/no-such-model from the hub: Got: ConnectError: [Errno -2] Name or service not known "
        "An error happened while trying"
    )
    assert list(tmp_path.iterdir()) == []
