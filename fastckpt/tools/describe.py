"""Every step directory under a root, as ``fastckpt ls`` shows it. Torch-free."""

from __future__ import annotations

import os
import re
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from ..errors import CorruptCheckpointError, StorageError, StorageTimeoutError
from ..manifest import schema as fmt
from ..manifest.discovery import (find_step, list_steps, marker_time, read_manifest,
                                  read_small_json, root_hint)
from ..manifest.index import INDEX_SUFFIX, check_listed
from ..retention import INFLIGHT_GRACE_S
from ..storage import Storage, open_storage
from ..storage.bounded import CALL_S

VERIFIED_PREFIX = ".verified-"
VERIFY_FAILED_PREFIX = ".verify-failed-"


def as_storage(root: str | os.PathLike | Storage, **kw: Any) -> Storage:
    """The storage of ``root`` for the tools (ls, inspect, verify, gc, resume): a local root's
    metadata calls each end, or raise StorageError, within ``bounded.CALL_S`` (a mount that
    stops answering fails the command instead of hanging it); a view already bounded is kept,
    and remote backends bound their calls themselves (``op_timeout_s``)."""
    st = root if isinstance(root, Storage) else open_storage(str(root), **kw)
    if getattr(st, "deadline", None) is None and getattr(st, "call_s", None) is None:
        st = st.per_call(CALL_S)
    return st


def remote_tier(storage: Storage) -> tuple[str, Storage] | None:
    """The remote tier a local root names (``Checkpointer(local, remote=url)`` records it in
    ``ROOT/.tiers.json``): (its URL, its storage, opened with the environment's credentials),
    or None."""
    if not storage.is_local:
        return None
    rec = read_small_json(storage, storage.join(fmt.TIERS)) or {}
    url = rec.get("remote")
    # the record is a file of the root (untrusted): an object store's URL only, never a
    # local path, and the tools only read there (see docs/design.md, "Threat model")
    if not isinstance(url, str) or url.split("://", 1)[0] not in _REMOTE_SCHEMES:
        return None
    return url, open_storage(url)


_REMOTE_SCHEMES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss"})


def display_path(storage: Storage, path: str) -> str:
    """A path as the user would type it: a URL for fsspec backends, a plain path otherwise."""
    disp = getattr(storage, "display", None)
    return disp(path) if callable(disp) else path


def _scan(d: str) -> dict[str, tuple[int | None, float | None]]:
    out = {}
    try:
        it = os.scandir(d)
    except (FileNotFoundError, NotADirectoryError):  # gone, or a stray file named step-*
        return {}
    except OSError as e:
        from ..storage.base import storage_error
        raise storage_error(e, "listing", d) from e
    with it:
        for e in it:
            try:
                st = e.stat(follow_symlinks=False)
                out[e.name] = (st.st_size, st.st_mtime)
            except OSError:
                out[e.name] = (None, None)
    return out


def _entries(storage: Storage, d: str) -> dict[str, tuple[int | None, float | None]]:
    """name -> (size, mtime) of the files of a directory, in one listing where possible."""
    if storage.is_local:
        return storage.run("listing", _scan, d, path=d)
    fs = getattr(storage, "fs", None)
    if fs is not None:
        try:
            fs.invalidate_cache(d)
            infos = fs.ls(d, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as e:
            from ..storage.base import storage_error
            raise storage_error(e, "listing", display_path(storage, d)) from e
        out = {}
        for info in infos:
            name = str(info.get("name", "")).rstrip("/").rsplit("/", 1)[-1]
            out[name] = (info.get("size"), _mtime_of(info))
        return out
    return {n: (storage.size(f"{d}/{n}"), None) for n in storage.listdir(d)}


def _mtime_of(info: dict) -> float | None:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created", "modified"):
        v = info.get(key)
        if v is None:
            continue
        if isinstance(v, (int, float)):
            return float(v)
        ts = getattr(v, "timestamp", None)
        if callable(ts):
            try:
                return float(ts())
            except Exception:
                continue
        try:
            from datetime import datetime
            return datetime.fromisoformat(str(v).replace("Z", "+00:00")).timestamp()
        except Exception:
            continue
    return None


@dataclass
class StepRecord:
    """One step directory as ``fastckpt ls`` shows it.

    state: "committed" (valid manifest), "corrupt" (a manifest that fails validation),
    "writing" (no manifest; an in-flight marker or a file younger than the grace period: a save
    may be running) or "partial" (no manifest, nothing recent: an abandoned save).
    checksum: "verified" / "failed" (the result ``verify`` recorded for this save) /
    "unverified"; None for steps that are not committed.
    """
    step: int
    path: str
    state: str
    created_unix: float | None = None
    size_bytes: int = 0
    world_size: int | None = None
    save_id: str | None = None
    tensors: int | None = None
    files: int = 0
    checksum: str | None = None
    verified_unix: float | None = None
    latest: bool = False
    inflight_since: float | None = None
    modified_unix: float | None = None
    error: str | None = None
    #: names in the step directory left by a save that committed or a publish that was
    #: interrupted (``gc`` removes them from a step it keeps)
    leftovers: list = field(default_factory=list)
    _dir: str = field(default="", repr=False)

    @property
    def committed(self) -> bool:
        return self.state == "committed"

    def to_json(self) -> dict:
        d = asdict(self)
        d.pop("_dir")
        d["created"] = (time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(self.created_unix))
                        if self.created_unix else None)
        return d


def _describe_one(storage: Storage, step: int, d: str, now: float, grace: float,
                  indexes: str = "read") -> StepRecord:
    rec = StepRecord(step=step, path=display_path(storage, d), state="partial", _dir=d)
    try:
        ents = _entries(storage, d)
    except StorageTimeoutError:
        raise  # (the storage, not this step: every other step would wait the bound again)
    except StorageError as e:  # this step only: the others are still listed
        rec.state, rec.error = "corrupt", str(e)
        return rec
    rec.size_bytes = sum(s or 0 for s, _ in ents.values())
    rec.files = sum(1 for n in ents if n.endswith(fmt.SHARD_SUFFIX))
    mtimes = [m for _, m in ents.values() if m is not None]
    if storage.is_local:  # a directory a save just created, before its marker is written
        try:
            mtimes.append(storage.run("stat", os.lstat, d, path=d).st_mtime)
        except StorageTimeoutError:
            raise
        except OSError:
            pass
    rec.modified_unix = max(mtimes) if mtimes else None
    body = None
    if fmt.MANIFEST in ents:
        try:
            # None: removed since the listing. "listed": a per-rank index is checked present
            # and sized from this listing, not read (ls at thousands of ranks)
            body = read_manifest(storage, d, step=step, chunks=indexes != "listed")
            if body is not None and indexes == "listed" and "indexes" in body:
                check_listed(body, {n: sz for n, (sz, _) in ents.items()},
                             file=f"{d}/{fmt.MANIFEST}", step_dir=d)
        except CorruptCheckpointError as e:
            rec.state, rec.error = "corrupt", str(e)
        except StorageTimeoutError:
            raise
        except StorageError as e:
            rec.state, rec.error = "corrupt", f"cannot read the manifest: {e}"
    committed_sid = body.get("save_id") if body is not None else None
    for n, (_, mtime) in ents.items():
        if n.startswith(fmt.INFLIGHT_PREFIX):
            if n == f"{fmt.INFLIGHT_PREFIX}{committed_sid}":  # that save committed: debris
                rec.leftovers.append(n)
                continue
            t = marker_time(storage, f"{d}/{n}")
            rec.inflight_since = t if rec.inflight_since is None else max(rec.inflight_since, t)
        elif ".tmp-" in n and (mtime is None or now - mtime >= grace):
            rec.leftovers.append(n)  # a temporary file of an interrupted publish
    if committed_sid is not None:
        rec.leftovers += _dead_attempts(storage, d, ents, body, committed_sid, now, grace)
    if body is not None and indexes == "read":  # (gc's kept steps: as a load needs them)
        for name, f in sorted(body["files"].items()):
            size, _ = ents.get(name, (None, None))
            if name not in ents or (size is not None and size != f["size"]):
                rec.state = "corrupt"
                rec.error = (f"shard file {name} is missing" if name not in ents else
                             f"shard file {name} is {size} bytes, the manifest says {f['size']}")
                break
    if rec.state == "corrupt":
        return rec
    if body is not None:
        rec.state = "committed"
        rec.created_unix = body.get("created_unix")
        rec.world_size = body.get("world_size")
        rec.save_id = body.get("save_id")
        rec.tensors = len(body.get("tensors", {}))
        rec.files = len(body.get("files", {}))
        rec.checksum = "unverified"
        if f"{VERIFIED_PREFIX}{rec.save_id}" in ents:
            rec.checksum = "verified"
            doc = read_small_json(storage, f"{d}/{VERIFIED_PREFIX}{rec.save_id}") or {}
            rec.verified_unix = doc.get("verified_unix")
        elif f"{VERIFY_FAILED_PREFIX}{rec.save_id}" in ents:
            rec.checksum = "failed"
            doc = read_small_json(storage, f"{d}/{VERIFY_FAILED_PREFIX}{rec.save_id}") or {}
            rec.verified_unix = doc.get("verified_unix")
        return rec
    recent_marker = rec.inflight_since is not None and now - rec.inflight_since < grace
    recent_file = rec.modified_unix is not None and now - rec.modified_unix < grace
    if recent_marker or recent_file:
        rec.state = "writing"
    rec.created_unix = rec.inflight_since or None
    return rec


def describe_steps(root: str | Storage, *, grace: float = INFLIGHT_GRACE_S,
                   now: float | None = None, indexes: str = "read") -> list[StepRecord]:
    """Every step directory under ``root``, ascending; [] for an empty or missing root.
    ``indexes="listed"`` (``fastckpt ls``): a step's per-rank chunk indexes are checked
    present with their pinned sizes in the directory's listing, not read and checksummed
    (``"read"``, what gc decides on).

    Raises StorageError when the root cannot be listed. A damaged manifest does not raise: the
    step is reported with state "corrupt" and the reason in ``error``.
    """
    storage = as_storage(root)
    now = time.time() if now is None else now
    recs = [_describe_one(storage, s, d, now, grace, indexes) for s, d in list_steps(storage)]
    committed = [r for r in recs if r.committed]
    if committed:
        committed[-1].latest = True
    return recs


def newest_committed(root: str | Storage, *, skipped: list | None = None
                     ) -> tuple[int, str, dict]:
    """(step, step directory, manifest body) of what a resume loads: the newest step with a
    valid manifest (the engine's rule, :func:`fastckpt.reader.find_step`; newer steps with a
    damaged manifest are skipped and their errors appended to ``skipped``, then not logged:
    the caller reports them). Raises
    CheckpointNotFoundError when there is none and CorruptCheckpointError when every manifest
    is damaged.

    Per-rank chunk indexes are checked present with their pinned sizes in one listing, not
    read (``chunks="listed"``: the body has no chunks): N index reads per call at N ranks
    would put minutes before every restart. A load checks the contents of those it reads
    and, finding one damaged, loads the step before on every rank together."""
    return find_step(as_storage(root), skipped=skipped, warn=skipped is None, chunks="listed")


def step_data_bytes(body: dict) -> int:
    """Bytes of shard data a committed step holds (the sum of its files' sizes)."""
    return sum(int(f.get("size", 0)) for f in body.get("files", {}).values())


def not_found_hint(storage: Storage) -> str:
    """Why there is no committed step, for an error message."""
    hint = root_hint(storage)
    if hint is not None:
        return hint
    try:
        recs = describe_steps(storage)
    except StorageError:
        return ""
    if not recs:
        return "no step directories"
    states: dict[str, int] = {}
    for r in recs:
        states[r.state] = states.get(r.state, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(states.items()))


#: a shard or index file of a save (its save id in group 1)
_ATTEMPT_RE = re.compile(r"r[0-9]{5,}-([A-Za-z0-9_-]{1,64})(?:-[0-9]{3,}"
                         + re.escape(fmt.SHARD_SUFFIX) + "|" + re.escape(INDEX_SUFFIX) + ")")


def _dead_attempts(storage: Storage, d: str, ents: dict, body: dict, sid: str, now: float,
                   grace: float) -> list[str]:
    """The names in a committed step that other saves of it left and no manifest names, of
    the saves that are over: a save of the step again that was killed, a ``dcp.save`` attempt
    that failed (before 2026-12-06 they stayed for good, gc and retention left them). A save
    is over when its in-flight marker (without one: its newest file) is older than ``grace``,
    as for a step that never committed; a save of the step running now keeps its files."""
    named = set(body.get("files", {})) | {i.get("file") for i in body.get("indexes", [])}
    saves: dict[str, list] = {}
    for n, (_, mtime) in ents.items():
        m = _ATTEMPT_RE.fullmatch(n)
        other = m.group(1) if m else (n[len(fmt.INFLIGHT_PREFIX):]
                                      if n.startswith(fmt.INFLIGHT_PREFIX) else None)
        if other is not None and other != sid and n not in named:
            saves.setdefault(other, []).append((n, now if mtime is None else mtime))
    out: list[str] = []
    for other, names in saves.items():
        marker = f"{fmt.INFLIGHT_PREFIX}{other}"
        began = (marker_time(storage, f"{d}/{marker}") if marker in ents
                 else max(m for _, m in names))
        if now - began >= grace:
            out += [n for n, _ in names]
    return sorted(out)
