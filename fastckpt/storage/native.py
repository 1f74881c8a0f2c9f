"""fastckpt's hot I/O path: whole-shard writes and region reads with fused xxh3-64 checksums.

This is the only module that loads the C extension ``fastckpt._native_ext`` (``native/fastckpt_io.c``).
Two interchangeable backends implement :class:`IOBackend`:

* ``native`` -- the extension: worker pthreads keep several 16 MiB ``pwrite``/``pread`` requests in
  flight while the calling thread hashes the same bytes; the GIL is released throughout.
* ``python`` -- the same algorithm with ``os.pwrite``/``os.preadv`` on Python threads and the
  ``xxhash`` package's streaming xxh3-64 (which releases the GIL on large updates): ``pyio.py``.

Both produce byte-identical files and identical hashes (xxh3-64, seed 0, as
``xxhash.xxh3_64_intdigest``).  O_DIRECT is used when the buffer is 4096-aligned and long enough to
pad the last block (see :func:`aligned_buffer`), and silently replaced by buffered I/O where the
file system refuses it (EINVAL).
"""

from __future__ import annotations

import os
import threading
from typing import Protocol, Sequence

# the Python backend and the page-aligned buffers, part of this module's interface too
from .pyio import (ALIGN, DEFAULT_BLOCK_SIZE, DEFAULT_DEPTH, PythonBackend, aligned_buffer,
                   check_block_size)

__all__ = [
    "ALIGN",
    "DEFAULT_BLOCK_SIZE",
    "DEFAULT_DEPTH",
    "IOBackend",
    "NativeBackend",
    "PythonBackend",
    "aligned_buffer",
    "byte_regroup_kernels",
    "get_backend",
    "native_available",
    "native_error",
]

_BUILD_HINT = (
    "build it with: apt-get install -y libxxhash-dev (provides xxhash.h), then "
    "`pip install -e .` or `python setup.py build_ext --inplace` in the fastckpt checkout"
)

# --------------------------------------------------------------------------------------------
# loading the extension
# --------------------------------------------------------------------------------------------

_ext = None
_ext_error: str | None = None
try:
    from .. import _native_ext as _ext  # type: ignore[attr-defined, no-redef]
except Exception as e:  # ImportError, or a broken/ABI-mismatched .so
    _ext = None
    _ext_error = f"{type(e).__name__}: {e}"


def native_available() -> bool:
    """True when the C extension loaded."""
    return _ext is not None


def native_error() -> str | None:
    """Why the C extension did not load (None when it did)."""
    return None if _ext is not None else (_ext_error or "fastckpt._native_ext not loaded")


# --------------------------------------------------------------------------------------------
# the protocol
# --------------------------------------------------------------------------------------------


class IOBackend(Protocol):
    name: str  # "native" or "python"

    def write_file(self, path: str, buf, nbytes: int, ranges: Sequence[tuple[int, int]], *,
                   direct: bool = True, fsync: bool = True) -> list[int]:
        """Create/truncate ``path`` (0o644) holding exactly ``buf[0:nbytes]``.

        Returns ``[xxh3_64(buf[off:off+len]) for off, len in ranges]``, hashed while the writes
        are in flight.  O_DIRECT when ``direct`` and buf is 4096-aligned with
        ``len(buf) >= round_up(nbytes, 4096)`` (the slack past nbytes is written, then truncated).
        Preallocates nbytes; fsyncs when ``fsync``.  Errors: OSError naming path and offset.
        """
        ...

    def read_into(self, path: str, file_offset: int, buf, nbytes: int, *, direct: bool = True,
                  hash: bool = True) -> int | None:
        """Read exactly nbytes at file_offset into writable ``buf[0:nbytes]``; return their xxh3_64
        (None with ``hash=False``).

        O_DIRECT when ``direct``, buf 4096-aligned, file_offset % 4096 == 0 and
        ``len(buf) >= round_up(nbytes, 4096)`` (the slack may receive bytes past nbytes).
        A file too short raises EOFError naming the path.
        """
        ...

    def read_to(self, path: str, file_offset: int, address: int, nbytes: int, *,
                direct: bool = True, hash: bool = True) -> int | None:
        """Read exactly nbytes at file_offset into the raw memory ``[address, address+nbytes)``
        (valid, writable, kept alive by the caller; nothing outside it is written); return
        their xxh3_64, hashed as the blocks land (None with ``hash=False``). With ``direct`` and
        ``address % 4096 == file_offset % 4096``: O_DIRECT, the partial first and last pages
        through bounce pages (a load's destination tensors); else buffered. A file too short
        raises EOFError naming the path."""
        ...

    def hash(self, buf, nbytes: int) -> int:
        """xxh3_64 of buf[0:nbytes]."""
        ...

    def copy_hash(self, dst, dst_offset: int, src_address: int, nbytes: int, *,
                  hash: bool = True) -> int | None:
        """Copy ``nbytes`` from the raw address ``src_address`` (memory the caller keeps alive
        and unchanged during the call) into ``dst[dst_offset:]``; with ``hash`` also return
        their xxh3_64, computed in the same pass (else None)."""
        ...

    def copy(self, dst_address: int, src_address: int, nbytes: int) -> None:
        """memcpy between raw addresses (valid, non-overlapping) with the GIL released."""
        ...

    def copy_many(self, copies: Sequence[tuple[int, int, int]], threads: int) -> int:
        """memcpy every ``(dst_address, src_address, nbytes)`` (valid, no destination
        overlapping a source or another destination) with the GIL released, the total split
        evenly over up to ``threads`` threads (none started for less than 4 MiB a thread);
        returns the number of threads used. The staging copy of an async save."""
        ...

    def write_segments(self, path: str, nbytes: int, segments: Sequence[tuple[int, int, int]],
                       hash_ranges: Sequence[tuple[int, int]], *, direct: bool = True,
                       fsync: bool = True) -> list[int]:
        """Create/truncate ``path`` holding ``nbytes`` bytes gathered from memory: ``segments``
        are ``(file_offset, address, length)``, in order and contiguous, covering the file (the
        last may run on to the next 4096 boundary; the file is truncated after). O_DIRECT when
        every offset, address and length is a multiple of 4096. Returns the xxh3_64 of each
        ``(address, length)`` in ``hash_ranges``, computed while the requests are in flight.
        The memory must stay valid and unchanged during the call."""
        ...


# --------------------------------------------------------------------------------------------
# native backend
# --------------------------------------------------------------------------------------------


class NativeBackend:
    """The C extension (worker pthreads + fused xxh3, GIL released)."""

    name = "native"

    def __init__(self, block_size: int = DEFAULT_BLOCK_SIZE, depth: int = DEFAULT_DEPTH) -> None:
        if _ext is None:
            raise ImportError(f"fastckpt native I/O extension unavailable ({native_error()}); {_BUILD_HINT}")
        check_block_size(block_size)
        self.block_size = block_size
        self.depth = max(1, int(depth))

    def write_file(self, path, buf, nbytes, ranges, *, direct=True, fsync=True):
        return _ext.write_file(os.fspath(path), buf, nbytes, ranges, direct, fsync,
                               self.block_size, self.depth)

    def read_into(self, path, file_offset, buf, nbytes, *, direct=True, hash=True):
        return _ext.read_into(os.fspath(path), file_offset, buf, nbytes, direct, self.block_size,
                              self.depth, hash)

    def read_to(self, path, file_offset, address, nbytes, *, direct=True, hash=True):
        return _ext.read_to(os.fspath(path), file_offset, address, nbytes, direct, self.block_size,
                            self.depth, hash)

    def hash(self, buf, nbytes):
        return _ext.hash(buf, nbytes)

    def copy_hash(self, dst, dst_offset, src_address, nbytes, *, hash=True):
        return _ext.copy_hash(dst, dst_offset, src_address, nbytes, hash)

    def copy(self, dst_address, src_address, nbytes):
        _ext.copy(dst_address, src_address, nbytes)

    def copy_many(self, copies, threads):
        if not hasattr(_ext, "copy_many"):  # an extension built before it: the Python copy
            from .pyio import copy_many
            return copy_many(copies, threads)
        return _ext.copy_many(copies, threads)

    def write_segments(self, path, nbytes, segments, hash_ranges, *, direct=True, fsync=True):
        return _ext.write_segments(os.fspath(path), nbytes, segments, hash_ranges, direct, fsync,
                                   self.block_size, self.depth)

    def __repr__(self) -> str:
        return f"NativeBackend(block_size={self.block_size}, depth={self.depth})"


# --------------------------------------------------------------------------------------------
# selection
# --------------------------------------------------------------------------------------------

_instances: dict[str, IOBackend] = {}
_instances_lock = threading.Lock()


def get_backend(mode: str = "auto") -> IOBackend:
    """The I/O backend for ``mode``: "auto" (native if it loaded, else python), "require"
    (native, or ImportError saying how to build it) or "off" (python).  Instances are cached."""
    if mode not in ("auto", "require", "off"):
        raise ValueError(f"io mode must be 'auto', 'require' or 'off', got {mode!r}")
    if mode == "require" and _ext is None:
        raise ImportError(f"fastckpt native I/O extension unavailable ({native_error()}); {_BUILD_HINT}")
    name = "native" if mode != "off" and _ext is not None else "python"
    with _instances_lock:
        b = _instances.get(name)
        if b is None:
            b = NativeBackend() if name == "native" else PythonBackend()
            _instances[name] = b
        return b



# --------------------------------------------------------------------------------------------
# byte grouping kernels of the compression codec (fastckpt.storage.codec)
# --------------------------------------------------------------------------------------------


def byte_regroup_kernels():
    """``(byte_group, byte_ungroup)`` of the C extension (GIL released), or None when it did not
    load or was built before they existed; :mod:`fastckpt.storage.codec` then uses
    :func:`py_group` and :func:`py_ungroup`, which give the same bytes and refuse the same
    arguments."""
    group = getattr(_ext, "byte_group", None)
    ungroup = getattr(_ext, "byte_ungroup", None)
    return (group, ungroup) if group is not None and ungroup is not None else None


def _grouping_views(src, dst, width: int) -> tuple[memoryview, memoryview]:
    """The checks of the C kernels (before 2026-12-06 the Python ones lacked them: width 0 was
    a ZeroDivisionError, 65 accepted, a read-only destination a TypeError, and an ungroup in
    place gave wrong bytes)."""
    if not 1 <= width <= 64:
        raise ValueError(f"width must be 1..64, got {width}")
    s, d = memoryview(src).cast("B"), memoryview(dst).cast("B")
    if d.readonly:
        raise BufferError("the destination must be a writable buffer")
    if len(d) < len(s):
        raise ValueError(f"destination of {len(d)} bytes is shorter than the source ({len(s)})")
    if len(s):
        from .pyio import _address
        a, b = _address(s), _address(d)
        if a < b + len(d) and b < a + len(s):
            raise ValueError("source and destination overlap")
    return s, d


def py_group(src, dst, width: int) -> None:
    """Plane k of dst = byte k of every width-byte element of src; the len % width tail last
    (the C kernel's pure-Python twin)."""
    s, d = _grouping_views(src, dst, width)
    n = len(s)
    m = n // width
    body = m * width
    b = src if type(src) is bytes else s.tobytes()  # extended slices of bytes are C loops
    for k in range(width):
        d[k * m:(k + 1) * m] = b[k:body:width]
    d[body:n] = s[body:n]


def py_ungroup(src, dst, width: int) -> None:
    """The inverse of :func:`py_group`."""
    s, d0 = _grouping_views(src, dst, width)
    n = len(s)
    m = n // width
    body = m * width
    if type(dst) is bytearray:
        d0.release()  # (a bytearray refuses even an empty slice assignment while exported)
        d = dst
    else:
        d = bytearray(n)
    for k in range(width):
        d[k:body:width] = s[k * m:(k + 1) * m]
    d[body:n] = s[body:n]
    if d is not dst:
        d0[:n] = d
