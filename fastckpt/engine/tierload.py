"""Resume across the tiers of ``Checkpointer(local, remote=url)`` (the module docstring of
tiering.py has the whole design), and the uploader's helpers that check files and roots.

Call sequence of ``load_tiers`` (all ranks):

1. each rank lists both tiers: the newest committed step of each (or whether ``step`` is
   committed there), whether it passed over a damaged step, and the error of a listing that
   failed;
2. rank 0 alone receives the views (``Group.decide``: O(N), a gather is O(N^2)) and answers
   with the newest step of all, whether every rank has it in each tier, and the listing
   errors;
3. a listing that failed on any rank fails the load on every rank (a ``StorageError`` naming
   the rank, the tier and the error) unless the load named a step that a tier holds for every
   rank: "no checkpoint" from a store that did not answer would start the job from scratch,
   and its saves would then replace the remote tier's newer steps;
4. the step is loaded from the local root when every rank has it there (faster), else from
   the remote root; a local copy that fails to load is loaded from the remote tier instead;
5. a resume (the newest step, ``strict``) whose step is damaged in every tier that holds it
   (``CorruptCheckpointError``, raised alike on every rank) starts again at 1 with the newest
   step older than it, with a warning (``LOAD_ATTEMPTS`` steps in all), as a plain root's load
   does; a step asked for by number and ``read()`` raise;
6. a load of the newest step whose step was removed while it was read (a writer's retention),
   or whose listings the ranks do not agree on (a commit between them), starts again at 1
   (``StepRemovedError``, alike on every rank; ``LOAD_ATTEMPTS`` in all). Before 2026-12-06
   both came out as a ``CheckpointNotFoundError``: ``resume()`` returned None ("no
   checkpoint") while a newer step was committed.

The listings go through per-call views (``READ_STALL_S`` each, as ``load_into``'s): before
2026-12-06 a local mount that stopped answering held a tiered resume for good.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any

from ..errors import (CheckpointNotFoundError, CorruptCheckpointError, StepRemovedError,
                      StorageError)
from ..manifest.discovery import find_step
from ..storage import Storage
from . import load as _load
from .load import LOAD_ATTEMPTS, IndexSelector, _newest_below, load_into

log = logging.getLogger("fastckpt")


def load_tiers(tier: Any, state: dict | None, *, step: int | None, verify: bool, strict: bool,
               timeout_s: float) -> tuple[int, dict]:
    """(all ranks) Load the newest committed step of either tier of ``tier`` (a
    ``tiering.Tier``), or ``step``; set ``tier.last_load``."""
    below, fallbacks, removed = None, 0, 0
    while True:
        try:
            return _load_tiers(tier, state, step=step, verify=verify, strict=strict,
                               timeout_s=timeout_s, below=below)
        except StepRemovedError as e:  # (every rank alike: load_into's collective, or seen)
            removed += 1
            if step is not None or removed == LOAD_ATTEMPTS:
                raise
            log.warning("fastckpt: %s; listing the tiers again (attempt %d of %d)", e,
                        removed + 1, LOAD_ATTEMPTS)
        except CorruptCheckpointError as e:  # (every rank alike: see load_into)
            failed = getattr(e, "tier_step", None)
            fallbacks += 1
            if (step is not None or state is None or not strict or failed is None
                    or fallbacks == LOAD_ATTEMPTS):
                raise
            below = failed
            log.warning("fastckpt: step %d does not load from any tier (%s); loading the "
                        "newest older committed step", failed, e)


def _load_tiers(tier: Any, state: dict | None, *, step: int | None, verify: bool,
                strict: bool, timeout_s: float, below: int | None) -> tuple[int, dict]:
    """One pass of ``load_tiers``; ``below``: the newest step older than it (a fallback)."""
    from .tiering import remote_display
    engine = tier.engine
    group = engine.group
    # first each rank validates only the chunk indexes it loads from (its own at the saved
    # world size, see load_into); if any rank passed over a damaged step, every rank looks
    # again reading every index, so that a damaged index of one rank makes all of them
    # pass over it alike
    own = (IndexSelector(state, group.rank, group.world_size, strict)
           if state is not None else None)
    views = [s.per_call(_load.READ_STALL_S) for s in (engine.storage, tier.storage)]
    while True:
        (local, d1, e1), (remote, d2, e2) = (_newest(views[0], step, own, below),
                                             _newest(views[1], step, own, below))
        mine = {"local": local, "remote": remote, "damaged": d1 or d2,
                "errors": [f"{t} tier: {e}" for t, e in (("local", e1), ("remote", e2)) if e]}
        seen = group.decide(mine, _tiers_seen, timeout_s=timeout_s,
                            what="load: the tiers' newest steps")
        if own is None or not seen.get("damaged"):
            break
        own = None
    best = seen["best"]
    order = []
    if seen["local"]:
        order.append(("local", engine.storage))
    if seen["remote"]:
        order.append(("remote", tier.storage))
    if seen["errors"] and (step is None or not order):
        r, what = seen["errors"][0]
        raise StorageError(
            f"resume across tiers: could not list the {what}"
            + (f" ({len(seen['errors'])} listing(s) failed)" if len(seen["errors"]) > 1 else "")
            + ": which step is the newest is unknown, so nothing was loaded (a restart from "
            "scratch would overwrite the newer steps). Retry when the store answers, or load a "
            "step by number", rank=r)
    if best is None:
        where = f"step {step}" if step is not None else "no committed checkpoint"
        raise CheckpointNotFoundError(
            f"{where} in either tier: {engine.storage.root} or {remote_display(tier.url)}")
    if not order:  # the ranks saw different steps (a commit between their listings): again
        raise StepRemovedError(
            f"the ranks do not agree on the newest step (rank: its newest local and "
            f"remote step: {seen['differ']})")
    last: BaseException | None = None
    for i, (name, st) in enumerate(order):
        try:
            out = load_into(st, state, step=best, verify=verify, strict=strict,
                            group=group, timeout_s=timeout_s)
        except StepRemovedError:
            raise
        except CheckpointNotFoundError as e:  # (listed on every rank: removed since; load_into
            # says so once its own-index pass met the removal and the full pass found no step)
            raise StepRemovedError(f"step {best} was removed from the {name} tier while it "
                                   f"was loaded ({e})", rank=tier.rank) from e
        except (CorruptCheckpointError, StorageError) as e:
            if i + 1 == len(order):
                if isinstance(e, CorruptCheckpointError):
                    e.tier_step = best  # type: ignore[attr-defined]  # (for load_tiers)
                raise
            log.warning("fastckpt: rank %d: step %d did not load from the %s tier (%s); "
                        "loading it from the %s tier", tier.rank, best, name, e,
                        order[i + 1][0])
            last = e
            continue
        root = st.root if name == "local" else remote_display(tier.url)
        tier.last_load = {"step": out[0], "tier": name, "root": root}
        log.info("fastckpt: rank %d: loaded step %d from the %s tier (%s)%s", tier.rank,
                 out[0], name, root, f" after: {last}" if last else "")
        return out
    raise AssertionError("unreachable")  # pragma: no cover


def _newest(st: Storage, step: int | None, own: Any = None, below: int | None = None
            ) -> tuple[int | None, bool, str | None]:
    """The newest committed step of a tier (or ``step`` if committed there; or the newest
    older than ``below``), else None; whether a damaged step was passed over; the error of a
    listing that failed (then the step is unknown, not absent). ``own``: see ``find_step``
    (of an indexed step, only the indexes the load's ``IndexSelector`` names are read)."""
    skipped: list = []
    try:
        if below is not None:
            return _newest_below(st, below), False, None
        return find_step(st, step, skipped=skipped, own=own)[0], bool(skipped), None
    except CheckpointNotFoundError:
        return None, False, None
    except CorruptCheckpointError:
        return None, True, None
    except StorageError as e:
        log.warning("fastckpt: could not list %s: %s", getattr(st, "root", st), e)
        return None, False, str(e)


def _tiers_seen(views: list[dict]) -> dict:
    """(rank 0, ``Group.decide``) From every rank's newest step per tier: the newest step of
    all, whether every rank has it in each tier, the first ranks whose view differs from
    it, whether any rank passed over a damaged step (``damaged``), and the first listing
    errors as [rank, error]."""
    found = [v[t] for v in views for t in ("local", "remote") if v[t] is not None]
    best = max(found) if found else None
    differ = [[r, v["local"], v["remote"]] for r, v in enumerate(views)
              if v["local"] != best or v["remote"] != best]
    errors = [[r, e] for r, v in enumerate(views) for e in v.get("errors") or ()]
    return {"best": best, "local": best is not None and all(v["local"] == best for v in views),
            "remote": best is not None and all(v["remote"] == best for v in views),
            "differ": differ[:8], "damaged": any(v.get("damaged") for v in views),
            "errors": errors[:8]}


# -- the uploader's helpers (engine/tiering.py) --------------------------------------------
def named_files(up: Any) -> set[str]:
    """(coordinator) The shard and index files the upload's manifest names: the set the local
    commit built (parsing a large manifest again costs seconds), else from its bytes."""
    if up.named:
        return set(up.named)
    return manifest_names(json.loads(up.manifest or b"{}").get("body", {}))


def manifest_names(body: dict) -> set[str]:
    """The shard and index files a manifest's body names."""
    return set(body.get("files", {})) | {i.get("file") for i in body.get("indexes", [])}


def check_apart(local: Storage, remote: Storage) -> None:
    """(the tier's set-up) ValueError, naming both, for a remote root that is the local root or
    a directory in it or above it: each upload failed on the remote lease (the local root's,
    held by this job), and its removals reached the local step's shards (before 2026-12-06
    every local step lost its shards so; the remote retention would remove local steps)."""
    if not (local.is_local and remote.is_local):
        return
    a, b = os.path.realpath(local.root), os.path.realpath(remote.root)
    if os.path.commonpath([a, b]) in (a, b):
        where = "is" if a == b else "is inside" if os.path.commonpath([a, b]) == a else "holds"
        raise ValueError(f"remote={remote.root} {where} the local root {local.root}: the "
                         "remote tier needs a root of its own, outside the local one")


def run_parts(step: int, st: Storage, parts: list) -> None:
    """(coordinator, the housekeeping after a remote commit) Each part on ``st``; a failure
    is logged (committed: the next upload or ``fastckpt gc`` finishes it)."""
    for what, fn in parts:
        try:
            fn(st)
        except Exception as e:  # noqa: BLE001 - committed: the next upload or gc finishes
            log.warning("fastckpt: step %d committed remotely, but %s failed: %s", step, what, e)


def check_present(st: Storage, d: str, up: Any) -> None:
    """(coordinator, before the remote manifest) Every file the manifest names is in the
    remote step directory (one listing: a LIST per 1000 names): a file removed since its
    upload would commit a step that does not load, on the tier a restart may have alone. A
    listing that lags the writes fails the upload; the local commit stands."""
    names = set(st.listdir(d))
    missing = sorted(named_files(up) - names)
    if missing:
        raise CorruptCheckpointError(
            f"step {up.step}: {len(missing)} file(s) the manifest names are not in the remote "
            f"step directory after the upload ({', '.join(missing[:4])}"
            f"{', ...' if len(missing) > 4 else ''}): the remote manifest is not published",
            file=d)


def drop_cache(path: str) -> None:
    """Drop the uploaded file's pages from the page cache (they were read only to upload)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):
        pass
    finally:
        os.close(fd)
