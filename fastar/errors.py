"""The project's exception types: every failure a user can cause ends in one of these, with a message that
names the file, tensor or expert at fault. Front-ends print `str(err)` on one line and exit non-zero."""

from __future__ import annotations


class FastarError(Exception):
    """Base of all errors fastar raises on purpose."""

    param: str | None = None  # the request field at fault, where a server answers the error with a 400


class FormatError(FastarError):
    """A `.fst` file is malformed, truncated, corrupt or of an unsupported version."""


class ModelNotFound(FormatError, FileNotFoundError):
    """A model path that names no file or directory: a FileNotFoundError too, as `open()` of it raises."""


class CheckpointError(FastarError):
    """A source checkpoint is incomplete or does not match its config (missing shard, wrong dtype/shape)."""


class ConfigError(FastarError, ValueError):
    """A model config is missing a field or holds a value the engine cannot run."""


class OptionError(ConfigError):
    """A `load` option's value refused once it is checked against the model or the machine (a `ram_budget` below one
    expert, a `draft` the checkpoint lacks, a `device` there is none of). `str()` names the option as the Python API
    spells it (`ram_budget=1000: ...`); `as_flags(flags)` is the same error as the command line spells it
    (`--ram-budget 1000: ...`), which the CLI raises instead. In `problem`, `{keyword=VALUE}` names another setting
    the same way (`{ram_budget=None}`: `ram_budget=None`, or `--ram-budget none`; a switch's `{verify=False}`:
    `verify=False`, or its flag alone, `--no-verify`)."""

    def __init__(self, keyword: str, value: object, problem: str) -> None:
        self.keyword, self.value, self.problem = keyword, value, problem
        super().__init__(f"{keyword}={value!r}: {_settings(problem, {})}")

    def as_flags(self, flags: dict[str, str]) -> ConfigError:
        """The error in the command line's words: `flags` maps keywords to flags (`ram_budget` -> `--ram-budget`); a
        keyword without a flag keeps its Python spelling."""
        flag = flags.get(self.keyword)
        option = f"{flag} {self.value}" if flag else f"{self.keyword}={self.value!r}"
        return ConfigError(f"{option}: {_settings(self.problem, flags)}")


def _settings(problem: str, flags: dict[str, str]) -> str:
    """`problem` with each `{keyword=VALUE}` spelt as `flags` say (as Python where a keyword has none)."""
    import re

    def spell(m: re.Match) -> str:
        keyword, value = m.group(1), m.group(2)
        flag = flags.get(keyword)
        if flag is None:
            return f"{keyword}={value if value in ('None', 'True', 'False') else repr(value)}"
        if value in ("True", "False"):  # a switch: its flag says which way
            return flag
        return f"{flag} {'none' if value == 'None' else value}"

    return re.sub(r"\{(\w+)=([^{}]*)\}", spell, problem)


class OutputError(FastarError):
    """An output path refused before anything is written to it (`fastar.outputs`): it exists and `force` was not
    given, or its folder cannot be written. The message starts with the path; `named` puts the command-line flag
    that gave it in front (`-o PATH: ...`)."""

    def named(self, flag: str) -> OutputError:
        """The same error with `flag` before its message (a new exception of the same kind)."""
        return type(self)(f"{flag} {self}" if flag else str(self))


class OutputExists(OutputError, FileExistsError):
    """The output exists and the call did not say `force=True` (`--force`): nothing was written. Also a
    `FileExistsError`, as a library caller may expect of a write that will not replace a file."""


class EngineClosed(FastarError, RuntimeError):
    """An `Engine` was used after `close()`."""


class QueueFull(FastarError):
    """The step scheduler's wait queue is full: try again after `retry_after` seconds (a server's 503)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after
