"""Verification primitives of a step's files against its manifest. Torch-free.

``first_overlap`` is validation's check that a tensor's chunks do not overlap (bounded for
any manifest). ``check_layout`` finds what validation (``schema.validate_body``) leaves to a
verification: chunks of different tensors that share bytes of a file. ``verify_file`` re-reads
one shard file in blocks and checks every chunk's xxh3-64 and that the alignment padding
between chunks is zero: together, every byte of the file. A compressed chunk's checksum covers
its stored bytes; ``verify_file`` also decodes each of its zstd frames as the bytes stream by
(:class:`_Frames`), so a chunk that matches its checksum but does not decode (a writer's bug, a
crafted file) is named too. The engine's reader checks the same checksum with
``checksum_matches`` before it uses a chunk.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from dataclasses import asdict, dataclass
from typing import Callable

import xxhash

from ..errors import NotRegularFileError, StorageError, StorageTimeoutError
from ..storage import Storage
from ..storage.native import aligned_buffer
from . import schema as fmt

ProgressFn = Callable[[int], None]


def checksum_matches(h: int, chunk: dict) -> bool:
    """Whether ``h`` (an xxh3-64) is the chunk's recorded checksum."""
    return fmt.hexdigest(h) == chunk["checksum"]


@dataclass
class Problem:
    """One thing wrong with a checkpoint. ``offset``/``length`` are bytes within ``file``."""
    kind: str  # manifest | missing | size | checksum | padding | truncated | decode | read
    message: str
    file: str | None = None
    tensor: str | None = None
    offset: int | None = None
    length: int | None = None
    rank: int | None = None

    def __str__(self) -> str:
        parts = []
        if self.file:
            parts.append(f"file {self.file}")
        if self.tensor is not None:
            parts.append(f"tensor {self.tensor!r}")
        if self.offset is not None:
            if self.length and self.length > 1:
                last = self.offset + self.length - 1
                parts.append(f"offset {self.offset} (bytes {self.offset}..{last})")
            else:
                parts.append(f"offset {self.offset}")
        return (", ".join(parts) + ": " if parts else "") + self.message

    def to_json(self) -> dict:
        return asdict(self)


def check_layout(body: dict) -> tuple[list[Problem], dict[str, list]]:
    """What the manifest's validation (``schema.validate_body``: every chunk inside its tensor
    and its file, tensors covered exactly) leaves to verify: chunks of different tensors that
    share bytes of a file. Returns the problems and file -> [(fqn, chunk)] in file order."""
    problems: list[Problem] = []
    by_file: dict[str, list] = {name: [] for name in body["files"]}
    for fqn, t in body["tensors"].items():
        for c in t["chunks"]:
            if c["length"]:
                by_file[c["file"]].append((fqn, c))
    for name, chunks in by_file.items():
        chunks.sort(key=lambda fc: fc[1]["offset"])
        prev_end, prev = 0, None
        for fqn, c in chunks:
            if c["offset"] < prev_end:
                problems.append(Problem("manifest", f"chunk overlaps tensor {prev!r}'s bytes",
                                        file=name, tensor=fqn, offset=c["offset"]))
            prev_end, prev = max(prev_end, c["offset"] + c["length"]), fqn
    return problems, by_file


#: the first sweep of :func:`first_overlap` runs while it compares at most this many pairs per
#: box
SWEEP_PAIRS = 8
#: :func:`_split` compares a part of this many boxes or fewer with the other part pair by pair
SPLIT_LEAF = 16


def first_overlap(boxes: list) -> tuple | None:
    """Two of ``boxes`` (``(offsets, sizes)``, none empty) that share an element, or None;
    ``schema.validate_body``'s check of a tensor's chunks. A sweep along the dimension with
    the most distinct starts (dim 0 for FSDP shards, the cut one for row or column pieces)
    compares each box with the earlier ones whose ranges along it meet its own: a few per box
    for every layout fastckpt writes. A crafted one (rows in a square's top-left quarter,
    columns in its bottom-right one: along either dimension about n^2 / 2 pairs meet) stops
    it after ``SWEEP_PAIRS`` per box and goes to :func:`_split`, along the dimensions where
    the boxes' ranges differ, the one where the fewest pairs meet first: O(n log^2 n) when 2
    are left (O(n log^d n) for d), handing back to a sweep along that one once it has done
    about as much work as that sweep would."""
    if len(boxes) < 2:
        return None
    ndim = len(boxes[0][0])
    if ndim == 0:
        return boxes[0], boxes[1]  # 0-d: one element, so two non-empty chunks overlap
    dim = max(range(ndim), key=lambda d: len({b[0][d] for b in boxes}))
    found = _sweep(boxes, dim, SWEEP_PAIRS * len(boxes))
    if found is not False:
        return found
    dims = [d for d in range(ndim) if len({(b[0][d], b[1][d]) for b in boxes}) > 1]
    if not dims:
        return boxes[0], boxes[1]  # all alike
    pairs = {d: _pairs_meeting(boxes, d) for d in dims}  # O(n log n) each
    dims.sort(key=pairs.__getitem__)
    found = _split(boxes, dims, budget=pairs[dims[0]])
    return _sweep(boxes, dims[0]) if found is False else found


def _sweep(boxes: list, dim: int, budget: float = float("inf")) -> tuple | None | bool:
    """(:func:`first_overlap`) The sweep along ``dim``; False once it has compared more than
    ``budget`` pairs."""
    active: list = []
    for b in sorted(boxes, key=lambda b: b[0][dim]):
        lo = b[0][dim]
        active = [a for a in active if a[0][dim] + a[1][dim] > lo]
        budget -= len(active)
        if budget < 0:
            return False
        for a in active:
            if all(ao < bo + bs and bo < ao + as_
                   for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1])):
                return a, b
        active.append(b)
    return None


def _pairs_meeting(boxes: list, d: int) -> int:
    """How many pairs of boxes have ranges along dimension ``d`` that meet (the comparisons a
    sweep along it makes): each box's start against the ends of the boxes that start before."""
    starts = sorted(b[0][d] for b in boxes)
    ends = sorted(b[0][d] + b[1][d] for b in boxes)
    return sum(i - bisect_right(ends, x) for i, x in enumerate(starts))


def _split(boxes: list, dims: list, budget: float = float("inf")) -> tuple | None | bool:
    """(:func:`first_overlap`) Two boxes that meet along ``dims`` or None, False once it has
    handled more than ``budget`` boxes (the sweep's count of pairs); by the divide and conquer
    of Zomorodian and Edelsbrunner ("Fast software for box intersections", 2002), on a work
    list rather than recursion: a task ``(ranges, points, k, a, b)`` finds a box of ``ranges``
    whose range along ``dims[k]`` holds the start of a box of ``points`` (every start in
    ``[a, b)``), the two meeting along ``dims[k + 1:]`` too (along the dims before k they
    meet by construction). The points are cut at their median start; ranges that span the
    whole slab hold every point, so along ``dims[k]`` they are done: a task for the next
    dimension, both ways round (a range holds the other's start, or the other holds its
    own; once when the two sets are one: a grid's cells); the others go to the halves they
    meet (a segment tree's O(log n) nodes each)."""
    lo = [[b[0][d] for d in dims] for b in boxes]
    hi = [[b[0][d] + b[1][d] for d in dims] for b in boxes]
    n, inf = len(dims), float("inf")

    def meet(i: int, j: int) -> bool:
        return i != j and all(lo[i][k] < hi[j][k] and lo[j][k] < hi[i][k] for k in range(n))
    every = list(range(len(boxes)))
    todo: list = [(every, every, 0, -inf, inf)]
    while todo:
        ranges, points, k, a, b = todo.pop()
        if not ranges or not points:
            continue
        budget -= len(ranges) + len(points)
        if budget < 0:
            return False
        if k == n or min(len(ranges), len(points)) <= SPLIT_LEAF:  # (k == n: any two meet)
            hit = next(((i, j) for i in ranges for j in points if meet(i, j)), None)
            if hit is not None:
                return boxes[hit[0]], boxes[hit[1]]
            continue
        xs = sorted(lo[j][k] for j in points)
        if xs[0] == xs[-1]:  # every point at one coordinate: the ranges that hold it
            held = [i for i in ranges if lo[i][k] <= xs[0] < hi[i][k]]
            todo += [(held, points, k + 1, -inf, inf)]
            if held != points:
                todo.append((points, held, k + 1, -inf, inf))
            continue
        m = xs[len(xs) // 2]
        if m == xs[0]:  # (both halves hold points)
            m = xs[bisect_right(xs, m)]
        span = [i for i in ranges if lo[i][k] <= a and b <= hi[i][k]]
        rest = [i for i in ranges if not (lo[i][k] <= a and b <= hi[i][k])]
        if span != points:
            todo.append((points, span, k + 1, -inf, inf))
        todo += [(span, points, k + 1, -inf, inf),
                 ([i for i in rest if lo[i][k] < m and a < hi[i][k]],
                  [j for j in points if lo[j][k] < m], k, a, m),
                 ([i for i in rest if m < hi[i][k] and lo[i][k] < b],
                  [j for j in points if lo[j][k] >= m], k, m, b)]
    return None


class _Frames:
    """The zstd frames of one compressed chunk, decoded one by one as its stored bytes are fed
    in file order (decoded bytes are dropped: what is checked is that every frame decodes to
    exactly the raw bytes its place holds). Holds at most one frame's bytes; ``error``: the
    first frame that did not decode (later ones are not tried)."""

    def __init__(self, desc: dict, raw_nbytes: int) -> None:
        from ..storage import codec
        self.codec, self.desc = codec, desc
        self.plan: list[tuple[int, int]] = []  # (stored length, raw length) per frame
        for _, _, _, _, rlen in codec.frame_spans(desc, raw_nbytes):
            frames = desc["frames"][len(self.plan):len(self.plan) + desc["group"]]
            self.plan += zip(frames, codec.plane_sizes(rlen, desc["group"]))
        self.i = self.pos = 0  # the next frame and its first byte within the chunk
        self.pending = bytearray()
        self.error: Exception | None = None

    def _check(self, frame) -> None:
        try:
            self.codec.decode_frame(memoryview(frame), self.i, len(self.plan), self.pos,
                                    self.plan[self.i][1], self.desc.get("checksum", False), {})
        except self.codec.CodecError as e:
            self.error = e
        self.pos += self.plan[self.i][0]
        self.i += 1

    def feed(self, piece: memoryview) -> None:
        while piece and self.error is None and self.i < len(self.plan):
            need = self.plan[self.i][0] - len(self.pending)
            if not self.pending and len(piece) >= need:  # a whole frame in this block
                self._check(piece[:need])
            else:
                self.pending += piece[:need]
                if len(self.pending) < self.plan[self.i][0]:
                    return
                self._check(self.pending)
                self.pending = bytearray()
            piece = piece[need:]

    @property
    def checked(self) -> int:
        return self.i


def _read(storage: Storage, path: str, offset: int, buf, n: int) -> None:
    storage.read_into(path, offset, buf, n, hash=False)  # (hashed per chunk by the caller)


def verify_file(storage: Storage, d: str, name: str, info: dict, chunks: list,
                 block: int, progress: ProgressFn | None,
                 get_buf: Callable[[int], memoryview] | None = None,
                 dtypes: dict[str, str] | None = None) -> tuple[list[Problem], int, int, int]:
    """Check one shard file; return (problems, bytes read, chunks checked, frames decoded).
    ``dtypes`` (tensor -> manifest dtype name) turns on the decoding of compressed chunks'
    frames (None: their stored bytes are checked only)."""
    path = f"{d}/{name}"
    declared = int(info["size"])
    rank = info.get("rank")
    problems: list[Problem] = []
    try:
        size = storage.size(path)
    except StorageTimeoutError:
        raise  # (the storage stopped answering: verify_step ends, it does not go on)
    except StorageError as e:  # (a FIFO or a directory there: damage, not a failed read)
        kind = "missing" if isinstance(e, NotRegularFileError) else "read"
        return [Problem(kind, f"cannot stat the file: {e}", file=name, rank=rank)], 0, 0, 0
    if size is None:
        tensors = sorted({fqn for fqn, _ in chunks})
        more = f" (and {len(tensors) - 5} more)" if len(tensors) > 5 else ""
        if progress:
            progress(declared)
        return [Problem("missing", f"shard file is missing; it holds {len(chunks)} chunk(s) of "
                        f"{', '.join(map(repr, tensors[:5]))}{more}", file=name,
                        rank=rank)], 0, 0, 0
    readable = min(size, declared)
    if size != declared:
        problems.append(Problem(
            "size", f"shard file is {size} bytes, the manifest says {declared} "
            f"({'truncated' if size < declared else 'extended'})", file=name,
            offset=readable, rank=rank))
    # segments covering [0, readable): chunks (hash them) and the gaps between (must be zero)
    segs: list[list] = []  # [start, end, fqn | None, chunk | None, hasher | None, _Frames]
    pos = 0
    frames: list[_Frames] = []
    for fqn, c in chunks:
        off, ln = int(c["offset"]), int(c["length"])
        if off + ln > readable:
            problems.append(Problem("truncated", "chunk lies past the end of the file",
                                    file=name, tensor=fqn, offset=off, length=ln, rank=rank))
            continue
        if off > pos:
            segs.append([pos, off, None, None, None, None])
        fr = None
        if "codec" in c and dtypes is not None:
            fr = _Frames(c["codec"], math.prod(c["sizes"]) * fmt.DTYPES[dtypes[fqn]])
            frames.append(fr)
        segs.append([off, off + ln, fqn, c, xxhash.xxh3_64(), fr])
        if off >= pos:  # (an overlap, reported by the manifest check, is hashed on its own)
            pos = off + ln
    if pos < readable:
        segs.append([pos, readable, None, None, None, None])
    segs.sort(key=lambda s: s[0])
    buf = (get_buf or aligned_buffer)(min(block, max(readable, 1)))
    nread = 0
    checked = 0
    open_segs: list[list] = []
    i = 0
    bad_gap_reported = False
    for bstart in range(0, readable, block):
        n = min(block, readable - bstart)
        bend = bstart + n
        try:
            # (bounded on a local root's per-call view: a mount that stops answering)
            storage.run("reading", _read, storage, path, bstart, buf, n, path=path)
        except StorageTimeoutError:
            raise
        except StorageError as e:
            problems.append(Problem("missing" if isinstance(e, NotRegularFileError) else "read",
                                    f"cannot read {n} bytes: {e}", file=name, offset=bstart,
                                    rank=rank))
            if progress:
                progress(readable - bstart)
            return problems, nread, checked, sum(f.checked for f in frames)
        mv = buf[:n]
        nread += n
        while i < len(segs) and segs[i][0] < bend:
            open_segs.append(segs[i])
            i += 1
        still = []
        for seg in open_segs:
            s0, s1, fqn, c, h, fr = seg
            lo, hi = max(s0, bstart), min(s1, bend)
            if hi > lo:
                piece = mv[lo - bstart:hi - bstart]
                if h is not None:
                    h.update(piece)
                    if fr is not None:
                        fr.feed(piece)
                elif not bad_gap_reported:
                    raw = piece.tobytes()
                    rest = raw.lstrip(b"\0")
                    if rest:
                        bad_gap_reported = True
                        at = lo + len(raw) - len(rest)
                        problems.append(Problem(
                            "padding", "non-zero byte in the alignment padding between chunks "
                            "(no tensor data, but the file was modified)", file=name, offset=at,
                            length=1, rank=rank))
            if s1 > bend:
                still.append(seg)
                continue
            if h is not None:
                checked += 1
                got = fmt.hexdigest(h.intdigest())
                if not checksum_matches(h.intdigest(), c):
                    problems.append(Problem(
                        "checksum", f"checksum mismatch in chunk {list(c['offsets'])}+"
                        f"{list(c['sizes'])} (expected {c['checksum']}, read {got}): the data "
                        "is damaged", file=name, tensor=fqn, offset=s0, length=s1 - s0,
                        rank=rank))
                elif fr is not None and fr.error is not None:  # (bytes as written, not valid)
                    e = fr.error
                    problems.append(Problem(
                        "decode", f"{e}: the chunk matches its checksum but cannot be loaded",
                        file=name, tensor=fqn, offset=s0 + e.frame_offset, rank=rank,
                        length=fr.plan[e.frame][0]))
        open_segs = still
        if progress:
            progress(n)
    return problems, nread, checked, sum(f.checked for f in frames)
