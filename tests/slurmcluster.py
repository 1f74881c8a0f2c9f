"""A real one-node Slurm cluster for the tests (started by ``scripts/slurm.sh up``).

Import the fixture into a test module::

    from tests.slurmcluster import slurm  # noqa: F401

``slurm`` (session) starts the cluster once (installing Slurm with apt-get when root and
missing) and returns a :class:`SlurmCluster`. It skips the tests with the script's reason when
the cluster cannot start (not root, no apt-get, a daemon failing: the logs' last lines are in
the reason). ``FASTCKPT_SLURM=off`` skips them; ``FASTCKPT_SLURM=require`` makes a cluster that
cannot start a test failure. The cluster stays up after the session (the next ``up`` takes a
fraction of a second, and other pytest sessions may be using it); ``FASTCKPT_SLURM_DOWN=1`` stops
it at the end of a session that started it, ``bash scripts/slurm.sh down`` at any time. Give the
tests ``@pytest.mark.timeout(N, func_only=True)`` so that the (once per session, possibly minutes
long) install does not count against the first test.

Partitions: ``main`` (default, never preempted), ``low`` (preempted by ``high`` with
PreemptMode=REQUEUE, GraceTime=20), ``high``. KillWait=10.
"""

from __future__ import annotations

import os
import re
import subprocess
import time
from dataclasses import dataclass
from typing import Callable, Iterable

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "slurm.sh")
SACCT_FIELDS = ("JobID", "JobName", "Partition", "State", "ExitCode", "DerivedExitCode", "Start", "End")
UP_TIMEOUT = float(os.environ.get("FASTCKPT_SLURM_UP_TIMEOUT", "600"))


@dataclass
class SlurmCluster:
    env: dict  # os.environ + SLURM_CONF, without an outer job's SLURM_*/SBATCH_*/SRUN_* variables
    conf: str
    since: str  # sacct -S: this session's start, so stale records with a reused job id never count

    def run(self, *cmd: str, timeout: float = 30, check: bool = True, **kw) -> subprocess.CompletedProcess:
        p = subprocess.run(list(cmd), env=self.env, capture_output=True, text=True, timeout=timeout, **kw)
        if check and p.returncode != 0:
            raise AssertionError(f"{' '.join(cmd)} -> {p.returncode}\n{p.stdout}{p.stderr}")
        return p

    def sbatch(self, script_text: str, cwd, *extra_args: str) -> int:
        """Submit ``script_text`` (a batch script, ``#!/bin/bash`` first) from ``cwd``; the job id."""
        p = self.run("sbatch", "--parsable", "-D", str(cwd), *extra_args, input=script_text, cwd=str(cwd))
        return int(p.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict:
        """``scontrol show job -o``, as a dict (JobState, Restarts, ExitCode, Reason...); {} once the
        job has been purged (MinJobAge after it ended)."""
        p = self.run("scontrol", "show", "job", "-o", str(job_id), check=False)
        line = p.stdout.strip().splitlines()[0] if p.returncode == 0 and p.stdout.strip() else ""
        return dict(re.findall(r"(\S+?)=(.*?)(?=\s+[A-Za-z][\w:/]*=|$)", line))

    def state(self, job_id: int) -> str:
        """The job's state: from scontrol, or from sacct once the job is purged ('' if neither knows)."""
        j = self.job(job_id)
        if j:
            return j.get("JobState", "")
        rows = [r for r in self.sacct(job_id) if r["JobID"] == str(job_id)]
        return rows[-1]["State"].split()[0] if rows else ""

    def wait(self, job_id: int, until: Callable[[dict], bool] | str | Iterable[str], timeout: float = 60) -> dict:
        """Poll until ``until(job)`` is true (``job`` as from :meth:`job`, its JobState filled in
        from sacct once purged), or until JobState is ``until`` / one of ``until``; the job dict."""
        if not callable(until):
            states = {until} if isinstance(until, str) else set(until)
            until = lambda j: j.get("JobState") in states  # noqa: E731
        deadline = time.monotonic() + timeout
        while True:
            j = self.job(job_id) or {"JobId": str(job_id), "JobState": self.state(job_id), "purged": "1"}
            if until(j):
                return j
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: condition not met in {timeout}s; last seen {j}; "
                                     f"sacct {self.sacct(job_id)}")
            time.sleep(0.5)

    def sacct(self, job_id: int) -> list[dict]:
        """The accounting rows of the job and its steps (``--duplicates``: one allocation row per
        run of a requeued job), as dicts of SACCT_FIELDS. sacct 22.05 has no Restarts field:
        use ``job(id)["Restarts"]`` or count the allocation rows."""
        p = self.run("sacct", "-P", "-n", "--duplicates", "-S", self.since, "-j", str(job_id),
                     "-o", ",".join(SACCT_FIELDS), check=False)
        return [dict(zip(SACCT_FIELDS, line.split("|"))) for line in p.stdout.splitlines() if line.strip()]

    def wait_sacct(self, job_id: int, pred: Callable[[list[dict]], bool], timeout: float = 60) -> list[dict]:
        """Poll ``sacct`` (accounting lags the controller) until ``pred(rows)``; the rows."""
        deadline = time.monotonic() + timeout
        while True:
            rows = self.sacct(job_id)
            if pred(rows):
                return rows
            if time.monotonic() > deadline:
                raise AssertionError(f"job {job_id}: sacct condition not met in {timeout}s; rows {rows}")
            time.sleep(0.5)

    def scancel(self, job_id: int, *args: str) -> None:
        self.run("scancel", *args, str(job_id))


def _tail(text: str, n: int = 40) -> str:
    return "\n".join(text.strip().splitlines()[-n:])


@pytest.fixture(scope="session")
def slurm():
    mode = os.environ.get("FASTCKPT_SLURM", "auto")
    if mode == "off":
        pytest.skip("FASTCKPT_SLURM=off")
    since = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() - 60))
    try:
        p = subprocess.run(["bash", SCRIPT, "up"], capture_output=True, text=True, timeout=UP_TIMEOUT)
        ok, out = p.returncode == 0, p.stdout + p.stderr
        if p.returncode == 3:  # cannot set up here (not root, no apt-get)
            reason = f"no Slurm cluster: {_tail(out, 1)}"
        else:
            reason = f"no Slurm cluster: scripts/slurm.sh up -> {p.returncode}\n{_tail(out)}"
    except subprocess.TimeoutExpired as e:
        ok, out = False, ((e.stdout or b"") + (e.stderr or b"")).decode(errors="replace")
        reason = f"no Slurm cluster: scripts/slurm.sh up still running after {UP_TIMEOUT:.0f}s\n{_tail(out)}"
    if not ok:
        if mode == "require":
            pytest.fail(reason, pytrace=False)
        pytest.skip(reason)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_"))}
    conf = subprocess.run(["bash", SCRIPT, "env"], capture_output=True, text=True, timeout=30).stdout
    env["SLURM_CONF"] = conf.strip().split("=", 1)[1]
    yield SlurmCluster(env=env, conf=env["SLURM_CONF"], since=since)
    if "already up" not in out and os.environ.get("FASTCKPT_SLURM_DOWN") == "1":
        try:
            subprocess.run(["bash", SCRIPT, "down"], capture_output=True, timeout=180)
        except subprocess.TimeoutExpired:
            pass
