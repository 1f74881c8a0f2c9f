"""Staging pieces and the reusable buffer pool (capped and uncapped)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastckpt
from fastckpt.engine.staging import StagingPool, split
from tests.crash_worker import blank, state_for


def _manifest(root, step):
    return json.load(open(os.path.join(root, f"step-{step:010d}", "manifest.json")))["body"]


def test_split_packs_and_splits_rows():
    from fastckpt.engine.plan import ChunkSpec
    big = ChunkSpec("w", "float32", (100, 1000), (0, 0), (100, 1000), 400_000, False)
    small = ChunkSpec("b", "float32", (10,), (0,), (10,), 40, False)
    row = ChunkSpec("r", "float32", (1, 300_000), (0, 0), (1, 300_000), 1_200_000, False)
    pieces = split([small, big, row], 150_000)
    boxes = [(s.spec.fqn, s.spec.offsets, s.spec.sizes) for p in pieces for s in p.slots]
    assert boxes[0] == ("b", (0,), (10,))
    w_rows = [(o[0], sz[0]) for f, o, sz in boxes if f == "w"]
    assert w_rows == [(0, 37), (37, 37), (74, 26)]  # 37 rows of 4000 bytes fit in 150000
    assert ("r", (0, 0), (1, 300_000)) in boxes  # one row larger than a piece: its own piece
    for p in pieces:
        assert p.size <= 150_000 or len(p.slots) == 1


@pytest.mark.parametrize("cap", [None, 3 << 20, 0])
def test_round_trip_with_pieces(root, cap):
    st = state_for(4, 12)  # 12 MiB in one tensor
    with fastckpt.Checkpointer(root, staging_cap_bytes=cap) as ck:
        ck.save(st, step=4).wait()
        pool = ck._pool.nbytes
    body = _manifest(root, 4)
    if cap is None:
        assert len(body["files"]) == 1
    else:  # pieces of at most cap/2 (1 MiB minimum): the big tensor is split along dim 0
        assert len(body["files"]) >= 6
        assert len(body["tensors"]["w"]["chunks"]) >= 6
        assert pool <= max(cap, 2 << 20) + (64 << 10)
    out = blank(12)
    assert fastckpt.load(out, root) == 4
    assert torch.equal(out["w"], st["w"]) and torch.equal(out["h"], st["h"])


def test_pool_is_reused_across_saves(root):
    with fastckpt.Checkpointer(root) as ck:
        ck.save(state_for(1, 4), step=1).wait()
        bufs = [id(b) for b in ck._pool._dedicated]
        for s in range(2, 6):
            ck.save(state_for(s, 4), step=s).wait()
        assert [id(b) for b in ck._pool._dedicated] == bufs
    out = blank(4)
    assert fastckpt.load(out, root) == 5 and torch.equal(out["w"], state_for(5, 4)["w"])


def test_capped_pool_failure_does_not_hang(tmpfs):
    root = os.path.join(tmpfs("size=5m"), "ckpt")
    with fastckpt.Checkpointer(root, staging_cap_bytes=2 << 20) as ck:
        with pytest.raises(fastckpt.SaveFailedError, match="device is full"):
            ck.save(state_for(1, 12), step=1).wait()  # 12 MiB through 1 MiB pieces
        ck.save(state_for(2, 1), step=2).wait()  # the pool still works afterwards
    out = blank(1)
    assert fastckpt.load(out, root) == 2


def test_pool_capped_mode_bounds_buffers():
    pool = StagingPool()
    pool.prepare([1 << 20] * 10, cap=3 << 20)
    assert pool.capped and pool.nbytes == 3 << 20
    a = pool.acquire(0)
    pool.acquire(1)
    pool.acquire(2)
    assert pool._free.empty()  # a fourth piece would wait for the writer to release one
    pool.release(a)
    from fastckpt.storage.pyio import _address
    b = pool.acquire(3)  # the same buffer, lent as a view of its own
    assert _address(b) == _address(a) and b is not a
    pool.release(a)  # (a view given back twice: nothing)
    assert pool._free.empty()
    pool.prepare([1 << 20] * 10, cap=3 << 20)  # the next save: views of the last are not taken
    pool.release(b)
    assert pool._free.qsize() == 3
    pool.prepare([1 << 20] * 3, cap=None)
    assert not pool.capped and pool.nbytes == 3 << 20


def test_state_with_only_empty_tensors(root):
    st = {"e": torch.empty(0, 5), "z": torch.zeros(0, dtype=torch.int64), "n": 1}
    fastckpt.save(st, root, step=1)
    out = {"e": torch.ones(0, 5), "z": torch.ones(0, dtype=torch.int64), "n": 0}
    assert fastckpt.load(out, root) == 1 and out["n"] == 1 and out["e"].shape == (0, 5)


def test_fused_staging_matches_plain_staging():
    """stage_piece with an I/O backend (capped pool, one-off saves) copies the same bytes as the
    torch copy and returns the chunks' xxh3, for contiguous, strided and row-split tensors."""
    import xxhash

    from fastckpt.storage import native as _native
    from fastckpt.engine.plan import local_chunks as _local_chunks
    from fastckpt.engine.staging import stage_piece

    g = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(300, 500, generator=g),
               "t": torch.randn(400, 300, generator=g).t(),  # strided
               "i": torch.arange(10, dtype=torch.int16), "e": torch.empty(0)}
    chunks, data = _local_chunks(tensors)
    pieces = split(chunks, 200_000)  # "a" (600 kB) is split by rows
    for be in ["python"] + (["native"] if _native.native_available() else []):
        io = _native.get_backend("off" if be == "python" else "require")
        for p in pieces:
            plain, fused = _native.aligned_buffer(p.size + 64), _native.aligned_buffer(p.size + 64)
            fused[:] = b"\xff" * len(fused)  # gaps must be zeroed, not left as they were
            assert stage_piece(p, plain, data) is None
            hashes = stage_piece(p, fused, data, io)
            assert bytes(fused[:p.size]) == bytes(plain[:p.size]), be
            assert hashes == [xxhash.xxh3_64_intdigest(bytes(plain[s.offset:s.offset + s.spec.nbytes]))
                              for s in p.slots], be


def test_split_small_first_piece_covers_every_row():
    """A streamed save's first piece is small (the first write starts early); every row of a
    split tensor still lands in exactly one piece."""
    from fastckpt.engine.plan import ChunkSpec
    big = ChunkSpec("w", "float32", (100, 1000), (0, 0), (100, 1000), 400_000, False)
    pieces = split([big], 150_000, first=40_000)
    assert pieces[0].size <= 40_000 and all(p.size <= 150_000 for p in pieces)
    rows = [(s.spec.offsets[0], s.spec.sizes[0]) for p in pieces for s in p.slots]
    assert rows[0] == (0, 10) and rows[1] == (10, 37)
    assert sum(n for _, n in rows) == 100
    assert all(a + n == b for (a, n), (b, _) in zip(rows, rows[1:]))


def _mixed_state():
    g = torch.Generator().manual_seed(5)
    return {"big": torch.randn(700, 1000, generator=g),  # 2.8 MB: split by rows below
            "odd": torch.randn(300_007, generator=g)[3:],  # 1.2 MB, 12 bytes into a page
            "bf": torch.randn(600, 600, generator=g).to(torch.bfloat16),
            "strided": torch.randn(800, 400, generator=g).t(),
            "small": torch.arange(100, dtype=torch.int32), "empty": torch.empty(0, 3),
            "meta": {"lr": 0.5}}


def _blank_like(st):
    return {k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else {"lr": 0.0})
            for k, v in st.items()}


@pytest.mark.parametrize("native", ["off", "require"])
def test_zero_copy_save_round_trip(tmp_path, native, monkeypatch):
    """A blocking save writes large contiguous tensors straight from memory (their file offset
    in phase with their address); everything else goes through the bounce buffer. The result
    loads bit-exact and passes verify."""
    from fastckpt import tools
    from fastckpt.storage import native as _native
    from fastckpt.engine.staging import PIECE_MIN_DEFAULT
    if native == "require" and not _native.native_available():
        pytest.skip("native extension not built")
    monkeypatch.setattr("fastckpt.engine.staging.PIECE_MIN_DEFAULT", 2 << 20)  # several pieces
    assert PIECE_MIN_DEFAULT  # (the module constant is what piece_bytes reads)
    st = _mixed_state()
    root = str(tmp_path / "ck")
    with fastckpt.Checkpointer(root, native=native) as ck:
        h = ck.save(st, step=3, block=True)
        assert h.committed and ck._pool.nbytes == 0  # nothing was staged
    body = _manifest(root, 3)
    assert len(body["files"]) >= 2
    phased = 0
    for fqn in ("big", "odd"):
        for c in body["tensors"][fqn]["chunks"]:
            if c["length"] < (1 << 20):  # small chunks are staged, at 64-byte offsets
                continue
            phased += 1
            rows_before = c["offsets"][0]
            t = st[fqn]
            addr = t.data_ptr() + rows_before * (t.nbytes // max(1, t.shape[0]))
            assert (c["offset"] - addr) % 4096 == 0, (fqn, c)
    assert phased >= 1
    out = _blank_like(st)
    assert fastckpt.load(out, root) == 3
    for k, v in st.items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(out[k], v), k
    assert out["meta"] == {"lr": 0.5}
    assert tools.verify_step(root, 3).ok


def test_zero_copy_files_match_staged_bytes(tmp_path):
    """Both backends write the same bytes for a zero-copy save (the layout depends only on the
    tensors' addresses), and the bytes of each chunk are the tensor's."""
    from fastckpt.storage import native as _native
    from fastckpt.engine.plan import local_chunks as _local_chunks
    from fastckpt.engine.staging import gather_piece, stage_piece

    st = {k: v for k, v in _mixed_state().items() if isinstance(v, torch.Tensor)}
    chunks, data = _local_chunks(st)
    phase = {k: t.data_ptr() % 4096 for k, t in data.items() if t.is_contiguous()}
    pieces = split(chunks, 2 << 20, phase=phase)
    backends = [_native.PythonBackend()] + ([_native.NativeBackend()]
                                            if _native.native_available() else [])
    for p in pieces:
        ref = _native.aligned_buffer(p.size)
        stage_piece(p, ref, data)  # the staged layout of the same piece: the expected bytes
        outs = []
        for be in backends:
            g = gather_piece(p, data, be)
            path = tmp_path / f"{be.name}-{p.index}"
            hashes = be.write_segments(str(path), p.size, g.segments, g.hash_ranges)
            outs.append(path.read_bytes())
            assert outs[-1] == bytes(ref[:p.size]), be.name
            assert hashes == [_native.PythonBackend().hash(ref[s.offset:s.offset + s.spec.nbytes],
                                                           s.spec.nbytes) for s in p.slots]
    # the 2.8 MB tensor's first 2 MiB-piece row range is written from its memory
    assert gather_piece(pieces[0], data, backends[0]).direct_bytes >= 1 << 20


@pytest.mark.parametrize("native", ["off", "require"])
@pytest.mark.parametrize("threads", [1, 3])
def test_async_staging_copy_many(tmp_path, native, threads, monkeypatch):
    """An async save's staging copy goes through one ``copy_many`` of every contiguous CPU
    slot (strided, empty and row-split tensors around it), and the checkpoint loads bit-exact;
    a later save after the state changed stores the new bytes (the pool is reused)."""
    from fastckpt.storage import native as _native
    if native == "require" and not _native.native_available():
        pytest.skip(_native.native_error())
    monkeypatch.setenv("FASTCKPT_NATIVE", native)
    calls = []
    import fastckpt.engine.core as core
    real = core.copy_all

    def spy(io, copies, n):
        calls.append((len(copies), sum(c[2] for c in copies), n))
        return real(io, copies, n)
    monkeypatch.setattr(core, "copy_all", spy)
    st = _mixed_state()
    root = str(tmp_path / "ck")
    with fastckpt.Checkpointer(root, copy_threads=threads) as ck:
        ck.save(st, step=1).wait()
        before = {k: v.clone() for k, v in st.items() if isinstance(v, torch.Tensor)}
        st["big"].add_(1)
        ck.save(st, step=2).wait()
    contiguous = sum(v.nbytes for v in st.values()
                     if isinstance(v, torch.Tensor) and v.is_contiguous())
    assert [c[1:] for c in calls] == [(contiguous, threads)] * 2
    assert all(c[0] >= 4 for c in calls)  # big (in rows), odd, bf, small
    for step, want in [(1, {**st, **before}), (2, st)]:
        out = _blank_like(st)
        assert fastckpt.load(out, root, step=step) == step
        for k, v in want.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(out[k], v), (step, k)


def test_copy_threads_option():
    from fastckpt.engine.staging import copy_threads
    assert copy_threads(3) == 3
    assert 1 <= copy_threads(None) <= 16 and copy_threads(None) == min(16, torch.get_num_threads())
    from fastckpt.options import CheckpointOptions
    for bad in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match="copy_threads"):
            CheckpointOptions(copy_threads=bad)


# ------------------------------------------------------- interrupted and failed staging

class _SlowDisk:
    """A local root whose shard writes start ``delay`` seconds late (a slow disk)."""

    @staticmethod
    def open(root: str, delay: float):
        import time
        from fastckpt.storage.local import LocalStorage
        from fastckpt.testing.faults import FaultyStorage

        class Slow(FaultyStorage):
            def write_gathered(self, *a, **kw):
                time.sleep(self._shared.get("delay", 0.0))
                return super().write_gathered(*a, **kw)
        st = Slow(LocalStorage(root))
        st._shared["delay"] = delay
        return st


class _Interrupt(BaseException):
    """What a signal handler raises (KeyboardInterrupt, SystemExit)."""


def test_an_interrupted_blocking_save_commits_nothing(tmp_path):
    """A blocking zero-copy save writes from the tensors' memory; interrupted while it waits,
    it must not commit (the caller goes on and changes the tensors) and must not return while
    a write still reads them. Before 2026-12-06 it committed a step holding the caller's
    later bytes, whose checksums failed, and keep_last=1 had removed the good step."""
    import signal
    import threading
    root = str(tmp_path / "r")
    st = _SlowDisk.open(root, 0.0)
    w = torch.full((1 << 20,), 1.0)
    ck = fastckpt.Checkpointer(st, keep_last=1)
    ck.save({"w": w}, step=0, block=True)
    st._shared["delay"] = 1.0

    def interrupt(*_):
        raise _Interrupt()
    old = signal.signal(signal.SIGUSR2, interrupt)
    try:
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGUSR2)).start()
        with pytest.raises(_Interrupt):
            ck.save({"w": w}, step=1, block=True)
    finally:
        signal.signal(signal.SIGUSR2, old)
    w.fill_(2.0)  # the caller goes on
    ck.close()  # (the interrupt was the call's outcome: not raised again)
    assert fastckpt.steps(root) == [0]
    out = {"w": torch.zeros(1 << 20)}
    assert fastckpt.load(out, root) == 0 and bool((out["w"] == 1.0).all())


def test_a_failed_pool_allocation_does_not_break_later_saves(root, monkeypatch):
    # before 2026-12-06 the pool kept a None where the buffer was, and every later save of
    # the Checkpointer raised TypeError
    with fastckpt.Checkpointer(root) as ck:
        ck.save({"w": torch.ones(1000)}, step=1).wait()
        real = StagingPool._new
        fail = {"n": 1}

        def new(self, n):
            if fail["n"]:
                fail["n"] -= 1
                raise MemoryError("injected: no memory for the staging buffer")
            return real(self, n)
        monkeypatch.setattr(StagingPool, "_new", new)
        with pytest.raises(MemoryError):
            ck.save({"w": torch.ones(1 << 20)}, step=2)
        for step in (3, 4):
            ck.save({"w": torch.full((1 << 20,), float(step))}, step=step).wait()
    assert fastckpt.steps(root) == [1, 3, 4]
