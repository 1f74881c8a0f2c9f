"""Staging pieces and the reusable buffer pool (capped and uncapped)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastckpt
from fastckpt.staging import StagingPool, split
from tests.crash_worker import blank, state_for


def _manifest(root, step):
    return json.load(open(os.path.join(root, f"step-{step:010d}", "manifest.json")))["body"]


def test_split_packs_and_splits_rows():
    from fastckpt.checkpointer import ChunkSpec
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
    assert pool.acquire(3) is a
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

    from fastckpt import _native
    from fastckpt.checkpointer import _local_chunks
    from fastckpt.staging import stage_piece

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
    from fastckpt.checkpointer import ChunkSpec
    big = ChunkSpec("w", "float32", (100, 1000), (0, 0), (100, 1000), 400_000, False)
    pieces = split([big], 150_000, first=40_000)
    assert pieces[0].size <= 40_000 and all(p.size <= 150_000 for p in pieces)
    rows = [(s.spec.offsets[0], s.spec.sizes[0]) for p in pieces for s in p.slots]
    assert rows[0] == (0, 10) and rows[1] == (10, 37)
    assert sum(n for _, n in rows) == 100
    assert all(a + n == b for (a, n), (b, _) in zip(rows, rows[1:]))
