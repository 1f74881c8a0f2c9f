"""Corruption, bad input, unwritable roots and full disks: clear errors, nothing lost."""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt.engine import dist as _dist
from fastckpt.engine.commit import commit
from tests.crash_worker import blank, state_for
from tests.models import mlp


def _shard(root, step):
    d = os.path.join(root, f"step-{step:010d}")
    body = json.load(open(os.path.join(d, "manifest.json")))["body"]
    return d, body


# ------------------------------------------------------------------------------------ corruption

def test_flipped_byte_in_shard_names_file_tensor_offset(root):
    fastckpt.save(state_for(1, 2), root, step=1)
    d, body = _shard(root, 1)
    c = body["tensors"]["w"]["chunks"][0]
    path = os.path.join(d, c["file"])
    with open(path, "r+b") as f:
        f.seek(c["offset"] + 12345)
        b = f.read(1)
        f.seek(c["offset"] + 12345)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(fastckpt.CorruptCheckpointError) as ei:
        fastckpt.load(blank(2), root)
    msg = str(ei.value)
    assert c["file"] in msg and "'w'" in msg and f"offset {c['offset']}" in msg
    assert "checksum mismatch" in msg
    assert ei.value.key == "w" and ei.value.offset == c["offset"]
    # with verification off the damaged bytes load (the user asked for it)
    st = blank(2)
    assert fastckpt.load(st, root, verify=False) == 1


def test_truncated_shard_is_detected(root):
    fastckpt.save(state_for(1, 2), root, step=1)
    d, body = _shard(root, 1)
    name, info = next(iter(body["files"].items()))
    os.truncate(os.path.join(d, name), info["size"] - 100)
    with pytest.raises(fastckpt.CorruptCheckpointError, match="truncated") as ei:
        fastckpt.load(blank(2), root)
    assert name in str(ei.value)


@pytest.mark.parametrize("damage", ["truncate", "flip", "empty"])
def test_damaged_manifest_is_detected(root, damage, caplog):
    fastckpt.save(state_for(1, 1), root, step=1)
    fastckpt.save(state_for(2, 1), root, step=2)
    path = os.path.join(root, "step-0000000002", "manifest.json")
    data = bytearray(open(path, "rb").read())
    if damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "flip":
        i = data.index(b'"length": ') + len('"length": ')
        data[i] = ord("9") if data[i] != ord("9") else ord("8")  # still valid JSON
    else:
        data = bytearray()
    open(path, "wb").write(bytes(data))
    # asked for by number: the error names the manifest
    with pytest.raises(fastckpt.CorruptCheckpointError) as ei:
        fastckpt.load(blank(1), root, step=2)
    assert "manifest.json" in str(ei.value) and "step-0000000002" in str(ei.value)
    # the newest: one bad step does not stop a resume; it is skipped loudly, naming it
    st = blank(1)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        assert fastckpt.load(st, root) == 1
    assert torch.equal(st["w"], state_for(1, 1)["w"])
    assert any("skipping step 2" in r.getMessage() and "step-0000000002" in r.getMessage()
               for r in caplog.records)


# ------------------------------------------------------------------------------------- bad input

class Opaque:
    pass


@pytest.mark.parametrize("bad,where", [
    ({"a": {"b": [1, Opaque()]}}, "a.b.1"),
    ({"x": object()}, "x"),
    ({"s": {1, 2}}, "s"),
    ({"b": b"bytes"}, "b"),
    ({"t": torch.zeros(3).to_sparse()}, "t"),
])
def test_unsupported_objects_fail_before_writing(root, bad, where):
    fastckpt.save(state_for(1, 1), root, step=1)
    before = sorted(os.listdir(root))
    with pytest.raises(fastckpt.UnsupportedStateError) as ei:
        fastckpt.save({"ok": torch.ones(2), **bad}, root, step=2)
    assert isinstance(ei.value, TypeError)
    assert repr(where) in str(ei.value) or f"tensor {where!r}" in str(ei.value)
    assert sorted(os.listdir(root)) == before


def test_state_must_be_a_dict(root):
    with pytest.raises(TypeError, match="state must be a dict"):
        fastckpt.save([torch.ones(1)], root, step=0)


def test_missing_key_shape_and_dtype_mismatch(root):
    m = mlp(0)
    fastckpt.save({"model": m, "step": 1}, root, step=1)
    with pytest.raises(fastckpt.StateMismatchError, match="missing from the checkpoint") as ei:
        fastckpt.load({"model": mlp(1), "step": 0, "extra": torch.zeros(2)}, root)
    assert ei.value.key == "extra"
    with pytest.raises(fastckpt.StateMismatchError, match="shape mismatch") as ei:
        fastckpt.load({"model": mlp(1, width=34), "step": 0}, root)
    assert ei.value.key == "model.0.weight"
    with pytest.raises(fastckpt.StateMismatchError, match="dtype mismatch"):
        fastckpt.load({"model": mlp(1).double(), "step": 0}, root)
    # non-strict loading leaves extra destination keys alone
    st = {"model": mlp(1), "step": 0, "extra": torch.zeros(2)}
    assert fastckpt.load(st, root, strict=False) == 1
    assert torch.equal(st["model"][0].weight, m[0].weight)


def test_empty_and_missing_roots(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(fastckpt.CheckpointNotFoundError, match="no committed checkpoint"):
        fastckpt.load(blank(1), str(empty))
    with fastckpt.Checkpointer(str(tmp_path / "never-created")) as ck:
        assert ck.resume(blank(1)) is None
    (empty / "step-0000000004").mkdir()
    with pytest.raises(fastckpt.CheckpointNotFoundError, match="1 step directories, none"):
        fastckpt.load(blank(1), str(empty))
    with pytest.raises(fastckpt.CheckpointNotFoundError, match="step 3"):
        fastckpt.load(blank(1), str(empty), step=3)


def test_unwritable_root(tmp_path):
    f = tmp_path / "a-file"
    f.write_text("x")
    with pytest.raises(fastckpt.StorageError) as ei:
        fastckpt.save(state_for(1, 1), str(f / "ckpt"), step=1)
    assert "a-file" in str(ei.value)


@pytest.fixture
def small_fs(tmpfs):
    return tmpfs("size=6m")


@pytest.fixture
def readonly_fs(tmpfs):
    return tmpfs("size=1m,ro")


def test_read_only_root(readonly_fs):
    with pytest.raises(fastckpt.StorageError, match="read-only") as ei:
        fastckpt.save(state_for(1, 1), readonly_fs, step=1)
    assert readonly_fs in str(ei.value)


def test_full_disk_keeps_previous_checkpoint(small_fs):
    root = os.path.join(small_fs, "ckpt")
    fastckpt.save(state_for(1, 1), root, step=1)
    with fastckpt.Checkpointer(root) as ck:
        h = ck.save(state_for(2, 8), step=2)  # 8 MiB into what is left of 6 MiB
        with pytest.raises(fastckpt.SaveFailedError) as ei:
            h.wait()
    msg = str(ei.value)
    assert "device is full" in msg and "rank 0" in msg and ".fck" in msg
    assert isinstance(ei.value.__cause__, fastckpt.StorageError)
    st = blank(1)
    assert fastckpt.load(st, root) == 1 and torch.equal(st["w"], state_for(1, 1)["w"])
    # the failed attempt's partial shard is removed by the next successful commit
    fastckpt.save(state_for(3, 1), root, step=3)
    assert sorted(os.listdir(root)) == ["latest", "step-0000000001", "step-0000000003"]


# ------------------------------------------------------------------------- background failures

def test_background_failure_surfaces_on_next_save_and_close(small_fs):
    root = os.path.join(small_fs, "ckpt")
    ck = fastckpt.Checkpointer(root)
    ck.save(state_for(1, 8), step=1)  # fails in the background; nobody waits
    with pytest.raises(fastckpt.SaveFailedError):
        ck.save(state_for(2, 1), step=2)
    h = ck.save(state_for(3, 1), step=3)
    h.wait()
    ck.save(state_for(4, 8), step=4)
    with pytest.raises(fastckpt.SaveFailedError):
        ck.close()
    ck.close()  # idempotent


def test_handle_states(root):
    with fastckpt.Checkpointer(root) as ck:
        h = ck.save(state_for(1, 4), step=1)
        assert h.staged
        h.wait()
        assert h.committed and h.done() and h.exception() is None
        assert "committed" in repr(h)
    with pytest.raises(ValueError, match="non-negative int"):
        fastckpt.save(state_for(1, 1), root, step=-1)
    with pytest.raises(ValueError, match="keep_last"):
        fastckpt.Checkpointer(root, keep_last=0)


# ------------------------------------------------------------- the commit protocol, with threads

def _run_commit_threads(world, results, deadline_s, coordinator=lambda res: {"n": len(res)},
                        skip=()):
    ex = _dist.Exchange()  # no process group: an in-process exchange
    out = {}

    def one(r):
        try:
            out[r] = commit(ex, save_id="s1", rank=r, world_size=world, result=results[r],
                            deadline=time.monotonic() + deadline_s, coordinator=coordinator)
        except Exception as e:  # noqa: BLE001
            out[r] = e
    threads = [threading.Thread(target=one, args=(r,)) for r in range(world) if r not in skip]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, time.monotonic() - t0


def test_commit_all_ok():
    out, _ = _run_commit_threads(3, [{"ok": True}] * 3, 5)
    assert all(o == {"ok": True, "n": 3} for o in out.values())


def test_commit_names_failing_ranks():
    res = [{"ok": True}, {"ok": False, "error": "disk full"}, {"ok": False, "error": "EIO"}]
    out, _ = _run_commit_threads(3, res, 5)
    for o in out.values():
        assert isinstance(o, fastckpt.SaveFailedError)
        assert o.failures == {1: "disk full", 2: "EIO"}
        assert "rank 1: disk full" in str(o) and "rank 2: EIO" in str(o)


def test_commit_missing_rank_times_out_in_bounded_time():
    out, took = _run_commit_threads(3, [{"ok": True}] * 3, 1.0, skip=(2,))
    assert 0.9 <= took < 1 + 5  # bounded: the deadline plus scheduling slack on a busy machine
    for r in (0, 1):
        assert isinstance(out[r], fastckpt.CommitTimeoutError) and out[r].missing_ranks == [2]


def test_commit_coordinator_failure_reaches_everyone():
    def boom(_):
        raise OSError(28, "No space left on device")
    out, _ = _run_commit_threads(2, [{"ok": True}] * 2, 5, coordinator=boom)
    assert all(isinstance(o, fastckpt.SaveFailedError) for o in out.values())
    assert isinstance(out[0].__cause__, OSError)
    assert "commit failed" in str(out[1])


def test_store_exchange_waits_do_not_block_other_threads():
    """A commit waiting on its peers must not hold the shared c10d client (the preemption
    watcher uses it at the same time)."""
    from datetime import timedelta

    import torch.distributed as dist
    from tests.distributed import free_port
    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    ex = _dist.Exchange(store=store)
    t = threading.Thread(target=ex.wait, args=(["never"], time.monotonic() + 3.0))
    t.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    ex.set("x", b"1")
    found, missing = ex.wait(["x"], time.monotonic() + 5.0)
    took = time.monotonic() - t0
    t.join()
    assert found == {"x": b"1"} and not missing
    assert took < 1.0, took  # not after the other thread's 3 s wait


class _SlowReader(_dist.Exchange):
    """An in-process exchange where rank 1 (thread "r1") is slow to read the verdict."""

    def __init__(self):
        super().__init__()
        self.read_at: float | None = None

    def wait(self, keys, deadline):
        slow = threading.current_thread().name == "r1" and keys[0].endswith("/outcome")
        if slow:
            time.sleep(0.5)
        found, missing = super().wait(keys, deadline)
        if slow:
            self.read_at = time.monotonic()
        return found, missing


def test_coordinator_stays_until_the_verdict_was_read():
    """Rank 0 hosts the store: if it returned (and its job exited) before the others read the
    decision, they could not know the step was committed."""
    ex = _SlowReader()
    done = {}

    def one(r):
        done[r] = commit(ex, save_id="s1", rank=r, world_size=2, result={"ok": True},
                         deadline=time.monotonic() + 10, coordinator=lambda res: {})
        done[f"t{r}"] = time.monotonic()
    ts = [threading.Thread(target=one, args=(r,), name=f"r{r}") for r in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert done[0] == done[1] == {"ok": True}
    assert done["t0"] >= ex.read_at
    assert not ex._local  # every key was deleted


def _exit_right_after_save(rank, world, root):
    if rank == 1:  # slow to read rank 0's verdict, as a loaded rank is
        slow = _dist.Exchange.wait

        def wait(self, keys, deadline):
            if keys and keys[0].endswith("/outcome"):
                time.sleep(1.0)
            return slow(self, keys, deadline)
        _dist.Exchange.wait = wait
    fastckpt.save(state_for(1, 1), root, step=1)  # rank 0 then exits: its store goes
    return True


def test_rank0_exiting_after_its_last_save_does_not_fail_the_others(root):
    from tests.distributed import run
    assert run(_exit_right_after_save, 2, root, timeout=60) == [True, True]
    from fastckpt.tools.verify import verify_step
    res = verify_step(root, record=False)
    assert res.step == 1 and not res.problems and res.save_id


def _gather_then_exit(rank, world, root):
    if rank == 1:  # slow to read the values, as a loaded rank is
        slow = _dist.Exchange.wait

        def wait(self, keys, deadline):
            time.sleep(1.0)
            return slow(self, keys, deadline)
        _dist.Exchange.wait = wait
    # rank 0 returns (then its process exits, and the store with it) as soon as it has read
    return _dist.Group(name="exit-test").gather(rank * 10, timeout_s=30, what="test gather")


def test_rank0_leaving_after_a_gather_does_not_fail_the_others():
    from tests.distributed import run
    assert run(_gather_then_exit, 2, None, timeout=60) == [[0, 10], [0, 10]]
