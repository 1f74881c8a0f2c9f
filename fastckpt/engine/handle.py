"""The handle of one save: its two completions, *staged* and *committed*; and the save as
the writer takes it (:class:`Job`)."""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import StorageError

if TYPE_CHECKING:
    from .plan import SavePlan

#: how long past a save's own deadlines its handle is still waited for by a ``wait()`` without
#: a timeout (the writer's phases each end by theirs: see :meth:`SaveHandle.bound`)
STUCK_SLACK_S = 60.0


class SaveHandle:
    """The two completions of one save: *staged* and *committed*. Thread-safe.

    ``staged`` is true once the state was copied: the tensors may be modified again.
    ``wait()`` blocks until the save is committed (durable) and re-raises any failure of the
    background write, naming the rank(s) and file.
    """

    def __init__(self, step: int, path: str, bound: float | None = None) -> None:
        self.step = step
        self.path = path
        #: (``time.monotonic()``) when waiting for this save stops with a StorageError: the
        #: writer's phases (the writes, the commit exchange, the housekeeping) each end by
        #: ``commit_timeout_s`` (an emergency save: by its deadline), so a save still running
        #: past them all is held by a call that will not return (a hung mount). None: no bound
        self.bound = bound
        self._staged = threading.Event()
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._reported = False
        self.bytes_written = 0  # stored (compressed) bytes
        self.raw_bytes = 0
        self.timings: dict[str, float] = {}
        #: (step, error) of an earlier save that failed unobserved, set by an emergency save
        #: (which does not raise it)
        self.earlier_failure: tuple[int, BaseException] | None = None
        #: the remote tier (``Checkpointer(..., remote=...)``): None (no remote tier),
        #: "deferred" (uploaded once the uploader is free, unless a newer step replaces it),
        #: "skipped" (replaced: it stays local), "pending" (uploading), "committed", "failed"
        self.remote_state: str | None = None
        self._remote_done = threading.Event()
        self._remote_exc: BaseException | None = None
        self._remote_reported = False
        #: (``time.monotonic()``) when ``wait_remote()`` without a timeout stops with a
        #: StorageError: the tier sets it from the upload's deadlines (engine/tiering.py)
        self.remote_bound: float | None = None
        #: whether this save compressed and why (``compression="auto"``: the measurement)
        self.compression: dict = {}

    @property
    def staged(self) -> bool:
        return self._staged.is_set()

    @property
    def committed(self) -> bool:
        return self._done.is_set() and self._exc is None

    def done(self) -> bool:
        return self._done.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The save's failure, None if it committed or is still running after ``timeout``
        seconds (without one: until the save's bound, then StorageError, as ``wait``)."""
        if timeout is None:
            self._wait_done(None)
        else:
            self._done.wait(timeout)
        return self._exc

    def wait(self, timeout: float | None = None) -> "SaveHandle":
        """Block until the save is committed, or ``timeout`` seconds (TimeoutError); raise its
        failure. Without a timeout the wait still ends at the save's own bound (``bound``):
        a StorageError saying it is stuck."""
        self._wait_done(timeout)
        if self._exc is not None:
            self._reported = True
            raise self._exc
        return self

    def _wait_done(self, timeout: float | None) -> None:
        if timeout is not None or self.bound is None:
            if not self._done.wait(timeout):
                raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
            return
        if not self._done.wait(max(0.0, self.bound - time.monotonic())):
            raise StorageError(
                f"the save of step {self.step} is still running past its deadlines (its "
                "writes, its commit exchange and its housekeeping are each bounded by "
                "commit_timeout_s): a write or file-system call is stuck (a hung NFS mount, a "
                "failing device?); whether it commits is unknown, the steps committed before it "
                "are untouched, and this Checkpointer cannot save or load until it ends",
                file=self.path)

    def take_failure(self) -> BaseException | None:
        """The failure of a finished save, marked as observed: neither the next ``save`` nor
        ``close`` raises it again. None while running or when it committed."""
        if not self._done.is_set() or self._exc is None:
            return None
        self._reported = True
        return self._exc

    def wait_remote(self, timeout: float | None = None) -> "SaveHandle":
        """Block until the step is committed on the remote tier too, or ``timeout`` seconds
        (TimeoutError); raise the upload's failure. Returns at once when there is no remote
        tier, and once a deferred step is replaced by a newer one (``remote_state`` None or
        "skipped"). Without a timeout the wait still ends at the upload's bound
        (``remote_bound``, moved on when the upload begins): a StorageError saying it is
        stuck (before 2026-12-06 it waited for good)."""
        if self.remote_state is None:
            return self
        end = None if timeout is None else time.monotonic() + timeout
        while not self._remote_done.is_set():
            until = end if end is not None else self.remote_bound
            left = None if until is None else until - time.monotonic()
            if left is not None and left <= 0:
                if end is not None:
                    raise TimeoutError(f"upload of step {self.step} still running after "
                                       f"{timeout}s")
                raise StorageError(
                    f"the upload of step {self.step} to the remote tier ({self.remote_state}) "
                    "is still running past its deadlines (each bounded by commit_timeout_s): "
                    "a call is stuck (a hung mount or store?); the step is committed locally",
                    file=self.path)
            self._remote_done.wait(None if left is None else min(left, 1.0))
        if self._remote_exc is not None:
            self._remote_reported = True
            raise self._remote_exc
        return self

    @property
    def remote_committed(self) -> bool:
        return self.remote_state == "committed"

    def _remote_begin(self, bound: float | None = None) -> None:
        self.remote_state = "pending"
        self.remote_bound = bound if bound is not None else self.remote_bound
        self._remote_done.clear()

    def _remote_finish(self, exc: BaseException | None) -> None:
        self._remote_exc = exc
        self.remote_state = "failed" if exc is not None else "committed"
        self._remote_done.set()

    def _finish(self, exc: BaseException | None) -> None:
        self._exc = exc
        if exc is not None and self.remote_state in ("pending", "deferred"):  # never committed
            self._remote_finish(exc)
        self._done.set()

    def __repr__(self) -> str:
        state = ("committed" if self.committed else "failed" if self.done()
                 else "staged" if self.staged else "staging")
        return f"<SaveHandle step={self.step} {state} {self.path}>"


@dataclass
class Job:
    """One save, from the training thread to the writer."""
    plan: SavePlan
    handle: SaveHandle
    step_dir: str
    user_meta: dict = field(default_factory=dict)
    t0: float = 0.0
    #: (piece, buffer, hashes, ready) as they are staged; (None, error, ...) when staging failed
    pieces: queue.Queue = field(default_factory=queue.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)  # superseded: stop early
    failed: threading.Event = field(default_factory=threading.Event)  # (writer) staging stops
    deadline: float | None = None  # monotonic; the emergency save's commit deadline
    files: set = field(default_factory=set)  # (coordinator) the shard files it committed
    #: this rank's shard files as written (name, size, chunks): the remote tier uploads them
    my_files: list = field(default_factory=list)
    #: this rank's chunk index ({"file", "size", "checksum"}) when the plan is indexed
    my_index: dict | None = None
    manifest: bytes | None = None  # (coordinator) the manifest's bytes, once committed
    upload: bool = False  # hand it to the remote tier once committed (the plan decided)
    compress: bool = False  # encode the pieces (engine/compress.py)
    write_deadline: float = 0.0  # (monotonic) the write phase's, set by the writer
    #: the Engine, kept alive while the writer holds the job: its atexit close (a weak
    #: reference) then finishes the save of a Checkpointer the program dropped (lost before)
    owner: Any = None
