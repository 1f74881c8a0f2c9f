"""The handle of one save: its two completions, *staged* and *committed*."""

from __future__ import annotations

import threading


class SaveHandle:
    """The two completions of one save: *staged* and *committed*. Thread-safe.

    ``staged`` is true once the state was copied: the tensors may be modified again.
    ``wait()`` blocks until the save is committed (durable) and re-raises any failure of the
    background write, naming the rank(s) and file.
    """

    def __init__(self, step: int, path: str) -> None:
        self.step = step
        self.path = path
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
        self._done.wait(timeout)
        return self._exc

    def wait(self, timeout: float | None = None) -> "SaveHandle":
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
        if self._exc is not None:
            self._reported = True
            raise self._exc
        return self

    def take_failure(self) -> BaseException | None:
        """The failure of a finished save, marked as observed: neither the next ``save`` nor
        ``close`` raises it again. None while running or when it committed."""
        if not self._done.is_set() or self._exc is None:
            return None
        self._reported = True
        return self._exc

    def wait_remote(self, timeout: float | None = None) -> "SaveHandle":
        """Block until the step is committed on the remote tier too; raise the upload's
        failure. Returns at once when there is no remote tier, and once a deferred step is
        replaced by a newer one (``remote_state`` None or "skipped")."""
        if self.remote_state is None:
            return self
        if not self._remote_done.wait(timeout):
            raise TimeoutError(f"upload of step {self.step} still running after {timeout}s")
        if self._remote_exc is not None:
            self._remote_reported = True
            raise self._remote_exc
        return self

    @property
    def remote_committed(self) -> bool:
        return self.remote_state == "committed"

    def _remote_begin(self) -> None:
        self.remote_state = "pending"
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
