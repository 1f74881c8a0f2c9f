"""Review repros for the local-first tiering (fastckpt/engine/tiering.py and friends).

Each test here failed on the code it was written against; the remote tier is a second local
root (``open_storage(path)``) or fsspec's memory:// unless said otherwise.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt.engine import tiering
from fastckpt.storage import open_storage

pytest_plugins = ["tests.s3fixtures"]

pytestmark = [pytest.mark.timeout(120)]


def _remote_steps(path: str) -> list[int]:
    return fastckpt.steps(path)


def _slow_uploads(monkeypatch, seconds: float) -> None:
    real = tiering.Tier._upload_file

    def slow(self, st, up, f, dest):
        time.sleep(seconds)
        return real(self, st, up, f, dest)
    monkeypatch.setattr(tiering.Tier, "_upload_file", slow)


def test_a_step_planned_deferred_while_the_chain_ends_is_left_behind(tmp_path, monkeypatch,
                                                                     caplog):
    """The plan reads ``tier.busy`` (True: step 1 is uploading) and registers the deferred
    step with ``expect`` only later (after the plan exchange, the staging pool's allocation,
    ...). If step 1's upload and its chain end in between, the chain saw neither a deferred
    nor an expected step and ended; step 2 is then "deferred" with no chain to upload it:
    ``wait_remote`` never returns and ``close()`` skips it, so the newest step never reaches
    the remote tier (docs/design.md: "close() ... leaves it uploaded")."""
    _slow_uploads(monkeypatch, 1.0)  # step 1's upload: busy when step 2 is planned
    from fastckpt.engine import core
    real_pieces = core.shard_pieces
    box = {}

    def slow_pieces(*a, **k):  # between the plan's busy read and expect(): a slow step
        tier = box.get("tier")
        end = time.monotonic() + 8  # (step 1's upload and its chain end in ~2 s unfixed)
        while tier is not None and tier.busy and time.monotonic() < end:
            time.sleep(0.01)
        return real_pieces(*a, **k)
    monkeypatch.setattr(core, "shard_pieces", slow_pieces)
    caplog.set_level("INFO", logger="fastckpt")
    local, remote = tmp_path / "local", tmp_path / "remote"
    remote.mkdir()
    with fastckpt.Checkpointer(str(local), remote=open_storage(str(remote))) as ck:
        ck.save({"w": torch.full((1000,), 1.0)}, step=1, block=True)
        box["tier"] = ck.tier
        h2 = ck.save({"w": torch.full((1000,), 2.0)}, step=2, block=True)
        # planned deferred (the plan found step 1 uploading); a chain that waits for it (the
        # fix: the plan's reservation keeps it going, so slow_pieces waits its 8 s) takes
        # it as soon as it commits, so by now it may be "pending" already
        assert "step 2: uploaded once the upload of an earlier step is over" in caplog.text
        assert h2.remote_state in ("deferred", "pending", "committed")
        h2.wait_remote(timeout=5)  # TimeoutError here: nobody will upload it
    assert h2.remote_state == "committed"
    assert _remote_steps(str(remote)) == [1, 2]


class _HungListing:
    """Mixin: ``subdirs``/``listdir`` of this root block while ``hang`` is set, until ``gate``
    (a mount that stops answering; let go at the end of the test)."""

    def _setup(self):
        self.hang = False
        self.gate = threading.Event()
        self.entered = threading.Event()

    def _block(self):
        if self.hang:
            self.entered.set()
            self.gate.wait(60)


def _hung_local(root: str):
    from fastckpt.storage.local import LocalStorage, bounded_call

    class Hung(_HungListing, LocalStorage):  # (blocks inside the call, as a mount would)
        @bounded_call("listing")
        def subdirs(self, path):
            self._block()
            return LocalStorage.subdirs.__wrapped__(self, path)

        @bounded_call("listing")
        def listdir(self, path):
            self._block()
            return LocalStorage.listdir.__wrapped__(self, path)
    st = Hung(root)
    st._setup()
    return st


def _close_within(ck, seconds: float):
    """close() in a thread: (returned in time, its exception)."""
    out = {}

    def go():
        try:
            ck.close()
        except BaseException as e:  # noqa: BLE001
            out["exc"] = e
    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    return not t.is_alive(), out.get("exc"), t


def test_a_hung_local_root_makes_the_uploader_and_close_wait_for_good(tmp_path, monkeypatch):
    """The uploader's housekeeping runs local retention on ``engine.storage`` itself, not a
    bounded view (tiering.py ``_housekeep``; the writer's own housekeeping goes through
    ``Storage.run`` on a bounded view). A local mount that stops answering after the local
    commit then holds the uploader for good, and with it ``wait_remote()`` and ``close()``:
    an untiered Checkpointer's close raises by its bound (docs/design.md, "No local call
    holds a save past its deadline")."""
    from fastckpt.engine import handle as _handle
    from fastckpt.engine import writer as _writer
    # the short bounds of tests/test_hung_storage.py: every documented bound of a save and
    # of close() is then a few seconds
    monkeypatch.setattr(_writer, "WRITE_GRACE_S", 0.5)
    monkeypatch.setattr(_writer, "WRITE_STALL_S", 0.5)
    monkeypatch.setattr(_writer, "MIN_WRITE_BPS", 1 << 40)
    monkeypatch.setattr(_writer, "CLOSE_MIN_S", 0.5)
    monkeypatch.setattr(_handle, "STUCK_SLACK_S", 1.0)
    local = _hung_local(str(tmp_path / "local"))
    (tmp_path / "remote").mkdir()
    real = tiering.Tier._upload_file

    def arm(self, st, up, f, dest):  # the local commit and its housekeeping are done
        local.hang = True
        return real(self, st, up, f, dest)
    monkeypatch.setattr(tiering.Tier, "_upload_file", arm)
    ck = fastckpt.Checkpointer(local, remote=open_storage(str(tmp_path / "remote")),
                               commit_timeout_s=1.5, keep_last=1)
    try:
        ck.save({"w": torch.full((1000,), 1.0)}, step=1, block=True)
        assert local.entered.wait(20)
        ended, exc, t = _close_within(ck, 20)
        assert ended, "close() still waiting 20 s after a 1.5 s commit_timeout_s"
    finally:
        local.gate.set()


def _retire_under_the_first_read(monkeypatch, local: str, new_step: int):
    """The first shard check of a load runs after a writer (another process, as a training
    job next to an eval job) committed ``new_step`` with keep_last=1: the step being read is
    gone (as docs/design.md's "Any number of readers" describes)."""
    from fastckpt.engine import reader as _reader
    real = _reader.FastCkptReader.check_files
    done = []

    def check_files(self):
        if not done:
            done.append(1)
            fastckpt.save({"w": torch.full((1000,), float(new_step))}, local, step=new_step,
                          keep_last=1)
        return real(self)
    monkeypatch.setattr(_reader.FastCkptReader, "check_files", check_files)


@pytest.mark.parametrize("tiered", [False, True])
def test_a_step_retired_under_a_tiered_resume_is_not_no_checkpoint(tmp_path, monkeypatch,
                                                                    tiered):
    """A load whose step the writer's retention removes while it is read starts again on the
    newer step (docs/design.md, "Any number of readers"; ``load_into`` does, untiered). The
    tiered load asks ``load_into`` for the step by number, so ``StepRemovedError`` comes out
    at once; it is a ``CheckpointNotFoundError``, which ``Checkpointer.resume`` turns into
    None: "no checkpoint", the job starts from scratch while step 4 is committed.
    (tiered=False passes: the same interleaving without a remote tier loads step 4.)"""
    local = str(tmp_path / "local")
    (tmp_path / "remote").mkdir()
    fastckpt.save({"w": torch.full((1000,), 3.0)}, local, step=3, keep_last=1)
    _retire_under_the_first_read(monkeypatch, local, 4)
    kw = {"remote": open_storage(str(tmp_path / "remote"))} if tiered else {}
    with fastckpt.Checkpointer(local, **kw) as ck:
        dest = {"w": torch.zeros(1000)}
        got = ck.resume(dest)
        assert got == 4 and float(dest["w"][0]) == 4.0, (got, ck.last_load)


def test_a_failed_emergency_reupload_removes_the_committed_remote_step(tmp_path, monkeypatch):
    """A stop at the step just saved: the local decision is "committed" and, with nothing in
    flight, ``decide_remote`` answers "upload", so ``after_save`` uploads that save again
    although its upload committed already (``remote_state == "committed"``). The second
    upload writes the same file names; when it fails (a store error, its deadline), the
    uploader's ``_discard`` removes this rank's files of the save: the files the remote
    manifest of the step names. The remote tier then holds a manifest whose shards are gone,
    its only copy of the step (local_survives=False: the node's disk goes with it)."""
    from fastckpt.preempt import budget, tiered
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    os.makedirs(remote)
    with fastckpt.Checkpointer(local, remote=open_storage(remote)) as ck:
        h = ck.save({"w": torch.full((1000,), 1.0)}, step=1, block=True)
        h.wait_remote(timeout=30)
        assert h.remote_state == "committed"
        # the emergency decision at step 1 (nothing in flight, plenty of time)
        nums = {"left_s": 30.0, "est_save_s": 0.1, "inflight_left_s": 0.0,
                "inflight_piece_s": 0.0}
        rep = budget.estimate_remote(nbytes=4000, measured_bps=1e8, record_bps=None,
                                     assumed_bps=1e8, inflight=None)
        remote_decision, _, _ = budget.decide_remote([rep], "committed", nums, 0.5, False, 1)
        assert remote_decision == "upload"
        ck.tier.freeze()

        def store_error(self, st, up, f, dest):
            raise OSError(5, "the store answered 500 (simulated)")
        monkeypatch.setattr(tiering.Tier, "_upload_file", store_error)
        events = []
        tiered.after_save(ck, {"remote": remote_decision}, h, time.monotonic() + 10,
                          lambda name, **kw: events.append((name, kw)), 0)
    # the remote tier must still hold a loadable step 1
    dest = {"w": torch.zeros(1000)}
    assert fastckpt.load(dest, remote) == 1 and float(dest["w"][0]) == 1.0


@pytest.mark.parametrize("tiered", [False, True])
def test_a_hung_local_root_fails_a_tiered_resume_by_its_bound(tmp_path, monkeypatch, tiered):
    """A load's metadata calls go through a per-call view (``load_into``:
    ``storage.per_call(READ_STALL_S)``), so a local mount that stops answering fails the load
    after READ_STALL_S (docs/design.md). The tiered resume first lists each tier with
    ``find_step`` on ``engine.storage`` itself (tierload.py ``_newest``), unbounded: it waits
    for good. (tiered=False passes: StorageError after the bound.)"""
    from fastckpt.engine import load as _load
    monkeypatch.setattr(_load, "READ_STALL_S", 1.0)
    root = str(tmp_path / "local")
    fastckpt.save({"w": torch.full((1000,), 1.0)}, root, step=1)
    (tmp_path / "remote").mkdir()
    local = _hung_local(root)
    kw = {"remote": open_storage(str(tmp_path / "remote"))} if tiered else {}
    ck = fastckpt.Checkpointer(local, **kw)
    out = {}

    def go():
        try:
            out["step"] = ck.resume({"w": torch.zeros(1000)})
        except BaseException as e:  # noqa: BLE001
            out["exc"] = e
    local.hang = True
    t = threading.Thread(target=go, daemon=True)
    try:
        t.start()
        t.join(15)
        assert not t.is_alive(), "resume still waiting 15 s after a 1 s bound"
        assert isinstance(out.get("exc"), fastckpt.StorageError), out
    finally:
        local.gate.set()
        t.join(30)
        ck.close()


def _s3_opts(s3) -> dict:
    client = dict(s3.storage_options["client_kwargs"], endpoint_url=s3.endpoint)
    return {**s3.storage_options, "client_kwargs": client, "skip_instance_cache": True}


def test_cli_resume_with_every_local_manifest_damaged_reads_the_remote_tier(tmp_path, s3,
                                                                            capsys):
    """``fastckpt resume ROOT`` of a tiered root whose local manifests are all damaged (one
    torn manifest, keep_last=1) while the remote tier holds the step: the engine's resume
    (``Tier.load``) loads it from the remote tier, but the CLI's ``_newest_of_tiers``
    (cli/steps.py) lets the local ``CorruptCheckpointError`` out before it looks at the
    remote tier: "every committed step is damaged" (exit 1), and a script or supervisor
    deciding from it starts from scratch or gives up."""
    from fastckpt import cli
    local = str(tmp_path / "cli")
    url = s3.url("dmg")
    with fastckpt.Checkpointer(local, remote=url, storage_options=_s3_opts(s3),
                               keep_last=1) as ck:
        ck.save({"w": torch.full((1000,), 2.0)}, step=2, block=True).wait_remote(timeout=60)
    man = os.path.join(local, "step-0000000002", "manifest.json")
    with open(man, "r+b") as f:  # torn
        f.truncate(os.path.getsize(man) // 2)
    with fastckpt.Checkpointer(local, remote=url, storage_options=_s3_opts(s3)) as ck:
        dest = {"w": torch.zeros(1000)}
        assert ck.resume(dest) == 2 and ck.last_load["tier"] == "remote"  # the engine: fine
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(["resume", local, "--json"])
    captured = capsys.readouterr()
    assert e.value.code == 0, (e.value.code, captured.out, captured.err)


def test_a_remote_tier_that_is_the_local_root_destroys_every_local_step(tmp_path):
    """``remote=`` naming the local root itself (a configuration slip: a default that falls
    back to the local path). Nothing refuses it: each upload fails on the remote lease (the
    local root is flocked by this very job), and the failed upload's ``_discard`` removes
    "this rank's remote files": the shards of the local step just committed. Every step keeps
    a valid manifest naming missing shards; nothing loads. Expected: refused when the
    Checkpointer is made (``_open_tier``), or at least the local steps left alone."""
    local = str(tmp_path / "l")
    try:
        ck = fastckpt.Checkpointer(local, remote=open_storage(local))
    except ValueError:
        return  # refused up front: fine
    with ck:
        h = ck.save({"w": torch.full((1000,), 1.0)}, step=1, block=True)
        with pytest.raises(Exception):
            h.wait_remote(timeout=30)
    dest = {"w": torch.zeros(1000)}
    assert fastckpt.load(dest, local) == 1 and float(dest["w"][0]) == 1.0


def test_the_upload_bandwidth_sample_leaves_the_lease_out(tmp_path, monkeypatch):
    """``Tier._upload`` starts the clock of the bandwidth sample (``samples``, which the
    emergency budget divides the state's bytes by) before the coordinator takes the remote
    lease on its first upload: the lease's wait (the 0.2 s read-back on stores without
    conditional writes, memory:// here: 8 MiB "took" 0.22 s instead of 0.02 s; up to
    ``lease_ttl_s`` for a lease left by a dead holder) counts as upload time. The measured
    bandwidth is then 10x or more too low for the next uploads, and a preemption's
    ``decide_remote`` skips uploads that fit. Here the lease takes 1 s (simulated)."""
    import uuid
    from fastckpt import lease as _lease
    real = _lease.WriterLease.acquire

    def slow_acquire(self):
        time.sleep(1.0)
        return real(self)
    monkeypatch.setattr(_lease.WriterLease, "acquire", slow_acquire)
    url = "memory://review-bw-" + uuid.uuid4().hex[:8]
    with fastckpt.Checkpointer(str(tmp_path / "l"), remote=url) as ck:
        ck.save({"w": torch.ones(1 << 20)}, step=1, block=True).wait_remote(timeout=30)
        (nbytes, secs), = list(ck.tier.samples)
    assert secs < 1.0, f"4 MiB to memory:// counted as {secs:.2f} s of upload"
