"""Shared pytest fixtures. Keep this small: one fixture per shared resource, built lazily, once per session.

The checkpoint fixtures return directories written by `fastar.fixtures.write_checkpoint` (official on-disk
format). They are shared by every test in the session: treat them as read-only and copy before corrupting.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from fastar.fixtures import write_checkpoint
from fastar.quant import kernels as _kernels


@pytest.fixture(scope="session", autouse=True)
def prompt_cache_in_a_temp_folder(tmp_path_factory: pytest.TempPathFactory):
    """`fastar serve` and `fastar chat` keep a prompt cache by default in the user cache directory: tests that run
    them (in process or as subprocesses) use a temporary folder instead (the FASTAR_PROMPT_CACHE mirror)."""
    import os

    before = os.environ.get("FASTAR_PROMPT_CACHE")
    os.environ["FASTAR_PROMPT_CACHE"] = str(tmp_path_factory.mktemp("prompt-cache"))
    yield
    if before is None:
        os.environ.pop("FASTAR_PROMPT_CACHE", None)
    else:
        os.environ["FASTAR_PROMPT_CACHE"] = before


def pytest_configure(config):
    """The suite runs the CPU path everywhere (as CI does) and the device tests name their device, whatever the
    engine's default. FASTAR_DEVICE reaches the CLI, including in subprocesses."""
    import os

    os.environ.setdefault("FASTAR_DEVICE", "cpu")


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: without it they are skipped, with the reason."""
    gpu = [item for item in items if "gpu" in item.keywords]
    if not gpu:
        return
    import torch

    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA (torch.cuda.is_available() is false)")
        for item in gpu:
            item.add_marker(skip)


@pytest.fixture(scope="module")
def one_torch_thread():
    """For modules of tiny-model tests (`pytestmark = pytest.mark.usefixtures("one_torch_thread")`): torch's
    intra-op threads only add overhead on tiny tensors (10x on a busy 2-core box). Restored after the module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny` preset, seed 0: 5 layers + 1 MTP block, vocab 1024, 3 shards (~20 MB)."""
    return write_checkpoint(tmp_path_factory.mktemp("ckpt-tiny"), "tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_fst_path(tiny_ckpt: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny_ckpt` converted to a `.fst`, once for the session (tests read it; they corrupt copies, never it)."""
    from fastar.convert.hf import convert

    return convert(tiny_ckpt, tmp_path_factory.mktemp("fst-tiny") / "tiny.fst", progress=False)


@pytest.fixture(scope="module")
def tiny_fst_file(tiny_fst_path: Path):
    """`tiny_fst_path` opened (`FstFile`), one per test module."""
    from fastar.format.reader import FstFile

    return FstFile(tiny_fst_path)


@pytest.fixture(scope="session")
def dspark_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`tiny-dspark` preset, seed 0: `tiny` with DSpark stages mtp.0..mtp.2."""
    return write_checkpoint(tmp_path_factory.mktemp("ckpt-dspark"), "tiny-dspark", seed=0)


@pytest.fixture(scope="session")
def vocab_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`vocab` preset, seed 0: `tiny` widths with the real 129,280-token vocabulary (~160 MB, ~4 s to write)."""
    return write_checkpoint(tmp_path_factory.mktemp("ckpt-vocab"), "vocab", seed=0)


@pytest.fixture(params=[*(_kernels.cpu_features()["usable_isas"] if _kernels.available() else []), "numpy"])
def kernel_backend(request, monkeypatch):
    """Each instruction set of the C kernels this CPU runs, then the numpy fallback (the extension hidden)."""
    if request.param == "numpy":
        monkeypatch.setattr(_kernels, "_C", None)
    else:
        _kernels.set_isa(request.param)
    yield request.param
    if _kernels.available():
        _kernels.set_isa("auto")
