"""The `.fst` version 3 container, as code: constants and layout arithmetic that the reader and writer share.

Owns: the byte layout below, the storage dtypes, the expert-record geometry. Imports no torch.
Does not own: reading (`reader.py`), writing (`writer.py`), or what the tensors mean (`fastar.config`).

File layout (all integers little-endian; every region starts at a multiple of ALIGN = 4096 bytes):

  offset            size          field
  0                 4             magic  b"FST\\0"  (shared with FaStar v2; the version tells them apart)
  4                 4             u32 version = 3
  8                 8             u64 header_len: bytes of the JSON header that follows the preamble
  16                8             u64 header_xxh64: xxh64 (seed 0) of those header bytes
  24                8             u64 data_offset: where the first region starts (= align(64 + header_len))
  32                8             u64 file_size: total bytes of a complete file
  40                24            reserved, zero
  64                header_len    JSON header, UTF-8 (see below); then zero padding up to data_offset
  data_offset       ...           resident region: each tensor / blob at its own 4096-aligned offset
  bank.offset       ...           expert bank: slots x experts records of `bank.stride` bytes each
  file_size                       end (the last record is padded to a multiple of ALIGN)

Regions follow each other in the header's order with no holes: each starts at align(end of the previous).

JSON header keys:
  "format": "fastar.fst", "version": 3,
  "converter": {"name", "version"}, "source": {...identity of the checkpoint...},
  "config": ModelConfig.to_dict(),
  "tensors": [{"name", "dtype", "shape", "offset", "nbytes", "xxh64"}, ...]   checkpoint names, verbatim
  "blobs":   [{"name", "offset", "nbytes", "xxh64"}, ...]                        e.g. "tokenizer.json"
  "experts": {"offset", "stride", "slots", "experts", "sections": [{"field", "dtype", "shape", "offset",
              "nbytes"}], "xxh64": [one hex digest per record, slot-major]}
  xxh64 digests are 16 lowercase hex digits.

Storage dtypes (checkpoint precision, never requantized):
  F8_E4M3 (1 B, e4m3fn bits)   F8_E8M0 (1 B, UE8M0 scale)   BF16 (2 B bits)   F32 (4 B)   I64 (8 B)
  FP4X2 (1 B holding two e2m1 codes: low nibble = even column, high nibble = odd column; bit 3 = sign)

Expert record for (slot, e) at  bank.offset + (slot * experts + e) * stride ; slots 0..L-1 are the main
layers, L.. the MTP/DSpark blocks. Sections, each at a 64-byte-aligned offset inside the record, in order:
  w1 FP4X2 [I, D/2]  gate rows, row-major        w1_scale F8_E8M0 [I, D/32]   one scale per 32 columns
  w3 FP4X2 [I, D/2]  up                          w3_scale F8_E8M0 [I, D/32]
  w2 FP4X2 [D, I/2]  down                        w2_scale F8_E8M0 [D, I/32]
For Flash (D = 4096, I = 2048) the sections are 4 MiB, 256 KiB, 4 MiB, 256 KiB, 4 MiB, 256 KiB and the stride
is 13,369,344 bytes = 3264 pages, no padding. The record's xxh64 covers all `stride` bytes (padding is zero).
"""

from __future__ import annotations

import math

MAGIC = b"FST\x00"
VERSION = 3
PREAMBLE_SIZE = 64
PREAMBLE_FMT = "<4sIQQQQ24x"
ALIGN = 4096
SECTION_ALIGN = 64
MAX_HEADER_SIZE = 64 * 1024 * 1024
FORMAT_NAME = "fastar.fst"

# storage dtype -> bytes per stored element
DTYPE_SIZES: dict[str, int] = {
    "F8_E4M3": 1,
    "F8_E8M0": 1,
    "FP4X2": 1,
    "BF16": 2,
    "F32": 4,
    "I64": 8,
}
# storage dtype -> numpy dtype of the raw view (see fastar.weights.source)
NUMPY_DTYPES: dict[str, str] = {
    "F8_E4M3": "uint8",
    "F8_E8M0": "uint8",
    "FP4X2": "uint8",
    "BF16": "uint16",
    "F32": "float32",
    "I64": "int64",
}
# checkpoint (safetensors) dtype -> storage dtype; packed FP4 arrives as I8
FROM_SAFETENSORS: dict[str, str] = {
    "F8_E4M3": "F8_E4M3",
    "F8_E8M0": "F8_E8M0",
    "BF16": "BF16",
    "F32": "F32",
    "I64": "I64",
    "I8": "FP4X2",
}

EXPERT_FIELDS = ("w1", "w1_scale", "w3", "w3_scale", "w2", "w2_scale")


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def nbytes_of(dtype: str, shape: list[int] | tuple[int, ...]) -> int:
    return DTYPE_SIZES[dtype] * math.prod(shape)


def expert_sections(hidden: int, inter: int) -> list[dict]:
    """The six sections of one expert record (field, dtype, shape, offset inside the record, nbytes)."""
    shapes = {
        "w1": ("FP4X2", [inter, hidden // 2]),
        "w1_scale": ("F8_E8M0", [inter, hidden // 32]),
        "w3": ("FP4X2", [inter, hidden // 2]),
        "w3_scale": ("F8_E8M0", [inter, hidden // 32]),
        "w2": ("FP4X2", [hidden, inter // 2]),
        "w2_scale": ("F8_E8M0", [hidden, inter // 32]),
    }
    out, off = [], 0
    for f in EXPERT_FIELDS:
        dt, shape = shapes[f]
        off = align(off, SECTION_ALIGN)
        n = nbytes_of(dt, shape)
        out.append({"field": f, "dtype": dt, "shape": shape, "offset": off, "nbytes": n})
        off += n
    return out


def expert_stride(sections: list[dict]) -> int:
    last = sections[-1]
    return align(last["offset"] + last["nbytes"])


def expert_offset(bank_offset: int, stride: int, experts: int, slot: int, e: int) -> int:
    return bank_offset + (slot * experts + e) * stride
