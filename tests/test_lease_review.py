"""Review of the writer lease (fastckpt/lease.py, 2026-12-07): a holder whose lease was taken
over.

The takeover tests run where ``flock`` is refused (NFS emulates it with POSIX locks: EBADF on a
read-only directory fd), so the record alone decides, as on NFS and object stores without
conditional writes. A holder that did not renew for the lease's TTL (SIGSTOP, a partitioned
node) loses the lease to the next writer:

* it must not hold it again once the taker's record is gone (the taker released it): before
  2026-12-07 ``check()`` passed again and the next renewal wrote the old holder's record back,
  though it had logged "this job must not write there any more";
* a takeover between its check before the manifest and its housekeeping (a partition while
  the manifest is published) must not let its retention remove the taker's in-flight save:
  before 2026-12-07 retention removed every partial step after the commit, unchecked (the
  local root's writer and the remote tier's uploader alike).

And the claim of a root (the write probe, then the lease) on a mount that stops answering
fails the first save by its bound instead of holding it.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt.errors import SaveFailedError, StorageError, WriterLockedError
from fastckpt.lease import LEASE, WriterLease
from fastckpt.manifest import schema as fmt
from fastckpt.storage.local import LocalStorage

pytestmark = pytest.mark.timeout(120)


@pytest.fixture
def no_flock(monkeypatch):
    def refused(fd, op):
        raise OSError(errno.EBADF, os.strerror(errno.EBADF))
    monkeypatch.setattr(fcntl, "flock", refused)


def _expire(root: str) -> None:
    """The holder's record as if it had not been renewed for long (its holder was stopped)."""
    path = os.path.join(root, LEASE)
    with open(path) as f:
        rec = json.load(f)
    rec["renewed_unix"] = time.time() - 3600
    with open(path, "w") as f:
        json.dump(rec, f)


def test_a_lease_taken_over_stays_lost_after_the_taker_released_it(tmp_path, no_flock, caplog):
    root = str(tmp_path / "root")
    old = WriterLease(LocalStorage(root), ttl_s=30.0, renew_s=20.0).acquire()
    try:
        _expire(root)
        new = WriterLease(LocalStorage(root), ttl_s=30.0, renew_s=20.0).acquire()
        with caplog.at_level(logging.ERROR, logger="fastckpt"):
            old.renew()  # sees the taker's record
        assert any("taken over" in r.getMessage() for r in caplog.records)
        with pytest.raises(WriterLockedError, match="taken over"):
            old.check()
        new.release()  # the taker is done: its record is removed
        assert not os.path.exists(os.path.join(root, LEASE))
        old.renew()  # must not write the old holder's record back
        assert not os.path.exists(os.path.join(root, LEASE))
        with pytest.raises(WriterLockedError, match="taken over"):
            old.check()  # nor commit as if it still held the lease
    finally:
        old.release()


def _state(v: float) -> dict:
    return {"w": torch.full((64,), float(v))}


def test_retention_after_a_takeover_leaves_the_takers_save(tmp_path, no_flock, monkeypatch):
    root = str(tmp_path / "root")
    theirs = os.path.join(root, fmt.step_dirname(9))  # the taker's in-flight save (partial)
    orig = LocalStorage.publish_manifest

    def publish_manifest(self, path, data):
        orig(self, path, data)
        if fmt.step_dirname(2) in path:  # a partition while step 2's manifest was written:
            _expire(root)                 # another writer took the lease over meanwhile
            taker = WriterLease(LocalStorage(root), ttl_s=30.0, renew_s=20.0)
            taker.acquire()._stop.set()  # (its record stays: it holds the lease)
            os.makedirs(theirs)
            with open(os.path.join(theirs, "shard-r0-0.bin"), "wb") as f:
                f.write(b"x" * 4096)
    monkeypatch.setattr(LocalStorage, "publish_manifest", publish_manifest)
    with fastckpt.Checkpointer(root, keep_last=1) as ck:
        ck.save(_state(1), step=1, block=True)
        ck.save(_state(2), step=2, block=True)  # committed before the takeover was seen
        assert os.path.isdir(theirs) and os.listdir(theirs), "retention removed the taker's save"
        with pytest.raises(SaveFailedError, match="taken over"):  # (its lease check: as before)
            ck.save(_state(3), step=3, block=True)


def test_remote_retention_after_a_takeover_leaves_the_takers_save(tmp_path, no_flock,
                                                                  monkeypatch):
    """The same on a tiered root: the remote root's lease (the uploader's) is taken over
    while step 6's remote manifest is written; that upload's remote retention must not remove
    the taker's in-flight upload (a partial step below 6: it resumed from an older step)."""
    from fastckpt.storage import open_storage
    local, remote = str(tmp_path / "local"), str(tmp_path / "remote")
    os.makedirs(remote)
    theirs = os.path.join(remote, fmt.step_dirname(3))
    orig = LocalStorage.publish_manifest

    def publish_manifest(self, path, data):
        orig(self, path, data)
        if path.startswith(remote) and fmt.step_dirname(6) in path:
            _expire(remote)
            WriterLease(LocalStorage(remote), ttl_s=30.0, renew_s=20.0).acquire()._stop.set()
            os.makedirs(theirs)
            with open(os.path.join(theirs, "shard-r0-0.bin"), "wb") as f:
                f.write(b"x" * 4096)
    monkeypatch.setattr(LocalStorage, "publish_manifest", publish_manifest)
    with fastckpt.Checkpointer(local, remote=open_storage(remote), keep_last=1) as ck:
        ck.save(_state(5), step=5, block=True).wait_remote(timeout=30)
        h = ck.save(_state(6), step=6, block=True)
        h.wait_remote(timeout=30)
        assert h.remote_state == "committed"
    assert os.path.isdir(theirs) and os.listdir(theirs), "retention removed the taker's save"


@pytest.mark.timeout(90)
def test_claiming_a_root_on_a_mount_that_stops_answering_has_a_deadline(tmp_path):
    """The first save claims the root (is it writable? the writer lease): on a mount that
    stops answering it fails by the save's bound, naming the call, instead of holding the
    training thread (before 2026-12-07 the write probe ran unbounded)."""
    from tests.test_hung_storage import Hung
    root = str(tmp_path / "ck")
    os.makedirs(root)
    st = Hung(root, hang=("publish",))
    ck = fastckpt.Checkpointer(st, commit_timeout_s=1.5)
    out: dict = {}

    def first_save():
        try:
            ck.save(_state(1), step=1).wait()
            out["result"] = "saved"
        except Exception as e:  # noqa: BLE001
            out["result"] = e
    th = threading.Thread(target=first_save, daemon=True)
    th.start()
    try:
        th.join(30)  # the bound is 1.5 s: far from 30 s
        assert not th.is_alive(), "the first save is still claiming the root after 30 s"
        assert isinstance(out["result"], StorageError), out
        assert "publishing" in str(out["result"]) and ".fastckpt-write-probe" in str(out["result"])
    finally:
        st.answers()
        th.join(30)
        ck.close()
