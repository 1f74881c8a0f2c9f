"""The pure-Python I/O backend and the buffer helpers both backends share.

``PythonBackend`` runs the native backend's algorithm with ``os.pwrite``/``os.preadv`` on Python
threads and the ``xxhash`` package's streaming xxh3-64: byte-identical files, identical hashes.
It is what runs where the C extension is not built, and in CI's second pass
(``FASTCKPT_NATIVE=off``). Buffers: :func:`aligned_buffer` (page-aligned, for O_DIRECT) and raw
address views for zero-copy writes.
"""

from __future__ import annotations

import ctypes
import errno as _errno
import fcntl
import itertools
import mmap
import os
import stat
import threading
from typing import Sequence

import xxhash

ALIGN = 4096
DEFAULT_BLOCK_SIZE = 16 << 20  # per request; measured best of 1/4/8/16 MiB (native/README.md)
MAX_BLOCK_SIZE = 1 << 30  # (the native code's request arithmetic stays far from overflow)
DEFAULT_DEPTH = 4  # requests in flight (worker threads)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def _round_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


_MAP_FLAGS = mmap.MAP_PRIVATE | getattr(mmap, "MAP_ANONYMOUS", 0x20)


def aligned_buffer(nbytes: int) -> memoryview:
    """Page-aligned writable host memory (private anonymous mmap), length rounded up to 4096.

    Private, not shared: shared anonymous memory is shmem, whose first-touch faults cost more.
    No ``MADV_HUGEPAGE`` here: measured, it doubled a one-off save's CPU time. (The tensors a
    load allocates are advised since 2026-12-06, :func:`huge_pages`: with their faults taken
    by the prefault thread it now pays; on 2026-11-30, before that thread, it made a cold load
    2.4x slower, the faults and compaction inside the reads.)

    The mmap stays alive as long as the returned memoryview (``view.obj`` is the mmap).
    """
    if nbytes < 0:
        raise ValueError(f"nbytes must be >= 0, got {nbytes}")
    size = _round_up(nbytes)
    if size == 0:  # mmap cannot map 0 bytes
        return memoryview(mmap.mmap(-1, ALIGN, flags=_MAP_FLAGS))[:0]
    return memoryview(mmap.mmap(-1, size, flags=_MAP_FLAGS))


_MADV_POPULATE_WRITE = 23  # Linux >= 5.14
_libc = None
_populate_ok = True


def populate(address: int, nbytes: int) -> bool:
    """Fault in the pages of ``[address, address + nbytes)`` for writing, without changing a
    byte of them (``madvise(MADV_POPULATE_WRITE)``: a page already present is left as it is,
    an absent one is allocated as a write fault would): the first-touch faults of memory a load
    is about to fill, taken ahead of the reads on another thread instead of inside them. The
    GIL is released during the call. False (nothing done) where the kernel has no such advice
    (before Linux 5.14, not Linux) or the range is refused; the reads then fault the pages
    themselves, as before."""
    global _populate_ok
    if not _populate_ok or nbytes <= 0:
        return False
    lo = address // ALIGN * ALIGN  # madvise wants a page-aligned start; whole pages only
    got = _madvise(lo, _round_up(address + nbytes) - lo, _MADV_POPULATE_WRITE)
    if got is None or got == _errno.EINVAL:  # no libc, or an older kernel: never again
        _populate_ok = False
    return got == 0


_MADV_HUGEPAGE = 14
HUGE = 2 << 20  # a transparent huge page (x86-64, arm64 with 4 KiB pages)
#: the smallest allocation advised to huge pages: at least one whole huge page inside it
HUGE_MIN = 2 * HUGE


def huge_pages(address: int, nbytes: int) -> bool:
    """Advise the whole 2 MiB pages inside ``[address, address + nbytes)`` to transparent huge
    pages (``madvise(MADV_HUGEPAGE)``; this kernel's THP mode is "madvise"), for memory a
    restart's load allocates and fills (a fresh optimizer's moments): one fault per 2 MiB,
    taken by the prefault thread ahead of the reads (:func:`populate`), instead of 512.
    Measured (2026-12-06, ``bench_saveload.py --contenders fastckpt``, 1.5 GiB state with 1 GiB
    of new moments, runs of 3 alternating with ``FASTCKPT_THP=0``): restart load 1.09-1.10 s
    and 0.45-0.46 CPU-s/GiB against 1.19-1.22 s and 0.47-0.50 (per-run medians, 2 pairs; 4
    earlier pairs of the same advice: 1.05 vs 1.28 s, 0.43 vs 0.48), 1432 huge-page faults per
    run, no compaction stall, no fallback. ``FASTCKPT_THP=0`` off, ``=1`` on; by default off
    where the kernel reports free memory to a hypervisor (:func:`free_page_reporting`): there
    it made the restart load 1.5x slower at 3.4x the CPU (docs/benchmarks.md, 2026-12-06).
    False when nothing was advised (too small, no such advice, turned off)."""
    from ..options import huge_pages_on
    on = huge_pages_on()
    if nbytes < HUGE_MIN or not (on if on is not None else not free_page_reporting()):
        return False
    lo = (address + HUGE - 1) // HUGE * HUGE
    hi = (address + nbytes) // HUGE * HUGE
    return hi > lo and _madvise(lo, hi - lo, _MADV_HUGEPAGE) == 0


_reporting: bool | None = None
_BALLOON = "/sys/bus/virtio/drivers/virtio_balloon"
_F_REPORTING = 5  # VIRTIO_BALLOON_F_REPORTING: the guest hands free blocks back to the host


def free_page_reporting() -> bool:
    """Whether this kernel reports free memory to its hypervisor (virtio-balloon free page
    reporting): free 2 MiB blocks go back to the host, a fresh huge page is 512 host faults."""
    global _reporting
    if _reporting is None:
        _reporting = False
        try:
            for dev in os.listdir(_BALLOON):
                feats = os.path.join(_BALLOON, dev, "features")
                if dev.startswith("virtio") and os.path.exists(feats):
                    with open(feats) as f:
                        bits = f.read().strip()
                    _reporting = _reporting or bits[_F_REPORTING:_F_REPORTING + 1] == "1"
        except OSError:
            pass
    return _reporting


def _madvise(address: int, nbytes: int, advice: int) -> int | None:
    """``madvise``: 0, the errno of a refusal, or None where there is no libc to ask."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL(None, use_errno=True)
            _libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
            _libc.madvise.restype = ctypes.c_int
        except (OSError, AttributeError):
            _libc = False
    if not _libc:
        return None
    return 0 if _libc.madvise(address, nbytes, advice) == 0 else ctypes.get_errno()


COPY_MIN_SHARE = 4 << 20  # copy_many starts no thread for less than this


def split_shares(copies: Sequence[tuple[int, int, int]], threads: int) -> list[list[tuple]]:
    """``copies`` ((dst, src, nbytes) ranges) cut into at most ``threads`` lists of equal byte
    counts (cuts on 64-byte boundaries; a range may be split between two), at least
    ``COPY_MIN_SHARE`` bytes each: the split ``copy_many`` runs (native/fastckpt_io.c does the
    same in C)."""
    total = sum(c[2] for c in copies)
    want = max(1, min(int(threads), 64, total // COPY_MIN_SHARE))
    each = (total // want + 63) & ~63
    shares: list[list[tuple]] = [[] for _ in range(want)]
    pos = 0
    for d, s, n in copies:
        a = pos
        while a < pos + n:
            k = min(a // each, want - 1) if each else 0
            z = min(pos + n, (k + 1) * each) if k < want - 1 else pos + n
            shares[k].append((d + (a - pos), s + (a - pos), z - a))
            a = z
        pos += n
    return shares


def check_block_size(block_size: int) -> None:
    if block_size <= 0 or block_size % ALIGN or block_size > MAX_BLOCK_SIZE:
        raise ValueError("block_size must be a positive multiple of 4096, at most 1 GiB")


def copy_many(copies: Sequence[tuple[int, int, int]], threads: int) -> int:
    """``IOBackend.copy_many`` in Python: :func:`split_shares`, each share's ranges by
    ``ctypes.memmove`` (which releases the GIL) on its own thread; the number used."""
    copies = [tuple(c) for c in copies]  # (an iterator was used up by the checks below)
    for i, c in enumerate(copies):
        if len(c) != 3:
            raise ValueError(f"copy_many: copy {i} is not (dst, src, nbytes)")
        if c[2] < 0 or (c[2] and (not c[0] or not c[1])):
            raise ValueError(f"copy_many: copy {i} has a null address or a negative length")
    shares = split_shares(copies, threads)

    def run(share):
        for d, s, n in share:
            ctypes.memmove(d, s, n)
    workers = [threading.Thread(target=run, args=(sh,), daemon=True) for sh in shares[1:]]
    try:
        for w in workers:
            w.start()
        run(shares[0])
    finally:  # no copy may go on into buffers the caller hands out after an error
        for w in workers:
            if w.ident is not None:
                w.join()  # memmove of memory the caller holds: always ends
    return len(shares)


class _PyBuffer(ctypes.Structure):
    _fields_ = [
        ("buf", ctypes.c_void_p),
        ("obj", ctypes.c_void_p),
        ("len", ctypes.c_ssize_t),
        ("itemsize", ctypes.c_ssize_t),
        ("readonly", ctypes.c_int),
        ("ndim", ctypes.c_int),
        ("format", ctypes.c_char_p),
        ("shape", ctypes.c_void_p),
        ("strides", ctypes.c_void_p),
        ("suboffsets", ctypes.c_void_p),
        ("internal", ctypes.c_void_p),
    ]


_PyObject_GetBuffer = ctypes.pythonapi.PyObject_GetBuffer
_PyObject_GetBuffer.argtypes = [ctypes.py_object, ctypes.POINTER(_PyBuffer), ctypes.c_int]
_PyObject_GetBuffer.restype = ctypes.c_int
_PyBuffer_Release = ctypes.pythonapi.PyBuffer_Release
_PyBuffer_Release.argtypes = [ctypes.POINTER(_PyBuffer)]
_PyBuffer_Release.restype = None


def _address(obj) -> int:
    """Address of the first byte of a buffer-protocol object (read-only ones too)."""
    view = _PyBuffer()
    if _PyObject_GetBuffer(obj, ctypes.byref(view), 0) != 0:  # pragma: no cover - raises instead
        raise BufferError("cannot get buffer")
    try:
        return view.buf or 0
    finally:
        _PyBuffer_Release(ctypes.byref(view))


def _raw_view(address: int, nbytes: int) -> memoryview:
    """A byte view of raw memory (no copy); empty for nbytes == 0."""
    if nbytes == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")


def _byte_view(buf, *, writable: bool = False) -> memoryview:
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if not mv.c_contiguous:
        _address(buf)  # (the exporter's own error for a plain-bytes request, as native gets)
        raise BufferError("buf must be a C-contiguous buffer")
    if writable and mv.readonly:
        raise BufferError("buf must be a writable buffer")
    if mv.ndim != 1 or mv.format != "B":
        mv = mv.cast("B")
    return mv


def _check_nbytes(mv: memoryview, nbytes: int) -> None:
    if nbytes < 0 or nbytes > mv.nbytes:
        raise ValueError(f"nbytes={nbytes} outside buffer of {mv.nbytes} bytes")


def _check_ranges(ranges: Sequence[tuple[int, int]], nbytes: int) -> list[tuple[int, int]]:
    out = []
    for r in ranges:
        off, ln = r
        off, ln = int(off), int(ln)
        if off < 0 or ln < 0 or off > nbytes or ln > nbytes - off:
            raise ValueError(f"range ({off}, {ln}) outside [0, {nbytes})")
        out.append((off, ln))
    return out


def _os_error(err: int, what: str, path: str, offset: int | None = None) -> OSError:
    msg = f"{os.strerror(err)}: {what} {path}"
    if offset is not None:
        msg += f" at offset {offset}"
    return OSError(err, msg)


def _open(path: str, flags: int, direct: bool) -> tuple[int, bool]:
    """Open with O_DIRECT when ``direct`` and the file system takes it (EINVAL: without);
    (fd, whether O_DIRECT is on). Errors name the path."""
    if direct:
        try:
            return os.open(path, flags | _O_DIRECT, 0o644), True
        except OSError as e:
            if e.errno != _errno.EINVAL:
                raise _os_error(e.errno, "opening", path) from None
    try:
        return os.open(path, flags, 0o644), False
    except OSError as e:
        raise _os_error(e.errno, "opening", path) from None


def _eof_error(path: str, nbytes: int, file_offset: int, size: int) -> EOFError:
    return EOFError(f"{path}: expected {nbytes} bytes at offset {file_offset}, file ended at {size}")


# --------------------------------------------------------------------------------------------
# pure-Python backend
# --------------------------------------------------------------------------------------------


class _Job:
    """State shared by the I/O threads of one call."""

    def __init__(self, fd: int, direct: bool, nblocks: int) -> None:
        self.fd = fd
        self.direct = direct
        self.next = itertools.count()  # next() is atomic under the GIL
        self.nblocks = nblocks
        self.lock = threading.Lock()
        self.cv = threading.Condition(self.lock)
        self.done = [False] * nblocks
        self.failed = False
        self.err: tuple[int, int] | None = None  # (errno, file offset)
        self.eof = False

    def fail(self, err: int, off: int, eof: bool = False) -> None:
        with self.cv:
            if not self.failed:
                self.failed = True
                self.err = (err, off)
                self.eof = eof
            self.cv.notify_all()

    def drop_direct(self) -> bool:
        with self.lock:
            if self.direct:
                try:
                    fl = fcntl.fcntl(self.fd, fcntl.F_GETFL)
                    fcntl.fcntl(self.fd, fcntl.F_SETFL, fl & ~_O_DIRECT)
                except OSError:
                    return False
                self.direct = False
            return True


class PythonBackend:
    """Pure Python: os.pwrite/os.preadv on threads + xxhash streaming; same files, same hashes."""

    name = "python"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, depth: int = DEFAULT_DEPTH) -> None:
        check_block_size(block_size)
        self.block_size = block_size
        self.depth = max(1, int(depth))

    # -- helpers --------------------------------------------------------------------------

    def _run(self, job: _Job, worker, main) -> None:
        """Run worker() on up to `depth` threads (inline for a single block) while main() runs here."""
        nthreads = min(self.depth, job.nblocks) if job.nblocks > 1 else 0
        started = []
        for i in range(nthreads):
            t = threading.Thread(target=worker, name=f"fastckpt-io-{i}", daemon=True)
            try:
                t.start()
            except RuntimeError:  # cannot start a thread: do with what we have
                break
            started.append(t)
        if not started:
            worker()
            if not job.failed:
                main()
            return
        try:
            main()
        except BaseException:
            with job.cv:
                job.failed = True  # stop the workers; the exception propagates
            raise
        finally:
            for t in started:
                t.join()

    # -- write ----------------------------------------------------------------------------

    def write_file(self, path, buf, nbytes, ranges, *, direct=True, fsync=True):
        # a buffer is one segment of memory: the same path as a gathered write
        mv = _byte_view(buf)
        _check_nbytes(mv, nbytes)
        rlist = _check_ranges(ranges, nbytes)
        addr = _address(mv) if mv.nbytes else 0
        span = _round_up(nbytes) if mv.nbytes >= _round_up(nbytes) and addr % ALIGN == 0 \
            else nbytes
        segments = [(0, addr, span)] if nbytes else []
        return self.write_segments(path, nbytes, segments, [(addr + o, n) for o, n in rlist],
                                   direct=direct, fsync=fsync)

    # -- read -----------------------------------------------------------------------------

    def read_into(self, path, file_offset, buf, nbytes, *, direct=True, hash=True):
        path = os.fspath(path)
        mv = _byte_view(buf, writable=True)
        _check_nbytes(mv, nbytes)
        if file_offset < 0:
            raise ValueError("file_offset must be >= 0")
        use_direct = bool(direct and _O_DIRECT and nbytes > 0 and file_offset % ALIGN == 0
                          and mv.nbytes >= _round_up(nbytes) and _address(mv) % ALIGN == 0)
        # never through a link; a FIFO in place of a shard must not block the open; then
        # only a regular file is read (as the native backend)
        flags = os.O_RDONLY | _O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | os.O_NONBLOCK
        fd, use_direct = _open(path, flags, use_direct)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise _os_error(_errno.EINVAL, "opening (not a regular file)", path)
            size = st.st_size
            if size < file_offset + nbytes:
                raise _eof_error(path, nbytes, file_offset, size)
            if nbytes == 0:
                return xxhash.xxh3_64_intdigest(b"") if hash else None
            io_len = _round_up(nbytes) if use_direct else nbytes
            bs = self.block_size
            job = _Job(fd, use_direct, (io_len + bs - 1) // bs)
            hasher = xxhash.xxh3_64()

            def worker() -> None:
                while not job.failed:
                    i = next(job.next)
                    if i >= job.nblocks:
                        return
                    start = i * bs
                    end = min(start + bs, io_len)
                    need = min(start + bs, nbytes) - start
                    got = 0
                    retried = False
                    while start + got < end:
                        was_direct = job.direct
                        try:
                            n = os.preadv(fd, [mv[start + got:end]], file_offset + start + got)
                        except OSError as e:
                            if e.errno == _errno.EINVAL and was_direct and not retried:
                                retried = True
                                if job.drop_direct():
                                    continue
                            job.fail(e.errno, file_offset + start + got)
                            return
                        if n == 0:
                            break
                        got += n
                        if was_direct and n % ALIGN:
                            break  # short O_DIRECT read: end of file
                    if got < need:
                        job.fail(0, file_offset + start + got, eof=True)
                        return
                    with job.cv:
                        job.done[i] = True
                        job.cv.notify_all()

            def main() -> None:
                for i in range(job.nblocks if hash else 0):
                    with job.cv:
                        while not job.done[i] and not job.failed:
                            job.cv.wait()
                        if job.failed:
                            return
                    start = i * bs
                    end = min(start + bs, nbytes)
                    if end > start:
                        hasher.update(mv[start:end])

            self._run(job, worker, main)
            if job.err is not None:
                if job.eof:
                    raise _eof_error(path, nbytes, file_offset, os.fstat(fd).st_size)
                raise _os_error(job.err[0], "reading", path, job.err[1])
            return hasher.intdigest() if hash else None
        finally:
            os.close(fd)

    def read_to(self, path, file_offset, address, nbytes, *, direct=True, hash=True):
        """Read exactly ``nbytes`` at ``file_offset`` into the raw memory ``[address,
        address + nbytes)`` (kept alive by the caller); their xxh3_64 (None with ``hash=False``).
        With ``direct`` and ``address`` in phase with ``file_offset`` modulo 4096, the whole
        pages with O_DIRECT straight in and the partial first and last pages buffered (the
        native backend reads those with O_DIRECT too, into bounce pages); else buffered."""
        if file_offset < 0 or nbytes < 0 or (nbytes and not address):
            raise ValueError("file_offset, address or nbytes out of range")
        end = file_offset + nbytes
        lo, hi = _round_up(file_offset), end // ALIGN * ALIGN
        if not (direct and nbytes and (address - file_offset) % ALIGN == 0 and hi > lo):
            self.read_into(path, file_offset, _raw_view(address, nbytes) if nbytes else
                           bytearray(0), nbytes, direct=False, hash=False)
        else:
            for a, z, d in ((lo, hi, True), (file_offset, lo, False), (hi, end, False)):
                if z > a:
                    self.read_into(path, a, _raw_view(address + a - file_offset, z - a), z - a,
                                   direct=d, hash=False)
        return self.hash(_raw_view(address, nbytes), nbytes) if hash else None

    def hash(self, buf, nbytes):
        mv = _byte_view(buf)
        _check_nbytes(mv, nbytes)
        return xxhash.xxh3_64_intdigest(mv[:nbytes])

    def write_segments(self, path, nbytes, segments, hash_ranges, *, direct=True, fsync=True):
        path = os.fspath(path)
        if nbytes < 0:
            raise ValueError("nbytes must be >= 0")
        end, aligned, reqs, bs = 0, True, [], self.block_size
        hash_ranges = list(hash_ranges)  # (an iterator was used up by the checks below)
        for i, (off, addr, ln) in enumerate(segments):
            if off != end or ln < 0 or ln > _round_up(nbytes) - off or addr < 0 or (
                    ln and not addr):
                raise ValueError(f"segment {i} (offset {off}, length {ln}) does not continue the "
                                 f"previous one at {end} within the file's {nbytes} bytes")
            end = off + ln
            aligned = aligned and not (off % ALIGN or addr % ALIGN or ln % ALIGN)
            reqs += [(off + k, addr + k, min(bs, ln - k)) for k in range(0, ln, bs)]
        if end < nbytes or end > _round_up(nbytes):
            raise ValueError(f"segments cover {end} bytes, the file has {nbytes}")
        for addr, ln in hash_ranges:
            if ln < 0 or (ln and not addr):
                raise ValueError("hash range with a null address or negative length")
        use_direct = bool(direct and _O_DIRECT and aligned and nbytes > 0)
        flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | _O_CLOEXEC
        fd, use_direct = _open(path, flags, use_direct)
        try:
            if nbytes > 0:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    if e.errno not in (_errno.EOPNOTSUPP, _errno.ENOSYS, _errno.EINVAL):
                        raise _os_error(e.errno, "preallocating", path, 0) from None
            job = _Job(fd, use_direct, len(reqs))
            out: list = []

            def worker() -> None:
                while not job.failed:
                    i = next(job.next)
                    if i >= job.nblocks:
                        return
                    off, addr, ln = reqs[i]
                    view = _raw_view(addr, ln)
                    retried = False
                    while view:
                        try:
                            n = os.pwrite(fd, view, off)
                        except OSError as e:
                            if e.errno == _errno.EINVAL and job.direct and not retried:
                                retried = True
                                if job.drop_direct():
                                    continue
                            job.fail(e.errno, off)
                            return
                        if n == 0:
                            job.fail(_errno.EIO, off)
                            return
                        view = view[n:]
                        off += n

            def main() -> None:
                h = xxhash.xxh3_64_intdigest
                out.extend(h(_raw_view(a, ln)) for a, ln in hash_ranges)

            self._run(job, worker, main)
            if job.err is not None:
                raise _os_error(job.err[0], "writing", path, job.err[1])
            if end != nbytes:
                try:
                    os.ftruncate(fd, nbytes)
                except OSError as e:
                    raise _os_error(e.errno, "truncating", path, nbytes) from None
            if fsync:
                try:
                    os.fsync(fd)
                except OSError as e:
                    raise _os_error(e.errno, "syncing", path) from None
        finally:
            os.close(fd)
        return out

    def copy(self, dst_address, src_address, nbytes):
        if nbytes < 0 or (nbytes and (not dst_address or not src_address)):
            raise ValueError("copy: null address or negative length")
        if nbytes:
            ctypes.memmove(dst_address, src_address, nbytes)

    def copy_many(self, copies, threads):
        return copy_many(copies, threads)

    def copy_hash(self, dst, dst_offset, src_address, nbytes, *, hash=True):
        mv = _byte_view(dst, writable=True)
        if dst_offset < 0 or nbytes < 0 or dst_offset > mv.nbytes or nbytes > mv.nbytes - dst_offset \
                or (nbytes and not src_address):
            raise ValueError(f"copy of {nbytes} bytes to offset {dst_offset} outside buffer of "
                             f"{mv.nbytes} bytes")
        if nbytes:  # ctypes releases the GIL around the call
            ctypes.memmove(_address(mv) + dst_offset, src_address, nbytes)
        return xxhash.xxh3_64_intdigest(mv[dst_offset:dst_offset + nbytes]) if hash else None

    def __repr__(self) -> str:
        return f"PythonBackend(block_size={self.block_size}, depth={self.depth})"
