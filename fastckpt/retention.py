"""Which steps exist, in which state, and removing the ones no longer wanted.

A step directory is *committed* when it holds ``manifest.json``, else *partial* (a save that
is running, crashed, or was interrupted). Removal deletes the manifest first, so a crash
half-way through leaves a partial directory, never a committed step with shards missing.
The ``keep_last`` steps kept are the newest whose manifests read back valid (a damaged one is
neither counted nor removed): a torn manifest once took a slot, and the loadable step it
pushed out was removed.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from .manifest import schema as fmt
from .manifest.discovery import list_steps, manifest_state, marker_time
from .storage import Storage

#: a partial step whose in-flight marker is younger than this may still be written by someone
INFLIGHT_GRACE_S = 3600.0


@dataclass(frozen=True)
class StepInfo:
    step: int
    path: str
    committed: bool
    inflight_since: float | None  # newest in-flight marker's creation time, if any
    leftovers: tuple = ()  # in-flight markers and temporary files left by interrupted saves


def scan(storage: Storage) -> list[StepInfo]:
    out = []
    for step, d in list_steps(storage):
        names = storage.listdir(d)
        since = None
        for n in names:
            if n.startswith(fmt.INFLIGHT_PREFIX):
                t = marker_time(storage, f"{d}/{n}")
                since = t if since is None else max(since, t)
        junk = tuple(n for n in names if n.startswith(fmt.INFLIGHT_PREFIX) or ".tmp-" in n)
        out.append(StepInfo(step, d, fmt.MANIFEST in names, since, junk))
    return out


def damaged_steps(storage: Storage, infos: list[StepInfo], keep_last: int) -> set[int]:
    """The committed steps, newest first, whose manifest does not read back valid (read and
    checked as ``resume`` checks it: the manifest, and the chunk indexes in one listing), read
    until ``keep_last`` valid ones were found: the steps that count toward ``keep_last`` are
    then the valid ones. A manifest that cannot be read at all (a storage error) is not
    called damaged: retention then counts it as before rather than keep more steps."""
    out: set[int] = set()
    valid = 0
    for info in reversed([i for i in infos if i.committed]):
        if valid >= keep_last:
            break
        state = manifest_state(storage, info.path, step=info.step)
        if state == "damaged":
            out.add(info.step)
        elif state != "absent":  # (valid, or unknown: counted, as before)
            valid += 1
    return out


def remove_step(storage: Storage, path: str) -> None:
    storage.remove(f"{path}/{fmt.MANIFEST}")
    storage.remove_dir(path)


def plan_removal(infos: list[StepInfo], keep_last: int | None, *, protect: set[int] = frozenset(),
                 now: float | None = None, force_partial: bool = False,
                 committed_only: bool = False, partial_below: int | None = None,
                 damaged: set[int] = frozenset(),
                 grace: float = INFLIGHT_GRACE_S) -> list[StepInfo]:
    """The steps to remove: old committed ones beyond ``keep_last`` and abandoned partial ones
    (none with ``committed_only``; only those below ``partial_below`` when it is given).

    Never the newest committed step, never a step in ``protect``, never a partial step with a
    recent in-flight marker unless ``force_partial``. ``damaged``: committed steps whose
    manifest does not read back (:func:`damaged_steps`): not counted, not removed. ``grace``:
    how recent an in-flight marker is (``fastckpt gc --grace``).
    """
    now = time.time() if now is None else now
    committed = [i for i in infos if i.committed and i.step not in damaged]
    newest = committed[-1].step if committed else None
    doomed = []
    if keep_last is not None:
        doomed += [i for i in committed[:-keep_last] if i.step != newest]
    for i in infos:
        if i.committed or committed_only or (partial_below is not None
                                             and i.step >= partial_below):
            continue
        recent = i.inflight_since is not None and now - i.inflight_since < grace
        if force_partial or not recent:
            doomed.append(i)
    return [i for i in doomed if i.step not in protect]


def apply_retention(storage: Storage, keep_last: int | None, *,
                    protect: set[int] = frozenset(), force_partial: bool = False,
                    committed_only: bool = False, partial_below: int | None = None) -> list[int]:
    """Remove what ``plan_removal`` selects; return the removed steps.

    A Checkpointer calls this after each commit with ``force_partial=True``: one job writes a
    root at a time, and no rank starts its next save before the coordinator's housekeeping
    of this one ended (the next plan exchange waits for it), so every partial step it is not
    writing itself is abandoned. The remote tier's coordinator calls it on the remote root with
    ``partial_below=`` the step it just committed: the other ranks' uploaders do not wait for
    its housekeeping (an emergency upload starts at once), so a newer partial step there may be
    an upload in flight. It calls it on the local root with ``committed_only=True`` (a save may
    be writing a partial step there at the same time).
    """
    removed = []
    infos = scan(storage)
    damaged = damaged_steps(storage, infos, keep_last) if keep_last is not None else set()
    for info in plan_removal(infos, keep_last, protect=protect, force_partial=force_partial,
                             committed_only=committed_only, partial_below=partial_below,
                             damaged=damaged):
        remove_step(storage, info.path)
        removed.append(info.step)
    if force_partial:  # committed steps keep no markers of a save that died after its commit
        for info in infos:
            if info.committed and info.step not in protect and info.step not in removed:
                for n in info.leftovers:
                    storage.remove(f"{info.path}/{n}")
    return removed
