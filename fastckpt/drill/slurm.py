"""The ``slurm`` scenario: the job submitted with ``sbatch`` as ``fastckpt slurm`` prints
it (:class:`SlurmLauncher`, one srun task per rank), cancelled with ``scancel``, checked
against sacct and srun's report, restarted with a fresh ``sbatch`` of the same script. In
the default drill only when a Slurm cluster answers (:func:`slurm_unavailable`)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import socket
import subprocess
import sys
import time
from typing import Any

from .launch import Job, Launcher, RankProcess, _read_jsonl
from .options import SIGKILL, DrillError, DrillOptions
from .scenarios import Scenario, ScenarioRun, judge_committed_stop, register

#: seconds ``sinfo`` may take to answer before the cluster counts as absent (with a
#: SLURM_CONF that names a missing file, sinfo retries for 60 s)
SLURM_PROBE_S = 5.0
#: how long a probe's answer is reused (per SLURM_CONF and PATH)
SLURM_PROBE_TTL_S = 30.0
#: bound of each other Slurm command (sbatch, scancel, scontrol, sacct)
SLURM_CMD_S = 30.0
#: seconds the judge waits for accounting to show the jobs' end (sacct lags the controller)
SACCT_WAIT_S = 30.0
SLURM_JOB_NAME = "fastckpt-drill"
SACCT_FIELDS = ("JobID", "State", "ExitCode", "DerivedExitCode", "Submit", "Start", "End",
                "Partition", "NodeList")
#: JobStates of a job that is still there (queued, starting, running, ending, requeued)
SLURM_ACTIVE = frozenset({"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED",
                          "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "RESIZING", "SIGNALING",
                          "STAGE_OUT", "STOPPED", "SPECIAL_EXIT", "RESV_DEL_HOLD"})
_NODE_USABLE = ("idle", "mix", "alloc", "comp", "plnd")
_probe_cache: dict[tuple, tuple[float, Any]] = {}


def slurm_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the drill's Slurm commands and jobs (sbatch's default --export=ALL
    hands it to the ranks): the caller's, SLURM_CONF included, without an outer job's
    SLURM_*/SBATCH_*/SRUN_*/SALLOC_* variables or torch.distributed's rendezvous variables
    (each rank gets its own from Slurm); the running Python's bin directory first on PATH
    (``fastckpt``, ``python``), the directory fastckpt is imported from first on PYTHONPATH,
    OMP_NUM_THREADS=1; then ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k == "SLURM_CONF" or not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
              "MASTER_PORT", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID"):
        env.pop(k, None)
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join(
        [bindir] + [d for d in env.get("PATH", "").split(os.pathsep) if d and d != bindir])
    src = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = os.pathsep.join(
        [src] + [d for d in env.get("PYTHONPATH", "").split(os.pathsep) if d and d != src])
    env["OMP_NUM_THREADS"] = "1"
    env.update(extra or {})
    return env


def _slurm(args: list[str], timeout: float = SLURM_CMD_S, env: dict | None = None,
           cwd: str | None = None) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of a Slurm command; 127 when it is not on PATH, 124 when it
    did not answer within ``timeout`` (then killed; stderr: what it wrote until then)."""
    try:
        p = subprocess.run(args, env=env or slurm_env(), cwd=cwd, capture_output=True,
                           text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    except FileNotFoundError:
        return 127, "", f"{args[0]}: not found on PATH"
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        return 124, "", err or ""
    except OSError as e:
        return 126, "", f"{args[0]}: {e}"
    return p.returncode, p.stdout, p.stderr


def _lines(text: str, prog: str) -> list[str]:
    """Non-empty lines, each without the ``prog: `` Slurm puts before its messages."""
    return [ln.strip().removeprefix(f"{prog}: ") for ln in (text or "").splitlines()
            if ln.strip()]


def _probe_key() -> tuple:
    return os.environ.get("SLURM_CONF"), os.environ.get("PATH")


def slurm_unavailable() -> str | None:
    """None when a Slurm cluster answers in the caller's environment (``sinfo -h`` within
    SLURM_PROBE_S) and has a partition up with a node that can run jobs; else why not, e.g.
    ``no Slurm cluster answers (sinfo: fatal: Could not establish a configuration source)``.
    Cached per SLURM_CONF and PATH for SLURM_PROBE_TTL_S."""
    key = ("sinfo",) + _probe_key()
    hit = _probe_cache.get(key)
    if hit is not None and time.monotonic() - hit[0] < SLURM_PROBE_TTL_S:
        return hit[1]
    rc, out, err = _slurm(["sinfo", "-h", "-o", "%P|%a|%t|%D"], timeout=SLURM_PROBE_S)
    why = None
    if rc != 0:
        lines = _lines(err, "sinfo")
        if rc == 124:  # the first line says why it retries; the rest repeats it
            detail = f"no answer within {SLURM_PROBE_S:g} s" + (f"; {lines[0]}" if lines else "")
        else:
            detail = lines[-1] if lines else f"exit code {rc}"
        why = f"no Slurm cluster answers (sinfo: {detail})"
    else:
        rows = [ln.split("|") for ln in out.splitlines() if ln.strip()]
        usable = [r for r in rows if len(r) == 4 and r[1] == "up"
                  and r[2].rstrip("~#!%$@^-+") in _NODE_USABLE]
        if not usable:
            why = ("no Slurm node can run a job (sinfo: partition/avail/state/nodes " +
                   (", ".join("/".join(r) for r in rows[:8]) or "no partition") + ")")
    _probe_cache[key] = (time.monotonic(), why)
    return why


def slurm_kill_wait() -> int | None:
    """The cluster's KillWait (``scontrol show config``): the window between the SIGTERM of
    scancel (or of the time limit) and the SIGKILL; None when scontrol does not say."""
    key = ("killwait",) + _probe_key()
    hit = _probe_cache.get(key)
    if hit is not None and time.monotonic() - hit[0] < SLURM_PROBE_TTL_S:
        return hit[1]
    rc, out, _ = _slurm(["scontrol", "show", "config"], timeout=10)
    kw = None
    for line in out.splitlines() if rc == 0 else []:
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "KillWait" and parts[2].isdigit():
            kw = int(parts[2])
    _probe_cache[key] = (time.monotonic(), kw)
    return kw


def _slurm_time(v: str | None) -> float | None:
    try:
        return time.mktime(time.strptime(v or "", "%Y-%m-%dT%H:%M:%S"))
    except ValueError:  # Unknown, None
        return None


class SlurmSubmission:
    """One sbatch of the drill's job script: the job id, when it was submitted, the script's
    SHA-256, and Slurm's view of the job (``scontrol show job``, then ``sacct`` once purged)."""

    def __init__(self, job_id: str, tag: str, submit_t: float, script: str, sha256: str,
                 out: str, logs: str) -> None:
        self.job_id, self.tag, self.submit_t = job_id, tag, submit_t
        self.script, self.sha256, self.out, self.logs = script, sha256, out, logs
        self.cancel_t: float | None = None
        self.killed = False
        self.requeued = False  # seen back in the queue after its run (then ended)
        self.info: dict[str, str] = {}
        self.ranks: list[SlurmRank] = []
        self._state, self._polled = "PENDING", -1e9

    @property
    def log(self) -> str:
        """The batch script's output: the supervisor's lines (``--output=LOGS/%x-%j.out``)."""
        return os.path.join(self.logs, f"{SLURM_JOB_NAME}-{self.job_id}.out")

    def log_text(self) -> str:
        try:
            with open(self.log, errors="replace") as f:
                return f.read()
        except OSError:
            return ""

    def state(self, max_age_s: float = 0.5) -> str:
        """The JobState (polled at most every ``max_age_s``); a failing controller keeps the
        last one."""
        if time.monotonic() - self._polled < max_age_s:
            return self._state
        self._polled = time.monotonic()
        rc, out, err = _slurm(["scontrol", "show", "job", "-o", self.job_id], timeout=10)
        if rc == 0 and out.strip():
            self.info = dict(re.findall(r"(\S+?)=(.*?)(?=\s+[A-Za-z][\w:/]*=|$)",
                                        out.strip().splitlines()[0]))
            self._state = self.info.get("JobState", self._state)
        elif "invalid job id" in err.lower():  # purged (MinJobAge after its end)
            rows = self.sacct()
            self._state = rows[-1]["State"].split()[0] if rows else "GONE"
        return self._state

    def active(self, max_age_s: float = 0.5) -> bool:
        return self.state(max_age_s) in SLURM_ACTIVE

    def sacct(self) -> list[dict]:
        """The job's allocation rows (``sacct -X --duplicates``: one per run of a requeued
        job), since a minute before it was submitted (a reused job id's old rows never count)."""
        since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(self.submit_t - 60))
        rc, out, _ = _slurm(["sacct", "-X", "-P", "-n", "--duplicates", "-S", since, "-j",
                             self.job_id, "-o", ",".join(SACCT_FIELDS)], timeout=15)
        rows = [dict(zip(SACCT_FIELDS, ln.split("|"))) for ln in out.splitlines() if ln.strip()]
        return [r for r in rows if r.get("JobID") == self.job_id]

    def wait_ended(self, timeout: float = SACCT_WAIT_S) -> list[dict]:
        """The sacct rows once accounting shows the job ended (or at the deadline)."""
        end = time.monotonic() + timeout
        while True:
            rows = self.sacct()
            if rows and all(r["State"].split()[0] not in SLURM_ACTIVE for r in rows) \
                    and not self.active(0):
                return rows
            if time.monotonic() > end:
                return rows
            time.sleep(0.5)

    def cancel(self) -> tuple[int, str]:
        """``scancel JOB``: Slurm sends SIGTERM to every process of the job, SIGKILL KillWait
        later. (exit code, message)."""
        self.cancel_t = time.time()
        rc, out, err = _slurm(["scancel", self.job_id])
        self._polled = -1e9
        return rc, (out + err).strip()

    def settle(self, timeout: float = SACCT_WAIT_S) -> None:
        """Wait until the job has left Slurm (COMPLETING included: its supervisor decides on
        the requeue last). A job requeued after its run (PENDING again) is noted and ended: it
        would run beside the next job on the same checkpoint root."""
        end = time.monotonic() + timeout
        while self.active(0.2) and time.monotonic() < end:
            if self.state(0.2) in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED"):
                self.requeued = True
                self.kill()
            time.sleep(0.2)
        if self.active(0):
            self.kill()

    def kill(self) -> bool:
        """End the job now (SIGKILL to every step, then scancel); False if it is gone."""
        if self.killed or not self.active(0):
            return False
        self.killed = True
        _slurm(["scancel", "--signal=KILL", "--full", self.job_id])
        _slurm(["scancel", self.job_id])
        self._polled = -1e9
        return True


class SlurmRank(RankProcess):
    """A rank that srun started in the drill's Slurm job (the task process itself, see
    :func:`fastckpt.drill.worker.task`). Slurm reports no per-task exit code for a
    cancelled step, so the code is the one the rank recorded as it exited
    (``exit-<tag>-r<r>.json``); the end is when the driver sees the process gone (its pid and
    start time from ``task-<tag>-r<r>.json``, on this host), else the record's time. A rank
    gone without a record, or still without one when the job has left Slurm, was killed with
    the job (SIGKILL: KillWait over, or the drill's kill): -9, ``no_exit_record``. A SIGKILL
    "to the rank" ends the whole job."""

    def __init__(self, rank: int, sub: SlurmSubmission, out: str, tag: str) -> None:
        super().__init__(rank, 0, lambda: None)
        self.pid = None  # type: ignore[assignment]  # known once the task record exists
        self.sub, self.out, self.tag = sub, out, tag
        self.task: dict | None = None
        self.exit_record: dict | None = None
        self.no_exit_record = False

    def _record(self, kind: str) -> dict | None:
        try:
            with open(os.path.join(self.out, f"{kind}-{self.tag}-r{self.rank}.json")) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def started(self) -> dict | None:
        if self.task is None:
            self.task = self._record("task")
            if self.task is not None:
                self.pid = int(self.task["pid"])
        return self.task

    def _alive(self) -> bool | None:
        """Whether the rank's process still exists (None: not on this host, or not known)."""
        t = self.task
        if not t or t.get("host") != socket.gethostname() or t.get("start_ticks") is None:
            return None
        from .worker import start_ticks
        return start_ticks(int(t["pid"])) == t["start_ticks"]

    def poll(self) -> int | None:
        if self.code is not None:
            return self.code
        self.started()
        if self.exit_record is None:
            self.exit_record = self._record("exit")
        alive = self._alive()
        if alive:
            return None  # recorded its code, or not, it is still tearing down
        if self.exit_record is None:
            if alive is None and self.sub.active():
                return None
            self.exit_record = self._record("exit")  # written just before it ended
        if self.exit_record is not None:
            self.code = int(self.exit_record["code"])
            self.ended_t = time.time() if alive is False else float(self.exit_record["t"])
        elif alive is False or not self.sub.active():
            self.no_exit_record = True
            self.code, self.ended_t = -SIGKILL, time.time()
        return self.code

    def signal(self, sig: int) -> bool:
        if self.poll() is not None:
            return False
        if sig == SIGKILL:
            return self.sub.kill()
        if not self._alive():
            return False
        try:
            os.kill(int(self.task["pid"]), sig)  # type: ignore[index]
            return True
        except ProcessLookupError:
            return False


class SlurmLauncher(Launcher):
    """Submits the job with ``sbatch`` as the script ``fastckpt slurm`` prints
    (:func:`fastckpt.tools.slurm.sbatch_script`, srun launcher, one task per rank on one
    node): ``OUT/job.sbatch`` runs ``fastckpt resume ROOT --supervise --requeue -- srun ...
    fastckpt resume ROOT -q -- python -m fastckpt.drill.worker --task
    OUT/slurm-job.json``. Each start writes the job to ``OUT/slurm-job.json`` and submits the
    script again: the restart is a fresh sbatch of the same script. Batch and task logs go to
    ``OUT/slurm-logs/``."""

    name = "slurm"

    def __init__(self, kill_wait: int, time_limit_min: int, partition: str | None = None
                 ) -> None:
        self.kill_wait = kill_wait
        self.time_limit_min = time_limit_min
        self.partition = partition
        self.subs: list[SlurmSubmission] = []

    def start(self, job_path: str, world: int, env: dict[str, str]) -> list[RankProcess]:
        from ..tools.slurm import sbatch_script
        with open(job_path) as f:
            job = json.load(f)
        out = os.path.abspath(job["out"])
        job = dict(job, root=os.path.abspath(job["root"]), out=out)
        fixed = os.path.join(out, "slurm-job.json")
        with open(fixed, "w") as f:
            json.dump(job, f, indent=1)
        logs = os.path.join(out, "slurm-logs")
        os.makedirs(logs, exist_ok=True)  # Slurm opens --output before the script runs
        text = sbatch_script(
            root=job["root"], grace_s=max(1, self.kill_wait), name=SLURM_JOB_NAME,
            cmd=[sys.executable, "-m", "fastckpt.drill.worker", "--task", fixed],
            source=f"fastckpt drill: the window of scancel's SIGTERM, this cluster's "
                   f"KillWait of {self.kill_wait} s",
            ntasks_per_node=world, launcher="srun", time_limit=str(self.time_limit_min),
            partition=self.partition, logs=logs, kill_wait=self.kill_wait)
        script = os.path.join(out, "job.sbatch")
        with open(script, "w") as f:
            f.write(text)
        for sub in self.subs:  # one job at a time on the checkpoint root
            sub.settle()
        if not self.subs:  # Slurm queues a job no node can run (PENDING, PartitionConfig)
            rc, so, se = _slurm(["sbatch", "--test-only", script], env=slurm_env(env), cwd=out)
            if rc != 0:
                raise DrillError(
                    f"sbatch --test-only {script}: {(se or so).strip()[-300:] or rc}: the job "
                    f"({world} tasks on one node) cannot run on this cluster")
        submit_t = time.time()
        rc, so, se = _slurm(["sbatch", "--parsable", script], env=slurm_env(env), cwd=out)
        if rc != 0 or not so.strip().split(";")[0].isdigit():
            why = (se or so).strip()[-500:]
            if rc == 124:
                why = f"no answer within {SLURM_CMD_S:g} s" + (f"; {why}" if why else "")
            raise DrillError(f"sbatch {script} failed (exit {rc}): {why}")
        sub = SlurmSubmission(so.strip().split(";")[0], job["tag"], submit_t, script,
                              hashlib.sha256(text.encode()).hexdigest(), out, logs)
        sub.ranks = [SlurmRank(r, sub, out, job["tag"]) for r in range(world)]
        self.subs.append(sub)
        return list(sub.ranks)

    def diagnose(self) -> str:
        out = []
        for sub in self.subs:
            st = sub.state(0)
            reason = sub.info.get("Reason")
            tail = sub.log_text()[-400:].strip()
            out.append(f"Slurm job {sub.job_id} ({sub.tag}): {st}"
                       + (f" (reason {reason})" if reason and reason != "None" else "")
                       + f"; its log {sub.log} ends: {tail!r}")
        return "; ".join(out)

    def release(self) -> None:
        for sub in self.subs:  # a job still queued or running is ended
            if sub.active(0):
                sub.kill()


class SlurmScenario(Scenario):
    name = "slurm"
    summary = ("the job submitted with sbatch as `fastckpt slurm` prints it (srun, one task "
               "per rank), then scancel: Slurm's SIGTERM reaches every rank (window: "
               "KillWait); one stop step committed, exit 143 everywhere, sacct CANCELLED and "
               "not requeued; a fresh sbatch of the same script resumes bit-exact")
    default_when_available = True

    def __init__(self) -> None:
        self.slurm: SlurmLauncher | None = None  # this run's (judge reads its submissions)

    def available(self) -> str | None:
        return slurm_unavailable()

    def window(self, opts: DrillOptions) -> float:
        return float(slurm_kill_wait() or 30)  # Slurm's default KillWait

    def job(self, opts: DrillOptions) -> dict:
        return {"grace_s": self.window(opts)}

    def launcher(self, opts: DrillOptions) -> Launcher | None:
        # a safety net only (the drill ends its jobs): the job's run, the restart, imports
        minutes = max(3, math.ceil((opts.steps * (opts.step_s + 0.1) + 120) / 60))
        self.slurm = SlurmLauncher(int(self.window(opts)), minutes)
        return self.slurm

    def act(self, job: Job, opts: DrillOptions) -> None:
        sub = job.procs[0].sub  # type: ignore[attr-defined]
        rc, msg = sub.cancel()
        for r in range(job.world):  # the driver's time: Slurm signals the ranks itself
            job.sent.append({"rank": r, "signal": "SIGTERM", "t": sub.cancel_t,
                             "delivered": rc == 0, "via": f"scancel {sub.job_id}"})
        if rc != 0:
            raise DrillError(f"scancel {sub.job_id} failed (exit {rc}): {msg}")

    def judge(self, run: ScenarioRun, opts: DrillOptions) -> None:
        judge_committed_stop(run, opts, signalled=None)
        missing = [x["rank"] for x in run.ranks if "SIGTERM" not in (x.get("signals") or [])]
        run.check("Slurm's SIGTERM reached every rank", not missing,
                  f"rank(s) {missing} logged no SIGTERM" if missing else
                  "every rank logged SIGTERM (scancel: Slurm signals each task itself)")
        # Slurm SIGKILLs what is left KillWait after its SIGTERM: the processes, with their
        # interpreter's teardown after the exit event, have to be gone by then
        gone = [x.get("gone_s") for x in run.ranks]
        run.check("every rank gone before KillWait's SIGKILL",
                  all(g is not None and g < run.window_s for g in gone),
                  f"processes gone {gone} s after the first signal (exit events "
                  f"{[x['timeline'].get('exit') for x in run.ranks]} s; KillWait "
                  f"{run.window_s:g} s)")
        subs = self.slurm.subs if self.slurm else []
        sl: dict[str, Any] = run.measured.setdefault("slurm", {})
        if not subs:
            run.check("sacct: the job CANCELLED, not requeued", False, "no job was submitted")
            return
        first = subs[0]
        rows = first.wait_ended()
        states = [r["State"] for r in rows]
        now = first.state(0)
        sl.update(job_id=first.job_id, script=first.script, script_sha256=first.sha256,
                  job_log=first.log, kill_wait_s=self.window(opts), ntasks=len(run.ranks),
                  partition=rows[0]["Partition"] if rows else None,
                  node=rows[0]["NodeList"] if rows else None,
                  state=states[-1] if states else None, sacct=rows,
                  requeued=len(rows) > 1 or now in ("PENDING", "REQUEUED") or first.requeued,
                  scancel_t=first.cancel_t,
                  queue_wait_s=_wait(rows[0]) if rows else None,
                  submit_to_steps_s=_first_steps(first, "run", len(run.ranks)))
        sl["exit_records"] = [
            {"rank": p.rank, "code": p.code, "how": (p.exit_record or {}).get("how"),
             "no_exit_record": p.no_exit_record, "pid": p.pid,
             "host": (p.task or {}).get("host")} for p in first.ranks]
        delays = [x.get("signal_delivery_ms") for x in run.ranks]
        sl["scancel_to_signal_ms"] = (max(delays) if delays and None not in delays else None)
        run.check("sacct: the job CANCELLED, not requeued",
                  len(rows) == 1 and states[0].startswith("CANCELLED") and not sl["requeued"],
                  f"job {first.job_id}: sacct {states} (ExitCode "
                  f"{[r['ExitCode'] for r in rows]}), scontrol now {now}")
        log = first.log_text()
        srun = srun_task_codes(log)
        sl["srun_task_codes"] = {str(k): v for k, v in sorted(srun.items())}
        codes = [x["exit_code"] for x in run.ranks]
        run.check("srun: every task exited with the rank's code",
                  all(srun.get(r) == (None if c == 0 else str(c))
                      for r, c in enumerate(codes)),
                  f"srun's report per task {sl['srun_task_codes'] or 'none'} in {first.log}; "
                  f"the ranks' exit records {codes}")
        said = [ln.strip() for ln in log.splitlines() if ln.startswith("fastckpt:")]
        run.check("the supervisor did not requeue the cancelled job",
                  f"job {first.job_id} was cancelled" in log and "not requeued" in log,
                  " | ".join(said[-2:]) or f"nothing from the supervisor in {first.log}")
        if len(subs) < 2:
            run.check("the restart: a fresh sbatch of the same script, COMPLETED", False,
                      "no restart job was submitted")
            return
        second = subs[-1]
        rows2 = second.wait_ended()
        states2 = [r["State"] for r in rows2]
        sl.update(restart_job_id=second.job_id, restart_state=states2[-1] if states2 else None,
                  restart_sacct=rows2,
                  restart_queue_wait_s=_wait(rows2[-1]) if rows2 else None,
                  restart_submit_to_steps_s=_first_steps(second, "restart", len(run.ranks)))
        ok = (second.sha256 == first.sha256 and second.job_id != first.job_id
              and states2 == ["COMPLETED"] and rows2[-1]["ExitCode"] == "0:0")
        run.check("the restart: a fresh sbatch of the same script, COMPLETED", ok,
                  f"job {second.job_id}: sacct {states2} (ExitCode "
                  f"{[r['ExitCode'] for r in rows2]}); script "
                  f"{'the same' if second.sha256 == first.sha256 else 'DIFFERENT'} "
                  f"(sha256 {second.sha256[:12]})")


_SRUN_TASKS = re.compile(r"^srun: error: \S+: tasks? ([\d,\-]+): (.*)$")


def srun_task_codes(log: str) -> dict[int, str]:
    """What srun said of each task that did not exit 0, from the batch script's output:
    ``srun: error: NODE: tasks 0-1: Exited with exit code 143`` -> {0: "143", 1: "143"};
    a task killed by a signal: its text ("Killed", "Terminated"). Tasks that exited 0 are
    not listed by srun."""
    out: dict[int, str] = {}
    for line in log.splitlines():
        m = _SRUN_TASKS.match(line.strip())
        if not m:
            continue
        what = m.group(2).strip()
        code = what.rsplit(" ", 1)[-1] if what.startswith("Exited with exit code") else what
        for part in m.group(1).split(","):
            a, _, b = part.partition("-")
            if a.isdigit() and (not b or b.isdigit()):
                for t in range(int(a), int(b or a) + 1):
                    out[t] = code
    return out


def _wait(row: dict) -> float | None:
    """Seconds between the job's submission and its start (sacct: whole seconds)."""
    a, b = _slurm_time(row.get("Submit")), _slurm_time(row.get("Start"))
    return None if a is None or b is None else round(b - a, 1)


def _first_steps(sub: SlurmSubmission, tag: str, world: int) -> float | None:
    """Seconds from sbatch to the moment every rank had logged its first step."""
    ts = []
    for r in range(world):
        rows = _read_jsonl(os.path.join(sub.out, f"steps-{tag}-r{r}.jsonl"))
        if not rows:
            return None
        ts.append(rows[0]["t"])
    return round(max(ts) - sub.submit_t, 2)


register(SlurmScenario())

