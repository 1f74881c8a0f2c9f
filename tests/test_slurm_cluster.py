"""Smoke tests of the one-node Slurm cluster of scripts/slurm.sh, with real jobs.

They pin down what this Slurm (Debian's 22.05) does, which the preemption tests rely on:

* sacct prints an exit status >= 128 minus 128: ``exit 143`` shows as ExitCode ``15:0``
  (``scontrol show job`` says ``143:0``; an srun step's 143 shows as DerivedExitCode ``143:0``).
* ``scancel`` sends SIGTERM to the batch shell too (then SIGKILL after KillWait=10).
* Preemption with GraceTime (partition ``low``): SIGTERM goes at once to the job's srun steps
  only; the batch shell gets it when the grace time is over, and only a job still running then
  is requeued. A job that ends by itself during its grace time is not requeued (FAILED).
* A requeued job waits AuthInfo cred_expire (20 s here, 120 s by default) + 1 s before it may
  start again.
"""

from __future__ import annotations

import time

import pytest

# (transient states too: SIGNALING, seen once between RUNNING and FAILED)
from fastckpt.drill.slurm import SLURM_ACTIVE
from tests.slurmcluster import slurm  # noqa: F401


def _read(path) -> str:
    return path.read_text() if path.exists() else ""


def _wait_file(path, text: str, timeout: float = 60) -> str:
    deadline = time.monotonic() + timeout
    while text not in _read(path):
        assert time.monotonic() < deadline, f"{text!r} not in {path} after {timeout}s: {_read(path)!r}"
        time.sleep(0.2)
    return _read(path)


def _times(log: str, word: str) -> list[float]:
    """The time stamps (last field) of the log lines starting with ``word``."""
    return [float(line.split()[-1]) for line in log.splitlines() if line.startswith(word)]


@pytest.mark.timeout(120, func_only=True)
def test_srun_steps_complete(slurm, tmp_path):  # noqa: F811
    job = slurm.sbatch("#!/bin/bash\nsrun -n 2 hostname\n", tmp_path, "-n", "2", "-o", "out.txt")
    slurm.wait(job, {"COMPLETED", "FAILED", "CANCELLED"}, 60)
    assert slurm.job(job).get("JobState", "COMPLETED") == "COMPLETED"
    assert len((tmp_path / "out.txt").read_text().split()) == 2
    rows = slurm.wait_sacct(job, lambda rs: {r["JobID"] for r in rs} >= {f"{job}", f"{job}.batch", f"{job}.0"}
                            and all(r["State"] == "COMPLETED" for r in rs))
    assert all(r["ExitCode"] == "0:0" for r in rows), rows


@pytest.mark.timeout(120, func_only=True)
def test_exit_143_is_failed(slurm, tmp_path):  # noqa: F811
    job = slurm.sbatch("#!/bin/bash\nexit 143\n", tmp_path, "-o", "out.txt")
    j = slurm.wait(job, {"COMPLETED", "FAILED", "CANCELLED"}, 60)
    if "ExitCode" in j:  # still known to the controller: it keeps the real status
        assert j["ExitCode"] == "143:0", j
    rows = slurm.wait_sacct(job, lambda rs: any(r["JobID"] == str(job) and r["State"] not in ("PENDING", "RUNNING")
                                                for r in rs))
    main = [r for r in rows if r["JobID"] == str(job)][-1]
    assert main["State"] == "FAILED", rows
    assert main["ExitCode"] == "15:0", rows  # sacct 22.05 prints exit statuses >= 128 minus 128
    assert main["DerivedExitCode"] == "0:0", rows  # no srun step


@pytest.mark.timeout(120, func_only=True)
def test_scancel_sends_sigterm_to_the_batch_shell(slurm, tmp_path):  # noqa: F811
    script = """#!/bin/bash
trap 'echo TERM >> sig.log; exit 143' TERM
echo started >> sig.log
sleep 300 & wait
"""
    job = slurm.sbatch(script, tmp_path, "-o", "out.txt")
    _wait_file(tmp_path / "sig.log", "started")
    slurm.scancel(job)
    slurm.wait(job, lambda j: j["JobState"] not in SLURM_ACTIVE, 60)
    assert _read(tmp_path / "sig.log").split() == ["started", "TERM"]
    rows = slurm.wait_sacct(job, lambda rs: any(r["JobID"] == str(job) and r["State"].startswith("CANCELLED")
                                                for r in rs))
    batch = [r for r in rows if r["JobID"] == f"{job}.batch"]
    assert not batch or batch[-1]["ExitCode"] == "15:0", rows  # the shell's own exit 143


LOW_JOB = """#!/bin/bash
echo "start restart=${SLURM_RESTART_COUNT:-0} $(date +%s.%N)" >> run.log
[ "${SLURM_RESTART_COUNT:-0}" -gt 0 ] && exit 0
trap 'echo "shell-TERM $(date +%s.%N)" >> run.log; exit 143' TERM
srun -n 1 bash -c 'trap "echo step-TERM \\$(date +%s.%N) >> run.log; exit 143" TERM; sleep 300 & wait'
echo "srun-rc=$? $(date +%s.%N)" >> run.log
sleep 300 & wait  # stay until the grace time is over: only then is the job requeued
"""


@pytest.mark.timeout(180, func_only=True)
def test_high_preempts_low_and_low_is_requeued(slurm, tmp_path):  # noqa: F811
    low = slurm.sbatch(LOW_JOB, tmp_path, "-p", "low", "--requeue", "-n", "2", "-J", "low", "-o", "low.out")
    _wait_file(tmp_path / "run.log", "start restart=0")
    time.sleep(1)  # the srun step is up
    submitted = time.time()
    high = slurm.sbatch("#!/bin/bash\nsleep 2\n", tmp_path, "-p", "high", "-n", "1", "-J", "high", "-o", "high.out")
    slurm.wait(low, lambda j: j.get("Restarts", "0") != "0", 60)  # preempted and requeued
    log = _wait_file(tmp_path / "run.log", "shell-TERM")
    step_term, shell_term = _times(log, "step-TERM"), _times(log, "shell-TERM")
    assert step_term and step_term[0] - submitted < 10, log  # the steps hear of it at once...
    assert shell_term[0] - submitted >= 15, log  # ...the batch shell when GraceTime=20 is over
    slurm.wait(high, lambda j: j["JobState"] == "COMPLETED", 60)
    # requeued by Slurm: pending until its BeginTime, ~121 s on (cred_expire, left at its
    # default as on real clusters), which is why fastckpt's requeue sets StartTime itself
    j = slurm.wait(low, lambda j: j.get("JobState") == "PENDING", 30)
    assert j["Restarts"] == "1" and j["Reason"] == "BeginTime", j
    wait = (time.mktime(time.strptime(j["EligibleTime"], "%Y-%m-%dT%H:%M:%S")) - time.time())
    assert 60 < wait <= 125, j
    rows = slurm.wait_sacct(low, lambda rs: [r["State"] for r in rs if r["JobID"] == str(low)]
                            == ["PREEMPTED", "PENDING"])
    assert [r["Partition"] for r in rows if r["JobID"] == str(low)] == ["low", "low"]
    slurm.scancel(low)


@pytest.mark.timeout(120, func_only=True)
def test_preempted_job_that_exits_in_its_grace_time_is_not_requeued(slurm, tmp_path):  # noqa: F811
    script = LOW_JOB.replace("sleep 300 & wait  #", "exit 143  #")
    low = slurm.sbatch(script, tmp_path, "-p", "low", "--requeue", "-n", "2", "-J", "low", "-o", "low.out")
    _wait_file(tmp_path / "run.log", "start restart=0")
    time.sleep(1)
    high = slurm.sbatch("#!/bin/bash\ntrue\n", tmp_path, "-p", "high", "-n", "1", "-J", "high", "-o", "high.out")
    j = slurm.wait(low, lambda j: j["JobState"] not in SLURM_ACTIVE, 60)
    assert j["JobState"] == "FAILED" and j.get("Restarts", "0") == "0", j
    assert "srun-rc=143" in _read(tmp_path / "run.log")
    slurm.wait(high, "COMPLETED", 60)
    rows = slurm.wait_sacct(low, lambda rs: any(r["JobID"] == str(low) and r["State"] == "FAILED" for r in rs))
    main = [r for r in rows if r["JobID"] == str(low)]
    assert len(main) == 1 and main[0]["DerivedExitCode"] == "143:0", rows
