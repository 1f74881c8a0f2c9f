"""Which steps exist under a root, and reading a step's manifest. Torch-free.

Used by the engine (load, retention), the DCP reader and every command-line tool. A step
directory is ``step-NNNNNNNNNN``; it is *committed* when it holds a valid ``manifest.json``.
The in-flight markers a save leaves while it runs (``.inflight-<save_id>``) are read here too.
"""

from __future__ import annotations

import errno
import json
import logging
import math
import operator
import re
import time
from typing import Callable, Iterator, Optional, Union

from ..errors import (CheckpointNotFoundError, CorruptCheckpointError, NotRegularFileError,
                      StorageError, StorageTimeoutError)
from ..storage import Storage
from . import schema as fmt

log = logging.getLogger("fastckpt")

#: the metadata file of a torch.distributed.checkpoint (DCP) directory
DCP_METADATA = ".metadata"
#: full scans of a root that keeps changing before ``find_step`` gives up (with an error that
#: is not "no checkpoint": a job script must never start fresh because a writer was busy)
MAX_SCANS = 20


def list_steps(storage: Storage) -> list[tuple[int, str]]:
    """(step, directory) of every step directory under the root, ascending (links and files
    named like a step inside a local root are left out: see fastckpt/storage/local.py)."""
    out = []
    for name in storage.subdirs(storage.root):
        s = fmt.parse_step_dirname(name)
        if s is not None:
            out.append((s, storage.join(name)))
    return sorted(out)


def committed_steps(storage: Storage, *, newest_first: bool = False,
                    chunks: bool | str = True) -> Iterator[int]:
    """The steps whose manifest reads back valid (``chunks``: see :func:`read_manifest`),
    ascending or ``newest_first``, read lazily (a caller that stops early reads no more); a
    damaged one is left out (``fastckpt verify`` names it). StorageError (at the first item)
    when the root cannot be listed."""
    listing = list_steps(storage)
    for s, d in (reversed(listing) if newest_first else listing):
        try:
            if read_manifest(storage, d, step=s, chunks=chunks) is not None:
                yield s
        except CorruptCheckpointError:
            continue


def manifest_state(storage: Storage, step_dir: str, *, step: int) -> str:
    """A committed step's manifest as ``resume`` checks it (the manifest, and its chunk indexes
    in one listing): "valid", "damaged" (it fails validation), "absent" (removed meanwhile) or
    "unknown" (the storage could not be read)."""
    try:
        body = read_manifest(storage, step_dir, step=step, chunks="listed")
    except CorruptCheckpointError:
        return "damaged"
    except Exception:  # noqa: BLE001 - a storage error: unknown
        return "unknown"
    return "absent" if body is None else "valid"


def read_manifest(storage: Storage, step_dir: str, *, step: int | None = None,
                  chunks: bool | str = True, own: "Own" = None) -> dict | None:
    """The validated manifest body of a step directory; None if it has no manifest (or it was
    removed between the stat and the read). CorruptCheckpointError when it is damaged, crafted,
    too large, or not a regular file; StorageError when the storage cannot be read.

    A version-4 manifest's chunk lists are in per-rank index files (fastckpt/manifest/index.py),
    read and merged here; ``chunks=False`` skips them (the body then has no ``chunks`` in its
    tensors): for callers that need only the step, its save id, files or metadata;
    ``chunks="listed"`` skips them too but checks, in one listing of the directory, that each
    index is there with its pinned size (``index.check_listed``): what ``fastckpt resume``
    and the tools that pick a step need, at any world size, without N index reads.
    ``own=(rank, world_size)``: when the step was saved with indexes by ``world_size`` ranks,
    read ``rank``'s index only: a partial body (:func:`fastckpt.manifest.index.expand`), which
    :func:`is_partial` tells apart. ``own`` may also be a function of the manifest's body (the
    load's, which knows the boxes its rank reads) naming the saving ranks whose indexes to
    read, or None for every index (:func:`select_indexes`)."""
    path = f"{step_dir}/{fmt.MANIFEST}"
    refuse_link(storage, step_dir)
    try:
        n = storage.size(path)
        if n is None:
            return None
        if n > fmt.MAX_MANIFEST_BYTES:
            raise CorruptCheckpointError(f"manifest is {n} bytes, more than the "
                                         f"{fmt.MAX_MANIFEST_BYTES} fastckpt reads", file=path)
        data = storage.read_bytes(path)
    except NotRegularFileError as e:
        raise CorruptCheckpointError(f"the manifest is not a regular file ({e})",
                                     file=path) from None
    except StorageError as e:
        if is_missing(e):  # removed since the stat: retention or gc
            return None
        raise
    body = fmt.decode_manifest(data, file=path, step=step)
    if chunks == "listed" and "indexes" in body:
        from .index import check_listed
        sizes = storage.sizes(step_dir)
        if fmt.MANIFEST not in sizes:
            return None  # removed since it was read: retention or gc
        check_listed(body, sizes, file=path, step_dir=step_dir)
        return body
    if chunks and "indexes" in body:
        from .index import read_indexes
        return read_indexes(storage, step_dir, body, file=path, own=select_indexes(body, own))
    return body


def refuse_link(storage: Storage, step_dir: str) -> None:
    """CorruptCheckpointError when a step directory of a local root is a symbolic link: the
    listings leave such a directory out, and a step named by its number (``load(step=N)``,
    ``fastckpt inspect --step N``) must not lead out of the root either (storage/local.py)."""
    if not storage.is_local or step_dir.rstrip("/") == storage.root.rstrip("/"):
        return
    import os
    if storage.run("stat", os.path.islink, step_dir, path=step_dir):  # (an lstat)
        raise CorruptCheckpointError("the step directory is a symbolic link; fastckpt never "
                                     "follows links inside the root (listings leave them "
                                     "out)", file=step_dir)


#: what ``read_manifest``'s ``own`` may be: (rank, world size), or a function of the body
Own = Union[tuple, Callable[[dict], Optional[frozenset]], None]


def select_indexes(body: dict, own: Own) -> frozenset | None:
    """The saving ranks whose indexes ``read_manifest(..., own=own)`` reads, None for every
    index. Only a manifest with per-rank indexes and inline chunks (written since 2026-12-05;
    without them a rank's own index rarely covers what it loads: the replicated tensors are
    spread over the ranks) is read in part: ``(rank, world)``, this rank's own index when the
    step was saved at that world size; a function, the ranks it names (it sees the body
    without chunks)."""
    if own is None or "indexes" not in body or "inline" not in body:
        return None
    if callable(own):
        sel = own(body)
        if sel is None:
            return None
        n = len(body["indexes"])
        return frozenset(r for r in sel if 0 <= r < n)
    rank, world = own
    return frozenset({rank}) if body["world_size"] == world and 0 <= rank < world else None


def is_partial(body: dict, own: Own) -> bool:
    """Whether ``read_manifest(..., own=own)`` gives a partial body for this manifest."""
    return select_indexes(body, own) is not None


def is_missing(e: BaseException) -> bool:
    """Whether a storage error says the path does not exist."""
    return (getattr(e, "errno", None) == errno.ENOENT
            or isinstance(e.__cause__, FileNotFoundError))


def find_step(storage: Storage, step: int | None = None, *,
              skipped: list | None = None, warn: bool = True,
              own: Own = None, chunks: bool | str = True) -> tuple[int, str, dict]:
    """The requested step, or the newest step with a valid manifest.

    ``step=None``: a step whose manifest is damaged is skipped with a warning naming it (and
    appended to ``skipped``; ``warn=False``: no warning, the caller reports ``skipped``) so
    that one bad step never stops a resume; CorruptCheckpointError
    only when damaged manifests are all there is. The ``latest`` hint is not consulted: the
    listing decides. Safe against a writer committing and removing steps meanwhile (retention
    after each commit): a pass newest-first that finds nothing is confirmed by a pass
    oldest-first and a second listing. In an oldest-first pass that misses, every committed step
    it listed was removed before it was read, which retention does only after committing a
    newer step; the newest committed step is never removed, so it is in the second listing and
    not in the first, and the scan runs again. So CheckpointNotFoundError means there was an
    instant with no committed step, never "a writer was busy".

    ``step=N``: that step or CheckpointNotFoundError; a damaged manifest raises
    CorruptCheckpointError naming it. ``own``: see :func:`read_manifest` (a step is then
    valid for this rank: only its own index was read); ``chunks``: see :func:`read_manifest`
    (``"listed"``: the indexes are checked present and sized, not read).
    """
    if step is not None:
        # (a str or float made a valid step's manifest "invalid" ("it is in the directory of
        # step 5 but says step 5"), True loaded step 1: what ``save`` refuses, refused here)
        if isinstance(step, bool) or not hasattr(type(step), "__index__"):
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        step = operator.index(step)
        d = storage.join(fmt.step_dirname(step))
        body = read_manifest(storage, d, step=step, own=own, chunks=chunks)
        if body is None:
            raise CheckpointNotFoundError(f"step {step} has no committed checkpoint under "
                                          f"{storage.root}", file=d)
        return step, d, body
    bad: dict[int, CorruptCheckpointError] = {}

    def scan(listing: list, newest_first: bool) -> tuple[int, str, dict] | None:
        hit = None
        for s, d in (reversed(listing) if newest_first else listing):
            try:
                body = read_manifest(storage, d, step=s, own=own, chunks=chunks)
            except CorruptCheckpointError as e:
                bad[s] = e
                continue
            if body is not None:
                bad.pop(s, None)
                hit = (s, d, body)
                if newest_first:
                    break
        return hit

    for _ in range(MAX_SCANS):
        listing = list_steps(storage)
        hit = scan(listing, True)
        if hit is None:
            listing = list_steps(storage)
            hit = scan(listing, False)
        if hit is not None:
            newer = sorted(s for s in bad if s > hit[0])
            for s in newer:
                if warn:
                    log.warning("fastckpt: skipping step %d, its manifest is damaged (%s); "
                                "the newest valid step is %d", s, bad[s], hit[0])
                if skipped is not None:
                    skipped.append(bad[s])
            return hit
        again = {s for s, _ in list_steps(storage)}
        if again <= {s for s, _ in listing}:
            break
    else:
        raise StorageError(f"the root kept changing over {MAX_SCANS} scans (steps committed "
                           "and removed faster than they could be listed); try again",
                           file=storage.root)
    if bad:  # damaged manifests are all there is: the newest one's error (file, tensor)
        raise bad[max(bad)]
    hint = root_hint(storage)
    if hint is None:
        hint = f"{len(listing)} step directories, none committed" if listing else \
            "no step directories"
    raise CheckpointNotFoundError(f"no committed checkpoint under {storage.root} ({hint})")


def looks_like_step_dir(storage: Storage) -> str | None:
    """The parent to use when the root given is itself a step directory (its name is
    ``step-N`` and it holds a manifest or shard files), else None."""
    root = storage.root.rstrip("/")
    parent, _, name = root.rpartition("/")
    if fmt.parse_step_dirname(name) is None:
        return None
    try:
        names = storage.listdir(root)
    except StorageTimeoutError:
        raise  # (not "no step directory": the storage did not answer)
    except StorageError:
        return None
    if fmt.MANIFEST in names or any(n.endswith(fmt.SHARD_SUFFIX) for n in names):
        return parent or "/"
    return None


def root_hint(storage: Storage) -> str | None:
    """Why a root holds no step at all, when there is a likelier reason than "nothing saved
    yet": it does not exist (a mistyped path), it is a step directory (use its parent), or it
    is (or holds) a DCP checkpoint (``fastckpt convert`` it)."""
    parent = looks_like_step_dir(storage)
    if parent is not None:
        return f"it is a step directory: give its parent, {parent}"
    dcp = dcp_hint(storage)
    if dcp is not None:
        return dcp
    if storage.is_local:
        import os
        if not storage.run("stat", os.path.exists, storage.root):
            return "the directory does not exist: mistyped, or nothing was saved there yet"
    return None


_DCP_DATA = re.compile(r"__[0-9]+_[0-9]+\.distcp")  # FileSystemWriter's files: __RANK_N.distcp
_ANY_STEP = re.compile(r"step[-_]?([0-9]+)")  # torchtitan's step-N, any number of digits


def _is_dcp_dir(names: list[str]) -> bool:
    return DCP_METADATA in names and any(_DCP_DATA.fullmatch(n) for n in names)


def dcp_hint(storage: Storage, *, listing_errors: bool = False) -> str | None:
    """When the root is a DCP checkpoint directory (``torch.distributed.checkpoint``'s
    ``.metadata`` and ``__R_N.distcp`` files), or holds DCP checkpoints in ``step-N``
    subdirectories (torchtitan's layout; the newest three are looked at): what to run
    instead, for the "no committed checkpoint" message. None otherwise, or when the root
    cannot be listed (``listing_errors``: then the StorageError is raised: the CLI's first
    look at a root, so that a store that does not answer costs one bound, not two)."""
    root = storage.root.rstrip("/") or "/"
    disp = getattr(storage, "display", None)
    show = (lambda p: disp(p)) if callable(disp) else (lambda p: p)  # noqa: E731
    try:
        names = storage.listdir(root)
    except StorageError:
        if listing_errors:
            raise
        return None
    if _is_dcp_dir(names):
        return ("it is a DCP checkpoint (torch.distributed.checkpoint); run "
                f"`fastckpt convert {show(root)} ROOT` to make a fastckpt checkpoint of it")
    if any(fmt.parse_step_dirname(n) is not None for n in names):
        return None  # fastckpt's own steps (next to DCP ones a run wrote before switching)
    steps = sorted(((int(m.group(1)), n) for n in names if (m := _ANY_STEP.fullmatch(n))),
                   reverse=True)
    for _, n in steps[:3]:
        try:
            sub_names = storage.listdir(f"{root}/{n}")
        except StorageTimeoutError:
            raise
        except StorageError:  # a file named step-N, an unreadable directory
            continue
        if _is_dcp_dir(sub_names):
            sub = show(f"{root}/{n}")
            return ("it holds DCP checkpoints in step directories (torchtitan's layout): the "
                    f"newest, {sub}, is a DCP checkpoint (torch.distributed.checkpoint); run "
                    f"`fastckpt convert {sub} ROOT` to make a fastckpt checkpoint of it")
    return None


def marker_name(save_id: str) -> str:
    return f"{fmt.INFLIGHT_PREFIX}{save_id}"


def marker_doc(save_id: str, *, host: str, pid: int) -> bytes:
    """The content of a save's in-flight marker."""
    return json.dumps({"save_id": save_id, "created_unix": time.time(), "host": host,
                       "pid": pid}).encode()


def read_small_json(storage: Storage, path: str) -> dict | None:
    """A small JSON object (a marker, a record); None when it is missing, unreadable, larger
    than 1 MiB or not a mapping. Never raises."""
    try:
        if (storage.size(path) or 0) > 1 << 20:
            return None
        doc = json.loads(storage.read_bytes(path))
        return doc if isinstance(doc, dict) else None
    except Exception:  # noqa: BLE001 - a damaged record says nothing
        return None


def marker_time(storage: Storage, path: str) -> float:
    """When the save of an in-flight marker began; 0.0 when the marker is unreadable (treated
    as old), and when its time is not a finite number (a crafted one: an integer too large
    for a float raised OverflowError, which stopped retention and the tools for the whole
    root; NaN or infinity kept its partial step "in flight" for good)."""
    doc = read_small_json(storage, path) or {}
    try:
        t = float(doc["created_unix"])
    except (KeyError, TypeError, ValueError, OverflowError):
        return 0.0
    return t if math.isfinite(t) else 0.0
