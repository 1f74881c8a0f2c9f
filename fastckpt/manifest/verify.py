"""Verification primitives of a step's files against its manifest. Torch-free.

``check_layout`` finds what validation (``schema.validate_body``) leaves to a verification:
chunks of different tensors that share bytes of a file. ``verify_file`` re-reads one shard file
in blocks and checks every chunk's xxh3-64 and that the alignment padding between chunks is
zero: together, every byte of the file. The engine's reader checks the same checksum with
``checksum_matches`` before it uses a chunk.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Callable

import xxhash

from ..errors import StorageError
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
    kind: str  # manifest | missing | size | checksum | padding | truncated | read
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


def verify_file(storage: Storage, d: str, name: str, info: dict, chunks: list,
                 block: int, progress: ProgressFn | None,
                 get_buf: Callable[[int], memoryview] | None = None
                 ) -> tuple[list[Problem], int, int]:
    """Check one shard file; return (problems, bytes read, chunks checked)."""
    path = f"{d}/{name}"
    declared = int(info["size"])
    rank = info.get("rank")
    problems: list[Problem] = []
    try:
        size = storage.size(path)
    except StorageError as e:
        return [Problem("read", f"cannot stat the file: {e}", file=name, rank=rank)], 0, 0
    if size is None:
        tensors = sorted({fqn for fqn, _ in chunks})
        more = f" (and {len(tensors) - 5} more)" if len(tensors) > 5 else ""
        if progress:
            progress(declared)
        return [Problem("missing", f"shard file is missing; it holds {len(chunks)} chunk(s) of "
                        f"{', '.join(map(repr, tensors[:5]))}{more}", file=name,
                        rank=rank)], 0, 0
    readable = min(size, declared)
    if size != declared:
        problems.append(Problem(
            "size", f"shard file is {size} bytes, the manifest says {declared} "
            f"({'truncated' if size < declared else 'extended'})", file=name,
            offset=readable, rank=rank))
    # segments covering [0, readable): chunks (hash them) and the gaps between (must be zero)
    segs: list[list] = []  # [start, end, fqn | None, chunk | None, hasher | None]
    pos = 0
    for fqn, c in chunks:
        off, ln = int(c["offset"]), int(c["length"])
        if off + ln > readable:
            problems.append(Problem("truncated", "chunk lies past the end of the file",
                                    file=name, tensor=fqn, offset=off, length=ln, rank=rank))
            continue
        if off > pos:
            segs.append([pos, off, None, None, None])
        if off < pos:  # overlap: reported by the manifest check; hash it on its own
            segs.append([off, off + ln, fqn, c, xxhash.xxh3_64()])
            continue
        segs.append([off, off + ln, fqn, c, xxhash.xxh3_64()])
        pos = off + ln
    if pos < readable:
        segs.append([pos, readable, None, None, None])
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
            storage.read_into(path, bstart, buf, n, hash=False)  # hashed per chunk below
        except StorageError as e:
            problems.append(Problem("read", f"cannot read {n} bytes: {e}", file=name,
                                    offset=bstart, rank=rank))
            if progress:
                progress(readable - bstart)
            return problems, nread, checked
        mv = buf[:n]
        nread += n
        while i < len(segs) and segs[i][0] < bend:
            open_segs.append(segs[i])
            i += 1
        still = []
        for seg in open_segs:
            s0, s1, fqn, c, h = seg
            lo, hi = max(s0, bstart), min(s1, bend)
            if hi > lo:
                piece = mv[lo - bstart:hi - bstart]
                if h is not None:
                    h.update(piece)
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
        open_segs = still
        if progress:
            progress(n)
    return problems, nread, checked
