"""Reading the preemption event logs the ranks write (``fastckpt.preempt.events.EventLog``):
the job's exit code, for launchers that hide the workers' codes. Torch-free."""

from __future__ import annotations

import json
import logging
import os
import stat

log = logging.getLogger("fastckpt")

#: how much of a rank's log is read (its end): the last run's events are there
TAIL_BYTES = 16 << 20


#: the bound on reading the logs (small files; the supervisor reads them inside the grace
#: window, after the ranks exited): past it, a mount that stopped answering gives []
READ_S = 10.0


def last_exits(events_dir: str, *, since: float | None = None) -> list[dict]:
    """Each rank's last ``exit`` event of its last run (after its last ``armed``); [] if none,
    if ``events_dir`` does not exist, or if it cannot be read within ``READ_S`` (a hung mount:
    a warning says so). ``since`` (Unix time): only events from then on."""
    from ..errors import StorageError
    from ..storage import bounded
    try:
        return bounded.hop(READ_S, "reading the event logs", events_dir, _last_exits,
                           events_dir, since)
    except StorageError as e:
        log.warning("fastckpt: %s; the job's exit code is the launcher's", e)
        return []


def _last_exits(events_dir: str, since: float | None) -> list[dict]:
    out = []
    try:
        names = sorted(os.listdir(events_dir))
    except OSError:  # (absent, not a directory, unreadable)
        return []
    for name in names:
        if not (name.startswith("rank") and name.endswith(".jsonl")):
            continue
        last = None
        for line in _tail_lines(os.path.join(events_dir, name)):
            try:
                e = json.loads(line)
            except ValueError:
                continue
            if not isinstance(e, dict) or (since is not None and not (
                    isinstance(e.get("t"), (int, float)) and e["t"] >= since)):
                continue
            if e.get("event") == "armed":
                last = None  # a newer run of the job starts here
            elif e.get("event") == "exit" and isinstance(e.get("code"), int):
                last = e
        if last is not None:
            out.append(last)
    return out


def job_exit_code(events_dir: str, *, since: float | None = None) -> int | None:
    """The job's exit code from the ranks' event logs: the highest last ``exit`` code, None if
    no rank logged one (a normal finish or a crash), or if ``events_dir`` does not exist.
    ``since`` (Unix time): only events logged from then on (this run's, not an earlier
    incarnation's). For launchers that hide the workers' codes (torchrun exits 1):
    ``torchrun ...; exit $(python -m fastckpt.preempt ROOT/events $?)``."""
    codes = [int(e["code"]) for e in last_exits(events_dir, since=since)]
    return max(codes) if codes else None


def _tail_lines(path: str) -> list[str]:
    """The lines of the end of a rank's log; [] for anything but a readable regular file (a
    FIFO blocked the supervisor's open for good, a directory or an unreadable file lost the
    job's exit code before 2026-12-06). Bytes that are not UTF-8 are replaced."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
    except OSError:
        return []
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            return []
        start = max(0, info.st_size - TAIL_BYTES)
        data = os.pread(fd, info.st_size - start, start)
    except OSError:
        return []
    finally:
        os.close(fd)
    lines = data.decode("utf-8", "replace").splitlines()
    return lines[1:] if start else lines  # (the first one cut)

