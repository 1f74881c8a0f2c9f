"""Staging: splitting a rank's chunks into shard files ("pieces") and copying them into a pool
of reusable, page-aligned host buffers.

Each piece is one shard file and is staged into one buffer laid out exactly as the file, so it
is written with direct I/O in one call. The pool:

* **uncapped** (default for a ``Checkpointer``): one buffer per piece, allocated on the first
  save and reused by every later one (no allocation, no page faults, no growth). ``save``
  returns as soon as every piece is copied: the stall is one memcpy of the rank's state.
* **capped** (``staging_cap_bytes``, and every one-off ``fastckpt.save``): at most
  ``max(2, cap // piece)`` buffers; pieces beyond them are staged as soon as the background
  writer has written (and released) an earlier one. Host memory stays under the cap and the
  copy of one piece overlaps the write of the previous one; the training stall grows with the
  overflow (about overflow / write bandwidth).

Thread-safety: ``StagingPool`` is used by one training thread (acquire) and one writer thread
(release).
"""

from __future__ import annotations

import bisect
import dataclasses
import queue
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import FastCkptError
from ..manifest import schema as fmt
from ..storage.pyio import _address, aligned_buffer

MIN_PIECE = 1 << 20
PIECE_MIN_DEFAULT = 64 << 20
PIECE_MAX_DEFAULT = 256 << 20
# a capped pool holds this many pieces: two being written (the writer keeps two files in
# flight) while the next two are copied
CAPPED_BUFFERS = 4
FIRST_PIECE = 16 << 20  # see first_piece_bytes


@dataclass(frozen=True)
class Slot:
    """One chunk (or a row range of one, for chunks larger than a piece) in a piece."""
    spec: object  # ChunkSpec of the stored box (sub-box for a split chunk)
    key: tuple  # (fqn, offsets) of the rank's local tensor holding the data
    row0: int  # first row of the local tensor (dim 0) this slot holds
    offset: int  # byte offset in the piece's file


@dataclass(frozen=True)
class Piece:
    index: int
    slots: tuple
    size: int  # file size in bytes


def piece_bytes(total: int, cap: int | None) -> int:
    """The target size of one shard file for a rank holding ``total`` bytes."""
    p = min(PIECE_MAX_DEFAULT, max(PIECE_MIN_DEFAULT, total // 8))
    if cap is not None:
        p = min(p, max(MIN_PIECE, cap // CAPPED_BUFFERS))
    return fmt.align_up(p)


def first_piece_bytes(limit: int) -> int:
    """The first piece of a streamed (capped) save: small, so the first write starts after a
    short copy instead of a whole piece's (the copy into never-touched buffers is the slow
    one)."""
    return max(MIN_PIECE, min(limit, FIRST_PIECE))


def split(chunks, limit: int, first: int | None = None,
          phase: dict | None = None) -> list[Piece]:
    """Pack chunks (in order) into pieces of at most ``limit`` bytes (the first one at most
    ``first`` when given); a larger chunk is split along dim 0 into row ranges (each a box of
    the global tensor, so the manifest and DCP's planner see them as ordinary chunks). A single
    row larger than the limit gets a piece of its own.

    ``phase`` (zero-copy saves): key -> the address of the rank's tensor modulo 4096, for the
    tensors written straight from their memory. Such a chunk is placed at a file offset with the
    same remainder, so all of it but its first and last partial pages can go to the file with
    O_DIRECT from where it lies (:func:`gather_piece`)."""
    from dataclasses import replace
    slots_by_piece: list[list[tuple]] = [[]]
    used = 0

    def cur_limit() -> int:
        return first if first is not None and len(slots_by_piece) == 1 else limit

    def add(spec, key, row0):
        nonlocal used
        align = fmt.ALIGN if spec.nbytes >= fmt.SMALL_CHUNK else fmt.SMALL_ALIGN
        ph = 0
        if phase is not None and key in phase and spec.nbytes >= fmt.SMALL_CHUNK:
            ph = (phase[key] + row0 * (spec.nbytes // max(1, spec.sizes[0]))) % fmt.ALIGN
        pos = fmt.align_up(used, align) + ph
        if slots_by_piece[-1] and pos + spec.nbytes > cur_limit():
            slots_by_piece.append([])
            pos = ph
        slots_by_piece[-1].append((spec, key, row0, pos))
        used = pos + spec.nbytes

    def next_limit() -> int:  # the limit of the piece the next chunk will start
        return cur_limit() if not slots_by_piece[-1] else limit

    for spec in chunks:
        key = (spec.fqn, spec.offsets)
        if spec.nbytes <= next_limit() or not spec.sizes or spec.sizes[0] <= 1:
            add(spec, key, 0)
            continue
        rows = spec.sizes[0]
        row_bytes = spec.nbytes // rows
        r0 = 0
        while r0 < rows:
            n = min(max(1, next_limit() // row_bytes), rows - r0)
            sub = replace(spec, offsets=(spec.offsets[0] + r0,) + tuple(spec.offsets[1:]),
                          sizes=(n,) + tuple(spec.sizes[1:]), nbytes=n * row_bytes)
            add(sub, key, r0)
            r0 += n
    pieces = []
    for i, slots in enumerate(s for s in slots_by_piece if s):
        size = max(off + spec.nbytes for spec, _, _, off in slots)
        pieces.append(Piece(i, tuple(Slot(*s) for s in slots), size))
    return pieces


class StagingPool:
    """Reusable page-aligned host buffers (see the module docstring). With a ``pinner`` (a
    :class:`fastckpt.engine.device.DeviceStager`, for states holding CUDA tensors) every buffer
    is page-locked once and unregistered before it is freed.

    A capped pool lends each buffer as a view of its own (``acquire``) and takes back only the
    views of the current save (``release``): a write left to its thread by a failed save (a
    hung mount) that returns later cannot give its buffer back a second time, into a later save
    that has lent it again (before 2026-12-06 two of that save's pieces were then staged into
    one buffer, and the shard of the first was written with the second's bytes)."""

    def __init__(self) -> None:
        self._dedicated: list[memoryview] = []
        self._shared: list[memoryview] = []
        self._free: queue.Queue = queue.Queue()
        self._lent: dict[int, tuple] = {}  # id(view) -> (view, buffer): this save's loans
        self.capped = False
        self._pinner = None

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self._dedicated) + sum(len(b) for b in self._shared)

    @staticmethod
    def will_cap(total: int, cap: int | None) -> bool:
        """Whether a rank holding ``total`` bytes will stream through a capped pool."""
        return cap is not None and total > cap

    def _new(self, size: int) -> memoryview:
        buf = aligned_buffer(size)
        if self._pinner is not None:
            self._pinner.pin(_address(buf), len(buf))
        return buf

    def _drop(self, bufs: list) -> None:
        if self._pinner is not None:
            for b in bufs:
                if b is not None and len(b):
                    self._pinner.unpin(_address(b))
        bufs.clear()

    def close(self) -> None:
        """Unpin and free every buffer."""
        self._drop(self._dedicated)
        self._drop(self._shared)
        self._free = queue.Queue()

    def prepare(self, sizes: list[int], cap: int | None, pinner=None) -> None:
        """Size the pool for the next save's pieces (no save may be in flight); ``pinner``:
        pin every buffer (kept pinned by later saves)."""
        if pinner is not None and self._pinner is None:
            self._pinner = pinner
            for b in self._dedicated + self._shared:
                if len(b):
                    pinner.pin(_address(b), len(b))
        need = sum(fmt.align_up(max(s, 1)) for s in sizes)
        if cap is None or need <= cap:
            self.capped = False
            self._drop(self._shared)
            self._free = queue.Queue()
            bufs = self._dedicated
            for i, s in enumerate(sizes):
                want = fmt.align_up(max(s, 1))
                if i >= len(bufs):
                    bufs.append(self._new(want))
                elif len(bufs[i]) < want:
                    # free it before allocating; a failed allocation leaves no hole behind
                    # (before 2026-12-06 a None stayed, and every later save raised TypeError)
                    rest = bufs[i:]
                    del bufs[i:]
                    self._drop(rest)
                    bufs.append(self._new(want))
            extra = bufs[len(sizes):]
            del bufs[len(sizes):]
            self._drop(extra)
            return
        self.capped = True
        self._drop(self._dedicated)
        size = fmt.align_up(max(sizes))
        n = max(2, min(len(sizes), cap // size))
        if len(self._shared) != n or any(len(b) < size for b in self._shared):
            self._drop(self._shared)
            self._shared = [self._new(size) for _ in range(n)]
        self._free = queue.Queue()
        self._lent = {}  # (an earlier save's loans, still out, are not taken back)
        for b in self._shared:
            self._free.put(b)

    def acquire(self, index: int, failed: Any = None) -> memoryview:
        """The buffer for piece ``index``; in capped mode, waits for one to be released, or
        until ``failed`` (a ``threading.Event``: the save is over) is set: then raises."""
        if not self.capped:
            return self._dedicated[index]
        while True:
            try:
                buf = self._free.get(timeout=0.1)
            except queue.Empty:
                if failed is not None and failed.is_set():
                    raise FastCkptError("the save ended (failed in the writer) while staging "
                                        "waited for a buffer") from None
                continue
            view = buf[:]
            self._lent[id(view)] = (view, buf)
            return view

    def release(self, buf) -> None:
        """Take back a view ``acquire`` lent for the current save (anything else: nothing)."""
        if self.capped and isinstance(buf, memoryview):  # not a zero-copy save's Gathered
            loan = self._lent.pop(id(buf), None)
            if loan is not None and loan[0] is buf:
                self._free.put(loan[1])


def shard_pieces(plan: Any, data: dict, zero_copy: bool, cap: int | None,
                 pool: "StagingPool") -> Any:
    """(training thread) ``plan`` with the rank's shard files: zero-copy ones place each large
    contiguous CPU chunk in phase with its memory; pooled ones fit the pool (a capped pool
    streams a small first piece)."""
    total = sum(c.nbytes for c in plan.my_chunks)
    if zero_copy:
        phase = {k: t.data_ptr() % fmt.ALIGN for k, t in data.items()
                 if t.device.type == "cpu" and t.is_contiguous()
                 and t.nbytes >= fmt.SMALL_CHUNK}
        pieces = split(plan.my_chunks, piece_bytes(total, None), phase=phase)
    else:
        limit = piece_bytes(total, cap)
        pieces = split(plan.my_chunks, limit, first=first_piece_bytes(limit)
                       if pool.will_cap(total, cap) else None)
    return dataclasses.replace(plan, pieces=tuple(pieces))


def stage_piece(piece: Piece, buf: memoryview, data: dict, io=None,
                device=None, copies: list | None = None) -> list[int] | None:
    """Copy a piece's slots into ``buf`` at their file offsets; zero the alignment gaps so the
    file's bytes are deterministic.

    With ``io`` (an I/O backend: the capped pool and one-off saves, where the copy overlaps the
    writer), contiguous CPU tensors are copied by ``io.copy_hash``: one thread, GIL released,
    each chunk's xxh3 computed on the bytes just copied while they are in cache, so the writer
    does not read them again; returns the slots' hashes. Without ``io`` (an uncapped pool, where
    the copy is the training stall) returns None: the writer hashes; with ``copies`` (a list)
    each contiguous CPU slot is appended to it as ``(dst_address, src_address, nbytes)`` for
    the caller's one :func:`copy_all` of every piece, the rest is copied by torch here.

    ``device`` (a :class:`fastckpt._device.DeviceStager`): device tensors are queued on its
    side stream instead (the caller collects the piece's event with ``device.end_piece()``);
    such a piece's hashes are left to the writer, which reads the buffer after the event.
    """
    if device is not None and any(s.spec.nbytes and device.backend.is_device(data[s.key])
                                  for s in piece.slots):
        io = None
    else:
        device = None
    hashes: list[int] | None = [] if io is not None else None
    if piece.size == 0:  # only empty tensors: an empty file
        if hashes is not None:
            hashes = [io.hash(b"", 0) for _ in piece.slots]
        return hashes
    dst = torch.frombuffer(buf, dtype=torch.uint8, count=fmt.align_up(piece.size))
    pos = 0
    for slot in piece.slots:
        n = slot.spec.nbytes
        if slot.offset > pos:
            dst[pos:slot.offset].zero_()
        src = _slot_source(slot, data) if n else None
        if hashes is None:
            if n and device is not None and device.backend.is_device(src):
                device.copy(dst[slot.offset:slot.offset + n], src)
            elif n and copies is not None and src.device.type == "cpu" and src.is_contiguous():
                copies.append((_address(buf) + slot.offset, src.data_ptr(), n))
            elif n:
                _copy_typed(dst[slot.offset:slot.offset + n], src)
        elif n and src.device.type == "cpu" and src.is_contiguous():
            hashes.append(io.copy_hash(buf, slot.offset, src.data_ptr(), n))
        else:
            if n:  # GPU or strided: torch copies, then the hash of the staged bytes
                dst[slot.offset:slot.offset + n].copy_(src.contiguous().reshape(-1).view(torch.uint8))
            hashes.append(io.hash(buf[slot.offset:slot.offset + n], n))
        pos = slot.offset + n
    return hashes


def copy_threads(option: int | None) -> int:
    """The staging copy's thread count: ``option``, else torch's intra-op threads (<= 16)."""
    return option if option is not None else max(1, min(16, torch.get_num_threads()))


def copy_all(io, copies: list, threads: int) -> None:
    """The staging copy of an uncapped save (the training stall): every contiguous CPU slot of
    every piece in one ``io.copy_many``, split over ``threads`` threads. On the build VM, 1.5
    GiB of 64 MiB tensors: 0.09 s on 2 threads, 0.16-0.17 s on one; glibc's ``memcpy`` 0.24-0.30
    s on one thread, torch's ``copy_`` on its 2 intra-op threads 0.15 s (docs/benchmarks.md,
    the async stall)."""
    io.copy_many(copies, threads)


def _copy_typed(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src`` into the bytes ``dst`` through a view of ``dst`` with src's dtype and shape:
    torch's typed copy kernels measured about 12% faster here than its byte copy (1.5 GiB fp32:
    0.102 vs 0.115 s), and a strided source is copied without a contiguous temporary."""
    try:
        typed = dst.view(src.dtype).view(src.shape)
    except (RuntimeError, TypeError):  # a dtype with no byte view: copy the bytes
        dst.copy_(src.contiguous().reshape(-1).view(torch.uint8))
        return
    typed.copy_(src)


@dataclass
class Gathered:
    """A piece of a zero-copy save: where each part of its file comes from."""
    segments: list  # (file_offset, address, length): tensor memory or the bounce buffer
    hash_ranges: list  # (address, length) of each slot's bytes, in slot order
    bounce: memoryview  # holds gaps, small/strided/GPU chunks and the big ones' edge pages
    direct_bytes: int  # bytes written straight from tensor memory


def _slot_source(slot: Slot, data: dict):
    src = data[slot.key]
    if slot.row0 or src.shape[:1] != slot.spec.sizes[:1]:
        src = src.narrow(0, slot.row0, slot.spec.sizes[0])
    return src


def gather_piece(piece: Piece, data: dict, io) -> Gathered:
    """Plan a piece's file for :meth:`write_segments` without staging it: the page-aligned body
    of every chunk placed in phase with its memory (see :func:`split`) is written from the
    tensor itself; the rest of the file (gaps, small, strided or GPU chunks, the partial first
    and last pages of the big ones) is copied into one small page-aligned bounce buffer."""
    A = fmt.ALIGN
    io_len = fmt.align_up(piece.size)
    bodies = []  # (file_lo, file_hi, address of file_lo)
    srcs = []
    for slot in piece.slots:
        n = slot.spec.nbytes
        src = _slot_source(slot, data) if n else None
        srcs.append(src)
        if not n or src.device.type != "cpu" or not src.is_contiguous():
            continue
        addr = src.data_ptr()
        lo, hi = fmt.align_up(slot.offset), (slot.offset + n) // A * A
        if (addr - slot.offset) % A == 0 and hi - lo >= A:
            bodies.append((lo, hi, addr + (lo - slot.offset)))
    # the bounce regions: the file minus the bodies, each mapped to a place in `bounce`
    regions, pos = [], 0  # (file_lo, file_hi, bounce_offset)
    boff = 0
    for lo, hi, _ in bodies + [(io_len, io_len, 0)]:
        if lo > pos:
            regions.append((pos, lo, boff))
            boff += lo - pos
        pos = hi
    bounce = aligned_buffer(boff)
    base = _address(bounce) if boff else 0

    starts = [lo for lo, _, _ in regions]

    def overlaps(a: int, z: int):  # (file_lo, file_hi, bounce offset) of [a, z) in the regions
        i = max(0, bisect.bisect_right(starts, a) - 1)
        while i < len(regions) and regions[i][0] < z:
            lo, hi, b = regions[i]
            x, y = max(lo, a), min(hi, z)
            if y > x:
                yield x, y, b + (x - lo)
            i += 1

    hash_ranges = []
    dst = torch.frombuffer(bounce, dtype=torch.uint8, count=boff) if boff else None
    for slot, src in zip(piece.slots, srcs):
        n = slot.spec.nbytes
        if not n:
            hash_ranges.append((0, 0))
            continue
        if src.device.type == "cpu" and src.is_contiguous():
            addr = src.data_ptr()
            hash_ranges.append((addr, n))
            # copy the parts of the slot that fall in bounce regions (a region never splits
            # inside a body, so each overlap is one contiguous run)
            for a, z, at in overlaps(slot.offset, slot.offset + n):
                io.copy(base + at, addr + (a - slot.offset), z - a)
        else:  # no body: the whole slot lies in one region
            (_, _, at), = overlaps(slot.offset, slot.offset + n)
            dst[at:at + n].copy_(src.contiguous().reshape(-1).view(torch.uint8))
            hash_ranges.append((base + at, n))
    segments = sorted([(lo, base + b, hi - lo) for lo, hi, b in regions]
                      + [(lo, addr, hi - lo) for lo, hi, addr in bodies])
    return Gathered(segments, hash_ranges, bounce, sum(hi - lo for lo, hi, _ in bodies))
