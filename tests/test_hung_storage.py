"""A file system that stops answering (a hung NFS mount, a failing device) fails a save by its
deadline, naming the rank and the file or call, instead of hanging the job; the steps committed
before it stay loadable, nothing the caller passed changes, and ``close`` ends too.

Simulated, and said so: nothing here can make a real mount stop answering (no NFS server, no
FUSE tools on these machines), and a local system call blocked in the kernel cannot be
interrupted anyway. ``Hung`` is a real LocalStorage whose chosen calls block on an event inside
the code path they take: shard writes on the engine's I/O threads (the writer bounds its waits
for them), a load's reads on its reader threads (bounded by engine/readitems.py), metadata calls
inside the bounded view's pool thread (``bounded_call``).
The blocked calls are let go at the end of each test, as a mount that comes back would.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt.engine import handle as _handle
from fastckpt.engine import load as _load
from fastckpt.engine import reader as _reader
from fastckpt.engine import readitems as _readitems
from fastckpt.engine import writer as _writer
from fastckpt.errors import SaveFailedError, StorageError
from fastckpt.manifest import schema as fmt
from fastckpt.storage.local import LocalStorage, bounded_call

from tests.distributed import run

COMMIT_S = 1.5  # commit_timeout_s of these tests: the writes' and the commit's deadline
READ_S = 1.0  # a load's wait for a read or a metadata call (READ_STALL_S: 120 s)


class Hung(LocalStorage):
    """A local root whose calls named in ``hang`` block until ``gate`` is set."""

    def __init__(self, root: str, hang: tuple = ()) -> None:
        super().__init__(root)
        self.hang = set(hang)
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.before_write = None  # called before each shard write (a test's interleaving)
        self.write_s = 0.0  # each shard write takes this long (a slow disk that answers)

    def answers(self) -> None:
        """The mount answers again: nothing blocks, the blocked calls return."""
        self.hang.clear()
        self.gate.set()

    def _block(self, what: str) -> None:
        if what in self.hang:
            self.entered.set()
            self.gate.wait(120)

    def write_shard(self, *args, **kw):
        if self.before_write is not None:
            self.before_write()
        self._block("write")
        time.sleep(self.write_s)
        return super().write_shard(*args, **kw)

    @bounded_call("publishing")
    def publish(self, path: str, data: bytes, *, durable: bool = True) -> None:
        name = path.rsplit("/", 1)[-1]
        self._block({"manifest.json": "publish_manifest", "latest": "publish_latest"}.get(
            name, "publish"))
        return LocalStorage.publish.__wrapped__(self, path, data, durable=durable)

    def write_gathered(self, *args, **kw):  # (a blocking save's zero-copy writes)
        if self.before_write is not None:
            self.before_write()
        self._block("write")
        time.sleep(self.write_s)
        return super().write_gathered(*args, **kw)

    def read_into(self, *args, **kw):
        self._block("read")
        return super().read_into(*args, **kw)

    @bounded_call("syncing the directory")
    def sync_dir(self, path: str) -> None:
        self._block("sync_dir")
        return LocalStorage.sync_dir.__wrapped__(self, path)

    @bounded_call("reading")
    def read_bytes(self, path: str) -> bytes:
        if path.endswith("manifest.json"):
            self._block("manifest")
        return LocalStorage.read_bytes.__wrapped__(self, path)


@pytest.fixture(autouse=True)
def short_bounds(monkeypatch):
    monkeypatch.setattr(_writer, "WRITE_GRACE_S", 0.5)
    monkeypatch.setattr(_writer, "WRITE_STALL_S", 0.5)  # (a write's own allowance: 120 s)
    monkeypatch.setattr(_writer, "MIN_WRITE_BPS", 1 << 40)
    monkeypatch.setattr(_writer, "CLOSE_MIN_S", 0.5)
    monkeypatch.setattr(_handle, "STUCK_SLACK_S", 1.0)
    for mod in (_readitems, _load, _reader):  # a load's bound on each read and metadata call
        monkeypatch.setattr(mod, "READ_STALL_S", READ_S)


@pytest.fixture
def job(tmp_path):
    """(root, a Hung storage on it, a Checkpointer on that) for one test; at the end the
    mount answers and the Checkpointer is closed."""
    root = str(tmp_path / "ck")
    st = Hung(root)
    ck = fastckpt.Checkpointer(st, commit_timeout_s=COMMIT_S)
    try:
        yield root, st, ck
    finally:
        st.gate.set()
        ck.close()


def state(v: float) -> dict:
    return {"w": torch.full((1 << 18,), v), "b": torch.full((1000,), v), "step": int(v)}


def loads(root: str, v: float) -> int:
    got = {"w": torch.zeros(1 << 18), "b": torch.zeros(1000), "step": 0}
    step = fastckpt.load(got, root)
    assert torch.equal(got["w"], torch.full((1 << 18,), v)) and got["step"] == int(v)
    return step


@pytest.mark.parametrize("block", [False, True], ids=["async", "blocking-zero-copy"])
def test_a_shard_write_that_never_returns_fails_the_save_by_its_deadline(job, block):
    root, st, ck = job
    ck.save(state(1.0), step=1, block=True)
    st.hang.add("write")
    s2 = state(2.0)
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s2.items()}
    t0 = time.monotonic()
    with pytest.raises(SaveFailedError, match="did not finish within its bound") as e:
        ck.save(s2, step=2, block=block).wait()
    took = time.monotonic() - t0
    assert st.entered.is_set()
    assert took < COMMIT_S + 0.5 + 8, took  # the deadline, the grace, the commit's abort
    cause = e.value.__cause__
    assert isinstance(cause, StorageError) and cause.rank == 0, cause
    assert cause.file.endswith(".fck") and "step-0000000002" in cause.file
    assert all(torch.equal(s2[k], before[k]) if isinstance(before[k], torch.Tensor)
               else s2[k] == before[k] for k in before)
    assert fastckpt.steps(root) == [1] and loads(root, 1.0) == 1
    # the mount comes back: the stuck write returns into an aborted save, the next commits
    st.answers()
    ck.save(state(3.0), step=3, block=True)
    assert fastckpt.steps(root) == [1, 3] and loads(root, 3.0) == 3


def test_a_directory_sync_that_never_returns_fails_the_save_naming_the_call(job):
    """The writer thread's own metadata call (the shard files' directory fsync) runs on the
    bounded view's pool: the save fails naming it, the writer is free for the next save."""
    root, st, ck = job
    ck.save(state(1.0), step=1, block=True)
    st.hang.add("sync_dir")
    t0 = time.monotonic()
    with pytest.raises(SaveFailedError, match="syncing the directory did not return") as e:
        ck.save(state(2.0), step=2).wait()
    assert time.monotonic() - t0 < COMMIT_S + 8
    assert "step-0000000002" in e.value.__cause__.file
    assert fastckpt.steps(root) == [1] and loads(root, 1.0) == 1
    st.answers()
    ck.save(state(3.0), step=3, block=True)
    assert fastckpt.steps(root) == [1, 3]


def test_close_ends_at_the_bound_while_a_write_is_still_stuck(tmp_path):
    """The failed save is reported; its write still holds an I/O thread. ``close`` used to
    join that thread for good; it now raises at the last save's bound (its deadlines plus the
    slack), naming the step."""
    root = str(tmp_path / "ck")
    st = Hung(root, hang=("write",))
    ck = fastckpt.Checkpointer(st, commit_timeout_s=COMMIT_S)
    try:
        with pytest.raises(SaveFailedError):
            ck.save(state(1.0), step=1).wait()
        t0 = time.monotonic()
        with pytest.raises(StorageError, match=r"closing: .*step 1\).*hung mount") as e:
            ck.close()
        assert time.monotonic() - t0 < 3 * COMMIT_S + 1.0 + 5
        assert "step-0000000001" in e.value.file
        assert fastckpt.steps(root) == []
    finally:
        st.gate.set()


def _two_ranks(rank: int, world: int, root: str) -> dict:
    # (this process's bounds: the fixture set the parent's only)
    _writer.WRITE_GRACE_S, _writer.WRITE_STALL_S, _writer.MIN_WRITE_BPS = 0.5, 0.5, 1 << 40
    _writer.CLOSE_MIN_S, _handle.STUCK_SLACK_S = 0.5, 1.0
    st = Hung(root) if rank == 1 else LocalStorage(root)
    ck = fastckpt.Checkpointer(st, commit_timeout_s=COMMIT_S)
    out: dict = {}
    try:
        ck.save(state(1.0 + rank), step=1, block=True)
        if rank == 1:
            st.hang.add("write")
        t0 = time.monotonic()
        try:
            ck.save(state(10.0 + rank), step=2).wait()
            out["error"] = None
        except fastckpt.FastCkptError as e:  # rank 0: rank 1 did not report by the deadline
            out["error"] = f"{type(e).__name__}: {e} (cause: {e.__cause__})"
        out["took"] = time.monotonic() - t0
        if rank == 1:
            st.answers()
        ck.save(state(3.0 + rank), step=3, block=True)
        out["steps"] = ck.steps()
    finally:
        if rank == 1:
            st.gate.set()
        ck.close()
    return out


def test_two_ranks_one_stuck_write_fails_the_save_on_both_naming_the_rank(tmp_path):
    """Rank 1's shard write never returns: both ranks fail step 2 by the deadline (rank 0's
    error names rank 1, rank 1's its stuck write), step 1 stays the newest, and step 3
    commits once the mount answers again."""
    root = str(tmp_path / "ck")
    r0, r1 = run(_two_ranks, 2, root)
    for r in (r0, r1):
        assert r["error"] is not None and r["took"] < COMMIT_S + 0.5 + 10, r
        assert r["steps"] == [1, 3], r
    assert "rank(s) [1]" in r0["error"], r0["error"]
    assert "did not finish within its bound" in r1["error"], r1["error"]


@pytest.mark.parametrize("where", ["read", "manifest"])
def test_a_load_whose_read_never_returns_fails_naming_the_file(tmp_path, where):
    """A restart on a mount that stops answering: a shard read (on a reader thread) or the
    manifest's read (a metadata call of the load's per-call view) that never returns fails the
    load within its bound, naming the file (and the read's offset), instead of hanging the
    restart; once the mount answers, the same load succeeds."""
    root = str(tmp_path / "ck")
    with fastckpt.Checkpointer(root) as ck:
        ck.save(state(1.0), step=1, block=True)
    st = Hung(root, hang=(where,))
    try:
        got = {"w": torch.zeros(1 << 18), "b": torch.zeros(1000), "step": 0}
        t0 = time.monotonic()
        with pytest.raises(StorageError) as e:
            fastckpt.load(got, st)
        assert time.monotonic() - t0 < READ_S + 8
        assert st.entered.is_set()
        if where == "read":
            assert "has not returned" in str(e.value) and e.value.file.endswith(".fck")
            assert e.value.offset is not None and "must not be used" in str(e.value)
        else:
            assert "reading did not return" in str(e.value)
            assert e.value.file.endswith("manifest.json")
        st.answers()
        assert loads(root, 1.0) == 1
        got = {"w": torch.zeros(1 << 18), "b": torch.zeros(1000), "step": 0}
        assert fastckpt.load(got, st) == 1 and torch.equal(got["w"], torch.full((1 << 18,), 1.0))
    finally:
        st.gate.set()


def test_close_after_a_long_finished_save_does_not_blame_a_hung_mount(tmp_path):
    """A save that committed long ago (past its bound) and a healthy root: close releases
    everything and raises nothing; the root can be opened again at once (the lease is
    released)."""
    root = str(tmp_path / "ck")
    ck = fastckpt.Checkpointer(root, commit_timeout_s=COMMIT_S)
    h = ck.save(state(1.0), step=1, block=True)
    h.bound = time.monotonic() - 10  # (as if the job trained for an hour since)
    ck.close()
    with fastckpt.Checkpointer(root) as again:
        again.save(state(2.0), step=2, block=True)
    assert fastckpt.steps(root) == [1, 2]


def test_a_manifest_rename_left_to_its_thread_never_lands_after_the_failure(job):
    """The manifest's publish does not return in time: the save fails and every rank removes
    its shards; when the mount answers again, the rename must not happen (it would commit a
    step whose shards are gone: every restart would fail on it). The newest step stays 1."""
    root, st, ck = job
    ck.save(state(1.0), step=1, block=True)
    st.hang.add("publish_manifest")
    with pytest.raises(fastckpt.FastCkptError, match="publishing"):
        ck.save(state(2.0), step=2, block=True)
    st.answers()
    time.sleep(0.5)  # (the released call reaches its commit point)
    assert fastckpt.steps(root) == [1]
    assert loads(root, 1.0) == 1
    ck.save(state(3.0), step=3, block=True)
    assert fastckpt.steps(root) == [1, 3]


def test_housekeeping_left_to_its_thread_never_removes_the_next_saves_files(job):
    """Step 2's housekeeping (its ``latest`` hint first) does not return in time: the save
    is committed and the writer goes on. The mount answers while step 3 is being written: the
    abandoned housekeeping must stop, not remove step 3's files as an abandoned partial step
    (before the fix it did: step 3 failed, or a committed step was removed)."""
    root, st, ck = job
    ck.save(state(1.0), step=1, block=True)
    st.hang.add("publish_latest")
    ck.save(state(2.0), step=2, block=True)  # committed; its housekeeping is held
    assert st.entered.is_set() and fastckpt.steps(root) == [1, 2]
    st.hang.clear()

    def release():  # once, as step 3's first shard is written
        st.before_write = None
        st.gate.set()
        time.sleep(0.5)  # (the abandoned pass runs: its listing sees step 3 partial)
    st.before_write = release
    ck.save(state(3.0), step=3, block=True)
    assert fastckpt.steps(root) == [1, 2, 3] and loads(root, 3.0) == 3


def test_calls_stuck_on_one_mount_leave_other_roots_working(tmp_path):
    """Six calls stuck on root A hold six threads; a call on a healthy root B still runs
    (the pool grows; before, four stuck calls made every other root's calls time out,
    blaming B)."""
    a, b = Hung(str(tmp_path / "a"), hang=("sync_dir",)), LocalStorage(str(tmp_path / "b"))
    os.makedirs(a.root)
    os.makedirs(b.root)
    errors = []

    def stuck():
        try:
            a.bounded(time.monotonic() + 30).sync_dir(a.root)
        except StorageError as e:
            errors.append(e)
    threads = [threading.Thread(target=stuck, daemon=True) for _ in range(6)]
    try:
        for t in threads:
            t.start()
        time.sleep(0.5)
        t0 = time.monotonic()
        assert b.bounded(time.monotonic() + 3).listdir(b.root) == []
        assert time.monotonic() - t0 < 2
    finally:
        a.gate.set()
        for t in threads:
            t.join(10)
    assert errors == []  # (released before their bound)


def test_a_slow_disk_that_answers_still_commits(tmp_path, monkeypatch):
    """Each shard write takes 2.5 s, past the save's write deadline (commit_timeout_s=1):
    the write's own allowance (WRITE_STALL_S + its bytes at MIN_WRITE_BPS) covers it, and the
    save commits (a slow disk is not a hung one)."""
    monkeypatch.setattr(_writer, "WRITE_STALL_S", 10.0)
    root = str(tmp_path / "ck")
    st = Hung(root)
    st.write_s = 2.5
    with fastckpt.Checkpointer(st, commit_timeout_s=1.0) as ck:
        ck.save(state(1.0), step=1, block=True)
    assert fastckpt.steps(root) == [1] and loads(root, 1.0) == 1


@pytest.mark.parametrize("cmd,hang", [("ls", "manifest"), ("resume", "manifest"),
                                      ("inspect", "manifest"), ("gc", "manifest"),
                                      ("verify", "read")])
def test_the_cli_on_a_hung_mount_ends_with_exit_4_naming_the_file(tmp_path, monkeypatch,
                                                                   capsys, cmd, hang):
    """``fastckpt ls|resume|inspect|gc|verify ROOT`` on a root whose manifest (or shard)
    reads never return: exit 4 (storage) at the per-call bound (CALL_S: 120 s; 1 s here), the
    file named, instead of a command that never ends; once the mount answers, the same command
    succeeds (before 2026-12-06 the tools' calls ran in place, unbounded)."""
    from fastckpt.tools import describe
    from tests.clirun import call
    root = str(tmp_path / "ck")
    fastckpt.save(state(1.0), root, step=1)
    st = Hung(root, hang=(hang,))
    monkeypatch.setattr(describe, "CALL_S", READ_S)
    monkeypatch.setattr(describe, "open_storage", lambda r, **kw: st)
    t0 = time.monotonic()
    try:
        code, out, err = call(cmd, root, capsys=capsys)
    finally:
        took = time.monotonic() - t0
        st.answers()
    assert st.entered.is_set(), "the simulated hang was not reached"
    assert code == 4, (code, out, err)
    assert took < 30, took  # (the blocked call is held for 120 s)
    named = "manifest.json" if hang == "manifest" else fmt.SHARD_SUFFIX
    assert "did not return within its bound" in err, err
    assert named in err or named in out, (out, err)
    assert "corrupt" not in out and "retry when the storage answers" in err, (out, err)
    code, out, err = call(cmd, root, capsys=capsys)
    assert code == 0, (code, out, err)
    assert fastckpt.steps(root) == [1]


def test_the_job_exit_code_on_a_hung_mount_falls_back_to_the_launchers(tmp_path, monkeypatch,
                                                                        caplog):
    """The supervisor reads the ranks' event logs inside the grace window: on a mount that
    stops answering, ``job_exit_code`` gives None (the launcher's code stands) after
    ``events.READ_S`` with a warning naming the directory, instead of waiting until the
    orchestrator's SIGKILL (simulated: the directory listing blocks)."""
    from fastckpt.tools import events
    d = tmp_path / "events"
    d.mkdir()
    (d / "rank0.jsonl").write_text('{"event": "armed", "t": 1}\n{"event": "exit", "code": 143}\n')
    assert events.job_exit_code(str(d)) == 143
    gate, entered = threading.Event(), threading.Event()
    listdir = os.listdir

    def hung_listdir(p):
        if str(p) == str(d):
            entered.set()
            gate.wait(120)
        return listdir(p)
    monkeypatch.setattr(events, "READ_S", READ_S, raising=False)
    monkeypatch.setattr(events.os, "listdir", hung_listdir)
    t0 = time.monotonic()
    try:
        with caplog.at_level("WARNING", logger="fastckpt"):
            assert events.job_exit_code(str(d)) is None
    finally:
        took = time.monotonic() - t0
        gate.set()
    assert entered.is_set() and took < 30, took
    assert str(d) in caplog.text and "did not return within its bound" in caplog.text
