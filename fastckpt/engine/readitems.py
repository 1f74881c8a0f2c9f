"""What the load's reader threads read (engine/reader.py), and the bounded wait for them.

A read from a local or NFS file system that stops answering blocks its system call for good,
and nothing can interrupt it. The load stops *waiting* instead: when no read has finished for
:func:`stall_s` seconds (:data:`READ_STALL_S` plus the largest read at :data:`MIN_READ_BPS`),
:func:`next_ready` raises a StorageError naming the file, the offset and the length of the read
that has run longest, and the stuck thread is left to its call (a daemon). Its bytes may still
land in the destination later (a direct read writes into the state being loaded): the load
failed, so that state must not be used (load it again once the mount answers).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

from ..errors import StorageError
from ..storage import bounded as _bounded

#: how long the load waits for a read to finish beyond its transfer time (seconds), and the
#: slowest read rate a read is given time for (bytes/s): storage/bounded.py's per-call bound
READ_STALL_S = _bounded.CALL_S
MIN_READ_BPS = _bounded.MIN_RATE


@dataclass
class _Direct:
    """A chunk read straight into its destination tensor (see FastCkptReader._direct_ok)."""
    file: str
    start: int
    reqs: list  # [(read item, fqn, chunk entry, destination)]

    @property
    def length(self) -> int:
        return int(self.reqs[0][2]["length"])


@dataclass
class _Span:
    """A run of needed chunks of one file, read with one request (start is 4096-aligned)."""
    file: str
    start: int
    end: int
    chunks: list = field(default_factory=list)

    @property
    def length(self) -> int:
        return self.end - self.start


class Busy:
    """The reads under way, by reader thread: what a stalled load names."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now: dict[int, tuple] = {}
        self.stalled = False  # set by next_ready when it gave up: the threads are not joined

    def start(self, item) -> None:
        with self._lock:
            self._now[threading.get_ident()] = (item, time.monotonic())

    def end(self) -> None:
        with self._lock:
            self._now.pop(threading.get_ident(), None)

    def oldest(self) -> tuple | None:
        with self._lock:
            return min(self._now.values(), key=lambda v: v[1], default=None)


def stall_s(items: list) -> float:
    """How long the load waits for the next read to finish."""
    return READ_STALL_S + max((it.length for it in items), default=0) / MIN_READ_BPS


def next_ready(ready: queue.Queue, busy: Busy, bound: float, step_dir: str, rank: int):
    """The next finished read from the reader threads, or StorageError when none finished in
    ``bound`` seconds (see the module docstring)."""
    try:
        return ready.get(timeout=bound)
    except queue.Empty:
        pass
    busy.stalled = True
    stuck = busy.oldest()
    what, file, offset = "no read finished", None, None
    if stuck is not None:
        it, since = stuck
        file, offset = f"{step_dir}/{it.file}", it.start
        what = (f"the read of {it.length} bytes has not returned after "
                f"{time.monotonic() - since:.0f} s")
    raise StorageError(
        f"{what} (the load waits {bound:.0f} s for a read): the file system stopped answering "
        "(a hung NFS mount, a failing device?); the load failed and the state it was loading "
        "into must not be used (a stuck read may still write into it)", file=file,
        offset=offset, rank=rank)
