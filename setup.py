"""Builds the C kernels (fastar.quant._kernels) with the machine's C compiler; no downloads.

Baseline flags only (no -march=native, no global -march): each SIMD file carries its own target pragmas or needs none
(AArch64's ASIMD is baseline), and dispatch.c picks the ISA at run time, so one build runs on any CPU of its
architecture. The x86-64 kernel files are compiled only on x86-64 and the AArch64 ones only on AArch64 (each also
compiles to nothing elsewhere, see kernels.h). The flags are ones gcc and clang (macOS) both take.
"""

import platform
import sys

from setuptools import Extension, setup

CSRC = "fastar/quant/csrc/"
COMMON = [
    "bindings.c",
    "bind_ops.c",
    "bind_blocks.c",
    "bind_route.c",
    "bind_compress.c",
    "bind_attend.c",
    "bind_head_i8.c",
    "bind_hc.c",
    "dispatch.c",
    "experts.c",
    "pool.c",
    "readahead.c",
    "kern_scalar.c",
    "rowops.c",
    "mhc.c",
    "route.c",
    "attn.c",
    "attn_prefill.c",
    "gemm_avx512bf16.c",
    "head_i8.c",
]  # the GEMM file defines portable stubs where it has no x86 body
X86 = ["kern_avx2.c", "kern_avx512.c", "kern_avx512bf16.c"]
ARM64 = ["kern_neon.c", "kern_neonbf16.c", "attn_neon.c"]

machine = platform.machine().lower()
arch_files = X86 if machine in ("x86_64", "amd64", "i386", "i686") else ARM64 if machine in ("arm64", "aarch64") else []
sources = [CSRC + f for f in COMMON + arch_files]
extra = ["-O3", "-std=gnu11", "-fno-strict-aliasing", "-Wall", "-Wno-unknown-pragmas"]
link = ["-lm"]
if sys.platform != "darwin":  # macOS: pthreads are part of libSystem, and clang warns about an unused -pthread
    extra.append("-pthread")
    link.append("-pthread")
if sys.platform == "win32":
    extra, link = ["/O2"], []

setup(
    ext_modules=[
        Extension(
            "fastar.quant._kernels",
            sources=sources,
            depends=[
                CSRC + h
                for h in (
                    "kernels.h",
                    "simd.h",
                    "dispatch.h",
                    "bindings.h",
                    "kern_avx512.h",
                    "exp512.h",
                    "exp_neon.h",
                    "head_i8.h",
                )
            ],
            extra_compile_args=extra,
            extra_link_args=link,
        )
    ]
)
