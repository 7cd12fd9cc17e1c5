"""Builds the C kernels (fastar.quant._kernels) with the machine's C compiler; no downloads.

Baseline flags only (no -march=native): the SIMD files carry their own target pragmas and dispatch.c picks
AVX-512 (+BF16), AVX2+FMA+F16C or the scalar code at run time, so one build runs on any x86-64 (or other) CPU.
"""
import sys

from setuptools import Extension, setup

CSRC = "fastar/quant/csrc/"
sources = [CSRC + f for f in ("bindings.c", "bind_ops.c", "dispatch.c", "experts.c", "pool.c", "kern_scalar.c",
                                 "kern_avx2.c", "kern_avx512.c", "kern_avx512bf16.c", "gemm_avx512bf16.c", "rowops.c",
                                 "mhc.c", "attn.c")]
extra = ["-O3", "-std=gnu11", "-fno-strict-aliasing", "-pthread", "-Wall", "-Wno-unknown-pragmas"]
link = ["-pthread", "-lm"]
if sys.platform == "win32":
    extra, link = ["/O2"], []

setup(
    ext_modules=[
        Extension(
            "fastar.quant._kernels",
            sources=sources,
            depends=[CSRC + h for h in ("kernels.h", "simd.h", "dispatch.h", "bindings.h", "kern_avx512.h",
                                        "exp512.h")],
            extra_compile_args=extra,
            extra_link_args=link,
        )
    ]
)
