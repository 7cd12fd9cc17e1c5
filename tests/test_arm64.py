"""The C kernels without Python: tests/csrc/kernels_check.c (the weight products, the FP8 activation quantization)
and tests/csrc/ops_check.c (attention, mHC, SwiGLU, the fused experts, the row ops), each linked with every kernel
source (not the bindings), run natively and, cross-compiled for AArch64, under qemu-aarch64 with a CPU model that
has FEAT_BF16.

The harnesses compare every ISA the build has with the portable kernels (and the products with a float64 product):
awkward sizes, special values, 1/2/3 threads, batch invariance; their comments say what exactly. The AArch64 run is
how these x86-64 machines prove the NEON and BF16 kernels: `bash .ci/install-arm` installs the cross compiler and
qemu.
"""

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "fastar" / "quant" / "csrc"
HARNESSES = {"products": ROOT / "tests" / "csrc" / "kernels_check.c", "ops": ROOT / "tests" / "csrc" / "ops_check.c"}
CROSS_CC = "aarch64-linux-gnu-gcc"
QEMU = "qemu-aarch64"
QEMU_CPU = "max"  # qemu's model with every feature it emulates, FEAT_BF16 included
FLAGS = [
    "-O3",
    "-std=gnu11",
    "-fno-strict-aliasing",
    "-pthread",  # setup.py's
    "-Wall",
    "-Werror",
    "-Wno-unknown-pragmas",
]


def kernel_sources() -> list[str]:
    """Every C file of the extension except the Python bindings: the kernels must build without Python.h."""
    return sorted(str(p) for p in CSRC.glob("*.c") if not p.name.startswith("bind"))


def _cc() -> str | None:
    return os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")


def _build(cc: str, harness: str, exe: Path, extra: list[str]) -> None:
    r = subprocess.run(
        [cc, *FLAGS, *extra, f"-I{CSRC}", str(HARNESSES[harness]), *kernel_sources(), "-lm", "-o", str(exe)],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, f"{cc} failed:\n{r.stderr}"


def _isas_checked(stdout: str) -> set[str]:
    return {line.split()[0] for line in stdout.splitlines() if line.rstrip().endswith(" cases")}


def test_kernel_sources_do_not_include_python():
    for src in kernel_sources():
        assert "Python.h" not in Path(src).read_text(), f"{src} includes Python.h"


@pytest.mark.skipif(_cc() is None, reason="no C compiler on PATH")
@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_native_kernels_match_the_portable_ones(tmp_path, harness):
    exe = tmp_path / "kernels_check"
    _build(_cc(), harness, exe, [])
    r = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "scalar" in _isas_checked(r.stdout)
    assert " 0 failed" in r.stdout


@pytest.mark.skipif(
    shutil.which(CROSS_CC) is None or shutil.which(QEMU) is None,
    reason=f"{CROSS_CC} or {QEMU} not on PATH (bash .ci/install-arm installs them)",
)
@pytest.mark.parametrize("harness", sorted(HARNESSES))
def test_aarch64_kernels_match_the_portable_ones_under_qemu(tmp_path, harness):
    exe = tmp_path / "kernels_check_aarch64"
    _build(CROSS_CC, harness, exe, ["-static"])
    r = subprocess.run([QEMU, "-cpu", QEMU_CPU, str(exe)], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr
    checked = _isas_checked(r.stdout)
    assert {"neon", "neon-bf16", "scalar"} <= checked, f"ISAs checked under qemu: {sorted(checked)}\n{r.stdout}"
    if harness == "products":  # qemu's CPU has FEAT_DotProd: the int8 head's products take SDOT there
        assert re.search(r"^neon\s+head_i8_dot path neon-dotprod$", r.stdout, re.M), r.stdout
    assert " 0 failed" in r.stdout


@pytest.mark.skipif(shutil.which(CROSS_CC) is None, reason=f"{CROSS_CC} not on PATH (bash .ci/install-arm installs it)")
def test_aarch64_row_ops_compile_to_neon(tmp_path):
    """The RMS norm and RoPE have no NEON twin because the AArch64 compiler vectorizes their plain C: each function's
    arithmetic includes 4-lane float instructions (the norm's 16 fixed partial sums and its scaling, RoPE's pairs
    through LD2 / ST2). The portable SwiGLU calls expf per element, hence the NEON ISAs' own (kern_neon.c)."""
    asm = tmp_path / "rowops.s"
    r = subprocess.run(
        [CROSS_CC, *FLAGS, "-S", f"-I{CSRC}", str(CSRC / "rowops.c"), "-o", str(asm)], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stderr
    bodies, name = {}, None
    for line in asm.read_text().splitlines():
        if line and not line[0].isspace() and line.endswith(":") and not line.startswith("."):
            name = line[:-1]
        elif name:
            bodies.setdefault(name, []).append(line)
    vector_ops = re.compile(r"\b(fmul|fadd|fsub|fmla)\s+v\d+\.4s")
    for fn in ("rms_norm_rows", "rope_rows"):
        assert any(vector_ops.search(s) for s in bodies[fn]), f"{fn} has no 4-lane float arithmetic"
    assert any("ld2\t" in s or "ld2 " in s for s in bodies["rope_rows"]), "rope_rows does not load its pairs with LD2"
