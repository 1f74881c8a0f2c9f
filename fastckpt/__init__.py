"""fastckpt: fast, atomic, preemption-aware checkpoints for PyTorch distributed training.

    ckpt = fastckpt.Checkpointer("/nvme/ckpt/run42", keep_last=3)   # a path or an fsspec URL
    start = ckpt.resume(state)          # newest committed checkpoint loaded in place, or None
    handle = ckpt.save(state, step=step)  # returns once staged; writes in the background
    ckpt.close()                        # waits for in-flight saves

Importing this package has no side effects: no threads, signal handlers, environment reads or
network access happen until a Checkpointer is used.
"""

__version__ = "0.1.0"

from .checkpointer import Checkpointer, SaveHandle, load, save  # noqa: E402
from .errors import (  # noqa: E402
    CheckpointNotFoundError, CommitTimeoutError, CorruptCheckpointError, FastCkptError,
    SaveFailedError, StateMismatchError, StorageError, UnsupportedStateError)
from .options import CheckpointOptions  # noqa: E402
from .reader import FastCkptReader  # noqa: E402

__all__ = [
    "Checkpointer", "SaveHandle", "CheckpointOptions", "FastCkptReader", "save", "load",
    "FastCkptError", "UnsupportedStateError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "StateMismatchError", "StorageError", "SaveFailedError", "CommitTimeoutError", "__version__",
]
