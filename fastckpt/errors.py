"""fastckpt's exceptions.

Every error raised on purpose derives from :class:`FastCkptError` (an ``Exception``, never a
``BaseException``), names what it concerns (rank, file, tensor key, byte offset) in its message,
keeps those as attributes, and keeps the underlying exception as ``__cause__``.
"""

from __future__ import annotations

__all__ = [
    "FastCkptError",
    "UnsupportedStateError",
    "CheckpointNotFoundError",
    "StepRemovedError",
    "CorruptCheckpointError",
    "StateMismatchError",
    "StorageError",
    "NotRegularFileError",
    "StorageTimeoutError",
    "WriterLockedError",
    "SaveFailedError",
    "CommitTimeoutError",
    "CollectiveTimeoutError",
]


class FastCkptError(Exception):
    """Base class of every error fastckpt raises on purpose."""

    def __init__(self, message: str, *, rank: int | None = None, file: str | None = None,
                 key: str | None = None, offset: int | None = None) -> None:
        self.rank = rank
        self.file = file
        self.key = key
        self.offset = offset
        parts = []
        if rank is not None:
            parts.append(f"rank {rank}")
        if file is not None:
            parts.append(f"file {file}")
        if key is not None:
            parts.append(f"tensor {key!r}")
        if offset is not None:
            parts.append(f"offset {offset}")
        prefix = (", ".join(parts) + ": ") if parts else ""
        super().__init__(prefix + message)


class UnsupportedStateError(FastCkptError, TypeError):
    """The state holds an object fastckpt cannot store (raised before anything is written)."""


class CheckpointNotFoundError(FastCkptError, FileNotFoundError):
    """No committed checkpoint (or not the requested step) exists under the root."""


class StepRemovedError(CheckpointNotFoundError):
    """The step being read was removed meanwhile (retention or ``fastckpt gc`` after a newer
    step was committed); a load of the newest step retries on the new newest one."""


class CorruptCheckpointError(FastCkptError):
    """A manifest or shard failed validation: bad JSON, wrong size, checksum mismatch."""


class StateMismatchError(FastCkptError, ValueError):
    """The state to load into does not fit the checkpoint (missing key, shape or dtype)."""


class StorageError(FastCkptError, OSError):
    """The storage refused an operation (unwritable root, full disk, unreachable bucket)."""


class NotRegularFileError(StorageError):
    """A path where fastckpt expects a regular file holds something else (a directory, a FIFO,
    a device, a symbolic link): it is never opened or followed."""


class StorageTimeoutError(StorageError):
    """A storage call did not answer within its bound: a local mount that stopped answering
    (NFS, a failing device) or an object store that did not answer within ``op_timeout_s``.
    Not damage: the tools (``ls``, ``resume``, ``verify``) end on it (exit 4) instead of
    reporting a step as damaged or waiting the bound again for every other step. (Not a
    ``TimeoutError``: ``SaveHandle.wait(timeout)`` raises that for "still running".)"""


class WriterLockedError(FastCkptError):
    """Another writer holds the root (see ``fastckpt.lease``); names the holder."""

    def __init__(self, message: str, *, holder: dict | None = None, **kw) -> None:
        self.holder = dict(holder or {})
        super().__init__(message, **kw)


class CollectiveTimeoutError(FastCkptError, TimeoutError):
    """Ranks did not all arrive at an exchange within its deadline; names the missing ranks."""

    def __init__(self, message: str, *, missing_ranks: list[int] | None = None, **kw) -> None:
        self.missing_ranks = list(missing_ranks or [])
        super().__init__(message, **kw)


class CommitTimeoutError(CollectiveTimeoutError):
    """Ranks did not all report within the commit deadline; names the missing ranks.

    ``outcome_unknown``: this rank never received the coordinator's decision (rank 0 died or
    its store went away), so the step may have been committed all the same."""

    def __init__(self, message: str, *, outcome_unknown: bool = False, **kw) -> None:
        self.outcome_unknown = outcome_unknown
        super().__init__(message, **kw)


class SaveFailedError(FastCkptError):
    """A save failed on one or more ranks; ``failures`` maps rank -> message.

    The previous committed checkpoint is untouched.
    """

    def __init__(self, message: str, *, failures: dict[int, str] | None = None, **kw) -> None:
        self.failures = dict(failures or {})
        super().__init__(message, **kw)
