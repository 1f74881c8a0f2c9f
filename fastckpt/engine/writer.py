"""The background writer: one thread per Checkpointer that writes each save's shard files
and runs the commit protocol, so that ``save`` returns once the state is staged.

Call sequence of one save (``Job``), in the writer thread of every rank:

1. make the step directory; (coordinator) publish the in-flight marker ``.inflight-<save_id>``;
2. take the pieces as the training thread stages them and write them, ``WRITE_STREAMS`` shard
   files at once (one file's drain, fsync and open overlap the next file's writes), each from
   its staging buffer (or gathered from the tensors, zero-copy) with the chunk checksums
   computed in the same pass; then one fsync of the directory;
3. ``commit.commit``: publish this rank's result; (coordinator) write the manifest when every
   rank succeeded (the commit point) and publish the outcome at once; every rank learns it;
4. (coordinator, after the outcome) ``_housekeep``: the ``latest`` hint, leftovers of earlier
   attempts, retention -- off the commit deadline, each part on its own;
5. the handle is finished (committed, or failed with the error every rank sees).

Every call to a remote store runs under the save's deadline (``Storage.bounded``): the write
phase gets ``commit_timeout_s`` (an emergency save: what is left of its grace window), the
commit exchange as much again, the clean-up of a failed save ``DISCARD_S``.

Thread-safety: ``submit`` from the training thread; everything else runs in the writer thread.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import queue
import socket
import threading
import time
from concurrent.futures import TimeoutError as FutureTimeout
from concurrent.futures import wait as wait_all
from typing import Any, Callable

from ..errors import CommitTimeoutError, FastCkptError, StorageError
from ..manifest import index as idx
from ..manifest import schema as fmt
from ..manifest.discovery import marker_doc, marker_name, read_manifest
from ..options import CheckpointOptions
from ..retention import apply_retention
from ..storage import Storage
from ..storage import bounded as _bounded
from ..storage.threads import Threads
from . import dist as _dist
from . import handle as _handle
from .commit import check_present, commit, publish_checked
from .handle import Job
from .plan import SavePlan
from .staging import Gathered, StagingPool

log = logging.getLogger("fastckpt")

WRITE_STREAMS = 2  # shard files written at once by one rank
DISCARD_S = 10.0  # removing a failed save's files from a remote store, at most
DRAIN_S = 30.0  # after a failure, taking the pieces staging still hands over, at most
#: how long past its bound a shard write is waited for (a remote store's own bound, at the
#: deadline, reports first; past this, a write that has not returned fails the save)
WRITE_GRACE_S = 5.0
#: the least time ``close`` gives the writer's threads to stop
CLOSE_MIN_S = 5.0
#: a shard write is given at least this long plus its bytes at MIN_WRITE_BPS (a healthy slow
#: disk), whatever the save's write deadline: storage/bounded.py's per-call bound
WRITE_STALL_S = _bounded.CALL_S
MIN_WRITE_BPS = _bounded.MIN_RATE
_SENTINEL = object()


class Writer:
    """The writer thread of one Checkpointer (started at its first save)."""

    def __init__(self, storage: Storage, options: CheckpointOptions, group: "_dist.Group",
                 pool: StagingPool) -> None:
        self.storage = storage
        self.options = options
        self.group = group
        self.rank = group.rank
        self.pool = pool
        #: called (writer thread) after each committed save: (bytes, write_s, stage_s)
        self.on_saved: list[Callable[[int, float, float], None]] = []
        #: called (writer thread) with each committed Job, after its housekeeping
        self.on_committed: list[Callable[[Job], None]] = []
        #: steps retention must keep besides the one just committed (the remote tier's)
        self.protect: Callable[[], set] = set
        #: steps retention must keep besides (an integration's: the Trainer's best step)
        self.keep: frozenset = frozenset()
        #: the engine's compression (engine/compress.py), for the pieces of jobs that compress
        self.compression: Any = None
        self.queue: queue.Queue = queue.Queue()
        #: (coordinator) the writer lease, checked just before each manifest is written
        self.lease: Any = None
        self._thread: threading.Thread | None = None
        #: the shard writes' threads (WRITE_STREAMS, or the store's count), made with the
        #: writer thread: a save still running when the process exits (``close`` from
        #: ``atexit``) writes on them (storage/threads.py)
        self._io: Threads | None = None

    def submit(self, job: Job) -> None:
        """(training thread) Hand a save to the writer; it starts on each piece as staged."""
        if self._thread is None:
            self._io = Threads(max(WRITE_STREAMS, self.storage.write_streams), "fastckpt-io")
            self._thread = threading.Thread(target=self._run, name="fastckpt-writer",
                                            daemon=True)
            self._thread.start()
        self.queue.put(job)

    def close(self, until: float | None = None) -> bool:
        """Finish the queued saves and stop the threads, waiting until ``until`` at most
        (``time.monotonic()``; the last save's bound); False when a thread was still held
        then by a call that does not return (a hung mount): it is left to run (a daemon).
        Idempotent."""
        ok = True
        if self._thread is not None:
            self.queue.put(_SENTINEL)
            self._thread.join(None if until is None else max(0.0, until - time.monotonic()))
            ok = not self._thread.is_alive()
            self._thread = None
        if self._io is not None:
            self._io.shutdown(wait=False)
            ok = self._io.join(until) and ok
            self._io = None
        return ok

    def close_for(self, last: Any) -> StorageError | None:
        """``close``, waiting for the last save (a ``SaveHandle``, or None) until its bound
        (at least CLOSE_MIN_S; a save that is over: CLOSE_MIN_S, for the threads to stop);
        the error to raise when a thread was still held then (None: all stopped)."""
        now = time.monotonic()
        until = (None if last is None else now + CLOSE_MIN_S if last.done()
                 else max(last.bound or now, now + CLOSE_MIN_S))
        if self.close(until):
            return None
        return StorageError(
            f"closing: a write or file-system call of this checkpointer's saves (the last: step "
            f"{last.step}) has not returned past its bound (a hung mount?); the steps committed "
            "before it are untouched, the writer lease is released, its thread keeps running "
            "until the call returns", file=last.path)

    def _run(self) -> None:
        while True:
            job = self.queue.get()
            if job is _SENTINEL:
                return
            try:
                self._write_and_commit(job)
                job.handle._finish(None)
            except BaseException as e:  # carried to the caller through the handle
                job.failed.set()
                log.error("fastckpt: rank %d: save of step %d failed: %s", self.rank,
                          job.handle.step, e)
                job.handle._finish(e)
            job = None  # (its owner, the Engine, is kept alive by queued and running jobs only)

    def _write_and_commit(self, job: Job) -> None:
        """(background) Write this rank's shards, then the commit protocol. Every call to a
        remote store runs under the save's deadline: the write phase gets ``commit_timeout_s``
        (an emergency save: what is left of its grace window), the commit exchange as much
        again, so a store that stops answering fails the save instead of hanging it."""
        plan, d = job.plan, job.step_dir
        write_deadline = time.monotonic() + self.options.commit_timeout_s
        if job.deadline is not None:
            write_deadline = min(write_deadline, job.deadline)
        job.write_deadline = write_deadline
        st = self.storage.bounded(write_deadline)
        marker = f"{d}/{marker_name(plan.save_id)}"
        result: dict[str, Any]
        local_exc: BaseException | None = None
        t0 = time.perf_counter()
        try:
            files = []
            remaining = len(plan.pieces)
            left = sum(p.size for p in plan.pieces)  # bytes still to be staged
            pending: collections.deque = collections.deque()
            try:
                # (inside: a step directory or marker that cannot be made fails the save
                # below, which still takes the staged pieces, so that a capped pool never
                # leaves the training thread waiting for a buffer)
                def begin() -> None:
                    st.makedirs(d)
                    if self.rank == 0:
                        st.publish(marker, marker_doc(plan.save_id, host=socket.gethostname(),
                                                      pid=os.getpid()))
                st.run("creating the step directory and its marker", begin)  # (one hand-off)
                # WRITE_STREAMS pieces are written at once, so one file's drain, fsync and
                # open overlap the next file's writes and the device queue never runs dry
                ex = self._io
                streams = ex.size
                while remaining:
                    piece, buf, hashes, ready = self._next_piece(job, pending, plan, left)
                    remaining -= 1
                    if piece is None:
                        remaining = 0  # the training thread stopped staging
                        raise FastCkptError(f"staging failed: {type(buf).__name__}: {buf}") from buf
                    left -= piece.size
                    if job.cancel.is_set():
                        self._release(buf, ready)
                        raise FastCkptError(f"save of step {plan.step} was cancelled (superseded "
                                            "by a newer save, or its call was interrupted); "
                                            "nothing was committed")
                    try:
                        while len(pending) >= streams or (pending and pending[0][0].done()):
                            files.append(self._result(pending.popleft(), plan))
                    except BaseException:
                        self._release(buf, ready)  # (the piece just taken: never written)
                        raise
                    pending.append((ex.submit(self._write_piece, st, d, plan, piece, buf,
                                              hashes, ready, job.compress),
                                    f"{d}/{fmt.shard_name(self.rank, plan.save_id, piece.index)}",
                                    self._write_bound(piece.size, job)))
                while pending:
                    files.append(self._result(pending.popleft(), plan))
                files.sort(key=lambda f: f["piece"])
                st.sync_dir(d)  # the files' entries, once for all of them
                if plan.indexed:  # then the chunk list, durably (fsync, rename, dir fsync)
                    data, entry = idx.encode_index(self.rank, plan.save_id, files)
                    entry = {"file": idx.index_name(self.rank, plan.save_id), **entry}
                    st.publish(f"{d}/{entry['file']}", data)
                    job.my_index = entry
                job.my_files = files
            except BaseException:
                job.failed.set()  # (a capped pool's staging stops waiting for a buffer)
                raise
            finally:
                # after a failure: the writes under way end first (each bounded by the save's
                # deadline; they release their own buffers), then the pieces still coming are
                # taken (bounded: staging stops once it sees job.failed)
                wait_all([f for f, _, _ in pending], timeout=max(
                    [b - time.monotonic() for _, _, b in pending] + [0.0]))
                drain_until = time.monotonic() + DRAIN_S
                while remaining and time.monotonic() < drain_until:
                    try:
                        piece, buf, _, ready = job.pieces.get(timeout=0.1)
                    except queue.Empty:
                        continue
                    remaining = 0 if piece is None else remaining - 1
                    if piece is not None:
                        self._release(buf, ready)
            if job.my_index is not None:  # the chunks are in the index: names and sizes only
                # (and the chunks of tensors that are not DTensor shards: the coordinator lists
                # the written-once ones in the manifest too, its "inline")
                sharded = {c.fqn for c in plan.my_chunks if c.dtensor}
                result = {"ok": True, "index": job.my_index,
                          "files": [{k: f[k] for k in ("file", "piece", "size")}
                                    for f in files],
                          "inline": [{**c, "file": f["file"]} for f in files
                                     for c in f["chunks"] if c["fqn"] not in sharded]}
            else:
                result = {"ok": True, "files": files}
            # the skeleton travels with the result (only the coordinator needs it), and only
            # rank 0's when every rank's hash was rank 0's at the plan exchange
            if self.rank == 0 or not plan.same_tree:
                result["tree"] = plan.tree
        except Exception as e:
            local_exc = e
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        if local_exc is None and job.cancel.is_set():
            local_exc = FastCkptError(f"save of step {plan.step} was cancelled (superseded by a "
                                      "newer save, or its call was interrupted); nothing was "
                                      "committed")
            result = {"ok": False, "error": str(local_exc)}
        t1 = time.perf_counter()
        deadline = time.monotonic() + self.options.commit_timeout_s
        if job.deadline is not None:
            deadline = min(deadline, job.deadline)
        try:
            commit(self.group.exchange, save_id=plan.save_id, rank=self.rank,
                   world_size=plan.world_size, result=result, deadline=deadline,
                   coordinator=lambda results: self._coordinate(
                       job, results, self.storage.bounded(deadline)))
        except FastCkptError as e:
            if not getattr(e, "outcome_unknown", False):
                self._discard(job, marker)
                if local_exc is not None and e.__cause__ is None:
                    raise e from local_exc
                raise
            # the coordinator may have committed before it became unreachable, and a manifest
            # may reference this rank's shards: they stay, whatever is found
            if local_exc is not None or not self._committed_anyway(job):
                if not getattr(e, "missing_ranks", None):
                    raise  # (the coordinator's manifest write: whether it landed is unknown)
                raise CommitTimeoutError(
                    f"save {plan.save_id} of step {plan.step}: no commit decision from the "
                    "coordinator, rank(s) [0], within the deadline (rank 0 died, hangs, or its store "
                    "is unreachable) and the step has no manifest naming this save: not "
                    "committed; this rank's shards stay (the next commit or `fastckpt gc` "
                    "removes them); the previous committed checkpoint is intact",
                    missing_ranks=[0], rank=self.rank, outcome_unknown=True) from (
                        local_exc or e)
            log.warning("fastckpt: rank %d: no commit decision from rank 0 for step %d, but "
                        "the step's manifest names this save: committed", self.rank, plan.step)
        job.handle.timings["commit_s"] = time.perf_counter() - t1
        if self.rank == 0:
            self._housekeep(job)
        job.handle.bytes_written = sum(f["size"] for f in job.my_files) or plan.file_size
        job.handle.raw_bytes = plan.file_size
        job.handle.timings["write_s"] = t1 - t0
        job.handle.timings["total_s"] = time.perf_counter() - job.t0
        for cb in self.on_saved:
            cb(plan.file_size, t1 - t0, job.handle.timings.get("stage_s", 0.0))
        for cb in self.on_committed:
            cb(job)

    def _write_bound(self, nbytes: int, job: Job, since: float | None = None) -> float:
        """(``time.monotonic()``) until when a shard write of ``nbytes`` just submitted is
        waited for: the save's write deadline, or, when later, :data:`WRITE_STALL_S` plus its
        bytes at :data:`MIN_WRITE_BPS` (a slow disk that answers finishes a large shard past
        the phase's deadline); an emergency save's: its deadline. Then
        :data:`WRITE_GRACE_S`, so that a remote store's own bound reports first."""
        now = time.monotonic() if since is None else since
        end = job.write_deadline
        if job.deadline is None:
            end = max(end, now + WRITE_STALL_S + nbytes / MIN_WRITE_BPS)
        return end + WRITE_GRACE_S

    def stuck_bound(self, nbytes: int, deadline: float | None) -> float:
        """(training thread, a save of ``nbytes`` on this rank) Its handle's last bound
        (``SaveHandle.bound``): the writer's phases each end by theirs (the writes: the
        write deadline or :meth:`_write_bound`'s allowance; the commit exchange; the
        housekeeping), so a save still running past them all, plus STUCK_SLACK_S, is held by a
        call that does not return. An emergency save: its deadline plus the slack."""
        if deadline is not None:
            return deadline + _handle.STUCK_SLACK_S
        return (time.monotonic() + 3 * self.options.commit_timeout_s + WRITE_STALL_S
                + nbytes / MIN_WRITE_BPS + WRITE_GRACE_S + _handle.STUCK_SLACK_S)

    def _next_piece(self, job: Job, pending: collections.deque, plan: SavePlan,
                    nbytes: int) -> tuple:
        """(background) The next staged piece, ``nbytes`` still to come. While staging waits
        for a buffer the oldest write under way holds (a capped pool), that write is held to
        its bound; with none under way, staging gets :meth:`_write_bound`'s allowance for the
        bytes left (a training thread stuck in a device copy fails the save; since 2026-12-07,
        before which this wait had no end of its own and woke every 0.1 s)."""
        since = time.monotonic()
        while True:
            under_way = next((p for p in pending if not p[0].done()), None)
            until = under_way[2] if under_way else self._write_bound(nbytes, job, since)
            try:
                return job.pieces.get(timeout=max(0.0, until - time.monotonic()))
            except queue.Empty:
                if under_way is not None:
                    self._result(under_way, plan)  # (raises, unless it has just returned)
                    since = time.monotonic()  # its buffer is free from now on
                    continue
                raise FastCkptError(
                    f"staging of step {plan.step} handed over nothing for {until - since:.0f} s "
                    f"({nbytes} bytes left): the copy of the state stopped; not committed",
                    rank=self.rank) from None

    def _result(self, pending: tuple, plan: SavePlan) -> dict:
        """A shard write's entries (raising its error), waited for until its bound
        (:meth:`_write_bound`): a write into a file system that stopped answering fails the
        save, naming the file, and is left to its thread (local system calls cannot be
        interrupted)."""
        fut, path, until = pending
        bound = max(until - time.monotonic(), 0.0)
        try:
            return fut.result(timeout=bound)
        except FutureTimeout:
            raise StorageError(
                f"the shard write of step {plan.step} did not finish within its bound (the "
                f"save's write deadline, commit_timeout_s={self.options.commit_timeout_s:g}, "
                f"or {WRITE_STALL_S:g} s + its bytes at {MIN_WRITE_BPS >> 20} MiB/s; an "
                "emergency save: its grace): the file system stopped answering (a hung NFS "
                "mount, a failing device?); not committed; check the mount: the write keeps "
                "its thread until it returns", rank=self.rank, file=path) from None

    def _committed_anyway(self, job: Job) -> bool:
        """(background, after the coordinator's decision could not be read) Whether the step's
        manifest is there and names this save: the coordinator committed, then became
        unreachable (a job whose rank 0 exited, or was killed, right after its last save)."""
        st = self.storage.bounded(time.monotonic() + DISCARD_S)
        try:
            body = read_manifest(st, job.step_dir, step=job.plan.step, chunks=False)
        except Exception as e:  # noqa: BLE001 - unknown stays unknown
            log.warning("fastckpt: rank %d: could not read step %d's manifest: %s", self.rank,
                        job.plan.step, e)
            return False
        return body is not None and body.get("save_id") == job.plan.save_id

    def _discard(self, job: Job, marker: str) -> None:
        """(background, after a failed save) Remove this rank's files of the save, so a full
        disk is not kept full by the attempt; best effort and bounded (DISCARD_S on a remote
        store), the next commit removes the rest."""
        st = self.storage.bounded(time.monotonic() + DISCARD_S)
        try:
            for piece in job.plan.pieces:
                st.remove(
                    f"{job.step_dir}/{fmt.shard_name(self.rank, job.plan.save_id, piece.index)}")
            if job.plan.indexed:
                st.remove(f"{job.step_dir}/{idx.index_name(self.rank, job.plan.save_id)}")
            if self.rank == 0:
                st.remove(marker)
        except Exception as e:  # noqa: BLE001
            log.warning("fastckpt: rank %d: could not remove the failed save's files: %s",
                        self.rank, e)

    def _release(self, buf: Any, ready: Any) -> None:
        """(background) Give an unwritten piece's buffer back once no copy still fills it;
        never raises (a failed device wait still gives it back: the drain of a failed save
        must go on, or a capped pool leaves the training thread waiting)."""
        try:
            if ready is not None:
                ready.wait()
        except Exception as e:  # noqa: BLE001 - (a sticky device error) the save fails anyway
            log.error("fastckpt: rank %d: waiting for a piece's device copies failed: %s",
                      self.rank, e)
        self.pool.release(buf)

    def _write_piece(self, st: Storage, d: str, plan: SavePlan, piece: Any, buf: memoryview,
                     hashes: list[int] | None, ready: Any = None, compress: bool = False
                     ) -> dict:
        """(background) Write one shard file from its staged buffer, then release the buffer to
        the pool; the file's manifest entries.
        ``hashes``: the chunks' checksums when staging computed them, else computed here while
        writing. ``ready``: the device-to-host copies into ``buf`` to wait for first. No
        whole-file checksum: every byte of a shard is a chunk (checksummed) or alignment padding
        (zero), which is what ``verify`` checks."""
        if ready is not None:
            try:
                ready.wait()
            except BaseException:
                self.pool.release(buf)  # (a failed device wait: the buffer goes back)
                raise
        name = fmt.shard_name(self.rank, plan.save_id, piece.index)
        path = f"{d}/{name}"
        gathered = isinstance(buf, Gathered)
        ranges = [(s.offset, s.spec.nbytes) for s in piece.slots]
        if compress and not gathered:  # encoded, then written; checksums of the stored bytes
            t_enc = time.perf_counter()
            try:
                out, size, entries = self.compression.encode_piece(piece, buf)
            finally:
                self.pool.release(buf)
            t_write = time.perf_counter()
            self.compression.record_encode(piece.size, t_write - t_enc, size)
            try:
                hashes = st.write_shard(path, out, size, [(o, n) for _, o, n, _ in entries],
                                        sync_dir=False)
            finally:
                self.compression.release(out)
            self.compression.record_write(size, time.perf_counter() - t_write)
            chunks = [{"fqn": sl.spec.fqn, "offsets": list(sl.spec.offsets),
                       "sizes": list(sl.spec.sizes), "offset": o, "length": n,
                       "checksum": fmt.hexdigest(h), "codec": desc}
                      for (sl, o, n, desc), h in zip(entries, hashes)]
            return {"file": name, "piece": piece.index, "size": size, "chunks": chunks}
        t_write = time.perf_counter()
        if gathered:  # zero-copy: from the tensors' memory and a small bounce buffer
            hashes = st.write_gathered(path, piece.size, buf.segments, buf.hash_ranges)
        else:
            try:
                hashes = st.write_shard(path, buf, piece.size, ranges, hashes=hashes,
                                        sync_dir=False)
            finally:
                self.pool.release(buf)
        if self.compression is not None:  # the target's bandwidth, for compression="auto"
            self.compression.record_write(piece.size, time.perf_counter() - t_write)
        chunks = [{"fqn": s.spec.fqn, "offsets": list(s.spec.offsets),
                   "sizes": list(s.spec.sizes), "offset": s.offset, "length": s.spec.nbytes,
                   "checksum": fmt.hexdigest(h)} for s, h in zip(piece.slots, hashes)]
        return {"file": name, "piece": piece.index, "size": piece.size, "chunks": chunks}

    def _coordinate(self, job: Job, results: list[dict], st: Storage) -> dict:
        """(coordinator) Write the manifest for a save every rank completed; the commit point
        (``st``: the storage bounded by the commit deadline)."""
        plan, d = job.plan, job.step_dir
        trees = results
        files: dict[str, dict] = {}
        compressed = False
        inline: dict = {}
        indexes = [res.get("index") for res in results]
        if plan.indexed and all(indexes):  # format 4: the chunks stay in the ranks' indexes
            tensors = {fqn: dict(m) for fqn, m in plan.tensors.items()}
            for r, res in enumerate(results):
                for f in res["files"]:
                    files[f["file"]] = {"rank": r, "size": f["size"]}
            inline = idx.inline_chunks(tensors, results)
            results = []
        elif any(indexes):
            raise FastCkptError("ranks disagree on whether the save is indexed: rank(s) "
                                f"{[r for r, i in enumerate(indexes) if not i][:8]} sent no "
                                "chunk index (nothing was committed)")
        else:
            indexes = []
            tensors = {fqn: {**m, "chunks": []} for fqn, m in plan.tensors.items()}
        for r, res in enumerate(results):
            for f in res["files"]:
                files[f["file"]] = {"rank": r, "size": f["size"]}
                for c in f["chunks"]:
                    compressed = compressed or c.get("codec") is not None
                    tensors[c["fqn"]]["chunks"].append(idx.chunk_entry(c, r, f["file"]))
        body = fmt.new_manifest_body(step=plan.step, world_size=plan.world_size,
                                     save_id=plan.save_id, files=files, tensors=tensors,
                                     trees=([trees[0]["tree"]] * len(trees)
                                            if plan.same_tree else
                                            [res["tree"] for res in trees]),
                                     user_meta=job.user_meta,
                                     torch_version=_torch_version())
        if indexes:
            body["indexes"] = indexes
            # (older readers ignore it and read every index; empty, it still tells a reader
            # that a rank's own index holds what it wrote: a state of DTensors alone)
            body["inline"] = inline
        if self.lease is not None:  # nobody took the root over since the save began
            self.lease.check()
        # indexes: version 4; compressed chunks: 3 (an older reader would take their bytes as
        # raw)
        version = 4 if indexes else 3 if compressed else plan.format_version
        data = fmt.encode_manifest(body, max(plan.format_version, version))
        # (before the write: a coordinator that finds its manifest there after an unclear
        # write, ``_committed_anyway``, keeps these in its housekeeping)
        job.files = set(files) | {i["file"] for i in indexes}
        check_present(st, d, {**{n: f["size"] for n, f in files.items()},
                              **{i["file"]: i["size"] for i in indexes}})
        publish_checked(st, self.storage, f"{d}/{fmt.MANIFEST}", data, plan.save_id,
                        step=plan.step)
        job.manifest = data
        # nothing else here: the outcome is published as soon as the manifest is (the other
        # ranks wait only until the deadline); housekeeping runs after it (_housekeep)
        return {"step": plan.step, "bytes": sum(f["size"] for f in files.values())}

    def _housekeep(self, job: Job) -> None:
        """(coordinator, after the outcome was published) The ``latest`` hint, the leftovers of
        earlier attempts at this step, retention. None of it can undo the commit; each part runs
        even when another failed, and what failed is finished by the next save's retention or
        by ``fastckpt gc``. An emergency save (``job.deadline``) removes no committed step: it
        runs inside the grace window, before the ranks' final barrier, and removal is not free
        anywhere (an object store's DELETEs; on local ext4 mounted with ``discard``, removing a
        1.5 GiB step took about 0.25 s here, and a 15 GB shard per rank takes seconds); the
        next save's retention, after the restart, removes what it left. On a local file system
        it still removes abandoned partial steps (the save it superseded, whose ranks have
        discarded their own files: an empty directory or nearly). Bounded by
        ``commit_timeout_s`` (an emergency save: its deadline), so a storage that stops
        answering cannot hold the writer."""
        deadline = time.monotonic() + self.options.commit_timeout_s
        if job.deadline is not None:
            deadline = min(deadline, job.deadline)
        st, d, plan = self.storage.bounded(deadline), job.step_dir, job.plan

        def leftovers() -> None:
            keep = job.files | {fmt.MANIFEST}
            for n in st.listdir(d):
                if n not in keep:
                    st.remove(f"{d}/{n}")

        def retention(keep_last: int | None) -> None:
            if self.lease is not None:  # taken over since the check before the manifest (a
                self.lease.check()      # partition while it was written): remove nothing
            removed = apply_retention(st, keep_last, protect={plan.step} | set(self.protect())
                                      | self.keep, force_partial=True)
            if removed:
                log.info("fastckpt: retention removed steps %s", removed)

        parts = [
            # a hint for people and scripts (fastckpt itself lists the steps): not synced
            ("updating the latest hint", lambda: st.publish(
                st.join(fmt.LATEST), json.dumps({"step": plan.step}).encode(), durable=False)),
            ("removing leftovers of earlier attempts", leftovers),
        ]
        if job.deadline is None:
            parts.append(("retention", lambda: retention(self.options.keep_last)))
        elif st.is_local:  # only the abandoned partial steps (a superseded save's, whose
            # ranks removed their own files already): no committed step
            parts.append(("removing abandoned partial steps", lambda: retention(None)))

        def run_parts() -> None:
            for what, fn in parts:
                try:
                    fn()
                except Exception as e:  # noqa: BLE001 - committed: retried by the next save/gc
                    log.warning("fastckpt: step %d committed, but %s failed: %s (the next save "
                                "or `fastckpt gc` finishes it)", plan.step, what, e)
        try:
            st.run("the housekeeping after a commit", run_parts)  # (one hand-off for all)
        except Exception as e:  # noqa: BLE001 - (its bound passed: a storage that hangs)
            log.warning("fastckpt: step %d committed, but its housekeeping failed: %s (the next "
                        "save or `fastckpt gc` finishes it)", plan.step, e)


def _torch_version() -> str:
    import torch  # already imported by the engine; recorded in the manifest
    return str(torch.__version__)
