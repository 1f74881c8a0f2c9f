"""The emergency path with a remote tier, on real gloo ranks stopped by real signals, against
the moto server on 127.0.0.1 (behind tests/s3throttle.py where the store is slow).

- A stop whose checkpoint fits the window both ways: every rank decides "upload", the stop
  step is committed locally and remotely before the exit (143); the node's local root is then
  lost, and the restart resumes from the remote tier bit-exact against an uninterrupted run.
- A store too slow for the window (its upload bandwidth measured on the last periodic
  upload): "skip", said why in the event log, the local checkpoint committed, every rank out
  with 143 within the grace window.
The decision itself, branch by branch: tests/test_tiering.py::test_the_remote_decision.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from fastckpt import preempt
from tests.preempt_worker import launch
from tests.s3throttle import ThrottleProxy
from tests.test_preempt import (_check_resume_exact, _cfg, _events, _one, _wait, _wait_step,
                                baseline)  # noqa: F401 - baseline is a fixture

pytest_plugins = ["tests.s3fixtures"]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MiB = 1 << 20


def _opts(s3, endpoint: str | None = None) -> dict:
    client = dict(s3.storage_options["client_kwargs"], endpoint_url=endpoint or s3.endpoint)
    return {**s3.storage_options, "client_kwargs": client, "skip_instance_cache": True}


def _remote_steps(s3, prefix: str) -> list[int]:
    return sorted(int(k.split("/")[1].split("-")[1]) for k in s3.keys(prefix)
                  if k.endswith("/manifest.json"))


def test_the_stop_checkpoint_reaches_the_remote_tier_and_the_restart_uses_it(tmp_path, s3,
                                                                             baseline):
    cfg = _cfg(tmp_path, "tier", save_every=4,
               remote={"url": s3.url("em"), "options": _opts(s3)})
    procs = launch(2, cfg)
    _wait_step(cfg["out"], "tier", 0, 6, procs)
    os.kill(procs[1].pid, signal.SIGTERM)
    assert _wait(procs) == [preempt.EXIT_PREEMPTED] * 2
    stop = None
    for r in range(2):
        evs = _events(cfg["root"], r)
        d = _one(evs, "decision")
        assert d["decision"] == "save" and d["remote"] == "upload", d
        assert _one(evs, "upload_end")["ok"], _one(evs, "upload_end")
        stop = _one(evs, "commit")["step"]
        assert _one(evs, "upload_end")["step"] == stop
    assert stop in _remote_steps(s3, "em")
    # the node is gone with its NVMe: the restart finds an empty local root
    lost = cfg["root"] + ".lost"
    os.rename(cfg["root"], lost)
    _check_resume_exact(tmp_path, 2, cfg, stop, baseline)


def test_a_store_too_slow_for_the_window_is_skipped_in_time(tmp_path, s3):
    with ThrottleProxy(s3.server.port, rate_bps=1 * MiB) as proxy:
        cfg = _cfg(tmp_path, "slow", total=2000, save_steps=[2], mib=4, grace_s=6.0,
                   remote={"url": s3.url("slow"), "options": _opts(s3, proxy.endpoint)})
        procs = launch(2, cfg)
        t0 = time.monotonic()
        while 2 not in _remote_steps(s3, "slow"):  # the periodic upload, measured: ~4 s
            assert time.monotonic() - t0 < 90 and all(p.exitcode is None for p in procs)
            time.sleep(0.1)
        time.sleep(0.3)  # every rank's uploader has recorded its measurement
        t_sig = time.time()
        os.kill(procs[0].pid, signal.SIGTERM)
        assert _wait(procs, timeout=60) == [preempt.EXIT_PREEMPTED] * 2
    for r in range(2):
        evs = _events(cfg["root"], r)
        d = _one(evs, "decision")
        assert d["remote"] == "skip" and "no upload fits" in d["remote_why"], d
        assert "lost if the node is" in d["remote_why"]  # local_survives=False, said so
        assert _one(evs, "estimate")["up_source"] == "measured"
        assert _one(evs, "commit")["step"] > 2  # the local checkpoint of the stop
        assert not [e for e in evs if e["event"] == "upload_start"]
        assert _one(evs, "exit")["t"] - t_sig < 6.0
    assert _remote_steps(s3, "slow") == [2]


def test_a_direct_s3_root_budgets_with_its_measured_bandwidth(tmp_path, s3):
    """No tier: the root itself is on the (slow) store. The periodic save measured it; the
    stop's save does not fit the window at that bandwidth: skip, in time."""
    import json as _json
    events = str(tmp_path / "events")
    with ThrottleProxy(s3.server.port, rate_bps=1 * MiB) as proxy:
        cfg = _cfg(tmp_path, "direct", total=2000, save_steps=[2], mib=4, grace_s=6.0,
                   event_log=events)
        cfg["root"] = s3.url("direct")
        cfg["root_options"] = _opts(s3, proxy.endpoint)
        procs = launch(2, cfg)
        t0 = time.monotonic()
        while 2 not in _remote_steps(s3, "direct"):
            assert time.monotonic() - t0 < 90 and all(p.exitcode is None for p in procs)
            time.sleep(0.1)
        time.sleep(0.5)
        t_sig = time.time()
        os.kill(procs[1].pid, signal.SIGTERM)
        assert _wait(procs, timeout=60) == [preempt.EXIT_PREEMPTED] * 2
    for r in range(2):
        with open(os.path.join(events, f"rank{r:05d}.jsonl")) as f:
            evs = [_json.loads(line) for line in f if line.strip()]
        est = _one(evs, "estimate")
        assert est["source"].startswith("measured") and est["write_mibps"] < 8, est
        assert _one(evs, "decision")["decision"] == "skip"
        assert _one(evs, "exit")["t"] - t_sig < 6.0
    assert _remote_steps(s3, "direct") == [2]
