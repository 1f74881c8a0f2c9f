"""One writer per root: a lease held by the writing job's coordinator (rank 0).

Retention removes every partial step the writer is not writing itself, so two jobs saving into
one root would delete each other's in-flight saves. The lease makes the second writer fail at
its first ``save`` with :class:`~fastckpt.errors.WriterLockedError` naming the holder, instead.

* ``ROOT/.writer.json`` is the lease record: who holds the root (owner id, host, pid, job id
  from Slurm/torchrun/Kubernetes), when it was taken and last renewed, and its time to live.
  The holder renews it every ``RENEW_S`` from a daemon thread and removes it on ``close()``.
* On a local root, the root directory itself is also ``flock``-ed for as long as the lease is
  held (no lock file to leave behind). The kernel drops that lock the moment the holder dies,
  so on the same host (or wherever the file system propagates ``flock``) a crashed holder is
  recognised at once: whoever gets the lock takes over a record left by a process of the same
  host. Where ``flock`` is refused (NFS emulates it with POSIX locks, which need a writable
  fd), the record alone decides, with a warning.

Acquiring (``acquire``): the lock is refused -> a live holder: error. Then the record: none, or
expired (not renewed for ``ttl_s``), or left on this host while the lock was free, or written by
the same job id (a requeued Slurm job, a restarted torchrun) -> take over. A record of another
host that is not expired is waited for, at most until it expires (it is not renewed when its
holder died); renewed meanwhile -> a live holder: error. After writing its record, the taker
reads it back ``CONFIRM_S`` later: of two writers racing for a free lease, both see the last
record written, so exactly one goes on.

On object stores that honour conditional writes (S3: ``If-None-Match``, ``If-Match``; see
``Storage.conditional_writes``) the record is taken with put-if-absent, or over the record
just read (``If-Match`` its version), and renewed over its own last version: of two writers
racing for the lease exactly one write succeeds, no read-back wait is needed, and a holder
whose lease was taken over learns it at its next renewal.

Limits: object stores without conditional writes decide a race by that read-back, which holds
when both writers put their record within ``CONFIRM_S`` of reading the old one (with the lock,
no read-back is needed); a writer that
stops renewing for longer than ``ttl_s`` (a process stopped with SIGSTOP, a partitioned node)
loses the lease to the next writer, for good (``lost``): its next commit and its retention
fail on ``check``, but a commit already past its check is not prevented (documented in
docs/design.md, "Concurrency rules for a root"). Readers (``load``, ``resume``, the CLI) never
take the lease.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
import uuid
from typing import Any

from .errors import StorageError, WriterLockedError
from .storage.base import ConditionFailed
from .options import job_id
from .storage import Storage

log = logging.getLogger("fastckpt")

LEASE = ".writer.json"
TTL_S = 60.0
RENEW_S = 15.0
CONFIRM_S = 0.2
OP_S = 10.0  # the most one lease call on a remote store may take

def describe(rec: dict, now: float | None = None) -> str:
    now = time.time() if now is None else now
    age = now - float(rec.get("renewed_unix", 0) or 0)
    job = f", job {rec['job']}" if rec.get("job") else ""
    return (f"host {rec.get('host', '?')}, pid {rec.get('pid', '?')}{job}, lease renewed "
            f"{age:.0f} s ago (expires after {float(rec.get('ttl_s', TTL_S)):.0f} s)")


class WriterLease:
    """The lease of one writer on one root. Thread-safe; ``acquire`` once, ``release`` once."""

    def __init__(self, storage: Storage, *, ttl_s: float = TTL_S, renew_s: float = RENEW_S,
                 wait_s: float | None = None) -> None:
        if not ttl_s > renew_s > 0:
            raise ValueError(f"need ttl_s > renew_s > 0 (got {ttl_s}, {renew_s})")
        self.storage = storage
        self.ttl_s = float(ttl_s)
        self.renew_s = float(renew_s)
        self.wait_s = self.ttl_s + 2 * CONFIRM_S if wait_s is None else float(wait_s)
        self.path = storage.join(LEASE)
        self.owner = uuid.uuid4().hex
        self.record: dict[str, Any] = {}
        self._lock_fd: int | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._mu = threading.Lock()
        #: conditional writes (object stores that honour them): the record's last version
        self._cond = (not storage.is_local) and storage.conditional_writes()
        self._version: str | None = None
        self._seen_version: str | None = None
        #: the record of the writer that took this lease over, once seen: the lease stays
        #: lost (renew writes nothing, check raises) even after that record is gone
        self.lost: dict | None = None

    # -- acquire ------------------------------------------------------------------------------
    def acquire(self) -> "WriterLease":
        """Take the lease or raise WriterLockedError naming the holder (see the module
        docstring); waits at most ``wait_s`` for an unrenewed lease of another host to expire."""
        self._op().makedirs(self.storage.root)
        free_lock = self._lock()
        try:
            self._take(free_lock)
        except BaseException:
            self._unlock()
            raise
        self._thread = threading.Thread(target=self._renewer, name="fastckpt-lease",
                                        daemon=True)
        self._thread.start()
        return self

    def _lock(self) -> bool:
        """flock the directory of a local root; True if locked, False where it cannot be."""
        if not self.storage.is_local:
            return False
        import fcntl
        root = self.storage.root
        try:
            fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as e:
            raise StorageError(f"cannot open the root to lock it: {os.strerror(e.errno)}",
                               file=root) from e
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                rec = self._read() or {}
                who = describe(rec) if rec else "its record is not written yet"
                raise WriterLockedError(
                    f"another process is writing checkpoints to {root} ({who}); one job "
                    "writes a root at a time: give this job its own root, or stop the other "
                    "writer", holder=rec, file=root) from None
            # NFS emulates flock with POSIX locks, which a read-only directory fd cannot take
            log.warning("fastckpt: cannot flock %s (%s); the writer lease relies on its record "
                        "alone", root, os.strerror(e.errno))
            return False
        self._lock_fd = fd
        return True

    def _unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # drops the flock
            self._lock_fd = None

    def _op(self) -> Storage:
        """The storage with each lease call bounded (a remote store that stops answering
        fails a renewal or a check after OP_S, never holds a save or close())."""
        return self.storage.bounded(time.monotonic() + min(OP_S, self.renew_s))

    def _read(self) -> dict | None:
        """The record (None: absent, or not a lease record); on a conditional store
        ``_seen_version`` is the version read (None: absent), a torn record's too."""
        self._seen_version = None
        try:
            if self._cond:  # with its version, for the conditional write that follows
                got = self._op().read_versioned(self.path)
                self._seen_version = None if got is None else got[1]
                if got is None:
                    return None
                doc = json.loads(got[0])
            else:
                doc = json.loads(self._op().read_bytes(self.path))
        except StorageError as e:
            if getattr(e, "errno", None) == errno.ENOENT or isinstance(e.__cause__,
                                                                      FileNotFoundError):
                return None
            raise
        except ValueError:  # torn or foreign content: nobody's valid lease
            return None
        return doc if isinstance(doc, dict) else None

    def _mine(self, rec: dict | None, *, locked: bool) -> str | None:
        """Why an existing record may be taken over, or None if it belongs to a live holder."""
        if rec is None:
            return "free"
        now = time.time()
        try:
            expired = now - float(rec["renewed_unix"]) > float(rec.get("ttl_s", TTL_S))
        except (KeyError, TypeError, ValueError):
            return "unreadable record"
        if expired:
            return "expired"
        if locked and rec.get("host") == socket.gethostname():
            return "its holder on this host died (the lock was free)"
        mine = job_id()
        if mine is not None and rec.get("job") == mine:
            return f"left by an earlier run of this job ({mine})"
        return None

    def _take(self, locked: bool) -> None:
        end = time.monotonic() + self.wait_s
        first = self._read()
        rec = first
        while True:
            why = self._mine(rec, locked=locked)
            if why is not None:
                break
            if rec is not None and first is not None and (
                    rec.get("renewed_unix") != first.get("renewed_unix")
                    or rec.get("owner") != first.get("owner")) or time.monotonic() >= end:
                raise WriterLockedError(
                    f"another job is writing checkpoints to {self.storage.root} "
                    f"({describe(rec)}); one job writes a root at a time: give this job its "
                    f"own root, or stop the other writer (a dead holder's lease expires "
                    f"{float(rec.get('ttl_s', TTL_S)):.0f} s after its last renewal)",
                    holder=rec, file=self.path)
            time.sleep(min(1.0, max(0.05, end - time.monotonic())))
            rec = self._read()
        if why != "free":
            log.warning("fastckpt: taking over the writer lease of %s: %s (%s)",
                        self.storage.root, why, describe(rec or {}))
        now = time.time()
        self.record = {"owner": self.owner, "host": socket.gethostname(), "pid": os.getpid(),
                       "job": job_id(), "acquired_unix": now, "renewed_unix": now,
                       "ttl_s": self.ttl_s}
        if self._cond:  # exactly one of racing takers writes: no read-back
            # (a torn or foreign record is there, with a version: taken over by that version;
            # put-if-absent would fail on it for good)
            absent = rec is None and self._seen_version is None
            try:
                self._version = self._op().put_conditional(
                    self.path, self._encoded(), if_absent=absent,
                    if_match=None if absent else self._seen_version)
            except ConditionFailed:
                if self._own_write_landed():  # a retried PUT whose first answer was lost
                    return
                back = self._read() or {}
                raise WriterLockedError(
                    f"another job took the writer lease of {self.storage.root} at the same "
                    f"time ({describe(back)}); one job writes a root at a time", holder=back,
                    file=self.path) from None
            return
        self._write()
        if locked:  # the lock already excludes every other taker
            return
        time.sleep(CONFIRM_S)
        back = self._read()
        if back is None or back.get("owner") != self.owner:
            raise WriterLockedError(
                f"another job took the writer lease of {self.storage.root} at the same time "
                f"({describe(back or {})}); one job writes a root at a time", holder=back or {},
                file=self.path)

    def _own_write_landed(self) -> bool:
        """(conditional store, after ConditionFailed) Whether the record there is the one
        this holder just wrote: a request retried after its answer was lost finds its own
        write and fails the condition. Then its version is this holder's."""
        back = self._read()
        if back is not None and back == self.record:
            self._version = self._seen_version
            return True
        return False

    def _encoded(self) -> bytes:
        return (json.dumps(self.record) + "\n").encode()

    def _write(self) -> None:
        self._op().publish(self.path, self._encoded(), durable=False)

    # -- hold ---------------------------------------------------------------------------------
    def _renewer(self) -> None:
        while not self._stop.wait(self.renew_s):
            try:
                self.renew()
            except Exception as e:  # noqa: BLE001 - retried at the next period
                log.warning("fastckpt: renewing the writer lease of %s failed: %s",
                            self.storage.root, e)

    def renew(self) -> None:
        """Write the record again with the current time (also called by the renew thread)."""
        with self._mu:
            if not self.record or self._stop.is_set() or self.lost is not None:
                return
            rec = self._read()
            if rec is not None and rec.get("owner") != self.owner:
                self.lost = rec
                log.error("fastckpt: the writer lease of %s was taken over by %s; this job "
                          "must not write there any more", self.storage.root, describe(rec))
                return
            self.record["renewed_unix"] = time.time()
            if self._cond:  # over this holder's own last version, or not at all
                try:
                    self._version = self._op().put_conditional(self.path, self._encoded(),
                                                               if_match=self._version)
                except ConditionFailed:
                    if not self._own_write_landed():
                        self.lost = self._read() or {}
                        log.error("fastckpt: the writer lease of %s was taken over (%s); this "
                                  "job must not write there any more", self.storage.root,
                                  describe(self.lost))
                return
            self._write()

    def check(self) -> None:
        """Raise WriterLockedError if another writer took the lease over (checked before each
        manifest and before retention removes anything); once taken over, always (before
        2026-12-07 it passed again once the taker had released its record, and the next
        renewal wrote this holder's record back)."""
        rec = self.lost if self.lost is not None else self._read()
        if rec is not None and rec.get("owner") != self.owner:
            self.lost = rec
            raise WriterLockedError(
                f"this job's writer lease on {self.storage.root} was taken over by another job "
                f"({describe(rec)}), after this one did not renew it for {self.ttl_s:.0f} s",
                holder=rec, file=self.path)

    def release(self) -> None:
        """Stop renewing, remove the record if it is still this holder's, drop the lock.
        Idempotent; never raises (logs)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._mu:
            if self.record:
                try:
                    rec = self._read()
                    if rec is not None and rec.get("owner") == self.owner:
                        self._op().remove(self.path)
                except Exception as e:  # noqa: BLE001
                    log.warning("fastckpt: releasing the writer lease of %s failed: %s (it "
                                "expires by itself)", self.storage.root, e)
                self.record = {}
            self._unlock()
