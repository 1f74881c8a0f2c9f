"""The cross-rank commit: one function, an injected exchange, one deadline.

Call sequence for one save (``save_id`` agreed when the save was planned); every wait is one
server-side wait on the exchange (no polling), and the store work is O(1) per rank:

1. (all ranks)     write and fsync the rank's shard, then publish a result under
                   ``{save_id}/result/{rank}``: ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``.
2. (coordinator)   wait for every rank's result until the deadline (one wait for all the keys,
                   then ``multi_get``). If all are ok, call ``coordinator(results)``, which
                   writes the manifest (the commit point) and returns a small JSON-able dict;
                   publish the outcome under ``{save_id}/outcome``. Missing ranks, failed ranks
                   or a failed manifest write publish a failure naming them.
3. (other ranks)   wait for the outcome until the deadline + ``OUTCOME_GRACE_S`` (the
                   coordinator decides at the deadline, and its verdict names the missing ranks),
                   delete their own result key, then acknowledge: append ``"<rank>,"`` to
                   ``{save_id}/acks`` and count ``{save_id}/nack``; the rank that brings the
                   count to the number of ranks that reported sets ``{save_id}/acked``.
4. (coordinator)   wait for ``acked`` (bounded by the time the others wait for the outcome;
                   at the deadline ``acks`` names who did not read it), then delete the four
                   keys. Rank 0 hosts the store in a plain torch.distributed job: a coordinator
                   that returned at once and exited (a job ending after its last save) took the
                   verdict with it, and a rank that cannot read the verdict cannot know whether
                   the step committed.
5. (all ranks)     raise on failure. A rank that never read the verdict raises
                   :class:`CommitTimeoutError` with ``outcome_unknown`` set: the caller must look
                   for the manifest before treating the save as failed, and must not delete its
                   shards (a committed manifest may reference them).

Nothing here touches storage, so the protocol is testable with threads and a dict exchange.
A store that stops answering (its host died: see ``dist.store_host``) is a
:class:`CommitTimeoutError` naming the ranks lost with it.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from ..errors import (CommitTimeoutError, CorruptCheckpointError, SaveFailedError, StorageError,
                      StorageTimeoutError)
from ..manifest.discovery import read_manifest
from ..storage import Storage
from .dist import StoreUnreachable

log = logging.getLogger("fastckpt")


#: reading a manifest back after its write reported an error, at most (seconds)
READ_BACK_S = 10.0
#: how much longer than the coordinator the other ranks wait for its decision
OUTCOME_GRACE_S = 2.0
#: how much longer than that the coordinator waits for their acknowledgements
ACK_SLACK_S = 1.0
#: how often a cancellable commit wait (an upload's) looks at its cancel: one store wait per
#: rank a second while the slowest rank uploads
CANCEL_SLICE_S = 1.0


def _wait(exchange: Any, keys: list, deadline: float, cancel: Any, save_id: str,
          rank: int) -> tuple[dict, list]:
    """``exchange.wait`` until ``deadline``, in slices of CANCEL_SLICE_S that end it with a
    CommitTimeoutError once ``cancel`` is set: (rank 0) before any decision, so nothing is
    committed; (the others) the outcome is then unknown, and their files stay."""
    while True:
        step = deadline if cancel is None else min(deadline, time.monotonic() + CANCEL_SLICE_S)
        found, missing = exchange.wait(keys, step)
        if not missing or step >= deadline:
            return found, missing
        if cancel.is_set():
            raise CommitTimeoutError(
                f"save {save_id}: cancelled (superseded) before the commit decision"
                + ("" if rank == 0 else " reached this rank: whether it committed is unknown"),
                outcome_unknown=rank != 0, rank=rank)


def commit(exchange: Any, *, save_id: str, rank: int, world_size: int, result: dict,
           deadline: float, coordinator: Callable[[list[dict]], dict],
           cancel: Any = None) -> dict:
    """Run the commit protocol on one rank; return the outcome or raise.

    ``deadline`` is a ``time.monotonic()`` value. Raises :class:`CommitTimeoutError` (naming
    the missing ranks) or :class:`SaveFailedError` (naming every failing rank). ``cancel``
    (a ``threading.Event``): set, it ends the wait for the results or the decision (a
    superseded upload whose peers may never report: a preemption froze their tiers first).
    """
    out_key = f"{save_id}/outcome"
    mine = f"{save_id}/result/{rank}"
    cause: BaseException | None = None
    decided = False
    try:
        exchange.set(mine, json.dumps(result).encode())
        if rank == 0:
            keys = [f"{save_id}/result/{r}" for r in range(world_size)]
            found, missing = _wait(exchange, keys, deadline, cancel, save_id, rank)
            results = [json.loads(found[k]) if k in found else None for k in keys]
            failures = {r: res.get("error", "failed") for r, res in enumerate(results)
                        if res is not None and not res.get("ok")}
            missing_ranks = [r for r, k in enumerate(keys) if k in missing]
            outcome: dict[str, Any]
            if missing_ranks or failures:
                outcome = {"ok": False, "failures": failures, "missing": missing_ranks}
            else:
                try:
                    outcome = {"ok": True, **coordinator(results)}
                except Exception as e:  # the manifest write failed: nothing was committed
                    cause = e  # (or, ``outcome_unknown``, maybe it was: every rank looks)
                    outcome = {"ok": False, "failures": {0: f"commit failed: {e}"},
                               "missing": [],
                               "unknown": bool(getattr(e, "outcome_unknown", False))}
            decided = True
            exchange.set(out_key, json.dumps(outcome).encode())
            exchange.delete([mine])
            # stay until the ranks that reported have read the verdict (or stopped waiting)
            readers = world_size - 1 - len(missing_ranks)
            if readers > 0:
                _, unread = exchange.wait([f"{save_id}/acked"],
                                          deadline + OUTCOME_GRACE_S + ACK_SLACK_S)
                if unread:
                    acked = _ranks(exchange, f"{save_id}/acks")
                    late = [r for r in range(1, world_size)
                            if r not in acked and r not in missing_ranks]
                    log.warning("fastckpt: save %s: rank(s) %s did not acknowledge the commit "
                                "decision (%s); they report the save as failed unless they "
                                "find its manifest", save_id, late,
                                "committed" if outcome["ok"] else "not committed")
            exchange.delete([out_key, f"{save_id}/acked", f"{save_id}/acks", f"{save_id}/nack"])
        else:
            # the coordinator decides at the deadline; wait a little longer for its verdict,
            # which names the ranks that did not report (else every rank would blame rank 0)
            found, missing = _wait(exchange, [out_key], deadline + OUTCOME_GRACE_S, cancel,
                                   save_id, rank)
            if missing:
                raise CommitTimeoutError(
                    f"save {save_id}: no commit decision from the coordinator, rank(s) [0], "
                    "within the deadline: rank 0 died or hangs; nothing was committed, the "
                    "previous committed checkpoint is intact",
                    missing_ranks=[0], rank=rank, outcome_unknown=True)
            outcome = json.loads(found[out_key])
            decided = True
            exchange.delete([mine])
            if rank not in (outcome.get("missing") or []):  # too late to count: no ack
                exchange.append(f"{save_id}/acks", f"{rank},".encode())
                readers = world_size - 1 - len(outcome.get("missing") or [])
                if exchange.add(f"{save_id}/nack", 1) == readers:
                    exchange.set(f"{save_id}/acked", b"1")
    except StoreUnreachable as e:
        if rank == 0 and decided:  # the verdict is ours; the peers look for the manifest
            log.warning("fastckpt: save %s: %s after the decision", save_id, e)
        else:
            raise CommitTimeoutError(
                f"save {save_id}: {e}; rank(s) {e.ranks} are lost with it. "
                + ("Nothing was committed, the previous committed checkpoint is intact"
                   if rank == 0 else "Whether the coordinator committed is unknown: look for "
                   "the manifest"),
                missing_ranks=e.ranks, rank=rank, outcome_unknown=rank != 0) from e
    if not outcome["ok"] and outcome.get("unknown"):
        raise CommitTimeoutError(
            f"save {save_id}: {next(iter(outcome['failures'].values()))}",
            outcome_unknown=True, rank=rank) from cause
    if not outcome["ok"]:
        missing_ranks = outcome.get("missing") or []
        failures = {int(r): m for r, m in outcome.get("failures", {}).items()}
        if missing_ranks and not failures:
            raise CommitTimeoutError(
                f"save {save_id}: rank(s) {missing_ranks} did not report within the deadline "
                f"({_late(deadline)}); nothing was committed, the previous committed checkpoint "
                "is intact",
                missing_ranks=missing_ranks, rank=rank)
        detail = "; ".join(f"rank {r}: {m}" for r, m in sorted(failures.items()))
        if missing_ranks:
            detail += f"; rank(s) {missing_ranks} did not report"
        raise SaveFailedError(f"save {save_id} failed and was not committed ({detail}); the "
                              "previous committed checkpoint is intact", failures=failures,
                              rank=rank) from cause
    return outcome


def _ranks(exchange: Any, key: str) -> set[int]:
    """The ranks appended to ``key`` as ``"<rank>,"`` (empty if it does not exist)."""
    found, _ = exchange.wait([key], 0.0)
    return {int(x) for x in found.get(key, b"").decode().split(",") if x.strip().isdigit()}


def _late(deadline: float) -> str:
    return f"deadline passed {max(0.0, time.monotonic() - deadline):.1f}s ago"


def check_present(st: Storage, d: str, sizes: dict[str, int]) -> None:
    """(coordinator, a local root) Every file the manifest names is in ``d`` at its size just
    before it is published: a ``fastckpt gc`` that removed the step meanwhile (a
    job saving an older step again, which gc was removing) fails the save instead of
    committing a manifest that names removed files (a review found that window, 2026-12-06).
    Object stores: not checked (a listing of thousands of keys per save)."""
    if not st.is_local:
        return
    there = st.sizes(d)
    bad = sorted(n for n, size in sizes.items() if there.get(n) != size)
    if bad:
        raise StorageError(f"{len(bad)} file(s) of this save are gone or changed just before "
                           f"its commit (first: {bad[0]}): removed meanwhile (fastckpt gc of "
                           "this step?); nothing was committed", file=d)


def may_land_later(error: BaseException) -> bool:
    """Whether a failed write may still take effect after it was given up: the storage layer
    says so (``outcome_unknown``: a local rename left to its thread under way, not one stopped
    at its commit point), or the call got no answer in time (a timeout: an object store may
    still apply a request it received; a synchronous fsspec call keeps running on its thread),
    or its request got no answer at all (``answered`` False: a connection cut while the store
    may be applying it). An error the storage answered took effect or not when it was raised:
    a read-back tells which."""
    e: BaseException | None = error
    for _ in range(16):  # (the cause chain; bounded)
        if e is None:
            return False
        unknown = getattr(e, "outcome_unknown", None)
        if unknown is not None:
            return bool(unknown)
        if isinstance(e, (StorageTimeoutError, TimeoutError)) or getattr(e, "answered",
                                                                          True) is False:
            return True
        e = e.__cause__
    return False


def publish_checked(st: Storage, storage: Storage, path: str, data: bytes, save_id: str, *,
                    step: int) -> None:
    """(coordinator) Publish a manifest; when the write reports an error, read back what is
    there: the manifest may have landed all the same (a directory fsync that failed after the
    rename, an object store's PUT whose answer was lost). Naming this save: committed (the
    error is logged). Not naming it: the error is raised (nothing was committed, the ranks
    remove their files), unless the write may still land (:func:`may_land_later`: a timeout,
    no answer). Then, and when nothing can be read back, a FastCkptError with
    ``outcome_unknown``, so that no rank removes the files a manifest may name (they once did:
    the step lost its shards; before 2026-12-06 a manifest PUT that timed out and landed after
    the read-back named shards every rank had removed)."""
    try:
        st.publish_manifest(path, data)
        return
    except Exception as e:
        error = e
    late = may_land_later(error)
    if getattr(error, "outcome_unknown", False):  # a local rename left to its
        # thread under way: the mount stopped answering, a read-back would wait on it too
        raise _unknown(path, step, f"did not finish in time and may still land ({error})"
                       ) from error
    d = path.rsplit("/", 1)[0]
    try:
        body = read_manifest(storage.bounded(time.monotonic() + READ_BACK_S), d, step=step,
                             chunks=False)
    except CorruptCheckpointError:
        body = None  # (a publish is atomic: what is there is not this save's)
    except Exception as e:  # noqa: BLE001 - unknown stays unknown
        raise _unknown(path, step, f"reported an error ({type(error).__name__}: {error}) and "
                       f"reading it back failed too ({type(e).__name__}: {e})") from error
    if body is not None and body.get("save_id") == save_id:
        log.warning("fastckpt: the manifest write of save %s reported %s: %s, but the manifest "
                    "at %s names this save: committed", save_id, type(error).__name__, error,
                    path)
        return
    if late:
        raise _unknown(path, step, f"got no answer in time and may still land ({error}; not "
                       "there when read back)") from error
    raise error


def _unknown(path: str, step: int, what: str) -> CommitTimeoutError:
    return CommitTimeoutError(
        f"writing the manifest {path} {what}: whether step {step} is committed is unknown; "
        "every rank keeps its files (`fastckpt ls` tells, `fastckpt gc` removes them if not)",
        outcome_unknown=True)
