"""Review of the save's staging and async path (staging.py, device.py, handle.py, core.py,
writer.py, checkpointer.py): each test reproduces one defect found by reading the code."""

from __future__ import annotations

import threading
import time

import pytest
import torch

import fastckpt
from fastckpt.engine import handle as _handle
from fastckpt.engine import writer as _writer

from tests.test_hung_storage import Hung

COMMIT_S = 1.5


@pytest.fixture
def short_bounds(monkeypatch):
    monkeypatch.setattr(_writer, "WRITE_GRACE_S", 0.5)
    monkeypatch.setattr(_writer, "WRITE_STALL_S", 0.5)
    monkeypatch.setattr(_writer, "MIN_WRITE_BPS", 1 << 40)
    monkeypatch.setattr(_writer, "CLOSE_MIN_S", 0.5)
    monkeypatch.setattr(_handle, "STUCK_SLACK_S", 1.0)


def _in_thread(fn, timeout: float):
    """Run ``fn`` in a daemon thread; (finished, result or exception)."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as e:  # noqa: BLE001
            out["error"] = e
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(timeout)
    return (not t.is_alive()), out


def test_capped_pool_save_on_a_hung_mount_fails_by_its_deadline(tmp_path, short_bounds):
    """A capped pool (2 buffers, 6 pieces) on a mount whose shard writes never return: the
    save must fail by its deadline (docs/design.md, Failure cases: "a shard write ... that never
    returns: the save fails by its deadline"). The writer gives up on the stuck writes, then
    waits without a bound for pieces the training thread can never stage (both buffers are
    held: one by the stuck write, one taken from the queue and never released), while the
    training thread waits for a buffer until the handle is done, which it never is."""
    st = Hung(str(tmp_path / "ck"))
    ck = fastckpt.Checkpointer(st, commit_timeout_s=COMMIT_S, staging_cap_bytes=2 << 20)
    try:
        st.hang.add("write")
        state = {"w": torch.arange(6 << 18, dtype=torch.float32).reshape(6 << 8, 1024)}
        finished, out = _in_thread(lambda: ck.save(state, step=1).wait(), timeout=10)
        assert finished, "save() of a capped pool on a hung mount never returned (deadlock)"
        assert "error" in out
    finally:
        st.answers()
        try:
            ck.close()
        except Exception:  # noqa: BLE001
            pass


_DROPPED_SCRIPT = r'''
import gc, sys, threading, weakref
import torch
sys.path.insert(0, sys.argv[3])
import fastckpt
from fastckpt.storage import bounded
from tests.test_hung_storage import Hung

st = Hung(sys.argv[1])
st.hang.add("write")  # the shard write waits for the gate: under way when the script ends
KEEP = []

def checkpoint(state):
    ck = fastckpt.Checkpointer(st)
    if sys.argv[2] == "keep":
        KEEP.append(ck)
    return weakref.ref(ck), ck.save(state, step=1)

ref, handle = checkpoint({"w": torch.arange(1000.0)})

def flush_pool():
    # (an idle thread of the bounded pool keeps its last call's error, whose traceback holds
    # the frames of the first save: a reference to the Checkpointer that goes away with the
    # thread's next call; make every idle thread take one so that gc is deterministic)
    p = bounded.pool()
    n = p.threads
    barrier = threading.Barrier(n)
    futs = []
    for _ in range(n):
        f = bounded._Future()
        p.submit(bounded._Call("flush", ""), f, barrier.wait, (5,), {})
        futs.append(f)
    for f in futs:
        f.done.wait(5)

for _ in range(20 if sys.argv[2] == "drop" else 1):
    flush_pool()
    gc.collect()
    if ref() is None:
        break
print("collected" if ref() is None else "alive", "done" if handle.done() else "running",
      flush=True)
# the mount answers again once the script has ended (a non-daemon thread: joined at shutdown,
# before the atexit handlers run, which then finish the save)
threading.Timer(0.5, st.answers).start()
'''


@pytest.mark.parametrize("keep", ["keep", "drop"])
def test_an_async_save_of_an_unreferenced_checkpointer_is_finished_at_exit(tmp_path, keep):
    """docs/design.md (Save step 5): an async save still running at a normal exit is finished
    by the ``atexit`` close. ``Engine`` registers that close through a weak reference only, so
    a Checkpointer the program no longer references (made in a function that returns the
    handle, as in ``def checkpoint(state): return Checkpointer(root).save(state, step=s)``) is
    collected while its save is in flight; at exit nothing waits for the daemon writer thread
    and the step is silently never committed (no error anywhere)."""
    import os
    import subprocess
    import sys
    root = str(tmp_path / "ck")
    script = tmp_path / "dropped.py"
    script.write_text(_DROPPED_SCRIPT)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    p = subprocess.run([sys.executable, str(script), root, keep, repo], capture_output=True,
                       text=True, timeout=60, cwd=repo)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "running" in p.stdout, p.stdout  # the save was still in flight at exit
    assert fastckpt.steps(root) == [1], (
        f"{keep}: {p.stdout.strip()}: the async save was lost at exit "
        f"(files: {sorted(os.listdir(os.path.join(root, 'step-0000000001')))})")


class _Interrupt(BaseException):
    """What a signal handler raises (KeyboardInterrupt, SystemExit)."""


def test_a_blocking_zero_copy_save_interrupted_while_gathering_returns_after_its_writes(
        tmp_path, monkeypatch):
    """docs/design.md (Failure cases): a blocking zero-copy save interrupted (Ctrl-C, a signal
    handler that raises) "re-raises only once no write still reads the tensors". That holds
    for an interrupt while ``_write_from_memory`` waits, but not for one during its gather
    loop (core.py ``_write_from_memory``, the ``for piece`` loop; ``_save``'s ``except`` only
    queues the error and re-raises): the pieces already handed to the writer are still (or
    only then) written from the caller's tensor memory after ``save`` raised, so the caller
    that frees or changes its tensors has a writer thread reading them (freed memory: EFAULT,
    or a segfault in the checksum pass)."""
    from fastckpt.engine import core as _core
    from fastckpt.engine import staging as _staging
    monkeypatch.setattr(_staging, "PIECE_MIN_DEFAULT", 2 << 20)  # two 2 MiB pieces
    st = Hung(str(tmp_path / "ck"))
    st.write_s = 1.0  # each shard write reads the tensors 1 s after it starts
    log: list = []
    real_write = st.write_gathered

    def write_gathered(*a, **kw):
        try:
            return real_write(*a, **kw)
        finally:
            log.append(("write_end", time.monotonic()))
    st.write_gathered = write_gathered
    real_gather = _core.gather_piece
    calls = {"n": 0}

    def gather(piece, data, io):
        calls["n"] += 1
        if calls["n"] == 2:  # the interrupt lands while the second piece is gathered
            raise _Interrupt()
        return real_gather(piece, data, io)
    monkeypatch.setattr(_core, "gather_piece", gather)
    ck = fastckpt.Checkpointer(st)
    try:
        state = {"a": torch.ones(1 << 19), "b": torch.ones(1 << 19)}  # 2 MiB each
        with pytest.raises(_Interrupt):
            ck.save(state, step=1, block=True)
        raised = time.monotonic()
        time.sleep(1.5)  # (any write still under way ends now)
        late = [t - raised for what, t in log if what == "write_end"]
        assert not [d for d in late if d > 0], (
            f"a shard write read the caller's tensors {max(late):.2f} s after save() raised")
    finally:
        try:
            ck.close()
        except BaseException:  # noqa: BLE001
            pass


def test_a_write_left_to_its_thread_does_not_hand_its_buffer_to_a_later_save(
        tmp_path, short_bounds, monkeypatch):
    """docs/design.md ("No local call holds a save past its deadline"): a call left to its
    thread "does nothing visible afterwards". A shard write of a capped pool that outlived its
    save's bound still owns its staging buffer; the next save's ``StagingPool.prepare`` puts
    every buffer back in the free queue (that one too), and when the late write returns, its
    ``release`` puts it there a second time. Two pieces of the new save are then staged into
    one buffer while the first is still being written: the new step commits a shard holding
    another piece's bytes (a checksum mismatch on load here; silently wrong where the writer
    hashes, i.e. pieces with CUDA chunks)."""
    from fastckpt.engine import core as _core
    from fastckpt.storage.local import LocalStorage

    first_gate = threading.Event()  # the mount "answers again"
    staged: set = set()
    phase = {"save": 1, "writes": 0}
    cond = threading.Condition()

    class Flaky(LocalStorage):
        def write_shard(self, *a, **kw):
            with cond:
                phase["writes"] += 1
                n, save = phase["writes"], phase["save"]
            if save == 1 and n == 1:
                first_gate.wait(60)  # save 1's first write is stuck past its bound
            elif save == 2 and n == 1:
                first_gate.set()  # the stuck write returns now
                with cond:  # (its buffer's release let the training thread stage piece 4
                    # into the buffer this write is about to write from; fixed: it does not)
                    cond.wait_for(lambda: 4 in staged, timeout=0.5)
            return super().write_shard(*a, **kw)

    real_stage = _core.stage_piece

    def stage(piece, *a, **kw):
        out = real_stage(piece, *a, **kw)
        with cond:
            if phase["save"] == 2:
                staged.add(piece.index)
            cond.notify_all()
        return out
    monkeypatch.setattr(_core, "stage_piece", stage)

    root = str(tmp_path / "ck")
    st = Flaky(root)
    ck = fastckpt.Checkpointer(st, commit_timeout_s=COMMIT_S, staging_cap_bytes=4 << 20)
    try:
        def state(v):  # 6 pieces of 1 MiB, 4 buffers; each piece's rows hold their index
            return {"w": torch.arange(6 * 256, dtype=torch.float32).repeat_interleave(1024)
                    .reshape(6 * 256, 1024) + v}
        with pytest.raises(Exception):
            ck.save(state(0.0), step=1).wait()  # fails by its bound, the write still stuck
        with cond:
            phase["save"], phase["writes"] = 2, 0
        ck.save(state(1000.0), step=2).wait()
        out = {"w": torch.zeros(6 * 256, 1024)}
        assert fastckpt.load(out, root) == 2
        assert torch.equal(out["w"], state(1000.0)["w"])
    finally:
        first_gate.set()
        try:
            ck.close()
        except Exception:  # noqa: BLE001
            pass


def test_staging_that_stops_fails_the_save_by_the_writers_bound(tmp_path, short_bounds,
                                                              monkeypatch):
    """The training thread's copy of the state stops (a device copy that never ends; here the
    uncapped pool's one memcpy, held on an event): the writer fails the save by its own bound
    instead of waiting for the pieces without end (until 2026-12-07 it waited, and committed
    whatever arrived whenever it arrived). The previous step stays, the next save commits."""
    from fastckpt.engine import core as _core
    release = threading.Event()
    real = _core.copy_all

    def stuck(*a, **k):
        release.wait(30)
        return real(*a, **k)
    ck = fastckpt.Checkpointer(str(tmp_path / "ck"), commit_timeout_s=COMMIT_S)
    try:
        state = {"w": torch.arange(1 << 18, dtype=torch.float32)}
        ck.save(state, step=1, block=True)
        monkeypatch.setattr(_core, "copy_all", stuck)
        holder: dict = {}
        th = threading.Thread(target=lambda: holder.update(h=ck.save(state, step=2)),
                              daemon=True)
        th.start()
        time.sleep(COMMIT_S + 3)  # past the writer's bound (COMMIT_S + WRITE_GRACE_S)
        release.set()  # the copy ends late: nothing of it may commit now
        th.join(30)
        assert "h" in holder, "save() never returned"
        with pytest.raises(fastckpt.FastCkptError, match="staging of step 2 handed over nothing"):
            holder["h"].wait(timeout=40)
        monkeypatch.setattr(_core, "copy_all", real)
        assert fastckpt.steps(str(tmp_path / "ck")) == [1]
        ck.save(state, step=3, block=True)
        assert fastckpt.steps(str(tmp_path / "ck")) == [1, 3]
        out = {"w": torch.zeros(1 << 18)}
        fastckpt.load(out, str(tmp_path / "ck"), step=3)
        assert torch.equal(out["w"], state["w"])
    finally:
        release.set()
        ck.close()
