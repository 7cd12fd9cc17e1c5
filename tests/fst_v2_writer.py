"""Test-side writer of FaStar `.fst` version 2 files and sidecars, from an official-format checkpoint.

Follows the layout in `fastar/convert/v2.py`'s docstring (and FaStar's `scripts/fst_converter.py`
`convert_full_model_v4`, `convert_hc_only`, `convert_norm_only`) on its own: its constants are spelled out here,
not imported from `fastar.convert.v2`, so the reader is tested against an independent reading of the spec. Used only
by tests.

What it writes, like the original converter:
- main `X.fst`: globals (TID 0 embed, 1 final norm, 2 head, 40 compress ratios), per layer the norms (TIDs 3, 4,
  14, 15; "stale" = divided by 40 like the early converter, so tests see the sidecar win), Q/KV/O projections
  (5/0 wq_a, 5/1 wq_b, 6 wkv, 8/0 wo_a, 8/1 wo_b), router (9) and bias (10, F32, non-hash layers), shared expert
  (11/12/13), compressor (32-35), and the expert bank of 17-byte MXFP4 blocks (gate, up, down).
  FP8 weights are dequantized to float32 and stored BF16 by truncation (`bits >> 16`), as FaStar did, but
  with a correct e4m3 decoder (FaStar's zeroes exponent field 15).
- `indexer=True` adds the lightning indexer under the fastar extension TIDs 41-46 (FaStar never wrote it).
- `X.fst.hc`: TIDs 23-28 per layer and 29-31 global (fn BF16-truncated [24, 4d], scale/base F32), no bank.
- `X.fst.norm`: TID 1 global, TIDs 3, 4, 14, 15 (BF16) and 22 (attn_sink, F32) per layer, no bank.
- `X.fst.tid2eid`: raw int32 [hash layers][vocab][top_k].
Sidecar headers carry placeholder fields (q_heads = hidden/128, kv_heads 4, head_dim 128, no bank), as FaStar's.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from fastar.convert.checkpoint import Checkpoint
from fastar.quant import reference as ref

HEADER_FMT = "<4sIIIIIIIIIIIQffQQQQQQQQ"  # 128 bytes
ENTRY_FMT = "<IHHHHIQQQQQQ"  # 64 bytes
PAGE = 4096
GLOBAL = 0xFFFF
QTYPES = {"Q8_0": 1, "BF16": 2, "F32": 3, "MXFP4": 4}
FLASH_BLOCK_BYTES = 13_369_344  # what FaStar's sidecar headers carry whatever the model

GLOBALS = {
    "embed.weight": (0, 0),
    "norm.weight": (1, 0),
    "head.weight": (2, 0),
    "hc_head_fn": (29, 0),
    "hc_head_scale": (30, 0),
    "hc_head_base": (31, 0),
}
LAYER = {
    "attn_norm.weight": (3, 0),
    "ffn_norm.weight": (4, 0),
    "attn.wq_a.weight": (5, 0),
    "attn.wq_b.weight": (5, 1),
    "attn.wkv.weight": (6, 0),
    "attn.wo_a.weight": (8, 0),
    "attn.wo_b.weight": (8, 1),
    "ffn.gate.weight": (9, 0),
    "ffn.gate.bias": (10, 0),
    "ffn.shared_experts.w1.weight": (11, 0),
    "ffn.shared_experts.w3.weight": (12, 0),
    "ffn.shared_experts.w2.weight": (13, 0),
    "attn.q_norm.weight": (14, 0),
    "attn.kv_norm.weight": (15, 0),
    "attn.attn_sink": (22, 0),
    "hc_attn_fn": (23, 0),
    "hc_attn_scale": (24, 0),
    "hc_attn_base": (25, 0),
    "hc_ffn_fn": (26, 0),
    "hc_ffn_scale": (27, 0),
    "hc_ffn_base": (28, 0),
    "attn.compressor.ape": (32, 0),
    "attn.compressor.wkv.weight": (33, 0),
    "attn.compressor.wgate.weight": (34, 0),
    "attn.compressor.norm.weight": (35, 0),
    "attn.indexer.wq_b.weight": (41, 0),
    "attn.indexer.weights_proj.weight": (42, 0),
    "attn.indexer.compressor.ape": (43, 0),
    "attn.indexer.compressor.wkv.weight": (44, 0),
    "attn.indexer.compressor.wgate.weight": (45, 0),
    "attn.indexer.compressor.norm.weight": (46, 0),
}
NORMS = {"attn_norm.weight", "ffn_norm.weight", "attn.q_norm.weight", "attn.kv_norm.weight"}
HC = {"hc_attn_fn", "hc_attn_scale", "hc_attn_base", "hc_ffn_fn", "hc_ffn_scale", "hc_ffn_base"}


def align_up(x: int) -> int:
    return (x + PAGE - 1) // PAGE * PAGE


def bf16_truncate(x: np.ndarray) -> np.ndarray:
    """float32 -> BF16 bits by truncation (FaStar's `_bf16_bytes`)."""
    return (np.ascontiguousarray(x, np.float32).view(np.uint32) >> 16).astype(np.uint16)


def q8_0_encode(x: np.ndarray) -> bytes:
    """FaStar `quantize_q8_0`: planar, all fp16 scales (absmax/127) then all int8 blocks of 32."""
    a = np.ascontiguousarray(x, np.float32).ravel()
    nb = -(-a.size // 32)
    pad = np.zeros(nb * 32, np.float32)
    pad[: a.size] = a
    blocks = pad.reshape(nb, 32)
    scale = np.abs(blocks).max(axis=1) / 127.0
    scale[scale < 1e-12] = 0.0
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.round(blocks / safe[:, None]), -127, 127).astype(np.int8)
    return scale.astype(np.float16).tobytes() + q.tobytes()


def mxfp4_blocks(packed: np.ndarray, scale: np.ndarray) -> bytes:
    """Checkpoint FP4 ([rows, cols/2] low nibble first) + UE8M0 [rows, cols/32] -> [rows][cols/32][17] bytes."""
    rows, groups = scale.shape
    b = np.concatenate([scale.reshape(rows, groups, 1), packed.reshape(rows, groups, 16)], axis=2)
    return b.astype(np.uint8).tobytes()


def mxfp4_encode(x: np.ndarray) -> bytes:
    """A float matrix to MXFP4 dense blocks (DeepSeek's per-32 rule via fastar.quant.reference)."""
    packed, scale = ref.fp4_encode(np.asarray(x, np.float32))
    return mxfp4_blocks(packed, scale)


class _Container:
    """Collects (tid, layer, sub, qtype, shape, bytes) and writes FaStar's layout: header page, directory,
    4096-aligned data, optional expert bank, file truncated to a page multiple, header written last."""

    def __init__(self) -> None:
        self.entries: list[tuple[int, int, int, int, tuple[int, ...], bytes]] = []

    def add(self, tid: int, layer: int, sub: int, qtype: str, shape, data: bytes) -> None:
        self.entries.append((tid, layer, sub, QTYPES[qtype], tuple(int(s) for s in shape), bytes(data)))

    def write(self, path: Path, header: dict, bank=None) -> None:
        dir_off = align_up(struct.calcsize(HEADER_FMT))
        data_off = align_up(dir_off + len(self.entries) * struct.calcsize(ENTRY_FMT))
        with open(path, "wb") as f:
            f.write(b"\0" * data_off)
            dirs = []
            for tid, lid, sub, qt, shape, data in self.entries:
                off = align_up(f.tell())
                f.seek(off)
                f.write(data)
                s3 = (shape + (1, 1, 1))[:3]
                dirs.append(struct.pack(ENTRY_FMT, tid, lid, sub, qt, len(shape), 0, *s3, off, len(data), 0))
            bank_off = align_up(f.tell())
            f.seek(dir_off)
            f.write(b"".join(dirs))
            count = 0
            if bank is not None:
                stride, blocks = bank
                for i, blk in enumerate(blocks):
                    f.seek(bank_off + i * stride)
                    f.write(blk)
                    count += 1
            f.seek(0, 2)
            f.truncate(align_up(f.tell()))
            h = dict(header, sdo=dir_off, sdc=len(self.entries), eo=bank_off, et=count)
            f.seek(0)
            f.write(
                struct.pack(
                    HEADER_FMT,
                    b"FST\x00",
                    2,
                    h["hd"],
                    h["nl"],
                    h["ne"],
                    h["tk"],
                    h["qh"],
                    h["kh"],
                    h["hd2"],
                    h["id"],
                    h["ns"],
                    0,
                    h["vs"],
                    h["re"],
                    h["rf"],
                    h["sdo"],
                    h["sdc"],
                    h["eo"],
                    h["eb"],
                    h["es"],
                    h["et"],
                    h.get("r1", 0),
                    h.get("r2", 0),
                )
            )


def _stored(ck: Checkpoint, name: str, qtype: str, stale: bool = False) -> tuple[tuple[int, ...], bytes, str]:
    """(shape, bytes, qtype) of one official tensor as FaStar stores it."""
    dtype = ck.dtype(name)
    a = ck.read(name)
    if dtype == "F8_E4M3":
        x = ref.fp8_block_dequant(a, ck.read(name[: -len("weight")] + "scale"))
    elif dtype == "BF16":
        x = ref.bf16_decode(a)
    else:
        x = a.astype(np.float32)
    if stale:
        x = x / 40.0
    if qtype == "BF16":
        return x.shape, bf16_truncate(x).tobytes(), qtype
    if qtype == "F32":
        return x.shape, x.astype(np.float32).tobytes(), qtype
    if qtype == "Q8_0":
        return x.shape, q8_0_encode(x), qtype
    return x.shape, mxfp4_encode(x), qtype


def _default_qtype(name: str) -> str:
    leaf = name.rsplit(".", 1)[-1]
    f32 = leaf in ("attn_sink", "ape", "bias") or leaf.endswith(("_scale", "_base"))
    return "F32" if f32 else "BF16"


def write_v2(
    src: str | Path | Checkpoint,
    out: str | Path,
    *,
    indexer: bool = True,
    norms_in_main: str | None = "stale",
    hc_in_main: bool = False,
    qtypes: dict[str, str] | None = None,
    drop: set[str] | frozenset = frozenset(),
    header: dict | None = None,
    sidecars: tuple[str, ...] = ("hc", "norm", "tid2eid"),
) -> Path:
    """Write `out` (+ sidecars `out.hc`, `out.norm`, `out.tid2eid`) from checkpoint `src`; returns `out`.

    norms_in_main: "stale" (norms / 40, the early converter's bug), "exact", or None (not in the main file).
    hc_in_main: also put the HC tensors in the main file (the current converter does). qtypes: storage type per
    official name ("BF16", "F32", "Q8_0", "MXFP4"). drop: official names to leave out. header: fields to
    override (keys hd, nl, ne, tk, qh, kh, hd2, id, ns, vs, re, rf, eb, es, r1, r2). sidecars: which to write.
    """
    ck = src if isinstance(src, Checkpoint) else Checkpoint(src)
    cfg = ck.config
    out = Path(out)
    qtypes = qtypes or {}
    n, d, inter = cfg.num_hidden_layers, cfg.hidden_size, cfg.moe_intermediate_size
    main, hc, norm = _Container(), _Container(), _Container()

    def put(c: _Container, name: str, tid: int, lid: int, sub: int, stale: bool = False) -> None:
        if name in drop:
            return
        shape, data, qt = _stored(ck, name, qtypes.get(name, _default_qtype(name)), stale)
        c.add(tid, lid, sub, qt, shape, data)

    for name in ("embed.weight", "norm.weight", "head.weight"):
        if name != "norm.weight" or norms_in_main:
            put(main, name, GLOBALS[name][0], GLOBAL, 0, stale=name == "norm.weight" and norms_in_main == "stale")
    if "compress_ratios" not in drop:
        r = np.asarray(cfg.compress_ratios[:n], np.float32)
        main.add(40, GLOBAL, 0, "F32", r.shape, r.tobytes())
    for name in ("hc_head_fn", "hc_head_scale", "hc_head_base"):
        put(hc, name, GLOBALS[name][0], GLOBAL, 0)
        if hc_in_main:
            put(main, name, GLOBALS[name][0], GLOBAL, 0)
    put(norm, "norm.weight", 1, GLOBAL, 0)
    for L in range(n):
        p = f"layers.{L}."
        for suffix, (tid, sub) in LAYER.items():
            name = p + suffix
            if not ck.has(name) or (suffix.startswith("attn.indexer.") and not indexer):
                continue
            if suffix in HC:
                put(hc, name, tid, L, sub)
                if hc_in_main:
                    put(main, name, tid, L, sub)
            elif suffix in NORMS or suffix == "attn.attn_sink":
                put(norm, name, tid, L, sub)
                if norms_in_main and suffix != "attn.attn_sink":
                    put(main, name, tid, L, sub, stale=norms_in_main == "stale")
            else:
                put(main, name, tid, L, sub)

    block = 2 * inter * (d // 32) * 17 + d * (inter // 32) * 17
    stride = align_up(block)
    blocks = []
    for L in range(n):
        for e in range(cfg.n_routed_experts):
            x = ck.expert(L, e)
            blocks.append(
                mxfp4_blocks(x.w1, x.w1_scale) + mxfp4_blocks(x.w3, x.w3_scale) + mxfp4_blocks(x.w2, x.w2_scale)
            )
    h = {
        "hd": d,
        "nl": n,
        "ne": cfg.n_routed_experts,
        "tk": cfg.num_experts_per_tok,
        "qh": cfg.num_attention_heads,
        "kh": cfg.num_key_value_heads,
        "hd2": cfg.head_dim,
        "id": inter,
        "ns": cfg.n_shared_experts,
        "vs": cfg.vocab_size,
        "re": cfg.rms_norm_eps,
        "rf": cfg.rope_theta,
        "eb": block,
        "es": stride,
    }
    h.update(header or {})
    main.write(out, h, bank=(h["es"], blocks))
    side = {
        "hd": d,
        "nl": n,
        "ne": cfg.n_routed_experts,
        "tk": cfg.num_experts_per_tok,
        "qh": d // 128,
        "kh": 4,
        "hd2": 128,
        "id": 0,
        "ns": 1,
        "vs": cfg.vocab_size,
        "re": 1e-6,
        "rf": 10000.0,
        "eb": FLASH_BLOCK_BYTES,
        "es": FLASH_BLOCK_BYTES,
    }
    if "hc" in sidecars:
        hc.write(Path(f"{out}.hc"), side)
    if "norm" in sidecars:
        norm.write(Path(f"{out}.norm"), side)
    if "tid2eid" in sidecars:
        t = np.stack([ck.read(f"layers.{L}.ffn.gate.tid2eid") for L in range(cfg.num_hash_layers)])
        t.astype("<i4").tofile(f"{out}.tid2eid")
    return out
