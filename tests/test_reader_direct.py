"""Loads that read large chunks straight into their destination tensors (no read buffer, no
copy): when the destination's address is in phase with the chunk's file offset, and for the
tensors a load allocates itself (placed in phase). Loads through the page cache (small or
cached checkpoints) are in tests/test_load_paths.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastckpt
from fastckpt.storage import native as _native
from fastckpt.engine import reader as R


@pytest.fixture(autouse=True)
def around_the_page_cache(monkeypatch):
    """These tests are about reads with O_DIRECT, which a load uses for a checkpoint over
    SMALL_LOAD bytes whose files are not in the page cache: make every load one of those."""
    from fastckpt.storage.local import LocalStorage
    monkeypatch.setattr(R, "SMALL_LOAD", 0)
    monkeypatch.setattr(LocalStorage, "cached", lambda self, path: False)


@pytest.fixture(params=["off", "require"])
def native(request, monkeypatch):
    if request.param == "require" and not _native.native_available():
        pytest.skip("native extension not built")
    monkeypatch.setenv("FASTCKPT_NATIVE", request.param)
    return request.param


def _in_phase(nbytes: int, phase: int, dtype=torch.float32) -> torch.Tensor:
    """A tensor of ``nbytes`` whose address is ``phase`` modulo 4096."""
    raw = torch.empty(nbytes + 4096, dtype=torch.uint8)
    skip = (phase - raw.data_ptr()) % 4096
    return raw[skip:skip + nbytes].view(dtype)


def _model_opt(seed: int, stepped: bool):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(768, 768), torch.nn.ReLU(), torch.nn.Linear(768, 512))
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    if stepped:
        m(torch.randn(4, 768)).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return m, opt


def _chunk(root: str, step: int, fqn: str) -> tuple[str, dict]:
    d = os.path.join(root, f"step-{step:010d}")
    body = json.load(open(os.path.join(d, "manifest.json")))["body"]
    c = body["tensors"][fqn]["chunks"][0]
    return os.path.join(d, c["file"]), c


def test_fresh_optimizer_is_read_in_place(root, native, stats):
    """A restarted job's optimizer has no moments: the load allocates them in phase with the
    file and reads them with O_DIRECT straight into place; the result is bit-exact."""
    m, opt = _model_opt(0, stepped=True)
    fastckpt.save({"model": m, "optim": opt}, root, step=1)
    m2, opt2 = _model_opt(1, stepped=False)
    assert fastckpt.load({"model": m2, "optim": opt2}, root) == 1
    for a, b in zip(m.parameters(), m2.parameters()):
        assert torch.equal(a, b)
    for p, p2 in zip(m.parameters(), m2.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], opt2.state[p2][k])
    # the weights' moments (1.5 and 2.25 MiB, allocated by the load) go direct; the model's own
    # weights only if malloc happened to place them in phase
    moments = 2 * sum(p.nbytes for p in m.parameters() if p.nbytes >= (1 << 20))
    assert stats[-1]["direct_chunks"] >= 4 and stats[-1]["direct_bytes"] >= moments, stats


@pytest.mark.parametrize("where", ["body", "first_page", "last_page"])
def test_damage_in_a_direct_chunk_names_file_key_offset(root, native, stats, where):
    w = torch.randn(1 << 19)  # 2 MiB
    fastckpt.save({"w": w}, root, step=1)
    path, c = _chunk(root, 1, "w")
    at = {"body": c["offset"] + (1 << 20), "first_page": c["offset"] + 1,
          "last_page": c["offset"] + c["length"] - 1}[where]
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x40]))
    out = {"w": _in_phase(w.nbytes, c["offset"] % 4096)}
    with pytest.raises(fastckpt.CorruptCheckpointError, match="checksum mismatch") as ei:
        fastckpt.load(out, root)
    assert stats[-1]["direct_chunks"] == 1
    assert ei.value.key == "w" and ei.value.offset == c["offset"]
    assert c["file"] in str(ei.value)


def test_out_of_phase_destination_goes_through_a_buffer(root, native, stats):
    w = torch.randn(1 << 19)
    fastckpt.save({"w": w}, root, step=1)
    _, c = _chunk(root, 1, "w")
    for shift, direct in ((0, 1), (64, 0), (2048, 0)):
        out = {"w": _in_phase(w.nbytes, (c["offset"] + shift) % 4096)}
        fastckpt.load(out, root)
        assert torch.equal(out["w"], w)
        assert stats[-1]["direct_chunks"] == direct, (shift, stats[-1])


def test_truncated_file_under_a_direct_chunk(root, native):
    w = torch.randn(1 << 19)
    fastckpt.save({"w": w}, root, step=1)
    path, c = _chunk(root, 1, "w")
    with open(path, "r+b") as f:  # the size check names the file before any read
        f.truncate(c["offset"] + (1 << 20))
    out = {"w": _in_phase(w.nbytes, c["offset"] % 4096)}
    with pytest.raises(fastckpt.CorruptCheckpointError) as ei:
        fastckpt.load(out, root)
    assert c["file"] in str(ei.value)


def test_spans_do_not_read_through_large_gaps(root, stats):
    """Gaps over 1 MiB between the chunks read in spans are not read through: here the gap is
    a chunk read directly into its destination."""
    a, b = torch.randn(1 << 19), torch.randn(1 << 19)
    fastckpt.save({"a": a, "b": b, "s": torch.arange(10)}, root, step=1)
    _, ca = _chunk(root, 1, "a")
    _, cb = _chunk(root, 1, "b")
    # "a" out of phase (read in a span), "b" in phase (read directly): a span through b's
    # 2 MiB would reach "s"
    out = {"a": _in_phase(a.nbytes, (ca["offset"] + 64) % 4096),
           "b": _in_phase(b.nbytes, cb["offset"] % 4096),
           "s": torch.zeros(10, dtype=torch.int64)}
    fastckpt.load(out, root)
    for k, v in (("a", a), ("b", b), ("s", torch.arange(10))):
        assert torch.equal(out[k], v), k
    assert stats[-1]["direct_bytes"] == b.nbytes, stats
    assert stats[-1]["span_bytes"] < a.nbytes + (1 << 20), stats  # not b's 2 MiB again


def test_populate_faults_pages_in_without_changing_them():
    """pyio.populate (MADV_POPULATE_WRITE): the pages are there afterwards (touching them takes
    no fault) and the bytes already written are unchanged."""
    import mmap
    import resource
    from fastckpt.storage import pyio
    n = 16 << 20
    buf = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    addr = pyio._address(buf)
    buf[4096 * 3:4096 * 3 + 5] = b"hello"  # one page present, with data
    if not pyio.populate(addr + 100, n - 200):  # an unaligned range: whole pages around it
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    assert buf[4096 * 3:4096 * 3 + 5] == b"hello" and buf[:4096] == bytes(4096)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for off in range(0, n, 4096):
        buf[off + 7] = 1
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
    assert faults < (n // 4096) // 8, faults  # 4096 pages; a fault each without populate
    assert not pyio.populate(addr, 0)


def test_the_prefault_thread_covers_the_direct_destinations(root, native, stats, monkeypatch):
    """The prefault thread populates every direct read's destination, whole; the load stays
    bit-exact."""
    import mmap
    from fastckpt.storage import pyio
    probe = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if not pyio.populate(pyio._address(probe), 4096):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE")
    calls = []
    real = R.populate
    monkeypatch.setattr(R, "populate", lambda a, n: calls.append((a, n)) or real(a, n))
    m, opt = _model_opt(0, stepped=True)
    fastckpt.save({"model": m, "optim": opt}, root, step=1)
    m2, opt2 = _model_opt(1, stepped=False)
    assert fastckpt.load({"model": m2, "optim": opt2}, root) == 1
    for p, p2 in zip(m.parameters(), m2.parameters()):
        for k in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(opt.state[p][k], opt2.state[p2][k])
    covered = sum(n for _, n in calls)
    assert stats[-1]["direct_chunks"] >= 4 and covered == stats[-1]["direct_bytes"], (calls, stats)
    for p2 in m2.parameters():
        for k in ("exp_avg", "exp_avg_sq"):
            t = opt2.state[p2][k]
            if t.nbytes >= (1 << 20):  # a direct read: its whole destination was populated
                assert sum(n for a, n in calls if t.data_ptr() <= a < t.data_ptr() + t.nbytes
                           ) == t.nbytes


def _thp_eligible(address: int) -> bool:
    """Whether the mapping holding ``address`` may take transparent huge pages
    (``THPeligible`` in /proc/self/smaps)."""
    vma = None
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                vma = lo <= address < hi
            elif vma and head == "THPeligible:":
                return line.split()[1] == "1"
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.parametrize("thp", ["1", "0"])
def test_the_moments_a_load_allocates_are_advised_to_huge_pages(root, monkeypatch, thp):
    """A restart's load allocates a fresh optimizer's moments (in phase with their chunks);
    those of 4 MiB and more are advised to transparent huge pages (``pyio.huge_pages``: the
    prefault thread then faults them 2 MiB at a time), unless FASTCKPT_THP=0. Bit-exact."""
    path = "/sys/kernel/mm/transparent_hugepage/enabled"
    mode = open(path).read() if os.path.exists(path) else "[never]"
    if "[never]" in mode:
        pytest.skip("no transparent huge pages here")
    monkeypatch.setenv("FASTCKPT_THP", thp)
    from fastckpt.storage import pyio
    advised, real = [], pyio._madvise

    def spy(address, nbytes, advice):
        if advice == pyio._MADV_HUGEPAGE:
            advised.append((address, address + nbytes))
        return real(address, nbytes, advice)
    monkeypatch.setattr(pyio, "_madvise", spy)
    torch.manual_seed(0)
    m = torch.nn.Linear(2048, 1024)  # an 8 MiB weight
    opt = torch.optim.Adam(m.parameters(), lr=1e-3)
    m(torch.randn(4, 2048)).sum().backward()
    opt.step()
    fastckpt.save({"model": m, "optim": opt}, root, step=1)
    m2 = torch.nn.Linear(2048, 1024)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-3)
    assert fastckpt.load({"model": m2, "optim": opt2}, root) == 1
    for k in ("exp_avg", "exp_avg_sq"):
        t = opt2.state[m2.weight][k]
        assert torch.equal(t, opt.state[m.weight][k]), k
        inside = (t.data_ptr() + (4 << 20) - 1) // (2 << 20) * (2 << 20)  # a whole 2 MiB page
        if thp == "1":
            assert any(lo <= inside < hi for lo, hi in advised), (k, advised)
            assert _thp_eligible(inside), k
    # (not the mapping's flag: freed memory an earlier advice covered is reused by malloc
    # with the flag kept, so eligibility says nothing of this load with FASTCKPT_THP=0)
    assert advised if thp == "1" else not advised, advised


@pytest.mark.parametrize("reporting", [True, False])
def test_huge_pages_by_default_only_where_the_host_does_not_take_free_memory_back(
        tmp_path, monkeypatch, reporting):
    """FASTCKPT_THP unset ("auto"): no huge-page advice on a VM whose virtio-balloon reports
    free pages to the host (there a fresh 2 MiB page is memory the host took back: the restart
    load ran 1.5x slower at 3.4x the CPU with the advice, docs/benchmarks.md); the advice
    elsewhere; FASTCKPT_THP=1 advises whatever the balloon says."""
    from fastckpt.storage import pyio
    dev = tmp_path / "virtio0"
    dev.mkdir()
    bits = ["0"] * 64
    bits[1] = bits[2] = "1"
    bits[pyio._F_REPORTING] = "1" if reporting else "0"
    (dev / "features").write_text("".join(bits) + "\n")
    monkeypatch.setattr(pyio, "_BALLOON", str(tmp_path))
    monkeypatch.setattr(pyio, "_reporting", None)
    calls = []
    monkeypatch.setattr(pyio, "_madvise", lambda a, n, adv: calls.append(adv) or 0)
    monkeypatch.delenv("FASTCKPT_THP", raising=False)
    assert pyio.free_page_reporting() is reporting
    assert pyio.huge_pages(1 << 30, 8 << 20) is (not reporting)
    monkeypatch.setenv("FASTCKPT_THP", "1")
    assert pyio.huge_pages(1 << 30, 8 << 20) is True
    assert calls == [pyio._MADV_HUGEPAGE] * (1 if reporting else 2)
