"""The machine probes `fastar bench kernels` divides by (fastar.bench.kernels.machine_limits), on every ISA this
CPU runs: the streaming read and the FMA peak loop are the ISA's own (NEON's on AArch64, the portable vectors'
for "scalar"), so each ISA's kernels are reported as fractions of what that ISA can do."""

from __future__ import annotations

import numpy as np
import pytest

from fastar.quant import kernels as K

pytestmark = pytest.mark.skipif(not K.available(), reason="C extension not built")

ISAS = K.cpu_features()["usable_isas"] if K.available() else []


@pytest.mark.parametrize("isa", ISAS)
def test_probes_run_on_every_isa(isa):
    K.set_isa(isa)
    try:
        buf = np.arange(1 << 20, dtype=np.uint8)
        assert K._C.read_bandwidth(buf) > 0
        s1, f1 = K._C.fma_peak(20_000)
        s2, f2 = K._C.fma_peak(40_000)
        assert s1 > 0 and s2 > 0
        assert f2 == 2 * f1 > 0  # flops counted per iteration: the rate is flops / seconds
    finally:
        K.set_isa("auto")
