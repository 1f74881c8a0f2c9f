"""Local-first tiering: every save commits to the local root (the short stall, the fast
device), then each rank uploads its shard files of that step to the remote root and the
coordinator commits the same manifest there. On a preempted cloud VM the local NVMe goes with
the node: a checkpoint counts once it is off the node.

Call sequence of one upload (``Tier``; "uploader": one background thread per Checkpointer):

1. (all ranks, training thread, in the save's plan exchange) rank 0 says whether its
   uploader is still busy with an earlier step (it names every chained step, and is idle only
   once the others' uploads of the last one are over); if not, the step is uploaded once it
   is committed locally, else it is *deferred* (``SaveHandle.remote_state == "deferred"``)
   and rank 0 expects it. Reading busy and expecting the step are one step under the tier's
   lock (``reserve``, then ``planned``). No local save ever waits for an upload.
2. (all ranks, writer thread, after the local commit) the step goes to the uploader: this
   rank's files (names, sizes, chunk offsets and checksums) and, on the coordinator, the
   manifest's bytes; a deferred step replaces the previous deferred one (which is then
   "skipped": it stays local). Local retention keeps both until their upload is over.
3. (all ranks, uploader) (coordinator, first upload) take the remote root's writer lease.
   Upload each file: the local file mapped read-only (its pages are read from the page cache
   by the HTTP client; no staging copy), its parts in flight at once (``S3Storage``), every
   chunk's checksum computed again from the mapped bytes and compared with the manifest's: a
   file that changed on the local disk is not committed remotely.
4. (all ranks, uploader) ``commit.commit`` under ``<save_id>.remote`` with the upload's
   deadline (``commit_timeout_s``; an emergency upload: the grace deadline): (coordinator)
   one listing checks every file the manifest names is in the remote step directory, then
   the same manifest bytes on the remote root, by a conditional PUT; every rank learns the
   outcome. A failed upload removes the remote files this attempt wrote (bounded), never one
   a committed remote manifest names; nothing is visible remotely without the manifest.
5. (coordinator) the remote ``latest`` hint, leftovers of earlier attempts, retention with
   ``remote_keep_last`` (an emergency upload removes nothing, as an emergency save; partial
   steps only below this one: the other ranks do not wait for this, and a newer partial step
   may be their emergency upload in flight), then local retention of committed steps that
   were kept only for their upload; each on a bounded view (a hung mount cannot hold it).
6. The handle's remote completion is set: committed, or failed (``wait_remote()`` raises).
7. (all ranks, uploader) the chain: (coordinator) names the newest deferred step under
   ``<save_id>.chain`` (or none, once no step it expects is still being written locally);
   every rank uploads that step next (1-6), its uploader staying busy meanwhile. So the
   remote tier gets the newest step whenever the uploader is free, and ``close()`` (which
   waits for the chain) leaves the newest step uploaded. Every wait is bounded by
   ``commit_timeout_s``; an upload superseded by a preemption stops waiting at its commit
   (its peers may never report: their tiers froze first).

Resume (``Tier.load``, engine/tierload.py): every rank reports the newest committed step of
each tier; the newest step of either tier is loaded, from the local root when every rank has
it there (faster), else from the remote root; a local copy that fails to load (a damaged or
missing shard) is loaded from the remote tier instead, and a step damaged in every tier that
holds it makes a resume load the newest older step of either tier (3 steps back at most).
``last_load`` says which tier it came from. A tier that could not be listed fails the resume
by name (the newest step is unknown).

``close()`` waits for the uploader until the last upload's bound, then raises a StorageError
naming the call that holds it. A remote root in or above the local root is refused.

Limits: the local root is one file system every rank of the job sees (one node's NVMe, or a
shared file system), as for an untiered root. Node-local disks of a multi-node job are not a
local tier yet.
"""

from __future__ import annotations

import json
import logging
import mmap
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError, FastCkptError, StorageError
from ..lease import WriterLease
from ..manifest import schema as fmt
from ..manifest.discovery import read_manifest
from ..retention import apply_retention
from ..storage import Storage
from . import handle as _handle
from .commit import commit, publish_checked
from .tierload import (check_apart, check_present, drop_cache, manifest_names, named_files,
                       run_parts)

log = logging.getLogger("fastckpt")
#: how long a rank waits at a time for the coordinator's choice of the next upload (it
#: checks between slices whether a preemption froze the tier)
CHAIN_SLICE_S = 0.25

#: the record in the local root that names its remote tier (no credentials): for the CLI
TIERS_FILE = fmt.TIERS
DISCARD_S = 10.0
CLOSE_MIN_S = 5.0  # close(): the least wait for the uploader thread
DEFERRED_KEPT = 4  # deferred steps kept per rank for the chain
_SENTINEL = object()


@dataclass
class Upload:
    """One step for the uploader (see the module docstring, step 2)."""
    step: int
    save_id: str
    local_dir: str
    files: list  # this rank's: [{"file", "size", "chunks": [{"offset", "length", "checksum"}]}]
    manifest: bytes | None  # the coordinator's
    handle: Any
    named: frozenset = frozenset()  # (coordinator) the shard and index files the manifest names
    deadline: float | None = None  # monotonic; an emergency upload's
    cancel: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    seconds: float = 0.0
    started: float = 0.0  # monotonic, when its first file began (after the lease)
    written: list = field(default_factory=list)  # the files this attempt began to write


def remote_display(url: str) -> str:
    """``url`` without user info (``s3://key:secret@bucket/x`` -> ``s3://bucket/x``)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host.rsplit('@', 1)[-1]}{slash}{path}"


class Tier:
    """The remote tier of one engine (``Checkpointer(local, remote=url)``)."""

    def __init__(self, engine: Any, remote: Storage, url: str) -> None:
        check_apart(engine.storage, remote)
        self.engine = engine
        self.storage = remote
        self.url = url
        opts = engine.options
        self.keep_last = opts.keep_last if opts.remote_keep_last == "same" else \
            opts.remote_keep_last
        self.rank = engine.rank
        #: (bytes, seconds) of this rank's last uploads, for the emergency budget
        self.samples: deque = deque(maxlen=5)
        #: which tier and root the last load came from: {"step", "tier", "root"}
        self.last_load: dict | None = None
        self._queue: queue.Queue = queue.Queue()
        self._current: Upload | None = None
        self._pending = 0  # queued or running, the chain included
        self._lock = threading.Condition()
        self._deferred: list = []  # deferred, locally committed Jobs, oldest first
        #: (coordinator) Jobs planned as deferred, not yet committed locally: the chain waits
        #: for them (a chain that ended before such a step committed would leave it behind)
        self._expected: list = []
        #: (coordinator) the plan found the uploader busy, its save not yet ``planned``
        self._reserved = False
        self._newest: Any = None  # the handle of the last save planned
        self._bound = 0.0  # monotonic: the latest bound of an upload handed out (close())
        self._doing = ("", "")  # (what, path): the uploader's current call, for close()
        self._thread: threading.Thread | None = None
        self._lease: WriterLease | None = None
        self._recorded = False
        #: set by the preemption trigger: only its own uploads from now on (see ``freeze``)
        self.frozen = False

    # -- state the engine and the trigger read ------------------------------------------------
    @property
    def busy(self) -> bool:
        """An upload is queued or running on this rank."""
        with self._lock:
            return self._pending > 0

    def protected(self) -> set[int]:
        """Local steps that retention must keep: queued, deferred or being uploaded."""
        with self._lock:
            cur = self._current
            out = {u.step for u in list(self._queue.queue) if isinstance(u, Upload)}
            out |= {j.plan.step for j in self._deferred}
        if cur is not None:
            out.add(cur.step)
        return out

    def current(self) -> Upload | None:
        return self._current

    def bytes_per_s(self) -> float | None:
        """This rank's measured upload bandwidth (its last uploads), None before any."""
        if not self.samples:
            return None
        b = sum(s[0] for s in self.samples)
        t = sum(s[1] for s in self.samples)
        return b / t if t > 0 else None

    # -- the engine's calls --------------------------------------------------------------------
    def record(self) -> None:
        """(coordinator, first save) Name the remote tier in the local root, for the CLI."""
        if self._recorded or self.rank != 0:
            return
        st = self.engine.storage
        try:
            st.publish(st.join(TIERS_FILE), json.dumps(
                {"remote": remote_display(self.url)}).encode(), durable=False)
            self._recorded = True
        except StorageError as e:
            log.warning("fastckpt: could not record the remote tier in %s: %s", st.root, e)

    def reserve(self) -> bool:
        """(the plan exchange) Whether the uploader is busy; if so, the chain does not end
        before the save is ``planned`` (before 2026-12-06 the deferred step was expected only
        after the staging's set-up: a chain that ended in between left it "deferred" for
        good). A save that fails first: the next plan, ``close()`` or the chain's bound."""
        with self._lock:
            self._reserved = self._pending > 0
            return self._reserved

    def planned(self, job: Any, upload: bool) -> None:
        """(training thread) The plan's verdict: "pending" or "deferred" (then the coordinator
        expects it: until it is committed, ``defer``, or failed, the chain waits for it); the
        reservation is dropped. An emergency save's upload is the trigger's (``submit``)."""
        h, mine = job.handle, job.deadline is None
        if mine:
            job.upload, h.remote_state = upload, "pending" if upload else "deferred"
            h.remote_bound = (h.bound or time.monotonic()) + (1 if upload else 2) * self.allow()
        with self._lock:
            self._reserved = False
            if mine and not upload and self.rank == 0:
                self._expected = [j for j in self._expected if not j.handle.done()] + [job]
            if mine:
                self._newest, self._bound = h, max(self._bound, h.remote_bound)
            self._lock.notify_all()

    def allow(self) -> float:
        """The longest one upload runs once begun (a call left to its thread aside): files and
        commit, housekeeping (2 roots) or discard, the chain's choice, a save's slack."""
        return 4 * self.engine.options.commit_timeout_s + DISCARD_S + _handle.STUCK_SLACK_S

    def defer(self, job: Any) -> None:
        """(writer thread) A committed local save whose plan found an uploader busy: a
        candidate of the chain (step 7). The last few are kept: a rank may commit a newer
        one before the coordinator names the older one (its housekeeping comes first)."""
        with self._lock:
            self._expected = [j for j in self._expected if j is not job]
            self._deferred.append(job)
            old = self._deferred[:-DEFERRED_KEPT]
            del self._deferred[:-DEFERRED_KEPT]
            self._lock.notify_all()
        for j in old:
            _skipped(j)

    def _take_deferred(self, save_id: str | None, until: float) -> Any:
        """A deferred job, removed with the older ones (which are skipped): ``save_id``'s,
        waited for until ``until``; None: the newest there is (or None), waiting until
        ``until`` while a save planned as deferred is still being written (``expect``)."""
        with self._lock:
            while True:
                ids = [j.plan.save_id for j in self._deferred]
                if save_id is None:  # (a failed save's handle is done without a defer)
                    self._expected = [j for j in self._expected if not j.handle.done()]
                    ready = bool(ids) or not (self._expected or self._reserved) or self.frozen
                else:
                    ready = save_id in ids
                if ready:
                    i = len(ids) - 1 if save_id is None else ids.index(save_id)
                    job = self._deferred[i] if i >= 0 else None
                    older = self._deferred[:max(i, 0)]
                    del self._deferred[:i + 1]
                    break
                left = until - time.monotonic()
                if left <= 0:
                    return None
                self._lock.wait(min(left, 0.1 if save_id is None else 1.0))
        for j in older:
            _skipped(j)
        return job

    def _upload_of(self, job: Any, deadline: float | None) -> Upload:
        bound = (time.monotonic() + self.allow() if deadline is None
                 else deadline + DISCARD_S + _handle.STUCK_SLACK_S)
        job.handle._remote_begin(bound)
        with self._lock:
            self._bound = max(self._bound, bound)
        files = list(job.my_files)
        if job.my_index is not None:  # format 4: this rank's chunk index goes up with its
            # shards, checked like one chunk (its checksum: xxh3-64 of all its bytes)
            i = job.my_index
            files.append({"file": i["file"], "size": i["size"], "chunks": [
                {"offset": 0, "length": i["size"], "checksum": i["checksum"]}]})
        return Upload(step=job.plan.step, save_id=job.plan.save_id, local_dir=job.step_dir,
                      files=files, manifest=job.manifest, handle=job.handle,
                      named=frozenset(job.files), deadline=deadline)

    def submit(self, job: Any, deadline: float | None = None) -> Upload:
        """(writer thread, or the trigger) Queue the upload of a committed local save."""
        up = self._upload_of(job, deadline)
        with self._lock:
            self._pending += 1
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="fastckpt-uploader",
                                            daemon=True)
            self._thread.start()
        self._queue.put(up)
        return up

    def freeze(self) -> None:
        """(preemption) From now on only the emergency path starts uploads: committed saves
        are not handed over, the chain stops, queued uploads that have not begun fail at once
        (the one in flight goes on: the decision may let it finish, or supersede it)."""
        self.frozen = True
        with self._lock:
            for u in list(self._queue.queue):
                if isinstance(u, Upload) and u.deadline is None:
                    u.cancel.set()

    def supersede(self) -> Upload | None:
        """Stop the upload in flight before its next file (it fails, nothing committed; one
        whose last file is under way ends and may still commit: an older step, complete)."""
        cur = self._current
        if cur is not None:
            cur.cancel.set()
        return cur

    def close(self, error: BaseException | None = None) -> BaseException | None:
        """Finish the queued uploads (each bounded by its deadline), stop the thread, release
        the remote lease; ``error`` (the writer's), else a StorageError naming the call that
        holds the uploader past the last upload's bound (before 2026-12-06: joined without
        one, a hung mount held ``close()`` for good). Warns of an unseen failed newest upload."""
        with self._lock:
            self._reserved = False  # (a save that failed after its plan: nothing comes)
            self._lock.notify_all()
        th, stuck, t0 = self._thread, None, time.monotonic()
        if th is not None:
            self._queue.put(_SENTINEL)
            while th.is_alive() and time.monotonic() < max(self._bound, t0 + CLOSE_MIN_S):
                th.join(min(max(self._bound, t0 + CLOSE_MIN_S) - time.monotonic(), 1.0))
            if th.is_alive():
                stuck = StorageError(
                    f"closing: the uploader is still {self._doing[0] or 'running'} past its "
                    "bound (a hung mount or store?); the steps committed before are untouched, "
                    "the remote lease is released, the thread runs until the call returns",
                    rank=self.rank, file=self._doing[1] or None)
            self._thread = None
        if self._lease is not None:
            self._lease.release()
            self._lease = None
        h = self._newest
        if h is not None and h.remote_state == "failed" and not h._remote_reported:
            log.warning("fastckpt: rank %d: closing: the upload of step %d, the newest, to %s "
                        "failed (%s); it is on the local tier only", self.rank, h.step,
                        remote_display(self.url), h._remote_exc)
        return error if error is not None else stuck

    # -- the uploader thread -------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            up = self._queue.get()
            if up is _SENTINEL:
                with self._lock:
                    left, self._deferred = self._deferred, []
                for j in left:  # saved just as the chain ended: it stays local
                    _skipped(j)
                return
            try:
                while up is not None:
                    self._one(up)
                    # the chain (step 7): the newest deferred step next; not after an
                    # emergency upload (the process exits)
                    up = self._chain(up) if up.deadline is None and not self.frozen else None
            finally:
                with self._lock:
                    self._pending -= 1

    def _one(self, up: Upload) -> None:
        self._current = up
        self._doing = (f"uploading step {up.step}", remote_display(self.url))
        t0 = up.started = time.monotonic()
        try:
            self._upload(up)
        except BaseException as e:  # carried to the handle
            up.error = e
            log.error("fastckpt: rank %d: upload of step %d to %s failed: %s", self.rank,
                      up.step, remote_display(self.url), e)
        finally:
            up.seconds = time.monotonic() - t0
            self._current = None
            up.done.set()
            up.handle._remote_finish(up.error)

    def _chain(self, done: Upload) -> Upload | None:
        """(all ranks) Step 7: the coordinator names the next step, the others follow."""
        ex = self.engine.group.exchange
        key = f"{done.save_id}.chain"
        until = time.monotonic() + self.engine.options.commit_timeout_s
        self._doing, job = (f"choosing the upload after step {done.step}", ""), None
        try:
            if self.rank == 0:
                job = self._take_deferred(None, until)
                ex.set(key, json.dumps(None if job is None else job.plan.save_id).encode())
            else:
                # in slices: a preemption freezes the tier on each rank at its own moment, and
                # a coordinator frozen before its upload ended names no next step, so a rank
                # frozen meanwhile stops waiting (its emergency upload is queued behind this)
                found: dict = {}
                while key not in found and not self.frozen and time.monotonic() < until:
                    found, _ = ex.wait([key], min(until, time.monotonic() + CHAIN_SLICE_S))
                if key not in found:
                    if self.frozen:
                        return None
                    log.warning("fastckpt: rank %d: no word from the coordinator on the next "
                                "upload within %.0f s", self.rank,
                                self.engine.options.commit_timeout_s)
                    return None
                save_id = json.loads(found[key])
                job = None if save_id is None else self._take_deferred(save_id, until)
                if save_id is not None and job is None:
                    log.warning("fastckpt: rank %d: the step the coordinator chose to upload "
                                "next (save %s) is not committed here", self.rank, save_id)
        except Exception as e:  # noqa: BLE001 - a store gone: no chain; saves go on
            log.warning("fastckpt: rank %d: choosing the next upload failed: %s", self.rank, e)
            if job is not None:  # (taken: failed, not "deferred" for good)
                job.handle._remote_finish(e)
            return None
        return None if job is None else self._upload_of(job, None)

    def _upload(self, up: Upload) -> None:
        opts = self.engine.options
        deadline = time.monotonic() + opts.commit_timeout_s
        if up.deadline is not None:
            deadline = min(deadline, up.deadline)
        st = self.storage.bounded(deadline)
        d = st.join(fmt.step_dirname(up.step))
        result: dict[str, Any]
        local_exc: BaseException | None = None
        nbytes = 0
        t0 = time.monotonic()
        try:
            if self.rank == 0 and self._lease is None:
                self._lease = WriterLease(self.storage, ttl_s=opts.lease_ttl_s,
                                          renew_s=opts.lease_ttl_s / 4).acquire()
            # the bandwidth sample leaves the lease's wait out (before 2026-12-06 it counted:
            # up to lease_ttl_s for a dead holder's lease; the budget then skipped uploads)
            t0 = up.started = time.monotonic()
            st.makedirs(d)
            for f in up.files:
                if up.cancel.is_set():
                    raise FastCkptError(f"upload of step {up.step} was superseded (preemption)")
                up.written.append(f["file"])
                self._upload_file(st, up, f, f"{d}/{f['file']}")
                nbytes += int(f["size"])
            result = {"ok": True}
        except Exception as e:
            local_exc = e
            result = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        secs = time.monotonic() - t0
        group = self.engine.group
        try:
            commit(group.exchange, save_id=f"{up.save_id}.remote", rank=self.rank,
                   world_size=group.world_size, result=result, deadline=deadline,
                   coordinator=lambda results: self._publish(up, self.storage.bounded(
                       deadline), d), cancel=up.cancel)
        except FastCkptError as e:
            if not getattr(e, "outcome_unknown", False):
                self._discard(up, d)
            if local_exc is not None and e.__cause__ is None:
                raise e from local_exc
            raise
        if nbytes and secs > 0:
            self.samples.append((nbytes, secs))

        if self.rank == 0:
            self._housekeep(up, d)
        log.info("fastckpt: rank %d: step %d committed on the remote tier %s (%.2f s)",
                 self.rank, up.step, remote_display(self.url), time.monotonic() - t0)

    def _upload_file(self, st: Storage, up: Upload, f: dict, dest: str) -> None:
        """One local shard file to ``dest``: mapped, uploaded, its chunks checked."""
        src = f"{up.local_dir}/{f['file']}"
        self._doing = (f"uploading step {up.step}'s file", src)
        size = int(f["size"])
        chunks = f["chunks"]
        ranges = [(int(c["offset"]), int(c["length"])) for c in chunks]
        fd = os.open(src, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
        try:
            if os.fstat(fd).st_size != size:
                raise CorruptCheckpointError(
                    f"the local shard holds {os.fstat(fd).st_size} bytes, the manifest says "
                    f"{size}: not uploaded", file=src, rank=self.rank)
            if size == 0:
                st.write_shard(dest, bytearray(1), 0, [])
                return
            mm = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        try:
            if hasattr(mm, "madvise"):  # read ahead: the HTTP client and the hash pass read it
                mm.madvise(mmap.MADV_SEQUENTIAL)
                mm.madvise(mmap.MADV_WILLNEED)
            view = memoryview(mm)
            try:
                got = st.write_shard(dest, view, size, ranges)
            finally:
                view.release()
            for c, h in zip(chunks, got):
                if fmt.hexdigest(h) != c["checksum"]:
                    self._remove(st, dest)
                    raise CorruptCheckpointError(
                        f"the local shard changed since it was written (checksum "
                        f"{fmt.hexdigest(h)}, the manifest says {c['checksum']}): not uploaded",
                        file=src, offset=int(c["offset"]), rank=self.rank)
        finally:
            try:
                mm.close()
            except BufferError:  # a view still held by the HTTP client's objects: freed with
                pass             # them (the file's fd is closed already)
            drop_cache(src)

    def _publish(self, up: Upload, st: Storage, d: str) -> dict:
        """(coordinator) The commit point of the remote tier: the local manifest's bytes."""
        if self._lease is not None:
            self._lease.check()
        if up.manifest is None:
            raise FastCkptError(f"step {up.step}: the coordinator has no manifest to upload")
        check_present(st, d, up)
        publish_checked(st, self.storage, f"{d}/{fmt.MANIFEST}", up.manifest, up.save_id,
                        step=up.step)
        return {"step": up.step}

    def _housekeep(self, up: Upload, d: str) -> None:
        """(coordinator) Step 5, on bounded views (``commit_timeout_s`` for each root; an
        emergency upload: its deadline). Before 2026-12-06 on the storages themselves: a local
        mount that stopped answering held the uploader, wait_remote() and close() for good."""
        kept = self.engine._writer.keep
        parts = [("updating the remote latest hint", lambda st: st.publish(
            st.join(fmt.LATEST), json.dumps({"step": up.step}).encode(), durable=False))]
        local: list = []
        if up.deadline is None:
            def leftovers(st: Storage) -> None:
                keep = {f["file"] for f in up.files} | {fmt.MANIFEST} | named_files(up)
                for n in st.listdir(d):
                    if n not in keep:
                        st.remove(f"{d}/{n}")
            parts.append(("removing leftovers of earlier uploads", leftovers))
            # partial steps newer than this one are kept: the other ranks do not wait for
            # this housekeeping, and a rank frozen by a preemption may be uploading the
            # emergency step already (CI caught its files removed, the step committed without)
            # keep_steps (an integration's: the Trainer's best step) holds on both tiers
            # (before 2026-12-06 both tiers' retention here removed it)
            def remote_retention(st: Storage) -> None:
                if self._lease is not None:  # not taken over since the manifest's check
                    self._lease.check()
                apply_retention(st, self.keep_last, protect={up.step} | kept,
                                force_partial=True, partial_below=up.step)
            parts.append(("remote retention", remote_retention))
            # the local steps kept for their upload (retention of the saves since protected
            # them); committed ones only: a save may be writing a partial step right now
            local.append(("local retention", lambda st: apply_retention(
                st, self.engine.options.keep_last,
                protect=(self.protected() - {up.step}) | kept, committed_only=True)))
        for storage, ps in [(self.storage, parts)] + ([(self.engine.storage, local)]
                                                      if local else []):
            end = time.monotonic() + self.engine.options.commit_timeout_s
            st = storage.bounded(end if up.deadline is None else min(end, up.deadline))
            self._doing = (f"the housekeeping after step {up.step}'s upload", storage.root)
            try:  # (one hand-off for all, as the writer's)
                st.run(self._doing[0], run_parts, up.step, st, ps)
            except Exception as e:  # noqa: BLE001 - (its bound passed: a storage that hangs)
                log.warning("fastckpt: step %d committed remotely, but its housekeeping on %s "
                            "failed: %s", up.step, storage.root, e)

    def _discard(self, up: Upload, d: str) -> None:
        """(a failed upload) Remove the remote files this attempt began to write, never one a
        committed remote manifest names (an emergency upload of a save uploaded already
        writes its names; before 2026-12-06 every file of the save went, the committed step's
        shards with them); its manifest unreadable: all kept (gc removes them)."""
        st = self.storage.bounded(time.monotonic() + DISCARD_S)
        try:
            body = read_manifest(st, d, step=up.step, chunks=False) if up.written else None
        except CorruptCheckpointError:
            body = None  # (not a step: nothing loads it)
        except Exception as e:  # noqa: BLE001 - unknown: keep them
            log.warning("fastckpt: step %d's remote files are kept: %s", up.step, e)
            return
        for n in set(up.written) - (set() if body is None else manifest_names(body)):
            self._remove(st, f"{d}/{n}")

    @staticmethod
    def _remove(st: Storage, path: str) -> None:
        try:
            st.remove(path)
        except Exception as e:  # noqa: BLE001 - gc removes it later
            log.warning("fastckpt: could not remove %s: %s", path, e)

    # -- resume across tiers (engine/tierload.py) ----------------------------------------------
    def load(self, state: dict | None, *, step: int | None, verify: bool, strict: bool,
             timeout_s: float) -> tuple[int, dict]:
        """(all ranks) Load the newest committed step of either tier (or ``step``), from the
        local root when every rank has it there; see the module docstring."""
        from .tierload import load_tiers
        return load_tiers(self, state, step=step, verify=verify, strict=strict,
                          timeout_s=timeout_s)


def _skipped(job: Any) -> None:
    job.handle.remote_state = "skipped"
    job.handle._remote_done.set()


__all__ = ["Tier", "Upload", "TIERS_FILE", "check_apart", "remote_display"]
