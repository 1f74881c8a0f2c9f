"""The preemption path's review of 2026-12-06:

* a stop signal was lost once another library had taken the wakeup fd and given it back
  (asyncio's ``add_signal_handler`` resets it to -1 when its loop closes): the trap's handler
  recorded the SIGTERM, but the signal thread read only the wakeup fd, and waited on it for
  ever; the job trained on and exited 0 (SIGKILL at the end of the window in production);
* ``FASTCKPT_GRACE_S`` (set by the Slurm and Kubernetes recipes) armed every Checkpointer, the
  one-off calls' too: ``fastckpt.load``/``steps``/``read`` beside the job's Checkpointer raised
  "another Checkpointer already holds the preemption trap";
* a rank-0-only one-off call (``fastckpt.latest_step(root)``) shifted the store prefix of the
  job's Checkpointer on that rank only: its first collective timed out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time

import torch

import fastckpt
from tests import distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

_ASYNCIO_THEN_SIGTERM = textwrap.dedent("""
    import asyncio, os, signal, sys, time, torch, fastckpt
    ck = fastckpt.Checkpointer(sys.argv[1], grace_s=10)
    async def side_job():  # e.g. an async uploader or health server run once
        asyncio.get_running_loop().add_signal_handler(signal.SIGUSR2, lambda: None)
        await asyncio.sleep(0.01)
    asyncio.run(side_job())  # its loop's close resets the wakeup fd to -1
    state = {"w": torch.zeros(10)}
    for step in range(1, 200):
        state["w"].fill_(step)
        if step == 5:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.05)
        ck.save(state, step=step, on_preempt=True)
    print("the loop ended: the signal was lost", flush=True)
""")


def test_a_stop_signal_after_another_library_took_the_wakeup_fd_is_acted_on(tmp_path):
    root = str(tmp_path / "r")
    r = subprocess.run([sys.executable, "-c", _ASYNCIO_THEN_SIGTERM, root], capture_output=True,
                       text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 143, (r.returncode, r.stdout, r.stderr[-2000:])
    assert "the signal was lost" not in r.stdout
    step = fastckpt.latest_step(root)
    assert step is not None and step >= 5
    got = {"w": torch.zeros(10)}
    assert fastckpt.load(got, root) == step and torch.equal(got["w"], torch.full((10,), step))


_ONE_OFF_BESIDE_THE_JOB = textwrap.dedent("""
    import sys, torch, fastckpt
    root, other = sys.argv[1], sys.argv[2]
    ck = fastckpt.Checkpointer(root)  # armed by FASTCKPT_GRACE_S, as the recipes set it
    assert ck.preemption is not None
    ck.save({"w": torch.ones(4)}, step=1, block=True)
    assert fastckpt.latest_step(root) == 1 and fastckpt.steps(root) == [1]
    assert torch.equal(fastckpt.read(root)["w"], torch.ones(4))
    got = {"w": torch.zeros(4)}
    assert fastckpt.load(got, root) == 1
    fastckpt.save({"w": torch.ones(4)}, other, step=3)
    ck.close()
    print("ok", flush=True)
""")


def test_one_off_calls_beside_the_jobs_armed_checkpointer_take_no_trap(tmp_path):
    r = subprocess.run([sys.executable, "-c", _ONE_OFF_BESIDE_THE_JOB, str(tmp_path / "r"),
                        str(tmp_path / "o")], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": REPO, "FASTCKPT_GRACE_S": "30"})
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


def _rank0_looks_first(rank: int, world: int, root: str, probe: str):
    if rank == 0:
        fastckpt.latest_step(probe)  # rank-local (no collective), before the job's
        fastckpt.steps(root)
    with fastckpt.Checkpointer(root, plan_timeout_s=10) as ck:
        st = {"w": torch.full((4,), float(rank))}
        ck.save(st, step=1, block=True)
        got = {"w": torch.zeros(4)}
        return ck.load(got), torch.equal(got["w"], st["w"])


def test_a_rank_local_call_on_one_rank_does_not_put_the_jobs_exchanges_apart(tmp_path):
    out = distributed.run(_rank0_looks_first, 2, str(tmp_path / "r"), str(tmp_path / "p"),
                          timeout=120)
    assert out == [(1, True), (1, True)]


_PERIODIC_THEN_ON_PREEMPT = textwrap.dedent("""
    import os, signal, sys, time, torch, fastckpt
    ck = fastckpt.Checkpointer(sys.argv[1], grace_s=10)
    state = {"w": torch.zeros(1 << 16)}
    for step in range(1, 200):
        state["w"].fill_(step)
        ck.save(state, step=step, block=True)  # the periodic save (every step), committed
        if step == 6:
            os.kill(os.getpid(), signal.SIGTERM)
        ck.save(state, step=step, on_preempt=True)  # the stop lands on a committed step
    print("the loop ended", flush=True)
""")


def test_a_stop_at_a_step_its_periodic_save_committed_writes_nothing_again(tmp_path):
    root = str(tmp_path / "r")
    r = subprocess.run([sys.executable, "-c", _PERIODIC_THEN_ON_PREEMPT, root],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 143, (r.returncode, r.stderr[-2000:])
    events = [json.loads(line) for line in open(os.path.join(root, "events", "rank00000.jsonl"))]
    (d,) = [e for e in events if e["event"] == "decision"]
    assert d["decision"] == "committed" and d["step"] >= 6, d
    assert not [e for e in events if e["event"] == "save_start"]
    t = d["step"]
    dt = os.path.join(root, f"step-{t:010d}")
    assert len([n for n in os.listdir(dt) if n.endswith(".fck")]) == 1  # one save's shard
    got = {"w": torch.zeros(1 << 16)}
    assert fastckpt.load(got, root) == t and torch.equal(got["w"], torch.full((1 << 16,), t))


def test_close_leaves_a_handler_installed_after_the_trap():
    """``close`` gave SIGTERM/SIGUSR1 back to their earlier handlers even when the job had
    installed its own after the trap (Lightning's, submitit's requeue handler): it replaced
    them with SIG_DFL / SIG_IGN. It undoes only its own handler now."""
    import signal

    from fastckpt.preempt.signals import SignalTrap
    before = signal.getsignal(signal.SIGUSR2)
    trap = SignalTrap({signal.SIGUSR2})
    trap.install()
    try:
        def mine(signum, frame):
            pass
        signal.signal(signal.SIGUSR2, mine)
        trap.close()
        assert signal.getsignal(signal.SIGUSR2) is mine
    finally:
        trap.close()
        signal.signal(signal.SIGUSR2, before)


def test_a_cancel_after_the_stop_consensus_gives_every_rank_one_exit_code(tmp_path):
    """SIGTERM (preempt) to rank 0, then SIGINT (cancel) to rank 1 while it is still in its
    long step, after the consensus: the ranks exited 143 and 0, and a supervisor taking the
    highest code requeued a cancelled job. The exit barrier now agrees on the cancel."""
    import signal

    from tests.preempt_worker import launch
    from tests.test_preempt import _events, _wait, _wait_step
    cfg = {"root": str(tmp_path / "ckpt"), "out": str(tmp_path / "out"), "tag": "c",
           "total": 40, "step_s": 0.03, "grace_s": 20.0, "cancel_signals": ["SIGINT"],
           "long_step": {"1": [4, 3.0]}}
    procs = launch(2, cfg)
    _wait_step(cfg["out"], "c", 1, 4, procs)  # rank 1 is in its 3 s step
    os.kill(procs[0].pid, signal.SIGTERM)
    time.sleep(1.0)
    os.kill(procs[1].pid, signal.SIGINT)
    codes = _wait(procs, 60)
    assert codes[0] == codes[1] == 0, codes  # cancelled, on both ranks
    for r in range(2):
        (ex,) = [e for e in _events(cfg["root"], r) if e["event"] == "exit"]
        assert ex["reason"] == "cancelled", ex
