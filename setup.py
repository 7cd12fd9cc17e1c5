"""Builds the C kernels (fastar.quant._kernels) with the machine's C compiler; no downloads."""
import sys

from setuptools import Extension, setup

extra = ["-O3", "-std=c11", "-fno-strict-aliasing", "-pthread"]
if sys.platform == "win32":
    extra = ["/O2"]

setup(
    ext_modules=[
        Extension(
            "fastar.quant._kernels",
            sources=["fastar/quant/csrc/kernels.c"],
            extra_compile_args=extra,
            extra_link_args=["-pthread"] if sys.platform != "win32" else [],
        )
    ]
)
