"""Preemption: signal trap, out-of-band stop consensus, grace budget, emergency save, exit.

* :mod:`.signals` -- the signal trap (the only code in fastckpt that installs handlers);
* :mod:`.trigger` -- ``Preemption``: the watcher, the stop consensus, the emergency path and
  the exit, driven by ``Checkpointer.save(state, step=s, on_preempt=True)``;
* :mod:`.budget` -- what fits the grace window, decided alike on every rank;
* :mod:`.events` -- the per-rank event log and the job's exit code from it
  (``python -m fastckpt.preempt EVENTS_DIR``).

See docs/preemption.md.
"""

from .events import EventLog, job_exit_code
from .trigger import EXIT_CANCELLED, EXIT_FAILED, EXIT_PREEMPTED, HARD_EXTRA_S, POLL_S, Preemption

__all__ = ["Preemption", "EventLog", "job_exit_code", "EXIT_PREEMPTED", "EXIT_CANCELLED",
           "EXIT_FAILED", "POLL_S", "HARD_EXTRA_S"]
