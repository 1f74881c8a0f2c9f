"""``fastckpt slurm`` and the supervisor's self-requeue.

Without a cluster: the script's shape (bash syntax, the #SBATCH lines, the exec-form resume
in front of srun) and the grace window from ``fastckpt bench``'s record. Real jobs on the
one-node Slurm that ``scripts/slurm.sh`` starts are in tests/test_slurm_jobs.py."""

from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from fastckpt.tools.slurm import sbatch_script
from tests.clirun import call


def _script(**kw):
    args = dict(root="/nvme/ck/run 1", cmd=["python", "train.py", "--tag", "a b"], grace_s=40,
                source="--grace", name="run1", nodes=1, ntasks_per_node=2)
    args.update(kw)
    return sbatch_script(**args)


def _exec_line(text: str) -> list[str]:
    """The script's exec command, with its continuation lines joined, as words."""
    lines = text.splitlines()
    i = next(i for i, ln in enumerate(lines) if ln.startswith("exec "))
    cmd = ""
    for ln in lines[i:]:
        cmd += ln.rstrip("\\").strip() + " "
        if not ln.endswith("\\"):
            break
    return shlex.split(cmd)


@pytest.mark.parametrize("launcher", ["srun", "torchrun"])
def test_script_is_bash_and_says_what_it_must(launcher):
    text = _script(launcher=launcher, nodes=2, time_limit="01:00:00", partition="low")
    r = subprocess.run(["bash", "-n"], input=text, text=True, capture_output=True)
    assert r.returncode == 0, r.stderr
    sb = [ln.split(None, 1)[1] for ln in text.splitlines() if ln.startswith("#SBATCH")]
    assert "--requeue" in sb and "--open-mode=append" in sb
    assert "--signal=B:USR1@45" in sb  # the window plus 5 s for the requeue
    assert "--time=01:00:00" in sb and "--partition=low" in sb and "--nodes=2" in sb
    assert f"--ntasks-per-node={2 if launcher == 'srun' else 1}" in sb
    assert 'FASTCKPT_SIGNAL_GRACE_S="SIGUSR1=40,SIGTERM=${kill_wait:-30}"' in text
    words = _exec_line(text)
    assert words[:6] == ["exec", "fastckpt", "resume", "/nvme/ck/run 1", "--supervise",
                         "--requeue"]
    srun = words.index("srun")
    assert "--open-mode=append" in words[srun:] and "--output=/nvme/ck/run 1/logs/%x-%j-%t.out" \
        in words[srun:]
    assert words[-4:] == ["python", "train.py", "--tag", "a b"]
    if launcher == "srun":  # each task: exec-form resume (maps SLURM_* to RANK etc.)
        assert words[srun + 3:srun + 7] == ["fastckpt", "resume", "/nvme/ck/run 1", "-q"]
    else:  # one torchrun per node, under a supervisor of its own
        assert words[srun + 3:srun + 8] == ["fastckpt", "resume", "/nvme/ck/run 1", "-q",
                                            "--supervise"]
        assert "--nnodes=2" in words and "--nproc-per-node=2" in words
        # the time limit's USR1 reaches the ranks as USR1 (their window, not KillWait's)
        assert "--signals-to-handle=SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1" in words


def test_script_refuses_what_cannot_work():
    with pytest.raises(ValueError, match="no command"):
        _script(cmd=[])
    with pytest.raises(ValueError, match="job name"):
        _script(name="a b")
    with pytest.raises(ValueError, match="launcher"):
        _script(launcher="mpirun")
    note = _script(kill_wait=10)
    assert "KillWait is 10 s < 40 s" in note and "KillWait is" not in _script(kill_wait=60)


def test_cli_takes_the_grace_window_from_the_bench_record(tmp_path, capsys):
    root = tmp_path / "run"
    root.mkdir()
    rc, out, err = call("slurm", str(root), "--", "python", "train.py", capsys=capsys)
    assert rc == 2 and "no grace window" in err and "fastckpt bench" in err
    (root / ".fastckpt-bench.json").write_text(json.dumps({
        "format": "fastckpt-bench", "version": 1, "measured": "2026-12-01",
        "grace": {"seconds": 77, "state_bytes": 10 << 30, "save_bytes_per_s": 1 << 30}}))
    rc, out, err = call("slurm", str(root), "--ntasks-per-node", "4", "--", "python",
                        "train.py", capsys=capsys)
    assert rc == 0, err
    assert "#SBATCH --signal=B:USR1@82" in out and "export FASTCKPT_GRACE_S=77" in out
    assert "fastckpt bench record" in out and "#SBATCH --job-name=run" in out
    rc, out, err = call("slurm", str(root), "--grace", "20", "--", "x", capsys=capsys)
    assert rc == 0 and "#SBATCH --signal=B:USR1@25" in out


def test_requeue_needs_supervise(tmp_path, capsys):
    rc, out, err = call("resume", str(tmp_path), "--requeue", "--", "true", capsys=capsys)
    assert rc == 2 and "--requeue needs --supervise" in err
