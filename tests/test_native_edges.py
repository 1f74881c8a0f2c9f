"""Edge cases of the native I/O extension (native/fastckpt_io.c) and its pure-Python twin
(fastckpt/storage/pyio.py, codec.py's grouping kernels): argument validation that must not
overflow, and the rule that both backends give the same bytes and the same error types.

The first section holds tests that reproduce defects found in review; the second checks
properties that were reviewed and hold (nothing written outside a destination, no fd leaks,
read-only buffers refused), so that they stay that way."""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap

import pytest
import xxhash

from fastckpt.storage import codec
from fastckpt.storage import native as _native
from fastckpt.storage.native import NativeBackend, PythonBackend, aligned_buffer
from fastckpt.storage.pyio import _address

from tests.test_native_io import NATIVE_SKIP, make_backend

needs_native = pytest.mark.skipif(not _native.native_available(), reason=NATIVE_SKIP)


@pytest.fixture(params=["native", "python"])
def backend(request):
    return make_backend(request.param)


def _kernels(name: str):
    if name == "native":
        ks = _native.byte_regroup_kernels()
        if ks is None:
            pytest.skip(NATIVE_SKIP)
        return ks
    return codec._py_group, codec._py_ungroup


# ============================================================================================
# defects
# ============================================================================================


@needs_native
def test_write_segments_with_overflowing_lengths_is_refused_not_a_crash(tmp_path):
    """Segments whose lengths sum past 2**63 wrap ``end`` (and the request count) in the C
    validation: three segments that "cover" 4096 bytes pass it, the request table is sized
    for 2 requests and the fill loop then writes ~2**39 entries past it (SIGSEGV). The
    pure-Python backend does the arithmetic on Python ints. Must be a ValueError."""
    script = textwrap.dedent(f"""
        from fastckpt.storage.native import NativeBackend, aligned_buffer
        from fastckpt.storage.pyio import _address
        buf = aligned_buffer(8192)
        a = _address(buf)
        B = 1 << 24  # the default block size
        segs = [(0, a, (1 << 63) - 1),                  # contributes -(2**39 - 1) requests
                ((1 << 63) - 1, a, (1 << 63) - B),      # contributes +(2**39 - 1): end wraps
                ((1 << 64) - B - 1, a, B + 1 + 4096)]   # "continues" at the wrapped end
        try:
            NativeBackend(block_size=B).write_segments({str(tmp_path / "f")!r}, 4096, segs, [],
                                                       direct=False, fsync=False)
        except ValueError as e:
            print("refused:", e)
        else:
            print("accepted")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0 and "refused" in r.stdout, (
        f"write_segments crashed or accepted overflowing segments: rc={r.returncode}, "
        f"stdout={r.stdout!r}, stderr={r.stderr[-500:]!r}")


@pytest.mark.parametrize("direct", [False, True], ids=["buffered", "direct"])
def test_a_huge_block_size_still_writes_the_bytes(backend_name_param, tmp_path, direct):
    """``NativeBackend(block_size=2**63 - 4096)`` is accepted (a positive multiple of 4096),
    but ``(io_len + block - 1) / block`` overflows in write_file: no block is written, the
    fallocated file of zeros is kept and the call returns the hashes of the real data (a
    checkpoint whose bytes are all zero, reported as written). The Python backend writes it."""
    try:
        be = make_backend(backend_name_param, block_size=(1 << 63) - 4096)
    except ValueError as e:  # refused where it is set (since 2026-12-06: at most 1 GiB) ...
        assert "block_size" in str(e)
        if backend_name_param == "native":  # ... and by the C code itself, past the wrapper
            from fastckpt.storage.native import _ext
            buf = aligned_buffer(8192)
            with pytest.raises(ValueError, match="block_size"):
                _ext.write_file(str(tmp_path / "g"), buf, 8192, [], direct, False,
                                (1 << 63) - 4096, 4)
        return
    n = 8192
    buf = aligned_buffer(n)
    data = random.Random(5).randbytes(n)
    buf[:] = data
    path = str(tmp_path / "f")
    try:
        hashes = be.write_file(path, buf, n, [(0, n)], direct=direct, fsync=False)
    except ValueError:
        return  # refusing the block size is fine too
    assert hashes == [xxhash.xxh3_64_intdigest(data)]
    with open(path, "rb") as f:
        assert f.read() == data, "write_file returned success but the file does not hold buf"


@pytest.fixture(params=["native", "python"])
def backend_name_param(request):
    return request.param


@pytest.mark.parametrize("case", ["negative hash length", "negative segment offset",
                                  "negative segment length"])
def test_write_segments_bad_numbers_are_value_errors_in_both_backends(backend, tmp_path, case):
    """The C code has its own ValueError checks for negative lengths/offsets, but parses
    every number with PyLong_AsUnsignedLongLong first, so it raises OverflowError (not a
    ValueError subclass) where the Python backend raises ValueError."""
    buf = aligned_buffer(4096)
    a = _address(buf)
    segs, hr = [(0, a, 10)], [(a, 10)]
    if case == "negative hash length":
        hr = [(a, -1)]
    elif case == "negative segment offset":
        segs = [(-1, a, 11)]
    else:
        segs = [(0, a, -10)]
    with pytest.raises(ValueError):
        backend.write_segments(str(tmp_path / "f"), 10, segs, hr, fsync=False)


@pytest.mark.parametrize("op", ["read_into", "read_to"])
def test_an_offset_past_any_file_is_an_eof_error_naming_the_file(backend, tmp_path, op):
    """A file offset of 2**62 or more: the Python backend raises EOFError naming the file
    (as for any offset past the end); the native one raises a bare ValueError ("file_offset
    out of range") that names neither the file nor the offset, and that callers catching
    (OSError, EOFError) (reader._read_direct, LocalStorage.read_into) do not wrap."""
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"x" * 8192)
    buf = aligned_buffer(8192)
    off = 1 << 62
    with pytest.raises(EOFError) as ei:
        if op == "read_into":
            backend.read_into(path, off, buf, 10)
        else:
            backend.read_to(path, off, _address(buf), 10)
    assert path in str(ei.value) and str(off) in str(ei.value)


def test_copy_many_takes_lists_as_items_in_both_backends(backend):
    """copy_many parses each item with PyArg_ParseTuple, which only takes a tuple: a list item
    raises SystemError ("new style getargs format but argument is not a tuple") in the native
    backend while the Python backend copies it."""
    src = bytearray(random.Random(1).randbytes(1000))
    dst = bytearray(1000)
    backend.copy_many([[_address(dst), _address(src), 1000]], 1)
    assert dst == src


def test_non_contiguous_numpy_buffers_raise_the_same_error_in_both_backends(tmp_path):
    """A non-C-contiguous numpy array: the native backend lets numpy's exporter answer
    PyBUF_SIMPLE (ValueError "ndarray is not C-contiguous"), the Python backend raises
    BufferError: callers cannot catch one type for both."""
    np = pytest.importorskip("numpy")
    if not _native.native_available():
        pytest.skip(NATIVE_SKIP)
    arr = np.zeros((8, 16), dtype=np.uint8)[:, ::2]
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(bytes(64))
    got = {}
    for be in (NativeBackend(), PythonBackend()):
        for name, call in (("write_file", lambda: be.write_file(path + "w", arr, 64, [])),
                           ("read_into", lambda: be.read_into(path, 0, arr, 64)),
                           ("hash", lambda: be.hash(arr, 64))):
            try:
                call()
                got[be.name, name] = None
            except Exception as e:  # noqa: BLE001 - the type is what is compared
                got[be.name, name] = type(e)
    for name in ("write_file", "read_into", "hash"):
        assert got["native", name] is got["python", name], (name, got)


def test_python_copy_many_copies_an_iterable_of_copies(backend):
    """pyio.copy_many iterates ``copies`` twice (validation, then split_shares): a generator
    is used up by the validation and nothing is copied, yet it returns as if it had; the
    native backend copies it."""
    src = bytearray(random.Random(2).randbytes(3000))
    dst = bytearray(3000)
    backend.copy_many(((_address(dst) + i, _address(src) + i, 1000) for i in (0, 1000, 2000)), 2)
    assert dst == src


def test_python_write_segments_hashes_an_iterable_of_hash_ranges(backend, tmp_path):
    """PythonBackend.write_segments iterates ``hash_ranges`` twice (validation, then the
    hashing): an iterator gives [] instead of the checksums (the native backend hashes it)."""
    data = random.Random(3).randbytes(5000)
    src = bytearray(data)
    a = _address(src)
    got = backend.write_segments(str(tmp_path / "f"), len(data), iter([(0, a, len(data))]),
                                 iter([(a, 10), (a + 10, 4990)]), fsync=False)
    assert got == [xxhash.xxh3_64_intdigest(data[:10]), xxhash.xxh3_64_intdigest(data[10:])]


@pytest.mark.parametrize("kernels", ["native", "python"])
@pytest.mark.parametrize("case", ["read-only dst", "width 0", "width 65", "dst is src"])
def test_grouping_kernels_refuse_the_same_inputs_the_same_way(kernels, case):
    """codec's pure-Python grouping kernels "give the same bytes" as the C ones but do not
    check what the C ones check: a read-only destination is a TypeError (C: BufferError),
    width 0 a ZeroDivisionError and width 65 is accepted (C: ValueError, width must be
    1..64), and a destination that is the source gives wrong bytes from _py_ungroup
    (C: ValueError, source and destination overlap)."""
    group, ungroup = _kernels(kernels)
    src = bytes(range(16))
    if case == "read-only dst":
        for fn in (group, ungroup):
            with pytest.raises(BufferError):
                fn(src, bytes(16), 2)
    elif case in ("width 0", "width 65"):
        w = 0 if case == "width 0" else 65
        for fn in (group, ungroup):
            with pytest.raises(ValueError, match="width"):
                fn(src, bytearray(16), w)
    else:
        for fn in (group, ungroup):
            ba = bytearray(src)
            try:
                fn(ba, ba, 2)
            except ValueError:
                continue  # refusing is what the C kernel does
            ref = bytearray(16)
            (codec._py_group if fn is group else codec._py_ungroup)(src, ref, 2)
            assert ba == ref, f"{fn.__name__} in place gave {bytes(ba)!r}, expected {bytes(ref)!r}"


# ============================================================================================
# reviewed and correct (kept as regression checks)
# ============================================================================================


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "buffered"])
def test_read_to_writes_exactly_the_requested_range(backend, tmp_path, direct):
    """read_to at every phase of the first/last partial page (bounce pages): the destination's
    bytes are the file's, the guard bytes around it are untouched, the hash is right."""
    size = 70_000
    data = random.Random(7).randbytes(size)
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(data)
    be = make_backend(backend.name, block_size=8192, depth=3)
    rnd = random.Random(8)
    guard = 3 * 4096
    for _ in range(60):
        off = rnd.choice([0, 1, 4095, 4096, 4097, rnd.randrange(size)])
        n = rnd.choice([1, 4095, 4096, 4097, 8193, 20000, rnd.randrange(size)])
        n = min(n, size - off)
        phase = rnd.choice([off % 4096, rnd.randrange(4096)])
        buf = aligned_buffer(n + 2 * guard + 4096)
        buf[:] = b"\xa5" * len(buf)
        start = guard + phase
        h = be.read_to(path, off, _address(buf) + start, n, direct=direct)
        assert h == xxhash.xxh3_64_intdigest(data[off:off + n])
        assert bytes(buf[start:start + n]) == data[off:off + n]
        assert bytes(buf[:start]) == b"\xa5" * start
        assert bytes(buf[start + n:]) == b"\xa5" * (len(buf) - start - n)


def test_no_fd_leaks_on_error_paths(backend, tmp_path):
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"z" * 8192)
    os.mkfifo(tmp_path / "fifo")
    os.symlink(path, tmp_path / "link")
    buf = aligned_buffer(8192)
    calls = [
        lambda: backend.read_into(path, 8000, buf, 1000),               # EOF
        lambda: backend.read_into(str(tmp_path / "fifo"), 0, buf, 10),  # not regular
        lambda: backend.read_into(str(tmp_path / "link"), 0, buf, 10),  # ELOOP
        lambda: backend.read_to(path, 8000, _address(buf), 1000),
        lambda: backend.write_file(str(tmp_path), buf, 10, []),          # EISDIR
        lambda: backend.write_file("/dev/full", buf, 8192, []),          # fallocate ENODEV
    ]
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(20):
        for c in calls:
            with pytest.raises((OSError, EOFError)):
                c()
    assert len(os.listdir("/proc/self/fd")) == before


def test_read_only_buffers_are_never_written(backend, tmp_path):
    path = str(tmp_path / "f")
    with open(path, "wb") as f:
        f.write(b"z" * 100)
    ro = bytes(100)
    with pytest.raises(BufferError):
        backend.read_into(path, 0, ro, 100)
    with pytest.raises(BufferError):
        backend.copy_hash(ro, 0, _address(bytearray(b"q" * 100)), 10)
    assert ro == bytes(100)
