"""Crash consistency: SIGKILL a writer anywhere in a save; resume never sees a half-written step."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

import fastckpt
from fastckpt.testing import faults
from tests.crash_worker import blank, state_for
from tests.distributed import Died, run

ROOT_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIB = 8


def _worker(root, a, b, mib=MIB, salt=0, fault=None, **popen):
    env = dict(os.environ, PYTHONPATH=ROOT_DIR)
    env.pop("FASTCKPT_TEST_FAULT", None)
    if fault:
        env["FASTCKPT_TEST_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "tests.crash_worker", root, str(a), str(b),
                             str(mib), str(salt)], env=env, cwd=ROOT_DIR, **popen)


def _load_exact(root, mib=MIB):
    """Load the newest committed step and check every byte against what that step saved."""
    st = blank(mib)
    step = fastckpt.load(st, root)
    want = state_for(step, mib, st["salt"])
    for k in ("w", "b", "h"):
        assert torch.equal(st[k], want[k]), (step, k)
    assert st["step"] == step and st["note"] == f"step {step}"
    return step, st["salt"]


@pytest.mark.parametrize("fault,committed", [
    ("before_write", False), ("mid_shard_write", False), ("after_shard_write", False),
    ("before_manifest", False), ("manifest_tmp_written", False),
    ("after_manifest", True), ("during_retention", True)])
def test_sigkill_at_each_commit_point(root, fault, committed):
    assert _worker(root, 1, 2).wait() == 0
    p = _worker(root, 2, 3, fault=fault)
    assert p.wait() == -signal.SIGKILL
    assert _load_exact(root) == ((2, 0) if committed else (1, 0))
    # the next save succeeds and removes what the crash left behind
    assert _worker(root, 3, 4).wait() == 0
    assert _load_exact(root) == (3, 0)
    steps = sorted(os.listdir(root))
    assert "step-0000000002" not in steps or committed
    for d in steps:
        if d.startswith("step-"):
            names = os.listdir(os.path.join(root, d))
            assert "manifest.json" in names and not any(".tmp" in n or ".inflight" in n
                                                        for n in names), (d, names)


@pytest.mark.parametrize("fault", ["mid_shard_write", "before_manifest", "manifest_tmp_written"])
def test_resave_of_committed_step_keeps_old_copy_until_commit(root, fault):
    assert _worker(root, 1, 2, salt=0).wait() == 0
    p = _worker(root, 1, 2, salt=5, fault=fault)  # same step, other content, killed
    assert p.wait() == -signal.SIGKILL
    assert _load_exact(root) == (1, 0)
    assert _worker(root, 1, 2, salt=6).wait() == 0
    assert _load_exact(root) == (1, 6)
    assert len([n for n in os.listdir(os.path.join(root, "step-0000000001"))
                if n.endswith(".fck")]) == 1


def test_sigkill_at_random_times(root):
    """Kill a process saving 24 MiB steps back to back at random moments, 8 times."""
    rng = random.Random(1234)
    assert _worker(root, 0, 1, mib=24).wait() == 0
    last = 0
    for i in range(8):
        p = _worker(root, last + 1, last + 50, mib=24, stdout=subprocess.PIPE, text=True)
        line = p.stdout.readline()  # the first save of this incarnation committed
        assert line.startswith("committed"), line
        time.sleep(rng.uniform(0.0, 0.6))
        p.kill()
        p.wait()
        step, _ = _load_exact(root, mib=24)
        assert step >= last + 1
        last = step


def _two_rank_fault(rank, world, root):
    storage = faults.open_faulty(root, rank=rank)
    ck = fastckpt.Checkpointer(storage, commit_timeout_s=4)
    ck.save(state_for(1, 1), step=1).wait()
    storage.arm(kill_at=faults.kill_point(os.environ["FAULT_LATER"], rank))
    t0 = time.monotonic()
    h = ck.save(state_for(2, 1), step=2)
    try:
        h.wait()
        return ("committed", time.monotonic() - t0)
    except fastckpt.FastCkptError as e:
        return (type(e).__name__, time.monotonic() - t0, getattr(e, "missing_ranks", None),
                str(e))
    finally:
        ck._closed = True  # the failure was observed above


@pytest.mark.parametrize("fault,dead", [("after_shard_write@1", 1), ("before_manifest@0", 0)])
def test_dead_peer_fails_commit_within_deadline(root, fault, dead):
    out = run(_two_rank_fault, 2, root, env={"FAULT_LATER": fault}, allow_death=True,
              timeout=60)
    assert isinstance(out[dead], Died) and out[dead].exitcode == -signal.SIGKILL
    alive = out[1 - dead]
    name, took, missing, msg = alive
    assert name == "CommitTimeoutError" and missing == [dead], alive
    # a dead rank 0 also takes the store down with it: rank 1 then learns at once
    assert took <= 4 + 5, alive
    if dead == 1:
        assert took >= 3.5, alive  # rank 0 waited for the deadline before giving up
    assert f"[{dead}]" in msg and "previous committed checkpoint is intact" in msg
    st = blank(1)
    assert fastckpt.load(st, root) == 1 and torch.equal(st["w"], state_for(1, 1)["w"])


def test_rank0_killed_right_after_commit_leaves_a_whole_checkpoint(root):
    """Rank 0 dies after publishing the manifest and before telling anybody. Rank 1 cannot read
    the verdict; it must find the manifest, report the save committed and keep its shards (it
    used to report "nothing was committed" and delete them under a committed manifest)."""
    out = run(_two_rank_fault, 2, root, env={"FAULT_LATER": "after_manifest@0"},
              allow_death=True, timeout=60)
    assert isinstance(out[0], Died) and out[0].exitcode == -signal.SIGKILL
    assert out[1][0] == "committed", out[1]
    from fastckpt.tools.verify import verify_step
    res = verify_step(root, record=False)
    assert res.step == 2 and not res.problems, res.problems
    st = blank(1)
    assert fastckpt.load(st, root) == 2 and torch.equal(st["w"], state_for(2, 1)["w"])
