"""`fastar export`: `.fst` -> the official checkpoint layout. Fixture checkpoint -> convert -> export gives back
every tensor byte for byte (and the same config.json and tokenizer); transformers loads the export and gives the
same logits as on the source; a FaStar v2 model exports to the same values; bad input fails in one line and
leaves nothing behind."""

from __future__ import annotations

import json

import numpy as np
import pytest
from fst_v2_writer import write_v2

from fastar.cli import main
from fastar.convert import export as X
from fastar.convert.checkpoint import Checkpoint
from fastar.convert.hf import convert
from fastar.convert.names import expected_tensors
from fastar.convert.v2 import FstV2File
from fastar.errors import FastarError


@pytest.fixture(scope="module")
def exported(tiny_ckpt, tmp_path_factory):
    d = tmp_path_factory.mktemp("export")
    fst = convert(tiny_ckpt, d / "tiny.fst", progress=False)
    return tiny_ckpt, fst, X.export(fst, d / "exported", progress=False, shard_size=8 << 20)


def assert_same_checkpoint(src_dir, out_dir):
    a, b = Checkpoint(src_dir), Checkpoint(out_dir)
    assert sorted(a.names()) == sorted(b.names())
    for name in a.names():
        (da, sa, _), (db, sb, _) = a.info(name), b.info(name)
        assert (da, sa) == (db, sb), name
        assert a.read(name).tobytes() == b.read(name).tobytes(), name
    b.validate()
    assert json.loads((out_dir / "config.json").read_text()) == json.loads((src_dir / "config.json").read_text())
    assert b.tokenizer_json() == a.tokenizer_json()


def test_export_gives_back_every_tensor_byte_for_byte(exported):
    src, _, out = exported
    assert_same_checkpoint(src, out)
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) > 1 and all(p.stat().st_size <= (8 << 20) + 65536 for p in shards)
    index = json.loads((out / X.INDEX_FILE).read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}
    assert not list(out.parent.glob(".exported.partial-*"))


def test_dspark_model_round_trips(dspark_ckpt, tmp_path):
    fst = convert(dspark_ckpt, tmp_path / "dspark.fst", progress=False)
    assert_same_checkpoint(dspark_ckpt, X.export(fst, tmp_path / "out", progress=False))


def test_transformers_gives_the_same_logits_on_the_export(exported):
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    src, _, out = exported
    ids = torch.randint(0, 1024, (1, 48), generator=torch.Generator().manual_seed(3))
    logits = []
    for path in (src, out):
        model = transformers.DeepseekV4ForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        with torch.no_grad():
            logits.append(model(ids).logits)
    assert torch.isfinite(logits[0]).all()
    assert torch.equal(logits[0], logits[1])


def test_v2_model_exports_to_the_same_values(tiny_ckpt, tmp_path):
    v2 = write_v2(tiny_ckpt, tmp_path / "tiny.fst")
    out = X.export(v2, tmp_path / "from-v2", progress=False)
    ck = Checkpoint(out)
    ck.validate()
    from fastar.quant import reference as ref

    with FstV2File(v2) as f:
        assert ck.config.num_layer_slots == f.config.num_layer_slots
        for name, (dtype, _) in expected_tensors(f.config).items():
            if name.endswith(".scale") or ".ffn.experts." in name:
                continue
            got = ck.read(name)
            if dtype == "F8_E4M3":
                got = ref.fp8_block_dequant(got, ck.read(name[: -len("weight")] + "scale"))
            elif dtype == "BF16":
                got = ref.bf16_decode(got)
            want = f.tensor(name)
            want = ref.bf16_decode(want) if f.dtype(name) == "BF16" else want
            np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32), err_msg=name)
        for slot in range(f.config.num_layer_slots):
            for e in range(f.config.n_routed_experts):
                pairs = zip(ck.expert(slot, e), f.expert(slot, e), strict=True)
                assert all(np.array_equal(u, v) for u, v in pairs)


def test_bad_input_fails_in_one_line_and_leaves_nothing(exported, tmp_path, monkeypatch, capsys):
    _, fst, out = exported
    with pytest.raises(FastarError, match="no such file"):
        X.export(tmp_path / "missing.fst", tmp_path / "a")
    with pytest.raises(FastarError, match="is a directory"):
        X.export(out, tmp_path / "a")
    with pytest.raises(FastarError, match="already exists"):
        X.export(fst, out)
    junk = tmp_path / "junk.fst"
    junk.write_bytes(b"not a model at all" * 10)
    with pytest.raises(FastarError, match="bad magic"):
        X.export(junk, tmp_path / "a")
    v2 = write_v2(Checkpoint(exported[0]), tmp_path / "noindexer.fst", indexer=False)
    with pytest.raises(FastarError, match="cannot export"):
        X.export(v2, tmp_path / "a")

    calls = []
    real = X._write_shard

    def dies_on_second_shard(*args, **kw):
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk full")
        return real(*args, **kw)

    monkeypatch.setattr(X, "_write_shard", dies_on_second_shard)
    with pytest.raises(FastarError, match=f"writing {tmp_path / 'b'} failed: disk full"):
        X.export(fst, tmp_path / "b", shard_size=8 << 20)
    assert not (tmp_path / "b").exists() and not list(tmp_path.glob(".b.partial-*"))
    monkeypatch.undo()

    assert main(["export", str(tmp_path / "missing.fst"), "-o", str(tmp_path / "c")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("fastar: error:") and err.count("\n") == 1
    assert main(["export", str(fst), "-o", str(tmp_path / "c"), "--shard-size", "4X"]) == 1  # names its flag
    assert (
        capsys.readouterr().err
        == "fastar: error: --shard-size: cannot read '4X' as a size (examples: 24G, 512M, 1000000)\n"
    )
    assert main(["export", str(fst), "-o", str(tmp_path / "c"), "--shard-size", "16M", "--no-progress"]) == 0
    assert (tmp_path / "c" / "config.json").is_file()


def test_a_folder_it_cannot_write_is_named_as_given(exported, tmp_path, monkeypatch):
    """The errors named the temporary `.NAME.partial-PID` folder (or a shard in it), a path the user never gave."""
    import errno

    _, fst, _ = exported
    with pytest.raises(FastarError) as err:
        X.export(fst, "/proc/fastar-export-here")  # a folder in which nothing can be made, whoever runs it
    said = str(err.value)  # (root may write /proc's entry list: the rename says it; others are told before)
    assert said.startswith("/proc/fastar-export-here: ") and "partial" not in said, said
    assert "cannot write (" in said or said.endswith("the directory /proc is not writable"), said

    def full(path, *args, **kw):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(X, "_write_shard", full)
    with pytest.raises(FastarError, match=f"^writing {tmp_path / 'd'} failed: No space left on device$"):
        X.export(fst, tmp_path / "d")
    assert not list(tmp_path.glob(".d.partial-*"))


def test_a_corrupt_expert_or_tensor_is_not_exported(tiny_fst_path, tmp_path, capsys):
    """`export` of a .fst with a flipped byte in an expert record (or a resident tensor, or the tokenizer) wrote it
    into the checkpoint and said nothing: the corruption, past every checksum the .fst had, was in shards no tool
    checks again. The checksums are checked as the file is read now: one line naming the record, nothing left."""
    import shutil

    from fastar.format.reader import FstFile

    with FstFile(tiny_fst_path) as f:
        at = {t["name"]: t["offset"] for t in f.header["tensors"] + f.header["blobs"]}
        at["expert (layer 2, id 3)"] = f.expert_offset(2, 3)
    for label in ("expert (layer 2, id 3)", "layers.1.attn.wkv.weight", "tokenizer.json"):
        bad = tmp_path / "bad.fst"
        shutil.copy(tiny_fst_path, bad)
        with open(bad, "r+b") as fh:
            fh.seek(at[label] + 100)
            byte = fh.read(1)
            fh.seek(at[label] + 100)
            fh.write(bytes([byte[0] ^ 0x40]))
        assert main(["export", str(bad), "-o", str(tmp_path / "out")]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "fails its checksum: the file is corrupt; nothing was exported" in err, err
        assert (label if label.startswith("expert") else repr(label)) in err, err
        assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.fst"]
