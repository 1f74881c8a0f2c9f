"""Compression of a save's shard files (``compression="zstd"`` or ``"auto"``): each chunk of a
staged piece is encoded by :mod:`fastckpt.storage.codec` (zstd over independent 4 MiB blocks,
float bytes grouped) into the piece's compressed file.

Call sequence (who makes each call):

1. (training thread, each save) ``Compression.decide(data)``: "zstd" compresses; "auto" measures
   the codec on a few MiB of the state's largest float tensor (``codec.measure``, ~6 ms) and
   compresses only where ``threads`` cores encode faster than the target writes: the target's
   bandwidth is what this rank measured on its last uncompressed saves (bytes per second of
   write; with a remote tier, the slower of the local write and the upload), else
   ``fastckpt bench``'s record, else (the first save) not compressed, and measured. Each rank decides for itself:
   the manifest records the codec per chunk, so ranks need not agree.
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

log = logging.getLogger("fastckpt")

#: "auto" tries compression again every this many saves while it is off for being slower
RETRY_EVERY = 10
#: chunks at least this large are encoded block-parallel; smaller ones one per pool thread
_PARALLEL_MIN = 2 * codec.DEFAULT_BLOCK
_FLOATS = {torch.float32, torch.float16, torch.bfloat16, torch.float64}


def default_threads() -> int:
    """Encoder threads per rank: the cores this process may use, split among the node's
    ranks (LOCAL_WORLD_SIZE), at most 8."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, min(8, cores // max(1, local)))


class Compression:
    """One engine's compression: the setting, the decision per save, the encoder pool."""

    def __init__(self, mode: str | None, *, level: int, threads: int | None,
                 native: str) -> None:
        self.mode = mode
        self.level = level
        self.threads = threads or default_threads()
        self.native = native
        self._pool: ThreadPoolExecutor | None = None
        self._outs: list = []  # output buffers, reused by later pieces (warm pages)
        self._outs_lock = threading.Lock()
        #: (stored bytes, write seconds) of this rank's last saves: the target's bandwidth
        self.samples: list[tuple[int, float]] = []
        #: raw bytes per second of the write phase of this rank's last saves, by mode
        self.rates: dict[bool, list[float]] = {False: [], True: []}
        #: with a remote tier the rates run to the remote commit (the upload is the target)
        self.tiered = False
        self._saves = 0
        #: the last decision: {"compress", "why", ...}, for logs, events and benchmarks
        self.last: dict = {}

    @property
    def pool(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="fastckpt-zstd")
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

    def record_rate(self, compressed: bool, raw_bytes: int, write_s: float) -> None:
        """(writer thread) The write phase of a committed save: raw bytes per second."""
        if raw_bytes > 0 and write_s > 0:
            r = self.rates[compressed]
            r.append(raw_bytes / write_s)
            del r[:-3]

    def record(self, stored_bytes: int, write_s: float) -> None:
        if stored_bytes > 0 and write_s > 0:
            self.samples.append((stored_bytes, write_s))
            del self.samples[:-5]

    def target_bps(self, record_bps: float | None, upload_bps: float | None) -> float | None:
        """The bandwidth compression competes with (see the module docstring, step 1)."""
        bps = None
        if self.samples:
            bps = sum(b for b, _ in self.samples) / sum(t for _, t in self.samples)
        elif record_bps:
            bps = record_bps
        if upload_bps:
            bps = upload_bps if bps is None else min(bps, upload_bps)
        return bps

    def decide(self, data: dict, *, record_bps: float | None = None,
               upload_bps: float | None = None) -> bool:
        """(training thread, each save) Whether this save compresses (step 1)."""
        if self.mode is None:
            self.last = {"compress": False, "why": "compression=None"}
            return False
        if self.mode == "zstd":
            self.last = {"compress": True, "why": "compression='zstd'"}
            return True
        sample = _sample(data)
        if sample is None:
            self.last = {"compress": False, "why": "no float tensor to measure"}
            return False
        target = self.target_bps(record_bps, upload_bps)
        if target is None:
            self.last = {"compress": False, "why": "the target's bandwidth is not measured "
                         "yet (first save)"}
            return False
        view, width = sample
        m = codec.measure(view, width, self.level, native=self.native)
        self._saves += 1
        nums = {"ratio": round(m["ratio"], 3), "threads": self.threads,
                "encode_mibps_per_core": round(m["bytes_per_s"] / (1 << 20), 1),
                "target_mibps": round(target / (1 << 20), 1)}
        plain, comp = _median(self.rates[False]), _median(self.rates[True])
        if plain is not None:
            nums["plain_mibps"] = round(plain / (1 << 20), 1)
        if comp is not None:
            nums["compressed_mibps"] = round(comp / (1 << 20), 1)
        if not codec.should_compress(m, write_bytes_per_s=target, threads=self.threads):
            on, why = False, ("the target is faster than the encoders" if m["ratio"] >= 1.05
                              else "the data hardly compresses")
        elif comp is None or self._saves % RETRY_EVERY == 0:
            on, why = True, ("trying compression: the codec's measurement says it may outrun "
                             "the target" if comp is None else "trying compression again")
        elif plain is None or comp > plain:
            on, why = True, "compressed saves were faster"
        else:
            on, why = False, "compressed saves were slower"
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
            pos = fmt.align_up(pos, fmt.SMALL_ALIGN)
            need = pos + enc.nbytes
            if need > len(out):  # incompressible data with frame headers: grow
                bigger = self._out(need * 2)
                bigger[:pos] = out[:pos]
                out = bigger
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


def _median(xs: list) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


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
    return memoryview(flat.numpy()), width
