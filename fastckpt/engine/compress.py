"""Compression of a save's shard files (``compression="zstd"`` or ``"auto"``): each chunk of a
staged piece is encoded by :mod:`fastckpt.storage.codec` (zstd over independent 4 MiB blocks,
float bytes grouped) into the piece's compressed file.

Call sequence (who makes each call):

1. (training thread, each save) ``Compression.decide(data)``: "zstd" compresses; "auto"
   predicts, per raw byte of a piece, which is written sooner. A writer stream writes a piece
   plain in 1/w, compressed in 1/e + 1/(r w) (each piece is encoded, then written; two pieces
   are in flight at once, so both sides pay the same overlap): w is this rank's measured
   bytes per second of one shard write (its last writes, plain or compressed; before any,
   ``fastckpt bench``'s record; the very first save is plain, and measured), e and r the
   encoders' speed and ratio on this rank's last compressed pieces (before any, the codec's
   measurement on a few MiB of the state, ``codec.measure``, on one core). With a remote tier
   the upload adds 1/u plain, 1/(r u) compressed (u: the measured upload bandwidth). It
   compresses when that is at least 5% sooner and the ratio is at least 1.05. Every
   compressed save measures e, r and w again, so a wrong first guess costs one save. Each
   rank decides for itself: the manifest records the codec per chunk.
2. (writer thread, per piece) ``encode_piece``: the piece's staged bytes (laid out as the
   uncompressed file) are encoded chunk by chunk into a page-aligned output buffer, each
   compressed chunk at a multiple of 64 bytes (zero padding between, as in any shard); the
   staging buffer goes back to the pool as soon as it is encoded. Large chunks are encoded
   ``threads`` blocks at a time on the writer's pool; small ones run on the pool side by side.
3. (writer thread) the output buffer is written as the shard, the checksums computed over the
   stored bytes (``fastckpt verify`` checks them without decoding); the manifest's chunk entry
   gets the stored offset and length and the codec's description.

Blocking saves that compress are staged like async ones (the codec reads the staged bytes).
"""

from __future__ import annotations

import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from ..manifest import schema as fmt
from ..storage import codec
from ..storage.native import aligned_buffer
from ..storage.pyio import _raw_view
from ..storage.threads import Threads
from .dist import local_ranks

log = logging.getLogger("fastckpt")

#: "auto" compresses only when a compressed piece is predicted at least 5% sooner
MARGIN = 0.95
#: ... and the data compresses by at least this much
MIN_RATIO = 1.05
#: chunks at least this large are encoded block-parallel; smaller ones one per pool thread
_PARALLEL_MIN = 2 * codec.DEFAULT_BLOCK
_FLOATS = {torch.float32, torch.float16, torch.bfloat16, torch.float64}


def default_threads() -> int:
    """Encoder threads per rank: the cores this process may use, split among the node's
    ranks (:func:`.dist.local_ranks`), at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(8, cores // local_ranks()))


class Compression:
    """One engine's compression: the setting, the decision per save, the encoder pool."""

    def __init__(self, mode: str | None, *, level: int, threads: int | None,
                 native: str) -> None:
        self.mode = mode
        self.unavailable: str | None = None
        if mode is not None:
            try:
                codec._zstd()
            except ImportError as e:
                if mode == "zstd":
                    raise
                self.unavailable = str(e)  # "auto": off, and said why
        self.level = level
        self.threads = threads or default_threads()
        self.native = native
        self._pool: Threads | None = None
        self._outs: list = []  # output buffers, reused by later pieces (warm pages)
        self._outs_lock = threading.Lock()
        #: (stored bytes, seconds) of this rank's last shard writes, one per piece (the
        #: write alone, plain or compressed): the target's bandwidth per write stream
        self.writes: list[tuple[int, float]] = []
        #: (raw bytes, seconds, stored bytes) of this rank's last piece encodings: the encoders'
        #: real speed (the pool, the copies, the cores' other work) and ratio
        self.encodes: list[tuple[int, float, int]] = []
        #: the last decision: {"compress", "why", ...}, for logs, events and benchmarks
        self.last: dict = {}

    @property
    def pool(self) -> Threads:
        """The encoders (storage/threads.py: a save finished from ``atexit`` still encodes);
        made by :meth:`start`, in the training thread."""
        return self.start()

    def start(self) -> Threads:
        if self._pool is None:
            self._pool = Threads(self.threads, "fastckpt-zstd")
        return self._pool

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._outs.clear()

    def _out(self, n: int) -> memoryview:
        with self._outs_lock:
            for i, b in enumerate(self._outs):
                if len(b) >= n:
                    return self._outs.pop(i)
        return aligned_buffer(fmt.align_up(n, 1 << 20))

    def release(self, buf: memoryview) -> None:
        """(writer thread) An output buffer written: kept for the next piece (at most 4)."""
        with self._outs_lock:
            if len(self._outs) < 4:
                self._outs.append(buf)

    def record_write(self, stored_bytes: int, seconds: float) -> None:
        """(writer thread) One shard file written (its write alone)."""
        if stored_bytes > 0 and seconds > 0:
            with self._outs_lock:
                self.writes.append((stored_bytes, seconds))
                del self.writes[:-16]

    def record_encode(self, raw_bytes: int, seconds: float, stored_bytes: int) -> None:
        """(writer thread) One piece encoded."""
        if raw_bytes > 0 and seconds > 0:
            with self._outs_lock:
                self.encodes.append((raw_bytes, seconds, stored_bytes))
                del self.encodes[:-16]

    def write_bps(self, record_bps: float | None) -> float | None:
        """Bytes per second one write stream moves to the target: the last writes, else
        ``fastckpt bench``'s record, else None."""
        with self._outs_lock:
            w = list(self.writes)
        if w:
            return sum(b for b, _ in w) / sum(t for _, t in w)
        return record_bps

    def predict(self, m: dict, w: float, upload_bps: float | None) -> tuple[float, float, dict]:
        """Seconds per raw byte of a piece, plain and compressed (see the module docstring):
        plain 1/w (+ 1/u with a remote tier), compressed 1/e + 1/(r w) (+ 1/(r u)), where e
        and r are the encoders' speed and ratio on real pieces (before any, the codec's
        measurement on one core), w the write stream's, u the upload's."""
        with self._outs_lock:
            enc = list(self.encodes)
        if enc:
            e = sum(x[0] for x in enc) / sum(x[1] for x in enc)
            r = sum(x[0] for x in enc) / max(1, sum(x[2] for x in enc))
            how = "measured on real pieces"
        else:
            e, r, how = m["bytes_per_s"], m["ratio"], "the codec's measurement, one core"
        plain = 1 / w + (1 / upload_bps if upload_bps else 0.0)
        comp = 1 / e + (1 / w + (1 / upload_bps if upload_bps else 0.0)) / r
        return plain, comp, {"encode_mibps": round(e / (1 << 20), 1), "ratio": round(r, 3),
                             "encoders": how, "write_mibps": round(w / (1 << 20), 1),
                             "upload_mibps": round(upload_bps / (1 << 20), 1)
                             if upload_bps else None}

    def decide(self, data: dict, *, record_bps: float | None = None,
               upload_bps: float | None = None) -> bool:
        """(training thread, each save) Whether this save compresses (step 1)."""
        if self.mode is None:
            self.last = {"compress": False, "why": "compression=None"}
            return False
        if self.mode == "zstd":
            self.last = {"compress": True, "why": "compression='zstd'"}
            return True
        if self.unavailable:
            self.last = {"compress": False, "why": self.unavailable}
            return False
        sample = _sample(data)
        if sample is None:
            self.last = {"compress": False, "why": "no float tensor to measure"}
            return False
        w = self.write_bps(record_bps)
        if w is None:
            self.last = {"compress": False, "why": "the target's bandwidth is not measured "
                         "yet (first save)"}
            return False
        view, width = sample
        m = codec.measure(view, width, self.level, native=self.native)
        plain, comp, nums = self.predict(m, w, upload_bps)
        nums["plain_s_per_gib"] = round(plain * (1 << 30), 3)
        nums["compressed_s_per_gib"] = round(comp * (1 << 30), 3)
        if m["ratio"] < MIN_RATIO:
            on, why = False, "the data hardly compresses"
        elif comp < MARGIN * plain:
            on, why = True, "a compressed piece is written sooner"
        else:
            on, why = False, "a plain piece is written sooner"
        self.last = {"compress": on, "why": why, **nums}
        return on

    def encode_piece(self, piece: Any, buf: memoryview) -> tuple[memoryview, int, list]:
        """(writer thread) Step 2: (output buffer, file size, [(slot, offset, stored length,
        desc)]) for a staged piece."""
        out = self._out(max(piece.size + 4096, 4096))  # a frame adds a few bytes at most
        pos = 0
        entries: list = []
        small: list = []
        for slot in piece.slots:
            n = slot.spec.nbytes
            src = buf[slot.offset:slot.offset + n]
            width = codec.group_width(slot.spec.dtype)
            if n >= _PARALLEL_MIN:
                enc = codec.encode(src, width=width, level=self.level, threads=self.threads,
                                   executor=self.pool, native=self.native)
                small.append((slot, _done(enc)))
            else:
                small.append((slot, self.pool.submit(codec.encode, src, width=width,
                                                     level=self.level, native=self.native)))
        for slot, fut in small:
            enc = fut.result()
            pad = fmt.align_up(pos, fmt.SMALL_ALIGN) - pos
            need = pos + pad + enc.nbytes
            if need > len(out):  # incompressible data with frame headers: grow
                bigger = self._out(need * 2)
                bigger[:pos] = out[:pos]
                out = bigger
            # the buffers are reused: the padding is zeroed, never an earlier piece's bytes
            # (verify checks it; before 2026-12-06 a second compressed save failed verify)
            out[pos:pos + pad] = bytes(pad)
            pos += pad
            start = pos
            for f in enc.frames:
                out[pos:pos + len(f)] = f
                pos += len(f)
            entries.append((slot, start, pos - start, enc.desc))
        return out, pos, entries


class _done:
    """A finished value with a Future's ``result``."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def result(self) -> Any:
        return self.value


def _sample(data: dict) -> tuple[memoryview, int] | None:
    """A few MiB of the largest contiguous CPU float tensor's bytes, and its group width."""
    best = None
    for t in data.values():
        if (isinstance(t, torch.Tensor) and t.dtype in _FLOATS and t.device.type == "cpu"
                and t.is_contiguous() and (best is None or t.nbytes > best.nbytes)):
            best = t
    if best is None or best.nbytes < 4096:
        return None
    flat = best.detach().reshape(-1).view(torch.uint8)[:4 << 20]
    width = codec.group_width(str(best.dtype).replace("torch.", ""))
    return _raw_view(flat.data_ptr(), flat.numel()), width


#: decoder threads for one compressed chunk on load (its 4 MiB blocks decode in parallel)
DECODE_THREADS = 4
_DECODERS: list = []
_DECODERS_LOCK = threading.Lock()


def _after_fork_child() -> None:
    """A forked child has none of the parent's threads: its first compressed load makes its
    own decoder pool (before 2026-12-06 it waited for good on the parent's)."""
    global _DECODERS_LOCK
    _DECODERS_LOCK = threading.Lock()
    _DECODERS.clear()


os.register_at_fork(after_in_child=_after_fork_child)


def decoders() -> ThreadPoolExecutor:
    """The process's decoder pool for loads (made on first use, kept: zstd contexts per
    thread)."""
    with _DECODERS_LOCK:
        if not _DECODERS:
            _DECODERS.append(ThreadPoolExecutor(DECODE_THREADS,
                                                thread_name_prefix="fastckpt-unzstd"))
        return _DECODERS[0]
