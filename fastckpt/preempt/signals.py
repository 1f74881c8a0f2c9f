"""The signal trap: the only place in fastckpt that installs signal handlers.

A ``SignalTrap`` installs Python handlers for the configured signals that only append
``(signum, time)`` to a list, and ``signal.set_wakeup_fd`` on a pipe, so the C-level handler
wakes the watcher thread at once, even while the training thread is blocked in a C call or a
collective. Earlier handlers are chained (Python callables) and restored by ``close``; a forked
child (a DataLoader worker) gets them back at fork and never acts on a signal. One trap per
process holds the signals (the process-wide registry ``_active``: signal handlers are
process-global by nature).

Call sequence: ``install`` (main thread) -> the watcher calls ``poll(timeout)`` in a loop and
gets each delivered signal once -> ``close`` (main thread). ``request`` (any thread) injects a
stop from code (``-1`` preempt, ``-2`` cancel).
"""

from __future__ import annotations

import logging
import math
import os
import select
import signal
import threading
import time
from typing import Any

log = logging.getLogger("fastckpt.preempt")

_lock = threading.Lock()
_active: "SignalTrap | None" = None  # the one trap holding the signal handlers
_fork_hook = False

REQUEST_PREEMPT = -1
REQUEST_CANCEL = -2


def signame(num: int) -> str:
    if num == REQUEST_PREEMPT:
        return "request_stop"
    if num == REQUEST_CANCEL:
        return "request_cancel"
    try:
        return signal.Signals(num).name
    except ValueError:
        return str(num)


#: signals an orchestrator sends as a warning before the stop, whose default action kills
_WARNINGS = frozenset(getattr(signal, n) for n in ("SIGUSR1", "SIGUSR2") if hasattr(signal, n))


def _exit_as_default(signum: int, frame: object) -> None:
    os._exit(128 + signum)  # (what the default disposition does, less a core dump)


def _default():
    """The handler that stands for "the default": SIG_DFL, except in a PID namespace's init
    (a container's PID 1: ``fastckpt resume ROOT -- CMD`` in exec form), to which the kernel
    delivers no signal left at its default: a closed job ignored the kubelet's SIGTERM there
    and waited for its SIGKILL (before 2026-12-06)."""
    return _exit_as_default if os.getpid() == 1 else signal.SIG_DFL


def _after_fork_child() -> None:
    """In a forked child (DataLoader worker): give the signals back, never act on them."""
    trap = _active
    if trap is None:
        return
    trap.forked = True
    try:
        signal.set_wakeup_fd(-1)
        for sig, old in trap.old_handlers.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
    except Exception:  # noqa: BLE001 - best effort in a child that will not act on signals
        pass


class SignalTrap:
    """Records the configured signals for one watcher. Thread-safety: the handler appends, the
    watcher reads (GIL-ordered list operations)."""

    def __init__(self, signals: set[int]) -> None:
        self.signals = set(signals)
        self.old_handlers: dict[int, Any] = {}
        self.forked = False
        self.trapped: list[str] = []  # names of the signals handled (empty off the main thread)
        self._handler_sigs: list[tuple[int, float]] = []  # appended by the handlers only
        self._seen = 0
        # deliveries per signal, as the wakeup fd and as the handler counted them, and as
        # returned (see ``poll``)
        self._by_fd: dict[int, int] = {}
        self._by_handler: dict[int, int] = {}
        self._returned: dict[int, int] = {}
        self._old_wakeup = -1
        self._rfd = self._wfd = -1
        self._pid = os.getpid()

    def install(self) -> None:
        """(main thread) Take the signals; raises if another trap of this process holds them.
        Off the main thread nothing is installed (``request`` still works)."""
        global _active, _fork_hook
        with _lock:
            if _active is not None and _active is not self:
                raise RuntimeError("another Checkpointer already holds the preemption trap in "
                                   "this process; close it first")
            _active = self
            if not _fork_hook:
                os.register_at_fork(after_in_child=_after_fork_child)
                _fork_hook = True
        if threading.current_thread() is not threading.main_thread():
            return
        self._rfd, self._wfd = os.pipe()
        os.set_blocking(self._rfd, False)
        os.set_blocking(self._wfd, False)
        for s in sorted(self.signals):
            self.old_handlers[s] = signal.signal(s, self._handler)
            self.trapped.append(signame(s))
        self._old_wakeup = signal.set_wakeup_fd(self._wfd, warn_on_full_buffer=False)

    def close(self, *, ignore: bool = False) -> None:
        """(main thread) Give the signals back to their earlier handlers; ``ignore``: ignore
        them instead, for a process on its way out after its stop (a late SIGTERM during the
        interpreter's and torch's teardown, seconds long, would turn the stop's exit code into
        death by that signal, which schedulers read differently). A warning signal (SIGUSR1,
        SIGUSR2) whose earlier handler was the default (terminate) is ignored from then on:
        the orchestrator sends it only because the job asked for a warning (``--signal``), and
        a job that ends its work near its time limit must not die of the warning in its
        teardown (CI caught a finished Slurm job marked FAILED, 138). SIGTERM gets its default
        back (as PID 1, a container's init, to which the kernel delivers no signal left at
        its default: a handler that exits 128 + N, as the default would). Idempotent."""
        global _active
        if not self.forked and threading.current_thread() is threading.main_thread():
            try:
                if self._rfd >= 0:
                    signal.set_wakeup_fd(self._old_wakeup)
                for s, old in self.old_handlers.items():
                    if signal.getsignal(s) != self._handler:
                        continue  # a handler installed after ours (Lightning's, submitit's)
                    default = old is None or old == signal.SIG_DFL
                    signal.signal(s, signal.SIG_IGN if ignore or (default and s in _WARNINGS)
                                  else _default() if default else old)
            except Exception as e:  # noqa: BLE001
                log.warning("fastckpt: could not restore signal handlers: %s", e)
        self.old_handlers = {}
        for fd in (self._rfd, self._wfd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self._rfd = self._wfd = -1
        with _lock:
            if _active is self:
                _active = None

    def _handler(self, signum: int, frame: Any) -> None:
        """(main thread, between bytecodes) Record only."""
        if os.getpid() != self._pid:  # a forked child that kept the handler: act as before
            old = self.old_handlers.get(signum)
            signal.signal(signum, old if old is not None else signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self._handler_sigs.append((signum, time.time()))
        old = self.old_handlers.get(signum)
        if callable(old) and old is not signal.default_int_handler:
            old(signum, frame)  # chain a Python-level handler installed before ours

    def request(self, cancel: bool = False) -> None:
        """(any thread) A stop asked for from code, e.g. a cloud termination-notice poller."""
        self._handler_sigs.append((REQUEST_CANCEL if cancel else REQUEST_PREEMPT, time.time()))
        if self._wfd >= 0:
            try:
                os.write(self._wfd, b"\0")
            except OSError:
                pass

    @property
    def has_fd(self) -> bool:
        """Deliveries wake ``poll`` through the wakeup fd (``wake`` ends a wait early)."""
        return self._rfd >= 0

    def wake(self) -> None:
        """(any thread) End a ``poll`` in progress (nothing is recorded)."""
        if self._wfd >= 0:
            try:
                os.write(self._wfd, b"\0")
            except OSError:
                pass

    def poll(self, timeout: float | None, stop: threading.Event) -> tuple[bool, list[tuple]]:
        """(watcher) Wait up to ``timeout`` (None: until a delivery or ``wake``; only with the
        wakeup fd) for a delivery; (woke, [(signum, wall time, source)])
        of the signals not returned before. Both the wakeup fd (it counts a delivery while the
        main thread is busy in C code) and the handler (it runs once the main thread gets back
        to Python) count each delivery; a signal is returned as often as the larger count
        grew. The handler's count alone still tells when the wakeup fd is no longer ours: a
        library that sets its own (asyncio's ``add_signal_handler``) resets it to -1 when its
        loop closes, and a SIGTERM after that was recorded and never acted on."""
        woke = False
        out: list[tuple] = []
        fd = self._rfd
        if fd >= 0:
            # poll(2), not select(2): select refuses an fd above 1023 (a process with many open
            # files, sockets or simulated ranks), and that failure returned at once, every time:
            # the signal thread spun on a core instead of waiting
            p = select.poll()
            p.register(fd, select.POLLIN)
            try:
                r = p.poll(None if timeout is None else max(0, math.ceil(timeout * 1000)))
            except OSError:
                r = []
            if r and not r[0][1] & select.POLLIN:
                # POLLNVAL/POLLHUP: the pipe was closed under us (close()): wait as the no-fd
                # path does, not spin
                stop.wait(timeout if timeout is not None else 0.1)
                r = []
            if r:
                woke = True
                try:
                    data = os.read(fd, 512)
                except OSError:
                    data = b""
                for b in data:
                    if b in self.signals:
                        self._by_fd[b] = self._by_fd.get(b, 0) + 1
                if self._old_wakeup >= 0 and data:
                    try:
                        os.write(self._old_wakeup, data)  # chain the previous wakeup fd
                    except OSError:
                        pass
        else:
            stop.wait(timeout if timeout is not None else 0.1)
        last: dict[int, float] = {}
        while self._seen < len(self._handler_sigs):
            signum, t = self._handler_sigs[self._seen]
            self._seen += 1
            if signum < 0:
                out.append((signum, t, "request"))
            else:
                self._by_handler[signum] = self._by_handler.get(signum, 0) + 1
                last[signum] = t
        now = time.time()
        for signum in sorted(self.signals):
            fd, handler = self._by_fd.get(signum, 0), self._by_handler.get(signum, 0)
            for _ in range(max(fd, handler) - self._returned.get(signum, 0)):
                out.append((signum, last.get(signum, now),
                            "wakeup_fd" if fd >= handler else "handler"))
            self._returned[signum] = max(fd, handler, self._returned.get(signum, 0))
        return woke, out
