"""What a drill runs (:class:`DrillOptions`), the constants every part of the drill shares,
and :class:`DrillError` (a job that did not do what its scenario needs)."""

from __future__ import annotations

import signal
from dataclasses import dataclass

#: fastckpt.preempt's exit codes and watchdog delay (not imported: that package loads torch)
EXIT_PREEMPTED = 143
EXIT_FAILED = 144
HARD_EXTRA_S = 3.0
#: the drill's own exit semantics (the CLI maps them): every scenario passed / one failed
DRILL_FORMAT = "fastckpt-drill"
DRILL_VERSION = 1
MARKER = ".fastckpt-drill"  # a directory holding it is a drill's output (safe to clear)
POLL_S = 0.005  # how often the driver reads the ranks' progress and event logs
SIGKILL = getattr(signal, "SIGKILL", 9)


class DrillError(Exception):
    """A job of the drill did not do what the scenario needs (it ended early, it hung): the
    scenario fails with this message. Not raised out of :func:`run_drill`."""


@dataclass(frozen=True, kw_only=True)
class DrillOptions:
    """What to drill. Frozen; validated at construction (ValueError says what to change).

    out_dir: where every job's checkpoint root, logs and outputs go (``OUT/<scenario>/``).
    ranks: processes per job (at least 2: the drill is about agreement between ranks).
    size_bytes: state per rank, as a padding tensor beside the model and AdamW state.
    grace_s: the grace window of every scenario but ``short-window``.
    short_window_s: ``short-window``'s window (None: ``min(grace_s, 3)``); its disk is
        throttled so that the state needs the whole window to be written.
    steps: training steps of every job (the reference's, and the restarts run to it).
    step_s: seconds each step sleeps (the compute of the small model is a few ms).
    save_at: the step (steps done) saved and committed synchronously before any signal: the
        checkpoint a preemption that cannot save, or fails, leaves to restart from.
    signal_after: steps trained after ``save_at`` before the signal.
    launcher: ``"forkserver"`` (ranks forked from a server that imported torch once: fast) or
        ``"subprocess"`` (each rank a fresh ``python -m fastckpt.drill.worker``).
    backend: ``"auto"`` (NCCL when every rank has a GPU, else gloo), ``"gloo"``, ``"nccl"``.
    seed: the staggered scenario's signal order and gaps.
    job_timeout_s: deadline for a job to reach the signal point, or to finish (restarts).
    hang_after_s: a signalled job still running this long after its window and fastckpt's
        watchdog delay (3 s) is hung: its ranks are SIGKILLed and the scenario fails.
    tamper: drill self-test only: ``"param-ulp"`` makes every restart move one parameter by
        one ulp, so the restart comparison must fail.
    """

    out_dir: str
    ranks: int = 2
    size_bytes: int = 32 << 20
    grace_s: float = 10.0
    short_window_s: float | None = None
    scenarios: tuple[str, ...] = ()
    steps: int = 30
    step_s: float = 0.03
    save_at: int = 4
    signal_after: int = 2
    launcher: str = "forkserver"
    backend: str = "auto"
    seed: int = 0
    job_timeout_s: float = 180.0
    hang_after_s: float = 15.0
    tamper: str | None = None

    def __post_init__(self) -> None:
        from .launch import LAUNCHERS
        from .scenarios import SCENARIOS
        if not isinstance(self.ranks, int) or self.ranks < 2:
            raise ValueError(f"ranks must be at least 2 (got {self.ranks!r}): the drill checks "
                             "that ranks agree on a stop")
        if self.size_bytes < 0:
            raise ValueError(f"size must be >= 0 bytes, got {self.size_bytes}")
        if not self.grace_s > 0:
            raise ValueError(f"grace must be > 0 seconds, got {self.grace_s}")
        if self.short_window_s is not None and not self.short_window_s > 0:
            raise ValueError(f"short_window_s must be > 0 seconds, got {self.short_window_s}")
        if self.save_at < 1 or self.signal_after < 1:
            raise ValueError("save_at and signal_after must be at least 1")
        if self.steps < self.save_at + self.signal_after + 5:
            raise ValueError(f"steps={self.steps} leaves no room for the stop: give at least "
                             f"save_at + signal_after + 5 = "
                             f"{self.save_at + self.signal_after + 5} (more on a loaded machine)")
        if not self.hang_after_s >= 0 or not self.job_timeout_s > 0:
            raise ValueError("hang_after_s must be >= 0 and job_timeout_s > 0")
        if not self.step_s >= 0:
            raise ValueError(f"step_s must be >= 0, got {self.step_s}")
        if self.launcher not in LAUNCHERS:
            raise ValueError(f"unknown launcher {self.launcher!r}; one of {sorted(LAUNCHERS)}")
        if self.backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"unknown backend {self.backend!r}; one of auto, gloo, nccl")
        unknown = [s for s in self.scenarios if s not in SCENARIOS]
        if unknown:
            raise ValueError(f"unknown scenario(s) {unknown}; one of {sorted(SCENARIOS)}")
        if self.tamper not in (None, "param-ulp"):
            raise ValueError(f"unknown tamper {self.tamper!r} (only 'param-ulp')")

    @property
    def chosen(self) -> tuple[str, ...]:
        """The scenarios to run: ``scenarios``, else :func:`default_scenarios` (the
        always-on ones, and ``slurm`` when a Slurm cluster answers)."""
        from .scenarios import default_scenarios
        return self.scenarios or default_scenarios()

    @property
    def short_window(self) -> float:
        return self.short_window_s if self.short_window_s is not None else min(self.grace_s, 3.0)

