"""The public API: ``Checkpointer`` (the engine plus the preemption trigger) and the one-shot
``save``/``load``.

    ckpt = fastckpt.Checkpointer("/nvme/ckpt/run42", keep_last=3, grace_s=30)
    start = ckpt.resume(state)                      # newest committed step loaded, or None
    ckpt.save(state, step=step)                     # returns once staged
    ckpt.save(state, step=step, on_preempt=True)    # ~1 us unless a stop was agreed
    ckpt.close()

The engine (``fastckpt.engine``) saves and loads; the trigger (``fastckpt.preempt``) traps the
stop signals and, at the agreed step, calls the engine's narrow preemption interface
(``inflight``, ``supersede``, ``emergency_save``). This module is where the two meet.
"""

from __future__ import annotations

import os
import threading
from typing import Any

from .engine.core import Engine
from .engine.handle import SaveHandle
from .storage import Storage

__all__ = ["Checkpointer", "SaveHandle", "save", "load", "read"]


class Checkpointer(Engine):
    """Saves and loads one training job's checkpoints under ``root``; see :class:`Engine`.

    With ``grace_s`` (or ``preempt=True``, or at the first ``save(..., on_preempt=True)``) it
    installs the preemption trigger (docs/preemption.md). Not thread-safe: call it from the
    training thread only.
    """

    def __init__(self, root: str | os.PathLike | Storage, **kwargs: Any) -> None:
        super().__init__(root, **kwargs)
        self._preempt: Any = None
        #: called before an emergency exit (e.g. by trackers), each with a dict: ``code``,
        #: ``reason``, ``step``, ``cancel``, ``rank``, ``world_size``; bounded (see
        #: ``fastckpt.preempt.trigger.EXIT_HOOK_S``), never changes the exit code
        self.on_exit: list = []
        if self.options.grace_s is not None or self.options.preempt:
            self._install_preemption()

    @property
    def preemption(self) -> Any:
        """The preemption trigger (:class:`fastckpt.preempt.Preemption`), None if not armed."""
        return self._preempt

    def _install_preemption(self) -> None:
        from .preempt import Preemption
        self._preempt = Preemption(self)
        self._preempt.install()

    def save(self, state: dict, *, step: int, block: bool = False,
             user_meta: dict | None = None, on_preempt: bool = False) -> SaveHandle | None:
        """Stage ``state`` and write it in the background as step ``step``; collective
        (see :meth:`Engine.save`).

        ``on_preempt=True``: save only if a stop was agreed (docs/preemption.md); returns None
        (about a microsecond, no collective) otherwise. At the agreed step every rank writes an
        emergency checkpoint, passes a barrier and exits the process with the documented code.
        """
        if on_preempt:
            _no_meta_on_preempt(user_meta)
            if self._preempt is None:
                self._check_open()
                self._install_preemption()
            return self._preempt.check(state, step)
        return super().save(state, step=step, block=block, user_meta=user_meta)

    def close(self) -> None:
        if not self._closed and self._preempt is not None:
            self._preempt.close()
        super().close()

    def __enter__(self) -> "Checkpointer":
        return self


def _no_meta_on_preempt(user_meta: dict | None) -> None:
    """An ``on_preempt`` save's emergency checkpoint carries ``{"preempted": True}`` as its
    user_meta: the caller's would be dropped without a word (it was, before 2026-12-07)."""
    if user_meta is not None:
        raise ValueError("user_meta is not saved by save(..., on_preempt=True): its emergency "
                         "checkpoint's user_meta is {'preempted': True}; keep such values in "
                         "the state")


# ------------------------------------------------------------------------------------ one-shots

ONE_SHOT_STAGING_CAP = 256 << 20

def one_shot(path: str | os.PathLike | Storage, **options: Any) -> Checkpointer:
    """The Checkpointer of a one-off call (``save``, ``load``, ``steps``, ...): no signal trap
    whatever ``FASTCKPT_GRACE_S`` says (nothing would act on it, and the job's own Checkpointer
    holds the trap: a one-off call beside it raised), unless the caller asks for one."""
    return Checkpointer(path, **{"grace_s": None, "preempt": False, **options})


#: path -> the Checkpointer that ``save(..., on_preempt=True)`` keeps for the process's lifetime
_ON_PREEMPT: dict[str, Checkpointer] = {}
_ON_PREEMPT_LOCK = threading.Lock()


def save(state: dict, path: str | os.PathLike, *, step: int, on_preempt: bool = False,
         user_meta: dict | None = None, **options: Any) -> SaveHandle | None:
    """Save ``state`` as step ``step`` under ``path`` and block until it is committed (with
    ``remote=URL``: committed locally, then uploaded and committed on the remote tier too).

    ``on_preempt=True``: call it every step; it saves (and exits) only when a stop was agreed,
    through one default Checkpointer per path kept for the process's lifetime.
    """
    if on_preempt:
        _no_meta_on_preempt(user_meta)
        with _ON_PREEMPT_LOCK:
            ck = _ON_PREEMPT.get(str(path))
            if ck is None or ck._closed:
                ck = _ON_PREEMPT[str(path)] = Checkpointer(path, preempt=True, **options)
        return ck.save(state, step=step, on_preempt=True)
    # a blocking save: on a local file system it is written straight from the tensors; where
    # it must be staged (object stores, zero_copy=False), nothing is reused after a one-off
    # save, so it streams through a few buffers rather than stage the whole state into fresh
    # memory first (first-touch page faults cost as much as the write)
    options.setdefault("staging_cap_bytes", ONE_SHOT_STAGING_CAP)
    with one_shot(path, **options) as ck:
        handle = ck.save(state, step=step, block=True, user_meta=user_meta)
        return handle.wait_remote()


def load(state: dict, path: str | os.PathLike, *, step: int | None = None,
         **options: Any) -> int:
    """Load ``step`` (default: newest committed) from ``path`` into ``state`` in place; return
    the step (with ``remote=URL``: the newest of either tier, see ``Checkpointer.last_load``). ``strict=True`` (default): a key the state has and the checkpoint lacks, or the
    reverse, is an error naming it; ``strict=False`` leaves such keys out. Keys are never added
    to ``state``: :func:`read` returns a whole checkpoint."""
    with one_shot(path, **options) as ck:
        return ck.load(state, step=step)


def steps(path: str | os.PathLike, **options: Any) -> list[int]:
    """The committed steps under ``path``, oldest first (no collective)."""
    with one_shot(path, collective=False, **options) as ck:
        return ck.steps()


def latest_step(path: str | os.PathLike, **options: Any) -> int | None:
    """The newest committed step under ``path``, or None (no collective)."""
    with one_shot(path, collective=False, **options) as ck:
        return ck.latest_step()


def read(path: str | os.PathLike, *, step: int | None = None, **options: Any) -> dict:
    """The whole checkpoint of ``step`` (default: newest committed) under ``path`` as a new
    dict of tensors and plain values, as saved (see :meth:`Engine.read`)."""
    with one_shot(path, **options) as ck:
        return ck.read(step=step)
