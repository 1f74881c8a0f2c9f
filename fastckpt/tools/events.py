"""Reading the preemption event logs the ranks write (``fastckpt.preempt.events.EventLog``):
the job's exit code, for launchers that hide the workers' codes. Torch-free."""

from __future__ import annotations

import json
import os


def job_exit_code(events_dir: str, *, since: float | None = None) -> int | None:
    """The job's exit code from the ranks' event logs: the highest last ``exit`` code, None if
    no rank logged one (a normal finish or a crash), or if ``events_dir`` does not exist.
    ``since`` (Unix time): only events logged from then on (this run's, not an earlier
    incarnation's). For launchers that hide the workers' codes (torchrun exits 1):
    ``torchrun ...; exit $(python -m fastckpt.preempt ROOT/events $?)``."""
    codes = []
    try:
        names = sorted(os.listdir(events_dir))
    except (FileNotFoundError, NotADirectoryError):
        return None
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
                    last = e.get("code")
        if last is not None:
            codes.append(int(last))
    return max(codes) if codes else None
