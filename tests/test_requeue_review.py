"""Review of the stop-save-requeue cycle under Slurm (suspicions from earlier reviews).

The supervisor (``fastckpt resume --supervise --requeue``) requeues the job after the ranks'
exit 143 (``scontrol requeue``, ``StartTime=...``, after asking ``sacct`` whether the job was
cancelled). Where the job's SIGKILL ends the supervisor at the same time as the ranks (KillWait
after the SIGTERM of a preemption that cancels), the requeue has to fit in what the ranks left
of the window: the teardown they reserve (``teardown_reserve``: the supervisor's measurements).
Before 2026-12-07 that measurement ended at the launcher's exit, before the requeue, so a save
sized to the window left the requeue no time on every run.

No Slurm here: ``sacct`` and ``scontrol`` are stand-ins on PATH that take their time, as a busy
controller and accounting database do."""

from __future__ import annotations

import json
import os
import sys
import time

from fastckpt.cli import supervise
from fastckpt.preempt.budget import teardown_reserve

SACCT_S = 0.6  # the stand-ins' answer times
SCONTROL_S = 0.3


def _stand_ins(tmp_path, monkeypatch):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    calls = tmp_path / "calls"
    for name, secs, out in (("sacct", SACCT_S, "PREEMPTED"), ("scontrol", SCONTROL_S, "")):
        p = bin_dir / name
        p.write_text(f"#!/bin/sh\nsleep {secs}\necho \"{name} $*\" >> {calls}\n"
                     f"echo '{out}'\n")
        p.chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    return calls


def test_the_reserve_the_next_run_keeps_covers_the_requeue(tmp_path, monkeypatch):
    calls = _stand_ins(tmp_path, monkeypatch)
    events = tmp_path / "events"
    events.mkdir()
    # a rank that logs its stop (exit 143, checkpoint committed) and exits 143 at once
    rank = ("import json, sys, time\n"
            f"with open({str(events / 'rank00000.jsonl')!r}, 'a') as f:\n"
            "    f.write(json.dumps({'event': 'armed', 't': time.time()}) + '\\n')\n"
            "    f.write(json.dumps({'event': 'exit', 'code': 143, 't': time.time()}) + '\\n')\n"
            "sys.exit(143)\n")
    echoed: list[str] = []
    env = {**os.environ, "SLURM_JOB_ID": "4242"}
    code = supervise.run((sys.executable, "-c", rank), env, events=str(events), signal_as=None,
                         echo=echoed.append, requeue=True)
    done = time.time()  # the supervisor's work is over: from here it may be killed
    assert code == 143, echoed
    assert any("job 4242 requeued" in m for m in echoed), echoed
    assert "scontrol requeue 4242" in calls.read_text()
    exit_t = json.loads((events / "rank00000.jsonl").read_text().splitlines()[-1])["t"]
    # what the supervisor needed after the ranks' exit event (the launcher's end, sacct,
    # scontrol requeue, scontrol update): the next run's ranks must keep it out of their window
    needed = done - exit_t
    assert needed >= SACCT_S + 2 * SCONTROL_S
    reserve, source = teardown_reserve(None, 60.0, str(events))
    assert "measured" in source
    assert reserve >= needed, (reserve, needed, (events / "supervisor.jsonl").read_text())


def test_no_requeue_record_without_a_logged_stop(tmp_path, monkeypatch):
    """CMD's own 143 with no rank's exit event (no stop logged): the job is requeued, as
    before, and no teardown is recorded (there is no exit event to measure from)."""
    _stand_ins(tmp_path, monkeypatch)
    events = tmp_path / "events"
    events.mkdir()
    echoed: list[str] = []
    code = supervise.run((sys.executable, "-c", "raise SystemExit(143)"),
                         {**os.environ, "SLURM_JOB_ID": "4243"}, events=str(events),
                         signal_as=None, echo=echoed.append, requeue=True)
    assert code == 143 and any("job 4243 requeued" in m for m in echoed), echoed
    assert not (events / "supervisor.jsonl").exists()
    assert teardown_reserve(None, 60.0, str(events))[1] == "default (not measured)"
