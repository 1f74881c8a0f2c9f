"""The preemption trigger's exchanges over the c10d store, in O(1) commands per rank.

``collect``: every rank's JSON report to one reducer and its answer back to every rank: each
rank appends one line and counts; the rank that completes the count reduces the lines once and
publishes the result; every rank waits for it with one server-side wait (no polling). It
serves the stop consensus (``stop_step``), the budget exchange (``budget.decide``) and the
exit barrier (``exit_barrier``). docs/scale.md measures it against 4096 simulated ranks.
"""

from __future__ import annotations

import json
import time
from typing import Any, Callable

from ..engine.dist import StoreUnreachable

#: a consensus record lists every rank's step up to this many ranks (else the range)
REPORTED_LIST_MAX = 64


class PeerLost(Exception):
    """Ranks did not report before a deadline, or were lost with the store (``missing``)."""

    def __init__(self, missing: list[int], what: str) -> None:
        self.missing = missing
        super().__init__(f"{what}: rank(s) {missing} did not answer")


def collect(ex: Any, key: str, rank: int, world: int, mine: dict, deadline: float, what: str,
            reduce: Callable[[list[dict]], Any], min_wait: float = 0.0) -> Any:
    """Append ``mine`` (with ``rank``) as a JSON line to ``key``, count ``key/n``; the rank
    that brings the count to ``world`` publishes ``reduce(lines by rank)`` under ``key/all``;
    every rank waits for it until ``deadline`` (``time.monotonic()``; at least ``min_wait``
    from now). Raises PeerLost naming the ranks whose line is missing then, or the ranks lost
    with the store."""
    try:
        ex.append(key, (json.dumps({**mine, "rank": rank}) + "\n").encode())
        if ex.add(f"{key}/n", 1) == world:
            ex.set(f"{key}/all", json.dumps(reduce(lines(ex, key))).encode())
        found, missing = ex.wait([f"{key}/all"], max(deadline, time.monotonic() + min_wait))
        if not missing:
            return json.loads(found[f"{key}/all"])
        got = {line["rank"] for line in lines(ex, key)}
    except StoreUnreachable as e:
        raise PeerLost(e.ranks, f"{what}: {e}") from e
    lost = sorted(set(range(world)) - got)
    raise PeerLost(lost, what if lost else f"{what}: the last rank to report died before it "
                   "published the result")


def lines(ex: Any, key: str) -> list[dict]:
    """The JSON lines appended to ``key``, one per rank (a rank's first), by rank."""
    out: dict[int, dict] = {}
    for raw in ex.get(key).splitlines():
        try:
            line = json.loads(raw)
            out.setdefault(int(line["rank"]), line)
        except (ValueError, KeyError, TypeError):
            continue
    return [out[r] for r in sorted(out)]


def stop_step(reports: list[dict]) -> dict:
    """(the last reporter) T and the earliest signal and kill from every rank's report."""
    steps = [r["passed"] for r in reports if r["passed"] is not None]
    firsts = [r["first_signal"] for r in reports if r["first_signal"] is not None]
    kills = [r["kill_at"] for r in reports if r.get("kill_at") is not None]
    passed = [r["passed"] for r in reports]
    return {"T": max(steps) + 1 if steps else -1,
            "first": min(firsts) if firsts else None, "kill": min(kills) if kills else None,
            "cancel": any(r["cancel"] for r in reports),
            "reported": passed if len(passed) <= REPORTED_LIST_MAX else
            [min(steps, default=None), max(steps, default=None)]}


def failed_ranks(reports: list[dict]) -> list[int]:
    return [r["rank"] for r in reports if not r["ok"]]


def exit_barrier(reports: list[dict]) -> dict:
    """(the exit barrier) the ranks whose save failed, and whether any rank was told to
    cancel: a cancel signal that came to one rank after the stop consensus must give every
    rank the same exit code (they gave 143 and 0: a supervisor that takes the highest code
    requeued a cancelled job)."""
    return {"bad": failed_ranks(reports), "cancel": any(r.get("cancel") for r in reports)}
