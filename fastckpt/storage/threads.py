"""The save path's worker threads: a fixed pool that still runs work while the interpreter
exits.

``concurrent.futures.ThreadPoolExecutor`` refuses every ``submit`` once the interpreter has
begun to exit (its exit hook runs before ``atexit``), so a job that returns right after an
async ``save`` lost that save: the writer, finishing it from the ``atexit`` close, could not
write its shard files ("cannot schedule new futures after interpreter shutdown"). This pool
has no such switch, and its threads are started when it is made (in a save, never at exit:
Python 3.12 refuses to start a thread then). The threads are daemons: a pool whose owner
never closes it does not keep the process alive.
"""

from __future__ import annotations

import queue
import threading
import time
from concurrent.futures import Executor, Future
from typing import Any, Callable

_STOP = None


class Threads(Executor):
    """``n`` worker threads taking ``submit``-ed calls in order; ``shutdown`` ends them after
    the calls already submitted."""

    def __init__(self, n: int, name: str) -> None:
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True)
                         for i in range(max(1, int(n)))]
        for t in self._threads:
            t.start()

    @property
    def size(self) -> int:
        return len(self._threads)

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future:
        fut: Future = Future()
        with self._lock:
            if self._closed:
                raise RuntimeError("fastckpt: submit to a closed thread pool")
            self._calls.put((fut, fn, args, kwargs))
        return fut

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        with self._lock:
            if not self._closed:
                self._closed = True
                for _ in self._threads:
                    self._calls.put(_STOP)
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()

    def join(self, until: float | None = None) -> bool:
        """(after ``shutdown``) Wait for the threads to end, until ``until`` at most
        (``time.monotonic()``; None: no bound); whether they all did."""
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(None if until is None else max(0.0, until - time.monotonic()))
        return not any(t.is_alive() for t in self._threads if t is not threading.current_thread())

    def _work(self) -> None:
        while True:
            call = self._calls.get()
            if call is _STOP:
                return
            fut, fn, args, kwargs = call
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - carried to the caller by the future
                fut.set_exception(e)
            else:
                fut.set_result(result)
