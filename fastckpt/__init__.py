"""fastckpt: fast, atomic, preemption-aware checkpoints for PyTorch distributed training.

    ckpt = fastckpt.Checkpointer("/nvme/ckpt/run42", keep_last=3)   # a path or an fsspec URL
    start = ckpt.resume(state)          # newest committed checkpoint loaded in place, or None
    handle = ckpt.save(state, step=step)  # returns once staged; writes in the background
    ckpt.close()                        # waits for in-flight saves

Importing this package has no side effects: no threads, signal handlers, environment reads or
network access happen until a Checkpointer is used.
"""

__version__ = "0.1.0"

import importlib

from .errors import (
    CheckpointNotFoundError, CollectiveTimeoutError, CommitTimeoutError, CorruptCheckpointError,
    FastCkptError,
    NotRegularFileError, SaveFailedError, StateMismatchError, StepRemovedError, StorageError,
    StorageTimeoutError, UnsupportedStateError, WriterLockedError)

# The engine (torch.distributed, DCP) is imported on first use, so that `import fastckpt` and
# the command-line tools stay quick (PEP 562).
_LAZY = {
    "Checkpointer": ".checkpointer", "SaveHandle": ".engine.handle", "save": ".checkpointer",
    "load": ".checkpointer", "read": ".checkpointer", "CheckpointOptions": ".options",
    "FastCkptReader": ".engine.reader", "RNGState": ".rng", "steps": ".checkpointer",
    "latest_step": ".checkpointer",
}

__all__ = [
    "Checkpointer", "SaveHandle", "CheckpointOptions", "FastCkptReader", "RNGState", "save",
    "load", "read", "steps", "latest_step",
    "FastCkptError", "UnsupportedStateError", "CheckpointNotFoundError", "CorruptCheckpointError",
    "StateMismatchError", "StorageError", "SaveFailedError", "CommitTimeoutError",
    "CollectiveTimeoutError",
    "NotRegularFileError", "StepRemovedError", "StorageTimeoutError", "WriterLockedError",
    "__version__",
]


#: submodules reachable as attributes after a bare ``import fastckpt`` (imported on first use)
_SUBMODULES = ("trackers", "dcp", "lightning", "hf", "torchtitan", "preempt")


def __getattr__(name: str):
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'fastckpt' has no attribute {name!r}")
    value = getattr(importlib.import_module(mod, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
