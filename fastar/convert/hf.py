"""`fastar convert`: the official DeepSeek-V4 checkpoint (a directory or a hub id) -> one `.fst` v3 file.

Owns: the conversion order and its progress report. Lossless: every tensor is copied in checkpoint precision
(FP8 + UE8M0 scales, BF16, F32, I64; packed FP4 experts byte for byte into the expert bank), so dequantizing
any tensor of the `.fst` gives exactly the checkpoint's values.
Does not own: checkpoint parsing and validation (`checkpoint.py`), the name manifest (`names.py`), the
container layout (`fastar.format`).

Memory: tensors are streamed one at a time (the largest, the embedding, is ~1 GB on Flash); experts one
record (13 MB) at a time. The output is written to `OUT.partial` and renamed only when complete.
"""
from __future__ import annotations

import os
import re
import sys
import time
from pathlib import Path

from .. import __version__
from ..errors import CheckpointError
from ..format import spec
from ..format.writer import FstWriter
from .checkpoint import Checkpoint
from .names import expected_tensors, is_routed_expert

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_source(src: str | os.PathLike) -> Path:
    """A local checkpoint directory, or a hub id fetched through huggingface_hub (honours HF_HOME)."""
    p = Path(src)
    if p.exists():
        if not p.is_dir():
            raise CheckpointError(f"{p}: expected a checkpoint directory (config.json + safetensors shards)")
        return p
    if not _HUB_ID.match(str(src)):
        raise CheckpointError(f"{src}: no such directory")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise CheckpointError(f"{src} is not a local directory and huggingface_hub is not installed") from None
    try:
        return Path(snapshot_download(str(src), allow_patterns=["*.json", "*.safetensors"]))
    except Exception as e:  # network, auth, missing repo: all end the same way for the user
        raise CheckpointError(f"could not fetch {src} from the hub: {e}") from None


def convert(src: str | os.PathLike, out: str | os.PathLike, progress: bool | None = None) -> Path:
    """Convert `src` into `out` and return the path. Raises CheckpointError/FormatError with a clear message.

    `src` may also be a FaStar v2 `.fst` (with its sidecars next to it): see `convert_v2`."""
    from ..format.v2 import read_version

    if Path(src).is_file() and read_version(src) == 2:
        return convert_v2(src, out, progress)
    ck = Checkpoint(resolve_source(src))
    ck.validate()
    cfg = ck.config
    resident = [n for n in expected_tensors(cfg) if not is_routed_expert(n)]
    tok = ck.tokenizer_json()

    w = FstWriter(out, cfg.to_dict(), source=ck.identity(), converter_version=__version__)
    with w:
        for name in resident:
            dtype, shape, _ = ck.info(name)
            w.add_tensor(name, spec.FROM_SAFETENSORS[dtype], shape)
        if tok is not None:
            w.add_blob("tokenizer.json", len(tok))
        w.set_expert_bank(cfg.num_layer_slots, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        w.begin()
        total = w.file_size
        bar = _progress(total, f"converting to {Path(out).name}", progress)
        try:
            for name in resident:
                w.write_tensor(name, ck.read(name))
                bar.update(w.bytes_written - bar.n)
            if tok is not None:
                w.write_tensor("tokenizer.json", tok)
            for slot in range(cfg.num_layer_slots):
                for e in range(cfg.n_routed_experts):
                    w.write_expert(slot, e, ck.expert(slot, e))
                    bar.update(w.bytes_written - bar.n)
        finally:
            bar.close()
        return w.finish()


def convert_v2(src: str | os.PathLike, out: str | os.PathLike, progress: bool | None = None) -> Path:
    """A FaStar v2 model (`src` + `.hc`, `.norm`, `.tid2eid` sidecars) -> one `.fst` v3 file.

    Every tensor is copied as `FstV2File` presents it (dense weights BF16 as v2 stored them, sidecar norms, HC,
    the hash table as I64), the 17-byte MXFP4 expert blocks repacked losslessly, and the V4 tokenizer embedded.
    """
    from ..format.v2 import FstV2File

    with FstV2File(src) as v2:
        cfg, names, tok = v2.config, v2.names(), v2.tokenizer_json()
        w = FstWriter(out, cfg.to_dict(), source=v2.identity(), converter_version=__version__)
        with w:
            for name in names:
                w.add_tensor(name, v2.dtype(name), v2.shape(name))
            if tok is not None:
                w.add_blob("tokenizer.json", len(tok))
            w.set_expert_bank(cfg.num_layer_slots, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
            w.begin()
            bar = _progress(w.file_size, f"converting to {Path(out).name}", progress)
            try:
                for name in names:
                    w.write_tensor(name, v2.tensor(name))
                    bar.update(w.bytes_written - bar.n)
                if tok is not None:
                    w.write_tensor("tokenizer.json", tok)
                for slot in range(cfg.num_layer_slots):
                    for e in range(cfg.n_routed_experts):
                        w.write_expert(slot, e, v2.expert(slot, e))
                        bar.update(w.bytes_written - bar.n)
            finally:
                bar.close()
            return w.finish()


class _NoBar:
    n = 0

    def update(self, k: int) -> None:
        self.n += k

    def close(self) -> None:
        pass


def _progress(total: int, desc: str, enabled: bool | None):
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return _NoBar()
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=desc, file=sys.stderr,
                mininterval=0.5)


def timed_convert(src, out) -> tuple[Path, float]:
    t = time.perf_counter()
    p = convert(src, out)
    return p, time.perf_counter() - t
