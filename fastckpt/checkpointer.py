"""The engine: ``Checkpointer`` (save/resume/load), its ``SaveHandle``, and one-shot helpers.

Call sequence of ``Checkpointer.save(state, step=s)`` (every rank calls it, collectively):

1. (all ranks, training thread) wait for this Checkpointer's previous save to finish writing
   (back-pressure: one staging buffer, never a second), re-raising its failure if unreported.
2. (all ranks, training thread) flatten ``state``: tensors out, plain values into a JSON
   skeleton; unsupported objects raise ``UnsupportedStateError`` here, before anything is written.
3. (all ranks, training thread) ``all_gather_object`` of each rank's chunk list and skeleton:
   every rank computes the same global plan (the save id from rank 0; which rank writes each
   chunk, replicated chunks written once, balanced by bytes; dtype/shape agreement).
4. (all ranks, training thread) copy the rank's chunks into its aligned staging buffer, laid out
   exactly as the shard file. ``save`` returns here: the handle is *staged*.
5. (all ranks, background thread) write + fsync the shard file (checksums computed in the same
   pass), fsync the directory, then the commit protocol of :mod:`fastckpt.commit`:
   the coordinator (rank 0) gathers every rank's result through the store, writes the manifest
   by tmp + fsync + rename + directory fsync (the commit point), updates the ``latest`` hint,
   removes files of earlier attempts at the same step, applies retention; every rank learns the
   outcome: the handle is *committed*, or fails naming the ranks.
"""

from __future__ import annotations

import atexit
import collections
import dataclasses
import json
import logging
import math
import os
import queue
import socket
import threading
import time
import uuid
import warnings
import weakref
from dataclasses import dataclass, field
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from . import _device, _dist, _faults
from . import format as fmt
from ._native import get_backend
from ._tree import flatten, is_dtensor, plan_load
from .commit import commit
from .errors import (FastCkptError, StepRemovedError, StorageError, UnsupportedStateError,
                     WriterLockedError)
from .lease import WriterLease
from .options import CheckpointOptions, options_from_env
from .reader import FastCkptReader, find_step
from .retention import apply_retention
from .staging import (Gathered, StagingPool, first_piece_bytes, gather_piece, piece_bytes,
                      split, stage_piece)
from .storage import Storage, open_storage

log = logging.getLogger("fastckpt")


# ------------------------------------------------------------------------------------ save plan

@dataclass(frozen=True)
class ChunkSpec:
    """One chunk a rank holds: a box of a (global) tensor."""
    fqn: str
    dtype: str
    shape: tuple  # global shape
    offsets: tuple
    sizes: tuple
    nbytes: int
    dtensor: bool


@dataclass(frozen=True)
class SavePlan:
    save_id: str
    step: int
    world_size: int
    my_chunks: tuple  # ChunkSpecs this rank writes, in key order
    tensors: dict  # fqn -> {"dtype", "shape", "dtensor"}
    trees: list  # per-rank skeletons
    pieces: tuple = ()  # this rank's shard files (staging.Piece), set by Checkpointer.save

    @property
    def file_size(self) -> int:
        """Bytes this rank writes, over all its shard files."""
        return sum(p.size for p in self.pieces)


def _local_chunks(tensors: dict[str, torch.Tensor]) -> tuple[list[ChunkSpec], dict]:
    """This rank's chunks and, per (fqn, offsets), the local tensor holding the data."""
    specs, data = [], {}
    for fqn, t in tensors.items():
        dtype = fmt.dtype_name(t.dtype)
        if is_dtensor(t):
            local = t.to_local()
            chunks = t.__create_chunk_list__()
            if len(chunks) != 1 or tuple(chunks[0].sizes) != tuple(local.shape):
                raise UnsupportedStateError(
                    f"DTensor placements {t.placements} give this rank a local tensor that is "
                    "not a single box of the global tensor; not supported yet", key=fqn)
            offsets, sizes = tuple(chunks[0].offsets), tuple(chunks[0].sizes)
            shape = tuple(t.shape)
        else:
            local = t.detach()
            offsets, sizes, shape = (0,) * t.dim(), tuple(t.shape), tuple(t.shape)
        if local.is_conj() or local.is_neg():
            # a lazily conjugated or negated view: its memory holds the unconjugated values,
            # which a write from memory (zero-copy, the capped pool's C copy) would store as
            # they lie. Materialise it (a new tensor: the user's stays as it is)
            local = local.resolve_conj().resolve_neg()
        nbytes = local.numel() * local.element_size()
        specs.append(ChunkSpec(fqn, dtype, shape, offsets, sizes, nbytes, is_dtensor(t)))
        data[(fqn, offsets)] = local
    return specs, data


def make_plan(gathered: list[dict], rank: int, step: int) -> SavePlan:
    """The global plan, computed identically on every rank from everyone's chunk lists."""
    errors = [(r, g["error"]) for r, g in enumerate(gathered) if g["error"]]
    if errors:
        r, msg = errors[0]
        more = f" (and {len(errors) - 1} more rank(s))" if len(errors) > 1 else ""
        raise UnsupportedStateError(f"rank {r} cannot save its state: {msg}{more}")
    tensors: dict[str, dict] = {}
    holders: dict[tuple, list[int]] = {}
    spec_of: dict[tuple, ChunkSpec] = {}
    for r, g in enumerate(gathered):
        for s in g["specs"]:
            s = ChunkSpec(*s)
            meta = {"dtype": s.dtype, "shape": list(s.shape), "dtensor": s.dtensor}
            prev = tensors.setdefault(s.fqn, meta)
            if prev != meta:
                raise UnsupportedStateError(
                    f"ranks disagree on tensor {s.fqn!r}: {prev} on an earlier rank, {meta} on "
                    f"rank {r}")
            key = (s.fqn, s.offsets)
            holders.setdefault(key, []).append(r)
            spec_of[key] = s
    load = [0] * len(gathered)
    mine = []
    # largest first, each to the least-loaded holder: replicated chunks are written once
    for key in sorted(spec_of, key=lambda k: (-spec_of[k].nbytes, k[0], k[1])):
        writer = min(holders[key], key=lambda r: (load[r], r))
        load[writer] += spec_of[key].nbytes
        if writer == rank:
            mine.append(spec_of[key])
    mine.sort(key=lambda s: (s.fqn, s.offsets))
    return SavePlan(save_id=gathered[0]["save_id"], step=step, world_size=len(gathered),
                    my_chunks=tuple(mine), tensors=tensors,
                    trees=[g["tree"] for g in gathered])


def _raise_setup_errors(gathered: list[dict], mine: BaseException | None) -> None:
    """(all ranks, after the plan exchange) Raise if any rank could not claim the root: its own
    error on that rank, the same kind naming the rank on the others."""
    bad = [(r, g["setup"]) for r, g in enumerate(gathered) if g.get("setup")]
    if not bad:
        return
    if mine is not None:
        raise mine
    r, (kind, msg) = bad[0]
    cls = WriterLockedError if kind == WriterLockedError.__name__ else StorageError
    raise cls(f"rank {r} cannot save: {msg}")


def _check_user_meta(meta: dict | None) -> dict:
    """A copy of ``user_meta`` once it is known to be JSON a manifest can hold (else the
    checkpoint could be committed and then refused on load)."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise TypeError(f"user_meta must be a dict, got {type(meta).__qualname__}")
    try:
        data = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"user_meta must be plain JSON (str keys, finite numbers): {e}") from None
    if fmt.too_deep(meta) is not None:
        raise ValueError(f"user_meta nests deeper than {fmt.MAX_NESTING} levels")
    return json.loads(data)


# ---------------------------------------------------------------------------------------- handle

class SaveHandle:
    """The two completions of one save: *staged* and *committed*. Thread-safe.

    ``staged`` is true once the state was copied: the tensors may be modified again.
    ``wait()`` blocks until the save is committed (durable) and re-raises any failure of the
    background write, naming the rank(s) and file.
    """

    def __init__(self, step: int, path: str) -> None:
        self.step = step
        self.path = path
        self._staged = threading.Event()
        self._done = threading.Event()
        self._exc: BaseException | None = None
        self._reported = False
        self.bytes_written = 0
        self.timings: dict[str, float] = {}

    @property
    def staged(self) -> bool:
        return self._staged.is_set()

    @property
    def committed(self) -> bool:
        return self._done.is_set() and self._exc is None

    def done(self) -> bool:
        return self._done.is_set()

    def exception(self, timeout: float | None = None) -> BaseException | None:
        self._done.wait(timeout)
        return self._exc

    def wait(self, timeout: float | None = None) -> "SaveHandle":
        if not self._done.wait(timeout):
            raise TimeoutError(f"save of step {self.step} still running after {timeout}s")
        if self._exc is not None:
            self._reported = True
            raise self._exc
        return self

    def _finish(self, exc: BaseException | None) -> None:
        self._exc = exc
        self._done.set()

    def __repr__(self) -> str:
        state = ("committed" if self.committed else "failed" if self.done()
                 else "staged" if self.staged else "staging")
        return f"<SaveHandle step={self.step} {state} {self.path}>"


_SENTINEL = object()


WRITE_STREAMS = 2  # shard files written at once by one rank
DISCARD_S = 10.0  # removing a failed save's files from a remote store, at most


@dataclass
class _Job:
    plan: SavePlan
    handle: SaveHandle
    step_dir: str
    user_meta: dict = field(default_factory=dict)
    t0: float = 0.0
    pieces: queue.Queue = field(default_factory=queue.Queue)  # (piece, buffer) as staged
    cancel: threading.Event = field(default_factory=threading.Event)  # superseded: stop early
    deadline: float | None = None  # monotonic; the emergency save's commit deadline
    files: set = field(default_factory=set)  # (coordinator) the shard files it committed


# ------------------------------------------------------------------------------------ checkpointer

class Checkpointer:
    """Saves and loads one training job's checkpoints under ``root`` (a path or fsspec URL).

    ``save`` and ``load``/``resume`` are collective: every rank of the default process group
    calls them in the same order. Not thread-safe: call it from the training thread only (its
    own background thread is internal). Use as a context manager or call ``close()``.
    """

    def __init__(self, root: str | os.PathLike, *, keep_last: int | None = None,
                 options: CheckpointOptions | None = None, storage_options: dict | None = None,
                 **option_overrides: Any) -> None:
        opts = options_from_env(options or CheckpointOptions())
        if keep_last is not None:
            option_overrides["keep_last"] = keep_last
        self.options = opts.with_changes(**option_overrides) if option_overrides else opts
        self.root = str(root)
        self.storage: Storage = open_storage(self.root, io_mode=self.options.native,
                                             direct_io=self.options.direct_io,
                                             storage_options=storage_options)
        self.rank = _dist.rank()
        self.world_size = _dist.world_size()
        self._exchange: _dist.Exchange | None = None
        self._pool = StagingPool()
        self._stager: _device.DeviceStager | None = None  # CUDA states only
        self._queue: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._last: SaveHandle | None = None
        self._last_job: _Job | None = None
        self._closed = False
        self._checked_root = False
        self._preempt: Any = None
        self._lease: WriterLease | None = None  # rank 0, from the first save to close()
        if self.options.grace_s is not None or self.options.preempt:
            self._install_preemption()
        ref = weakref.ref(self)
        self._atexit = lambda: (ref() and ref().close())  # type: ignore[union-attr]
        atexit.register(self._atexit)

    # -- properties ---------------------------------------------------------------------------
    @property
    def io_backend(self) -> str:
        """Which I/O path writes and reads the shards: "native" or "python"."""
        return get_backend(self.options.native).name

    @property
    def preemption(self) -> Any:
        """The preemption trigger (:class:`fastckpt.preempt.Preemption`), None if not armed."""
        return self._preempt

    def _install_preemption(self) -> None:
        from .preempt import Preemption
        self._preempt = Preemption(self)
        self._preempt.install()

    # -- save ---------------------------------------------------------------------------------
    def save(self, state: dict, *, step: int, block: bool = False,
             user_meta: dict | None = None, on_preempt: bool = False,
             _deadline: float | None = None) -> SaveHandle | None:
        """Stage ``state`` and write it in the background as step ``step``; collective.

        Returns once the state is staged (safe to modify); ``handle.wait()`` blocks until it is
        committed. ``block=True`` waits here. A failure of the previous background save is
        raised here if nobody observed it yet.

        ``on_preempt=True``: save only if a stop was agreed (docs/preemption.md); returns None
        (about a microsecond, no collective) otherwise. At the agreed step every rank writes an
        emergency checkpoint, passes a barrier and exits the process with the documented code.
        """
        if on_preempt:
            if self._preempt is None:
                self._check_open()
                self._install_preemption()
            return self._preempt.check(state, step)
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        t0 = time.perf_counter()
        self._drain_previous()
        user_meta = _check_user_meta(user_meta)
        # the root and the writer lease: failures are carried through the plan exchange, so
        # that no rank is left waiting in it
        setup_error: FastCkptError | None = None
        try:
            self._claim_root()
        except (WriterLockedError, StorageError) as e:
            if self.world_size == 1:
                raise
            setup_error = e
        error = None
        specs: list = []
        tree: Any = None
        data: dict = {}
        try:
            flat = flatten(state)
            local, data = _local_chunks(flat.tensors)
            specs = [tuple(s.__dict__.values()) for s in local]
            tree = flat.skeleton
            json.dumps(tree, allow_nan=False)
        except (UnsupportedStateError, ValueError, TypeError) as e:
            if self.world_size == 1:
                raise
            error = str(e)
        gathered = _dist.all_gather_object(
            {"save_id": uuid.uuid4().hex[:12], "specs": specs, "tree": tree, "error": error,
             "setup": None if setup_error is None else (type(setup_error).__name__,
                                                       str(setup_error))})
        _raise_setup_errors(gathered, setup_error)
        plan = make_plan(gathered, self.rank, step)
        cap = self.options.staging_cap_bytes
        total = sum(c.nbytes for c in plan.my_chunks)
        # a blocking save on a local file system is written straight from the tensors (the
        # caller does not touch them until it returns): no staging copy, no staging memory
        # (device tensors must be copied to the host anyway: they go through the pinned pool)
        stager = self._device_stager(data)
        zero_copy = (block and self.options.zero_copy and self.storage.gathered_writes
                     and stager is None)
        if zero_copy:
            phase = {k: t.data_ptr() % fmt.ALIGN for k, t in data.items()
                     if t.device.type == "cpu" and t.is_contiguous() and t.nbytes >= fmt.SMALL_CHUNK}
            pieces = split(plan.my_chunks, piece_bytes(total, None), phase=phase)
        else:
            limit = piece_bytes(total, cap)
            pieces = split(plan.my_chunks, limit, first=first_piece_bytes(limit)
                           if self._pool.will_cap(total, cap) else None)
        plan = dataclasses.replace(plan, pieces=tuple(pieces))
        if not zero_copy:
            self._pool.prepare([p.size for p in plan.pieces], cap, pinner=stager)
        step_dir = self.storage.join(fmt.step_dirname(step))
        handle = SaveHandle(step, step_dir)
        job = _Job(plan, handle, step_dir, user_meta=user_meta, t0=t0,
                   deadline=_deadline)
        self._ensure_worker()
        self._last = handle
        self._last_job = job
        self._queue.put(job)  # the writer starts on each piece as soon as it is staged
        t1 = time.perf_counter()
        try:
            if zero_copy:  # gather piece i+1 (edge pages, small tensors) while i is written
                for piece in plan.pieces:
                    job.pieces.put((piece, gather_piece(piece, data, self.storage.io), None,
                                    None))
                handle.timings["plan_s"] = t1 - t0
                _faults.point("after_stage", self.rank)
                # the tensors are read until the shards are written. An emergency save
                # (_deadline) returns at its deadline even so: its caller gives up and exits
                left = None if _deadline is None else max(0.0, _deadline - time.monotonic())
                if handle._done.wait(left):
                    handle._staged.set()
                    handle.wait()  # raises its failure
                return handle
            staged = []
            capped = self._pool.capped
            io = self.storage.io if capped else None
            if stager is not None:
                stager.begin_save()
            for piece in plan.pieces:
                buf = self._pool.acquire(piece.index)  # capped pool: waits for the writer
                hashes = stage_piece(piece, buf, data, io, stager)
                # device chunks are still being copied: the writer waits for `ready`
                ready = stager.end_piece() if stager is not None else None
                if capped:  # write while the next piece is copied
                    job.pieces.put((piece, buf, hashes, ready))
                else:
                    staged.append((piece, buf, hashes, ready))
            for item in staged:  # uncapped: the copy runs alone, so the stall is one memcpy
                job.pieces.put(item)
            if stager is not None:  # the caller's later kernels run after the copies
                stager.end_save()
        except BaseException as e:
            if stager is not None:  # no copy may still write a buffer the pool hands out
                stager.abort()
            job.pieces.put((None, e, None, None))  # the writer fails this save on every rank
            raise
        handle.timings["plan_s"] = t1 - t0
        handle.timings["stage_s"] = time.perf_counter() - t1
        handle._staged.set()
        _faults.point("after_stage", self.rank)
        if block:
            handle.wait()
        return handle

    def _claim_root(self) -> None:
        """Before a save writes anything: the root is writable (once), and on the coordinator
        the writer lease is held (taken at the first save) and was not taken over."""
        if not self._checked_root:
            self.storage.check_writable()
            self._checked_root = True
        if self.rank != 0:
            return
        if self._lease is None:
            self._lease = WriterLease(self.storage, ttl_s=self.options.lease_ttl_s,
                                      renew_s=self.options.lease_ttl_s / 4).acquire()
        else:
            self._lease.check()

    def _device_stager(self, data: dict) -> _device.DeviceStager | None:
        """The stager of this checkpointer's device tensors; None if ``data`` has none."""
        backend = _device.default_backend()
        if backend is None or not any(backend.is_device(t) for t in data.values()):
            return None
        if self._stager is None or self._stager.backend is not backend:
            self._stager = _device.DeviceStager(backend, self.options.cuda_stage)
        return self._stager

    def _supersede(self) -> SaveHandle | None:
        """Ask the in-flight save to stop before its next piece and fail without committing
        (every rank of the job must do the same); its handle, or None if none is in flight."""
        job = self._last_job
        if job is None or job.handle.done():
            return None
        job.cancel.set()
        return job.handle

    def wait(self) -> None:
        """Block until the last save is committed; raise its failure."""
        if self._last is not None:
            self._last.wait()

    def _drain_previous(self) -> None:
        last = self._last
        if last is None:
            return
        last._done.wait()
        if last._exc is not None and not last._reported:
            last._reported = True
            raise last._exc

    def _ensure_worker(self) -> None:
        if self._thread is None:
            if self._exchange is None:
                self._exchange = _dist.Exchange()
            self._thread = threading.Thread(target=self._worker, name="fastckpt-writer",
                                            daemon=True)
            self._thread.start()

    def _worker(self) -> None:
        while True:
            job = self._queue.get()
            if job is _SENTINEL:
                return
            try:
                self._write_and_commit(job)
                job.handle._finish(None)
            except BaseException as e:  # carried to the caller through the handle
                log.error("fastckpt: rank %d: save of step %d failed: %s", self.rank,
                          job.handle.step, e)
                job.handle._finish(e)

    def _write_and_commit(self, job: _Job) -> None:
        """(background) Write this rank's shards, then the commit protocol. Every call to a
        remote store runs under the save's deadline: the write phase gets ``commit_timeout_s``
        (an emergency save: what is left of its grace window), the commit exchange as much
        again, so a store that stops answering fails the save instead of hanging it."""
        plan, d = job.plan, job.step_dir
        write_deadline = time.monotonic() + self.options.commit_timeout_s
        if job.deadline is not None:
            write_deadline = min(write_deadline, job.deadline)
        st = self.storage.bounded(write_deadline)
        marker = f"{d}/{fmt.INFLIGHT_PREFIX}{plan.save_id}"
        result: dict[str, Any]
        local_exc: BaseException | None = None
        t0 = time.perf_counter()
        try:
            st.makedirs(d)
            if self.rank == 0:
                st.publish(marker, json.dumps({
                    "save_id": plan.save_id, "created_unix": time.time(),
                    "host": socket.gethostname(), "pid": os.getpid()}).encode())
            files = []
            remaining = len(plan.pieces)
            pending: collections.deque = collections.deque()
            try:
                # WRITE_STREAMS pieces are written at once, so one file's drain, fsync and
                # open overlap the next file's writes and the device queue never runs dry
                with ThreadPoolExecutor(WRITE_STREAMS, thread_name_prefix="fastckpt-io") as ex:
                    while remaining:
                        piece, buf, hashes, ready = job.pieces.get()
                        remaining -= 1
                        if piece is None:
                            remaining = 0  # the training thread stopped staging
                            raise FastCkptError(f"staging failed: {buf}") from buf
                        if job.cancel.is_set():
                            self._release(buf, ready)
                            raise FastCkptError(f"save of step {plan.step} was superseded by a "
                                                "newer save (preemption); nothing was committed")
                        while len(pending) >= WRITE_STREAMS or (pending and pending[0].done()):
                            files.append(pending.popleft().result())  # raises a write's error
                        pending.append(ex.submit(self._write_piece, st, d, plan, piece, buf,
                                                 hashes, ready))
                    while pending:
                        files.append(pending.popleft().result())
                files.sort(key=lambda f: f["piece"])
                st.sync_dir(d)  # the files' entries, once for all of them
            finally:
                # after a failure, take the pieces still coming so a capped pool never leaves
                # the training thread waiting for a buffer (the executor has finished by now:
                # its writes released their own buffers)
                while remaining:
                    piece, buf, _, ready = job.pieces.get()
                    remaining = 0 if piece is None else remaining - 1
                    if piece is not None:
                        self._release(buf, ready)
            result = {"ok": True, "files": files}
            _faults.point("after_shard_write", self.rank)
        except Exception as e:
            local_exc = e
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        _faults.throttle(plan.file_size, t0, job.cancel)
        if local_exc is None and job.cancel.is_set():
            local_exc = FastCkptError(f"save of step {plan.step} was superseded by a newer save "
                                      "(preemption); nothing was committed")
            result = {"ok": False, "error": str(local_exc)}
        t1 = time.perf_counter()
        deadline = time.monotonic() + self.options.commit_timeout_s
        if job.deadline is not None:
            deadline = min(deadline, job.deadline)
        try:
            commit(self._exchange, save_id=plan.save_id, rank=self.rank,
                   world_size=plan.world_size, result=result, deadline=deadline,
                   coordinator=lambda results: self._coordinate(
                       job, results, self.storage.bounded(deadline)))
        except FastCkptError as e:
            self._discard(job, marker)
            if local_exc is not None and e.__cause__ is None:
                raise e from local_exc
            raise
        job.handle.timings["commit_s"] = time.perf_counter() - t1
        if self.rank == 0:
            self._housekeep(job)
        job.handle.bytes_written = plan.file_size
        job.handle.timings["write_s"] = t1 - t0
        job.handle.timings["total_s"] = time.perf_counter() - job.t0
        if self._preempt is not None:
            self._preempt.record_save(plan.file_size, t1 - t0, job.handle.timings.get("stage_s", 0))

    def _discard(self, job: _Job, marker: str) -> None:
        """(background, after a failed save) Remove this rank's files of the save, so a full
        disk is not kept full by the attempt; best effort and bounded (DISCARD_S on a remote
        store), the next commit removes the rest."""
        st = self.storage.bounded(time.monotonic() + DISCARD_S)
        try:
            for piece in job.plan.pieces:
                st.remove(
                    f"{job.step_dir}/{fmt.shard_name(self.rank, job.plan.save_id, piece.index)}")
            if self.rank == 0:
                st.remove(marker)
        except Exception as e:  # noqa: BLE001
            log.warning("fastckpt: rank %d: could not remove the failed save's files: %s",
                        self.rank, e)

    def _release(self, buf: Any, ready: Any) -> None:
        """(background) Give an unwritten piece's buffer back once no copy still fills it."""
        if ready is not None:
            ready.wait()
        self._pool.release(buf)

    def _write_piece(self, st: Storage, d: str, plan: SavePlan, piece: Any, buf: memoryview,
                     hashes: list[int] | None, ready: Any = None) -> dict:
        """(background) Write one shard file from its staged buffer, then release the buffer to
        the pool; the file's manifest entries.
        ``hashes``: the chunks' checksums when staging computed them, else computed here while
        writing. ``ready``: the device-to-host copies into ``buf`` to wait for first. No
        whole-file checksum: every byte of a shard is a chunk (checksummed) or alignment padding
        (zero), which is what ``verify`` checks."""
        if ready is not None:
            ready.wait()
        name = fmt.shard_name(self.rank, plan.save_id, piece.index)
        path = f"{d}/{name}"
        gathered = isinstance(buf, Gathered)
        if piece.index == 0 and _faults.armed("mid_shard_write", self.rank):
            with open(path, "wb") as f:
                f.write(bytes(piece.size // 2) if gathered else buf[:piece.size // 2])
                f.flush()
                os.fsync(f.fileno())
            _faults.point("mid_shard_write", self.rank)
        ranges = [(s.offset, s.spec.nbytes) for s in piece.slots]
        if gathered:  # zero-copy: from the tensors' memory and a small bounce buffer
            hashes = st.write_gathered(path, piece.size, buf.segments, buf.hash_ranges)
        else:
            try:
                _, hashes = st.write_shard(path, buf, piece.size, ranges,
                                           hashes=hashes, whole=False, sync_dir=False)
            finally:
                self._pool.release(buf)
        chunks = [{"fqn": s.spec.fqn, "offsets": list(s.spec.offsets),
                   "sizes": list(s.spec.sizes), "offset": s.offset, "length": s.spec.nbytes,
                   "checksum": fmt.hexdigest(h)} for s, h in zip(piece.slots, hashes)]
        return {"file": name, "piece": piece.index, "size": piece.size, "chunks": chunks}

    def _coordinate(self, job: _Job, results: list[dict], st: Storage) -> dict:
        """(coordinator) Write the manifest for a save every rank completed; the commit point
        (``st``: the storage bounded by the commit deadline)."""
        plan, d = job.plan, job.step_dir
        files: dict[str, dict] = {}
        tensors = {fqn: {**m, "chunks": []} for fqn, m in plan.tensors.items()}
        for r, res in enumerate(results):
            for f in res["files"]:
                files[f["file"]] = {"rank": r, "size": f["size"]}
                for c in f["chunks"]:
                    tensors[c["fqn"]]["chunks"].append({
                        "offsets": c["offsets"], "sizes": c["sizes"], "rank": r,
                        "file": f["file"], "offset": c["offset"], "length": c["length"],
                        "checksum": c["checksum"]})
        body = fmt.new_manifest_body(step=plan.step, world_size=plan.world_size,
                                     save_id=plan.save_id, files=files, tensors=tensors,
                                     trees=plan.trees, user_meta=job.user_meta)
        data = fmt.encode_manifest(body)
        _faults.point("before_manifest", self.rank)
        if _faults.armed("manifest_tmp_written", self.rank):
            with open(f"{d}/.{fmt.MANIFEST}.tmp-fault", "wb") as f:
                f.write(data[: len(data) // 2])
            _faults.point("manifest_tmp_written", self.rank)
        st.publish(f"{d}/{fmt.MANIFEST}", data)
        _faults.point("after_manifest", self.rank)
        job.files = set(files)
        # nothing else here: the outcome is published as soon as the manifest is (the other
        # ranks wait only until the deadline); housekeeping runs after it (_housekeep)
        return {"step": plan.step, "bytes": sum(f["size"] for f in files.values())}

    def _housekeep(self, job: _Job) -> None:
        """(coordinator, after the outcome was published) The ``latest`` hint, the leftovers of
        earlier attempts at this step, retention. None of it can undo the commit; each part runs
        even when another failed, and what failed is finished by the next save's retention or
        by ``fastckpt gc``. An emergency save (``job.deadline``) to an object store skips
        retention (many DELETEs would eat the grace window the ranks' final barrier needs); on
        a local file system removal takes milliseconds and runs."""
        st, d, plan = self.storage, job.step_dir, job.plan

        def leftovers() -> None:
            keep = job.files | {fmt.MANIFEST}
            for n in st.listdir(d):
                if n not in keep:
                    st.remove(f"{d}/{n}")

        def retention() -> None:
            _faults.point("during_retention", self.rank)
            removed = apply_retention(st, self.options.keep_last, protect={plan.step},
                                      force_partial=True)
            if removed:
                log.info("fastckpt: retention removed steps %s", removed)

        parts = [
            # a hint for people and scripts (fastckpt itself lists the steps): not synced
            ("updating the latest hint", lambda: st.publish(
                st.join(fmt.LATEST), json.dumps({"step": plan.step}).encode(), durable=False)),
            ("removing leftovers of earlier attempts", leftovers),
        ]
        if job.deadline is None or st.is_local:
            parts.append(("retention", retention))
        for what, fn in parts:
            try:
                fn()
            except Exception as e:  # noqa: BLE001 - committed: retried by the next save / gc
                log.warning("fastckpt: step %d committed, but %s failed: %s (the next save or "
                            "`fastckpt gc` finishes it)", plan.step, what, e)

    # -- load ---------------------------------------------------------------------------------
    def load(self, state: dict, *, step: int | None = None, strict: bool | None = None) -> int:
        """Load ``step`` (default: the newest committed) into ``state`` in place; collective.

        Returns the step. Raises CheckpointNotFoundError when there is none.
        """
        self._check_open()
        self._drain_previous()
        return load_into(self.storage, state, step=step, verify=self.options.verify,
                         strict=self.options.strict if strict is None else strict)

    def resume(self, state: dict) -> int | None:
        """Load the newest committed checkpoint into ``state``; its step, or None if none."""
        from .errors import CheckpointNotFoundError
        try:
            return self.load(state)
        except CheckpointNotFoundError:
            return None

    def latest_step(self) -> int | None:
        from .errors import CheckpointNotFoundError
        try:
            return find_step(self.storage)[0]
        except CheckpointNotFoundError:
            return None

    # -- lifecycle ------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise FastCkptError("this Checkpointer is closed")

    def close(self) -> None:
        """Wait for in-flight saves, stop the writer thread; raise an unreported failure. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._preempt is not None:
            self._preempt.close()
        try:
            atexit.unregister(self._atexit)
        except Exception:
            pass
        if self._thread is not None:
            self._queue.put(_SENTINEL)
            self._thread.join()
            self._thread = None
        if self._lease is not None:  # after the last commit
            self._lease.release()
            self._lease = None
        self._pool.close()  # unpinned before they are freed
        self._pool = StagingPool()
        if self._stager is not None:
            self._stager.close()
        last = self._last
        if last is not None and last._exc is not None and not last._reported:
            last._reported = True
            raise last._exc

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ------------------------------------------------------------------------------------------ load

def _alloc_in_phase(body: dict, fqn: str, meta: dict) -> torch.Tensor:
    """A tensor the load creates (e.g. the moments of a freshly built optimizer), placed at an
    address with the same remainder modulo 4096 as its first saved chunk's file offset, so the
    reader can fill it with O_DIRECT without a read buffer or a copy (see
    ``FastCkptReader._direct_ok``). A view into a storage at most 4 KiB larger."""
    shape, dtype = tuple(meta["shape"]), meta["dtype"]
    nbytes = math.prod(shape) * dtype.itemsize
    first = next((c for c in body["tensors"][fqn]["chunks"] if not any(c["offsets"])), None)
    if first is None or nbytes < fmt.ALIGN:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + fmt.ALIGN, dtype=torch.uint8)
    skip = (int(first["offset"]) - raw.data_ptr()) % fmt.ALIGN
    return raw[skip:skip + nbytes].view(dtype).view(shape)


#: loads of the newest step retried when a writer's retention removed it meanwhile
LOAD_ATTEMPTS = 3


def load_into(storage: Storage, state: dict, *, step: int | None = None, verify: bool = True,
              strict: bool = True) -> int:
    """(all ranks) Load a committed step into ``state`` in place; return the step.

    ``step=None`` loads the newest committed step; if a writer removes it while it is read (its
    retention after committing a newer one), every rank learns it in the same collective and the
    load starts again on the new newest step (LOAD_ATTEMPTS in all). Each attempt overwrites
    every tensor it loads, and plain values and sub-states are put back only at the end.
    """
    for attempt in range(1, LOAD_ATTEMPTS + 1):
        try:
            return _load_once(storage, state, step=step, verify=verify, strict=strict)
        except StepRemovedError as e:
            if step is not None or attempt == LOAD_ATTEMPTS:
                raise
            log.warning("fastckpt: %s; loading the newest step again (attempt %d of %d)", e,
                        attempt + 1, LOAD_ATTEMPTS)
    raise AssertionError("unreachable")  # pragma: no cover


def _load_once(storage: Storage, state: dict, *, step: int | None, verify: bool,
               strict: bool) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    rank, world = _dist.rank(), _dist.world_size()
    err: BaseException | None = None
    plan = reader = None
    found_step = None
    try:
        found_step, d, body = find_step(storage, step)
        mpath = f"{d}/{fmt.MANIFEST}"
        tree = fmt.tree_for_rank(body, rank, world, file=mpath)
        meta = fmt.tensor_meta(body, file=mpath)
        reader = FastCkptReader(storage, body=body, step_dir=d, verify=verify, rank=rank)
        reader.check_files()  # the files really hold what the manifest says, before allocating
        plan = plan_load(state, tree, meta, strict=strict,
                         alloc=lambda fqn, m: _alloc_in_phase(body, fqn, m))
    except BaseException as e:
        err = e
    # agree before the collective read: one rank's problem must not hang the others
    statuses = _dist.all_gather_object(
        (found_step, None if err is None else f"{type(err).__name__}: {err}",
         isinstance(err, StepRemovedError)))
    steps = {s for s, _, _ in statuses}
    if step is None and ((len(steps) > 1 and None not in steps)
                         or any(removed for _, _, removed in statuses)):
        # a writer committed (and retention removed) between the ranks' listings
        raise StepRemovedError(f"the newest step changed while the ranks looked for it (ranks "
                               f"found steps {sorted(map(str, steps))})", rank=rank) from err
    if err is not None:
        raise err
    bad = [(r, m) for r, (_, m, _) in enumerate(statuses) if m]
    if bad:
        raise FastCkptError("load failed on other ranks: " +
                            "; ".join(f"rank {r}: {m}" for r, m in bad))
    assert plan is not None and reader is not None and found_step is not None
    try:
        with warnings.catch_warnings():  # DCP warns whenever it runs without a process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(plan.targets, storage_reader=reader,
                     planner=DefaultLoadPlanner(allow_partial_load=not strict),
                     no_dist=not _dist.initialized())
    except CheckpointException as e:  # a BaseException in DCP: turn it into ours
        failures = {r: (x[0] if isinstance(x, tuple) else x)  # (exception, traceback)
                    for r, x in (getattr(e, "failures", {}) or {}).items()}
        mine = failures.get(rank)
        removed = [x for x in failures.values() if isinstance(x, StepRemovedError)]
        if removed:  # every rank sees the same failures: all retry together
            raise (mine if isinstance(mine, StepRemovedError) else removed[0]) from None
        if isinstance(mine, FastCkptError):
            raise mine from None
        detail = "; ".join(f"rank {r}: {type(x).__name__}: {x}"
                           for r, x in sorted(failures.items()))
        raise FastCkptError(f"load of step {found_step} failed: {detail or e}") from None
    for fn in plan.finish:
        fn()
    return found_step


# ------------------------------------------------------------------------------------- one-shots

ONE_SHOT_STAGING_CAP = 256 << 20

_ON_PREEMPT: dict = {}  # path -> the default Checkpointer of save(..., on_preempt=True)


def save(state: dict, path: str | os.PathLike, *, step: int, on_preempt: bool = False,
         user_meta: dict | None = None, **options: Any) -> SaveHandle | None:
    """Save ``state`` as step ``step`` under ``path`` and block until it is committed.

    ``on_preempt=True``: call it every step; it saves (and exits) only when a stop was agreed,
    through one default Checkpointer per path kept for the process's lifetime.
    """
    if on_preempt:
        ck = _ON_PREEMPT.get(str(path))
        if ck is None or ck._closed:
            ck = _ON_PREEMPT[str(path)] = Checkpointer(path, preempt=True, **options)
        return ck.save(state, step=step, on_preempt=True)
    # a blocking save: on a local file system it is written straight from the tensors; where
    # it must be staged (object stores, zero_copy=False), nothing is reused after a one-off
    # save, so it streams through a few buffers rather than stage the whole state into fresh
    # memory first (first-touch page faults cost as much as the write)
    options.setdefault("staging_cap_bytes", ONE_SHOT_STAGING_CAP)
    with Checkpointer(path, **options) as ck:
        return ck.save(state, step=step, block=True, user_meta=user_meta)


def load(state: dict, path: str | os.PathLike, *, step: int | None = None,
         **options: Any) -> int:
    """Load ``step`` (default: newest committed) from ``path`` into ``state``; return the step."""
    with Checkpointer(path, **options) as ck:
        return ck.load(state, step=step)
