"""The emergency path's remote tier (``Checkpointer(local, remote=url)``): what each rank
reports, and the upload the agreed decision asks for.

Call sequence inside ``Preemption._emergency`` (every rank; see trigger.py):

1. ``freeze(ckpt)``: from the stop on, only the emergency path starts uploads (the tier stops
   handing over committed saves and chaining; queued uploads that have not begun fail).
2. ``report(...)``: the time to upload the emergency step at this rank's measured upload
   bandwidth, and what is left of the upload in flight; merged into the budget report.
3. The reducer of the budget exchange (one rank, for all) adds ``budget.decide_remote``:
   upload / finish / skip, and may turn the local decision into "skip" when the local tier
   does not survive (``local_survives=False``) and only the in-flight upload fits.
4. ``before_save``: for "upload", the upload in flight (an older step) is superseded at once
   (its bandwidth goes to the new step); for "finish" it goes on.
5. ``after_save``: "upload": the checkpoint of this stop (the emergency save, or the in-flight
   save the local decision waited for) is uploaded and committed remotely under the deadline
   (collective: every rank calls it), unless its upload committed already (``decide_remote``
   says "skip" then: each rank reports ``up_committed_step``); "finish": wait for the upload
   in flight until the deadline; "skip": nothing. Each outcome is an event in the rank's log.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import budget

log = logging.getLogger("fastckpt.preempt")


def tier_of(ckpt: Any) -> Any:
    return getattr(ckpt, "tier", None)


def freeze(ckpt: Any) -> None:
    tier = tier_of(ckpt)
    if tier is not None:
        tier.freeze()


def report(ckpt: Any, nbytes: int, assumed_upload_mibps: float) -> dict:
    """This rank's remote fields for the budget exchange ({} without a remote tier)."""
    tier = tier_of(ckpt)
    if tier is None:
        return {}
    record = budget.bench_record(getattr(ckpt, "root", "")) or {}
    done = getattr(ckpt, "last_committed", lambda: None)()  # (its upload may be committed)
    return dict(budget.estimate_remote(nbytes=nbytes, measured_bps=tier.bytes_per_s(),
                                       record_bps=record.get("upload"),
                                       assumed_bps=assumed_upload_mibps * (1 << 20),
                                       inflight=tier.current()),
                up_committed_step=done.step if done is not None and
                getattr(done, "remote_state", None) == "committed" else None)


def reduce(ckpt: Any, reports: list, decision: str, nums: dict, margin: float,
           step: int | None = None) -> tuple:
    """Step 3: (local decision, nums with "remote" and "remote_why"); ``step``: the stop's."""
    if tier_of(ckpt) is None:
        return decision, nums
    local_survives = bool(ckpt.options.local_survives)
    remote, local, why = budget.decide_remote(reports, decision, nums, margin, local_survives,
                                              step)
    return local, dict(nums, remote=remote, remote_why=why, local_survives=local_survives,
                       local_was=decision)


def before_save(ckpt: Any, nums: dict, event: Any) -> None:
    """Step 4."""
    tier = tier_of(ckpt)
    if tier is None or nums.get("remote") != "upload":
        return
    old = tier.supersede()
    if old is not None:
        event("upload_superseded", step=old.step)


def after_save(ckpt: Any, nums: dict, target: Any, deadline: float, event: Any,
               rank: int) -> None:
    """Step 5. ``target``: the handle of the checkpoint of this stop (None: none was made or
    it failed); ``deadline``: monotonic. Never raises: the remote tier's outcome is logged, the
    exit code stays the local one (143: the local commit, or the remote's last step, is what
    the restart finds)."""
    tier = tier_of(ckpt)
    remote = nums.get("remote")
    if tier is None or remote is None:
        return
    t0 = time.monotonic()
    try:
        if remote == "upload" and getattr(target, "remote_state", None) == "committed":
            # its upload committed already: never again (before 2026-12-06 it was, and a
            # failed second upload removed the files of the committed remote step)
            event("upload_skipped", step=target.step, why="committed on the remote tier")
        elif remote == "upload" and target is not None and target.committed:
            event("upload_start", step=target.step)
            up = ckpt.upload(target, deadline)
            done = up.done.wait(max(0.0, deadline - time.monotonic()))
            ok = done and up.error is None
            event("upload_end", step=target.step, ok=ok, finished=done,
                  seconds=round(time.monotonic() - t0, 4),
                  error=None if up.error is None else str(up.error))
            if not ok:
                log.error("fastckpt: rank %d: the emergency upload of step %d %s", rank,
                          target.step, f"failed: {up.error}" if done else
                          "did not finish before the deadline")
        elif remote == "finish":
            cur = tier.current()
            if cur is not None:
                done = cur.done.wait(max(0.0, deadline - time.monotonic()))
                event("upload_finished", step=cur.step, ok=done and cur.error is None,
                      finished=done, seconds=round(time.monotonic() - t0, 4))
    except Exception as e:  # noqa: BLE001 - logged; the local outcome decides the exit
        event("upload_end", ok=False, error=f"{type(e).__name__}: {e}",
              seconds=round(time.monotonic() - t0, 4))
        log.error("fastckpt: rank %d: the emergency upload failed: %s", rank, e)
