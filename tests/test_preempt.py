"""Preemption: real processes, real signals, gloo on CPU, 2 and 4 ranks.

Each multi-rank test runs ``tests.preempt_worker`` (a data-parallel Adam loop calling
``save(..., on_preempt=True)`` every step), signals chosen ranks, checks exit codes and the
per-rank event logs, and resumes: losses and optimizer moments must equal an uninterrupted run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt import preempt
from tests.preempt_worker import launch

TOTAL = 12


# ----------------------------------------------------------------------------------- helpers

def _wait(procs, timeout=90.0):
    end = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.1, end - time.monotonic()))
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
        p.join()
    assert not alive, f"ranks still running after {timeout}s"
    return [p.exitcode for p in procs]


def _losses(out, tag, rank=0):
    path = os.path.join(out, f"losses-{tag}-r{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def _wait_step(out, tag, rank, step, procs, timeout=60.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        ls = _losses(out, tag, rank)
        if ls and ls[-1]["step"] >= step:
            return ls[-1]["step"]
        assert all(p.exitcode is None for p in procs), [p.exitcode for p in procs]
        time.sleep(0.01)
    raise AssertionError(f"rank {rank} did not reach step {step}")


def _wait_file(path, procs, timeout=30.0):
    end = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < end, f"{path} did not appear"
        assert all(p.exitcode is None for p in procs), [p.exitcode for p in procs]
        time.sleep(0.01)


def _events(root, rank):
    with open(os.path.join(root, "events", f"rank{rank:05d}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _one(evs, name):
    found = [e for e in evs if e["event"] == name]
    assert found, (name, [e["event"] for e in evs])
    return found[-1]


def _cfg(tmp, tag, **kw):
    cfg = {"root": str(tmp / "ckpt"), "out": str(tmp / "out"), "tag": tag, "total": TOTAL,
           "step_s": 0.03, "grace_s": 20.0}
    cfg.update(kw)
    return cfg


_BASE: dict = {}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """Uninterrupted runs, one per world size: losses and final model/optimizer state."""
    def get(world):
        if world not in _BASE:
            tmp = tmp_path_factory.mktemp(f"base{world}")
            cfg = _cfg(tmp, "base")
            assert _wait(launch(world, cfg)) == [0] * world
            _BASE[world] = (_losses(cfg["out"], "base"),
                            torch.load(os.path.join(cfg["out"], "final-base-r0.pt")))
        return _BASE[world]
    return get


def _check_resume_exact(tmp, world, cfg, stop_step, baseline):
    """Resume from the emergency checkpoint: everything equals the uninterrupted run."""
    rcfg = dict(cfg, tag="resumed")
    for k in ("long_step", "fault_after_periodic", "throttle_mibps", "staging_cap_mib"):
        rcfg.pop(k, None)
    if "slow_resume_s" in rcfg:
        rcfg["slow_resume_s"] = 0.01
    assert _wait(launch(world, rcfg)) == [0] * world
    with open(os.path.join(cfg["out"], "resumed-resumed-r0")) as f:
        assert json.load(f) == stop_step
    base_losses, base_final = baseline(world)
    got = [x for x in _losses(cfg["out"], cfg["tag"]) if x["step"] <= stop_step]
    got += _losses(cfg["out"], "resumed")
    assert [x["step"] for x in got] == list(range(TOTAL))
    assert [x["loss"] for x in got] == [x["loss"] for x in base_losses]
    final = torch.load(os.path.join(cfg["out"], "final-resumed-r0.pt"))
    for k, v in base_final["model"].items():
        assert torch.equal(final["model"][k], v), k
    for pid, st in base_final["optim"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(final["optim"]["state"][pid][k], st[k]), (pid, k)


def _check_agreed(root, world, first_signal_t, step_s):
    """Every rank agreed on one stop step, quickly, and exited 143 after committing it."""
    stops = set()
    for r in range(world):
        evs = _events(root, r)
        c = _one(evs, "consensus")
        stops.add(c["stop_step"])
        assert c["t"] - first_signal_t <= step_s + 0.5 + 0.5, c  # +0.5 s: a loaded 2-core box
        assert _one(evs, "exit")["code"] == preempt.EXIT_PREEMPTED
        assert _one(evs, "commit")["step"] == c["stop_step"]
        assert _one(evs, "barrier")["ok"]
    assert len(stops) == 1, stops
    return stops.pop()


# ---------------------------------------------------------------------------- multi-rank tests

@pytest.mark.parametrize("world,sig,target", [(2, signal.SIGTERM, 1), (4, signal.SIGUSR1, 2)])
def test_signal_to_one_rank_before_any_checkpoint(tmp_path, baseline, world, sig, target):
    cfg = _cfg(tmp_path, "run")
    procs = launch(world, cfg)
    _wait_step(cfg["out"], "run", target, 4, procs)
    assert not os.path.exists(os.path.join(cfg["root"], "latest"))  # nothing committed yet
    t_sig = time.time()
    os.kill(procs[target].pid, sig)
    assert _wait(procs, 60) == [preempt.EXIT_PREEMPTED] * world
    stop = _check_agreed(cfg["root"], world, t_sig, cfg["step_s"])
    sig_ev = _one(_events(cfg["root"], target), "signal")
    assert sig_ev["signal"] == sig.name
    for r in range(world):
        if r != target:
            assert not [e for e in _events(cfg["root"], r) if e["event"] == "signal"]
    assert _one(_events(cfg["root"], 0), "decision")["decision"] == "save"
    _check_resume_exact(tmp_path, world, cfg, stop, baseline)


def test_sigterm_all_ranks_staggered_with_a_long_step(tmp_path, baseline):
    """Rank 1 is inside a 3 s step when rank 0 is signalled; rank 1 is signalled 1.5 s later,
    rank 0 a second time 2 s later (its budget is cut). One stop step for all."""
    cfg = _cfg(tmp_path, "run", long_step={"1": [5, 3.0]})
    procs = launch(2, cfg)
    _wait_step(cfg["out"], "run", 1, 5, procs)
    time.sleep(0.3)  # rank 1 is now sleeping in its long step 5
    t_sig = time.time()
    os.kill(procs[0].pid, signal.SIGTERM)
    time.sleep(1.5)
    os.kill(procs[1].pid, signal.SIGTERM)
    time.sleep(0.5)
    os.kill(procs[0].pid, signal.SIGTERM)
    assert _wait(procs, 60) == [preempt.EXIT_PREEMPTED] * 2
    # rank 1 learned within 0.5 s although its training thread was busy
    c1 = _one(_events(cfg["root"], 1), "consensus")
    assert c1["t"] - t_sig <= 1.0, c1
    stop = _check_agreed(cfg["root"], 2, t_sig, 3.0)
    assert stop == 6
    assert [e["signal"] for e in _events(cfg["root"], 0) if e["event"] == "signal"] == \
        ["SIGTERM", "SIGTERM"]
    assert _one(_events(cfg["root"], 0), "budget_cut")
    _check_resume_exact(tmp_path, 2, cfg, stop, baseline)


def test_the_same_notice_twice_does_not_cut_the_budget(tmp_path):
    """Slurm signals every process of a step and torchrun passes SIGTERM on too: a rank gets
    the same notice twice within milliseconds. That is one notice, not an impatient
    orchestrator (a second signal over 1 s later halves the budget: the test above).
    Rank 1 sleeps 1.5 s after step 3, so rank 0's stop (it needs rank 1 at the stop step and
    at the commit) is still open when the second signal comes: a whole stop of this small
    state took 45 ms on a fast host, and a second signal after the exit is not one."""
    cfg = _cfg(tmp_path, "run", long_step={"1": [3, 1.5]})
    procs = launch(2, cfg)
    _wait_step(cfg["out"], "run", 1, 3, procs)  # rank 1 is now sleeping after step 3
    os.kill(procs[0].pid, signal.SIGTERM)
    time.sleep(0.05)
    os.kill(procs[0].pid, signal.SIGUSR1)
    assert _wait(procs, 60) == [preempt.EXIT_PREEMPTED] * 2
    evs = _events(cfg["root"], 0)
    assert [e["signal"] for e in evs if e["event"] == "signal"] == ["SIGTERM", "SIGUSR1"]
    assert not [e for e in evs if e["event"] == "budget_cut"]
    assert _one(evs, "decision")["decision"] == "save"


def test_signal_while_async_save_in_flight(tmp_path, baseline):
    # 3 MiB per rank at 3 MiB/s: the periodic save of step 3 is in flight for about a second
    cfg = _cfg(tmp_path, "run", mib=3, throttle_mibps=3, save_steps=[3], step_s=0.03)
    procs = launch(2, cfg)
    _wait_step(cfg["out"], "run", 0, 4, procs)  # the save of step 3 was issued
    t_sig = time.time()
    os.kill(procs[0].pid, signal.SIGTERM)
    assert _wait(procs, 60) == [preempt.EXIT_PREEMPTED] * 2
    stop = _check_agreed(cfg["root"], 2, t_sig, cfg["step_s"])
    d = _one(_events(cfg["root"], 0), "decision")
    assert d["decision"] == "wait_then_save" and d["inflight_step"] == 3, d
    assert _one(_events(cfg["root"], 1), "inflight_done")["ok"]
    assert sorted(n for n in os.listdir(cfg["root"]) if n.startswith("step-")) == \
        ["step-0000000003", f"step-{stop:010d}"]
    _check_resume_exact(tmp_path, 2, cfg, stop, baseline)


def test_signal_supersedes_a_slow_in_flight_save(tmp_path, baseline):
    # 6 MiB per rank at 3 MiB/s in 1 MiB shard files: the periodic save of step 8 needs about
    # 2.5 s; finishing it and then saving step 9 does not fit 5 s of grace, dropping it after its
    # current file and saving step 9 does
    cfg = _cfg(tmp_path, "run", mib=6, throttle_mibps=3, save_steps=[2, 8], step_s=0.03,
               grace_s=5.0, staging_cap_mib=2)
    procs = launch(2, cfg)
    _wait_step(cfg["out"], "run", 0, 9, procs)  # the save of step 8 is in flight
    t_sig = time.time()
    os.kill(procs[1].pid, signal.SIGTERM)
    assert _wait(procs, 60) == [preempt.EXIT_PREEMPTED] * 2
    stop = _check_agreed(cfg["root"], 2, t_sig, cfg["step_s"])
    for r in range(2):
        evs = _events(cfg["root"], r)
        d = _one(evs, "decision")
        assert d["decision"] == "supersede" and d["inflight_step"] == 8, d
        sup = _one(evs, "superseded")
        assert sup["step"] == 8 and not sup["committed"], sup
        assert _one(evs, "exit")["deadline_in_s"] > 0
    assert sorted(n for n in os.listdir(cfg["root"]) if n.startswith("step-")) == \
        ["step-0000000002", f"step-{stop:010d}"]
    _check_resume_exact(tmp_path, 2, cfg, stop, baseline)


def test_signal_during_resume(tmp_path, baseline):
    cfg = _cfg(tmp_path, "first", total=4, save_steps=[3], slow_resume_s=0.01)
    assert _wait(launch(2, cfg)) == [0, 0]
    cfg = _cfg(tmp_path, "run", slow_resume_s=1.5)
    procs = launch(2, cfg)
    marker = os.path.join(cfg["out"], "resuming-run-r1")
    end = time.monotonic() + 60
    while not os.path.exists(marker):
        assert time.monotonic() < end and all(p.exitcode is None for p in procs)
        time.sleep(0.01)
    t_sig = time.time()
    os.kill(procs[1].pid, signal.SIGTERM)
    assert _wait(procs, 60) == [preempt.EXIT_PREEMPTED] * 2
    c = _one(_events(cfg["root"], 0), "consensus")
    assert c["reported"] == [None, None] and c["stop_step"] == -1  # the first call stops
    assert _one(_events(cfg["root"], 0), "commit")["step"] == 4
    for r in range(2):
        assert _one(_events(cfg["root"], r), "exit")["code"] == preempt.EXIT_PREEMPTED
    assert c["t"] - t_sig < 1.0
    # losses: steps 0-3 from the first run, step 4 from this one, the rest after resuming
    first = _losses(cfg["out"], "first")
    os.rename(os.path.join(cfg["out"], "losses-run-r0.jsonl"),
              os.path.join(cfg["out"], "losses-part-r0.jsonl"))
    with open(os.path.join(cfg["out"], "losses-run-r0.jsonl"), "w") as f:
        for x in first + _losses(cfg["out"], "part"):
            f.write(json.dumps(x) + "\n")
    _check_resume_exact(tmp_path, 2, cfg, 4, baseline)


@pytest.mark.parametrize("world,dead", [(2, 1), (4, 0)])
def test_peer_killed_during_emergency_save(tmp_path, world, dead):
    grace = 4.0
    cfg = _cfg(tmp_path, "run", grace_s=grace, save_steps=[2],
               fault_after_periodic=f"after_shard_write@{dead}")
    procs = launch(world, cfg)
    _wait_step(cfg["out"], "run", 0, 4, procs)
    target = 1 if dead == 0 else 0
    t_sig = time.time()
    os.kill(procs[target].pid, signal.SIGTERM)
    codes = _wait(procs, 60)
    t_end = time.time()
    assert codes[dead] == -signal.SIGKILL
    alive = [r for r in range(world) if r != dead]
    assert [codes[r] for r in alive] == [preempt.EXIT_FAILED] * len(alive), codes
    assert t_end - t_sig <= grace + 5.0
    for r in alive:
        ex = _one(_events(cfg["root"], r), "exit")
        assert ex["code"] == preempt.EXIT_FAILED and dead in (ex["missing"] or []), ex
        assert ex["t"] - t_sig <= grace + 5.0, ex
    # the previous committed checkpoint is the newest and loads on the same world size
    ck = fastckpt.Checkpointer(cfg["root"])
    assert ck.latest_step() == 2
    ck.close()
    rcfg = _cfg(tmp_path, "check", total=3)
    assert _wait(launch(world, rcfg)) == [0] * world
    with open(os.path.join(rcfg["out"], "resumed-check-r0")) as f:
        assert json.load(f) == 2


def test_hung_peer(tmp_path):
    """Rank 1 hangs (SIGSTOP) before rank 0 is signalled: rank 0's training thread is blocked
    in an all-reduce with it for good; the watchdog ends rank 0 with 144 within the deadline
    + 5 s, naming rank 1."""
    grace = 3.0
    cfg = _cfg(tmp_path, "run", grace_s=grace, save_steps=[2], total=400)
    procs = launch(2, cfg)
    _wait_step(cfg["out"], "run", 0, 4, procs)
    os.kill(procs[1].pid, signal.SIGSTOP)
    time.sleep(0.5)  # rank 0 is now waiting in the next step's all-reduce
    t_sig = time.time()
    os.kill(procs[0].pid, signal.SIGTERM)
    procs[0].join(grace + 10)
    t_end = time.time()
    os.kill(procs[1].pid, signal.SIGKILL)
    codes = _wait(procs, 30)
    assert codes == [preempt.EXIT_FAILED, -signal.SIGKILL], codes
    assert t_end - t_sig <= grace + 5.0
    ex = _one(_events(cfg["root"], 0), "exit")
    assert ex["code"] == preempt.EXIT_FAILED and ex["missing"] == [1], ex
    assert "watchdog" in ex["reason"], ex
    ck = fastckpt.Checkpointer(cfg["root"])
    assert ck.latest_step() == 2
    ck.close()


def test_throttled_writer_cannot_fit_the_window(tmp_path):
    grace = 3.0
    # 6 MiB per rank at 3 MiB/s: 2 s per save measured on step 2; 2 s + overhead > 3 s - 1 s
    cfg = _cfg(tmp_path, "run", grace_s=grace, mib=6, throttle_mibps=3, save_steps=[2], total=400,
               step_s=0.03)
    procs = launch(2, cfg)
    _wait_step(cfg["out"], "run", 0, 2, procs)
    _wait_file(os.path.join(cfg["root"], "step-0000000002", "manifest.json"), procs)
    time.sleep(0.3)
    t_sig = time.time()
    os.kill(procs[1].pid, signal.SIGTERM)
    assert _wait(procs, 60) == [preempt.EXIT_PREEMPTED] * 2
    for r in range(2):
        evs = _events(cfg["root"], r)
        d = _one(evs, "decision")
        assert d["decision"] == "skip" and d["est_save_s"] > d["left_s"], d
        assert not [e for e in evs if e["event"] == "save_start"]
        ex = _one(evs, "exit")
        assert ex["t"] < t_sig + grace, ex  # before the deadline
    assert sorted(n for n in os.listdir(cfg["root"]) if n.startswith("step-")) == \
        ["step-0000000002"]
    ck = fastckpt.Checkpointer(cfg["root"])
    assert ck.latest_step() == 2
    ck.close()


def test_disk_slower_than_measured_fails_cleanly(tmp_path):
    """The estimate fits but the disk slows down: the save misses the deadline; the ranks exit
    144 shortly after it, and nothing is committed for the stop step."""
    grace = 3.0
    cfg = _cfg(tmp_path, "run", grace_s=grace, mib=4, save_steps=[2], total=400,
               throttle_after_periodic=1)
    procs = launch(2, cfg)
    for r in range(2):
        _wait_file(os.path.join(cfg["out"], f"saved-run-r{r}"), procs)
    # past step 2: a stop at step 2 itself has nothing to write (its periodic save committed,
    # the "committed" decision), and no slow write to fail
    _wait_step(cfg["out"], "run", 0, 4, procs)
    t_sig = time.time()
    os.kill(procs[0].pid, signal.SIGTERM)
    assert _wait(procs, 60) == [preempt.EXIT_FAILED] * 2
    for r in range(2):
        evs = _events(cfg["root"], r)
        assert _one(evs, "decision")["decision"] == "save"
        assert _one(evs, "save_failed")
        ex = _one(evs, "exit")
        assert ex["t"] - t_sig <= grace + 5.0, ex
    ck = fastckpt.Checkpointer(cfg["root"])
    assert ck.latest_step() == 2
    ck.close()


# ---------------------------------------------------------------------------- one-process tests

def _plain_state():
    return {"w": torch.arange(1000.0), "step": 0}


def test_fast_path_cost_and_no_collective(root):
    ck = fastckpt.Checkpointer(root, grace_s=10)
    st = _plain_state()
    n = 20000
    t0 = time.perf_counter()
    for i in range(n):
        assert ck.save(st, step=i, on_preempt=True) is None
    per_call = (time.perf_counter() - t0) / n
    ck.close()
    assert per_call < 50e-6, per_call


def test_budget_uses_the_bench_record_before_any_save(root):
    """`fastckpt bench ROOT` seeds the estimate until a save was measured."""
    os.makedirs(root, exist_ok=True)
    st = _plain_state()
    ck = fastckpt.Checkpointer(root, grace_s=10)
    try:
        assert ck.preemption._estimate(st)["source"].startswith("assumed")
        with open(os.path.join(root, ".fastckpt-bench.json"), "w") as f:
            json.dump({"format": "fastckpt-bench", "version": 1,
                       "per_rank_bytes_per_s": {"save": 5 * (1 << 20), "stage": 1e9}}, f)
        est = ck.preemption._estimate(st)
        assert est["source"].startswith("fastckpt bench") and est["write_mibps"] == 5.0, est
        ck.save(st, step=1).wait()
        assert ck.preemption._estimate(st)["source"].startswith("measured")
    finally:
        ck.close()


def test_handlers_chained_and_restored(root):
    seen = []
    def old(s, f):
        seen.append(s)
    signal.signal(signal.SIGUSR1, old)
    try:
        ck = fastckpt.Checkpointer(root, grace_s=10, preempt_exit=False)
        assert signal.getsignal(signal.SIGUSR1) != old
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.3)
        assert seen == [signal.SIGUSR1]  # the earlier handler still ran
        st = _plain_state()
        h = None
        for step in range(50):
            h = ck.save(st, step=step, on_preempt=True)
            if h is not None:
                break
            time.sleep(0.01)
        assert h is not None and h.committed and ck.preemption.exit_code == 143
        ck.close()
        assert signal.getsignal(signal.SIGUSR1) is old
        assert signal.set_wakeup_fd(-1) == -1  # our wakeup fd was removed
    finally:
        signal.signal(signal.SIGUSR1, signal.SIG_DFL)


_LATE = """
import os, signal, sys, time
import fastckpt
ck = fastckpt.Checkpointer(sys.argv[1], grace_s=10, preempt_exit=False)
ck.save({"w": __import__("torch").zeros(4)}, step=1, block=True)
ck.close()  # the work is done; the process tears down (seconds, in a real job)
os.kill(os.getpid(), getattr(signal, sys.argv[2]))  # the orchestrator's late signal
time.sleep(0.5)
print("survived", flush=True)
"""


@pytest.mark.parametrize("sig,survives", [("SIGUSR1", True), ("SIGTERM", False)])
def test_a_late_warning_after_close_does_not_kill_a_finished_job(tmp_path, sig, survives):
    """Slurm's time-limit warning (``--signal=USR1@T``) can come after the job closed its
    Checkpointer, in its teardown: a warning signal whose earlier handler was the default
    (terminate) is ignored from then on, so the finished job exits 0 (CI caught it killed,
    138, and marked FAILED). SIGTERM still stops a closed job at once (its default)."""
    r = subprocess.run([sys.executable, "-c", _LATE, str(tmp_path / "ck"), sig],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": os.getcwd()})
    if survives:
        assert r.returncode == 0 and "survived" in r.stdout, (r.returncode, r.stderr[-2000:])
    else:
        assert r.returncode == -signal.SIGTERM and "survived" not in r.stdout, r.returncode


@pytest.mark.parametrize("sig,window", [(signal.SIGUSR1, 40.0), (signal.SIGTERM, 6.0)])
def test_each_signal_gets_its_own_window(root, sig, window):
    """Slurm: --signal=B:USR1@T gives T s (+ KillWait); scancel's SIGTERM gives KillWait. The
    deadline counts from the signal that came, with that signal's window, less the teardown."""
    ck = fastckpt.Checkpointer(root, grace_s=40, preempt_exit=False, teardown_s=0.5,
                               signal_grace_s={"SIGTERM": 6.0})
    try:
        t0 = time.time()
        os.kill(os.getpid(), sig)
        st = _plain_state()
        for step in range(200):
            if ck.save(st, step=step, on_preempt=True) is not None:
                break
            time.sleep(0.01)
        evs = [json.loads(line) for line in open(os.path.join(root, "events", "rank00000.jsonl"))]
        armed = [e for e in evs if e["event"] == "armed"][-1]
        assert armed["signal_grace_s"] == {"SIGTERM": 6.0} and armed["teardown_s"] == 0.5
        dec = [e for e in evs if e["event"] == "decision"][-1]
        # left = window - teardown - margin (1 s) - the time since the signal
        took = dec["t"] - t0
        assert window - 1.5 - took - 0.2 <= dec["left_s"] <= window - 1.5 + 0.05, (dec, took)
        assert ck.preemption.exit_code == 143
    finally:
        ck.close()


def test_signal_windows_from_the_environment():
    from fastckpt.options import options_from_env
    o = options_from_env(environ={"FASTCKPT_SIGNAL_GRACE_S": "SIGTERM=10, sigusr1=95.5",
                                  "FASTCKPT_TEARDOWN_S": "3"})
    assert o.signal_grace_s == {"SIGTERM": 10.0, "SIGUSR1": 95.5} and o.teardown_s == 3.0
    for bad in ("SIGTERM", "SIGTERM=x", "NOPE=3", "SIGTERM=0"):
        with pytest.raises(ValueError, match="SIGNAL_GRACE_S|signal name|must be > 0|no '='"):
            options_from_env(environ={"FASTCKPT_SIGNAL_GRACE_S": bad})


def test_on_off_settings_from_the_environment():
    """FASTCKPT_DIRECT_IO, _ZERO_COPY, _LOCAL_SURVIVES and _THP read alike: 0, false, no, off
    (any case) and the empty string turn them off; anything else on; THP is "auto" (None)
    when unset."""
    from fastckpt.options import huge_pages_on, options_from_env
    for v, on in (("0", False), ("false", False), ("No", False), ("OFF", False), ("", False),
                  (" 1 ", True), ("yes", True), ("on", True)):
        o = options_from_env(environ={"FASTCKPT_DIRECT_IO": v, "FASTCKPT_ZERO_COPY": v,
                                      "FASTCKPT_LOCAL_SURVIVES": v})
        assert (o.direct_io, o.zero_copy, o.local_survives) == (on, on, on), v
        assert huge_pages_on({"FASTCKPT_THP": v}) is on, v
    assert huge_pages_on({}) is None and huge_pages_on({"FASTCKPT_THP": " Auto"}) is None


def test_forked_worker_does_not_act(root):
    """A DataLoader-style forked child gets the earlier handler back (SIGTERM kills it) and
    its signal never reaches the parent's trap."""
    ck = fastckpt.Checkpointer(root, grace_s=10)
    try:
        pid = os.fork()
        if pid == 0:  # pragma: no cover - child
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(2)
            os._exit(7)
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGTERM
        time.sleep(0.3)
        assert not ck.preemption.pending and not ck.preemption._local
        assert ck.save(_plain_state(), step=1, on_preempt=True) is None
    finally:
        ck.close()


def _disarm(ck) -> None:
    """After an in-process stop whose SystemExit the test caught: the watchdog stays armed for
    the shutdown (by design), which must not end this pytest process."""
    p = ck.preemption
    if p is not None and p._watchdog is not None:
        p._watchdog.cancel()
    ck.close()


def test_request_stop_cancel_exits_zero(root):
    ck = fastckpt.Checkpointer(root, grace_s=10)
    st = _plain_state()
    threading.Timer(0.1, ck.preemption.request_stop, kwargs={"cancel": True}).start()
    try:
        with pytest.raises(SystemExit) as e:
            for step in range(200):
                ck.save(st, step=step, on_preempt=True)
                time.sleep(0.01)
    finally:
        _disarm(ck)
    assert e.value.code == preempt.EXIT_CANCELLED
    evs = _events(root, 0)
    assert _one(evs, "exit")["reason"] == "cancelled"
    assert fastckpt.Checkpointer(root).latest_step() == _one(evs, "commit")["step"]


def test_module_level_save_on_preempt(root):
    st = _plain_state()
    assert fastckpt.save(st, root, step=0, on_preempt=True) is None
    fastckpt.checkpointer._ON_PREEMPT[root].preemption.request_stop()
    try:
        with pytest.raises(SystemExit) as e:
            for step in range(1, 200):
                fastckpt.save(st, root, step=step, on_preempt=True)
                time.sleep(0.01)
    finally:
        _disarm(fastckpt.checkpointer._ON_PREEMPT.pop(root))
    assert e.value.code == preempt.EXIT_PREEMPTED


def test_decisions():
    def rep(left, est, infl=None, infl_left=0.0):
        return {"left_s": left, "est_s": est, "bytes": 1, "inflight_step": infl,
                "inflight_left_s": infl_left}
    d = preempt.Preemption.decide
    assert d([rep(10, 2), rep(9, 3)], 5, 1)[0] == "save"
    assert d([rep(10, 2), rep(3, 3)], 5, 1)[0] == "skip"
    assert d([rep(10, 2, 4, 3)], 5, 1)[0] == "wait_then_save"
    assert d([rep(5.5, 2, 4, 3)], 5, 1)[0] == "wait"
    assert d([rep(3, 2, 4, 3)], 5, 1)[0] == "abandon"
    assert d([rep(10, 2, 5, 3)], 5, 1)[0] == "wait"  # the in-flight save is this very step
    sup = dict(rep(5.5, 2, 4, 3), inflight_piece_s=0.5)  # only its current piece is left
    assert d([sup], 5, 1)[0] == "supersede"
    assert d([dict(sup, inflight_piece_s=3)], 5, 1)[0] == "wait"


def test_allreduce_consensus_option(tmp_path):
    cfg = _cfg(tmp_path, "run", consensus="allreduce")
    procs = launch(2, cfg)
    _wait_step(cfg["out"], "run", 1, 3, procs)
    os.kill(procs[1].pid, signal.SIGUSR1)
    assert _wait(procs, 60) == [preempt.EXIT_PREEMPTED] * 2
    steps = {_one(_events(cfg["root"], r), "commit")["step"] for r in range(2)}
    assert len(steps) == 1
    assert preempt.job_exit_code(os.path.join(cfg["root"], "events")) == preempt.EXIT_PREEMPTED


def test_watchdog_after_a_finished_stop_keeps_its_exit_code(tmp_path):
    """The stop finished (checkpoint committed, SystemExit caught by the script) but the
    interpreter's shutdown hangs on a thread: the watchdog ends the process at the deadline + 3 s
    with the stop's code (143), not "failed"."""
    root = str(tmp_path / "ck")
    script = textwrap.dedent(f"""
        import threading, time, torch, fastckpt
        ck = fastckpt.Checkpointer({root!r}, grace_s=3)
        st = {{"w": torch.arange(10.0)}}
        ck.preemption.request_stop()
        try:
            for step in range(500):
                ck.save(st, step=step, on_preempt=True)
                time.sleep(0.01)
        except SystemExit:
            pass
        threading.Thread(target=time.sleep, args=(120,)).start()  # not a daemon: shutdown hangs
    """)
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=90, cwd=os.path.dirname(os.path.dirname(__file__)))
    took = time.monotonic() - t0
    assert r.returncode == preempt.EXIT_PREEMPTED, r.stderr[-2000:]
    assert took < 60  # the hanging thread sleeps 120 s
    assert "grace deadline passed; exiting 143" in r.stderr  # the watchdog ended it
    # (the event log was closed with the stop's own "exit" event before the shutdown)
    assert [e for e in _events(root, 0) if e["event"] == "exit"][-1]["code"] == 143
    assert fastckpt.Checkpointer(root).latest_step() is not None


def test_late_signal_during_teardown_keeps_the_exit_code(tmp_path):
    """After the stop's exit event the process only tears down (torch's teardown takes seconds);
    a second SIGTERM then (Slurm, torchrun and Kubernetes all send more than one) must not turn
    exit 143 into death by signal 15."""
    root, ready, tearing = (str(tmp_path / n) for n in ("ck", "ready", "tearing"))
    script = textwrap.dedent(f"""
        import atexit, time, torch, fastckpt
        ck = fastckpt.Checkpointer({root!r}, grace_s=20)
        st = {{"w": torch.arange(10.0)}}
        def teardown():  # stands in for torch's and the job's slow teardown
            open({tearing!r}, "w").close()
            time.sleep(3)
        atexit.register(teardown)
        for step in range(3000):
            ck.save(st, step=step, on_preempt=True)
            if step == 2:
                open({ready!r}, "w").close()
            time.sleep(0.01)
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stderr=subprocess.PIPE, text=True,
                         cwd=os.path.dirname(os.path.dirname(__file__)))
    try:
        for path in (ready, tearing):
            end = time.monotonic() + 60
            while not os.path.exists(path) and p.poll() is None and time.monotonic() < end:
                time.sleep(0.02)
            assert os.path.exists(path), p.stderr.read()[-2000:] if p.poll() is not None else path
            p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    assert p.returncode == preempt.EXIT_PREEMPTED, err[-2000:]
    assert [e for e in _events(root, 0) if e["event"] == "exit"][-1]["code"] == 143


def test_the_signal_trap_waits_with_a_wakeup_fd_above_1023():
    """A process with many open files (data loaders, sockets; the protocol benchmark's simulated
    ranks) gets a wakeup pipe above fd 1023, which select() refuses: the trap's poll returned
    at once, every time, and the signal thread spun on a core. It must wait, and still see a
    request and a real signal."""
    import resource
    from fastckpt.preempt.signals import SignalTrap
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1600:
        if hard != resource.RLIM_INFINITY and hard < 1600:
            pytest.skip(f"RLIMIT_NOFILE hard limit {hard}")
        resource.setrlimit(resource.RLIMIT_NOFILE, (1600, hard))
    trap = SignalTrap({signal.SIGUSR1})
    trap.install()
    try:
        high = os.dup2(trap._rfd, 1500)
        os.close(trap._rfd)
        trap._rfd = high
        stop = threading.Event()
        t0, c0 = time.monotonic(), time.thread_time()
        woke, got = trap.poll(0.5, stop)
        assert not woke and not got
        assert time.monotonic() - t0 >= 0.45 and time.thread_time() - c0 < 0.2
        trap.request()
        woke, got = trap.poll(5, stop)
        assert woke and [s for s, _, _ in got] == [preempt.signals.REQUEST_PREEMPT]
        os.kill(os.getpid(), signal.SIGUSR1)
        woke, got = trap.poll(5, stop)
        assert woke and signal.SIGUSR1 in [s for s, _, _ in got], got
    finally:
        trap.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))


def test_an_emergency_save_leaves_retention_to_the_next_save(root):
    """Retention removes files (0.25 s per 1.5 GiB step on this VM's ext4 with discard): an
    emergency save, inside the grace window, removes no committed step; the next ordinary save
    applies retention."""
    ck = fastckpt.Checkpointer(root, keep_last=1)
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    ck.save(state, step=1, block=True)
    ck.save(state, step=2, block=True)
    assert ck.steps() == [2]
    h = ck.emergency_save(state, 3, time.monotonic() + 30)
    h.wait()
    assert ck.steps() == [2, 3]  # committed, nothing removed inside the window
    ck.save(state, step=4, block=True)
    assert ck.steps() == [4]
    ck.close()
