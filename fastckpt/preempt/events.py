"""The preemption event log: one JSON-lines file per rank, and the job's exit code from it.

Each line is ``{"t", "rank", "pid", "event", ...}``; the events and their fields are listed in
docs/preemption.md. ``python -m fastckpt.preempt EVENTS_DIR`` prints the job's exit code.
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from ..tools.events import job_exit_code  # noqa: F401 - re-exported: the reader is torch-free


class EventLog:
    """JSON-lines events of one rank, flushed per line. Thread-safe; never used by a handler."""

    def __init__(self, path: str | None, rank: int) -> None:
        self.path = path
        self.rank = rank
        self._lock = threading.Lock()
        self._f = None
        if path:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            self._f = open(path, "a", buffering=1)

    def __call__(self, event: str, **fields: Any) -> None:
        if self._f is None:
            return
        rec = {"t": round(time.time(), 6), "rank": self.rank, "pid": os.getpid(),
               "event": event, **fields}
        line = json.dumps(rec, default=str)
        with self._lock:
            try:
                self._f.write(line + "\n")
            except Exception:
                pass

    def close(self) -> None:
        with self._lock:
            if self._f is not None:
                try:
                    self._f.flush()
                    os.fsync(self._f.fileno())
                    self._f.close()
                except Exception:
                    pass
                self._f = None


