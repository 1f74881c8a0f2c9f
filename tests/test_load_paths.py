"""Which read path a load takes (issue 10, defect 7: small or cached loads must not be slower
than a framework's own): through the page cache for a checkpoint up to SMALL_LOAD bytes or
whose files are cached, around it (O_DIRECT) for a large cold one; and, on one process with
nothing to reshard, without DCP's planning machinery. Speed itself is measured by
benchmarks, not here: these check the choice and that every path verifies what it reads."""

from __future__ import annotations

import os

import pytest
import torch

import fastckpt
from fastckpt.engine import reader as R
from fastckpt.manifest import schema as fmt
from fastckpt.storage import LocalStorage


def _state():
    g = torch.Generator().manual_seed(3)
    return {"a": torch.randn(300_000, generator=g), "b": torch.randn(7, 5, generator=g),
            "c": torch.arange(10, dtype=torch.int64), "step": 4}


def _blank():
    # destinations out of phase with their chunks: only a read through the cache can go
    # straight into them
    raw = torch.empty(300_000 * 4 + 8, dtype=torch.uint8)
    return {"a": raw[4:4 + 1_200_000].view(torch.float32), "b": torch.zeros(7, 5),
            "c": torch.zeros(10, dtype=torch.int64), "step": 0}


def test_a_small_load_reads_through_the_cache_straight_into_place(root, stats, monkeypatch):
    fastckpt.save(_state(), root, step=1)
    import torch.distributed.checkpoint as dcp

    def no_dcp(*a, **k):
        raise AssertionError("a one-process whole-tensor load needs no DCP planning")
    monkeypatch.setattr(dcp, "load", no_dcp)
    dest = _blank()
    assert fastckpt.load(dest, root) == 1
    for k in ("a", "b", "c"):
        assert torch.equal(dest[k], _state()[k])
    assert stats[-1]["direct_io"] == 0 and stats[-1]["span_bytes"] == 0
    assert stats[-1]["direct_chunks"] == 3


def test_a_large_cold_load_reads_around_the_cache(root, stats, monkeypatch):
    fastckpt.save(_state(), root, step=1)  # written with O_DIRECT: not in the page cache
    monkeypatch.setattr(R, "SMALL_LOAD", 0)
    dest = _blank()
    fastckpt.load(dest, root)
    assert stats[-1]["direct_io"] == 1 and torch.equal(dest["a"], _state()["a"])
    d = os.path.join(root, fmt.step_dirname(1))
    for n in os.listdir(d):  # read through the cache once (as a previous load would)
        with open(os.path.join(d, n), "rb") as f:
            f.read()
    fastckpt.load(_blank(), root)
    assert stats[-1]["direct_io"] == 0


def test_cached_probe(tmp_path):
    p = str(tmp_path / "f")
    with open(p, "wb") as f:
        f.write(os.urandom(1 << 20))
        f.flush()
        os.fsync(f.fileno())
    st = LocalStorage(str(tmp_path))
    assert st.cached(p)
    fd = os.open(p, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    assert not st.cached(p)
    assert not st.cached(str(tmp_path / "missing"))


@pytest.mark.parametrize("small", [True, False])
def test_every_path_checks_what_it_reads(root, monkeypatch, small):
    fastckpt.save(_state(), root, step=1)
    if not small:
        monkeypatch.setattr(R, "SMALL_LOAD", 0)
        monkeypatch.setattr(LocalStorage, "cached", lambda self, path: False)
    d = os.path.join(root, fmt.step_dirname(1))
    shard = next(n for n in os.listdir(d) if n.endswith(fmt.SHARD_SUFFIX))
    with open(os.path.join(d, shard), "r+b") as f:
        f.seek(4096 + 1000)  # inside "a"
        b = f.read(1)
        f.seek(4096 + 1000)
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(fastckpt.CorruptCheckpointError, match="checksum mismatch"):
        fastckpt.load(_blank(), root)
