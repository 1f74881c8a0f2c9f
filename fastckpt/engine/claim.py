"""Claiming the root on a save's first run, agreed through rank 0 alone (``Group.decide``):
every rank's outcome goes to rank 0, which answers every rank with the ranks that failed, so
each raises and none is left waiting (O(N) where an all-gather was O(N^2))."""

from __future__ import annotations

from ..errors import StorageError, WriterLockedError


def setup_failures(values: list[dict]) -> list:
    """(rank 0, ``Group.decide``) The ranks that could not claim the root, with their errors:
    ``[rank, [kind, message]]`` for the first few, and how many in all."""
    bad = [[r, v["setup"]] for r, v in enumerate(values) if v.get("setup")]
    return [bad[:NAMED_MAX], len(bad)]


#: at most this many ranks' errors travel in an agreement's answer (the count says the rest)
NAMED_MAX = 8


def raise_setup_errors(failures: list, mine: BaseException | None) -> None:
    """(all ranks, after claiming the root) Raise if any rank could not claim it: its own
    error on that rank, the same kind naming the (first) rank on the others."""
    bad, n = failures
    if not n:
        return
    if mine is not None:
        raise mine
    r, (kind, msg) = bad[0]
    cls = WriterLockedError if kind == WriterLockedError.__name__ else StorageError
    more = f" (and {n - 1} more rank(s))" if n > 1 else ""
    raise cls(f"rank {r} cannot save: {msg}{more}")
