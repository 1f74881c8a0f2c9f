"""The engine: save (plan, stage, hand to the writer) and load, for one root.

Call sequence of ``Engine.save(state, step=s)`` (every rank calls it, collectively):

1. (all ranks, training thread) wait for this engine's previous save to finish writing
   (back-pressure: one staging pool, never a second), re-raising its failure if unreported.
2. (all ranks, training thread) flatten ``state`` (``state.flatten``): tensors out, plain values
   into a JSON skeleton; unsupported objects raise ``UnsupportedStateError`` here.
3. (all ranks, training thread) the plan exchange (``plan.PlanExchange``): each rank's layout
   hash and fingerprint hash to rank 0 (``Group.decide``), whose verdict says whether every
   rank reuses its previous plan; if not (the first save, a changed layout) the chunk lists go
   to rank 0 alone, which plans every rank (``plan.make_plans``) and sends each its own part
   (``Group.decide(..., each=True)``).
   A rank that could not flatten makes every rank raise: nothing has been written, not even
   the root. The skeleton stays on the rank until its commit result.
4. (all ranks, training thread, first save only) claim the root: it is writable, and
   (coordinator) the writer lease is taken (``fastckpt.lease``); one more ``Group.decide``
   (statuses to rank 0, its list of failures back) makes every rank raise if a rank could not.
5. (all ranks, training thread) split the rank's chunks into shard files and stage them into
   the reusable pool (or, for a blocking save, plan them to be written straight from the
   tensors: zero-copy); ``save`` returns: the handle is *staged*.
6. (all ranks, writer thread) ``writer.Writer``: write, commit, housekeeping; the handle is
   *committed* or failed.

For the preemption trigger the engine offers a narrow interface: ``inflight()`` (the save in
flight and the size of its largest shard file), ``supersede()`` (stop it before its next file),
``emergency_save(state, step, deadline)`` and ``emergency_is_zero_copy()``; ``on_saved``
callbacks receive each committed save's bandwidth.
"""

from __future__ import annotations

import atexit
import dataclasses
import functools
import json
import logging
import os
import time
import uuid
import weakref
from typing import Any, Callable

import xxhash

from ..errors import CheckpointNotFoundError, FastCkptError, UnsupportedStateError
from ..lease import WriterLease
from ..manifest import schema as fmt
from ..manifest.discovery import committed_steps, find_step
from ..options import CheckpointOptions, options_from_env
from ..storage import Storage, open_storage
from ..storage.native import get_backend
from . import device as _device
from . import dist as _dist
from .handle import Job, SaveHandle
from .load import load_into
from .claim import raise_setup_errors, setup_failures
from .plan import PlanExchange, local_chunks
from .compress import Compression
from .tiering import Tier, _skipped
from .staging import (StagingPool, copy_all, copy_threads, gather_piece, shard_pieces,
                      stage_piece)
from .state import flatten
from .writer import Writer

log = logging.getLogger("fastckpt")


class Engine:
    """Saves and loads one job's checkpoints under ``root`` (a path, an fsspec URL, or an open
    :class:`~fastckpt.storage.Storage`, e.g. one wrapped for fault injection).

    ``save`` and ``load``/``resume`` are collective: every rank of the default process group
    calls them in the same order. Not thread-safe: call it from the training thread only (its
    writer thread is internal). Use as a context manager or call ``close()``.
    """

    def __init__(self, root: str | os.PathLike | Storage, *, keep_last: int | None = None,
                 options: CheckpointOptions | None = None, storage_options: dict | None = None,
                 remote: str | Storage | None = None,
                 remote_storage_options: dict | None = None,
                 **option_overrides: Any) -> None:
        opts = options_from_env(options or CheckpointOptions())
        if keep_last is not None:
            option_overrides["keep_last"] = keep_last
        self.options = opts.with_changes(**option_overrides) if option_overrides else opts
        if isinstance(root, Storage):
            self.storage = root
        else:
            self.storage = open_storage(str(root), io_mode=self.options.native,
                                        direct_io=self.options.direct_io,
                                        storage_options=storage_options,
                                        remote=self.options.remote_settings())
        self.root = root if isinstance(root, str) else (
            str(root) if not isinstance(root, Storage) else self.storage.root)
        self.group = _dist.Group(collective=self.options.collective, name=self.storage.root)
        self.rank = self.group.rank
        self.world_size = self.group.world_size
        self._pool = StagingPool()
        self._stager: _device.DeviceStager | None = None  # CUDA states only
        self._writer = Writer(self.storage, self.options, self.group, self._pool)
        self._last: SaveHandle | None = None
        self._last_job: Job | None = None
        self._closed = False
        self._claimed = False
        #: saves begun per step (the last few steps): the exchanges of a save are keyed by
        #: (step, attempt), the same on every rank (``_plan``)
        self._attempts: dict[int, int] = {}
        self._lease: WriterLease | None = None  # rank 0, from the first save to close()
        self._tier: Tier | None = None
        if remote is not None:
            self._tier = self._open_tier(remote, remote_storage_options
                                         if remote_storage_options is not None
                                         else storage_options)
        self._upload_next = False
        self._plans = PlanExchange(self.options.rank_indexes)
        self._last_load: dict | None = None
        self._compression = Compression(self.options.compression,
                                        level=self.options.compression_level,
                                        threads=self.options.compression_threads,
                                        native=self.options.native)
        self._writer.compression = self._compression
        ref = weakref.ref(self)
        self._atexit = lambda: (ref() and ref().close())  # type: ignore[union-attr]
        atexit.register(self._atexit)

    def _open_tier(self, remote: str | Storage, storage_options: dict | None) -> Tier:
        """The remote tier (``remote=``): local-first saves, uploaded in the background."""
        if not self.storage.is_local:
            raise ValueError(f"remote= needs a local root (a path) to save to first; "
                             f"{self.root} is not one")
        if isinstance(remote, Storage):
            st, url = remote, getattr(remote, "url", remote.root)
        else:
            url = str(remote)
            st = open_storage(url, io_mode=self.options.native, direct_io=self.options.direct_io,
                              storage_options=storage_options,
                              remote=self.options.remote_settings())
        tier = Tier(self, st, url)
        self._writer.on_committed.append(self._committed)
        self._writer.protect = tier.protected
        return tier

    @property
    def tier(self) -> Tier | None:
        """The remote tier (``remote=``), or None."""
        return self._tier

    @property
    def last_load(self) -> dict | None:
        """Where the last load came from: ``{"step", "tier", "root"}`` (tier "local" or
        "remote"); None before any load."""
        if self._tier is not None and self._tier.last_load is not None:
            return self._tier.last_load
        return self._last_load

    def _committed(self, job: Job) -> None:
        """(writer thread) A save committed locally: upload it if its plan said so, else keep
        it as the tier's next candidate (see fastckpt/engine/tiering.py)."""
        if self._tier is None or job.deadline is not None:
            return
        if self._tier.frozen:  # (the emergency path uploads what it decides; not this)
            _skipped(job)
            return
        if job.upload:
            self._tier.submit(job)
        else:
            self._tier.defer(job)

    def upload(self, handle: SaveHandle, deadline: float | None = None) -> Any:
        """(preemption, all ranks) Upload the committed save ``handle`` to the remote tier
        now, under ``deadline``; the upload (``.done``, ``.error``). Collective."""
        job = self._last_job
        if self._tier is None or job is None or job.handle is not handle:
            raise FastCkptError("upload(): not the last save of a Checkpointer with remote=")
        return self._tier.submit(job, deadline)

    def _bench_bps(self) -> float | None:
        """This rank's write bandwidth from ``fastckpt bench``'s record in the root, if any."""
        if not self.storage.is_local:
            return None
        try:
            from ..bench.record import read_bench
            rec = (read_bench(self.storage.root) or {}).get("per_rank_bytes_per_s") or {}
            v = rec.get("save")
            return float(v) if type(v) in (int, float) and 0 < v < 1e12 else None  # (not inf)
        except Exception:  # noqa: BLE001 - a hint only
            return None

    @property
    def io_backend(self) -> str:
        """Which I/O path writes and reads local shards: "native" or "python"."""
        return get_backend(self.options.native).name

    @property
    def on_saved(self) -> list[Callable[[int, float, float], None]]:
        """Callbacks run (writer thread) after each committed save: (bytes, write_s, stage_s)."""
        return self._writer.on_saved

    # -- save ---------------------------------------------------------------------------------
    def save(self, state: dict, *, step: int, block: bool = False,
             user_meta: dict | None = None) -> SaveHandle:
        """Stage ``state`` and write it in the background as step ``step``; collective.

        Returns once the state is staged (safe to modify); ``handle.wait()`` blocks until it is
        committed. ``block=True`` waits here (and writes large tensors straight from their
        memory, without staging: ``zero_copy``). A failure of the previous background save is
        raised here if nobody observed it yet.
        """
        return self._save(state, step, block=block, user_meta=user_meta, deadline=None)

    def emergency_save(self, state: dict, step: int, deadline: float,
                       user_meta: dict | None = None) -> SaveHandle:
        """(preemption) A blocking save whose every remote call and the commit run under
        ``deadline`` (``time.monotonic()``); it returns at the deadline even if the write is
        still running (the process exits right after: whatever is not committed by then never
        is). Written zero-copy where the options allow."""
        return self._save(state, step, block=self.options.zero_copy, user_meta=user_meta,
                          deadline=deadline)

    def emergency_is_zero_copy(self) -> bool:
        """Whether ``emergency_save`` writes straight from the tensors (no staging time): the
        options allow it, the storage takes gathered writes, and no save so far held CUDA
        tensors (those are staged through the pinned pool)."""
        return (self.options.zero_copy and self.storage.gathered_writes
                and self._stager is None)

    def inflight(self) -> tuple[SaveHandle | None, int]:
        """The save still being written (or None) and its largest shard file in bytes."""
        job = self._last_job
        if job is None or job.handle.done():
            return None, 0
        return job.handle, max((p.size for p in job.plan.pieces), default=0)

    def keep_steps(self, steps: set[int] | frozenset[int]) -> None:
        """Steps retention keeps from now on besides the newest ``keep_last`` (an
        integration's: the Trainer's best step)."""
        self._writer.keep = frozenset(steps)

    def last_committed(self) -> SaveHandle | None:
        """This engine's last save if it is committed, else None."""
        last = self._last
        return last if last is not None and last.done() and last.committed else None

    def supersede(self) -> SaveHandle | None:
        """Ask the in-flight save to stop before its next shard file and fail without
        committing (every rank of the job must do the same); its handle, or None."""
        job = self._last_job
        if job is None or job.handle.done():
            return None
        job.cancel.set()
        return job.handle

    def wait(self) -> None:
        """Block until the last save is committed; raise its failure."""
        if self._last is not None:
            self._last.wait()

    def _save(self, state: dict, step: int, *, block: bool, user_meta: dict | None,
              deadline: float | None) -> SaveHandle:
        self._check_open()
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        t0 = time.perf_counter()
        key = self._save_key(step)  # (first: every call counts, even one that fails here)
        earlier = None
        if deadline is None:
            self._drain_previous()
        else:  # an emergency save: a failure nobody observed must not stop it
            earlier = self._take_previous_failure()
        user_meta = fmt.check_user_meta(user_meta)
        plan, data = self._plan(state, step, key, deadline)
        stager = self._device_stager(data)
        compress = self._compression.decide(
            data, record_bps=self._bench_bps(),
            upload_bps=self._tier.bytes_per_s() if self._tier is not None else None)
        if compress:  # (its threads start here, not in the writer: see storage/threads.py)
            self._compression.start()
        # a blocking save on a local file system is written straight from the tensors (the
        # caller does not touch them until it returns): no staging copy, no staging memory
        # (device tensors must be copied to the host anyway: they go through the pinned pool;
        # a compressing save encodes the staged bytes)
        zero_copy = (block and self.options.zero_copy and self.storage.gathered_writes
                     and stager is None and not compress)
        plan = shard_pieces(plan, data, zero_copy, self.options.staging_cap_bytes,
                            self._pool)
        if not zero_copy:
            self._pool.prepare([p.size for p in plan.pieces], self.options.staging_cap_bytes,
                               pinner=stager)
        step_dir = self.storage.join(fmt.step_dirname(step))
        handle = SaveHandle(step, step_dir,
                            bound=self._writer.stuck_bound(plan.file_size, deadline))
        handle.earlier_failure = earlier
        job = Job(plan, handle, step_dir, user_meta=user_meta, t0=t0, deadline=deadline,
                  compress=compress, owner=self)
        handle.compression = self._compression.last
        if self._tier is not None:  # "pending" or "deferred" (emergency saves: the trigger's)
            self._tier.planned(job, self._upload_next)  # (ends the plan's reservation)
            if job.deadline is None and not job.upload:
                log.info("fastckpt: step %d: uploaded once the upload of an earlier step is "
                         "over, unless a newer step replaces it", step)
        self._last, self._last_job = handle, job
        self._writer.submit(job)  # the writer starts on each piece as soon as it is staged
        t1 = time.perf_counter()
        handle.timings["plan_s"] = t1 - t0
        try:
            if zero_copy:
                return self._write_from_memory(job, data, deadline)
            self._stage(job, data, stager)
        except BaseException as e:  # (an interrupt too: the writer must not wait for pieces)
            job.pieces.put((None, e, None, None))  # (_stage's own, first, makes this unread)
            if block:  # raised here: the next save must not raise it again on this rank
                handle._reported = True  # alone (its peers observed it in their wait())
            raise
        handle.timings["stage_s"] = time.perf_counter() - t1
        handle._staged.set()
        if block:
            handle.wait()
        return handle

    def _wait_s(self, deadline: float | None) -> float:
        """How long a collective step of a save may wait: ``plan_timeout_s``, and for an
        emergency save never past its deadline (a peer that died before sending its plan is
        named then, not when the watchdog ends the process)."""
        if deadline is None:
            return self.options.plan_timeout_s
        return max(0.05, min(self.options.plan_timeout_s, deadline - time.monotonic()))

    def _save_key(self, step: int) -> str:
        """The store key of this save's exchanges: its step and how many saves of that step
        this rank began (``Group.decide``'s ``key``). Every rank names them alike when every
        rank calls ``save`` alike, whatever failed on some ranks only before (a timeout, an
        error): no exchange of one save can pair with another's."""
        n = self._attempts.pop(step, 0) + 1
        self._attempts[step] = n
        while len(self._attempts) > 64:  # (only a step saved again soon needs its count)
            del self._attempts[next(iter(self._attempts))]
        return f"save.{step}.{n}"

    def _plan(self, state: dict, step: int, key: str,
              deadline: float | None = None) -> tuple[Any, dict]:
        """(steps 2-4) Flatten the state and agree on the plan with every rank; (first save)
        claim the root. Whatever fails on this rank goes through the exchange, so every rank
        fails alike and none is left one exchange ahead of the others. ``key``: the
        exchanges' (:meth:`_save_key`): ranks that save different steps never meet, each names
        the others as missing."""
        error = None
        local_exc: Exception | None = None
        specs: list = []
        tree: Any = None
        data: dict = {}
        aliases = 0
        tree_hash = None
        try:
            flat = flatten(state)
            local, data = local_chunks(flat.tensors, digests=self.world_size > 1,
                                       world=self.world_size,
                                       full=self.options.fingerprint == "full")
            specs = [tuple(s.__dict__.values()) for s in local]
            tree = flat.skeleton
            aliases = len(flat.aliases)
            tree_hash = xxhash.xxh3_128_hexdigest(json.dumps(tree, allow_nan=False).encode())
        except Exception as e:  # (a Stateful's own error too: every rank must hear of it)
            if self.world_size == 1:
                raise
            local_exc = e
            error = (str(e) if isinstance(e, (UnsupportedStateError, ValueError, TypeError))
                     else f"{type(e).__name__}: {e}")
        # (the coordinator's busy and, if so, the reservation of the step: one step, see tiering)
        busy = self._tier.reserve() if self._tier is not None else False
        what = f"save of step {step}: the plan exchange"
        # the skeleton's hash: when every rank's is rank 0's, only rank 0 sends its skeleton
        # to the coordinator with its commit result (under FSDP they are all alike)
        common = {"error": error, "aliases": aliases, "tree_hash": tree_hash}
        verdict = self.group.decide(
            self._plans.value(uuid.uuid4().hex[:12], specs, up_busy=busy,
                              claimed=self._claimed, **common),
            self._decide, timeout_s=self._wait_s(deadline), what=what, key=key + "/plan")
        if local_exc is not None:  # (every rank fails this save: the verdict says why)
            raise local_exc
        # every rank decides alike: upload this step unless an uploader is still busy
        self._upload_next = not verdict["up_busy"]
        plan = self._plans.apply(verdict, step)
        if plan is None:  # the first save, or a layout changed: the chunk lists go to rank 0
            answer = self.group.decide(
                self._plans.full_value(uuid.uuid4().hex[:12], specs, rank=self.rank,
                                       **common),
                functools.partial(self._plans.assign, step=step), each=True,
                timeout_s=self._wait_s(deadline), what=what + " (the chunk lists)",
                key=key + "/lists")
            plan = self._plans.take(answer, self.rank, step)
        if verdict.get("claim", not self._claimed):  # (every rank alike: rank 0's verdict)
            self._claim_root(deadline, key + "/claim")
            if self._tier is not None:
                self._tier.record()
        return dataclasses.replace(plan, tree=tree), data

    def _decide(self, values: list[dict]) -> dict:
        """(rank 0) The plan exchange's verdict (``PlanExchange.decide``) and whether every
        rank must (still) claim the root: a rank whose claim failed or timed out claims again,
        every other rank with it."""
        return {**self._plans.decide(values),
                "claim": not all(v.get("claimed", True) for v in values)}

    def _claim_root(self, deadline: float | None = None, key: str | None = None) -> None:
        """(step 4, first save) The root is writable and, on the coordinator, the writer lease
        is held; a failure on any rank is raised on every rank. A rank that claimed already
        (another rank's claim failed) only takes part in the exchange."""
        error: Exception | None = None
        try:
            if not self._claimed:  # (bounded: a mount that stops answering fails the first
                end = time.monotonic() + self.options.commit_timeout_s  # save, as any other)
                self.storage.bounded(end if deadline is None else min(end, deadline)
                                     ).check_writable()
                if self.rank == 0:
                    self._lease = WriterLease(self.storage, ttl_s=self.options.lease_ttl_s,
                                              renew_s=self.options.lease_ttl_s / 4).acquire()
                    self._writer.lease = self._lease
        except Exception as e:
            if self.world_size == 1:
                raise
            error = e
        # (to rank 0 alone, which answers with the failures: O(N) where a gather is O(N^2))
        failures = self.group.decide(
            {"setup": None if error is None else [type(error).__name__, str(error)]},
            setup_failures, timeout_s=self._wait_s(deadline),
            what="first save: claiming the root", key=key)
        raise_setup_errors(failures, error)
        self._claimed = True

    def _write_from_memory(self, job: Job, data: dict, deadline: float | None) -> SaveHandle:
        """A zero-copy save: gather each piece (edge pages, small tensors) while the previous
        one is written, then wait for the commit: the tensors are read until the shards are
        written. An emergency save returns at its deadline even so: its caller gives up."""
        handle = job.handle
        try:  # (Ctrl-C or a failed gather, also while gathering: before 2026-12-06 it raised
            for piece in job.plan.pieces:  # while queued pieces were still written from them)
                job.pieces.put((piece, gather_piece(piece, data, self.storage.io), None, None))
            end = deadline if deadline is not None else handle.bound
            done = handle._done.wait(max(0.0, end - time.monotonic()))
        except BaseException as e:  # the writes read the tensors the caller gets back:
            job.pieces.put((None, e, None, None))  # nothing of this save may commit, and no
            job.cancel.set()  # write may go on (not handle.bound: a write under way only
            handle._done.wait(2 * self.options.commit_timeout_s + 5)  # reads, cannot commit)
            raise
        if done:
            handle._staged.set()
            handle.wait()  # raises its failure
        elif deadline is None:  # stuck past its bound (a hung mount): it must not commit
            job.cancel.set()
            handle.wait()  # raises: stuck
        return handle

    def _stage(self, job: Job, data: dict, stager: Any) -> None:
        """Copy each piece into the pool (CUDA chunks on a side stream): an uncapped pool hands
        the pieces to the writer after the last copy (the stall is one memcpy), a capped one
        each piece as soon as it is staged (the copy of the next overlaps its write)."""
        staged = []
        capped = self._pool.capped
        io = self.storage.io if capped else None
        copies: list | None = None if capped else []  # uncapped: one multi-threaded memcpy
        try:
            if stager is not None:
                stager.begin_save()
            for piece in job.plan.pieces:
                # (capped pool: waits for the writer, or until the save failed there)
                buf = self._pool.acquire(piece.index, job.failed)
                hashes = stage_piece(piece, buf, data, io, stager, copies)
                # device chunks are still being copied: the writer waits for `ready`
                ready = stager.end_piece() if stager is not None else None
                if capped:
                    job.pieces.put((piece, buf, hashes, ready))
                else:
                    staged.append((piece, buf, hashes, ready))
            if copies:  # (None: a capped pool copied each piece as it went)
                copy_all(self.storage.io, copies, copy_threads(self.options.copy_threads))
            if stager is not None:  # the caller's later kernels run after the copies (before
                stager.end_save()  # the hand-over: a failure here fails this save everywhere)
            for item in staged:
                job.pieces.put(item)
        except BaseException as e:
            job.pieces.put((None, e, None, None))  # the writer fails this save on every rank
            if stager is not None:  # no copy may still write a buffer the pool hands out
                try:
                    stager.abort()
                except Exception as x:  # noqa: BLE001 - (a sticky device error) the first
                    log.error("fastckpt: aborting the device copies failed too: %s", x)
            raise

    def _device_stager(self, data: dict) -> _device.DeviceStager | None:
        """The stager of this engine's device tensors; None if ``data`` has none."""
        backend = _device.default_backend()
        if backend is None or not any(backend.is_device(t) for t in data.values()):
            return None
        if self._stager is None or self._stager.backend is not backend:
            self._stager = _device.DeviceStager(backend, self.options.cuda_stage)
        return self._stager

    def _take_previous_failure(self) -> tuple[int, BaseException] | None:
        """(step, error) of the previous save if it failed unobserved, now observed."""
        last = self._last
        if last is None or last._reported:
            return None
        exc = last.take_failure()
        return None if exc is None else (last.step, exc)

    def _drain_previous(self) -> None:
        last = self._last
        if last is None:
            return
        last._wait_done(None)  # (ends at the save's bound: a StorageError, it is stuck)
        exc = last.take_failure() if not last._reported else None
        if exc is not None:
            raise exc

    # -- load ---------------------------------------------------------------------------------
    def load(self, state: dict, *, step: int | None = None, strict: bool | None = None) -> int:
        """Load ``step`` (default: the newest committed) into ``state`` in place; collective.

        Returns the step. Raises CheckpointNotFoundError when there is none.
        """
        self._check_open()
        self._drain_previous()
        return self._load(state, step, self.options.strict if strict is None else strict)[0]

    def _load(self, state: dict | None, step: int | None, strict: bool) -> tuple[int, dict]:
        if self._tier is not None:
            return self._tier.load(state, step=step, verify=self.options.verify, strict=strict,
                                   timeout_s=self.options.plan_timeout_s)
        out = load_into(self.storage, state, step=step, verify=self.options.verify,
                        strict=strict, group=self.group, timeout_s=self.options.plan_timeout_s)
        self._last_load = {"step": out[0], "tier": "local" if self.storage.is_local else
                           "remote", "root": self.storage.root}
        return out

    def read(self, *, step: int | None = None) -> dict:
        """The whole checkpoint of ``step`` (default: the newest committed) as a new dict:
        tensors (full, allocated here; per-rank values: this rank's) and plain values, as saved
        (modules and optimizers as their state dicts). For converters and tools; collective."""
        self._check_open()
        self._drain_previous()
        return self._load(None, step, True)[1]

    def resume(self, state: dict) -> int | None:
        """Load the newest committed checkpoint into ``state``; its step, or None if none."""
        try:
            return self.load(state)
        except CheckpointNotFoundError:
            return None

    def steps(self) -> list[int]:
        """Every committed step under the root (a valid manifest), oldest first."""
        return list(committed_steps(self.storage))

    def latest_step(self) -> int | None:
        try:
            return find_step(self.storage)[0]
        except CheckpointNotFoundError:
            return None

    # -- lifecycle ----------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise FastCkptError("this Checkpointer is closed")

    def close(self) -> None:
        """Wait for in-flight saves, stop the writer thread, release the root; raise an
        unreported failure. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            atexit.unregister(self._atexit)
        except Exception:  # noqa: BLE001
            pass
        last = self._last
        stuck = self._writer.close_for(last)  # (a StorageError: a write that does not return)
        if self._tier is not None:  # the queued uploads, each bounded (a StorageError: stuck)
            stuck = self._tier.close(stuck)
        if self._lease is not None:  # after the last commit
            self._lease.release()
            self._lease = None
        self._compression.close()
        if stuck is not None:  # (the staging buffers stay: a stuck write may still read them)
            raise stuck
        self._pool.close()  # unpinned before they are freed
        if self._stager is not None:
            self._stager.close()
        exc = last.take_failure() if last is not None and not last._reported else None
        if exc is not None:
            raise exc

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
