"""Synchronous fsspec file systems (sftp, ftp, webdav, hdfs: networked, no event loop) have every
call bounded like an async one's: before 2026-12-06 they were called directly, and a server
that stopped answering held a save or a load for ever (the review of 2026-12-06). Here a
``memory://`` file system whose calls block until released stands in for such a server (no
sftp server runs here)."""

from __future__ import annotations

import threading
import time
import uuid

import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

import fastckpt
from fastckpt.errors import StorageError, StorageTimeoutError
from fastckpt.storage.fsspec_backend import FsspecStorage

BOUND_S = 1.0
SLACK_S = 3.0


class _Stuck(MemoryFileSystem):
    """``memory://`` whose calls block while ``stuck`` is set (until ``release``)."""

    protocol = "fastckpt-stuck"
    stuck = threading.Event()
    release = threading.Event()

    def _hang(self) -> None:
        if _Stuck.stuck.is_set():
            _Stuck.release.wait(20)

    def ls(self, path, detail=True, **kw):
        self._hang()
        return super().ls(path, detail=detail, **kw)

    def info(self, path, **kw):
        self._hang()
        return super().info(path, **kw)

    def cat_file(self, path, start=None, end=None, **kw):
        self._hang()
        return super().cat_file(path, start=start, end=end, **kw)

    def pipe_file(self, path, value, **kw):
        self._hang()
        return super().pipe_file(path, value, **kw)


@pytest.fixture
def stuck():
    fsspec.register_implementation(_Stuck.protocol, _Stuck, clobber=True)
    _Stuck.stuck.clear()
    _Stuck.release.clear()
    yield _Stuck
    _Stuck.release.set()  # the abandoned calls end, their threads go back to the pool


def test_a_synchronous_file_system_that_stops_answering_fails_each_call_at_its_bound(stuck):
    url = f"{_Stuck.protocol}://r-{uuid.uuid4().hex[:8]}/root"
    st = FsspecStorage(url, storage_options={}, op_timeout_s=BOUND_S)
    st.makedirs(st.root)
    st.publish(st.join("a"), b"x")
    assert st.listdir(st.root) == ["a"]
    stuck.stuck.set()
    for what, call in [("listing", lambda: st.listdir(st.root)),
                       ("reading", lambda: st.read_bytes(st.join("a"))),
                       ("stat", lambda: st.size(st.join("a"))),
                       ("publish", lambda: st.publish(st.join("b"), b"y"))]:
        t0 = time.monotonic()
        with pytest.raises(StorageTimeoutError, match="no answer to"):
            call()  # (not damage: the tools end on it, exit 4)
        took = time.monotonic() - t0
        assert took < BOUND_S + SLACK_S, (what, took)


def test_a_load_from_a_file_system_that_stops_answering_fails_instead_of_hanging(stuck):
    url = f"{_Stuck.protocol}://r-{uuid.uuid4().hex[:8]}/root"
    st = FsspecStorage(url, storage_options={}, op_timeout_s=BOUND_S)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    with fastckpt.Checkpointer(st) as ck:
        ck.save(state, step=1).wait()
    stuck.stuck.set()
    out: dict = {}

    def load() -> None:
        try:
            fastckpt.Checkpointer(st).load({"w": torch.zeros(1000)})
            out["r"] = "loaded"
        except fastckpt.FastCkptError as e:
            out["r"] = e

    t = threading.Thread(target=load, daemon=True)
    t0 = time.monotonic()
    t.start()
    t.join(60)
    assert not t.is_alive(), "the load waits on a call that never returns"
    assert isinstance(out["r"], StorageError), out
    assert time.monotonic() - t0 < 4 * (BOUND_S + SLACK_S)
