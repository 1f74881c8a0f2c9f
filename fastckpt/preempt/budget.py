"""The grace-window budget: what each rank must write and how fast, and the decision every
rank computes alike from every rank's report.

Each rank reports (``estimate``): the bytes it writes, its write and staging bandwidth (the
last saves' measurements; before the first, ``fastckpt bench``'s record in the root, else
``assumed_write_mibps``), the in-flight save and what finishing it or stopping it after its
current shard file costs, and the time left. ``decide`` turns all reports into one of: save,
wait (for the in-flight save, which is the checkpoint), wait_then_save, supersede (stop the
in-flight save after its current file, save the newer step), abandon, skip.
"""

from __future__ import annotations

import json
import math
import os
import time
from typing import Any

from ..engine.dist import local_ranks


#: the most a record's bandwidth may claim (B/s): above it the record is not believed
MAX_RECORD_BPS = 1e12
_ANY = object()


def bench_record(root: str, compression: Any = _ANY) -> dict | None:
    """Per-rank bandwidths from ``fastckpt bench``'s record in a local root, if there is one
    and it holds for this job. Since 2026-12-06: a record measured with another
    ``compression`` than the job's is not taken; the record's rates are shared by this node's
    ranks (the bench's own count at most: a record of ``--ranks 1`` gave each of 8 ranks on
    the node the whole disk); values that are not finite positive numbers below
    :data:`MAX_RECORD_BPS` are dropped (Infinity made any save fit); a remote root's record is
    not read (an unbounded read on the emergency path)."""
    from ..bench.record import is_local, read_bench
    if not root or not is_local(root):
        return None
    try:
        rec = read_bench(root) or {}
        if compression is not _ANY and (rec.get("compression") or None) != (compression or None):
            return None
        per = rec.get("per_rank_bytes_per_s") or {}
        n = rec.get("ranks")
        n = n if type(n) is int and n >= 1 else 1
        share = n / max(n, local_ranks())
        return {k: float(v) * share for k, v in per.items()
                if type(v) in (int, float) and math.isfinite(v) and 0 < v <= MAX_RECORD_BPS}
    except Exception:  # noqa: BLE001 - a damaged record must not break the emergency path
        return None


def estimate(*, samples: list, state_bytes: Any, assumed_write_bps: float, record: Any,
             inflight: Any, piece_bytes: int, left_s: float, zero_copy: bool) -> dict:
    """This rank's report. ``samples``: (bytes, write_s, stage_s) of the last committed saves;
    ``state_bytes()``: the bytes of the state (called only without samples); ``record()``: the
    bench record's bandwidths (same); ``inflight``: the handle of the save in flight or None,
    ``piece_bytes`` its largest shard file; ``zero_copy``: the emergency save is written
    straight from the tensors (no staging: its time is the write's; else staging comes first
    and the write after, as in an uncapped pool, the conservative case)."""
    if samples:
        nbytes = samples[-1][0]
        write_bps = sum(s[0] for s in samples) / sum(s[1] for s in samples)
        ssum = sum(s[2] for s in samples)
        stage_bps = sum(s[0] for s in samples) / ssum if ssum > 0 else 2e9
        source = f"measured on {len(samples)} save(s)"
    else:
        nbytes = state_bytes()
        write_bps, stage_bps = assumed_write_bps, 2e9
        source = "assumed (no save measured yet)"
        rec = record()
        if rec:  # `fastckpt bench ROOT` measured this storage
            write_bps = rec.get("save") or write_bps
            stage_bps = rec.get("stage") or stage_bps
            source = "fastckpt bench record (no save measured yet)"
    stage_s = 0.0 if zero_copy else nbytes / stage_bps
    est_s = stage_s + nbytes / write_bps + 0.5  # + plan gather, manifest, acks
    # superseding stops the in-flight save before its next piece: at worst one piece (one
    # shard file) is still written first
    return {"bytes": int(nbytes), "write_mibps": round(write_bps / (1 << 20), 2),
            "est_s": round(est_s, 4), "source": source,
            "inflight_step": inflight.step if inflight is not None else None,
            "inflight_left_s": round(nbytes / write_bps + 0.5, 4) if inflight else 0.0,
            "inflight_piece_s": round(min(piece_bytes, nbytes) / write_bps, 4)
            if inflight else 0.0,
            "left_s": round(left_s, 4)}


def decide(reports: list[dict], step: int, margin: float) -> tuple[str, dict]:
    """The same decision on every rank, from every rank's report."""
    left = min(r["left_s"] for r in reports) - margin
    est = max(r["est_s"] for r in reports)
    infl = [r["inflight_step"] for r in reports if r["inflight_step"] is not None]
    infl_left = max(r["inflight_left_s"] for r in reports)
    piece_left = max(r.get("inflight_piece_s", r["inflight_left_s"]) for r in reports)
    nums = {"left_s": round(left, 3), "est_save_s": round(est, 3),
            "bytes": sum(r["bytes"] for r in reports),
            "inflight_step": max(infl) if infl else None,
            "inflight_left_s": round(infl_left, 3) if infl else 0.0,
            "inflight_piece_s": round(piece_left, 3) if infl else 0.0}
    if not infl and all(r.get("committed_step") == step for r in reports):
        return "committed", nums  # a save of this very step committed already: nothing to do
    if not infl:
        return ("save" if est <= left else "skip"), nums
    if max(infl) >= step:
        return ("wait" if infl_left <= left else "abandon"), nums
    if infl_left + est <= left:
        return "wait_then_save", nums
    if piece_left + est <= left:
        return "supersede", nums  # the newer step fits only without the older one
    if infl_left <= left:
        return "wait", nums
    return "abandon", nums


def estimate_remote(*, nbytes: int, measured_bps: float | None, record_bps: float | None,
                    assumed_bps: float, inflight: Any) -> dict:
    """This rank's report on the remote tier (``Checkpointer(local, remote=url)``): the time to
    upload ``nbytes`` (the emergency step) at the measured upload bandwidth (the last uploads;
    else the bench record's; else ``assumed_bps``), and the upload in flight: its step and
    what is left of it (``inflight``: the tier's current Upload or None)."""
    bps = measured_bps or record_bps or assumed_bps
    source = ("measured" if measured_bps else "fastckpt bench record" if record_bps
              else "assumed")
    left = piece = 0.0
    step = None
    if inflight is not None:
        step = inflight.step
        sizes = [int(f["size"]) for f in inflight.files]
        left = max(0.0, sum(sizes) / bps - (time.monotonic() - inflight.started)) + 0.5
        # superseded, it stops before its next file: the one under way goes on (at most the
        # largest, and never more than what is left of the whole upload)
        piece = min(left, max(sizes, default=0) / bps + 0.5)
    return {"up_est_s": round(nbytes / bps + 0.5, 4), "up_mibps": round(bps / (1 << 20), 2),
            "up_source": source, "up_inflight_step": step, "up_inflight_left_s": round(left, 4),
            "up_inflight_piece_s": round(piece, 4)}


def decide_remote(reports: list[dict], decision: str, nums: dict, margin: float,
                  local_survives: bool, step: int | None = None) -> tuple[str, str, str]:
    """(every rank alike) What reaches the remote tier inside the window, given the local
    decision: (remote decision, local decision, why).

    remote: "upload" (the checkpoint of this stop, once committed locally: the emergency step,
    or the in-flight save the local decision waits for), "finish" (the upload already in
    flight, of an older step, completes; nothing newer is uploaded), "skip" (nothing more).
    ``local_survives`` False (a Spot VM's NVMe): a local-only checkpoint is lost with the node,
    so when the new step cannot be uploaded but the in-flight upload can finish, the local save
    is skipped too and the window goes to that upload."""
    left = nums["left_s"]
    est, infl_left, piece = nums["est_save_s"], nums["inflight_left_s"], nums["inflight_piece_s"]
    # "committed": the stop's step was committed already (a save at this step waited for):
    # nothing to do locally, its upload may still be needed (before 2026-12-06 it never was),
    # unless a rank reports it committed remotely (``up_committed_step``): "skip"
    local_s = {"save": est, "wait_then_save": infl_left + est, "supersede": piece + est,
               "wait": infl_left, "committed": 0.0}.get(decision)
    up_s = max(r.get("up_est_s", 0.0) for r in reports)
    ups = [r["up_inflight_step"] for r in reports if r.get("up_inflight_step") is not None]
    up_left = max((r.get("up_inflight_left_s", 0.0) for r in reports), default=0.0)
    # the uploader starts the new upload once the local commit is done and the superseded
    # upload's file under way has ended (it stops between files): the later of the two
    up_piece = max((r.get("up_inflight_piece_s", r.get("up_inflight_left_s", 0.0))
                    for r in reports), default=0.0)
    if (decision == "committed" and ups and step is not None and max(ups) >= step
            and up_left <= left):  # (its own upload is under way: let it end)
        return "finish", decision, (f"the upload of step {max(ups)} in flight fits "
                                    f"({up_left:.2f} s of {left:.2f} s)")
    if decision == "committed" and step is not None and any(
            r.get("up_committed_step") == step for r in reports):  # (the commit is collective)
        return "skip", decision, f"step {step} is committed on the remote tier already"
    start = max(local_s, up_piece if ups else 0.0) if local_s is not None else None
    if start is not None and start + up_s <= left:
        return "upload", decision, (
            f"local {local_s:.2f} s + upload {up_s:.2f} s fit the {left:.2f} s left" if start
            == local_s else f"the file of the upload in flight ({up_piece:.2f} s) + upload "
            f"{up_s:.2f} s fit the {left:.2f} s left")
    if ups and up_left <= left:
        if not local_survives and local_s is not None:
            return "finish", "skip", (
                f"the local tier does not survive and the new step's upload ({up_s:.2f} s "
                f"after {local_s:.2f} s locally) does not fit the {left:.2f} s left: the "
                f"window goes to the upload of step {max(ups)} in flight ({up_left:.2f} s)")
        return "finish", decision, (f"the upload of step {max(ups)} in flight fits "
                                    f"({up_left:.2f} s of {left:.2f} s)")
    why = (f"no upload fits the {left:.2f} s left (the new step's: "
           f"{(local_s or 0.0) + up_s:.2f} s)")
    if not local_survives and local_s is not None:
        why += "; the local checkpoint is lost if the node is"
    return "skip", decision, why


#: teardown reserve when none was measured (at most grace / 10)
TEARDOWN_DEFAULT_S = 2.0


def teardown_reserve(configured: float | None, grace_s: float,
                     events_dir: str | None) -> tuple[float, str]:
    """(seconds kept out of the grace window for the process's teardown, how it is known)."""
    if configured is not None:
        return float(configured), "configured"
    measured = []
    if events_dir:
        try:
            with open(os.path.join(events_dir, "supervisor.jsonl"), encoding="utf-8") as f:
                for line in f:
                    try:
                        v = json.loads(line).get("teardown_s")
                    except (ValueError, AttributeError):
                        continue
                    if isinstance(v, (int, float)) and 0 <= v < 3600:
                        measured.append(float(v))
        except OSError:
            pass
    if measured:
        worst = max(measured[-5:])
        # a measurement can not take the whole window: at most half of it
        return round(min(worst * 1.25 + 0.25, grace_s / 2), 3), (
            f"measured by the supervisor (worst of the last {len(measured[-5:])}: {worst:.2f} s)")
    return round(min(TEARDOWN_DEFAULT_S, grace_s / 10), 3), "default (not measured)"
