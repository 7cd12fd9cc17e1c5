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
