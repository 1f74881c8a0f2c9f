"""Bounded waits for local file-system calls (LocalStorage's bounded and per-call views).

A local system call cannot be interrupted, and a mount that stops answering (NFS, a failing
device) blocks it for good. So fastckpt stops *waiting*: :func:`hop` runs a call on a pool
thread and waits for it until its bound; past that, a StorageError names the call and the
path, and the call is left to its thread.

A call left to its thread must not do later what the caller was told did not happen.
``hop`` gives each call a record the call reaches through :func:`commit_point` (around the
step that makes its effect visible: a manifest's rename) and :func:`check_abandoned` (before
each removal). When the waiter gives up, it marks the record under the record's lock: from
then on the call's commit point raises instead of renaming and its removals stop, so a late
manifest never lands next to shards the ranks have removed, and a late housekeeping pass never
removes the next save's files. If the waiter cannot take the lock (the rename itself hangs)
or the commit point was passed (the rename landed, the directory fsync hangs), the error says
the outcome is unknown (``outcome_unknown``): the save then keeps its files.

The pool grows on demand (up to :data:`MAX_THREADS`): calls stuck on one mount hold their
threads, and calls on other roots get new ones; a call that found no thread by its bound says
which calls hold them.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from ..errors import StorageError, StorageTimeoutError

#: the least time a bounded call is given when its deadline has passed already (the cleanup
#: after a failed save: milliseconds on a disk that answers)
FLOOR_S = 2.0
#: threads started with the pool (from the thread that opens the first local root: the main
#: thread, not a thread of an exiting interpreter) and the most it grows to
MIN_THREADS = 2
MAX_THREADS = 32
#: how long a waiter that gave up waits for the call's commit-point lock (a rename under way)
LOCK_S = 1.0
#: the per-call bound of calls with no deadline of their own (a load's; a shard write past a
#: short write phase): CALL_S plus the call's bytes at MIN_RATE; the remote backends' too
#: (fsspec_backend.py: ``op_timeout_s``'s default, ``_MIN_RATE``)
CALL_S = 120.0
MIN_RATE = 8 << 20

#: calls that change nothing, by their first word (their error says nothing about an effect)
_READS = ("reading", "listing", "stat")

_local = threading.local()


class _Call:
    __slots__ = ("what", "path", "since", "lock", "gave_up", "landed", "started")

    def __init__(self, what: str, path: str) -> None:
        self.what, self.path, self.since = what, path, time.monotonic()
        self.lock = threading.Lock()
        self.gave_up = self.landed = self.started = False


class _Pool:
    def __init__(self) -> None:
        self.pid = os.getpid()
        self.calls: queue.SimpleQueue = queue.SimpleQueue()
        self.lock = threading.Lock()
        self.threads = self.idle = self.queued = 0  # (queued: put, not yet taken)
        self.busy: dict[int, _Call] = {}
        for _ in range(MIN_THREADS):
            self._start()

    def _start(self) -> None:
        try:
            threading.Thread(target=self._work, name=f"fastckpt-local-{self.threads}",
                             daemon=True).start()
            self.threads += 1
        except RuntimeError:  # (an exiting interpreter: the threads there take it)
            pass

    def submit(self, call: _Call, fut: Any, fn: Any, args: tuple, kw: dict) -> None:
        with self.lock:
            self.queued += 1
            if self.idle < self.queued and self.threads < MAX_THREADS:
                self._start()  # (no waiting thread is left for it)
            self.calls.put((call, fut, fn, args, kw))

    def _work(self) -> None:
        while True:
            with self.lock:
                self.idle += 1
            call, fut, fn, args, kw = self.calls.get()
            with self.lock:
                self.idle -= 1
                self.queued -= 1
                if call.gave_up:  # (its waiter left before it started: it never runs)
                    continue
                call.started = True
                self.busy[id(call)] = call
            _local.call = call
            try:
                fut.set_result(fn(*args, **kw))
            except BaseException as e:  # noqa: BLE001 - carried to the waiter
                fut.set_exception(e)
            finally:
                _local.call = None
                with self.lock:
                    self.busy.pop(id(call), None)
                # (an idle thread keeps nothing of its last call: an error's traceback held
                # the caller's frames, a save's state and engine, until the next call)
                call = fut = fn = args = kw = None

    def oldest(self) -> _Call | None:
        with self.lock:
            return min(self.busy.values(), key=lambda c: c.since, default=None)


_pools: list[_Pool] = []
_pools_lock = threading.Lock()


def pool() -> _Pool:
    with _pools_lock:
        if not _pools or _pools[0].pid != os.getpid():  # (a forked child has no threads)
            _pools[:] = [_Pool()]
        return _pools[0]


class _Future:
    """A result slot (lighter than concurrent.futures.Future: one Event)."""
    __slots__ = ("done", "value", "error")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None

    def set_result(self, v: Any) -> None:
        self.value = v
        self.done.set()

    def set_exception(self, e: BaseException) -> None:
        self.error = e
        self.done.set()


def on_pool() -> bool:
    return getattr(_local, "call", None) is not None


def hop(bound: float, what: str, path: str, fn: Any, *args: Any, **kw: Any) -> Any:
    """``fn(*args, **kw)`` on a pool thread, waited for ``bound`` seconds (see the module
    docstring); from a pool thread, in place (no pool thread waits for another)."""
    if on_pool():
        return fn(*args, **kw)
    p, call, fut = pool(), _Call(what, path), _Future()
    p.submit(call, fut, fn, args, kw)
    if not fut.done.wait(bound):
        _give_up(p, call, fut, bound)
    if fut.error is not None:
        raise fut.error
    return fut.value


def _give_up(p: _Pool, call: _Call, fut: _Future, bound: float) -> None:
    with p.lock:
        started = call.started
        if not started:
            call.gave_up = True  # it never runs
    unknown = False
    if started:
        if call.lock.acquire(timeout=LOCK_S):
            try:
                unknown, call.gave_up = call.landed, True
            finally:
                call.lock.release()
        else:
            unknown = True  # inside its commit point (a rename that hangs)
    if fut.done.is_set():  # (it returned meanwhile)
        return
    if not started:
        old = p.oldest()
        held = (f"; every file-system thread ({p.threads}) is held by a call that has not "
                f"returned, the oldest: {old.what} {old.path}, for "
                f"{time.monotonic() - old.since:.0f} s" if old is not None else "")
        msg = f"{call.what} could not start within its bound ({bound:.1f} s){held}"
    else:
        msg = (f"{call.what} did not return within its bound ({bound:.1f} s): the file system "
               "stopped answering (a hung NFS mount, a failing device?)"
               + ("" if call.what.startswith(_READS) else
                  "; it may have taken effect (outcome unknown)" if unknown else
                  "; it will not take effect (stopped at its commit point)"))
    err = StorageTimeoutError(msg + "; check the mount: the call keeps its thread until it "
                              "returns, and the process may not exit before then",
                              file=call.path)
    err.outcome_unknown = unknown  # type: ignore[attr-defined]
    raise err


@contextmanager
def commit_point() -> Iterator[None]:
    """(the called function) Around the step that makes a call's effect visible: raises
    instead when the waiter gave up; marks the call landed once done."""
    call = getattr(_local, "call", None)
    if call is None:
        yield
        return
    with call.lock:
        if call.gave_up:
            raise StorageError(f"{call.what}: abandoned by its caller (its bound passed); not "
                               "done", file=call.path)
        yield
        call.landed = True


def check_abandoned() -> None:
    """(the called function) Before each removal: raise when the waiter gave up."""
    call = getattr(_local, "call", None)
    if call is not None and call.gave_up:
        raise StorageError(f"{call.what}: abandoned by its caller (its bound passed); "
                           "stopped", file=call.path)
