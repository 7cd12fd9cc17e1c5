"""The project's exception types: every failure a user can cause ends in one of these, with a message that
names the file, tensor or expert at fault. Front-ends print `str(err)` on one line and exit non-zero."""

from __future__ import annotations


class FastarError(Exception):
    """Base of all errors fastar raises on purpose."""

    param: str | None = None  # the request field at fault, where a server answers the error with a 400


class FormatError(FastarError):
    """A `.fst` file is malformed, truncated, corrupt or of an unsupported version."""


class CheckpointError(FastarError):
    """A source checkpoint is incomplete or does not match its config (missing shard, wrong dtype/shape)."""


class ConfigError(FastarError, ValueError):
    """A model config is missing a field or holds a value the engine cannot run."""


class EngineClosed(FastarError, RuntimeError):
    """An `Engine` was used after `close()`."""


class QueueFull(FastarError):
    """The step scheduler's wait queue is full: try again after `retry_after` seconds (a server's 503)."""

    def __init__(self, message: str, retry_after: int) -> None:
        super().__init__(message)
        self.retry_after = retry_after
