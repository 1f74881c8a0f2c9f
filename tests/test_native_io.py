"""Tests of fastckpt.storage.native: the native and pure-Python I/O backends must write byte-identical
files and return identical xxh3-64 hashes (== xxhash.xxh3_64_intdigest)."""

from __future__ import annotations

import errno
import os
import random
import subprocess
import threading

import pytest
import xxhash

from fastckpt.storage import native as _native
from fastckpt.storage import pyio as _pyio
from fastckpt.storage.native import NativeBackend, PythonBackend, aligned_buffer

MiB = 1 << 20
SIZES = [0, 1, 4095, 4096, 4097, 3 * MiB + 123, 40 * MiB]
NATIVE_SKIP = f"native extension not built: {_native.native_error()}"


def make_backend(name: str, **kw):
    if name == "native":
        if not _native.native_available():
            pytest.skip(NATIVE_SKIP)
        return NativeBackend(**kw)
    return PythonBackend(**kw)


@pytest.fixture(params=["native", "python"])
def backend(request):
    return make_backend(request.param)


# small blocks so that a few MiB already use several threads, partial last blocks, etc.
@pytest.fixture(params=["native", "python"])
def small_block_backend(request):
    return make_backend(request.param, block_size=64 * 1024, depth=3)


def fill(mv: memoryview, n: int, seed: int = 0) -> bytes:
    data = random.Random(seed).randbytes(n)
    mv[:n] = data
    return data


def make_ranges(n: int, seed: int = 1) -> list[tuple[int, int]]:
    rnd = random.Random(seed)
    out = [(0, n), (0, 0), (n, 0)]
    if n:
        out += [(n - 1, 1), (0, min(n, 7)), (n // 3, n - n // 3)]
        for _ in range(20):  # arbitrary, overlapping, some spanning many hash chunks
            a = rnd.randrange(n)
            out.append((a, rnd.randrange(n - a + 1)))
    return out


def expected(data: bytes, ranges) -> tuple[int, list[int]]:
    return [xxhash.xxh3_64_intdigest(data[o:o + ln]) for o, ln in ranges]


def read_file(path) -> bytes:
    with open(path, "rb") as f:
        return f.read()


# ------------------------------------------------------------------------------------------
# round trips
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("size", SIZES)
def test_round_trip(backend, tmp_path, size, direct):
    buf = aligned_buffer(size + 4096)  # aligned with slack: O_DIRECT path when direct=True
    data = fill(buf, size, seed=size)
    # the pool's bytes beyond nbytes must not end up in the file
    buf[size:size + 4096] = b"\xee" * 4096
    ranges = make_ranges(size)
    path = tmp_path / "shard.bin"
    rh = backend.write_file(str(path), buf, size, ranges, direct=direct, fsync=True)
    assert rh == expected(data, ranges)
    h = xxhash.xxh3_64_intdigest(data)
    assert os.path.getsize(path) == size
    assert read_file(path) == data
    assert os.stat(path).st_mode & 0o777 == 0o644 & ~_umask()

    out = aligned_buffer(size + 4096)
    assert backend.read_into(str(path), 0, out, size, direct=direct) == h
    assert out[:size] == data


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_multi_block_threads(small_block_backend, tmp_path, direct):
    """Many blocks, several threads, a partial last block, ranges straddling blocks."""
    n = 3 * MiB + 123
    buf = aligned_buffer(n)
    data = fill(buf, n, seed=7)
    ranges = make_ranges(n, seed=3) + [(64 * 1024 - 5, 10), (1 * MiB - 1, 2 * MiB)]
    path = str(tmp_path / "f")
    assert small_block_backend.write_file(path, buf, n, ranges, direct=direct) == expected(data, ranges)
    assert read_file(path) == data
    out = aligned_buffer(n)
    assert small_block_backend.read_into(path, 0, out, n, direct=direct) == xxhash.xxh3_64_intdigest(data)
    assert out[:n] == data


@pytest.mark.parametrize("size", [1, 4097, 3 * MiB + 123])
def test_unaligned_and_odd_buffers(backend, tmp_path, size):
    """bytearray / bytes / offset memoryview (not 4096-aligned): buffered fallback, same result."""
    data = random.Random(size).randbytes(size)
    ba = bytearray(b"x" + data)
    for buf in (bytearray(data), data, memoryview(ba)[1:]):
        path = str(tmp_path / "f")
        assert backend.write_file(path, buf, size, [(0, size)], direct=True) == expected(data, [(0, size)])
        assert read_file(path) == data
    # exact-size aligned buffer: no slack for the padded last block -> must still work
    buf = memoryview(aligned_buffer(size + 4096))[:size]
    buf[:] = data
    assert backend.write_file(str(tmp_path / "g"), buf, size, [(0, size)], direct=True) == \
        [xxhash.xxh3_64_intdigest(data)]
    assert read_file(tmp_path / "g") == data


def test_numpy_buffer(backend, tmp_path):
    np = pytest.importorskip("numpy")
    arr = np.arange(300_000, dtype=np.float32).reshape(1000, 300)
    raw = arr.tobytes()
    path = str(tmp_path / "np")
    rh = backend.write_file(path, arr, arr.nbytes, [(4, 400)])
    assert rh == expected(raw, [(4, 400)])
    h = xxhash.xxh3_64_intdigest(raw)
    out = np.zeros_like(arr)
    assert backend.read_into(path, 0, out, out.nbytes) == h
    assert (out == arr).all()
    assert backend.hash(arr, 1000) == xxhash.xxh3_64_intdigest(raw[:1000])


def test_files_identical_across_backends(tmp_path):
    if not _native.native_available():
        pytest.skip(NATIVE_SKIP)
    n = 5 * MiB + 77
    buf = aligned_buffer(n)
    data = fill(buf, n, seed=11)
    ranges = make_ranges(n)
    results = {}
    for name, be in (("native", NativeBackend()), ("python", PythonBackend())):
        for direct in (True, False):
            p = tmp_path / f"{name}-{direct}"
            results[(name, direct)] = be.write_file(str(p), buf, n, ranges, direct=direct)
            assert read_file(p) == data
    assert len(set(repr(v) for v in results.values())) == 1


def test_overwrite_truncates(backend, tmp_path):
    path = str(tmp_path / "f")
    big = aligned_buffer(MiB)
    fill(big, MiB)
    backend.write_file(path, big, MiB, [])
    backend.write_file(path, b"abc", 3, [])
    assert read_file(path) == b"abc"


def test_hash(backend):
    data = random.Random(5).randbytes(2 * MiB + 3)
    for n in (0, 1, 17, 240, 4096, 100_000, len(data)):
        assert backend.hash(data, n) == xxhash.xxh3_64_intdigest(data[:n])
    with pytest.raises(ValueError):
        backend.hash(data, len(data) + 1)


def test_native_hash_kernels_agree(tmp_path):
    """The AVX2 and the portable xxh3 kernels of the extension give the same hashes."""
    if not _native.native_available():
        pytest.skip(NATIVE_SKIP)
    ext = _native._ext
    data = random.Random(8).randbytes(5 * MiB + 17)
    lengths = list(range(0, 1100)) + [4095, 4096, 100_000, 1 * MiB + 3, len(data)]
    be = NativeBackend(block_size=1 * MiB, depth=2)
    old = ext._set_hash_avx2(True)
    try:
        for avx2 in (True, False):
            ext._set_hash_avx2(avx2)
            for n in lengths:
                off = n % 61
                mv = memoryview(data)[off:off + n] if off + n <= len(data) else memoryview(data)[:n]
                assert ext.hash(mv, len(mv)) == xxhash.xxh3_64_intdigest(mv), (ext.hash_impl(), n)
            p = str(tmp_path / f"k{avx2}")
            ranges = [(0, len(data)), (3, 4 * MiB), (1, 200)]
            assert be.write_file(p, data, len(data), ranges) == expected(data, ranges)
            assert be.read_into(p, 0, bytearray(len(data)), len(data)) == xxhash.xxh3_64_intdigest(data)
    finally:
        ext._set_hash_avx2(old)


def test_bad_arguments(backend, tmp_path):
    path = str(tmp_path / "f")
    with pytest.raises(ValueError):
        backend.write_file(path, b"abc", 4, [])
    with pytest.raises(ValueError):
        backend.write_file(path, b"abc", 3, [(2, 2)])
    backend.write_file(path, b"abc", 3, [])
    with pytest.raises(ValueError):
        backend.read_into(path, 0, bytearray(2), 3)
    with pytest.raises(BufferError):
        backend.read_into(path, 0, b"xyz", 3)  # read-only


# ------------------------------------------------------------------------------------------
# reads
# ------------------------------------------------------------------------------------------


@pytest.fixture
def data_file(tmp_path):
    n = 6 * MiB + 1234
    data = random.Random(99).randbytes(n)
    p = tmp_path / "data.bin"
    p.write_bytes(data)
    return str(p), data


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
@pytest.mark.parametrize("offset,nbytes", [
    (0, 1), (0, 4096), (4096, 4097), (8192, 3 * MiB), (4096, 6 * MiB + 1234 - 4096),  # aligned
    (1, 1), (7, 4096), (4095, 3 * MiB + 1), (12345, 6 * MiB + 1234 - 12345),  # unaligned
    (100, 0), (6 * MiB + 1234, 0),
])
def test_read_into_offsets(small_block_backend, data_file, offset, nbytes, direct):
    path, data = data_file
    for buf in (aligned_buffer(nbytes + 4096), bytearray(nbytes + 1)):
        assert small_block_backend.read_into(path, offset, buf, nbytes, direct=direct) == \
            xxhash.xxh3_64_intdigest(data[offset:offset + nbytes])
        assert bytes(buf[:nbytes]) == data[offset:offset + nbytes]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_read_past_eof(backend, data_file, direct):
    path, data = data_file
    n = len(data)
    buf = aligned_buffer(n + 8192)
    with pytest.raises(EOFError) as ei:
        backend.read_into(path, 4096, buf, n, direct=direct)
    msg = str(ei.value)
    assert path in msg and f"expected {n} bytes at offset 4096" in msg and f"file ended at {n}" in msg
    with pytest.raises(EOFError, match="file ended at"):
        backend.read_into(path, n + 1, buf, 0, direct=direct)


def test_read_missing_file(backend, tmp_path):
    path = str(tmp_path / "nope")
    with pytest.raises(FileNotFoundError) as ei:
        backend.read_into(path, 0, bytearray(10), 10)
    assert ei.value.errno == errno.ENOENT and path in str(ei.value)


# ------------------------------------------------------------------------------------------
# special file systems (need root for mount)
# ------------------------------------------------------------------------------------------


def _mount(tmp_path, name: str, *args: str):
    if os.geteuid() != 0:
        pytest.skip("mounting a test file system needs root")
    d = tmp_path / name
    d.mkdir()
    r = subprocess.run(["mount", *args, str(d)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"mount {' '.join(args)} failed: {r.stderr.strip()}")
    return d


def _umount(d) -> None:
    subprocess.run(["umount", str(d)], check=False)


@pytest.fixture
def tmpfs_8m(tmp_path):
    d = _mount(tmp_path, "tmpfs", "-t", "tmpfs", "-o", "size=8m", "tmpfs")
    yield d
    _umount(d)


@pytest.fixture
def ramfs(tmp_path):
    """ramfs refuses O_DIRECT at open (EINVAL): exercises the buffered fallback."""
    d = _mount(tmp_path, "ramfs", "-t", "ramfs", "ramfs")
    yield d
    _umount(d)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_tmpfs_round_trip(small_block_backend, tmpfs_8m, direct):
    n = 2 * MiB + 5
    buf = aligned_buffer(n)
    data = fill(buf, n, seed=2)
    path = str(tmpfs_8m / "f")
    assert small_block_backend.write_file(path, buf, n, [(3, 5)], direct=direct) == expected(data, [(3, 5)])
    assert read_file(path) == data
    out = aligned_buffer(n)
    assert small_block_backend.read_into(path, 0, out, n, direct=direct) == xxhash.xxh3_64_intdigest(data)


def test_o_direct_refused_falls_back(small_block_backend, ramfs):
    with pytest.raises(OSError) as ei:
        os.close(os.open(str(ramfs / "probe"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
    assert ei.value.errno == errno.EINVAL, "ramfs was expected to refuse O_DIRECT"
    n = MiB + 3
    buf = aligned_buffer(n)
    data = fill(buf, n, seed=4)
    path = str(ramfs / "f")
    assert small_block_backend.write_file(path, buf, n, [(0, n)], direct=True) == \
        [xxhash.xxh3_64_intdigest(data)]
    assert read_file(path) == data
    out = aligned_buffer(n)
    assert small_block_backend.read_into(path, 0, out, n, direct=True) == xxhash.xxh3_64_intdigest(data)
    assert out[:n] == data


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_enospc(backend, tmpfs_8m, direct):
    n = 16 * MiB
    buf = aligned_buffer(n)
    path = str(tmpfs_8m / "too-big.bin")
    with pytest.raises(OSError) as ei:
        backend.write_file(path, buf, n, [(0, n)], direct=direct)
    assert ei.value.errno == errno.ENOSPC
    assert path in str(ei.value) and "at offset" in str(ei.value)


def test_unwritable_directory(backend, tmp_path):
    if os.geteuid() == 0:  # root ignores permission bits: use a read-only mount (EROFS)
        d = _mount(tmp_path, "ro", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs")
    else:
        d = tmp_path / "ro"
        d.mkdir()
        d.chmod(0o555)
    try:
        path = str(d / "shard.bin")
        with pytest.raises(OSError) as ei:
            backend.write_file(path, b"hello", 5, [])
        assert ei.value.errno in (errno.EROFS, errno.EACCES, errno.EPERM)
        assert path in str(ei.value)
    finally:
        if os.geteuid() == 0:
            _umount(d)
        else:
            d.chmod(0o755)


# ------------------------------------------------------------------------------------------
# concurrency
# ------------------------------------------------------------------------------------------


def test_concurrent_calls(small_block_backend, tmp_path):
    """Several writers at once (as the core does per shard) keep their results apart."""
    errors: list[BaseException] = []

    def job(i: int) -> None:
        try:
            n = MiB + i * 4099
            buf = aligned_buffer(n)
            data = fill(buf, n, seed=100 + i)
            p = str(tmp_path / f"c{i}")
            assert small_block_backend.write_file(p, buf, n, [(0, n)]) == expected(data, [(0, n)])
            out = bytearray(n)
            assert small_block_backend.read_into(p, 0, out, n) == xxhash.xxh3_64_intdigest(data)
            assert out == data
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    ts = [threading.Thread(target=job, args=(i,)) for i in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors


# ------------------------------------------------------------------------------------------
# backend selection
# ------------------------------------------------------------------------------------------


def test_get_backend_modes():
    assert _native.get_backend("off").name == "python"
    assert _native.get_backend("off") is _native.get_backend("off")  # cached
    auto = _native.get_backend("auto")
    assert auto.name == ("native" if _native.native_available() else "python")
    if _native.native_available():
        assert _native.get_backend("require").name == "native"
        assert _native.native_error() is None
    with pytest.raises(ValueError):
        _native.get_backend("sometimes")


def test_require_without_extension(monkeypatch):
    """Simulated: the loader state is monkeypatched as if the extension had failed to import."""
    monkeypatch.setattr(_native, "_ext", None)
    monkeypatch.setattr(_native, "_ext_error", "ImportError: simulated missing extension")
    monkeypatch.setattr(_native, "_instances", {})
    assert not _native.native_available()
    assert "simulated" in _native.native_error()
    with pytest.raises(ImportError) as ei:
        _native.get_backend("require")
    msg = str(ei.value)
    assert "libxxhash-dev" in msg and "build_ext --inplace" in msg and "pip install -e ." in msg
    assert _native.get_backend("auto").name == "python"
    with pytest.raises(ImportError):
        NativeBackend()


def test_aligned_buffer():
    for n in (0, 1, 4096, 4097, 3 * MiB + 1):
        b = aligned_buffer(n)
        assert len(b) == (n + 4095) // 4096 * 4096
        assert not b.readonly
        assert _pyio._address(b) % 4096 == 0 if len(b) else True


# ------------------------------------------------------------------------------------------
# copy_hash (staging's fused copy + checksum)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 4095, 256 * 1024 + 7, 3 * MiB + 5])
def test_copy_hash_copies_and_hashes(backend, n):
    import ctypes
    src = bytearray(random.Random(n).randbytes(n) or b"\0")
    addr = ctypes.addressof((ctypes.c_char * len(src)).from_buffer(src))
    dst = aligned_buffer(n + 100)
    dst[:] = b"\xee" * len(dst)
    h = backend.copy_hash(dst, 100, addr, n)
    assert h == xxhash.xxh3_64_intdigest(bytes(src[:n]))
    assert bytes(dst[100:100 + n]) == bytes(src[:n])
    assert bytes(dst[:100]) == b"\xee" * 100  # nothing outside the target range is touched
    assert backend.copy_hash(dst, 0, addr, n, hash=False) is None
    with pytest.raises(ValueError, match="outside buffer"):
        backend.copy_hash(dst, len(dst) - n + 1, addr, n)


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_read_into_without_hash(small_block_backend, tmp_path, direct):
    size = 300 * 1024 + 5
    src = aligned_buffer(size)
    data = fill(src, size)
    path = str(tmp_path / "f")
    small_block_backend.write_file(path, src, size, [])
    dst = aligned_buffer(size)
    assert small_block_backend.read_into(path, 0, dst, size, direct=direct, hash=False) is None
    assert bytes(dst[:size]) == data
    with pytest.raises(EOFError):
        small_block_backend.read_into(path, 0, aligned_buffer(size + 1), size + 1, hash=False)


def test_copy_between_addresses(backend):
    import ctypes
    src = bytearray(random.Random(3).randbytes(100_000))
    dst = bytearray(100_010)
    a_src = ctypes.addressof((ctypes.c_char * len(src)).from_buffer(src))
    a_dst = ctypes.addressof((ctypes.c_char * len(dst)).from_buffer(dst))
    backend.copy(a_dst + 10, a_src, len(src))
    assert dst[10:] == src and dst[:10] == bytearray(10)
    backend.copy(a_dst, a_src, 0)
    with pytest.raises(ValueError):
        backend.copy(0, a_src, 5)


# --------------------------------------------------------------------------------------------
# copy_many: the async save's staging copy
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("threads", [1, 2, 3, 7])
def test_copy_many_copies_every_range_and_nothing_else(backend, threads):
    """Ranges of odd sizes and alignments (crossing the thread shares' cuts, the non-temporal
    loop's 1 MiB threshold and its 16 KiB blocks) land exactly; the bytes around each
    destination are untouched; the number of threads used follows the 4 MiB-a-thread rule."""
    rng = random.Random(threads)
    sizes = [0, 1, 63, 4096, 16383, (1 << 20) - 1, 1 << 20, 5 * MiB + 17, 9 * MiB + 4093]
    rng.shuffle(sizes)
    srcs, dsts, copies = [], [], []
    for i, n in enumerate(sizes):
        s = aligned_buffer(n + 128)
        s[:n + 128] = random.Random(i).randbytes(n + 128)
        d = aligned_buffer(n + 256)
        d[:] = b"\xa5" * len(d)
        so, do = rng.randrange(64), 64 + rng.randrange(64)  # unaligned both sides
        srcs.append((s, so)), dsts.append((d, do))
        copies.append((_pyio._address(d) + do, _pyio._address(s) + so, n))
    used = backend.copy_many(copies, threads)
    total = sum(sizes)
    assert used == max(1, min(threads, total // _pyio.COPY_MIN_SHARE))
    for n, (s, so), (d, do) in zip(sizes, srcs, dsts):
        assert bytes(d[do:do + n]) == bytes(s[so:so + n]), n
        assert bytes(d[:do]) == b"\xa5" * do and bytes(d[do + n:]) == b"\xa5" * (len(d) - do - n)


def test_copy_many_bad_arguments(backend):
    buf = aligned_buffer(4096)
    a = _pyio._address(buf)
    with pytest.raises(ValueError, match="null address|negative"):
        backend.copy_many([(a, a + 2048, 16), (0, a, 5)], 2)
    with pytest.raises(ValueError, match="null address|negative"):
        backend.copy_many([(a, a + 2048, -1)], 1)
    with pytest.raises((TypeError, ValueError)):
        backend.copy_many([(a, a + 2048)], 1)
    assert backend.copy_many([], 4) == 1 and backend.copy_many([(a, a + 2048, 0)], 4) == 1


def test_split_shares_equal_and_covering():
    """The Python backend's split (the C one mirrors it): every byte in exactly one share, in
    order, shares within 64 bytes of equal, cuts on 64-byte boundaries of the concatenation."""
    rng = random.Random(3)
    for _ in range(50):
        copies, d, s = [], 1 << 40, 1 << 41
        for _ in range(rng.randint(1, 12)):
            n = rng.choice([0, 1, 100, 1 << 20, 3 * MiB + 5, 17 * MiB + 1])
            copies.append((d, s, n))
            d, s = d + n + 4096, s + n + 4096
        threads = rng.randint(1, 9)
        shares = _pyio.split_shares(copies, threads)
        total = sum(n for _, _, n in copies)
        assert len(shares) == max(1, min(threads, total // _pyio.COPY_MIN_SHARE))
        flat = [c for sh in shares for c in sh]
        # re-joined in order, the pieces give back the ranges
        joined, i = [], 0
        for dd, ss, n in copies:
            if n == 0:
                continue
            got = 0
            while got < n:
                pd, ps, pn = flat[i]
                assert (pd, ps) == (dd + got, ss + got) and pn > 0
                got, i = got + pn, i + 1
            assert got == n
        assert i == len(flat)
        sizes = [sum(c[2] for c in sh) for sh in shares]
        assert sum(sizes) == total
        if len(shares) > 1:
            assert max(sizes[:-1]) - min(sizes[:-1]) == 0 and sizes[0] % 64 == 0
            assert sizes[-1] <= sizes[0] + len(shares)  # the remainder of total // shares
