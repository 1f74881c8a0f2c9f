"""What the ``fastckpt`` command does, as plain functions: usable from Python without the CLI.

* :func:`describe_steps` -- every step directory under a root: committed, partial, being
  written or damaged, with time, size, world size and checksum status (what ``fastckpt ls``
  prints);
* :func:`verify_step` -- re-read every shard file of a committed step and check it against the
  manifest, naming each bad file, tensor and byte offset (``fastckpt verify``);
* :func:`inspect_step` -- the tensors of a step with dtypes, shapes, sharding and sizes, and its
  plain values (``fastckpt inspect``);
* :func:`plan_gc` / :func:`run_gc` -- which steps a clean-up removes and why, and removing them
  (``fastckpt gc``);
* :func:`parse_size` / :func:`human_bytes` -- ``"4GiB"`` <-> ``4294967296``.

Every function takes a root (a path or an fsspec URL) or an open :class:`~fastckpt.storage.Storage`
and raises the errors of :mod:`fastckpt.errors` for expected conditions (no committed step:
:class:`~fastckpt.errors.CheckpointNotFoundError`; unreadable root:
:class:`~fastckpt.errors.StorageError`; damaged manifest:
:class:`~fastckpt.errors.CorruptCheckpointError`). Problems found *inside* a checkpoint by
:func:`verify_step` are returned, not raised.

The result of a verification is recorded in the step directory as a small JSON file named
``.verified-<save_id>`` (clean) or ``.verify-failed-<save_id>`` (problems found); ``ls`` reads it.
Being keyed by the save id, a marker never vouches for a later save of the same step (which
also removes it: the engine deletes unknown files from a step directory it re-saves).
"""

from __future__ import annotations

import json
import math
import os
import re
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import xxhash

from . import __version__
from . import format as fmt
from ._native import aligned_buffer
from .errors import CorruptCheckpointError, StorageError
from .reader import find_step, list_steps, read_manifest
from .retention import INFLIGHT_GRACE_S, StepInfo, plan_removal, remove_step
from .storage import Storage, open_storage

__all__ = [
    "VERIFIED_PREFIX", "VERIFY_FAILED_PREFIX", "StepRecord", "Problem", "VerifyResult",
    "GcAction", "as_storage", "display_path", "describe_steps", "newest_committed",
    "verify_step", "inspect_step", "plan_gc", "run_gc", "parse_size", "human_bytes",
    "step_data_bytes", "not_found_hint", "stale_uploads", "abort_uploads",
]

VERIFIED_PREFIX = ".verified-"
VERIFY_FAILED_PREFIX = ".verify-failed-"

ProgressFn = Callable[[int], None]


# ------------------------------------------------------------------------------------ sizes

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KI": 1 << 10, "KIB": 1 << 10, "KB": 10 ** 3,
          "M": 1 << 20, "MI": 1 << 20, "MIB": 1 << 20, "MB": 10 ** 6,
          "G": 1 << 30, "GI": 1 << 30, "GIB": 1 << 30, "GB": 10 ** 9,
          "T": 1 << 40, "TI": 1 << 40, "TIB": 1 << 40, "TB": 10 ** 12}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"4GiB"``, ``"4G"`` (both 2**32), ``"4GB"`` (4e9), ``"512MiB"``, ``"1.5T"``, ``"4096"``."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4GiB, 512MiB, 1.5T, 4096)")
    return int(float(m.group(1)) * _UNITS[unit])


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover


# ---------------------------------------------------------------------------------- storage

def as_storage(root: str | os.PathLike | Storage, **kw: Any) -> Storage:
    return root if isinstance(root, Storage) else open_storage(str(root), **kw)


def display_path(storage: Storage, path: str) -> str:
    """A path as the user would type it: a URL for fsspec backends, a plain path otherwise."""
    disp = getattr(storage, "display", None)
    return disp(path) if callable(disp) else path


def _entries(storage: Storage, d: str) -> dict[str, tuple[int | None, float | None]]:
    """name -> (size, mtime) of the files of a directory, in one listing where possible."""
    if storage.is_local:
        out = {}
        try:
            it = os.scandir(d)
        except (FileNotFoundError, NotADirectoryError):  # gone, or a stray file named step-*
            return {}
        except OSError as e:
            from .storage.base import storage_error
            raise storage_error(e, "listing", d) from e
        with it:
            for e in it:
                try:
                    st = e.stat(follow_symlinks=False)
                    out[e.name] = (st.st_size, st.st_mtime)
                except OSError:
                    out[e.name] = (None, None)
        return out
    fs = getattr(storage, "fs", None)
    if fs is not None:
        try:
            fs.invalidate_cache(d)
            infos = fs.ls(d, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as e:
            from .storage.base import storage_error
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


def _read_json(storage: Storage, path: str) -> dict | None:
    """A small JSON file (a marker), None if it is unreadable or not a mapping."""
    try:
        if (storage.size(path) or 0) > 1 << 20:
            return None
        doc = json.loads(storage.read_bytes(path))
        return doc if isinstance(doc, dict) else None
    except Exception:
        return None


# -------------------------------------------------------------------------------- describe

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


def _describe_one(storage: Storage, step: int, d: str, now: float, grace: float) -> StepRecord:
    rec = StepRecord(step=step, path=display_path(storage, d), state="partial", _dir=d)
    try:
        ents = _entries(storage, d)
    except StorageError as e:  # this step only: the others are still listed
        rec.state, rec.error = "corrupt", str(e)
        return rec
    rec.size_bytes = sum(s or 0 for s, _ in ents.values())
    rec.files = sum(1 for n in ents if n.endswith(fmt.SHARD_SUFFIX))
    mtimes = [m for _, m in ents.values() if m is not None]
    if storage.is_local:  # a directory a save just created, before its marker is written
        try:
            mtimes.append(os.lstat(d).st_mtime)
        except OSError:
            pass
    rec.modified_unix = max(mtimes) if mtimes else None
    body = None
    if fmt.MANIFEST in ents:
        try:
            body = read_manifest(storage, d, step=step)  # None: removed since the listing
        except CorruptCheckpointError as e:
            rec.state, rec.error = "corrupt", str(e)
        except StorageError as e:
            rec.state, rec.error = "corrupt", f"cannot read the manifest: {e}"
    committed_sid = body.get("save_id") if body is not None else None
    for n, (_, mtime) in ents.items():
        if n.startswith(fmt.INFLIGHT_PREFIX):
            if n == f"{fmt.INFLIGHT_PREFIX}{committed_sid}":  # that save committed: debris
                rec.leftovers.append(n)
                continue
            doc = _read_json(storage, f"{d}/{n}") or {}
            try:
                t = float(doc["created_unix"])
            except Exception:
                t = 0.0
            rec.inflight_since = t if rec.inflight_since is None else max(rec.inflight_since, t)
        elif ".tmp-" in n and (mtime is None or now - mtime >= grace):
            rec.leftovers.append(n)  # a temporary file of an interrupted publish
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
            doc = _read_json(storage, f"{d}/{VERIFIED_PREFIX}{rec.save_id}") or {}
            rec.verified_unix = doc.get("verified_unix")
        elif f"{VERIFY_FAILED_PREFIX}{rec.save_id}" in ents:
            rec.checksum = "failed"
            doc = _read_json(storage, f"{d}/{VERIFY_FAILED_PREFIX}{rec.save_id}") or {}
            rec.verified_unix = doc.get("verified_unix")
        return rec
    recent_marker = rec.inflight_since is not None and now - rec.inflight_since < grace
    recent_file = rec.modified_unix is not None and now - rec.modified_unix < grace
    if recent_marker or recent_file:
        rec.state = "writing"
    rec.created_unix = rec.inflight_since or None
    return rec


def describe_steps(root: str | Storage, *, grace: float = INFLIGHT_GRACE_S,
                   now: float | None = None) -> list[StepRecord]:
    """Every step directory under ``root``, ascending; [] for an empty or missing root.

    Raises StorageError when the root cannot be listed. A damaged manifest does not raise: the
    step is reported with state "corrupt" and the reason in ``error``.
    """
    storage = as_storage(root)
    now = time.time() if now is None else now
    recs = [_describe_one(storage, s, d, now, grace) for s, d in list_steps(storage)]
    committed = [r for r in recs if r.committed]
    if committed:
        committed[-1].latest = True
    return recs


def newest_committed(root: str | Storage, *, skipped: list | None = None
                     ) -> tuple[int, str, dict]:
    """(step, step directory, manifest body) of what a resume loads: the newest step with a
    valid manifest (the engine's rule, :func:`fastckpt.reader.find_step`; newer steps with a
    damaged manifest are skipped and their errors appended to ``skipped``). Raises
    CheckpointNotFoundError when there is none and CorruptCheckpointError when every manifest
    is damaged."""
    return find_step(as_storage(root), skipped=skipped)


def step_data_bytes(body: dict) -> int:
    """Bytes of shard data a committed step holds (the sum of its files' sizes)."""
    return sum(int(f.get("size", 0)) for f in body.get("files", {}).values())


# ---------------------------------------------------------------------------------- verify

@dataclass
class Problem:
    """One thing wrong with a checkpoint. ``offset``/``length`` are bytes within ``file``."""
    kind: str  # manifest | missing | size | checksum | padding | truncated | read | file-checksum
    message: str
    file: str | None = None
    tensor: str | None = None
    offset: int | None = None
    length: int | None = None
    rank: int | None = None

    def __str__(self) -> str:
        parts = []
        if self.file:
            parts.append(f"file {self.file}")
        if self.tensor is not None:
            parts.append(f"tensor {self.tensor!r}")
        if self.offset is not None:
            if self.length and self.length > 1:
                last = self.offset + self.length - 1
                parts.append(f"offset {self.offset} (bytes {self.offset}..{last})")
            else:
                parts.append(f"offset {self.offset}")
        return (", ".join(parts) + ": " if parts else "") + self.message

    def to_json(self) -> dict:
        return asdict(self)


@dataclass
class VerifyResult:
    step: int
    path: str
    save_id: str | None
    problems: list[Problem] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    chunks_checked: int = 0
    seconds: float = 0.0
    recorded: str | None = None  # the marker written, if any
    record_error: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"step": self.step, "path": self.path, "save_id": self.save_id, "ok": self.ok,
                "files_checked": self.files_checked, "bytes_checked": self.bytes_checked,
                "chunks_checked": self.chunks_checked, "seconds": round(self.seconds, 3),
                "recorded": self.recorded, "record_error": self.record_error,
                "problems": [p.to_json() for p in self.problems]}


def _itemsize(dtype_name: str) -> int | None:
    try:
        return fmt.dtype_from_name(dtype_name).itemsize
    except CorruptCheckpointError:
        return None


def _check_manifest(body: dict) -> tuple[list[Problem], dict[str, list]]:
    """What the manifest's validation (``format.validate_body``: every chunk inside its tensor
    and its file, tensors covered exactly) leaves to verify: chunks of different tensors that
    share bytes of a file. Returns the problems and file -> [(fqn, chunk)] in file order."""
    problems: list[Problem] = []
    by_file: dict[str, list] = {name: [] for name in body["files"]}
    for fqn, t in body["tensors"].items():
        for c in t["chunks"]:
            if c["length"]:
                by_file[c["file"]].append((fqn, c))
    for name, chunks in by_file.items():
        chunks.sort(key=lambda fc: fc[1]["offset"])
        prev_end, prev = 0, None
        for fqn, c in chunks:
            if c["offset"] < prev_end:
                problems.append(Problem("manifest", f"chunk overlaps tensor {prev!r}'s bytes",
                                        file=name, tensor=fqn, offset=c["offset"]))
            prev_end, prev = max(prev_end, c["offset"] + c["length"]), fqn
    return problems, by_file


def _verify_file(storage: Storage, d: str, name: str, info: dict, chunks: list,
                 block: int, progress: ProgressFn | None,
                 get_buf: Callable[[int], memoryview] | None = None
                 ) -> tuple[list[Problem], int, int]:
    """Check one shard file; return (problems, bytes read, chunks checked)."""
    path = f"{d}/{name}"
    declared = int(info["size"])
    rank = info.get("rank")
    problems: list[Problem] = []
    try:
        size = storage.size(path)
    except StorageError as e:
        return [Problem("read", f"cannot stat the file: {e}", file=name, rank=rank)], 0, 0
    if size is None:
        tensors = sorted({fqn for fqn, _ in chunks})
        more = f" (and {len(tensors) - 5} more)" if len(tensors) > 5 else ""
        if progress:
            progress(declared)
        return [Problem("missing", f"shard file is missing; it holds {len(chunks)} chunk(s) of "
                        f"{', '.join(map(repr, tensors[:5]))}{more}", file=name,
                        rank=rank)], 0, 0
    readable = min(size, declared)
    if size != declared:
        problems.append(Problem(
            "size", f"shard file is {size} bytes, the manifest says {declared} "
            f"({'truncated' if size < declared else 'extended'})", file=name,
            offset=readable, rank=rank))
    # segments covering [0, readable): chunks (hash them) and the gaps between (must be zero)
    segs: list[list] = []  # [start, end, fqn | None, chunk | None, hasher | None]
    pos = 0
    for fqn, c in chunks:
        off, ln = int(c["offset"]), int(c["length"])
        if off + ln > readable:
            problems.append(Problem("truncated", "chunk lies past the end of the file",
                                    file=name, tensor=fqn, offset=off, length=ln, rank=rank))
            continue
        if off > pos:
            segs.append([pos, off, None, None, None])
        if off < pos:  # overlap: reported by the manifest check; hash it on its own
            segs.append([off, off + ln, fqn, c, xxhash.xxh3_64()])
            continue
        segs.append([off, off + ln, fqn, c, xxhash.xxh3_64()])
        pos = off + ln
    if pos < readable:
        segs.append([pos, readable, None, None, None])
    segs.sort(key=lambda s: s[0])
    whole = xxhash.xxh3_64() if "checksum" in info else None  # only older saves have one
    buf = (get_buf or aligned_buffer)(min(block, max(readable, 1)))
    nread = 0
    checked = 0
    open_segs: list[list] = []
    i = 0
    bad_gap_reported = False
    for bstart in range(0, readable, block):
        n = min(block, readable - bstart)
        bend = bstart + n
        try:
            storage.read_into(path, bstart, buf, n, hash=False)  # hashed per chunk below
        except StorageError as e:
            problems.append(Problem("read", f"cannot read {n} bytes: {e}", file=name,
                                    offset=bstart, rank=rank))
            if progress:
                progress(readable - bstart)
            return problems, nread, checked
        mv = buf[:n]
        if whole is not None:
            whole.update(mv)
        nread += n
        while i < len(segs) and segs[i][0] < bend:
            open_segs.append(segs[i])
            i += 1
        still = []
        for seg in open_segs:
            s0, s1, fqn, c, h = seg
            lo, hi = max(s0, bstart), min(s1, bend)
            if hi > lo:
                piece = mv[lo - bstart:hi - bstart]
                if h is not None:
                    h.update(piece)
                elif not bad_gap_reported:
                    raw = piece.tobytes()
                    rest = raw.lstrip(b"\0")
                    if rest:
                        bad_gap_reported = True
                        at = lo + len(raw) - len(rest)
                        problems.append(Problem(
                            "padding", "non-zero byte in the alignment padding between chunks "
                            "(no tensor data, but the file was modified)", file=name, offset=at,
                            length=1, rank=rank))
            if s1 > bend:
                still.append(seg)
                continue
            if h is not None:
                checked += 1
                got = fmt.hexdigest(h.intdigest())
                if got != c["checksum"]:
                    problems.append(Problem(
                        "checksum", f"checksum mismatch in chunk {list(c['offsets'])}+"
                        f"{list(c['sizes'])} (expected {c['checksum']}, read {got}): the data "
                        "is damaged", file=name, tensor=fqn, offset=s0, length=s1 - s0,
                        rank=rank))
        open_segs = still
        if progress:
            progress(n)
    if size == declared and not problems and whole is not None:
        got = fmt.hexdigest(whole.intdigest())
        if got != info["checksum"]:
            problems.append(Problem("file-checksum", f"whole-file checksum mismatch (expected "
                                    f"{info['checksum']}, read {got})", file=name, rank=rank))
    return problems, nread, checked


def verify_step(root: str | Storage, step: int | None = None, *, jobs: int = 4,
                block_size: int = 32 << 20, progress: ProgressFn | None = None,
                record: bool = True, found: tuple[int, str, dict] | None = None) -> VerifyResult:
    """Re-read every shard file of a committed step (default: the newest) and check it.

    Checks the manifest's internal consistency, each file's presence and size, every chunk's
    xxh3-64 checksum, that alignment padding is zero (together: every byte of every file), and
    a whole-file checksum where the manifest has one (saves before 0.1.1 wrote it). Returns a
    :class:`VerifyResult` listing every problem (file, tensor, byte offset); raises only when
    there is no such committed step (CheckpointNotFoundError), its manifest is damaged
    (CorruptCheckpointError) or the root cannot be read (StorageError).

    ``progress(nbytes)`` is called (from worker threads) as bytes are checked; the total is
    :func:`step_data_bytes` of the manifest. ``record`` writes the result marker
    (``.verified-<save_id>`` or ``.verify-failed-<save_id>``) into the step directory; a
    failure to write it is reported in ``record_error``, never raised.
    """
    storage = as_storage(root)
    t0 = time.perf_counter()
    step, d, body = found if found is not None else find_step(storage, step)
    res = VerifyResult(step=step, path=display_path(storage, d), save_id=body.get("save_id"))
    problems, by_file = _check_manifest(body)
    res.problems.extend(problems)
    lock = threading.Lock()

    def prog(n: int) -> None:
        if progress is not None:
            with lock:
                progress(n)

    local = threading.local()  # one read buffer per worker thread, reused across files

    def get_buf(n: int) -> memoryview:
        b = getattr(local, "buf", None)
        if b is None or len(b) < n:
            b = local.buf = aligned_buffer(block_size)
        return b

    def one(name: str):
        return _verify_file(storage, d, name, body["files"][name], by_file.get(name, []),
                            block_size, prog, get_buf)

    names = sorted(body["files"])
    workers = max(1, min(jobs, len(names)))
    if workers == 1:
        outs = [one(n) for n in names]
    else:
        with ThreadPoolExecutor(workers, thread_name_prefix="fastckpt-verify") as ex:
            outs = list(ex.map(one, names))
    for probs, nread, nchunks in outs:
        res.problems.extend(probs)
        res.bytes_checked += nread
        res.chunks_checked += nchunks
    res.files_checked = len(names)
    res.seconds = time.perf_counter() - t0
    if record:
        _record(storage, d, res)
    return res


def _record(storage: Storage, d: str, res: VerifyResult) -> None:
    sid = res.save_id
    if not sid:
        return
    good, bad = f"{d}/{VERIFIED_PREFIX}{sid}", f"{d}/{VERIFY_FAILED_PREFIX}{sid}"
    target, other = (good, bad) if res.ok else (bad, good)
    doc = {"save_id": sid, "step": res.step, "ok": res.ok, "verified_unix": time.time(),
           "host": socket.gethostname(), "fastckpt_version": __version__,
           "bytes_checked": res.bytes_checked, "problems": len(res.problems)}
    try:
        if storage.size(f"{d}/{fmt.MANIFEST}") is None:
            raise StorageError("the step was removed while it was verified", file=d)
        storage.publish(target, (json.dumps(doc) + "\n").encode())
        storage.remove(other)
        res.recorded = display_path(storage, target)
    except StorageError as e:
        res.record_error = str(e)


# --------------------------------------------------------------------------------- inspect

def _sharding(shape: list, chunks: list) -> str:
    if not chunks:
        return "empty" if math.prod(shape or [1]) == 0 else "no data"
    ranks = sorted({c.get("rank") for c in chunks if c.get("rank") is not None})
    if len(chunks) == 1 and list(chunks[0]["sizes"]) == list(shape):
        return f"whole (rank {ranks[0]})" if ranks else "whole"
    dims = sorted({dim for c in chunks for dim, (s, n) in enumerate(zip(c["sizes"], shape))
                   if s != n})
    rr = _ranges(ranks)
    what = "dim " + ",".join(map(str, dims)) if dims else "?"
    return f"sharded {what} in {len(chunks)} chunks (ranks {rr})"


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _plain_values(tree: Any) -> dict[str, Any]:
    """Flattened key path -> plain value of a skeleton, tensors left out; a list or tuple of
    plain values stays one value."""
    from ._tree import TENSOR_TAG, decode_value
    out: dict[str, Any] = {}

    def has_tensor(x: Any) -> bool:
        if isinstance(x, dict):
            return TENSOR_TAG in x or any(has_tensor(v) for v in x.values())
        if isinstance(x, list):
            return any(has_tensor(v) for v in x)
        return False

    def key(path: str, k: Any) -> str:
        return f"{path}.{k}" if path else str(k)

    def walk(x: Any, path: str) -> None:
        if isinstance(x, dict) and TENSOR_TAG in x:
            return
        seq = x if isinstance(x, list) else x.get("$tuple") if isinstance(x, dict) else None
        if seq is not None:
            if has_tensor(seq) or any(isinstance(v, dict) and "$tuple" not in v
                                      and "$float" not in v for v in seq):
                for i, v in enumerate(seq):
                    walk(v, key(path, i))
            else:
                out[path] = decode_value(x)
            return
        if isinstance(x, dict) and "$float" in x:
            out[path] = decode_value(x)
            return
        if isinstance(x, dict) and "$dict" in x:
            for k, v in x["$dict"]:
                walk(v, key(path, decode_value(k)))
            return
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, key(path, k))
            return
        out[path] = x
    walk(tree, "")
    return out


def inspect_step(root: str | Storage, step: int | None = None, *,
                 found: tuple[int, str, dict] | None = None) -> dict:
    """Everything the manifest of a committed step says, in JSON-able form.

    Keys: step, path, save_id, created, created_unix, world_size, fastckpt_version,
    torch_version, files (name -> {rank, size}), data_bytes, tensors (list of {name, dtype,
    shape, numel, bytes, sharding, chunks: [{rank, file, offset, length, offsets, sizes}]}),
    plain_values (flattened key path -> value; per rank when ranks differ), user_meta.
    """
    storage = as_storage(root)
    step, d, body = found if found is not None else find_step(storage, step)
    tensors = []
    for fqn in sorted(body["tensors"]):
        t = body["tensors"][fqn]
        shape = list(t.get("shape", []))
        numel = math.prod(shape) if shape else 1
        isz = _itemsize(t.get("dtype", "")) or 0
        chunks = sorted(t.get("chunks", []), key=lambda c: (list(c["offsets"]), c.get("rank")))
        tensors.append({
            "name": fqn, "dtype": t.get("dtype"), "shape": shape, "numel": numel,
            "bytes": numel * isz, "dtensor": bool(t.get("dtensor")),
            "sharding": _sharding(shape, chunks),
            "chunks": [{"rank": c.get("rank"), "file": c.get("file"), "offset": c.get("offset"),
                        "length": c.get("length"), "offsets": c.get("offsets"),
                        "sizes": c.get("sizes"), "checksum": c.get("checksum")}
                       for c in chunks]})
    if "tree" in body:
        plain: Any = _plain_values(body["tree"])
    else:
        plain = {f"rank{r}": _plain_values(t) for r, t in enumerate(body.get("rank_trees", []))}
    return {
        "step": step, "path": display_path(storage, d), "save_id": body.get("save_id"),
        "created": body.get("created"), "created_unix": body.get("created_unix"),
        "world_size": body.get("world_size"), "fastckpt_version": body.get("fastckpt_version"),
        "torch_version": body.get("torch_version"),
        "files": {n: {"rank": f.get("rank"), "size": f.get("size")}
                  for n, f in sorted(body["files"].items())},
        "data_bytes": step_data_bytes(body), "tensors": tensors, "plain_values": plain,
        "plain_values_per_rank": "tree" not in body, "user_meta": body.get("user_meta", {}),
    }


# -------------------------------------------------------------------------------------- gc

@dataclass
class GcAction:
    """One step directory in a clean-up: removed whole, or kept; a kept committed step may
    still have ``leftovers`` removed (the in-flight marker of a save that committed, temporary
    files of an interrupted publish)."""
    record: StepRecord
    remove: bool
    reason: str
    done: bool = False
    skipped: str | None = None
    leftovers_removed: list = field(default_factory=list)

    @property
    def leftovers(self) -> list:
        return [] if self.remove or not self.record.committed else list(self.record.leftovers)

    def to_json(self) -> dict:
        return {"step": self.record.step, "path": self.record.path, "state": self.record.state,
                "size_bytes": self.record.size_bytes, "remove": self.remove,
                "reason": self.reason, "removed": self.done, "skipped": self.skipped,
                "leftovers": self.leftovers, "leftovers_removed": self.leftovers_removed}


def _age(now: float, t: float | None) -> str:
    if t is None:
        return "?"
    s = max(0.0, now - t)
    if s < 120:
        return f"{s:.0f} s"
    if s < 7200:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h" if s < 172800 else f"{s / 86400:.0f} days"


def _busy(r: StepRecord, now: float, grace: float) -> bool:
    return r.inflight_since is not None and now - r.inflight_since < grace


def plan_gc(root: str | Storage, keep: int | None, *, grace: float = INFLIGHT_GRACE_S,
            now: float | None = None) -> list[GcAction]:
    """What ``fastckpt gc --keep N`` does: one action per step directory, ascending.

    Removed: committed steps older than the newest ``keep`` committed ones (``keep=None``: no
    committed step), and abandoned partial steps (no manifest, no in-flight marker and no file
    younger than ``grace`` seconds). Never removed: the newest committed step, a step that may
    be being written (a partial step with recent activity, or a committed step with a recent
    in-flight marker: it is being saved again), a step whose manifest is damaged (inspect it
    and remove it by hand). The committed/partial rules are the engine's
    (:func:`fastckpt.retention.plan_removal`); this adds the file-age, re-save and
    damaged-manifest protections.
    """
    if keep is not None and keep < 1:
        raise ValueError("keep must be >= 1")
    storage = as_storage(root)
    now = time.time() if now is None else now
    recs = describe_steps(storage, grace=grace, now=now)
    eligible = [r for r in recs if r.state in ("committed", "partial")]
    infos = [StepInfo(r.step, r._dir, r.committed, r.inflight_since) for r in eligible]
    # a committed step being saved again (a job that went back to an earlier step)
    resaving = {r.step for r in eligible if r.committed and _busy(r, now, grace)}
    doomed = {i.step for i in plan_removal(infos, keep, now=now, protect=resaving)}
    actions = []
    for r in recs:
        if r.step in resaving and not r.latest:
            actions.append(GcAction(r, False, "a new save of this step is in flight (marker "
                                    f"{_age(now, r.inflight_since)} old)"))
        elif r.step in doomed and r.state in ("committed", "partial"):
            why = (f"older than the newest {keep} committed step(s)" if r.committed
                   else "abandoned partial save (no manifest, nothing written for "
                        f"{_age(now, r.modified_unix)})")
            actions.append(GcAction(r, True, why))
        elif r.latest:
            actions.append(GcAction(r, False, "newest committed step"))
        elif r.committed:
            actions.append(GcAction(r, False, f"within the newest {keep} committed"
                                    if keep else "committed (no --keep given)"))
        elif r.state == "writing":
            since = r.inflight_since if r.inflight_since else r.modified_unix
            actions.append(GcAction(r, False, f"may be being written (activity {_age(now, since)}"
                                    " ago)"))
        elif r.state == "corrupt":
            actions.append(GcAction(r, False, "manifest is damaged: inspect and remove by hand"))
        else:
            actions.append(GcAction(r, False, "kept"))
    return actions


def run_gc(root: str | Storage, actions: list[GcAction], *, grace: float = INFLIGHT_GRACE_S,
           progress: Callable[[GcAction], None] | None = None) -> list[GcAction]:
    """Remove the steps ``plan_gc`` marked, re-checking each one just before (a step whose state
    changed or where a save started since the plan is left alone). Removal deletes the
    manifest first."""
    storage = as_storage(root)
    for a in actions:
        if not a.remove:
            if a.leftovers:
                fresh = _describe_one(storage, a.record.step, a.record._dir, time.time(), grace)
                if fresh.committed and fresh.save_id == a.record.save_id:
                    for n in sorted(set(a.leftovers) & set(fresh.leftovers)):
                        storage.remove(f"{a.record._dir}/{n}")
                        a.leftovers_removed.append(n)
            continue
        now = time.time()
        fresh = _describe_one(storage, a.record.step, a.record._dir, now, grace)
        if fresh.state != a.record.state or _busy(fresh, now, grace) or (
                fresh.committed and fresh.save_id != a.record.save_id):
            a.skipped = (f"state changed to {fresh.state} since the plan"
                         if fresh.state != a.record.state else "a save started since the plan")
            if progress:
                progress(a)
            continue
        remove_step(storage, a.record._dir)
        a.done = True
        if progress:
            progress(a)
    return actions


def stale_uploads(root: str | Storage, *, grace: float = INFLIGHT_GRACE_S,
                  now: float | None = None) -> list[dict]:
    """Unfinished multipart uploads under the root (object stores) begun more than ``grace``
    seconds ago: a save that was killed, or whose abort failed because the store stopped
    answering (the engine logs those and says "fastckpt gc aborts it"). Each is
    ``{"url", "key", "upload_id", "initiated_unix"}``; younger ones may be a save in flight."""
    storage = as_storage(root)
    now = time.time() if now is None else now
    return [u for u in storage.incomplete_uploads()
            if now - float(u.get("initiated_unix") or 0.0) >= grace]


def abort_uploads(root: str | Storage, uploads: list[dict]) -> list[dict]:
    """Abort the given unfinished uploads (from :func:`stale_uploads`); the ones aborted."""
    storage = as_storage(root)
    done = []
    for u in uploads:
        storage.abort_upload(u)
        done.append(u)
    return done


def not_found_hint(storage: Storage) -> str:
    """Why there is no committed step, for an error message."""
    try:
        recs = describe_steps(storage)
    except StorageError:
        return ""
    if not recs:
        if storage.is_local and not os.path.exists(storage.root):
            return "the root does not exist yet"
        return "no step directories"
    states: dict[str, int] = {}
    for r in recs:
        states[r.state] = states.get(r.state, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(states.items()))

