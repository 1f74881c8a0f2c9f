"""The cross-rank commit: one function, an injected exchange, one deadline.

Call sequence for one save (``save_id`` agreed when the save was planned):

1. (all ranks)     write and fsync the rank's shard, then publish a result under
                   ``{save_id}/result/{rank}``: ``{"ok": true, ...}`` or ``{"ok": false, "error": ...}``.
2. (coordinator)   wait for every rank's result until the deadline. If all are ok, call
                   ``coordinator(results)``, which writes the manifest (the commit point) and
                   returns a small JSON-able dict; publish the outcome under ``{save_id}/outcome``.
                   Missing ranks, failed ranks or a failed manifest write publish a failure.
3. (other ranks)   wait for the outcome until the deadline + ``OUTCOME_GRACE_S`` (the
                   coordinator decides at the deadline, and its verdict names the missing ranks).
4. (all ranks)     acknowledge; the last rank deletes the keys. Raise on failure.

Nothing here touches storage, so the protocol is testable with threads and a dict exchange.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from ..errors import CommitTimeoutError, SaveFailedError


#: how much longer than the coordinator the other ranks wait for its decision
OUTCOME_GRACE_S = 2.0


def commit(exchange: Any, *, save_id: str, rank: int, world_size: int, result: dict,
           deadline: float, coordinator: Callable[[list[dict]], dict]) -> dict:
    """Run the commit protocol on one rank; return the outcome or raise.

    ``deadline`` is a ``time.monotonic()`` value. Raises :class:`CommitTimeoutError` (naming
    the missing ranks) or :class:`SaveFailedError` (naming every failing rank).
    """
    def rkey(r: int) -> str:
        return f"{save_id}/result/{r}"
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
    else:
        # the coordinator decides at the deadline; wait a little longer for its verdict, which
        # names the ranks that did not report (else every rank would only blame rank 0)
        found, missing = exchange.wait([out_key], deadline + OUTCOME_GRACE_S)
        if missing:
            raise CommitTimeoutError(
                f"save {save_id}: no commit decision from the coordinator, rank(s) [0], within "
                "the deadline: rank 0 died, hangs, or its store is unreachable; nothing was "
                "committed, the previous committed checkpoint is intact",
                missing_ranks=[0], rank=rank)
        outcome = json.loads(found[out_key])
    if exchange.add(f"{save_id}/acks", 1) >= world_size:
        exchange.delete([out_key, f"{save_id}/acks"])
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
