"""``fastckpt drill``: preempt a real training job on purpose and check everything fastckpt
promises about it (issue 13's "the drill"). Torch-free: torch is imported only by the ranks
(:mod:`fastckpt.drill.worker`).

    from fastckpt.drill import DrillOptions, run_drill
    result = run_drill(DrillOptions(out_dir="/tmp/drill", ranks=2, size_bytes=32 << 20))
    result["passed"]          # every scenario passed

Call sequence (all in the calling process; every wait has a deadline, a job still running at
its deadline is SIGKILLed and its scenario fails):

1. the **reference**: the job run uninterrupted to ``steps`` (shared by every scenario);
2. per **scenario** (a fresh job in ``OUT/<scenario>/``): start the ranks, wait until every
   rank trained past the synchronous checkpoint at ``save_at`` (and ``signal_after`` steps
   more), ``Scenario.act`` delivers the signals (and kills), wait for every rank to exit,
   read the ranks' event logs (``<root>/events/rankNNNNN.jsonl``) for the measurements,
   ``fastckpt verify`` the committed steps, **restart** the job from the newest committed
   checkpoint and run it to the end, compare it with the reference bit-exact (every rank's
   per-step losses, and a SHA-256 of every local tensor at the end: parameter shards, AdamW
   moments and step, the padding), then ``Scenario.judge`` adds the scenario's checks;
3. the result: a dict (written as JSON by the CLI) with the machine, versions, commit, date,
   every measurement and check; :func:`format_matrix` and :func:`write_timeline_png` present it.

Scenarios are :class:`Scenario` objects registered in :data:`SCENARIOS` with :func:`register`
(``one-rank``, ``staggered``, ``peer-killed``, ``short-window``, ``slurm``); a scenario may
bring its own launcher (:class:`Launcher`: ``start(job_path, world, env) -> [RankProcess]``,
used for its job and its restart) and say it cannot run here (``Scenario.available``: then it
is reported as skipped, not failed). ``slurm`` (:class:`SlurmScenario`) is in the default list
only when a Slurm cluster answers (:func:`slurm_unavailable`): it submits the job with
``sbatch`` as ``fastckpt slurm`` prints it (:class:`SlurmLauncher`), cancels it with
``scancel``, checks sacct, and restarts it with a fresh ``sbatch`` of the same script.
Not thread-safe: one drill per process at a time (it owns the processes and jobs it starts).

Modules: ``options.py`` (:class:`DrillOptions`, constants, :class:`DrillError`), ``launch.py``
(launchers, :class:`RankProcess`, :class:`Job`), ``scenarios.py`` (the registry and the
built-in scenarios), ``slurm.py`` (the ``slurm`` scenario and its launcher), ``driver.py``
(:class:`Drill`, :func:`compare`, :func:`run_drill`), ``report.py`` (matrix, notes, PNG),
``worker.py`` (one rank of the training job; the only one that imports torch).
"""

from __future__ import annotations

# the order of the imports is the order of registration: the built-in scenarios, then slurm
from .options import (DRILL_FORMAT, DRILL_VERSION, EXIT_FAILED, EXIT_PREEMPTED, HARD_EXTRA_S,
                      MARKER, POLL_S, SIGKILL, DrillError, DrillOptions)
from .launch import (LAUNCHERS, ForkserverLauncher, Job, Launcher, RankProcess,
                     SubprocessLauncher, free_port, read_events)
from .scenarios import (DEFAULT_SCENARIOS, SCENARIOS, OneRank, PeerKilled, Scenario,
                        ScenarioRun, ShortWindow, Staggered, default_scenarios,
                        judge_committed_stop, judge_previous_intact, judge_restart, register)
from .slurm import (SACCT_WAIT_S, SLURM_ACTIVE, SLURM_CMD_S, SLURM_JOB_NAME, SLURM_PROBE_S,
                    SLURM_PROBE_TTL_S, SlurmLauncher, SlurmRank, SlurmScenario,
                    SlurmSubmission, slurm_env, slurm_kill_wait, slurm_unavailable,
                    srun_task_codes)
from .driver import Drill, compare, prepare_out_dir, run_drill
from .report import (MATRIX_HEADERS, failures, format_matrix, matrix_rows, notes,
                     write_timeline_png)

__all__ = [
    "DEFAULT_SCENARIOS", "DRILL_FORMAT", "DRILL_VERSION", "Drill", "DrillError", "DrillOptions",
    "EXIT_FAILED", "EXIT_PREEMPTED", "ForkserverLauncher", "HARD_EXTRA_S", "Job", "LAUNCHERS",
    "Launcher", "MARKER", "MATRIX_HEADERS", "OneRank", "POLL_S", "PeerKilled", "RankProcess",
    "SACCT_WAIT_S", "SCENARIOS", "SIGKILL", "SLURM_ACTIVE", "SLURM_CMD_S", "SLURM_JOB_NAME",
    "SLURM_PROBE_S", "SLURM_PROBE_TTL_S", "Scenario", "ScenarioRun", "ShortWindow",
    "SlurmLauncher", "SlurmRank", "SlurmScenario", "SlurmSubmission", "Staggered",
    "SubprocessLauncher", "compare", "default_scenarios", "failures", "format_matrix",
    "free_port", "judge_committed_stop", "judge_previous_intact", "judge_restart",
    "matrix_rows", "notes", "prepare_out_dir", "read_events", "register", "run_drill",
    "slurm_env", "slurm_kill_wait", "slurm_unavailable", "srun_task_codes",
    "write_timeline_png",
]
