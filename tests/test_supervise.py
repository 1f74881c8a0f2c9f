"""``fastckpt resume ROOT --supervise -- torchrun ...`` with a real torchrun and 2 gloo workers:
the stop signal reaches the workers (torchrun dies of SIGUSR1 and forwards only SIGTERM), and
the job's exit code is the ranks' stop code (torchrun itself exits 1 after they exit 143);
plus ``python -m fastckpt.preempt``'s exit-code recipe after a normal finish."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from fastckpt import preempt

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "torchrun_worker.py")
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
            "2"]


def _env():
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}


def _supervised(root, progress, steps, *extra):
    return subprocess.Popen(
        [sys.executable, "-m", "fastckpt.cli", "resume", root, "--supervise", "--",
         *TORCHRUN, WORKER, root, str(steps), progress, *extra],
        env=_env(), stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_steps(progress, n, p, timeout=120):
    end = time.monotonic() + timeout
    while time.monotonic() < end and p.poll() is None:
        if os.path.exists(progress) and len(open(progress).read().split()) >= n:
            return
        time.sleep(0.05)
    raise AssertionError(f"no {n} steps (exit {p.poll()}): "
                         + (p.stderr.read()[-3000:] if p.poll() is not None else ""))


def _finish(p, timeout=120):
    try:
        _, err = p.communicate(timeout=timeout)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
    return p.returncode, err


@pytest.mark.parametrize("sig", [signal.SIGUSR1, signal.SIGTERM])
def test_supervised_torchrun_stops_saves_and_exits_143(tmp_path, sig):
    root, progress = str(tmp_path / "ck"), str(tmp_path / "progress")
    p = _supervised(root, progress, 100000)
    _wait_steps(progress, 5, p)
    p.send_signal(sig)  # to the supervisor only, as Slurm's --signal=B: does
    rc, err = _finish(p)
    assert rc == preempt.EXIT_PREEMPTED, err[-3000:]
    assert "the ranks logged a stop with exit code 143" in err
    sup = [json.loads(line) for line in open(os.path.join(root, "events", "supervisor.jsonl"))]
    assert sup[-1]["event"] == "supervisor_exit" and sup[-1]["code"] == 143
    assert 0 <= sup[-1]["teardown_s"] < 60  # measured: the ranks' exit event to torchrun's end
    events = os.path.join(root, "events")
    assert preempt.job_exit_code(events) == 143
    commits = []
    for r in (0, 1):
        evs = [json.loads(line) for line in open(os.path.join(events, f"rank{r:05d}.jsonl"))]
        commits.append([e["step"] for e in evs if e["event"] == "commit"][-1])
    assert commits[0] == commits[1] >= 4
    # and the requeued job resumes from it and runs to the end
    p = _supervised(root, progress, commits[0] + 4)
    rc, err = _finish(p)
    assert rc == 0, err[-3000:]
    assert f"resuming from step {commits[0]}" in err
    # the requeued ranks kept the measured teardown out of their grace window
    armed = [json.loads(line) for line in open(os.path.join(events, "rank00000.jsonl"))
             if '"armed"' in line][-1]
    assert armed["teardown_source"].startswith("measured by the supervisor"), armed
    assert armed["teardown_s"] == pytest.approx(
        min(sup[-1]["teardown_s"] * 1.25 + 0.25, armed["grace_s"] / 2), abs=2e-3)


def _children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def test_supervised_torchrun_passes_usr1_on_as_itself_and_waits_the_window(tmp_path):
    """Slurm's time-limit warning (SIGUSR1) reaches the ranks as SIGUSR1 when torchrun is told
    to pass it on (``--signals-to-handle``, as the generated Slurm script does), so the ranks
    budget the USR1 window, not SIGTERM's (KillWait): before 2026-12-06 the supervisor turned
    it into SIGTERM. And torchrun is given the ranks' longest window before it SIGKILLs them
    (TORCH_ELASTIC_SHUTDOWN_TIMEOUT: 30 s otherwise, which killed longer saves mid-write)."""
    root, progress = str(tmp_path / "ck"), str(tmp_path / "progress")
    env = {**_env(), "FASTCKPT_SIGNAL_GRACE_S": "SIGUSR1=45,SIGTERM=5"}
    p = subprocess.Popen(
        [sys.executable, "-m", "fastckpt.cli", "resume", root, "--supervise", "--",
         *TORCHRUN, "--signals-to-handle=SIGTERM,SIGINT,SIGUSR1", WORKER, root, "100000",
         progress], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _wait_steps(progress, 5, p)
        (torchrun,) = _children(p.pid)
        with open(f"/proc/{torchrun}/environ", "rb") as f:
            seen = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        assert seen.get(b"TORCH_ELASTIC_SHUTDOWN_TIMEOUT") == b"50", seen.get(
            b"TORCH_ELASTIC_SHUTDOWN_TIMEOUT")
        p.send_signal(signal.SIGUSR1)
    finally:
        rc, err = _finish(p)
    assert rc == preempt.EXIT_PREEMPTED, err[-3000:]
    for r in (0, 1):
        evs = [json.loads(line) for line in open(os.path.join(root, "events",
                                                              f"rank{r:05d}.jsonl"))]
        sig = [e for e in evs if e["event"] == "signal"][-1]
        assert sig["signal"] == "SIGUSR1", sig
        dec = [e for e in evs if e["event"] == "decision"][-1]
        assert dec["left_s"] > 20, dec  # the USR1 window (45 s), not SIGTERM's 5 s


def test_supervised_torchrun_on_a_remote_root_exits_143(tmp_path):
    """A remote ROOT (fsspec's ``local://`` stands in for s3://: the ranks' files are not
    under a local ROOT/events): the supervisor points the ranks' event log at a directory on
    this machine and exits with their 143 (before 2026-12-06 no rank logged anything it could
    read, and it exited with torchrun's 1: a failure to Kubernetes, no requeue on Slurm)."""
    import shutil
    from fastckpt.cli.supervise import local_events
    root, progress = "local://" + str(tmp_path / "ck"), str(tmp_path / "progress")
    events = local_events(root)
    shutil.rmtree(events, ignore_errors=True)
    try:
        p = _supervised(root, progress, 100000)
        _wait_steps(progress, 5, p)
        p.send_signal(signal.SIGTERM)
        rc, err = _finish(p)
        assert rc == preempt.EXIT_PREEMPTED, err[-3000:]
        assert "the ranks logged a stop with exit code 143" in err
        assert preempt.job_exit_code(events) == 143
    finally:
        shutil.rmtree(events, ignore_errors=True)


def test_torchrun_shutdown_timeout_and_signals_from_the_command():
    from fastckpt.cli.supervise import torchrun_env, torchrun_signals
    tr = ("torchrun", "--nproc-per-node=2", "train.py")
    assert torchrun_env(tr, {"FASTCKPT_GRACE_S": "90"}) == {
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "95"}
    assert torchrun_env(tr, {"FASTCKPT_SIGNAL_GRACE_S": "SIGUSR1=120,SIGTERM=30"}) == {
        "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "125"}
    # no window configured: the ranks assume 30 s (or their platform's), torchrun 30 s + 5
    assert torchrun_env(tr, {}) == {"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "35"}
    assert torchrun_env(tr, {"FASTCKPT_GRACE_S": "10"}) == {}  # (30 s: torchrun's own)
    assert torchrun_env(tr, {"FASTCKPT_GRACE_S": "90",
                             "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "40"}) == {}  # the user's
    assert torchrun_env(("torchrun", "--shutdown-timeout", "40", "t.py"),
                        {"FASTCKPT_GRACE_S": "90"}) == {}
    assert torchrun_env(("python", "train.py"), {"FASTCKPT_GRACE_S": "90"}) == {}
    assert torchrun_signals(("torchrun", "--signals-to-handle", "SIGTERM,sigusr1", "t.py")) == {
        "SIGTERM", "SIGUSR1"}
    assert torchrun_signals(("torchrun", "t.py", "--signals-to-handle=SIGUSR1")) == set()
    assert torchrun_signals(("srun", "--signals-to-handle=SIGUSR1")) == set()


def test_teardown_reserve_from_measurements_configuration_or_default(tmp_path):
    from fastckpt.preempt.budget import teardown_reserve
    ev = tmp_path / "events"
    assert teardown_reserve(None, 30.0, str(ev)) == (2.0, "default (not measured)")
    assert teardown_reserve(None, 5.0, None) == (0.5, "default (not measured)")
    assert teardown_reserve(3.5, 30.0, str(ev)) == (3.5, "configured")
    ev.mkdir()
    with open(ev / "supervisor.jsonl", "w") as f:
        for t in (9.0, 1.0, 1.2, "x", 2.0, 1.1, 0.9, -1):  # 9.0 is older than the last 5
            f.write(json.dumps({"event": "supervisor_exit", "teardown_s": t}) + "\n")
        f.write("not json\n")
    secs, source = teardown_reserve(None, 30.0, str(ev))
    assert secs == pytest.approx(2.0 * 1.25 + 0.25) and "2.00 s" in source
    assert teardown_reserve(None, 4.0, str(ev))[0] == 2.0  # never more than half the window


def test_supervised_crash_keeps_the_launchers_code(tmp_path):
    root, progress = str(tmp_path / "ck"), str(tmp_path / "progress")
    rc, err = _finish(_supervised(root, progress, 50, "3"))
    assert rc == 1, err[-3000:]  # torchrun's: a crash, not a stop
    assert "crashing at step 3" in err


def test_exit_code_recipe_after_a_normal_finish_and_without_events(tmp_path):
    def code(*args):
        r = subprocess.run([sys.executable, "-m", "fastckpt.preempt", *args],
                           capture_output=True, text=True, env=_env())
        assert r.stdout.strip() == str(r.returncode), (r.stdout, r.stderr)
        return r.returncode, r.stderr
    missing = str(tmp_path / "nothing" / "events")
    assert code(missing, "0")[0] == 0  # a normal finish: no traceback, no "none"
    assert code(missing, "1")[0] == 1
    rc, err = code(missing)
    assert rc == 1 and "pass $? as the second argument" in err
    ev = tmp_path / "events"
    ev.mkdir()
    t = time.time()
    (ev / "rank00000.jsonl").write_text(
        json.dumps({"event": "armed", "t": t}) + "\n" + json.dumps({"event": "exit", "code": 143,
                                                                   "t": t + 1}) + "\n")
    (ev / "rank00001.jsonl").write_text(json.dumps({"event": "armed", "t": t}) + "\n")
    assert code(str(ev), "1")[0] == 143  # the ranks' stop wins over torchrun's 1
    assert preempt.job_exit_code(str(ev), since=t + 5) is None  # an earlier run's stop
    # with the launch time: this run crashed before any rank armed its trap, so the earlier
    # run's 143 is not its code (it reported 143, "restart me", for a crash)
    assert code(str(ev), "1", str(t + 5))[0] == 1
    assert code(str(ev), "1", str(t - 5))[0] == 143
    assert code(str(ev), "1", "soon")[0] == 2


# ------------------------------------------------- srun tasks: torch.distributed's variables
# Simulated: the SLURM_* variables srun sets are written by the test (no Slurm runs here).

def test_first_host_of_a_slurm_hostlist():
    from fastckpt.options import first_slurm_host
    assert first_slurm_host("gpu[007-010,12],cpu1") == "gpu007"
    assert first_slurm_host("node3") == "node3"
    assert first_slurm_host("rack[1-2]-n[3-4],x") == "rack1-n3"
    assert first_slurm_host("a-[08,09]") == "a-08"
    assert first_slurm_host("") is None


def test_srun_task_gets_torch_variables_and_the_batch_script_does_not(tmp_path):
    from fastckpt.options import torch_env_from_slurm
    task = {"SLURM_JOB_ID": "4242", "SLURM_PROCID": "5", "SLURM_STEP_NUM_TASKS": "8",
            "SLURM_LOCALID": "1", "SLURM_STEP_NODELIST": "gpu[003-004]"}
    assert torch_env_from_slurm(task) == {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1",
                                          "MASTER_ADDR": "gpu003", "MASTER_PORT": "33742"}
    assert torch_env_from_slurm({**task, "RANK": "0", "MASTER_PORT": "1"}) == {
        "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "gpu003"}  # set ones are kept
    batch = {k: v for k, v in task.items() if k != "SLURM_STEP_NUM_TASKS"}
    assert torch_env_from_slurm(batch) == {}  # the batch step: SLURM_PROCID=0 but no step
    # through the CLI: the exec'd command sees them; torchrun (which sets its own) does not
    show = [sys.executable, "-c",
            "import os; print(os.environ.get('RANK'), os.environ.get('WORLD_SIZE'))"]
    env = {k: v for k, v in _env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                          "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-m", "fastckpt.cli", "resume", str(tmp_path / "ck"),
                        "--", *show], env={**env, **task}, capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.split() == ["5", "8"], r.stderr
    assert "from Slurm: RANK=5 WORLD_SIZE=8" in r.stderr


@pytest.mark.parametrize("log", ["fifo", "directory", "not_utf8", "unreadable"])
def test_a_bad_event_log_keeps_the_commands_exit_code(tmp_path, log):
    """``ROOT/events/rank0.jsonl`` that is a FIFO, a directory, not UTF-8 or unreadable: the
    supervisor still exits with CMD's code. Before 2026-12-06 the FIFO blocked it for good
    (SIGTERM ignored), the others turned 143 into 126 or 70 (a job not requeued)."""
    import stat as st
    root = tmp_path / "ck"
    events = root / "events"
    events.mkdir(parents=True)
    p = events / "rank0.jsonl"
    if log == "fifo":
        os.mkfifo(p)
    elif log == "directory":
        p.mkdir()
    elif log == "not_utf8":
        p.write_bytes(b'\xff\xfe{"event": "exit", "code": 143, "t": %d}\n' % int(time.time()))
    else:
        p.write_text("{}\n")
        p.chmod(0)
        if os.access(p, os.R_OK):  # (as root: every file is readable)
            p.chmod(st.S_IWUSR)
            pytest.skip("running with CAP_DAC_OVERRIDE: nothing is unreadable")
    r = subprocess.run([sys.executable, "-m", "fastckpt.cli", "resume", str(root),
                        "--supervise", "--", "sh", "-c", "exit 143"],
                       env=_env(), capture_output=True, text=True, timeout=60)
    assert r.returncode == 143, r.stderr[-2000:]


PID1_WORKER = """
import os, signal, sys, time, torch, fastckpt
# as a container's init starts: SIGTERM at its default (an ignored disposition is inherited,
# and an earlier in-process test may leave the test process ignoring SIGTERM)
signal.signal(signal.SIGTERM, signal.SIG_DFL)
ck = fastckpt.Checkpointer(sys.argv[1], grace_s=10)
ck.save({"w": torch.zeros(1000)}, step=1, on_preempt=True)
ck.close()
print(f"pid {os.getpid()} closed", flush=True)
time.sleep(60)
"""


def test_a_closed_job_running_as_pid_1_still_stops_on_sigterm(tmp_path):
    """A container's PID 1 (``fastckpt resume ROOT -- CMD`` in exec form): the kernel delivers
    no signal left at its default disposition to a PID namespace's init, so a job that closed
    its Checkpointer (the trap gives SIGTERM "its default" back) ignored the kubelet's SIGTERM
    and waited for SIGKILL, the whole grace period (before 2026-12-06). A real PID namespace
    (``unshare --pid``); skipped where this process may not make one."""
    import shutil
    unshare = shutil.which("unshare")
    cmd = [unshare, "--pid", "--fork", "--kill-child"] if unshare else None
    if cmd is None or subprocess.run([*cmd, "true"], capture_output=True).returncode != 0:
        pytest.skip("unshare --pid is not available here")
    p = subprocess.Popen([*cmd, sys.executable, "-c", PID1_WORKER, str(tmp_path / "ck")],
                         env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("pid 1 closed"), (line, p.poll())
        (child,) = _children(p.pid)
        t0 = time.monotonic()
        os.kill(child, signal.SIGTERM)  # from outside its namespace, as the kubelet's
        rc = p.wait(timeout=30)
        assert rc == 143 and time.monotonic() - t0 < 10, (rc, p.stderr.read()[-2000:])
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
