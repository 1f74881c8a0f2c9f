"""What the ``fastckpt`` command does, as plain functions: usable from Python without the CLI,
and without torch (job scripts call the CLI before every start; it must be quick).

* :func:`describe_steps` -- every step directory under a root: committed, partial, being
  written or damaged, with time, size, world size and checksum status (``fastckpt ls``);
* :func:`verify_step` -- re-read every shard file of a committed step and check it against the
  manifest, naming each bad file, tensor and byte offset (``fastckpt verify``);
* :func:`inspect_step` -- the tensors of a step with dtypes, shapes, sharding and sizes, and its
  plain values (``fastckpt inspect``);
* :func:`plan_gc` / :func:`run_gc` -- which steps a clean-up removes and why, and removing them;
  :func:`stale_uploads` / :func:`abort_uploads` -- unfinished multipart uploads (``fastckpt gc``);
* :func:`~fastckpt.tools.events.job_exit_code` -- the job's exit code from the preemption
  event logs the ranks wrote (``fastckpt resume --supervise``, ``python -m fastckpt.preempt``);
* :func:`parse_size` / :func:`human_bytes` -- ``"4GiB"`` <-> ``4294967296``.

Every function takes a root (a path or an fsspec URL) or an open :class:`~fastckpt.storage.Storage`
and raises the errors of :mod:`fastckpt.errors` for expected conditions (no committed step:
:class:`~fastckpt.errors.CheckpointNotFoundError`; unreadable root:
:class:`~fastckpt.errors.StorageError`; damaged manifest:
:class:`~fastckpt.errors.CorruptCheckpointError`). Problems found *inside* a checkpoint by
:func:`verify_step` are returned, not raised.
"""

from ..manifest.verify import Problem
from .describe import (VERIFIED_PREFIX, VERIFY_FAILED_PREFIX, StepRecord, as_storage,
                       describe_steps, display_path, newest_committed, not_found_hint,
                       remote_tier, step_data_bytes)
from .gc import GcAction, abort_uploads, plan_gc, run_gc, stale_uploads
from .inspect import inspect_step
from .sizes import human_bytes, parse_size
from .verify import VerifyResult, verify_step

__all__ = [
    "VERIFIED_PREFIX", "VERIFY_FAILED_PREFIX", "StepRecord", "Problem", "VerifyResult",
    "GcAction", "as_storage", "display_path", "describe_steps", "newest_committed",
    "verify_step", "inspect_step", "plan_gc", "run_gc", "parse_size", "human_bytes",
    "step_data_bytes", "not_found_hint", "stale_uploads", "abort_uploads", "remote_tier",
]
