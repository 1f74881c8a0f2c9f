"""Compression of checkpoint chunks: zstd frames over independent blocks, floats byte-grouped.

A chunk's raw bytes are cut into blocks of ``block`` bytes (the last one shorter). For a float
dtype of element width w > 1 (:func:`group_width`) each block is *byte-grouped*: byte k of every
element goes to plane k (the high plane holds sign + exponent, which compresses; the low ones are
mostly mantissa, which does not), and each plane becomes one zstd frame. With w == 1 (ints, bool,
fp8) the block itself is one frame. Every frame records its content size in its header.

On disk a compressed chunk is these frames back to back, block-major, plane-minor (block 0's
planes 0..w-1, then block 1's, ...); a chunk of r bytes, r not a multiple of w, keeps its
``r % w`` tail bytes at the end of its last frame. The chunk's manifest entry carries (JSON,
checked by :func:`validate_desc`)::

    {"codec": "zstd", "group": 2, "block": 4194304, "frames": [stored length of each frame, ...],
     "checksum": false, "level": 1}

``frames`` has ``ceil(r / block) * group`` entries summing to the stored length; r itself comes
from the manifest (shape x dtype); ``level`` is informational. Every frame is a standard zstd
frame (``zstd -d`` turns a chunk into its grouped bytes).

Choices, measured with ``benchmarks/bench_compression.py`` (a GPT trained 300 steps with AdamW;
2-core Xeon VM, zstd 1.5.7; GB/s of raw bytes per core). bf16 weights: 1.49x at 1.44 GB/s,
decoded at 1.9 (plain zstd level 1 on the raw bytes: 1.28x at 1.06, decoded at 1.0); fp32
weights and Adam exp_avg: 1.19x at 1.8 (zstd: 1.08x at 0.95); exp_avg_sq: 1.28x at 1.1 (zstd:
1.14x at 0.8).

* Planes are compressed by zstd's fast strategy with a tiny match finder (``hash_log`` 6,
  ``min_match`` 7): in exponent planes matches cost time *and* ratio; what pays is zstd's
  Huffman coding of literals (a 2 MiB bf16 exponent plane: 0.34 of its size at 1.1 GB/s; with
  level 1's own parameters 0.37 at 0.4 GB/s). Level 1 is best: level 3 is 2.5-3.5x slower and
  loses 1-3% on weights, higher levels gain 0.1%; negative levels turn Huffman off (1.00x).
* A plane whose two 16 KiB probes save under 2% (mantissa planes: half of bf16, three quarters
  of fp32) is written as a raw zstd frame built here, without running the compressor: 6-18%
  faster, ratio within 0.2%.
* Blocks of 4 MiB: compression within 5% of the best of 1/4/16 MiB; 1 MiB decodes up to 10%
  faster but quadruples the frame list; 16 MiB decodes 10-20% slower (past the L2 cache). Pass
  a long-lived ``executor`` for threads (a fresh pool's threads first build zstd contexts and
  a scratch block).
* No zstd content checksum by default: the manifest's xxh3-64 of the stored bytes catches
  damage, frame content sizes a decode of the wrong length; the checksum costs 7-19% of the
  compression speed, 11-21% of decoding. ``checksum=True`` adds it to every frame (zstd checks
  it when decoding).

Call sequence (any thread: every function is thread-safe; zstd contexts and a scratch block are
per thread):

1. (writer, ``compression="auto"``) :func:`measure` on a few MiB of the state, then
   :func:`should_compress` with the target's write bandwidth.
2. (writer, per chunk) ``enc = encode(view, width=group_width(dtype))``; write ``enc.frames``
   back to back (or :func:`iter_encode` + :func:`make_desc`, to write while compressing); put
   ``enc.desc`` in the chunk entry; the stored length is ``enc.nbytes``.
3. (manifest validator) ``validate_desc(desc, raw_nbytes, stored_nbytes)``.
4. (reader) ``decode_into(stored, desc, dst)``, ``dst`` exactly the raw size; for part of a
   chunk, :func:`frame_spans` and :func:`decode_block_into` on the blocks it needs.

A damaged frame, a frame that decodes to another size than its place holds, or a bad
description raises :class:`CodecError` (a :class:`~fastckpt.errors.CorruptCheckpointError`)
naming the frame, its byte offset in the stored chunk and, given ``offset``, in the file. A
decode checks each frame's declared size before decoding it: it holds about two blocks per
thread, whatever a frame claims, and writes nothing outside ``dst``.

Needs the ``zstandard`` package (``pip install 'fastckpt[zstd]'``). Grouping runs in the C
extension with the GIL released (``native`` "auto"/"require"; 8-15 GB/s), or in pure Python
("off", or the extension not built: the same bytes, 2.1-2.8 GB/s holding the GIL).
"""

from __future__ import annotations

import struct
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from ..errors import CorruptCheckpointError
from . import native as _native
from .native import py_group as _py_group
from .native import py_ungroup as _py_ungroup

__all__ = [
    "CODEC", "DEFAULT_BLOCK", "DEFAULT_LEVEL", "CodecError", "Encoded", "decode_block_into",
    "decode_frame", "decode_into", "encode", "frame_spans", "group_width", "iter_encode",
    "make_desc", "measure", "plane_sizes", "should_compress", "validate_desc",
]

CODEC = "zstd"
DEFAULT_LEVEL = 1
DEFAULT_BLOCK = 4 << 20
MIN_BLOCK = 64 << 10
MAX_BLOCK = 16 << 20  # (fastckpt's writer uses DEFAULT_BLOCK; 16 MiB: the largest measured)
MIN_LEVEL, MAX_LEVEL = -7, 22
GROUP_WIDTHS = (1, 2, 4, 8)
RAW_AT = 0.98  # a plane whose probes compress to >= 98% of their size is stored raw
PROBE = 16 << 10  # bytes per probe, two probes per plane
MIN_FRAME = 9  # the shortest zstd frame: 6-byte header + 3-byte last (empty) block header
_DESC_KEYS = {"codec", "group", "block", "frames", "checksum", "level"}
_ZSTD_MAGIC = 0xFD2FB528
_ZSTD_BLOCK_MAX = 128 << 10
_INSTALL_HINT = "compression needs the zstandard package: pip install 'fastckpt[zstd]'"

# manifest dtype name -> bytes per grouped element (complex: per real component; 1: none)
_GROUP_OF = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "complex64": 4,
             "complex128": 8, **dict.fromkeys(("int64", "int32", "int16", "int8", "uint8",
             "uint16", "uint32", "uint64", "bool", "float8_e4m3fn", "float8_e5m2"), 1)}


class CodecError(CorruptCheckpointError, ValueError):
    """A compressed chunk or its description is damaged or inconsistent.

    ``frame``: the index of the frame concerned (None for the description as a whole);
    ``frame_offset``: its first byte within the stored chunk; ``offset`` (of every fastckpt
    error): its byte offset in the file, when the caller gave the chunk's file offset."""

    def __init__(self, message: str, *, frame: int | None = None,
                 frame_offset: int | None = None, **kw: Any) -> None:
        self.frame = frame
        self.frame_offset = frame_offset
        super().__init__(message, **kw)


def group_width(dtype_name: str) -> int:
    """Bytes per element that byte grouping uses for a manifest dtype name (1: no grouping)."""
    if dtype_name not in _GROUP_OF:
        raise ValueError(f"unknown dtype name {dtype_name!r}")
    return _GROUP_OF[dtype_name]


# --------------------------------------------------------------------------------------------
# byte grouping kernels: C (GIL released) or pure Python (same bytes)
# --------------------------------------------------------------------------------------------


def _kernels(native: str) -> tuple[Callable, Callable]:
    """(group, ungroup) for ``native`` = "auto" | "require" | "off" (as ``get_backend``)."""
    if native not in ("auto", "require", "off"):
        raise ValueError(f"native must be 'auto', 'require' or 'off', got {native!r}")
    ks = _native.byte_regroup_kernels() if native != "off" else None
    if ks is None and native == "require":
        raise ImportError("the native byte grouping kernels are unavailable "
                          f"({_native.native_error() or 'extension built without them'}); "
                          "rebuild it: python setup.py build_ext --inplace")
    return ks if ks is not None else (_py_group, _py_ungroup)


# --------------------------------------------------------------------------------------------
# zstd: lazily imported, one set of contexts and one scratch buffer per thread
# --------------------------------------------------------------------------------------------

_zstd_mod = None
_local = threading.local()


def _zstd():
    global _zstd_mod
    if _zstd_mod is None:
        try:
            import zstandard
        except ImportError as e:
            raise ImportError(_INSTALL_HINT) from e
        _zstd_mod = zstandard
    return _zstd_mod


def _cctx(level: int, planes: bool, checksum: bool):
    cache = _local.__dict__.setdefault("cctx", {})
    key = (level, planes, checksum)
    c = cache.get(key)
    if c is None:
        z = _zstd()
        if planes:  # a tiny match finder: zstd's Huffman stage does the work on planes
            p = z.ZstdCompressionParameters.from_level(
                level, hash_log=6, min_match=7, write_checksum=int(checksum),
                write_content_size=1)
            c = z.ZstdCompressor(compression_params=p)
        else:
            c = z.ZstdCompressor(level=level, write_checksum=checksum, write_content_size=True)
        cache[key] = c
    return c


def _dctx():
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = _zstd().ZstdDecompressor()
    return d


def _scratch(n: int) -> memoryview:
    buf = getattr(_local, "scratch", None)
    if buf is None or len(buf) < n:
        buf = _local.scratch = bytearray(n)
    return memoryview(buf)[:n]


def _raw_frame(data: memoryview, checksum: bool) -> bytes:
    """A standard zstd frame holding ``data`` in raw blocks (RFC 8878): single segment, 8-byte
    content size, blocks of 128 KiB, optional XXH64 content checksum."""
    n = len(data)
    parts: list = [struct.pack("<IBQ", _ZSTD_MAGIC, 0xE0 | (4 if checksum else 0), n)]
    if n == 0:
        parts.append(b"\x01\x00\x00")  # last block, raw, size 0
    for off in range(0, n, _ZSTD_BLOCK_MAX):
        m = min(_ZSTD_BLOCK_MAX, n - off)
        parts.append(((m << 3) | (off + m >= n)).to_bytes(3, "little"))
        parts.append(data[off:off + m])
    if checksum:
        import xxhash
        parts.append(struct.pack("<I", xxhash.xxh64(data).intdigest() & 0xFFFFFFFF))
    return b"".join(parts)


# --------------------------------------------------------------------------------------------
# layout
# --------------------------------------------------------------------------------------------


def _nblocks(raw: int, block: int) -> int:
    return -(-raw // block)


def plane_sizes(length: int, group: int) -> list[int]:
    """Raw bytes of each frame of a block of ``length`` bytes (the tail joins the last plane)."""
    m = length // group
    return [m] * (group - 1) + [length - m * (group - 1)]


def _frame_range(n: int) -> tuple[int, int]:
    """The shortest and longest stored frame of n raw bytes: at least the magic and header
    descriptor (5 bytes) and per 128 KiB (a zstd block's most content) a block of 4 bytes or
    more (header, RLE byte): zeros at level 19 take 145 bytes per 4 MiB, this floor 133, so a
    description asks at most ~32768 raw bytes per stored byte; at most ZSTD_COMPRESSBOUND."""
    lo = max(MIN_FRAME, 5 + 4 * _nblocks(n, _ZSTD_BLOCK_MAX))
    return lo, n + (n >> 8) + (((128 << 10) - n) >> 11 if n < (128 << 10) else 0) + 64


def frame_spans(desc: dict, raw_nbytes: int) -> list[tuple[int, int, int, int, int]]:
    """One ``(first_frame, stored_offset, stored_length, raw_offset, raw_length)`` per block of a
    validated description: what a reader of part of a chunk reads and passes to
    :func:`decode_block_into`."""
    block, group, frames = desc["block"], desc["group"], desc["frames"]
    out, pos = [], 0
    for b in range(_nblocks(raw_nbytes, block)):
        stored = sum(frames[b * group:(b + 1) * group])
        raw_off = b * block
        out.append((b * group, pos, stored, raw_off, min(block, raw_nbytes - raw_off)))
        pos += stored
    return out


def make_desc(frame_lengths: Sequence[int], *, width: int, block: int = DEFAULT_BLOCK,
              level: int = DEFAULT_LEVEL, checksum: bool = False) -> dict:
    """The description of frames produced by :func:`iter_encode` with the same arguments."""
    return {"codec": CODEC, "group": width, "block": block,
            "frames": [int(n) for n in frame_lengths], "checksum": bool(checksum), "level": level}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def validate_desc(desc: Any, raw_nbytes: int, stored_nbytes: int, **where: Any) -> dict:
    """Check a chunk's description against its raw size (from the manifest's shape and dtype)
    and its stored length; return it. Raises :class:`CodecError`; ``where`` (file=, key=,
    rank=, offset=) goes into the error."""
    def bad(msg: str) -> CodecError:
        return CodecError(f"compressed chunk description: {msg}", **where)

    if not isinstance(desc, dict):
        raise bad(f"not an object: {type(desc).__name__}")
    if not (_is_int(raw_nbytes) and _is_int(stored_nbytes) and raw_nbytes >= 0
            and stored_nbytes >= 0):
        raise bad(f"sizes must be non-negative ints, got {raw_nbytes!r}, {stored_nbytes!r}")
    unknown = set(desc) - _DESC_KEYS
    if unknown:
        raise bad(f"unknown field(s) {sorted(unknown)} (written by a newer fastckpt?)")
    if desc.get("codec") != CODEC:
        raise bad(f"unknown codec {desc.get('codec')!r} (this fastckpt reads {CODEC!r})")
    group, block, frames = desc.get("group"), desc.get("block"), desc.get("frames")
    if not _is_int(group) or group not in GROUP_WIDTHS:
        raise bad(f"group {group!r} is not one of {GROUP_WIDTHS}")
    if not _is_int(block) or not MIN_BLOCK <= block <= MAX_BLOCK or block % group:
        raise bad(f"block {block!r} is not a multiple of group {group} in "
                  f"[{MIN_BLOCK}, {MAX_BLOCK}]")
    if not isinstance(desc.get("checksum", False), bool):
        raise bad(f"checksum {desc.get('checksum')!r} is not a bool")
    lvl = desc.get("level", DEFAULT_LEVEL)
    if not _is_int(lvl) or not MIN_LEVEL <= lvl <= MAX_LEVEL:
        raise bad(f"level {lvl!r} is not an int in [{MIN_LEVEL}, {MAX_LEVEL}]")
    if not isinstance(frames, list):
        raise bad("'frames' is not a list")
    nblocks = _nblocks(raw_nbytes, block)
    if len(frames) != nblocks * group:
        raise bad(f"{len(frames)} frames for {raw_nbytes} raw bytes in blocks of {block} "
                  f"with {group} plane(s) each (expected {nblocks * group})")
    sizes = (plane_sizes(block, group),  # full blocks, then the last one
             plane_sizes(raw_nbytes - (nblocks - 1) * block, group))
    bounds = [[_frame_range(n) for n in ns] for ns in sizes]
    tail, total = len(frames) - group, 0
    for i, f in enumerate(frames):  # one lean pass: a large state has 10^5 frames
        lo, hi = bounds[i >= tail][i % group]
        if type(f) is not int or not lo <= f <= hi:
            raise bad(f"frame {i} at stored offset {total}: length {f!r} impossible for "
                      f"{sizes[i >= tail][i % group]} raw bytes")
        total += f
    if total != stored_nbytes:
        raise bad(f"frames sum to {total} bytes, the stored chunk has {stored_nbytes}")
    return desc


# --------------------------------------------------------------------------------------------
# running blocks on threads, in order
# --------------------------------------------------------------------------------------------


def _ordered(fn: Callable[[int], Any], n: int, threads: int,
             executor: Executor | None) -> Iterator[Any]:
    """fn(0..n-1) results in order; up to 2 * threads blocks in flight on ``executor`` (else a
    private pool of ``threads``); inline when there is one thread or one block. On an error or
    an abandoned iteration, pending blocks are cancelled and running ones waited for."""
    if n <= 1 or (threads <= 1 and executor is None):
        for i in range(n):
            yield fn(i)
        return
    pool = executor or ThreadPoolExecutor(max_workers=threads, thread_name_prefix="fastckpt-zstd")
    ahead = max(2, 2 * threads)
    futs = [pool.submit(fn, i) for i in range(min(n, ahead))]
    try:
        for i in range(n):
            r = futs[i].result(timeout=120.0)  # (ms a block: a dead pool raises, no hang)
            futs[i] = None  # drop the result once handed over
            if i + ahead < n:
                futs.append(pool.submit(fn, i + ahead))
            yield r
    finally:
        for f in futs:
            if f is not None:
                f.cancel()
        for f in futs:
            if f is not None and not f.cancelled():
                try:
                    f.result()
                except Exception:
                    pass  # the first error is the one raised
        if executor is None:
            pool.shutdown(wait=True)


def _byte_view(buf: Any, what: str) -> memoryview:
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise ValueError(f"{what} must be a contiguous buffer")
    return mv.cast("B") if (mv.format, mv.ndim) != ("B", 1) else mv


# --------------------------------------------------------------------------------------------
# encode
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Encoded:
    """A compressed chunk: ``frames`` to write back to back (``nbytes`` in all) and ``desc`` for
    the manifest's chunk entry. Immutable; safe to share between threads."""

    frames: list
    desc: dict
    raw_nbytes: int

    @property
    def nbytes(self) -> int:
        return sum(self.desc["frames"])

    @property
    def ratio(self) -> float:
        return self.raw_nbytes / self.nbytes if self.nbytes else 1.0

    def tobytes(self) -> bytes:
        return b"".join(self.frames)


def _check_args(width: int, level: int, block: int, threads: int) -> None:
    if not _is_int(width) or width not in GROUP_WIDTHS:
        raise ValueError(f"width must be one of {GROUP_WIDTHS} (see group_width), got {width!r}")
    if not _is_int(level) or not MIN_LEVEL <= level <= MAX_LEVEL:
        raise ValueError(f"level must be an int in [{MIN_LEVEL}, {MAX_LEVEL}], got {level!r}")
    if not _is_int(block) or not MIN_BLOCK <= block <= MAX_BLOCK or block % 8:
        raise ValueError(f"block must be a multiple of 8 in [{MIN_BLOCK}, {MAX_BLOCK}], "
                         f"got {block!r}")
    if not _is_int(threads) or threads < 1:
        raise ValueError(f"threads must be an int >= 1, got {threads!r}")


def _compress_plane(plane: memoryview, level: int, checksum: bool) -> bytes:
    n = len(plane)
    if n >= 8 * PROBE:  # two probes decide whether zstd is worth running on the plane
        c = _cctx(level, True, checksum)
        probe = (len(c.compress(plane[n // 4:n // 4 + PROBE]))
                 + len(c.compress(plane[3 * n // 4:3 * n // 4 + PROBE])))
        if probe >= RAW_AT * 2 * PROBE:
            return _raw_frame(plane, checksum)
    return _cctx(level, True, checksum).compress(plane)


def _encode_block(src: memoryview, b: int, width: int, level: int, block: int,
                  checksum: bool, group: Callable) -> list[bytes]:
    raw = src[b * block:min((b + 1) * block, len(src))]
    if width == 1:
        return [_cctx(level, False, checksum).compress(raw)]
    g = _scratch(len(raw))
    group(raw, g, width)
    out, pos = [], 0
    for n in plane_sizes(len(raw), width):
        out.append(_compress_plane(g[pos:pos + n], level, checksum))
        pos += n
    return out


def iter_encode(src: Any, *, width: int, level: int = DEFAULT_LEVEL, block: int = DEFAULT_BLOCK,
                threads: int = 1, checksum: bool = False, executor: Executor | None = None,
                native: str = "auto") -> Iterator[bytes]:
    """The frames of ``src`` (any contiguous buffer), in order, as they are ready: at most
    2 * threads blocks are held. ``width``: :func:`group_width` of the dtype. Their description
    is ``make_desc([len(f) for f in frames], width=, block=, level=, checksum=)``."""
    _check_args(width, level, block, threads)
    mv = _byte_view(src, "src")
    group, _ = _kernels(native)
    _zstd()
    fn = lambda b: _encode_block(mv, b, width, level, block, checksum, group)  # noqa: E731
    for frames in _ordered(fn, _nblocks(len(mv), block), threads, executor):
        yield from frames


def encode(src: Any, *, width: int, level: int = DEFAULT_LEVEL, block: int = DEFAULT_BLOCK,
           threads: int = 1, checksum: bool = False, executor: Executor | None = None,
           native: str = "auto") -> Encoded:
    """Compress ``src`` (any contiguous buffer) into an :class:`Encoded`; ``threads`` blocks at
    a time (or on ``executor``). Arguments as :func:`iter_encode`."""
    frames = list(iter_encode(src, width=width, level=level, block=block, threads=threads,
                              checksum=checksum, executor=executor, native=native))
    desc = make_desc([len(f) for f in frames], width=width, block=block, level=level,
                     checksum=checksum)
    return Encoded(frames=frames, desc=desc, raw_nbytes=memoryview(src).nbytes)


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------


def decode_frame(frame: memoryview, i: int, nframes: int, pos: int, n: int, checksum: bool,
                 where: dict) -> bytes:
    """Frame i (at ``pos`` in the stored chunk) checked and decoded to exactly n bytes."""
    z = _zstd()

    def bad(msg: str) -> CodecError:
        w = dict(where)
        if w.get("offset") is not None:
            w["offset"] = w["offset"] + pos
        return CodecError(f"compressed chunk, frame {i} of {nframes} at stored byte {pos} "
                          f"({len(frame)} bytes): {msg}", frame=i, frame_offset=pos, **w)

    try:
        params = z.get_frame_parameters(frame)
    except z.ZstdError as e:
        raise bad(f"bad frame header ({e})") from e
    if params.content_size != n:
        size = ("unknown" if params.content_size == z.CONTENTSIZE_UNKNOWN
                else params.content_size)
        raise bad(f"declares {size} raw bytes, its place holds {n}")
    if bool(params.has_checksum) != checksum:
        raise bad(f"content checksum {'absent' if checksum else 'present'}, the description "
                  f"says checksum={checksum}")
    try:
        out = _dctx().decompress(frame, max_output_size=n, allow_extra_data=False)
    except z.ZstdError as e:
        raise bad(f"does not decode ({e})") from e
    if len(out) != n:
        raise bad(f"decoded to {len(out)} bytes, expected {n}")
    return out


def decode_block_into(stored: Any, desc: dict, raw_nbytes: int, b: int, dst: Any, *,
                      native: str = "auto", stored_offset: int = 0, **where: Any) -> None:
    """Decode block ``b`` of a validated description from ``stored`` (that block's frames only,
    starting at ``stored_offset`` of the chunk: for messages) into ``dst`` (exactly the block's
    raw length, see :func:`frame_spans`). ``where``: file=, key=, rank=, offset= (the chunk's
    file offset) for errors."""
    _, ungroup = _kernels(native)
    group, block, frames = desc["group"], desc["block"], desc["frames"]
    length = min(block, raw_nbytes - b * block)
    s, d = _byte_view(stored, "stored"), _byte_view(dst, "dst")
    if len(d) != length:
        raise ValueError(f"block {b} holds {length} raw bytes, dst has {len(d)}")
    checksum = desc.get("checksum", False)
    first, pos, rpos = b * group, 0, 0
    planes = _scratch(length) if group > 1 else d
    for k, n in enumerate(plane_sizes(length, group)):
        f = frames[first + k]
        if pos + f > len(s):
            raise CodecError(f"compressed chunk, frame {first + k}: stored bytes end at {len(s)}",
                             frame=first + k, frame_offset=stored_offset + pos, **where)
        out = decode_frame(s[pos:pos + f], first + k, len(frames), stored_offset + pos, n,
                            checksum, where)
        planes[rpos:rpos + n] = out
        pos += f
        rpos += n
    if group > 1:
        ungroup(planes, d, group)


def decode_into(stored: Any, desc: dict, dst: Any, *, threads: int = 1,
                executor: Executor | None = None, native: str = "auto", **where: Any) -> None:
    """Fill ``dst`` (a writable contiguous buffer of exactly the raw size) from ``stored`` (the
    whole stored chunk), ``threads`` blocks at a time (or on ``executor``). Validates ``desc``
    first. ``where``: file=, key=, rank=, offset= (the chunk's file offset) for errors."""
    s, d = _byte_view(stored, "stored"), _byte_view(dst, "dst")
    if d.readonly:
        raise ValueError("dst must be writable")
    validate_desc(desc, len(d), len(s), **where)
    _kernels(native)
    _zstd()
    spans = frame_spans(desc, len(d))

    def one(b: int) -> None:
        _, spos, slen, roff, rlen = spans[b]
        decode_block_into(s[spos:spos + slen], desc, len(d), b, d[roff:roff + rlen],
                          native=native, stored_offset=spos, **where)

    for _ in _ordered(one, len(spans), threads, executor):
        pass


# --------------------------------------------------------------------------------------------
# compression="auto"
# --------------------------------------------------------------------------------------------


def measure(sample: Any, width: int, level: int = DEFAULT_LEVEL, *, block: int = DEFAULT_BLOCK,
            max_sample: int = 4 << 20, native: str = "auto") -> dict:
    """Ratio and per-core speeds of this codec on ``sample`` (at most ``max_sample`` bytes of
    it, taken as 4 pieces spread over it): ``{"ratio", "bytes_per_s", "decode_bytes_per_s",
    "sample_nbytes"}``, speeds in raw bytes per CPU second of the calling thread (other load on
    the core does not count). About 6 ms for 4 MiB."""
    mv = _byte_view(sample, "sample")
    if len(mv) > max_sample:
        piece = max_sample // 4 // 8 * 8
        step = (len(mv) - piece) // 3 // 8 * 8
        data = b"".join(mv[i * step:i * step + piece] for i in range(4))
    else:
        data = mv.tobytes()
    encode(data[:MIN_BLOCK], width=width, level=level, native=native)  # contexts, scratch
    t0 = time.thread_time()
    enc = encode(data, width=width, level=level, block=block, native=native)
    t1 = time.thread_time()
    stored, out = enc.tobytes(), bytearray(len(data))
    t2 = time.thread_time()
    decode_into(stored, enc.desc, out, native=native)
    t3 = time.thread_time()
    return {"ratio": enc.ratio, "bytes_per_s": len(data) / max(t1 - t0, 1e-6),
            "decode_bytes_per_s": len(data) / max(t3 - t2, 1e-6), "sample_nbytes": len(data)}


def should_compress(measured: dict, *, write_bytes_per_s: float, threads: int = 1,
                    min_ratio: float = 1.05) -> bool:
    """``compression="auto"``: compress when it makes the write shorter. With compression and
    writing overlapped, a byte costs max(1 / (speed * threads), 1 / (ratio * bandwidth))
    against 1 / bandwidth: so when ``threads`` cores compress faster than the target writes,
    and the ratio is worth the CPU (at least ``min_ratio``)."""
    return (measured["ratio"] >= min_ratio
            and measured["bytes_per_s"] * max(1, threads) > write_bytes_per_s)
