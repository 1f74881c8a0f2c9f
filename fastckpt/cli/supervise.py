"""``fastckpt resume ROOT --supervise -- CMD``: run CMD as a child, pass the stop signals on,
and exit with the job's code. Torch-free.

Why not exec: a launcher between the job system and the ranks decides what the job system
sees. torchrun dies of SIGUSR1 (Slurm's usual ``--signal``) without telling its workers, and
exits 1 after its workers saved and exited 143, so the job ends FAILED and is never requeued.
Here the supervisor is the process the job system signals:

1. it starts CMD (same process group, same environment plus FASTCKPT_RESUME_*),
2. every stop signal it receives goes to CMD: SIGINT as SIGINT, and SIGTERM, SIGUSR1, SIGUSR2
   and SIGHUP as ``--signal-as`` (default: SIGTERM when CMD is torchrun, which forwards only
   SIGTERM/SIGINT to its workers; else the same signal). When CMD is srun only SIGUSR1 and
   SIGUSR2 are passed on: srun passes those through to its tasks but turns SIGTERM, SIGHUP and
   SIGQUIT into SIGKILL, and Slurm sends its own SIGTERM (scancel, time limit, preemption) to
   the step's tasks itself,
3. when CMD has exited it ignores further signals and exits with the stop's code the ranks
   logged in the event log of this run (143 preempted, 0 cancelled, 144 failed: see
   docs/preemption.md), or CMD's own code when no rank logged a stop (a normal finish or a
   crash), 128 + N when CMD died of signal N,
4. with ``--requeue``, inside a Slurm job: on 143 it requeues the job (``scontrol requeue``,
   ``StartTime=now``; not a cancelled job), see :mod:`fastckpt.tools.slurm`.

It waits for CMD as long as CMD runs (the training job itself); the job system's SIGKILL
bounds that, as it bounds every process of the job.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import time

EXIT_PREEMPTED = 143  # fastckpt.preempt.EXIT_PREEMPTED (this module is torch-free)
#: signals passed on to CMD (SIGINT as itself, the rest as ``signal_as``)
STOP_SIGNALS = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGHUP")


def is_torchrun(cmd: tuple[str, ...]) -> bool:
    """CMD is torchrun (``torchrun ...`` or ``python -m torch.distributed.run ...``)."""
    if not cmd:
        return False
    if os.path.basename(cmd[0]) == "torchrun":
        return True
    return any(a == "-m" and b in ("torch.distributed.run", "torch.distributed.launch")
               for a, b in zip(cmd, cmd[1:]))


#: torchrun's wait between passing a stop signal on and SIGKILLing its workers when neither
#: --shutdown-timeout nor TORCH_ELASTIC_SHUTDOWN_TIMEOUT sets it (torch 2.13)
TORCHRUN_SHUTDOWN_S = 30
_SHUTDOWN_ENV = "TORCH_ELASTIC_SHUTDOWN_TIMEOUT"


def _torchrun_option(cmd: tuple[str, ...], *names: str) -> str | None:
    """The value of a torchrun option (``--name V`` or ``--name=V``) before the script."""
    for i, a in enumerate(cmd):
        key, eq, val = a.partition("=")
        if key in names:
            return val if eq else (cmd[i + 1] if i + 1 < len(cmd) else None)
        if a.endswith(".py"):  # the training script: its own options follow
            return None
    return None


def torchrun_signals(cmd: tuple[str, ...]) -> set[str]:
    """The signals CMD's torchrun is told to pass on to its workers as themselves
    (``--signals-to-handle``); empty when CMD is not torchrun or the option is not given
    (older torchrun dies of SIGUSR1: it is then passed on as SIGTERM)."""
    if not is_torchrun(cmd):
        return set()
    val = _torchrun_option(cmd, "--signals-to-handle", "--signals_to_handle")
    return {n.strip().upper() for n in (val or "").split(",") if n.strip()}


def torchrun_env(cmd: tuple[str, ...], env: dict) -> dict:
    """For CMD torchrun: ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` covering the ranks' longest grace
    window (+ 5 s), unless it or ``--shutdown-timeout`` is set. torchrun SIGKILLs its workers
    30 s after passing the stop on: ranks told of a longer window (FASTCKPT_GRACE_S,
    FASTCKPT_SIGNAL_GRACE_S, a platform's) were killed mid-save, and torchrun's exit 1 then
    made the job a failure (before 2026-12-06)."""
    if (not is_torchrun(cmd) or _SHUTDOWN_ENV in env
            or _torchrun_option(cmd, "--shutdown-timeout", "--shutdown_timeout") is not None):
        return {}
    from ..options import options_from_env, platform_grace
    try:
        o = options_from_env(environ=env)
    except ValueError:  # a bad FASTCKPT_* variable: the ranks will say so
        return {}
    window = max([o.grace_s or platform_grace(env)[1], *(o.signal_grace_s or {}).values()])
    secs = math.ceil(window) + 5
    return {_SHUTDOWN_ENV: str(secs)} if secs > TORCHRUN_SHUTDOWN_S else {}


def event_log_env(path: str) -> dict:
    """The environment that points the ranks' event log at ``path`` (the ``event_log``
    option)."""
    from ..options import EVENT_LOG_ENV
    return {EVENT_LOG_ENV: path}


def local_events(root: str) -> str:
    """The event log directory a supervisor gives ranks saving to a remote ROOT (their log
    is read here, on this machine): one per user and root under the temporary directory,
    the same across requeues (the teardown measurements stay)."""
    import hashlib
    import tempfile
    tag = hashlib.sha1(root.encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"fastckpt-events-{os.getuid()}-{tag}")


def is_srun(cmd: tuple[str, ...]) -> bool:
    return bool(cmd) and os.path.basename(cmd[0]) == "srun"


def events_dir(root: str) -> str | None:
    """Where the ranks log their stop: the ``event_log`` option (FASTCKPT_EVENT_LOG), else
    ``ROOT/events`` for a local root; None for a remote root without it (the ranks' log is
    not on this machine)."""
    from ..options import options_from_env
    try:
        configured = options_from_env().event_log
    except ValueError:  # another FASTCKPT_* variable is bad: the ranks will say so
        configured = None
    if configured:
        return configured
    if "://" in root and not root.startswith("file://"):
        return None
    return os.path.join(root.removeprefix("file://"), "events")


#: stop signals received before CMD started (see :func:`catch_early`)
_early: list[int] = []


def catch_early() -> None:
    """(first thing in ``resume --supervise``) Record the stop signals until CMD runs;
    :func:`run` passes them on once it does. A container's PID 1 with no handler loses a
    signal (the kernel drops it), and any other process dies of it: before 2026-12-06 the
    handlers came after reading ROOT (seconds for a remote one), and a pod deleted meanwhile
    trained on until the SIGKILL with no emergency checkpoint."""
    for s in [signal.SIGINT] + [signal.Signals[n] for n in STOP_SIGNALS]:
        signal.signal(s, lambda signum, frame: _early.append(signum))


def run(cmd: tuple[str, ...], env: dict, *, events: str | None, signal_as: str | None,
        echo, requeue: bool = False) -> int:
    """Run CMD to its end; the job's exit code (see the module's docstring)."""
    code, exit_t = _run(cmd, env, events=events, signal_as=signal_as, echo=echo)
    job = env.get("SLURM_JOB_ID")
    if requeue and code == EXIT_PREEMPTED:
        if job:
            from ..tools.slurm import requeue_self
            requeued = requeue_self(job, echo)
            if exit_t is not None:
                # the requeue runs inside the window too (the job's SIGKILL ends this process,
                # and a requeue not made by then is never made): the teardown the next runs
                # keep out of their window covers it (before 2026-12-07 it ended at the
                # launcher's exit, and a save filling the window left no time to requeue)
                _record(events, {"event": "requeue", "requeued": requeued,
                                 "teardown_s": round(max(0.0, time.time() - exit_t), 3)})
        else:
            echo("fastckpt: --requeue: not in a Slurm job (no SLURM_JOB_ID): nothing to requeue")
    return code


def _run(cmd: tuple[str, ...], env: dict, *, events: str | None, signal_as: str | None,
         echo) -> tuple[int, float | None]:
    """(the job's exit code, the time of the ranks' last exit event, None if none logged)"""
    from ..tools.events import last_exits
    srun = is_srun(cmd) and not signal_as
    as_sig = signal.Signals[signal_as] if signal_as else (
        signal.SIGTERM if is_torchrun(cmd) else None)
    as_itself = set() if signal_as else torchrun_signals(cmd)  # (torchrun passes those on)
    started = time.time()
    child = subprocess.Popen(list(cmd), env=env)
    received: list[int] = []

    def forward(signum: int, frame: object) -> None:
        received.append(signum)
        if srun and signum not in (signal.SIGUSR1, signal.SIGUSR2):
            return  # Slurm signals the step's tasks itself; srun would SIGKILL them
        to = (signum if signum == signal.SIGINT or as_sig is None
              or signal.Signals(signum).name in as_itself else as_sig)
        try:
            child.send_signal(to)
        except ProcessLookupError:
            pass

    sigs = [signal.SIGINT] + [signal.Signals[n] for n in STOP_SIGNALS]
    for s in sigs:
        signal.signal(s, forward)
    while _early:  # (those of the start, now that CMD runs)
        forward(_early.pop(0), None)
    rc = child.wait()  # the handlers run in between; the wait resumes (PEP 475)
    for s in sigs:  # from here only the exit code is left to compute: nothing may kill that
        signal.signal(s, signal.SIG_IGN)
    ended = time.time()
    own = 128 - rc if rc < 0 else rc
    exits = last_exits(events, since=started) if events else []
    logged = max(int(e["code"]) for e in exits) if exits else None
    names = ", ".join(signal.Signals(s).name for s in received) or "none"
    if logged is not None:
        # the ranks' (and the launcher's) teardown after their exit event: not in the grace
        # budget yet, so the window has to leave this much free (docs/preemption.md)
        exit_t = max(float(e["t"]) for e in exits)
        teardown = max(0.0, ended - exit_t)
        echo(f"fastckpt: {cmd[0]} exited {own}; the ranks logged a stop with exit code "
             f"{logged} (signals passed on: {names}); teardown after the exit event "
             f"{teardown:.1f} s: exiting {logged}")
        _record(events, {"event": "supervisor_exit", "code": logged, "launcher_code": own,
                         "teardown_s": round(teardown, 3), "signals": names})
        return logged, exit_t
    if received:
        echo(f"fastckpt: {cmd[0]} exited {own} after signals {names}; no rank logged a stop "
             f"in {events}: exiting {own}")
    return own, None


def _record(events: str | None, rec: dict) -> None:
    """One line in ``events/supervisor.jsonl`` (best effort: the exit code matters more)."""
    if not events:
        return
    try:
        with open(os.path.join(events, "supervisor.jsonl"), "a", encoding="utf-8") as f:
            f.write(json.dumps({"t": round(time.time(), 6), "pid": os.getpid(), **rec}) + "\n")
    except OSError:
        pass
