"""The accelerator tier: the model on a torch device, routed experts split between the device and the CPU.

Owns:
- `resolve_device`: the `--device` values (`cpu`: the C kernels, the default everywhere for now; `torch:cpu`: this
  tier's torch code on the CPU, slow but real, what CI runs; `cuda`, `cuda:N`: opt-in and experimental until the tier
  has passed a run on a real GPU; `auto`: CUDA when present).
- `DeviceBackend`: the products contract the model is built through on a device (`weights`: resident weights on the
  device as `DeviceLinear`s and vectors; `scope`: the default device and torch-only ops its forward runs in;
  `attach`: hands each MoE the `ExpertSplit`), its VRAM budget and its counters (`stats`).
- `DeviceLinear`: a resident weight on the device, kept as stored (FP8 e4m3 bits + UE8M0 block scales, BF16, F32)
  and dequantized per product in blocks of rows, exactly as `fastar.quant.linear.Linear`'s reference path does.
  Why not dequantize once: FP8 to bf16 would be lossless but double the resident bytes (~6 GB more for Flash) and a
  float32 copy quadruple them; the per-product dequantization costs bandwidth the device has to spare.
- `ExpertSplit`: per layer per step, which routed experts run on the device (held in the `DeviceExpertCache` pool,
  or streamed into it for big prefill chunks) and which on the CPU with the C kernels, in a worker thread, while
  the device works; each expert's output kept apart and all summed on the device in expert-id order.
Does not own: the model's math (`deepseek_v4.py`; on a device every op takes its torch reference path,
`ops.torch_only`), the VRAM slot pool (`fastar.weights.device_cache`), the RAM tier (`fastar.weights.expert_cache`).

Exactness: with `reference` numerics every op is float32 torch math, as the C path's references are; the output
matches transformers within 1e-4 on the tiny models (tests/test_device.py). An expert run on the CPU by the C kernels
and on the device by torch differ by float32 summation order only, and because every expert's output is added in
expert-id order whatever the split, the same split always gives the same bits, and with the host running the torch
reference too (`host_kernels=False`) every split gives the same bits.
"""

from __future__ import annotations

import contextlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from ..config import ModelConfig, parse_size
from ..contracts import ExpertProvider, WeightSource
from ..errors import OptionError
from ..quant.linear import Linear, Weights, expert_ffn, ue8m0
from ..quant.reference import FP8_BLOCK
from ..weights.device_cache import DeviceExpertCache, slot_bytes
from . import ops

DEVICE_CHOICES = "cpu, torch:cpu, cuda or cuda:N"
STREAM_TOKENS = 256  # a chunk this long streams its layer's missing experts to the device instead of the CPU
ADMIT_FULL = 1  # experts a layer step may copy into a full pool (replacing others): bounds churn over PCIe
VRAM_RESERVE = 2 << 30  # bytes `gpu_budget="auto"` leaves free for activations and the decode state


def cuda_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # noqa: BLE001 - a broken driver reads as no CUDA
        return False


# Whether None (no --device) picks CUDA when present. Off until the accelerator tier has passed a measured run on a
# real GPU (docs/DEVICE.md, bench/gpu-check.sh): until then the default is the C kernels on the CPU everywhere, and
# `--device cuda` (or `auto`) opts in.
DEFAULT_TO_CUDA = False


def resolve_device(name: str | None) -> str:
    """A `--device` value -> "cpu" (the C kernels), "torch:cpu" or "cuda:N". None: "cpu" (`DEFAULT_TO_CUDA`);
    "auto": CUDA when present, else "cpu"."""
    if name is None or name == "auto":
        want_cuda = name == "auto" or DEFAULT_TO_CUDA
        return f"cuda:{torch.cuda.current_device()}" if want_cuda and cuda_available() else "cpu"
    name = str(name).strip().lower()
    if name in ("cpu", "torch:cpu"):
        return name
    if name == "cuda" or name.startswith("cuda:"):
        index = name[5:] or None
        if index is not None and not index.isdigit():
            raise OptionError("device", name, f"expected {DEVICE_CHOICES}")
        if not cuda_available():
            raise OptionError(
                "device",
                name,
                f"CUDA is not available here (torch {torch.__version__} sees no CUDA device); use {{device=cpu}}",
            )
        i = torch.cuda.current_device() if index is None else int(index)
        if i >= torch.cuda.device_count():
            raise OptionError("device", name, f"there are {torch.cuda.device_count()} CUDA device(s)")
        return f"cuda:{i}"
    raise OptionError("device", name, f"expected {DEVICE_CHOICES}")


# --- resident weights ----------------------------------------------------------------------------------------


class DeviceLinear(Linear):
    """A `Linear` whose stored bytes live on the device; its product is the reference path (no C kernels), with the
    FP8 block scales widened once (float32 [R/128, C/128], 1/4096 of the weight's bytes) and applied by broadcast:
    the same products as `fp8_dequant`, in three device ops instead of ten."""

    def __init__(self, lin: Linear, device: torch.device) -> None:  # not Linear.__init__: copies a built one
        self.name, self.dtype = lin.name, lin.dtype
        self.weight = lin.weight.to(device)  # uint8 FP8 bits / bfloat16 / float32, as stored
        self.scale = None if lin.scale is None else lin.scale.to(device)
        self.out_features, self.in_features = self.weight.shape
        self._kernels, self._w_np, self._s_np, self._direct = None, None, None, None
        self._scale_f32 = None if self.scale is None else ue8m0(self.scale)  # [R/128, C/128]

    def dequant(self, r0: int = 0, r1: int | None = None) -> torch.Tensor:
        w = self.weight[r0:r1]
        rows, cols = w.shape
        if not self.is_fp8 or r0 % FP8_BLOCK or rows % FP8_BLOCK or cols % FP8_BLOCK:
            return super().dequant(r0, r1)
        s = self._scale_f32[r0 // FP8_BLOCK : (r0 + rows) // FP8_BLOCK]  # [rows/128, cols/128]
        blocks = w.view(torch.float8_e4m3fn).float().view(rows // FP8_BLOCK, FP8_BLOCK, cols // FP8_BLOCK, FP8_BLOCK)
        return (blocks * s[:, None, :, None]).view(rows, cols)


class DeviceWeights(Weights):
    """`Weights` whose linears, vectors and tables are on the device (never stacked: that only saves kernel calls)."""

    def __init__(self, source: WeightSource, device: torch.device) -> None:
        super().__init__(source, kernels=False)
        self.device = device

    def linear(self, prefix: str, streamed: bool = True) -> Linear:
        return DeviceLinear(super().linear(prefix, streamed), self.device)

    def stacked(self, prefixes: list[str]) -> Linear | None:
        return None

    def vector(self, name: str) -> torch.Tensor:
        return super().vector(name).to(self.device)

    def table(self, name: str) -> torch.Tensor:
        return super().table(name).to(self.device)


# --- routed experts --------------------------------------------------------------------------------------------


class ExpertSplit:
    """Runs a MoE layer's routed experts for one step, split between the device pool and the CPU (see module doc).

    Policy per layer per step: experts the pool holds run on the device; when the chunk has at least
    `stream_tokens` tokens, missing ones are streamed into the pool (as many as it has slots the layer is not
    using) and run there too; the rest run on the CPU (C kernels over the RAM tier) in a worker thread, overlapped
    with the device's experts, and are then offered to the pool (`DeviceExpertCache.admit`) for later steps: all of
    them while slots are free, at most `ADMIT_FULL` per layer step once it is full.
    """

    def __init__(
        self,
        pool: DeviceExpertCache,
        provider: ExpertProvider,
        device: torch.device,
        stream_tokens: int = STREAM_TOKENS,
        host_kernels: bool = True,
    ) -> None:
        self.pool, self.provider, self.device = pool, provider, device
        self.stream_tokens, self.host_kernels = stream_tokens, host_kernels
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="fastar-cpu-experts")
        self._lock = threading.Lock()
        self.counts = dict.fromkeys(
            (
                "steps",
                "experts_device",
                "experts_streamed",
                "experts_cpu",
                "tokens_device",
                "tokens_cpu",
                "cpu_seconds",
                "wait_seconds",
            ),
            0,
        )

    def _count(self, **kw) -> None:
        with self._lock:
            for k, v in kw.items():
                self.counts[k] += v

    def plan(self, layer: int, wanted: list[int], tokens: int) -> tuple[list[int], list[int], list[int]]:
        """-> (held: run from the pool, streamed: copied in now and run there, host: run on the CPU)."""
        held = [e for e in wanted if self.pool.holds(layer, e)]
        room = self.pool.n_slots - len(held) if tokens >= self.stream_tokens else 0
        rest = [e for e in wanted if not self.pool.holds(layer, e)]
        return held, rest[: max(0, room)], rest[max(0, room) :]

    def __call__(self, moe, x: torch.Tensor, idx: torch.Tensor, wts: torch.Tensor) -> torch.Tensor:
        """Routed output [T, d] on the device for x [T, d], expert ids idx [T, k] and weights wts [T, k]."""
        layer, numerics = moe.layer, moe.numerics
        routed = idx.cpu().numpy()  # [T, k]: the step's one wait for the device, to know what it needs
        wanted = np.unique(routed).tolist()  # sorted: the summation order
        self.pool.note_use(layer, wanted)
        self.pool.begin_layer(layer)
        held, streamed, host = self.plan(layer, wanted, x.shape[0])
        act = numerics.act if numerics.fp8_activations else None
        ffn = dict(weight_before_down=numerics.official_routing, act_quant=act, act_block=128 if act else 0)
        job = None
        if host:  # hidden state to the host, the CPU's share in the worker while the device runs its own
            job = self._worker.submit(self._host_experts, layer, moe.limit, x.cpu(), routed, wts.cpu(), host, ffn)
        ys: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        for e in held + streamed:
            tok, slot = (torch.from_numpy(a).to(self.device) for a in np.nonzero(routed == e))
            y = expert_ffn(x[tok], self.pool.get(layer, e), wts[tok, slot], moe.limit, kernels=False, **ffn)
            ys[e] = (tok, y)
        if job is not None:
            replaced = 0  # copied in for later steps while the CPU computes them for this one
            for e in host:
                free = self.pool.has_free()
                if not free and replaced >= ADMIT_FULL:
                    break
                if self.pool.admit(layer, e) and not free:
                    replaced += 1
            t0 = time.perf_counter()
            for e, (tok, y) in job.result().items():
                ys[e] = (tok.to(self.device), y.to(self.device))
            self._count(wait_seconds=time.perf_counter() - t0)
        out = torch.zeros_like(x)  # [T, d]
        for e in wanted:  # expert-id order whatever ran where: the sum does not depend on the split
            out.index_add_(0, *ys[e])
        n_dev = sum(len(ys[e][0]) for e in held + streamed)
        self._count(
            steps=1,
            experts_device=len(held) + len(streamed),
            experts_streamed=len(streamed),
            experts_cpu=len(host),
            tokens_device=n_dev,
            tokens_cpu=routed.size - n_dev,
        )
        return out

    def _host_experts(self, layer, limit, x, routed, wts, ids, ffn) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """The worker: experts `ids` on the CPU from the RAM tier, each output kept apart (token rows, [n, d])."""
        t0 = time.perf_counter()
        ys = {}
        for batch in self.provider.each_batch(layer, ids):
            for e, ew in batch:
                tok, slot = (torch.from_numpy(a) for a in np.nonzero(routed == e))
                ys[e] = (tok, expert_ffn(x[tok], ew, wts[tok, slot], limit, kernels=self.host_kernels, **ffn))
        self._count(cpu_seconds=time.perf_counter() - t0)
        return ys

    def close(self) -> None:
        self._worker.shutdown(wait=True)


# --- the backend -----------------------------------------------------------------------------------------------


class DeviceBackend:
    """The model on `device` (a `resolve_device` value other than "cpu"). `gpu_budget`: bytes (or "20G") of device
    memory for the routed-expert pool; "auto"/None: on CUDA what is free after the resident weights less
    `VRAM_RESERVE`, on torch:cpu every expert; 0: every routed expert on the CPU. `host_kernels`: the CPU's experts
    through the C kernels (False: the torch reference, for tests of the split)."""

    def __init__(
        self,
        device: str,
        gpu_budget: int | str | None = "auto",
        stream_tokens: int = STREAM_TOKENS,
        host_kernels: bool = True,
    ) -> None:
        self.name = device
        self.device = torch.device("cpu" if device == "torch:cpu" else device)
        self.budget = None if gpu_budget in (None, "auto") else parse_size(gpu_budget)
        self.stream_tokens, self.host_kernels = stream_tokens, host_kernels
        self.pool: DeviceExpertCache | None = None
        self.split: ExpertSplit | None = None
        self.resident_bytes = 0

    def weights(self, source: WeightSource) -> DeviceWeights:
        return DeviceWeights(source, self.device)

    def build_model(self, source: WeightSource, **options):
        """`DeepseekV4(source, backend=self, **options)` built inside `scope` (its RoPE tables and any tensor it
        makes land on the device), with the expert pool attached."""
        from .deepseek_v4 import DeepseekV4

        with self.scope():
            return DeepseekV4(source, kernels=False, backend=self, **options)

    @contextlib.contextmanager
    def scope(self):
        """Where the model is built and every forward runs: factories default to the device, ops take torch paths."""
        with torch.device(self.device), ops.torch_only():
            yield

    def attach(self, model) -> None:
        """Build the expert pool under the budget and hand every MoE (main and MTP blocks) the split."""
        cfg: ModelConfig = model.config
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.resident_bytes = torch.cuda.memory_allocated(self.device)
        budget = self.budget
        if budget is None:
            if self.device.type == "cuda":
                free, _ = torch.cuda.mem_get_info(self.device)
                budget = max(0, free - VRAM_RESERVE)
            else:
                budget = cfg.num_layer_slots * cfg.n_routed_experts * slot_bytes(cfg)
        self.pool = DeviceExpertCache(model.experts, cfg, budget, self.device)
        self.split = ExpertSplit(self.pool, model.experts, self.device, self.stream_tokens, self.host_kernels)
        for block in list(model.layers) + [m.block for m in model.mtp]:
            block.ffn.offload = self.split

    def stats(self) -> dict:
        """`device_*` counters: the split's (steps, experts and routed token-slots on each side, CPU and wait
        seconds), the pool's (`pool_*`: hits, misses, admitted, evicted, bytes copied, slots), memory."""
        d = {"device": self.name}
        if self.split is not None:
            d.update(self.split.counts)
            d.update({f"pool_{k}": v for k, v in self.pool.stats().items()})
        if self.device.type == "cuda":
            d["peak_bytes"] = torch.cuda.max_memory_allocated(self.device)
            d["resident_bytes"] = self.resident_bytes
        return d

    def close(self) -> None:
        if self.split is not None:
            self.split.close()
