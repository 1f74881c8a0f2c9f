"""Saves that fail on some ranks only, and saves still running when the process exits
(issue 14's review of the save side, 2026-12-06):

* an error on one rank while it plans (a Stateful's own ``RuntimeError``) skipped the plan
  exchange on that rank only: from then on its exchanges paired with the other ranks' next
  ones, and rank 0 committed manifests naming shard files of another step (a newest
  checkpoint that did not load);
* a root claim that timed out on one rank left that rank "unclaimed": it made one exchange
  more per save than the others, and the job never saved again;
* ranks that call save with different steps never pair: each names the others as missing,
  and the next save with one step commits;
* a capped pool whose step directory (or in-flight marker) cannot be made left the training
  thread waiting for a buffer for ever;
* an async save still running at a normal exit was lost: ``concurrent.futures`` refuses new
  work once the interpreter exits, before ``atexit`` runs the close that finishes the save.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import torch.distributed as dist

import fastckpt
from fastckpt.storage import open_storage
from fastckpt.testing.faults import FaultyStorage
from tests import distributed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _Boom:
    """A Stateful whose ``state_dict`` raises (armed on one rank)."""

    def __init__(self, armed: bool) -> None:
        self.armed = armed

    def state_dict(self) -> dict:
        if self.armed:
            raise RuntimeError("the stateful failed")
        return {"v": 1}

    def load_state_dict(self, sd: dict) -> None:
        pass


def _state(rank: int) -> dict:
    return {"w": torch.arange(64, dtype=torch.float32) + rank, "b": torch.full((8,), 3.0 + rank)}


def _one_rank_fails_then_saves(rank: int, world: int, root: str):
    ck = fastckpt.Checkpointer(root, plan_timeout_s=20, commit_timeout_s=20)
    st = _state(rank)
    ck.save(st, step=1, block=True)
    out = {}
    try:
        ck.save({**st, "s": _Boom(rank == 1)}, step=2, block=True)
        out[2] = "committed"
    except Exception as e:  # noqa: BLE001 - what each rank saw
        out[2] = f"{type(e).__name__}: {e}"
    for step in (3, 4):
        st["w"].add_(1.0)
        ck.save(st, step=step, block=True)
        out[step] = "committed"
    got = {"w": torch.zeros(64), "b": torch.zeros(8)}
    out["loaded"] = ck.load(got)
    out["equal"] = all(torch.equal(got[k], st[k]) for k in st)  # what this rank saved
    ck.close()
    return out


def test_an_error_on_one_rank_fails_that_save_on_every_rank_and_the_next_ones_commit(root):
    out = distributed.run(_one_rank_fails_then_saves, 2, root, timeout=120)
    r0, r1 = out
    assert r1[2] == "RuntimeError: the stateful failed"  # its own error, on its rank
    assert "rank 1" in r0[2] and "RuntimeError: the stateful failed" in r0[2], r0
    assert r0[3] == r1[3] == r0[4] == r1[4] == "committed"
    assert fastckpt.steps(root) == [1, 3, 4]
    # every committed step is whole (the defect committed manifests naming shard files that
    # another step's directory held) and loads what each rank saved
    from fastckpt.tools.verify import verify_step
    for step in (1, 3, 4):
        res = verify_step(root, step, record=False)
        assert res.ok, (step, res.problems)
    assert r0["loaded"] == r1["loaded"] == 4 and r0["equal"] and r1["equal"]


def _different_steps(rank: int, world: int, root: str):
    ck = fastckpt.Checkpointer(root, plan_timeout_s=2)
    st = _state(rank)
    ck.save(st, step=1, block=True)
    try:
        ck.save(st, step=5 + rank, block=True)
        res = "committed"
    except fastckpt.CollectiveTimeoutError as e:
        res = (str(e), e.missing_ranks)
    dist.barrier()
    ck.save(st, step=7, block=True)  # the next save with one step
    ck.close()
    return res


def test_ranks_saving_different_steps_never_pair_and_name_each_other(root):
    (m0, miss0), (m1, miss1) = distributed.run(_different_steps, 2, root, timeout=120)
    assert "save of step 5: the plan exchange" in m0 and miss0 == [1], m0
    assert "save of step 6: the plan exchange" in m1 and miss1 == [0], m1
    assert fastckpt.steps(root) == [1, 7]


def _claim_times_out_on_rank_1(rank: int, world: int, root: str):
    # rank 0's first claim waits for a fresh lease of a run on another host to expire (2 s)
    # longer than rank 1 waits for the claim's answer (plan_timeout_s 1 s)
    import json

    from fastckpt.lease import LEASE
    if rank == 0:  # the other run's fresh lease, written once both ranks are up (a rank's
        # start-up can take longer than its 2 s: it was written before, and found expired)
        now = time.time()
        with open(os.path.join(root, LEASE), "w") as f:
            json.dump({"owner": "dead-run", "host": "other-host", "pid": 1, "job": None,
                       "acquired_unix": now, "renewed_unix": now, "ttl_s": 2}, f)
    dist.barrier()
    ck = fastckpt.Checkpointer(root, plan_timeout_s=1, commit_timeout_s=1, lease_ttl_s=2)
    st = _state(rank)
    out = {}
    for step in (1, 2, 3):
        dist.barrier()  # (a training step's collectives between the saves)
        try:
            ck.save(st, step=step, block=True)
            out[step] = "committed"
        except fastckpt.FastCkptError as e:
            out[step] = type(e).__name__
    ck.close()
    return out


def test_a_root_claim_that_timed_out_on_one_rank_is_made_again_by_every_rank(root):
    os.makedirs(root)
    r0, r1 = distributed.run(_claim_times_out_on_rank_1, 2, root, timeout=120)
    assert r1[1] == "CollectiveTimeoutError", r1  # the claim's answer came too late
    assert r0[1] != "committed"
    assert r0[2] == r1[2] == r0[3] == r1[3] == "committed", (r0, r1)
    assert fastckpt.steps(root) == [2, 3]


class _NoMarker(FaultyStorage):
    """A disk that is full for the in-flight marker of the next save."""

    full = False

    def publish(self, path, data, *, durable=True):
        if _NoMarker.full and ".inflight-" in path:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return super().publish(path, data, durable=durable)


def test_a_capped_save_whose_marker_cannot_be_written_fails_and_does_not_hang(root):
    ck = fastckpt.Checkpointer(_NoMarker(open_storage(root)), staging_cap_bytes=8 << 20,
                               commit_timeout_s=5)
    st = {f"w{i}": torch.full((1 << 20,), float(i)) for i in range(8)}  # 32 MiB > the cap
    ck.save(st, step=1, block=True)
    _NoMarker.full = True
    res: dict = {}

    def save() -> None:
        try:
            ck.save(st, step=2).wait(timeout=30)
            res["r"] = "committed"
        except fastckpt.FastCkptError as e:
            res["r"] = str(e)

    t = threading.Thread(target=save, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "save() waits for a staging buffer the writer never frees"
    assert "No space left on device" in res["r"], res
    _NoMarker.full = False
    ck.save(st, step=3, block=True)  # the pool's buffers all came back
    ck.close()
    assert fastckpt.steps(root) == [1, 3]


_EXIT_SCRIPT = textwrap.dedent("""
    import sys, torch, fastckpt
    from fastckpt.storage import open_storage
    from fastckpt.testing.faults import FaultyStorage
    root, compression = sys.argv[1], sys.argv[2]
    slow = FaultyStorage(open_storage(root), throttle_mibps=16)  # 12 MiB: ~0.75 s of writes
    ck = fastckpt.Checkpointer(slow, compression=compression or None)
    st = {f"w{i}": torch.arange(1 << 20, dtype=torch.float32) * (i + 1) for i in range(3)}
    ck.save(st, step=1)  # returns once staged; the script ends while it is written
""")


@pytest.mark.parametrize("compression", ["", "zstd"])
def test_an_async_save_still_running_at_a_normal_exit_is_committed(root, compression):
    r = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, root, compression],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "PYTHONPATH": REPO})
    assert r.returncode == 0, r.stderr
    assert "failed" not in r.stderr, r.stderr
    assert fastckpt.steps(root) == [1]
    got = {f"w{i}": torch.zeros(1 << 20) for i in range(3)}
    assert fastckpt.load(got, root) == 1
    for i in range(3):
        assert torch.equal(got[f"w{i}"], torch.arange(1 << 20, dtype=torch.float32) * (i + 1))


class _NoManifest(FaultyStorage):
    """A disk that is full for the next manifest (the commit point itself fails)."""

    full = False

    def publish_manifest(self, path, data):
        if _NoManifest.full:
            raise OSError(errno.ENOSPC, "No space left on device (simulated)")
        return super().publish_manifest(path, data)


@pytest.mark.parametrize("block", [True, False])
def test_a_manifest_that_cannot_be_written_fails_the_save_and_loses_nothing(root, block):
    ck = fastckpt.Checkpointer(_NoManifest(open_storage(root)), commit_timeout_s=5)
    st = {"w": torch.arange(1 << 20, dtype=torch.float32), "n": 1}
    ck.save(st, step=1, block=True)
    before = st["w"].clone()
    _NoManifest.full = True
    with pytest.raises(fastckpt.FastCkptError, match="No space left on device"):
        ck.save({**st, "n": 2}, step=2, block=block).wait(timeout=60)
    _NoManifest.full = False
    assert torch.equal(st["w"], before) and st["n"] == 1  # nothing the user passed changed
    assert fastckpt.steps(root) == [1]
    assert not os.path.exists(os.path.join(root, "step-0000000002", "manifest.json"))
    got = {"w": torch.zeros(1 << 20), "n": 0}
    assert fastckpt.load(got, root) == 1 and torch.equal(got["w"], before) and got["n"] == 1
    ck.save({**st, "n": 3}, step=3, block=True)  # and the next save commits
    ck.close()
    assert fastckpt.steps(root) == [1, 3]


class _UnclearManifest(FaultyStorage):
    """A manifest write that reports an error after it landed (``land``: a directory fsync
    that failed after the rename, an object store's PUT whose answer was lost) or before it
    (``land`` False), and reads of the manifest that fail ``fail_reads`` times."""

    armed = False
    land = True
    fail_reads = 0

    def publish_manifest(self, path, data):
        if not _UnclearManifest.armed:
            return super().publish_manifest(path, data)
        if _UnclearManifest.land:
            self.inner.publish_manifest(path, data)
        raise OSError(errno.EIO, "Input/output error (simulated, after the write)"
                      if _UnclearManifest.land else "Input/output error (simulated)")

    def _read_fails(self, path):
        if path.endswith("manifest.json") and _UnclearManifest.fail_reads > 0:
            _UnclearManifest.fail_reads -= 1
            raise OSError(errno.EIO, "Input/output error (simulated read)")

    def size(self, path):
        self._read_fails(path)
        return super().size(path)

    def read_bytes(self, path):
        self._read_fails(path)
        return super().read_bytes(path)


@pytest.fixture
def unclear():
    yield _UnclearManifest
    _UnclearManifest.armed, _UnclearManifest.land, _UnclearManifest.fail_reads = False, True, 0


@pytest.mark.parametrize("step", [2, 1])  # a new step; a re-save of the committed one
def test_a_manifest_write_that_errs_after_it_landed_commits_and_keeps_its_shards(root, unclear,
                                                                                 step):
    """The ranks removed the shards of a save whose manifest landed but whose write reported
    an error: the step (for a re-save, the only copy of it) named missing files."""
    ck = fastckpt.Checkpointer(_UnclearManifest(open_storage(root)))
    ck.save({"w": torch.zeros(1000)}, step=1, block=True)
    unclear.armed = True
    ck.save({"w": torch.full((1000,), 7.0)}, step=step, block=True)  # committed all the same
    unclear.armed = False
    ck.close()
    got = {"w": torch.zeros(1000)}
    assert fastckpt.load(got, root) == max(step, 1) and torch.equal(got["w"], torch.full((1000,), 7.0))
    from fastckpt.tools.verify import verify_step
    assert verify_step(root, step, record=False).ok


def test_a_manifest_write_whose_outcome_cannot_be_read_keeps_every_file(root, unclear):
    """The write erred before it landed, and reading it back erred too: whether the step is
    committed is unknown, so no file is removed; the committed step stays as it was."""
    ck = fastckpt.Checkpointer(_UnclearManifest(open_storage(root)))
    ck.save({"w": torch.zeros(1000)}, step=1, block=True)
    unclear.armed, unclear.land, unclear.fail_reads = True, False, 2
    with pytest.raises(fastckpt.CommitTimeoutError, match="unknown") as ei:
        ck.save({"w": torch.ones(1000)}, step=2, block=True)
    assert ei.value.outcome_unknown
    assert any(n.endswith(".fck") for n in os.listdir(os.path.join(root, "step-0000000002")))
    unclear.armed = False
    assert fastckpt.steps(root) == [1]
    got = {"w": torch.ones(1000)}
    assert fastckpt.load(got, root) == 1 and torch.equal(got["w"], torch.zeros(1000))
    ck.save({"w": torch.ones(1000)}, step=3, block=True)
    ck.close()


def _blocking_staging_fails_on_one_rank(rank: int, world: int, root: str, compression):
    import fastckpt.engine.core as core
    real = core.gather_piece

    def gather(piece, data, io):  # (zero-copy: the edge pages' copy of rank 1 fails)
        if armed["on"]:
            raise MemoryError("injected staging failure")
        return real(piece, data, io)
    armed = {"on": False}
    core.gather_piece = gather
    ck = fastckpt.Checkpointer(root, plan_timeout_s=15, commit_timeout_s=20,
                               compression=compression)
    if compression:  # (a staged save: its copy into the pool fails)
        real_stage = core.stage_piece

        def stage(*a, **kw):
            if armed["on"]:
                raise MemoryError("injected staging failure")
            return real_stage(*a, **kw)
        core.stage_piece = stage
    ck.save(_state(rank), step=1, block=True)
    armed["on"] = rank == 1
    try:
        ck.save(_state(rank), step=2, block=True)
        second = "ok"
    except (fastckpt.FastCkptError, MemoryError) as e:
        second = type(e).__name__
    armed["on"] = False
    t0 = time.monotonic()
    ck.save(_state(rank), step=3, block=True)  # before 2026-12-06: rank 1 raised step 2's
    took = time.monotonic() - t0               # failure again alone, rank 0 timed out
    ck.close()
    return second, took < 10


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_a_blocking_save_that_failed_on_one_rank_is_not_raised_again(root, compression):
    out = distributed.run(_blocking_staging_fails_on_one_rank, 2, root, compression)
    assert out == [("SaveFailedError", True), ("MemoryError", True)], out
    assert fastckpt.steps(root) == [1, 3]
