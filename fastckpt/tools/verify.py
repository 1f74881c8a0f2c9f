"""``fastckpt verify``: re-read every shard of a committed step and check it. Torch-free.

The result is recorded in the step directory as ``.verified-<save_id>`` (clean) or
``.verify-failed-<save_id>`` (problems found); ``ls`` reads it. Keyed by the save id, a record
never vouches for a later save of the same step (which also removes it: the engine deletes
unknown files from a step directory it re-saves).
"""

from __future__ import annotations

import json
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from .. import __version__
from ..errors import (CorruptCheckpointError, StepRemovedError, StorageError,
                      StorageTimeoutError)
from ..manifest import schema as fmt
from ..manifest.discovery import find_step, read_manifest
from ..manifest.verify import Problem, ProgressFn, check_layout, verify_file
from ..storage import Storage
from ..storage.native import aligned_buffer
from .describe import VERIFIED_PREFIX, VERIFY_FAILED_PREFIX, as_storage, display_path


@dataclass
class VerifyResult:
    step: int
    path: str
    save_id: str | None
    problems: list[Problem] = field(default_factory=list)
    files_checked: int = 0
    bytes_checked: int = 0
    chunks_checked: int = 0
    frames_checked: int = 0  # compressed chunks' zstd frames decoded
    seconds: float = 0.0
    recorded: str | None = None  # the marker written, if any
    record_error: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict:
        return {"step": self.step, "path": self.path, "save_id": self.save_id, "ok": self.ok,
                "files_checked": self.files_checked, "bytes_checked": self.bytes_checked,
                "chunks_checked": self.chunks_checked, "frames_checked": self.frames_checked,
                "seconds": round(self.seconds, 3), "notes": self.notes,
                "recorded": self.recorded, "record_error": self.record_error,
                "problems": [p.to_json() for p in self.problems]}


def verify_step(root: str | Storage, step: int | None = None, *, jobs: int = 4,
                block_size: int = 32 << 20, progress: ProgressFn | None = None,
                record: bool = True, found: tuple[int, str, dict] | None = None) -> VerifyResult:
    """Re-read every shard file of a committed step (default: the newest) and check it.

    Checks the manifest's internal consistency, each file's presence and size, every chunk's
    xxh3-64 checksum, that alignment padding is zero (together: every byte of every file), that
    every zstd frame of a compressed chunk decodes to the bytes its place holds (the checksum
    covers the stored bytes; without the ``zstandard`` package the frames are not decoded and
    ``notes`` says so), and a whole-file checksum where the manifest has one (saves before
    0.1.1 wrote it). Returns a
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
    if found is not None and any("chunks" not in t for t in found[2].get("tensors", {}).values()):
        step, found = found[0], None  # a body without its indexes' chunks ("listed")
    step, d, body = found if found is not None else find_step(storage, step)
    res = VerifyResult(step=step, path=display_path(storage, d), save_id=body.get("save_id"))
    problems, by_file = check_layout(body)
    res.problems.extend(problems)
    dtypes: dict[str, str] | None = {fqn: t["dtype"] for fqn, t in body["tensors"].items()}
    if any("codec" in c for fc in by_file.values() for _, c in fc):
        import importlib.util
        if importlib.util.find_spec("zstandard") is None:
            dtypes = None
            res.notes.append("compressed chunks: checksums checked, frames not decoded (the "
                             "zstandard package is not installed: pip install "
                             "'fastckpt[zstd]')")
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
        try:
            return verify_file(storage, d, name, body["files"][name], by_file.get(name, []),
                               block_size, prog, get_buf, dtypes)
        except StorageTimeoutError:
            local.buf = None  # (the read left to its thread may still land in it)
            raise

    names = sorted(body["files"])
    workers = max(1, min(jobs, len(names)))
    if workers == 1:
        outs = [one(n) for n in names]
    else:
        ex = ThreadPoolExecutor(workers, thread_name_prefix="fastckpt-verify")
        try:  # (a storage that stops answering ends it: the files not started are not)
            outs = list(ex.map(one, names))
        finally:
            ex.shutdown(wait=True, cancel_futures=True)
    for probs, nread, nchunks, nframes in outs:
        res.problems.extend(probs)
        res.bytes_checked += nread
        res.chunks_checked += nchunks
        res.frames_checked += nframes
    res.files_checked = len(names)
    res.seconds = time.perf_counter() - t0
    # a step retired (or saved again) by its writer meanwhile is not damaged: it is gone
    # (before 2026-12-06 its vanished files were reported as damage)
    if res.problems:
        try:
            now = read_manifest(storage, d, step=step, chunks=False)
        except CorruptCheckpointError:
            now = None
        if now is None or now.get("save_id") != res.save_id:
            raise StepRemovedError(f"step {step} was removed or saved again while it was "
                                   "verified: verify again", file=d)
    reads = [p for p in res.problems if p.kind == "read"]
    if reads and len(reads) == len(res.problems):  # the storage failed, not the data
        raise StorageError(f"step {step}: {len(reads)} file(s) could not be read, nothing "
                           f"found damaged (first: {reads[0]}); nothing recorded", file=d)
    if record and not reads:  # (a result with unread parts is not recorded)
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


