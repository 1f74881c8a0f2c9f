"""Review of the operational tools (2026-12-06): each test reproduces a defect found in the
generated Slurm script / Kubernetes Job, the supervisor, the event-log exit code, the
trackers or the drill. Every test here failed on the code it was written against."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from fastckpt.tools.k8s import job_manifests, to_yaml
from fastckpt.tools.slurm import sbatch_script
from tests.clirun import call


# ------------------------------------------------------------------ the sbatch script

def _sbatch_parse(tmp_path, text: str) -> subprocess.CompletedProcess:
    """Let the real ``sbatch`` parse the script's #SBATCH lines (``-v`` prints the options it
    read) against a controller that is not there: it fails at the submission, after the
    parse, in milliseconds."""
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=review\nSlurmctldHost=localhost\nSlurmctldPort=1\n"
                    "AuthType=auth/none\nCredType=cred/none\nMessageTimeout=1\nTCPTimeout=1\n"
                    "NodeName=localhost CPUs=2 State=UNKNOWN\n"
                    "PartitionName=p Nodes=localhost Default=YES State=UP\n")
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    env["SLURM_CONF"] = str(conf)
    return subprocess.run(["sbatch", "-v", str(script)], env=env, capture_output=True,
                          text=True, timeout=30, cwd=tmp_path)


def _sbatch_option(stderr: str, name: str) -> str | None:
    for line in stderr.splitlines():
        parts = line.split(":", 2)  # "sbatch: output              : /path"
        if len(parts) == 3 and parts[1].strip() == name:
            return parts[2].strip()
    return None


@pytest.mark.skipif(shutil.which("sbatch") is None, reason="sbatch is not installed")
@pytest.mark.parametrize("root", ["/scratch/my run/ckpt", "/scratch/run#2/ckpt",
                                  "/scratch/a \"b\" c/d\\e #f/ckpt"])
def test_sbatch_reads_the_log_path_of_a_root_with_a_space_or_hash(tmp_path, root):
    """``#SBATCH --output={logs}/%x-%j.out`` is written unquoted. sbatch splits a directive
    at whitespace and treats an unescaped '#' as the start of a comment: a ROOT with a space
    makes sbatch refuse the whole script ("Invalid directive found in batch script"), one
    with a '#' sends the job's log to a truncated path. (tests/test_slurm.py uses
    "/nvme/ck/run 1" as its ROOT and only runs ``bash -n``.)"""
    text = sbatch_script(root=root, cmd=["python", "train.py"], grace_s=40, source="--grace",
                         name="run1")
    r = _sbatch_parse(tmp_path, text)
    assert "Invalid directive" not in r.stderr, r.stderr
    assert _sbatch_option(r.stderr, "output") == f"{root}/logs/%x-%j.out", r.stderr


# ------------------------------------------------------------------------ Kubernetes

def test_k8s_job_name_derived_from_a_long_root_is_a_valid_name(tmp_path, capsys):
    """``fastckpt k8s ROOT`` names the Job after ROOT (``job_name``): lowercased, other
    characters turned into '-', cut to 50 characters. The cut can leave a trailing '-',
    which is not a Kubernetes name: the command fails (exit 2) for a root the user never
    asked to rename."""
    root = tmp_path / ("a" * 49 + "_b")
    root.mkdir()
    rc, out, err = call("k8s", str(root), "--image", "img:1", "--grace", "60", "--",
                        "python", "train.py", capsys=capsys)
    assert rc == 0, err


def test_k8s_yaml_keeps_characters_outside_the_bmp():
    """``to_yaml`` writes strings with ``json.dumps`` (ASCII only): a character outside the
    BMP becomes a JSON surrogate pair (``\\ud83d\\ude00``), which YAML reads as two lone
    surrogates (PyYAML) or rejects as an invalid escape (Go's yaml, i.e. kubectl): a ROOT or
    a CMD argument with such a character does not survive the manifest."""
    yaml = pytest.importorskip("yaml")
    docs = job_manifests(name="run", image="img:1", root="/data/r\U0001F600n",
                         cmd=["python", "train.py", "--tag", "\U00020000"], grace_s=60,
                         supervise=True)
    assert list(yaml.safe_load_all(to_yaml(docs))) == docs


# ------------------------------------------------------------------ the supervisor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# the training command: stops (exit 143) on SIGTERM, else trains for a few seconds and exits 0
_CHILD = ("import signal, sys, time\n"
          "signal.signal(signal.SIGTERM, lambda *a: sys.exit(143))\n"
          "time.sleep(6)\n")

# the container's PID 1: `fastckpt resume ROOT --supervise -- CMD`; the kubelet's SIGTERM
# arrives while the supervisor is still finding the newest step under ROOT (seconds for a
# remote root), i.e. before it has started CMD and installed its handlers
_PID1 = """
import os, signal, sys
from fastckpt.cli import main, steps
assert os.getpid() == 1, os.getpid()
real = steps._newest_of_tiers
def slow_listing(*a, **kw):
    os.kill(1, signal.SIGTERM)  # (what the kubelet sends, at this moment)
    return real(*a, **kw)
steps._newest_of_tiers = slow_listing
main(["resume", sys.argv[1], "--supervise", "--", sys.executable, "-c", sys.argv[2]])
"""


def test_supervisor_as_pid_1_does_not_lose_a_sigterm_sent_during_its_start(tmp_path):
    """The Job ``fastckpt k8s`` prints makes the supervisor the container's PID 1, and the
    kernel drops a signal to a PID namespace's init that has no handler. The supervisor
    installs its handlers only after it has read ROOT and started CMD: a pod deleted or
    preempted during that start (reading a remote ROOT takes seconds) loses the kubelet's
    only SIGTERM, CMD trains on until the SIGKILL and no emergency checkpoint is written.
    (Where the supervisor is not PID 1, Slurm's batch script, the same SIGTERM or the time
    limit's USR1 kills it by the default action instead.) The supervisor should catch the
    stop signals from its start and pass them on once CMD runs."""
    unshare = shutil.which("unshare")
    cmd = [unshare, "--pid", "--fork", "--kill-child"] if unshare else None
    if cmd is None or subprocess.run([*cmd, "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --pid is not available here")
    root = tmp_path / "ck"
    root.mkdir()
    env = {**os.environ, "PYTHONPATH": REPO}
    r = subprocess.run([*cmd, sys.executable, "-c", _PID1, str(root), _CHILD], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 143, (r.returncode, r.stderr[-2000:])


# ------------------------------------------------------------------------ trackers

# a preempted job's rank 0 with an MLflow run: the trigger runs the exit hook in a thread it
# waits for at most min(5 s, time to the deadline), at least 0.2 s, then exits (SystemExit)
_MLFLOW_PREEMPTED = """
import json, sys, threading, time
from fastckpt import trackers
import fastckpt.preempt  # (the trigger that runs the hook: imported in any job it runs in)

class Group:
    def decide(self, mine, fn, timeout_s, what):
        return fn([mine])

class Ckpt:  # what TrackerRun.start uses of a Checkpointer (one rank)
    rank, world_size, group, on_exit = 0, 1, Group(), []

tracker = trackers.MlflowRun(experiment="review", tracking_uri=sys.argv[1])
tracker.start(Ckpt())
print(json.dumps({"run_id": tracker.run_id}), flush=True)
slow = tracker._client.set_tag
def set_tag(*a, **kw):  # a tracking server that takes a while to answer
    time.sleep(3)
    return slow(*a, **kw)
tracker._client.set_tag = set_tag
info = {"code": 143, "reason": "preempted", "step": 7, "cancel": False, "rank": 0,
        "world_size": 1}
hooks = threading.Thread(target=lambda: [h(dict(info)) for h in Ckpt.on_exit], daemon=True)
hooks.start()
hooks.join(0.2)  # the trigger's bound near the deadline: the hook is left behind
raise SystemExit(143)
"""


def test_mlflow_run_of_a_preempted_job_is_not_finished_when_the_hook_is_left_behind(
        tmp_path, monkeypatch):
    """``MlflowRun._close`` (the exit hook, in the trigger's thread) sets the tags, then the
    status, and only at its end registers the ``atexit`` handler that ends the training
    thread's active run with that status. The trigger waits for the hook at most
    min(5 s, the time left to the deadline), 0.2 s near it; a hook left behind (a tracking
    server that answers slowly) has not registered the handler yet, so MLflow's own atexit
    handler ends the preempted run FINISHED, as a normal end. Registering the handler (and
    the status) before any call to the server keeps it KILLED."""
    pytest.importorskip("mlflow")
    uri = (tmp_path / "mlruns").as_uri()
    env = {**os.environ, "PYTHONPATH": REPO, "MLFLOW_ALLOW_FILE_STORE": "true"}
    r = subprocess.run([sys.executable, "-c", _MLFLOW_PREEMPTED, uri], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 143, r.stderr[-2000:]
    run_id = json.loads(r.stdout.splitlines()[0])["run_id"]
    from mlflow import MlflowClient
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    status = MlflowClient(tracking_uri=uri).get_run(run_id).info.status
    assert status != "FINISHED", "a preempted run (exit 143) shows FINISHED"


def _run_script(tmp_path, text: str, kill_wait_line: str) -> dict:
    """Run the generated script with bash, a fake ``scontrol`` that prints
    ``kill_wait_line`` for ``show config`` and a fake ``fastckpt`` that records its
    arguments and the FASTCKPT_* environment it is exec'd with."""
    bindir = tmp_path / "bin"
    bindir.mkdir(exist_ok=True)
    (bindir / "scontrol").write_text(
        "#!/bin/bash\n"
        f"if [ \"$1 $2\" = 'show config' ]; then echo {json.dumps(kill_wait_line)}; fi\n")
    rec = tmp_path / "exec.json"
    (bindir / "fastckpt").write_text(
        f"#!{sys.executable}\nimport json, os, sys\n"
        f"json.dump({{'argv': sys.argv[1:], 'env': {{k: v for k, v in os.environ.items() "
        f"if k.startswith('FASTCKPT_')}}}}, open({str(rec)!r}, 'w'))\n")
    for f in bindir.iterdir():
        f.chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {**os.environ, "PATH": f"{bindir}:{os.environ['PATH']}", "SLURM_JOB_ID": "42",
           "SLURM_JOB_NODELIST": "node1"}
    r = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True,
                       timeout=30, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return json.loads(rec.read_text())


def test_sbatch_script_on_a_cluster_with_killwait_0_gives_the_ranks_a_valid_window(tmp_path):
    """The script tells the ranks SIGTERM's window is the cluster's KillWait
    (``FASTCKPT_SIGNAL_GRACE_S=...,SIGTERM=<KillWait>``). Slurm accepts ``KillWait=0``
    (SIGKILL right after the SIGTERM); the script then exports ``SIGTERM=0``, which every
    rank's Checkpointer refuses at its start ("must be > 0 seconds"): every job of such a
    cluster fails before its first step, instead of running with no SIGTERM window."""
    from fastckpt.options import options_from_env
    root = tmp_path / "ck"
    text = sbatch_script(root=str(root), cmd=["python", "train.py"], grace_s=40,
                         source="--grace", name="run1")
    got = _run_script(tmp_path, text, "KillWait                = 0 sec")
    assert got["argv"][:5] == ["resume", str(root), "--supervise", "--requeue", "--"]
    env = {**got["env"]}
    options_from_env(environ=env)  # what each rank's Checkpointer reads at its start


# ------------------------------------------------------------------------------ the drill

def _one_rank_run(gone_s: float, window: float = 10.0):
    """A one-rank scenario's measurements as the driver builds them: every rank agreed on
    step 6, committed it, logged exit 143 at 0.2 s; its process ended ``gone_s`` after the
    first signal."""
    from fastckpt.drill.scenarios import ScenarioRun
    run = ScenarioRun(name="one-rank", summary="", window_s=window)
    for r in range(2):
        run.ranks.append({
            "rank": r, "exit_code": 143, "gone_s": gone_s, "teardown_s": 1.0,
            "timeline": {"signal": [0.0] if r == 1 else [], "consensus": 0.02,
                         "commit": 0.15, "exit": 0.2, "gone": gone_s},
            "consensus": {"stop_step": 6, "deadline_in_s": window - 1.0 - 0.02},
            "commit": {"step": 6}, "exit_event": {"code": 143}})
    run.measured.update(newest_committed=6, committed_steps=[4, 6], step_dirs=[4, 6])
    run.verify = [{"step": 4, "ok": True}, {"step": 6, "ok": True}]
    run.restart = {"exit_codes": [0, 0], "from_step": 6, "bit_exact": True}
    return run


def test_drill_does_not_pass_a_job_whose_ranks_outlive_the_window():
    """one-rank / staggered check that the ranks' *exit events* come before the deadline
    and that the processes' codes are 143, but not that the processes are gone before the
    window ends: nothing SIGKILLs them at first signal + window as the platform would (the
    drill only kills a rank 18 s later, as hung). A job whose ranks log their exit in time
    and then spend longer than the window in their teardown (a process group, CUDA or NCCL
    teardown) passes the drill, while on the cluster every rank is SIGKILLed at the window
    (exit 137: Slurm FAILED, a Kubernetes failure counted against backoffLimit). The slurm
    scenario has that check ("every rank gone before KillWait's SIGKILL"); these do not."""
    from fastckpt.drill.options import DrillOptions
    from fastckpt.drill.scenarios import SCENARIOS
    opts = DrillOptions(out_dir="/nonexistent")
    ok = _one_rank_run(gone_s=1.0)
    SCENARIOS["one-rank"].judge(ok, opts)
    assert ok.passed, [c for c in ok.checks if not c["ok"]]  # (the fixture is a passing run)
    late = _one_rank_run(gone_s=17.0)  # the window is 10 s
    SCENARIOS["one-rank"].judge(late, opts)
    assert not late.passed, "ranks still alive 7 s after the platform's SIGKILL: PASS"


# ------------------------------------------------------------------ errors that say what

def test_signal_as_without_supervise_is_refused(tmp_path):
    """``--signal-as`` only means something to the supervisor; without ``--supervise`` the
    command execs CMD and the option is dropped without a word (a job script that meant to
    have SIGUSR1 passed to torchrun as SIGTERM gets torchrun killed by SIGUSR1 instead).
    ``--requeue`` without ``--supervise`` is refused (exit 2, "--requeue needs
    --supervise"); ``--signal-as`` should be too."""
    # (in a child process: the exec form replaces the process that runs it)
    r = subprocess.run([sys.executable, "-m", "fastckpt.cli", "resume", str(tmp_path / "ck"),
                        "--signal-as", "SIGTERM", "--", sys.executable, "-c", "pass"],
                       env={**os.environ, "PYTHONPATH": REPO}, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "--signal-as" in r.stderr, (r.returncode, r.stderr)


def test_supervise_without_a_command_is_refused(tmp_path, capsys):
    """``resume ROOT --supervise --requeue`` without ``-- CMD`` printed the step and exited
    0, as if it had supervised something (found with the review above)."""
    rc, out, err = call("resume", str(tmp_path / "ck"), "--supervise", "--requeue",
                        capsys=capsys)
    assert rc == 2 and "--supervise needs CMD" in err, (rc, out, err)
