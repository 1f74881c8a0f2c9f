"""Real jobs on a real one-node Slurm (``scripts/slurm.sh``, Debian's slurm-wlm with slurmdbd
accounting, proctrack/cgroup, KillWait=10), each submitted as the script ``fastckpt slurm``
prints, and judged by the job's final state in sacct, as a user sees it:

- the time limit's warning (``--signal=B:USR1``) -> emergency checkpoint -> the job requeues
  itself, starts again seconds later, resumes and finishes bit-exact with an uninterrupted run;
- ``scancel``: the ranks save within KillWait, the job ends CANCELLED and is not requeued;
- partition preemption (``low`` preempted by ``high``, GraceTime=20), with torchrun inside the
  step: checkpoint, requeue, resume after the high-priority job, bit-exact.

The uninterrupted reference runs the same worker under a local torchrun (same world size,
gloo): every step's batch is a function of the step, so the losses and the final parameters and
Adam state must be equal to the last bit."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

# (transient states too: SIGNALING, seen once between RUNNING and FAILED)
from fastckpt.drill.slurm import SLURM_ACTIVE
from tests.slurmcluster import slurm  # noqa: F401 - the fixture

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "slurm_worker.py")
STEPS = 400
STEP_S = 0.1  # slow enough that the time limit's warning comes before the end

pytestmark = pytest.mark.slow


def _env(slurm):
    venv_bin = os.path.dirname(sys.executable)
    return {**slurm.env, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1",
            "PATH": venv_bin + os.pathsep + slurm.env.get("PATH", "")}


def _script(slurm, root, out, *opts, steps=STEPS):
    # torchrun takes the script (it runs it with its own python); srun takes a command
    python = [] if "torchrun" in opts else [sys.executable]
    r = subprocess.run([sys.executable, "-m", "fastckpt.cli", "slurm", root, *opts, "--",
                        *python, WORKER, root, str(steps), out, str(STEP_S)],
                       env=_env(slurm), capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


def _submit(slurm, tmp_path, text):
    p = subprocess.run(["sbatch", "--parsable"], input=text, cwd=str(tmp_path), env=_env(slurm),
                       capture_output=True, text=True, timeout=30)
    assert p.returncode == 0, p.stderr
    return int(p.stdout.strip().split(";")[0])


def _losses(out):
    path = os.path.join(out, "losses")
    if not os.path.exists(path):
        return []
    return [line.split() for line in open(path) if line.strip()]


def _wait_losses(out, n, slurm, job, timeout=90):
    end = time.monotonic() + timeout
    while len(_losses(out)) < n:
        assert time.monotonic() < end, f"fewer than {n} steps after {timeout} s: " \
            f"{slurm.job(job)}"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: the same worker, 2 ranks under a local torchrun."""
    d = tmp_path_factory.mktemp("reference")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                        "--nproc-per-node", "2", WORKER, str(d / "ck"), str(STEPS), str(d), "0"],
                       env={**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"},
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return [(s, h) for s, h, _ in _losses(str(d))], torch.load(d / "final.pt")


def _same_as_reference(out, reference):
    losses = _losses(out)
    ref_losses, ref_final = reference
    assert [(s, h) for s, h, _ in losses] == ref_losses  # every step once, to the last bit
    final = torch.load(os.path.join(out, "final.pt"))
    for k, v in ref_final["model"].items():
        assert torch.equal(final["model"][k], v), k
    for i, st in ref_final["optim"]["state"].items():
        for k, v in st.items():
            assert torch.equal(final["optim"]["state"][i][k], v), (i, k)
    return losses


def _runs(rows, job):
    """The allocation rows (one per run of the job), oldest first."""
    return [r for r in rows if r["JobID"] == str(job)]


def _log(root, job):
    with open(os.path.join(root, "logs", f"{os.path.basename(root)}-{job}.out")) as f:
        return f.read()


@pytest.mark.timeout(300, func_only=True)
def test_time_limit_warning_checkpoints_requeues_and_resumes_bit_exact(slurm, tmp_path,
                                                                       reference):
    root, out = str(tmp_path / "ck"), str(tmp_path)
    job = _submit(slurm, tmp_path, _script(slurm, root, out, "--grace", "20", "--time", "1",
                                           "--ntasks-per-node", "2"))
    rows = slurm.wait_sacct(job, lambda rows: any(
        r["State"] == "COMPLETED" for r in _runs(rows, job)), timeout=240)
    runs = _runs(rows, job)
    log = _log(root, job)
    # every run but the last got the warning (Slurm checks limits every ~30 s, so a run may
    # be warned early and the job need more than one requeue): one REQUEUED row per warning
    states = [r["State"] for r in runs]
    assert len(states) >= 2 and set(states[:-1]) == {"REQUEUED"} and states[-1] == "COMPLETED", \
        (runs, log)
    assert all(r["DerivedExitCode"] == "143:0" for r in runs[:-1]), runs  # the steps' 143
    assert runs[-1]["ExitCode"] == "0:0"
    assert "signals passed on: SIGUSR1" in log and f"job {job} requeued" in log, log
    losses = _same_as_reference(out, reference)
    # each run resumed from the step the previous one stopped at. A run warned after the
    # last step has none left to do (it resumes, finds nothing, ends 0), and one warned before
    # it resumed logs nothing: the job's own restart counter, not the step log, counts runs
    counts = [int(n) for _, _, n in losses]
    assert counts == sorted(counts), counts
    started = [tuple(map(int, line.split())) for line in open(os.path.join(out, "runs"))]
    assert [n for n, _ in started] == sorted({n for n, _ in started}), started
    assert started[0] == (0, -1) and started[-1][0] == len(runs) - 1, (started, runs)
    for n, resumed in started[1:]:
        done = [int(s) for s, _, c in losses if int(c) < n]
        assert resumed == max(done), (n, resumed, started)  # the last step before this run
        assert f"resuming from step {resumed}" in log, (n, resumed)
        assert all(int(s) > resumed for s, _, c in losses if int(c) == n), (n, resumed)
    # requeued and started again seconds later, not after Slurm's ~2 min BeginTime
    for a, b in zip(runs, runs[1:]):
        gap = (time.mktime(time.strptime(b["Start"], "%Y-%m-%dT%H:%M:%S"))
               - time.mktime(time.strptime(a["End"], "%Y-%m-%dT%H:%M:%S")))
        assert gap <= 30, runs


@pytest.mark.timeout(240, func_only=True)
def test_scancel_saves_within_killwait_and_is_not_requeued(slurm, tmp_path, reference):
    root, out = str(tmp_path / "ck"), str(tmp_path)
    job = _submit(slurm, tmp_path, _script(slurm, root, out, "--grace", "8",
                                           "--ntasks-per-node", "2"))
    _wait_losses(out, 20, slurm, job)
    t0 = time.time()
    slurm.scancel(job)
    rows = slurm.wait_sacct(job, lambda rows: any(
        r["State"].startswith("CANCELLED") for r in _runs(rows, job))
        and slurm.state(job) not in SLURM_ACTIVE, timeout=60)
    log = _log(root, job)
    assert [r["State"] for r in _runs(rows, job)] == ["CANCELLED by 0"], (rows, log)
    assert f"job {job} was cancelled" in log and "not requeued" in log, log
    # the ranks committed the step they stopped at, inside KillWait (10 s)
    import json
    events = [json.loads(line) for line in open(os.path.join(root, "events", "rank00000.jsonl"))]
    commit = [e for e in events if e["event"] == "commit"][-1]
    assert commit["t"] - t0 < 10, (commit, t0)
    losses = _losses(out)
    assert int(losses[-1][0]) == commit["step"]
    assert [(s, h) for s, h, _ in losses] == reference[0][:len(losses)]
    r = subprocess.run([sys.executable, "-m", "fastckpt.cli", "verify", root], env=_env(slurm),
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@pytest.mark.timeout(300, func_only=True)
def test_partition_preemption_with_torchrun_requeues_and_resumes_bit_exact(slurm, tmp_path,
                                                                           reference):
    root, out = str(tmp_path / "ck"), str(tmp_path)
    job = _submit(slurm, tmp_path, _script(slurm, root, out, "--grace", "15", "--partition",
                                           "low", "--launcher", "torchrun",
                                           "--ntasks-per-node", "2"))
    _wait_losses(out, 30, slurm, job)
    # a job of the high partition that needs the whole node preempts the low one
    hi = _submit(slurm, tmp_path, "#!/bin/bash\n#SBATCH --partition=high\n#SBATCH --exclusive\n"
                 "#SBATCH --output=high-%j.out\nsleep 2\n")
    rows = slurm.wait_sacct(job, lambda rows: any(
        r["State"] == "COMPLETED" for r in _runs(rows, job)), timeout=240)
    runs = _runs(rows, job)
    log = _log(root, job)
    assert [r["State"] for r in runs] == ["REQUEUED", "COMPLETED"], (runs, log)
    assert runs[0]["DerivedExitCode"] == "143:0", runs
    assert f"job {job} requeued" in log, log
    hi_rows = _runs(slurm.sacct(hi), hi)
    assert hi_rows and hi_rows[-1]["State"] == "COMPLETED", hi_rows
    # the low job ran again only after the high one
    assert runs[1]["Start"] >= hi_rows[-1]["Start"], (runs, hi_rows)
    _same_as_reference(out, reference)
