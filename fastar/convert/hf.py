"""`fastar convert`: the official DeepSeek-V4 checkpoint (a directory or a hub id) -> one `.fst` v3 file.

Owns: the conversion order and its progress report. Lossless: every tensor is copied in checkpoint precision
(FP8 + UE8M0 scales, BF16, F32, I64; packed FP4 experts byte for byte into the expert bank), so dequantizing
any tensor of the `.fst` gives exactly the checkpoint's values. Also FaStar v2 -> v3 (`convert_v2`) and the
`.fst.indexer` sidecar (`convert_indexer`: only the lightning-indexer tensors, which v2 files lack).
Does not own: checkpoint parsing and validation (`checkpoint.py`), the name manifest (`names.py`), the
container layout (`fastar.format`).

Memory: tensors are streamed one at a time, the next one read on another thread while this one is written (the
largest, the embedding, is ~1 GB on Flash); experts one record (13 MB) at a time, likewise. The output is
written to `OUT.partial` and renamed only when complete. An existing output is refused before the source is read
(or downloaded) unless `force=True` (`fastar.outputs.refuse_existing_output`, the command line's `--force`).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from .. import __version__
from ..config import ModelConfig
from ..contracts import ExpertWeights
from ..errors import CheckpointError, FormatError
from ..format import spec
from ..format.writer import FstWriter
from ..outputs import refuse_existing_output
from .checkpoint import INDEX_FILE, Checkpoint
from .names import expected_tensors, is_routed_expert

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_source(src: str | os.PathLike, only: Callable[[str], bool] | None = None) -> Path:
    """A local checkpoint directory, or a hub id fetched through huggingface_hub (honours HF_HOME): the json
    files and every shard, or with `only` just the shards holding a tensor name it accepts."""
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
        patterns = ["*.json"]
        if only is None:
            patterns.append("*.safetensors")
        else:
            index = Path(snapshot_download(str(src), allow_patterns=patterns)) / INDEX_FILE
            patterns += sorted({s for n, s in json.loads(index.read_text())["weight_map"].items() if only(n)})
        return Path(snapshot_download(str(src), allow_patterns=patterns))
    except Exception as e:  # network, auth, missing repo: all end the same way for the user
        reason = " ".join(str(e).split()) or type(e).__name__  # the hub's messages run over several lines
        raise CheckpointError(f"could not fetch {src} from the hub: {reason}") from None


def checkpoint_files(ck: Checkpoint) -> list[Path]:
    """The files of a checkpoint directory a conversion reads: its shards and its json (config, index, tokenizer)."""
    return [ck.path / name for name in ck.shard_names] + sorted(ck.path.glob("*.json"))


def local_files(src: str | os.PathLike) -> list[Path]:
    """The files a local source names, without reading any: a directory's entries, or a FaStar v2 file and its
    sidecars; none for a hub id. For `check_output` before the source is opened (the command line asks it before
    refusing an existing output, so the output named as one of these is said as what it is)."""
    p = Path(src)
    if p.is_dir():
        return sorted(p.iterdir())
    return [p, *(Path(f"{src}.{kind}") for kind in ("hc", "norm", "tid2eid", "indexer"))] if p.exists() else []


def check_output(out: str | os.PathLike, inputs: Iterable[Path]) -> None:
    """Refuse an output that is one of the files being converted: renamed into place once written, it would replace
    that file (a shard, the config, a v2 model; or the blob a hub snapshot's link points to), and with it the source
    it was made from."""
    o = Path(out)
    if not os.path.lexists(o):
        return
    target = o.parent.resolve() / o.name  # the directory entry the rename replaces
    for f in inputs:
        if os.path.lexists(f) and target in (f.parent.resolve() / f.name, f.resolve()):
            raise CheckpointError(
                f"{out} is {f.name}, a file of the model being converted: write the output elsewhere "
                "(it would replace that file)"
            )


def _refuse_output(src: str | os.PathLike, out: str | os.PathLike, force: bool) -> None:
    """Before anything of `src` is read: `out` naming one of its local files is said as that (with `force` too),
    then an existing `out` is refused unless `force` (OutputExists)."""
    check_output(out, local_files(src))
    refuse_existing_output(out, force)


def convert(
    src: str | os.PathLike, out: str | os.PathLike, progress: bool | None = None, *, force: bool = False
) -> Path:
    """Convert `src` into `out` and return the path. Raises CheckpointError/FormatError with a clear message, and
    OutputExists (a FileExistsError) when `out` exists and not `force` (with it, the old file is replaced only once
    the new one is complete).

    `src` may also be a FaStar v2 `.fst` (with its sidecars next to it): see `convert_v2`."""
    from .v2 import read_version

    _refuse_output(src, out, force)  # before the checkpoint is read (or downloaded): ~160 GB on Flash
    if Path(src).is_file() and read_version(src) == 2:
        return convert_v2(src, out, progress, force=True)  # (checked just now)
    ck = Checkpoint(resolve_source(src))
    check_output(out, checkpoint_files(ck))
    ck.validate()
    cfg = ck.config

    def planned(name: str) -> tuple[str, str, tuple[int, ...]]:
        dtype, shape, _ = ck.info(name)
        return name, spec.FROM_SAFETENSORS[dtype], shape

    resident = [planned(n) for n in expected_tensors(cfg) if not is_routed_expert(n)]
    return _write(out, cfg, ck.identity(), resident, ck.read, ck.tokenizer_json(), ck.expert, progress)


def convert_v2(
    src: str | os.PathLike, out: str | os.PathLike, progress: bool | None = None, *, force: bool = False
) -> Path:
    """A FaStar v2 model (`src` + `.hc`, `.norm`, `.tid2eid` sidecars, and `.indexer` when present) -> one `.fst`
    v3 file.

    Every tensor is copied as `FstV2File` presents it (dense weights BF16 as v2 stored them, sidecar norms, HC,
    the hash table as I64, the indexer sidecar's FP8 + scales), the 17-byte MXFP4 expert blocks repacked
    losslessly, and the V4 tokenizer embedded. A v2 model without the indexer is refused: a v3 file is complete.
    An existing `out` is refused unless `force`, as `convert` does.
    """
    from .v2 import FstV2File

    _refuse_output(src, out, force)
    with FstV2File(src) as v2:
        if v2.context_note is not None:
            raise FormatError(f"cannot convert: {v2.context_note}; then convert again (or run {src} as it is)")
        tensors = [(n, v2.dtype(n), v2.shape(n)) for n in v2.names()]
        return _write(out, v2.config, v2.identity(), tensors, v2.tensor, v2.tokenizer_json(), v2.expert, progress)


def _is_indexer(name: str) -> bool:
    return ".attn.indexer." in name


def convert_indexer(
    src: str | os.PathLike, out: str | os.PathLike, progress: bool | None = None, *, force: bool = False
) -> Path:
    """The lightning-indexer tensors (`layers.*.attn.indexer.*`, FP8 + scales as stored) of an official checkpoint
    -> a small `.fst` v3 file without experts: the `X.fst.indexer` sidecar that FaStar v2 models lack.

    Reads config.json, the index and only the shards that hold those tensors (other shards may be absent; a
    hub id downloads just those). Raises CheckpointError naming the missing shards or the wrong tensor, and
    OutputExists when `out` exists and not `force`, as `convert` does.
    """
    _refuse_output(src, out, force)
    ck = Checkpoint(resolve_source(src, only=_is_indexer))
    check_output(out, checkpoint_files(ck))
    cfg = ck.config
    want = {n: v for n, v in expected_tensors(cfg).items() if _is_indexer(n)}
    if not want:
        raise CheckpointError(f"{ck.path}: the model has no ratio-4 layers, hence no lightning indexer")
    absent = [n for n in want if not ck.has(n)]
    if absent:
        raise CheckpointError(f"missing tensor {absent[0]} (the index of {ck.path} places it in no shard)")
    shards = sorted({ck.shard_of(n) for n in want})
    lost = [s for s in shards if not (ck.path / s).is_file()]
    if lost:
        raise CheckpointError(
            f"{ck.path} lacks shard(s) {', '.join(lost)}: the indexer tensors are in "
            f"{', '.join(shards)} (only those shards are needed)"
        )
    for n, (dtype, shape) in want.items():  # `Checkpoint.validate` for these tensors only
        got, got_shape, shard = ck.info(n)
        if (got, got_shape) != (dtype, shape):
            raise CheckpointError(
                f"tensor {n} in shard {shard.name}: {got} {list(got_shape)}, expected {dtype} {list(shape)}"
            )
    source = dict(ck.identity(), contents="layers.*.attn.indexer.* only (a FaStar v2 model's .fst.indexer sidecar)")
    tensors = [(n, spec.FROM_SAFETENSORS[dtype], shape) for n, (dtype, shape) in want.items()]
    return _write(out, cfg, source, tensors, ck.read, progress=progress)


def _check_tokenizer(tok: bytes) -> None:
    """The tokenizer.json to embed must load as the V4 tokenizer, or `run` would fail only after conversion."""
    import tokenizers  # the library, not fastar.engine's wrapper: convert sits below the engine

    from ..encoding import BOS, EOS

    try:
        hf = tokenizers.Tokenizer.from_buffer(tok)
        if hf.token_to_id(BOS) is None or hf.token_to_id(EOS) is None:
            raise ValueError("no DeepSeek BOS/EOS tokens")
    except Exception as err:  # the tokenizers library raises its own Exception types for a malformed file
        reason = str(err).splitlines()[0][:200] if str(err) else type(err).__name__
        raise FormatError(f"tokenizer.json: not a usable DeepSeek-V4 tokenizer ({reason})") from None


def _write(
    out: str | os.PathLike,
    cfg: ModelConfig,
    source: dict,
    tensors: list[tuple[str, str, tuple[int, ...]]],
    read: Callable[[str], np.ndarray],
    tok: bytes | None = None,
    expert: Callable[[int, int], ExpertWeights] | None = None,
    progress: bool | None = None,
) -> Path:
    """One `.fst` v3 file: `tensors` [(name, storage dtype, shape)] as `read(name)` gives them, the tokenizer
    blob, and with `expert` ((slot, e) -> ExpertWeights) the whole expert bank (without it, no bank)."""
    if tok is not None:
        _check_tokenizer(tok)
    w = FstWriter(out, cfg.to_dict(), source=source, converter_version=__version__)
    with w:
        for name, dtype, shape in tensors:
            w.add_tensor(name, dtype, shape)
        if tok is not None:
            w.add_blob("tokenizer.json", len(tok))
        if expert is not None:
            w.set_expert_bank(cfg.num_layer_slots, cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size)
        w.begin()
        bar = _progress(w.file_size, f"converting to {Path(out).name}", progress)
        slots = range(cfg.num_layer_slots if expert is not None else 0)
        records = [(slot, e) for slot in slots for e in range(cfg.n_routed_experts)]
        try:
            for name, a in _read_ahead([(name, lambda n=name: read(n)) for name, _, _ in tensors]):
                w.write_tensor(name, a)
                bar.update(w.bytes_written - bar.n)
            if tok is not None:
                w.write_tensor("tokenizer.json", tok)
            for (slot, e), parts in _read_ahead([(r, lambda r=r: expert(*r)) for r in records]):
                w.write_expert(slot, e, parts)
                bar.update(w.bytes_written - bar.n)
        finally:
            bar.close()
        return w.finish()


def _read_ahead(jobs: list[tuple[Any, Callable[[], Any]]]) -> Iterator[tuple[Any, Any]]:
    """(key, load()) for each job in order, each load run on a thread of its own while the caller writes the one
    before (the reads release the GIL, as the writer's do): the next tensor comes off the disk during this one's
    write. One load ahead, so at most two tensors are held (the embedding, ~1 GB, is the largest)."""
    with ThreadPoolExecutor(1, thread_name_prefix="convert-read") as pool:
        ahead = pool.submit(jobs[0][1]) if jobs else None
        for i, (key, _) in enumerate(jobs):
            got = ahead.result()
            ahead = pool.submit(jobs[i + 1][1]) if i + 1 < len(jobs) else None
            yield key, got


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

    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=desc, file=sys.stderr, mininterval=0.5)


def timed_convert(src, out) -> tuple[Path, float]:
    t = time.perf_counter()
    p = convert(src, out)
    return p, time.perf_counter() - t
