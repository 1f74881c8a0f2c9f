"""Experiment trackers (W&B, MLflow) that show how a job ended, and a run that survives restarts.

    import fastckpt
    from fastckpt import trackers

    ckpt = fastckpt.Checkpointer("/nvme/ckpt/run42", grace_s=30)
    tracker = trackers.MlflowRun(experiment="run42")     # or trackers.WandbRun(project="run42")
    state = {"model": model, "optim": optim, "tracker": tracker}
    start = ckpt.resume(state)          # restores tracker.run_id when a checkpoint exists
    tracker.start(ckpt)                 # rank 0: a new run, or the checkpoint's run again
    for step in range(start or 0, total):
        loss = train_step()
        tracker.log({"loss": loss}, step=step)
        ckpt.save(state, step=step + 1, on_preempt=True)
    tracker.finish()                    # the normal end: FINISHED / exit code 0
    ckpt.close()

Why: a preempted job that is restarted should go on in the same tracker run, and the run should
say what happened to it. The run id is part of the training state (this object is Stateful:
``state_dict()`` is ``{"run_id": ..., "tracker": "wandb"|"mlflow"}``, stored as plain JSON), so
``resume`` puts it back before the run is started; and ``start`` adds a hook to
``ckpt.on_exit`` that the preemption trigger calls before its emergency exit:

============  ====  ===========================================  ==========================
outcome       exit  W&B                                          MLflow status
============  ====  ===========================================  ==========================
preempted     143   ``mark_preempting()``, ``finish(exit_code=   KILLED
                    143)``: shown "preempted"
cancelled     0     tag ``cancelled``, ``finish(exit_code=0)``   FINISHED
failed        144   ``finish(exit_code=144)``: "failed"          FAILED
``finish()``        ``finish(exit_code=0)``                      FINISHED
exception in        ``finish(exit_code=1)``                      FAILED
``with``
============  ====  ===========================================  ==========================

Each end also records ``fastckpt/exit`` (the outcome) and, for a stop, the stop step and exit
code: W&B run summary keys ``fastckpt/...``, MLflow tags ``fastckpt.exit``,
``fastckpt.exit_code``, ``fastckpt.stop_step``, ``fastckpt.reason``.

Call sequence (every rank runs the same script):

1. (all ranks) ``ckpt.resume(state)``: a checkpoint's ``{"run_id"}`` is loaded into the tracker
   (``load_state_dict``); nothing is contacted.
2. (all ranks) ``tracker.start(ckpt)``: rank 0 starts the run (W&B ``wandb.init(id=run_id,
   resume="allow")``; MLflow ``mlflow.start_run(run_id=run_id)``, or a new run when there is no
   id) and the id is sent to every rank over the Checkpointer's process group (a bounded
   exchange: ``timeout_s``), so every rank's state holds the same id from the next save on. A
   failure on rank 0 is raised on every rank. Only rank 0 talks to the tracker; ``log`` and
   ``finish`` do nothing on the others.
3. (rank 0) ``tracker.log(metrics, step=s)``.
4. (trigger's hook thread, all ranks, at an emergency exit) the outcome above; bounded by the
   trigger (``fastckpt.preempt.trigger.EXIT_HOOK_S`` and the grace deadline): the run is
   finished before the process exits.
5. (rank 0) ``tracker.finish()`` at the normal end, or leave a ``with tracker.start(ckpt):``
   block.

Put the tracker in the state from the first save on: a checkpoint saved without the key does
not load into a state that has it (``strict``; load with ``strict=False`` once). The packages
are imported only when a run starts; ``pip install 'fastckpt[wandb]'`` /
``'fastckpt[mlflow]'`` installs the tested versions. Not thread-safe, except that the exit hook
may run in the trigger's thread while the training thread waits in the emergency path.
See docs/integrations/trackers.md.
"""

from __future__ import annotations

import atexit
import importlib
import logging
import threading
import time
from typing import Any

from .errors import FastCkptError

__all__ = ["TrackerRun", "WandbRun", "MlflowRun", "TrackerError"]

log = logging.getLogger("fastckpt")

#: how long a second ``finish`` waits for one already running in another thread
_CLOSE_WAIT_S = 2.0


class TrackerError(FastCkptError):
    """A tracker run could not be started or resumed, or a checkpoint belongs to another run."""


def _require(module: str, extra: str, who: str) -> Any:
    """Import an optional tracker package, or say which extra installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"fastckpt.trackers.{who} needs the {module!r} package, which is not installed: "
            f"pip install 'fastckpt[{extra}]'") from e


def _outcome(info: dict) -> str:
    """The ``ckpt.on_exit`` info -> "preempted", "cancelled" or "failed"."""
    from .preempt import EXIT_CANCELLED, EXIT_PREEMPTED
    code = info.get("code")
    if code == EXIT_CANCELLED and info.get("cancel"):
        return "cancelled"
    if code == EXIT_PREEMPTED:
        return "preempted"
    return "failed"


class TrackerRun:
    """One tracker run kept across restarts through the checkpoint; see the module docstring.

    Subclasses implement ``_open(run_id) -> run_id`` (start or continue the run, on rank 0),
    ``_log(metrics, step)`` and ``_close(outcome, code, info)`` (end the run; ``info`` is the
    ``ckpt.on_exit`` dict, or None for ``finish`` and ``with``).

    Not thread-safe: call it from the training thread; only the exit hook may run in another
    thread (the trigger's), while the training thread waits in the emergency path.
    """

    kind = ""  # stored with the run id: a W&B id is not loaded into an MLflow tracker

    def __init__(self) -> None:
        #: the run's id: None until started, or restored by ``ckpt.resume``
        self.run_id: str | None = None
        self.rank: int | None = None  # set by start
        self.outcome: str | None = None  # how the run ended, once it has
        self._lock = threading.Lock()

    # -- Stateful ------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"run_id": self.run_id, "tracker": self.kind}

    def load_state_dict(self, sd: dict) -> None:
        if not isinstance(sd, dict) or "run_id" not in sd:
            raise TrackerError(f"{type(self).__name__}: the checkpoint holds {sd!r} where a "
                               "tracker's {'run_id': ...} was expected")
        rid, kind = sd["run_id"], sd.get("tracker", self.kind)
        if kind != self.kind:
            raise TrackerError(f"{type(self).__name__}: the checkpoint's run {rid!r} is a "
                               f"{kind!r} run, not a {self.kind!r} run")
        if rid is not None and not isinstance(rid, str):
            raise TrackerError(f"{type(self).__name__}: the checkpoint's run id {rid!r} is not "
                               "a string")
        if rid is None:
            return  # saved before a run was started: nothing to continue
        if self.rank is not None and rid != self.run_id:
            raise TrackerError(
                f"{type(self).__name__}: already started as run {self.run_id!r}, but the "
                f"checkpoint belongs to run {rid!r}: call ckpt.resume(state) before "
                "tracker.start(ckpt)")
        self.run_id = rid

    # -- lifecycle ------------------------------------------------------------------------------
    def start(self, ckpt: Any, *, timeout_s: float = 300.0) -> "TrackerRun":
        """Start the run on rank 0 (continuing ``run_id`` if one was restored), give every rank
        its id, and register the exit hook on ``ckpt``. Collective: every rank of ``ckpt``
        calls it; the others wait at most ``timeout_s`` for rank 0. Returns self."""
        if self.rank is not None:
            raise TrackerError(f"{type(self).__name__}: run {self.run_id!r} was already started")
        rank = ckpt.rank
        mine: dict = {"run_id": None, "error": None}
        if rank == 0:
            try:
                mine["run_id"] = self._open(self.run_id)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                if ckpt.world_size == 1:
                    if isinstance(e, ImportError):
                        raise
                    raise TrackerError(f"{type(self).__name__}: could not start run "
                                       f"{self.run_id!r}: {type(e).__name__}: {e}",
                                       rank=0) from e
                mine["error"] = f"{type(e).__name__}: {e}"
        first = ckpt.group.decide(mine, _rank_0s, timeout_s=timeout_s,
                                  what="tracker.start: sharing rank 0's run id")
        if first["error"] is not None:
            raise TrackerError(f"{type(self).__name__}: rank 0 could not start run "
                               f"{self.run_id!r}: {first['error']}", rank=rank)
        self.run_id = first["run_id"]
        self.rank = rank
        if self._on_exit not in ckpt.on_exit:
            ckpt.on_exit.append(self._on_exit)
        return self

    def log(self, metrics: dict, *, step: int | None = None) -> None:
        """Log ``metrics`` (name -> number) at ``step`` (rank 0; nothing elsewhere)."""
        if self.rank is None:
            raise TrackerError(f"{type(self).__name__}: log before start(ckpt)")
        if self.rank == 0 and self.outcome is None:
            self._log(metrics, step)

    def finish(self) -> None:
        """The normal end (FINISHED, exit code 0). Idempotent: a run the exit hook already
        ended keeps that outcome."""
        self._end("finished", 0, None)

    def __enter__(self) -> "TrackerRun":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if exc_type is None:
            self._end("finished", 0, None)
        elif issubclass(exc_type, SystemExit) and exc.code in (0, None):
            self._end("finished", 0, None)
        else:
            code = exc.code if isinstance(getattr(exc, "code", None), int) else 1
            self._end("failed", code, None)

    # -- ending ---------------------------------------------------------------------------------
    def _on_exit(self, info: dict) -> None:
        """``ckpt.on_exit`` hook (the trigger's hook thread)."""
        self._end(_outcome(info), int(info.get("code", 1)), info)

    def _end(self, outcome: str, code: int, info: dict | None) -> None:
        if self.rank != 0:
            if self.rank is not None:
                self.outcome = self.outcome or outcome
            return
        if not self._lock.acquire(timeout=_CLOSE_WAIT_S):
            log.warning("fastckpt: %s: another thread is still ending run %s after %.0f s; "
                        "not ending it again", type(self).__name__, self.run_id, _CLOSE_WAIT_S)
            return
        try:
            if self.outcome is not None:
                self._after_end()
                return
            t0 = time.monotonic()
            self._close(outcome, code, info)
            self.outcome = outcome
            log.info("fastckpt: %s: run %s ended %s (exit code %d) in %.2f s",
                     type(self).__name__, self.run_id, outcome, code, time.monotonic() - t0)
        finally:
            self._lock.release()

    def _after_end(self) -> None:
        """``finish`` or ``with`` after the exit hook ended the run (hook for subclasses)."""

    # -- backend --------------------------------------------------------------------------------
    def _open(self, run_id: str | None) -> str:
        raise NotImplementedError

    def _log(self, metrics: dict, step: int | None) -> None:
        raise NotImplementedError

    def _close(self, outcome: str, code: int, info: dict | None) -> None:
        raise NotImplementedError


def _stop_fields(outcome: str, code: int, info: dict | None) -> dict:
    out: dict = {"exit": outcome, "exit_code": code}
    if info is not None:
        out["stop_step"] = info.get("step")
        out["reason"] = str(info.get("reason", ""))[:2000]
    return out


class WandbRun(TrackerRun):
    """A Weights & Biases run. ``init_kwargs`` go to ``wandb.init`` (``project``, ``entity``,
    ``name``, ``config``, ``tags``, ``group``, ``settings``, ``mode``...); a restored run id is
    passed as ``id=`` with ``resume=resume`` ("allow": continue it, or create it when the
    server does not have it, e.g. an offline run never synced; "must": fail then).

    ``run`` is the ``wandb`` Run on rank 0 once started (None elsewhere).
    """

    kind = "wandb"

    def __init__(self, *, resume: str = "allow", **init_kwargs: Any) -> None:
        super().__init__()
        if resume not in ("allow", "must"):
            raise ValueError(f"resume must be 'allow' or 'must', got {resume!r}")
        self.resume = resume
        self.init_kwargs = dict(init_kwargs)
        self.run: Any = None

    def _open(self, run_id: str | None) -> str:
        wandb = _require("wandb", "wandb", "WandbRun")
        kw = dict(self.init_kwargs)
        if run_id is not None:
            kw.update(id=run_id, resume=self.resume)
        self.run = wandb.init(**kw)
        return str(self.run.id)

    def _log(self, metrics: dict, step: int | None) -> None:
        self.run.log(metrics, step=step)

    def _close(self, outcome: str, code: int, info: dict | None) -> None:
        run = self.run
        if outcome == "preempted":
            run.mark_preempting()  # first: it is sent to the service at once
        if outcome == "cancelled":
            run.tags = tuple(run.tags or ()) + ("cancelled",)
        run.summary.update({f"fastckpt/{k}": v
                            for k, v in _stop_fields(outcome, code, info).items()})
        run.finish(exit_code=code)


class MlflowRun(TrackerRun):
    """An MLflow run. A new run is created in ``experiment`` (a name; the current experiment
    when None) with ``run_name`` and ``tags``; ``tracking_uri`` is set with
    ``mlflow.set_tracking_uri`` when given (else MLflow's own default: ``MLFLOW_TRACKING_URI``).

    The run is started with ``mlflow.start_run`` on the thread that calls ``start``, so
    ``mlflow.log_*`` calls there log into it. ``run`` is the ``ActiveRun`` on rank 0 (None
    elsewhere).

    MLflow keeps the active run per thread and ends it FINISHED at interpreter exit; an exit
    hook (another thread) therefore sets the status through the client and ends the thread's
    active run with that same status at exit, before MLflow's own handler would.
    """

    kind = "mlflow"

    def __init__(self, *, experiment: str | None = None, run_name: str | None = None,
                 tags: dict | None = None, tracking_uri: str | None = None) -> None:
        super().__init__()
        self.experiment = experiment
        self.run_name = run_name
        self.tags = dict(tags or {})
        self.tracking_uri = tracking_uri
        self.run: Any = None
        self._client: Any = None
        self._thread: int | None = None
        self._status: str | None = None

    _STATUS = {"preempted": "KILLED", "cancelled": "FINISHED", "failed": "FAILED",
               "finished": "FINISHED"}

    def _open(self, run_id: str | None) -> str:
        mlflow = _require("mlflow", "mlflow", "MlflowRun")
        if self.tracking_uri is not None:
            mlflow.set_tracking_uri(self.tracking_uri)
        if run_id is None:
            if self.experiment is not None:
                mlflow.set_experiment(self.experiment)
            self.run = mlflow.start_run(run_name=self.run_name, tags=self.tags or None)
        else:
            self.run = mlflow.start_run(run_id=run_id)
        self._thread = threading.get_ident()
        self._client = mlflow.MlflowClient()
        return str(self.run.info.run_id)

    def _log(self, metrics: dict, step: int | None) -> None:
        import mlflow
        mlflow.log_metrics(metrics, step=step, run_id=self.run_id)

    def _close(self, outcome: str, code: int, info: dict | None) -> None:
        # the status and the exit handler first, the server's calls after: a hook left behind
        # on a slow server (the trigger waits for it at most 5 s) still ends the run with its
        # status, not MLflow's own FINISHED at exit (before 2026-12-06 a preempted run could
        # show FINISHED)
        self._status = self._STATUS[outcome]
        own = threading.get_ident() == self._thread
        if not own:
            atexit.register(self._end_fluent)  # runs before MLflow's (registered at its import)
        for k, v in _stop_fields(outcome, code, info).items():
            self._client.set_tag(self.run_id, f"fastckpt.{k}", str(v))
        if own:
            self._end_fluent(terminate=True)
            return
        self._client.set_terminated(self.run_id, self._status)

    def _after_end(self) -> None:
        if threading.get_ident() == self._thread:
            self._end_fluent()

    def _end_fluent(self, terminate: bool = False) -> None:
        """End this run as this thread's active run, if it still is, with its status (else,
        with ``terminate``, through the client)."""
        import mlflow
        active = mlflow.active_run()
        if active is not None and active.info.run_id == self.run_id:
            mlflow.end_run(self._status or "FINISHED")
        elif terminate:
            self._client.set_terminated(self.run_id, self._status or "FINISHED")


def _rank_0s(values: list) -> Any:
    """(rank 0, ``Group.decide``) rank 0's value: its run id or its error."""
    return values[0]
