"""The one weight-product interface the model calls: resident weights kept in checkpoint precision, and routed
experts fetched by (layer slot, expert id).

Owns:
- `Linear`: one resident weight exactly as stored (FP8 e4m3 bits + 128x128 UE8M0 scales, BF16, or F32) and its
  product `y = x @ W^T` in float32. Nothing is widened in memory: the torch reference path dequantizes a bounded
  block of rows per call (no cache), the fast path hands the stored bytes to `fastar.quant.kernels`.
- `Weights`: typed access to a `WeightSource` by official tensor name (`linear`, `vector`, `table`).
- `SourceExperts`: the default expert provider (`get(layer, e) -> ExpertWeights`, straight from the source, no
  paging); the expert pager replaces it (both implement `fastar.contracts.ExpertProvider`).
- `expert_ffn`: one routed expert (FP4 weights) applied to the tokens routed to it; `experts_ffn`: all of a chunk's
  experts in one fused call.
Does not own: activation quantization for the `official` numerics (the model applies `fastar.model.ops`
simulations to the inputs; `expert_ffn` takes the mid-activation hook as an argument) nor the choice of
which weights exist (the model asks by name).

Kernel path: used when `kernels=True` and `fastar.quant.kernels.available()` (the fused expert kernel only
without an activation hook; with one, three FP4 products with the hook between them); results agree with the
torch reference within float32 accumulation-order error.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import numpy as np
import torch

from ..contracts import ExpertWeights, Unpaged, WeightSource
from .reference import FP4_GROUP, FP4_VALUES, FP8_BLOCK

ROW_BLOCK = 4096  # rows dequantized at once by the reference path (bounds its temporaries)

_FP4_LUT = {torch.device("cpu"): torch.from_numpy(FP4_VALUES)}  # device -> float32 [16], by code


def _kernels():
    """The C kernels module when it is built and usable, else None."""
    try:
        from . import kernels
    except (ImportError, OSError):  # pragma: no cover - a broken build: the torch path still answers
        return None
    return kernels if kernels.available() else None


def _as_torch(a: np.ndarray | torch.Tensor) -> torch.Tensor:
    """Zero-copy view of a (possibly read-only, memory-mapped) numpy array; uint16 becomes bfloat16. A tensor (an
    expert already on a device, `fastar.weights.device_cache`) passes as it is."""
    if isinstance(a, torch.Tensor):
        return a
    a = np.ascontiguousarray(a)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only mmap views: we never write through them
        if a.dtype == np.uint16:
            return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
        return torch.from_numpy(a)


def ue8m0(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 bytes -> float32 powers of two 2^(b-127), built from the bit pattern (exact, b=0 -> 2^-127)."""
    b = scale.to(torch.int32)
    bits = torch.where(b > 0, b << 23, torch.full_like(b, 0x00400000))
    return bits.view(torch.float32)


def fp8_dequant(w: torch.Tensor, scale: torch.Tensor, row0: int = 0) -> torch.Tensor:
    """FP8 bits [R, C] (rows starting at absolute row `row0`, a multiple of 128) + block scales -> float32."""
    rows, cols = w.shape
    s = ue8m0(scale[row0 // FP8_BLOCK : (row0 + rows - 1) // FP8_BLOCK + 1])
    s = s.repeat_interleave(FP8_BLOCK, 0)[:rows].repeat_interleave(FP8_BLOCK, 1)[:, :cols]
    return w.view(torch.float8_e4m3fn).float() * s


def fp4_dequant(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP4 packed [R, C/2] (low nibble = even column) + per-32 scales [R, C/32] -> float32 [R, C]."""
    codes = torch.stack((w & 0x0F, w >> 4), dim=-1).flatten(-2).long()  # [R, C]
    lut = _FP4_LUT.get(w.device)
    if lut is None:  # one copy per device, not one per product
        lut = _FP4_LUT[w.device] = _FP4_LUT[torch.device("cpu")].to(w.device)
    rows, cols = codes.shape
    return (lut[codes].view(rows, cols // FP4_GROUP, FP4_GROUP) * ue8m0(scale)[:, :, None]).view(rows, cols)


class Linear:
    """A resident weight [out, in] in checkpoint precision with its float32 product `x @ W^T`."""

    def __init__(
        self, name: str, weight: np.ndarray, dtype: str, scale: np.ndarray | None = None, kernels: bool = True
    ) -> None:
        if dtype not in ("F8_E4M3", "BF16", "F32"):
            raise ValueError(f"{name}: unsupported weight dtype {dtype}")
        if (dtype == "F8_E4M3") != (scale is not None):
            raise ValueError(f"{name}: FP8 weights need a scale, other dtypes must not have one")
        self.name, self.dtype = name, dtype
        self.weight = _as_torch(weight)  # uint8 FP8 bits / bfloat16 / float32, as stored
        self.scale = None if scale is None else _as_torch(scale)
        self.out_features, self.in_features = self.weight.shape
        self._kernels = _kernels() if kernels else None
        # numpy views of the stored bytes, made once: the kernels take them without per-call conversion
        w = self.weight.view(torch.int16).numpy().view(np.uint16) if dtype == "BF16" else self.weight.numpy()
        self._w_np, self._s_np = w, None if self.scale is None else self.scale.numpy()
        self._direct = self._direct_product() if self._kernels is not None else None

    def _direct_product(self) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """The whole product as one C call on a float32 [T, in] tensor, its arguments bound once: a decode step
        makes ~10 products a layer, and the generic wrappers (`_kernel_product`, `kernels.fp8_matmul`) cost
        more than the smallest products' arithmetic. The same C entry point and arguments as `_kernel_product`
        (the same bits); the extension is looked up per call (`kernels.extension`), so the profiler's timing
        proxy sees these calls too. None for the weights that have no C product (F32)."""
        k, w, s, n = self._kernels, self._w_np, self._s_np, self.out_features
        if self.dtype == "F32" or (self.is_fp8 and s is None):
            return None

        def product(x: torch.Tensor) -> torch.Tensor:
            xn = x.detach().contiguous().numpy()
            out = np.empty((xn.shape[0], n), np.float32)
            if s is not None:
                k.extension.fp8_matmul(xn, w, s, out)
            else:
                k.extension.bf16_matmul(xn, w, out)
            return torch.from_numpy(out)

        return product

    def kernel_operands(self) -> tuple[np.ndarray, np.ndarray | None] | None:
        """The stored weight as the C extension takes it (FP8 bytes and their scales, or bfloat16 bits and None),
        for a caller that runs this product inside a larger C call; None where this weight has no C product."""
        return None if self._direct is None else (self._w_np, self._s_np)

    @property
    def is_fp8(self) -> bool:
        return self.dtype == "F8_E4M3"

    @property
    def nbytes(self) -> int:
        return self.weight.numel() * self.weight.element_size() + (0 if self.scale is None else self.scale.numel())

    def dequant(self, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        """Rows [r0, r1) as float32 (a temporary: the reference product widens one block at a time)."""
        w = self.weight[r0:r1]
        if self.is_fp8:
            return fp8_dequant(w, self.scale, r0)
        return w.float()

    def _kernel_product(self, x: torch.Tensor, r0: int = 0, r1: int | None = None) -> torch.Tensor | None:
        k = self._kernels
        if k is None:
            return None
        r1 = self.out_features if r1 is None else r1
        x = x.detach().contiguous().float().numpy()
        if self.is_fp8:  # on whole 128-row scale blocks (each row's sum is its own: the slice has the same bits)
            a0, a1 = r0 // FP8_BLOCK * FP8_BLOCK, min(-(-r1 // FP8_BLOCK) * FP8_BLOCK, self.out_features)
            out = k.fp8_matmul(x, self._w_np[a0:a1], self._s_np[a0 // FP8_BLOCK : -(-a1 // FP8_BLOCK)])
            if (a0, a1) != (r0, r1):
                out = np.ascontiguousarray(out[:, r0 - a0 : r1 - a0])
        elif self.dtype == "BF16":
            out = k.bf16_matmul(x, self._w_np[r0:r1])
        else:
            return None
        return torch.from_numpy(out)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] float32 -> [T, out] float32."""
        if self._direct is not None and x.dtype is torch.float32 and x.dim() == 2 and x.is_cpu:
            return self._direct(x)
        x = x.float()
        y = self._kernel_product(x)
        if y is not None:
            return y
        if self.dtype == "F32":
            return x @ self.weight.T
        out = x.new_empty(x.shape[0], self.out_features)
        for r0 in range(0, self.out_features, ROW_BLOCK):
            r1 = min(r0 + ROW_BLOCK, self.out_features)
            out[:, r0:r1] = x @ self.dequant(r0, r1).T
        return out

    def grouped(self, x: torch.Tensor) -> torch.Tensor:
        """Block-diagonal product: x [T, G, in] with group g using rows [g*out/G, (g+1)*out/G) -> [T, G, out/G]."""
        t, groups, _ = x.shape
        rank = self.out_features // groups
        k = self._kernels
        if k is not None and self.dtype in ("F8_E4M3", "BF16") and (not self.is_fp8 or rank % FP8_BLOCK == 0):
            xn = x.detach().contiguous().float().numpy().reshape(t, -1)  # one kernel call for all groups
            y = (
                k.fp8_matmul(xn, self._w_np, self._s_np, groups=groups)
                if self.is_fp8
                else k.bf16_matmul(xn, self._w_np, groups=groups)
            )
            return torch.from_numpy(y).view(t, groups, rank)
        out = x.new_empty(t, groups, rank)
        for g in range(groups):
            r0, r1 = g * rank, (g + 1) * rank
            y = self._kernel_product(x[:, g], r0, r1)
            out[:, g] = y if y is not None else x[:, g].float() @ self.dequant(r0, r1).T
        return out

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` as float32 (embedding lookup)."""
        if self.is_fp8:
            raise ValueError(f"{self.name}: row lookup of an FP8 weight is not supported")
        return self.weight[ids].float()

    def rows_array(self, ids: list[int]) -> np.ndarray | None:
        """`rows(ids)` of a BF16 weight on the CPU as a numpy array, by the bits: a bfloat16 is the top half of the
        float32 it widens to, so shifting its bits up gives `.float()`'s values exactly, in three numpy calls instead of
        a tensor, an index and a conversion (a decode step's embedding). None for other weights."""
        if self.dtype != "BF16" or not self.weight.is_cpu:
            return None
        return (self._w_np[ids].astype(np.uint32) << 16).view(np.float32)


class Weights:
    """Typed, name-based access to a `WeightSource` (official checkpoint names, storage precision)."""

    OWN_MEMORY_BYTES = 16 << 20  # product weights this big are read into memory of their own (`read_tensor`)

    def __init__(self, source: WeightSource, kernels: bool = True) -> None:
        self.source = source
        self.kernels = kernels

    def has(self, name: str) -> bool:
        return self.source.has(name)

    def linear(self, prefix: str, streamed: bool = True) -> Linear:
        """`prefix.weight` (+ `prefix.scale` when FP8) as a `Linear`. `streamed`: every row is read by each product
        (not a lookup table like the embedding), so a big one from a source that can `read_tensor` (a `.fst`) gets
        its own huge-page memory rather than a view of the file's mapping; the same bytes either way."""
        name = prefix + ".weight"
        dtype = self.source.dtype(name)
        scale = self.source.tensor(prefix + ".scale") if dtype == "F8_E4M3" else None
        read = self.source.read_tensor
        own = streamed and read is not None and self.source.nbytes(name) >= self.OWN_MEMORY_BYTES
        return Linear(prefix, read(name) if own else self.source.tensor(name), dtype, scale, kernels=self.kernels)

    def stacked(self, prefixes: list[str]) -> Linear | None:
        """The weights `prefixes` (same input width and dtype) stacked by rows as one `Linear`, so products of one
        input with all of them are one kernel call (row r of the result is row r of its own weight's: the same
        numbers). None where they cannot stack: other dtypes or widths, FP8 row counts that split a 128-row scale
        block, no kernels (nothing to gain), or a source that cannot `read_tensor` (copying from a mapping would
        keep both copies in RAM)."""
        names = [p + ".weight" for p in prefixes]
        dtypes = {self.source.dtype(n) for n in names}
        parts = [self.source.tensor(n) for n in names]
        read = self.source.read_tensor
        if (
            read is None
            or not self.kernels
            or _kernels() is None
            or len(dtypes) != 1
            or len({a.shape[1] for a in parts}) != 1
        ):
            return None
        dtype = dtypes.pop()
        if dtype not in ("F8_E4M3", "BF16") or (dtype == "F8_E4M3" and any(a.shape[0] % FP8_BLOCK for a in parts)):
            return None
        weight = np.concatenate([read(n) for n in names])
        scale = np.concatenate([self.source.tensor(p + ".scale") for p in prefixes]) if dtype == "F8_E4M3" else None
        return Linear("+".join(prefixes), weight, dtype, scale, kernels=self.kernels)

    def vector(self, name: str) -> torch.Tensor:
        """A small BF16/F32 tensor (norm weights, HC parameters, sinks, biases) widened to float32."""
        dtype = self.source.dtype(name)
        if dtype not in ("BF16", "F32"):
            raise ValueError(f"{name}: expected BF16 or F32, got {dtype}")
        return _as_torch(self.source.tensor(name)).float()

    def table(self, name: str) -> torch.Tensor:
        """An integer table (tid2eid) as int64."""
        return _as_torch(self.source.tensor(name)).long()


class SourceExperts(Unpaged):
    """Default expert provider: every request goes straight to the weight source (no cache)."""

    def __init__(self, source: WeightSource) -> None:
        self.source = source

    def get(self, layer: int, expert: int) -> ExpertWeights:
        return self.source.expert(layer, expert)


def expert_ffn(
    x: torch.Tensor,
    ew: ExpertWeights,
    route_w: torch.Tensor,
    limit: float,
    weight_before_down: bool = False,
    act_quant: Callable[[torch.Tensor], torch.Tensor] | None = None,
    kernels: bool = True,
    act_block: int = 0,
) -> torch.Tensor:
    """One routed FP4 expert on the tokens routed to it.

    x [T, D] float32, route_w [T]. `w2(silu(min(w1 x, l)) * clamp(w3 x, -l, l)) * route_w` (transformers'
    order) or, with `weight_before_down`, `w2(route_w * swiglu)` (DeepSeek's order). `act_quant`, when given,
    is applied to the inputs of each product (x before w1/w3, the mid activation before w2); when it is the
    FP8 block quantizer, `act_block` (its block) lets the fused kernel apply it inside, in one call.
    """
    x = x.float()
    route_w = route_w.float()
    k = _kernels() if kernels else None
    fused = act_quant is None or (act_block > 0 and weight_before_down)
    if k is not None and fused:  # it weights before w2: the same math when there is no act_quant
        out = torch.zeros_like(x)  # the kernel accumulates into out
        k.expert_ffn(
            x.detach().contiguous().numpy(),
            *(np.ascontiguousarray(a) for a in ew),
            route_w.detach().contiguous().numpy(),
            float(limit),
            out.numpy(),
            act_block=act_block if act_quant is not None else 0,
        )
        return out

    def product(a: torch.Tensor, w: np.ndarray, s: np.ndarray) -> torch.Tensor:
        if k is not None:  # unfused kernels: the mid activation must be quantized between the products
            return torch.as_tensor(k.fp4_matmul(a.contiguous(), np.ascontiguousarray(w), np.ascontiguousarray(s)))
        return a @ fp4_dequant(_as_torch(w), _as_torch(s)).T

    q = act_quant or (lambda a: a)
    xq = q(x)
    gate = product(xq, ew.w1, ew.w1_scale)  # [T, I]
    up = product(xq, ew.w3, ew.w3_scale)  # [T, I]
    if limit > 0:  # same clamp as fastar.model.ops.limited_swiglu (kept here: quant never imports model)
        gate, up = gate.clamp(max=limit), up.clamp(min=-limit, max=limit)
    mid = torch.nn.functional.silu(gate) * up  # [T, I]
    if weight_before_down:
        mid = mid * route_w[:, None]
    down = product(q(mid), ew.w2, ew.w2_scale)  # [T, D]
    return down if weight_before_down else down * route_w[:, None]


def experts_ffn(
    x: torch.Tensor,
    routed: np.ndarray,
    wts: torch.Tensor,
    weights: dict[int, ExpertWeights],
    order: list[int],
    limit: float,
    out: torch.Tensor,
    *,
    weight_before_down: bool = False,
    act_quant: Callable[[torch.Tensor], torch.Tensor] | None = None,
    kernels: bool = True,
    act_block: int = 0,
) -> bool:
    """Every routed expert of a chunk in one fused kernel call (`kernels.experts_ffn`: two pool jobs instead of two
    per expert), added into out [T, D] expert after expert in `order`: bit-identical to `expert_ffn` per expert
    followed by `index_add_` in that order. routed [T, k] expert ids, wts [T, k] routing weights, weights: id ->
    ExpertWeights. Returns False, having done nothing, where the fused kernel does not apply (no kernels, or an
    activation hook with transformers' routing order): the caller then runs `expert_ffn` per expert."""
    k = _kernels() if kernels else None
    if k is None or (act_quant is not None and not (act_block > 0 and weight_before_down)):
        return False
    flat = routed.reshape(-1)
    if routed.shape[0] == 1 and len(order) == len(flat):  # one token, distinct experts: expert e is its slot
        slot_of = {e: j for j, e in enumerate(flat.tolist())}
        slots = np.array([slot_of[e] for e in order], np.int64)
        rows, offsets = np.zeros(len(order), np.int64), np.arange(len(order) + 1, dtype=np.int64)
    else:
        ids, counts = np.unique(flat, return_counts=True)
        if ids.tolist() == list(order):  # ascending ids (the MoE's order): one stable sort groups the routes
            at = np.argsort(flat, kind="stable")  # flat positions by expert, each expert's in row-major order
            rows, slots = np.divmod(at, routed.shape[1])  # = np.nonzero(routed == e) for each e in turn
            offsets = np.concatenate(([0], np.cumsum(counts)))
        else:
            rows, slots = zip(*(np.nonzero(routed == e) for e in order))
            offsets = np.cumsum([0] + [len(r) for r in rows])
            rows, slots = np.concatenate(rows), np.concatenate(slots)
    k.experts_ffn(
        x.detach().contiguous().float().numpy(),
        [weights[e] for e in order],
        rows,
        offsets,
        wts.detach().float().numpy()[rows, slots],
        float(limit),
        out.numpy(),
        act_block=act_block if act_quant is not None else 0,
    )
    return True
