"""``fastckpt gc``: which steps a clean-up removes and why, removing them, and the unfinished
uploads of object stores. Torch-free."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

from ..retention import INFLIGHT_GRACE_S, StepInfo, plan_removal, remove_step
from ..storage import Storage
from .describe import StepRecord, _describe_one, as_storage, describe_steps


@dataclass
class GcAction:
    """One step directory in a clean-up: removed whole, or kept; a kept committed step may
    still have ``leftovers`` removed (the in-flight marker of a save that committed, temporary
    files of an interrupted publish)."""
    record: StepRecord
    remove: bool
    reason: str
    done: bool = False
    skipped: str | None = None
    leftovers_removed: list = field(default_factory=list)

    @property
    def leftovers(self) -> list:
        return [] if self.remove or not self.record.committed else list(self.record.leftovers)

    def to_json(self) -> dict:
        return {"step": self.record.step, "path": self.record.path, "state": self.record.state,
                "size_bytes": self.record.size_bytes, "remove": self.remove,
                "reason": self.reason, "removed": self.done, "skipped": self.skipped,
                "leftovers": self.leftovers, "leftovers_removed": self.leftovers_removed}


def _age(now: float, t: float | None) -> str:
    if t is None:
        return "?"
    s = max(0.0, now - t)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h" if s < 172800 else f"{s / 86400:.0f} days"


def _busy(r: StepRecord, now: float, grace: float) -> bool:
    return r.inflight_since is not None and now - r.inflight_since < grace


def plan_gc(root: str | Storage, keep: int | None, *, grace: float = INFLIGHT_GRACE_S,
            now: float | None = None) -> list[GcAction]:
    """What ``fastckpt gc --keep N`` does: one action per step directory, ascending.

    Removed: committed steps older than the newest ``keep`` committed ones (``keep=None``: no
    committed step), and abandoned partial steps (no manifest, no in-flight marker and no file
    younger than ``grace`` seconds). Never removed: the newest committed step, a step that may
    be being written (a partial step with recent activity, or a committed step with a recent
    in-flight marker: it is being saved again), a step whose manifest is damaged (inspect it
    and remove it by hand). The committed/partial rules are the engine's
    (:func:`fastckpt.retention.plan_removal`); this adds the file-age, re-save and
    damaged-manifest protections.

    Steps are described from their manifests and one listing each (per-rank chunk indexes
    present with their pinned sizes); the newest committed steps are then read and checked as
    a load checks them, index by index, until ``keep`` of them pass (one with ``keep=None``).
    Those are what the removal of every older step relies on; an older committed step is
    removed unread (at N ranks, reading every index of every step is N reads per step). An
    index damaged in place, its size kept, in one of the newest steps makes that step
    "corrupt" (kept, and the next older one is read instead); in a step older than the kept
    ones it goes unnoticed, and the step is removed like any other past ``keep``.
    """
    if keep is not None and keep < 1:
        raise ValueError("keep must be >= 1")
    storage = as_storage(root)
    now = time.time() if now is None else now
    recs = describe_steps(storage, grace=grace, now=now, indexes="listed")
    _read_kept(storage, recs, keep or 1, now, grace)
    # (a step `verify` recorded as FAILED is never counted toward --keep, nor removed: before
    # 2026-12-06 it counted, and `gc --keep 1` kept it and removed the loadable steps)
    eligible = [r for r in recs if r.state in ("committed", "partial") and not _failed(r)]
    infos = [StepInfo(r.step, r._dir, r.committed, r.inflight_since) for r in eligible]
    # a committed step being saved again (a job that went back to an earlier step)
    resaving = {r.step for r in eligible if r.committed and _busy(r, now, grace)}
    doomed = {i.step for i in plan_removal(infos, keep, now=now, protect=resaving,
                                           grace=grace)}
    actions = []
    for r in recs:
        if r.step in resaving and not r.latest:
            actions.append(GcAction(r, False, "a new save of this step is in flight (marker "
                                    f"{_age(now, r.inflight_since)} old)"))
        elif _failed(r):
            actions.append(GcAction(r, False, "verify recorded it as damaged (FAILED): kept, "
                                    "not counted toward --keep; inspect it, remove it by hand"))
        elif r.step in doomed and r.state in ("committed", "partial"):
            why = (f"older than the newest {keep} committed step(s)" if r.committed
                   else "abandoned partial save (no manifest, nothing written for "
                        f"{_age(now, r.modified_unix)})")
            actions.append(GcAction(r, True, why))
        elif r.latest:
            actions.append(GcAction(r, False, "newest committed step"))
        elif r.committed:
            actions.append(GcAction(r, False, f"within the newest {keep} committed"
                                    if keep else "committed (no --keep given)"))
        elif r.state == "writing":
            since = r.inflight_since if r.inflight_since else r.modified_unix
            actions.append(GcAction(r, False, f"may be being written (activity {_age(now, since)}"
                                    " ago)"))
        elif r.state == "corrupt":
            actions.append(GcAction(r, False, "manifest is damaged: inspect and remove by hand"))
        else:
            actions.append(GcAction(r, False, "kept"))
    return actions


def _read_kept(storage: Storage, recs: list[StepRecord], k: int, now: float,
               grace: float) -> None:
    """Re-describe the newest committed steps of ``recs`` (in place) with their indexes read
    and checked, newest first, until ``k`` of them pass; then mark the newest that passed."""
    found = 0
    for i in range(len(recs) - 1, -1, -1):
        if found >= k:
            break
        if recs[i].committed and not _failed(recs[i]):
            recs[i] = _describe_one(storage, recs[i].step, recs[i]._dir, now, grace)
            found += recs[i].committed and not _failed(recs[i])
    newest = max((r.step for r in recs if r.committed and not _failed(r)), default=None)
    for r in recs:
        r.latest = r.step == newest


def _failed(r: StepRecord) -> bool:
    """A committed step whose data ``verify`` found damaged (its recorded result)."""
    return r.committed and r.checksum == "failed"


def run_gc(root: str | Storage, actions: list[GcAction], *, grace: float = INFLIGHT_GRACE_S,
           progress: Callable[[GcAction], None] | None = None) -> list[GcAction]:
    """Remove the steps ``plan_gc`` marked, re-checking each one just before from its manifest
    and listing (a step whose state changed or where a save started since the plan is left
    alone). Removal deletes the manifest first."""
    storage = as_storage(root)
    for a in actions:
        if not a.remove:
            if a.leftovers:
                fresh = _describe_one(storage, a.record.step, a.record._dir, time.time(), grace,
                                      "listed")
                if fresh.committed and fresh.save_id == a.record.save_id:
                    for n in sorted(set(a.leftovers) & set(fresh.leftovers)):
                        storage.remove(f"{a.record._dir}/{n}")
                        a.leftovers_removed.append(n)
            continue
        now = time.time()
        # unchanged since the plan: the manifest (its save) and the listing, indexes unread
        fresh = _describe_one(storage, a.record.step, a.record._dir, now, grace, "listed")
        if fresh.state != a.record.state or _busy(fresh, now, grace) or (
                fresh.committed and fresh.save_id != a.record.save_id):
            a.skipped = (f"state changed to {fresh.state} since the plan"
                         if fresh.state != a.record.state else "a save started since the plan")
            if progress:
                progress(a)
            continue
        remove_step(storage, a.record._dir)
        a.done = True
        if progress:
            progress(a)
    return actions


def stale_uploads(root: str | Storage, *, grace: float = INFLIGHT_GRACE_S,
                  now: float | None = None) -> list[dict]:
    """Unfinished multipart uploads under the root (object stores) begun more than ``grace``
    seconds ago: a save that was killed, or whose abort failed because the store stopped
    answering (the engine logs those and says "fastckpt gc aborts it"). Each is
    ``{"url", "key", "upload_id", "initiated_unix"}``; younger ones may be a save in flight."""
    storage = as_storage(root)
    now = time.time() if now is None else now
    return [u for u in storage.incomplete_uploads()
            if now - float(u.get("initiated_unix") or 0.0) >= grace]


def abort_uploads(root: str | Storage, uploads: list[dict]) -> list[dict]:
    """Abort the given unfinished uploads (from :func:`stale_uploads`); the ones aborted."""
    storage = as_storage(root)
    done = []
    for u in uploads:
        storage.abort_upload(u)
        done.append(u)
    return done


