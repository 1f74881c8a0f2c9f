"""The cross-rank commit: one function, an injected exchange, one deadline.

Call sequence for one save (``save_id`` agreed when the save was planned):

1. (all ranks)     write and fsync the rank's shard, then publish a result under
                   ``{save_id}/result/{rank}``: ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``.
2. (coordinator)   wait for every rank's result until the deadline. If all are ok, call
                   ``coordinator(results)``, which writes the manifest (the commit point) and
                   returns a small JSON-able dict; publish the outcome under ``{save_id}/outcome``.
                   Missing ranks, failed ranks or a failed manifest write publish a failure.
3. (other ranks)   wait for the outcome until the deadline + ``OUTCOME_GRACE_S`` (the
                   coordinator decides at the deadline, and its verdict names the missing ranks),
                   then acknowledge under ``{save_id}/ack/{rank}``.
4. (coordinator)   wait for the acknowledgements of the ranks that reported (bounded by the
                   time they wait for the outcome), then delete the keys. Rank 0 hosts the
                   store in a torch.distributed job: a coordinator that returned at once and
                   exited (a job ending after its last save) took the verdict with it, and a
                   rank that cannot read the verdict cannot know whether the step committed.
5. (all ranks)     raise on failure. A rank that never read the verdict raises
                   :class:`CommitTimeoutError` with ``outcome_unknown`` set: the caller must look
                   for the manifest before treating the save as failed, and must not delete its
                   shards (a committed manifest may reference them).

Nothing here touches storage, so the protocol is testable with threads and a dict exchange.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable

from ..errors import CommitTimeoutError, SaveFailedError

log = logging.getLogger("fastckpt")


#: how much longer than the coordinator the other ranks wait for its decision
OUTCOME_GRACE_S = 2.0
#: how much longer than that the coordinator waits for their acknowledgements
ACK_SLACK_S = 1.0


def commit(exchange: Any, *, save_id: str, rank: int, world_size: int, result: dict,
           deadline: float, coordinator: Callable[[list[dict]], dict]) -> dict:
    """Run the commit protocol on one rank; return the outcome or raise.

    ``deadline`` is a ``time.monotonic()`` value. Raises :class:`CommitTimeoutError` (naming
    the missing ranks) or :class:`SaveFailedError` (naming every failing rank).
    """
    def rkey(r: int) -> str:
        return f"{save_id}/result/{r}"
    def akey(r: int) -> str:
        return f"{save_id}/ack/{r}"
    out_key = f"{save_id}/outcome"
    exchange.set(rkey(rank), json.dumps(result).encode())
    cause: BaseException | None = None
    if rank == 0:
        keys = [rkey(r) for r in range(world_size)]
        found, missing = exchange.wait(keys, deadline)
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
                cause = e
                outcome = {"ok": False, "failures": {0: f"commit failed: {e}"}, "missing": []}
        exchange.set(out_key, json.dumps(outcome).encode())
        exchange.delete(keys)
        # stay until the ranks that reported have read the verdict (or stopped waiting for it)
        readers = [akey(r) for r in range(1, world_size) if r not in missing_ranks]
        _, unread = exchange.wait(readers, deadline + OUTCOME_GRACE_S + ACK_SLACK_S)
        exchange.delete([out_key, *readers])
        if unread:
            log.warning("fastckpt: save %s: rank(s) %s did not acknowledge the commit decision "
                        "(%s); they report the save as failed unless they find its manifest",
                        save_id, sorted(int(k.rsplit("/", 1)[1]) for k in unread),
                        "committed" if outcome["ok"] else "not committed")
    else:
        # the coordinator decides at the deadline; wait a little longer for its verdict, which
        # names the ranks that did not report (else every rank would only blame rank 0)
        found, missing = exchange.wait([out_key], deadline + OUTCOME_GRACE_S)
        if missing:
            raise CommitTimeoutError(
                f"save {save_id}: no commit decision from the coordinator, rank(s) [0], within "
                "the deadline: rank 0 died, hangs, or its store is unreachable; nothing was "
                "committed, the previous committed checkpoint is intact",
                missing_ranks=[0], rank=rank, outcome_unknown=True)
        outcome = json.loads(found[out_key])
        exchange.set(akey(rank), b"1")
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


def _late(deadline: float) -> str:
    return f"deadline passed {max(0.0, time.monotonic() - deadline):.1f}s ago"
