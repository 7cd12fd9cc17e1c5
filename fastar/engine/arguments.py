"""The library API's arguments of the wrong kind, named in one line before anything runs.

Owns: the checks `load` makes of its model (`check_model`: a path or a `WeightSource`) and option names
(`check_option_names`), those `Engine` makes of its options (`check_load_options`, `check_load_names`: a draft,
numerics or cache policy misspelt, `check_warm_experts`), of its
folders (`check_path`: the usage profile's, the prefix cache's; a session file's is `session.file_path`), of
`stream`'s params, session, cancel event and progress callback (`check_stream`), of a perplexity window
(`check_window`) and of `serve_batch`'s requests (`check_pairs`): a string "no" for a switch, a session of another
engine, a dict for a `SamplingParams` are each a TypeError/ValueError naming the argument, never an AttributeError
inside a step or a silent surprise.
Does not own: the values' own ranges (`SamplingParams`, `Session.check_prompt`, `perplexity.windows`).
"""

from __future__ import annotations

import inspect
import os
import threading
from collections.abc import Callable
from typing import Any

from ..config import parse_size
from ..contracts import WeightSource
from ..errors import ConfigError
from ..model.deepseek_v4 import Numerics
from ..weights.expert_store import POLICIES
from . import speculative
from .sampling import SamplingParams
from .session import Session


def check_model(model: Any, what: str = "load") -> None:
    """A model to load is a path (a `.fst` file or a checkpoint directory; not empty: "" was the current directory)
    or an opened `WeightSource` (`what`: the call, for the message)."""
    if isinstance(model, WeightSource):
        return
    if not isinstance(model, str | os.PathLike):
        raise TypeError(
            f"{what} takes a model path (a .fst file or a checkpoint directory, as str or os.PathLike) or a "
            f"WeightSource, got {type(model).__name__}"
        )
    text = os.fspath(model)
    if not isinstance(text, str) or not text.strip() or "\0" in text:
        raise ValueError(f"{what}: the model path {text!r} is no path (give a .fst file or a checkpoint directory)")


def check_option_names(options: dict, init: Callable) -> None:
    """`load`'s options are `Engine`'s keyword arguments: a name that is not one (a typo) is named with the list."""
    known = [n for n in inspect.signature(init).parameters if n not in ("self", "source", "numerics")]
    unknown = [n for n in options if n not in known]
    if unknown:
        raise TypeError(f"load: unknown option {unknown[0]!r} (the options are {', '.join(known)})")


def check_load_options(switches: dict, direct_io: object, counts: dict, sizes: dict, names: dict) -> None:
    """`load`'s options of the wrong kind, before anything is read: one line naming the option. A switch must be a
    bool (the string "no" is true: `head_screen="no"` kept the screen on); a count (value, least, None allowed)
    an integer (`max_rollback=-1` was taken, to fail at the first rollback); a size (`ram_budget`, `gpu_budget`)
    whole bytes, a size string or None (True was 1 byte, 1.5 one byte too); a name (`draft`, `cache_policy`) a
    string or None (True was taken as "true")."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise TypeError(f"{name} must be True or False, got {value!r}")
    if direct_io is not None and not isinstance(direct_io, bool):
        raise TypeError(f"direct_io must be True, False or None (where the file system allows), got {direct_io!r}")
    for name, (value, least, none_ok) in counts.items():
        if value is None and none_ok:
            continue
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            also = " or None" if none_ok else ""
            raise ValueError(f"{name} must be an integer >= {least}{also}, got {value!r}")
    for name, value in sizes.items():
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | str)):
            raise TypeError(
                f"{name} must be a number of bytes (int), a size such as '24G', 'auto' or None, got {value!r}"
            )
        if isinstance(value, int) and value < 0:  # was "--ram-budget -1 B is smaller than one expert"
            raise ValueError(
                f"{name} must be a number of bytes >= 0, a size such as '24G', 'auto' or None, got {value}"
            )
        if isinstance(value, str):  # "cannot read 'lots' as a size" named no option
            try:
                parse_size(value)
            except ConfigError as e:
                raise ConfigError(f"{name}: {e}") from None
    for name, value in names.items():
        if value is not None and not isinstance(value, str):
            raise TypeError(f"{name} must be a string or None, got {value!r}")


def check_load_names(numerics: Any, draft: Any, cache_policy: Any) -> None:
    """`load`'s named choices, before anything is read: a draft (`speculative.draft_kind`) or numerics
    (`Numerics.named`) misspelt was refused only once every resident weight was read and the model built, a cache
    policy once the expert slab was allocated."""
    Numerics.named(numerics)
    speculative.draft_kind(draft)
    if cache_policy not in POLICIES:
        raise ValueError(f"unknown expert cache policy {cache_policy!r}; choose from {POLICIES}")


def check_warm_experts(value: Any) -> None:
    """`load(warm_experts=)`: True, False, or the folder of the usage profile (not "", the current directory)."""
    if isinstance(value, bool):
        return
    text = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    if not isinstance(text, str) or not text:
        raise TypeError(f"warm_experts must be True, False or a folder (of the usage profile), got {value!r}")


def check_path(value: Any, what: str) -> None:
    """A folder argument (`what`: it, for the message) is a non-empty str or os.PathLike: pathlib said only that its
    "argument should be a str or an os.PathLike object", and "" was the current directory."""
    text = os.fspath(value) if isinstance(value, str | os.PathLike) else None
    if not isinstance(text, str) or not text:
        raise TypeError(f"{what} must be a non-empty path, got {value!r}")


def check_stream(engine: Any, params: Any, session: Any, cancel: Any, on_prefill_progress: Any) -> None:
    """`Engine.stream`'s arguments besides the prompt (checked by the session)."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams (or pass keyword arguments), got {type(params).__name__}")
    if session is not None and not isinstance(session, Session):
        raise TypeError(f"session must be a Session from open_session(), got {type(session).__name__}")
    if session is not None and session.runner is not engine:
        raise ValueError("the session belongs to another engine: open one with this engine's open_session()")
    if session is not None and params.prompt_logprobs is not None:
        raise ValueError("prompt_logprobs scores the prompt from a fresh state: pass no session with it")
    if cancel is not None and not isinstance(cancel, threading.Event):
        raise TypeError(f"cancel must be a threading.Event, got {type(cancel).__name__}")
    if on_prefill_progress is not None and not callable(on_prefill_progress):
        raise TypeError(f"on_prefill_progress must be callable as (done, total), got {on_prefill_progress!r}")


def check_window(ctx: Any, stride: Any) -> None:
    """A perplexity window's sizes are integers (their ranges: `perplexity.windows`)."""
    for name, value in (("ctx", ctx), ("stride", stride)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise TypeError(f"{name} must be an integer, got {value!r}")


def check_pairs(requests: Any) -> None:
    """`serve_batch`'s requests are a list of (prompt, params or a dict of sampling keywords) pairs."""
    if not isinstance(requests, list | tuple):
        raise TypeError(
            f"serve_batch takes a list of (prompt, params or a dict of sampling keywords) pairs, got "
            f"{type(requests).__name__}"
        )
    bad = next(
        (
            r
            for r in requests
            if not (isinstance(r, tuple | list) and len(r) == 2 and isinstance(r[1], dict | SamplingParams))
        ),
        None,
    )
    if bad is not None:
        raise TypeError(f"serve_batch takes (prompt, params or a dict of sampling keywords) pairs, got {bad!r}")
