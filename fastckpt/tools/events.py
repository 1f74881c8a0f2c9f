"""Reading the preemption event logs the ranks write (``fastckpt.preempt.events.EventLog``):
the job's exit code, for launchers that hide the workers' codes. Torch-free."""

from __future__ import annotations

import json
import os


def last_exits(events_dir: str, *, since: float | None = None) -> list[dict]:
    """Each rank's last ``exit`` event of its last run (after its last ``armed``); [] if none
    or if ``events_dir`` does not exist. ``since`` (Unix time): only events from then on."""
    out = []
    try:
        names = sorted(os.listdir(events_dir))
    except (FileNotFoundError, NotADirectoryError):
        return []
    for name in names:
        if not (name.startswith("rank") and name.endswith(".jsonl")):
            continue
        last = None
        with open(os.path.join(events_dir, name)) as f:
            for line in f:
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
