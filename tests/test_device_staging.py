"""The CUDA staging path (fastckpt/engine/device.py): pinned pool buffers, side-stream copies, events.

The build machines have no GPU, so these tests drive the real staging, pool and writer code with
a **simulated** CUDA backend (``SimCuda``): "device" tensors are CPU tensors of one dtype, and a
copy queued on a side stream does not happen when it is queued but when something waits for an
event recorded after it, as on a GPU. A save that let the writer read a buffer before its event,
or let the caller run ahead of the copies, writes wrong bytes here and fails the round trip.
The last test runs the same save on real CUDA when a GPU is present (benchmarks/gpu_check.py
measures it).
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

import fastckpt
from fastckpt.engine import device as _device
from fastckpt.storage.pyio import _address

DEVICE_DTYPE = torch.float32  # the simulated "device" tensors; everything else is host memory


class SimStream:
    def __init__(self, name: str) -> None:
        self.name = name
        self.queued: list = []  # copies not run yet
        self.done = 0  # copies run


class SimEvent:
    def __init__(self, stream: SimStream, upto: int) -> None:
        self.stream, self.upto = stream, upto


class SimCuda:
    """A CUDA backend for CPU tests (see the module docstring). ``lazy``: a stream waiting for
    an event does not run the copies (a GPU whose copy engine is still busy when the writer
    starts); only the writer's host synchronize does."""

    name = "sim"

    def __init__(self, lazy: bool = False, fail_at: int | None = None) -> None:
        self.lazy = lazy
        self.fail_at = fail_at
        self.lock = threading.Lock()
        self.log: list[tuple] = []  # (call, thread name)
        self.registered: dict[int, int] = {}
        self.register_calls = 0
        self.current = SimStream("current")
        self.copies = 0

    def _note(self, what: str) -> None:
        self.log.append((what, threading.current_thread().name))

    def is_device(self, t: torch.Tensor) -> bool:
        return t.dtype == DEVICE_DTYPE

    def register(self, addr: int, nbytes: int) -> None:
        assert addr % 4096 == 0 and addr not in self.registered
        self.registered[addr] = nbytes
        self.register_calls += 1

    def unregister(self, addr: int) -> None:
        del self.registered[addr]

    def current_stream(self, device):
        return self.current

    def new_stream(self, device):
        return SimStream("side")

    def wait_stream(self, stream, other) -> None:
        self._note("wait_stream")

    def _pinned(self, t: torch.Tensor) -> bool:
        a, n = t.data_ptr(), t.untyped_storage().nbytes()
        return any(b <= a and a + t.numel() * t.element_size() <= b + m
                   for b, m in self.registered.items())

    def copy_async(self, dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        assert self._pinned(dst), "a device-to-host copy into unpinned memory"
        self.copies += 1
        if self.fail_at is not None and self.copies == self.fail_at:
            raise RuntimeError("simulated CUDA error in a device-to-host copy")
        with self.lock:  # src is read when the copy runs, not now
            stream.queued.append(
                lambda: dst.copy_(src.contiguous().reshape(-1).view(torch.uint8)))
        self._note("copy")

    def h2d(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        assert self._pinned(src), "a host-to-device copy from unpinned memory"
        self.copies += 1
        with self.lock:  # the buffer is read when the copy runs: after the reader's next read?
            self.current.queued.append(lambda: dst.copy_(src))
        self._note("h2d")

    def record(self, stream):
        with self.lock:
            return SimEvent(stream, stream.done + len(stream.queued))

    def _run(self, ev: SimEvent) -> None:
        with self.lock:
            s = ev.stream
            while s.done < ev.upto:
                s.queued.pop(0)()
                s.done += 1

    def wait_event(self, stream, ev) -> None:
        self._note("wait_event")
        if not self.lazy:  # the caller's later kernels run after the copies
            self._run(ev)

    def synchronize(self, ev) -> None:
        self._note("synchronize")
        self._run(ev)


@pytest.fixture
def sim(monkeypatch):
    def install(**kw):
        b = SimCuda(**kw)
        monkeypatch.setattr(_device, "default_backend", lambda: b)
        return b
    return install


def _state(seed: int, mib: int = 6) -> dict:
    g = torch.Generator().manual_seed(seed)
    n = (mib << 20) // 4
    return {
        "w": torch.randn(n // 1024, 1024, generator=g),  # device
        "wt": torch.randn(256, 300, generator=g).t(),  # device, not contiguous
        "b": torch.randn(17, generator=g),  # device, small
        "ids": torch.randint(0, 1 << 40, (50_000,), generator=g),  # host
        "h": torch.randn(4096, generator=g).to(torch.bfloat16),  # host
    }


def _blank(mib: int = 6) -> dict:
    n = (mib << 20) // 4
    return {"w": torch.zeros(n // 1024, 1024), "wt": torch.zeros(300, 256),
            "b": torch.zeros(17), "ids": torch.zeros(50_000, dtype=torch.int64),
            "h": torch.zeros(4096, dtype=torch.bfloat16)}


def _equal(a: dict, b: dict) -> None:
    for k in a:
        assert torch.equal(a[k], b[k]), k


def _on(log, thread_prefix):
    return [w for w, t in log if t.startswith(thread_prefix)]


@pytest.mark.parametrize("cap", [None, 3 << 20])
def test_device_tensors_staged_on_side_stream(root, sim, cap):
    """Stream mode: the caller's stream waits for the copies (not the host), the caller may
    change the tensors right after save returns, buffers are pinned once and reused."""
    cuda = sim()
    with fastckpt.Checkpointer(root, staging_cap_bytes=cap) as ck:
        pins = None
        save_pins = 0  # registrations by the saves (the loads pin their own read buffers)
        for step in range(3):
            st = _state(step)
            want = {k: v.clone() for k, v in st.items()}
            cuda.log.clear()
            before = cuda.register_calls
            h = ck.save(st, step=step)
            main = _on(cuda.log, "MainThread")
            assert main[0] == "wait_stream" and main.count("wait_stream") == 1
            assert main[-1] == "wait_event" and "synchronize" not in main
            for v in st.values():  # the next step's in-place updates
                v.mul_(-3) if v.is_floating_point() else v.add_(1)
            h.wait()
            save_pins += cuda.register_calls - before
            out = _blank()
            assert fastckpt.load(out, root) == step
            _equal(out, want)
            if pins is None:
                pins = dict(cuda.registered)
            assert cuda.registered == pins  # the same buffers, pinned once
        assert save_pins == len(pins)
        assert sum(pins.values()) == ck._pool.nbytes == ck._stager.pinned_bytes
        if cap is not None:
            assert ck._pool.capped and sum(pins.values()) <= cap + (1 << 20)
    assert cuda.registered == {}  # close() unpins before the buffers are freed


def test_writer_waits_for_the_copy_event(root, sim):
    """The copies finish only when the writer synchronizes on its piece's event: a writer that
    did not wait would write the never-touched (zero) buffer."""
    cuda = sim(lazy=True)
    st = _state(7)
    with fastckpt.Checkpointer(root) as ck:
        ck.save(st, step=1).wait()
    assert "synchronize" in _on(cuda.log, "fastckpt-io")
    assert "synchronize" not in _on(cuda.log, "MainThread")
    out = _blank()
    fastckpt.load(out, root)
    _equal(out, st)


def test_sync_mode_waits_on_the_host(root, sim):
    cuda = sim(lazy=True)
    st = _state(3)
    with fastckpt.Checkpointer(root, cuda_stage="sync") as ck:
        h = ck.save(st, step=1)
        main = _on(cuda.log, "MainThread")
        assert "synchronize" in main and "wait_event" not in main
        assert all(s.queued == [] for s in ck._stager._side.values())  # all copied on return
        for v in st.values():
            v.zero_()
        h.wait()
    out = _blank()
    fastckpt.load(out, root)
    _equal(out, _state(3))


def test_pool_regrows_and_unpins(root, sim):
    cuda = sim()
    with fastckpt.Checkpointer(root) as ck:
        ck.save(_state(1, 2), step=1).wait()
        small = set(cuda.registered)
        ck.save(_state(2, 12), step=2).wait()
        assert set(cuda.registered) == {_address(b) for b in ck._pool._dedicated}
        assert not small & set(cuda.registered)  # the outgrown buffer was unpinned, then freed
        assert sum(cuda.registered.values()) == ck._pool.nbytes > 12 << 20
        big = dict(cuda.registered)
        ck.save(_state(3, 2), step=3).wait()  # smaller again: the big buffer is reused
        assert cuda.registered == big
    assert cuda.registered == {}
    out = _blank(12)
    fastckpt.load(out, root, step=2)
    _equal(out, _state(2, 12))


def test_failed_device_copy_keeps_last_checkpoint(root, sim):
    with fastckpt.Checkpointer(root) as ck:
        cuda = sim()
        ck.save(_state(1), step=1).wait()
        cuda.fail_at = cuda.copies + 2  # the second copy of the next save fails
        with pytest.raises(RuntimeError, match="simulated CUDA error"):
            ck.save(_state(2), step=2)
        assert _on(cuda.log, "MainThread")[-1] == "synchronize"  # queued copies drained
        with pytest.raises(fastckpt.FastCkptError, match="staging failed"):
            ck.wait()
        assert ck.latest_step() == 1
        cuda.fail_at = None
        ck.save(_state(3), step=3).wait()
    out = _blank()
    assert fastckpt.load(out, root, step=1) == 1
    _equal(out, _state(1))
    assert fastckpt.load(out, root) == 3
    _equal(out, _state(3))


def test_a_sticky_device_error_fails_the_save_without_a_hang(root, sim, monkeypatch):
    """A device-side fault is sticky: every later CUDA call fails. Before 2026-12-06 (a) the
    stager's abort raised before the writer heard of the failure, so the next save waited
    for good; (b) with a capped pool the writer's failed event wait kept the piece's buffer,
    and the training thread waited for a buffer for good."""
    import threading
    cuda = sim()
    broken = {"on": False}
    real_copy, real_record, real_sync = cuda.copy_async, cuda.record, cuda.synchronize

    def copy_async(dst, src, stream):
        if broken["on"] and cuda.copies >= 1:
            broken["sticky"] = True
            raise RuntimeError("CUDA error: an illegal memory access (simulated)")
        return real_copy(dst, src, stream)

    def sticky(real):
        def call(*a):
            if broken.get("sticky"):
                raise RuntimeError("CUDA error: an illegal memory access (simulated, sticky)")
            return real(*a)
        return call
    monkeypatch.setattr(cuda, "copy_async", copy_async)
    monkeypatch.setattr(cuda, "record", sticky(real_record))
    monkeypatch.setattr(cuda, "synchronize", sticky(real_sync))
    with fastckpt.Checkpointer(root) as ck:
        broken["on"] = True
        with pytest.raises(RuntimeError, match="illegal memory access"):
            ck.save(_state(1), step=1)
        broken.clear()
        done, got = threading.Event(), {}

        def next_save():
            try:  # the failure of save 1, not yet observed, is raised here, then save 2 goes
                ck.save({"c": torch.arange(10)}, step=2, block=True)
            except fastckpt.FastCkptError as e:
                got["first"] = e
                ck.save({"c": torch.arange(10)}, step=2, block=True)
            done.set()
        threading.Thread(target=next_save, daemon=True).start()
        assert done.wait(30), "the next save waited for the failed one for good"
        assert ck.steps() == [2]

    # (b) a capped pool: the writer's wait for the copies of a piece fails
    root2 = os.path.join(root, "capped")
    cuda2 = sim()
    real_sync2 = cuda2.synchronize

    def sync_fails_in_the_writer(ev):
        if threading.current_thread().name.startswith("fastckpt"):
            raise RuntimeError("CUDA error: an illegal memory access (simulated)")
        return real_sync2(ev)
    monkeypatch.setattr(cuda2, "synchronize", sync_fails_in_the_writer)
    out: dict = {}

    def capped():
        try:
            with fastckpt.Checkpointer(root2, staging_cap_bytes=2 << 20) as ck:
                ck.save(_state(1), step=1).wait(30)
        except BaseException as e:  # noqa: BLE001
            out["err"] = e
    t = threading.Thread(target=capped, daemon=True)
    t.start()
    t.join(40)
    assert not t.is_alive(), "the capped save waited for a buffer for good"
    assert "illegal memory access" in str(out.get("err"))


def test_cuda_stage_option_is_checked():
    with pytest.raises(ValueError, match="cuda_stage"):
        fastckpt.CheckpointOptions(cuda_stage="async")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (none on the build VMs)")
def test_real_cuda_round_trip(root):
    st = {k: (v.cuda() if v.dtype == DEVICE_DTYPE else v) for k, v in _state(5).items()}
    with fastckpt.Checkpointer(root) as ck:
        for step in range(2):
            h = ck.save(st, step=step)
            for v in st.values():
                if v.is_cuda:
                    v.mul_(2)  # queued after the copies on the current stream
            h.wait()
        assert ck._stager is not None and ck._stager.pinned_bytes == ck._pool.nbytes
    out = _blank()
    fastckpt.load(out, root)
    want = {k: (v.cuda() * 2 if v.dtype == DEVICE_DTYPE else v) for k, v in _state(5).items()}
    _equal(out, {k: v.cpu() for k, v in want.items()})


def test_load_into_device_tensors_from_pinned_buffers(root, sim, monkeypatch):
    """Many spans through the reader's 4 buffers: a buffer read into again before its copies
    ran, or a load returning before they ran, leaves wrong bytes in the targets."""
    st = _state(11, 24)
    with fastckpt.Checkpointer(root, staging_cap_bytes=8 << 20) as ck:  # ~12 files of 2 MiB
        ck.save(st, step=1).wait()
    import fastckpt.engine.reader as reader
    monkeypatch.setattr(reader, "SPAN_MAX", 2 << 20)
    cuda = sim()
    out = _blank(24)
    assert fastckpt.load(out, root) == 1
    _equal(out, st)
    assert cuda.copies >= 12 and _on(cuda.log, "MainThread").count("h2d") == cuda.copies
    assert any(w == "synchronize" for w, t in cuda.log if t.startswith("fastckpt-reader"))
    assert cuda.registered == {}  # unpinned after the load


def test_blocking_save_of_device_tensors_uses_the_pinned_pool(root, sim):
    """A blocking (one-off) save is zero-copy for CPU tensors; device tensors must reach host
    memory anyway, so it stages them through the pinned, capped pool on the side stream."""
    cuda = sim(lazy=True)
    st = _state(13, 12)
    fastckpt.save(st, root, step=5)
    assert _on(cuda.log, "MainThread").count("copy") == 3 and cuda.register_calls >= 1
    assert cuda.registered == {}  # the one-off checkpointer's pool was unpinned at close
    out = _blank(12)
    assert fastckpt.load(out, root) == 5
    _equal(out, st)


def test_a_failure_ordering_the_caller_after_the_copies_fails_the_save(root, sim, monkeypatch):
    """``end_save`` (the caller's stream waits for the copies) raising: the save raises and
    nothing commits. Before 2026-12-06 an uncapped pool handed its pieces to the writer before
    that call, so the save raised on the caller and committed in the background all the same
    (its error queued after the last piece, where the writer never reads)."""
    with fastckpt.Checkpointer(root) as ck:
        cuda = sim()
        ck.save(_state(1), step=1).wait()

        def fails(stream, ev):
            raise RuntimeError("simulated CUDA error ordering the caller's stream")
        monkeypatch.setattr(cuda, "wait_event", fails)
        with pytest.raises(RuntimeError, match="ordering the caller"):
            ck.save(_state(2), step=2)
        with pytest.raises(fastckpt.FastCkptError, match="staging failed"):
            ck.wait()
        assert ck.latest_step() == 1
        monkeypatch.undo()
    out = _blank()
    assert fastckpt.load(out, root) == 1
    _equal(out, _state(1))
