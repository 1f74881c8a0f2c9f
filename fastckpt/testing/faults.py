"""Fault injection for tests, as a ``Storage`` wrapper: nothing in the engine knows about it.

``FaultyStorage(inner, kill_at=..., rank=...)`` forwards every call to ``inner`` (any backend:
local, s3, memory) and SIGKILLs the process at one point of a save, defined by the storage
calls the engine makes:

============================  ====================================================================
``before_write``              the save's step directory is made (staging done, nothing written)
``mid_shard_write``           half of the first shard file is written (durably), then the kill
``after_shard_write``         every shard file of this rank is written and its directory synced
``before_manifest``           the coordinator is about to publish the manifest
``manifest_tmp_written``      a torn temporary manifest lies next to where it goes
``after_manifest``            the manifest is published (the step is committed)
``during_retention``          retention begins (its first listing of the root after a commit)
============================  ====================================================================

``throttle_mibps``: shard writes share that bandwidth (a slow disk: two files written at once
each get half), for the preemption tests' budget decisions. ``arm(...)`` changes both later, e.g. after a first save.

    ck = fastckpt.Checkpointer(open_faulty(root, rank=0, spec="before_manifest"))

``open_faulty(root, rank=r, spec="<point>[@<rank>]")`` opens a root the way a Checkpointer does
and wraps it: test workers started as subprocesses pass the spec they were given (for example
in ``FASTCKPT_TEST_FAULT``, which only the tests' workers read).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Sequence

from ..manifest import schema as fmt
from ..storage import Storage

_KEEP = object()
POINTS = ("before_write", "mid_shard_write", "after_shard_write", "before_manifest",
          "manifest_tmp_written", "after_manifest", "during_retention")


class FaultyStorage(Storage):
    """A storage that kills the process at a chosen point, or writes slowly (see the module)."""

    def __init__(self, inner: Storage, *, kill_at: str | None = None, rank: int | None = None,
                 throttle_mibps: float | None = None) -> None:
        self.inner = inner
        self.root = inner.root
        self.kill_at: str | None = None
        self.rank = rank
        self.throttle_mibps: float | None = None
        # with the bounded views of this storage: whether a manifest was published, and when
        # the throttled "disk" is free again
        self._shared: dict = {"committed": False, "free_at": 0.0, "lock": threading.Lock()}
        self.arm(kill_at=kill_at, throttle_mibps=throttle_mibps)

    def arm(self, *, kill_at: Any = _KEEP, throttle_mibps: Any = _KEEP) -> None:
        """Change the kill point and/or the throttle (None: off; omitted: as it was)."""
        if kill_at is not _KEEP:
            if kill_at is not None and kill_at not in POINTS:
                raise ValueError(f"unknown fault point {kill_at!r}; one of {POINTS}")
            self.kill_at = kill_at
        if throttle_mibps is not _KEEP:
            self.throttle_mibps = throttle_mibps

    def _point(self, name: str) -> None:
        if self.kill_at == name:
            os.kill(os.getpid(), signal.SIGKILL)

    def _throttle(self, nbytes: int, started: float) -> None:
        """Return when a disk of ``throttle_mibps``, shared by every write, would have written
        ``nbytes`` begun at ``started``."""
        if self.throttle_mibps and nbytes:
            with self._shared["lock"]:
                begin = max(started, self._shared["free_at"])
                end = begin + nbytes / (self.throttle_mibps * (1 << 20))
                self._shared["free_at"] = end
            left = end - time.perf_counter()
            if left > 0:
                time.sleep(left)

    # -- the surface of Storage ------------------------------------------------------------------
    @property
    def is_local(self) -> bool:  # type: ignore[override]
        return self.inner.is_local

    @property
    def io(self) -> Any:
        return self.inner.io

    @property
    def gathered_writes(self) -> bool:  # type: ignore[override]
        return self.inner.gathered_writes

    def join(self, *parts: str) -> str:
        return self.inner.join(*parts)

    def bounded(self, deadline: float | None) -> "FaultyStorage":
        # (a subclass's bounded views are of the subclass: its own faults hold in them too)
        bound = type(self)(self.inner.bounded(deadline), rank=self.rank)
        bound.kill_at, bound.throttle_mibps = self.kill_at, self.throttle_mibps
        bound._shared = self._shared
        return bound

    def makedirs(self, path: str) -> None:
        if fmt.parse_step_dirname(path.rstrip("/").rsplit("/", 1)[-1]) is not None:
            self._point("before_write")
        self.inner.makedirs(path)

    def listdir(self, path: str) -> list[str]:
        if self._shared["committed"] and path.rstrip("/") == self.root.rstrip("/"):
            self._point("during_retention")
        return self.inner.listdir(path)

    def subdirs(self, path: str) -> list[str]:
        if self._shared["committed"] and path.rstrip("/") == self.root.rstrip("/"):
            self._point("during_retention")
        return self.inner.subdirs(path)

    def read_bytes(self, path: str) -> bytes:
        return self.inner.read_bytes(path)

    def size(self, path: str) -> int | None:
        return self.inner.size(path)

    def write_shard(self, path: str, buf, nbytes: int, ranges: Sequence[tuple[int, int]], *,
                    hashes: Sequence[int] | None = None, sync_dir: bool = True) -> list[int]:
        if self.kill_at == "mid_shard_write":
            self.inner.write_shard(path, buf, nbytes // 2, [], sync_dir=True)
            self._point("mid_shard_write")
        t0 = time.perf_counter()
        out = self.inner.write_shard(path, buf, nbytes, ranges, hashes=hashes, sync_dir=sync_dir)
        self._throttle(nbytes, t0)
        return out

    def write_gathered(self, path: str, nbytes: int, segments, hash_ranges) -> list[int]:
        if self.kill_at == "mid_shard_write":
            from ..storage.native import aligned_buffer
            self.inner.write_shard(path, aligned_buffer(max(nbytes // 2, 1)), nbytes // 2, [])
            self._point("mid_shard_write")
        t0 = time.perf_counter()
        out = self.inner.write_gathered(path, nbytes, segments, hash_ranges)
        self._throttle(nbytes, t0)
        return out

    def sync_dir(self, path: str) -> None:
        self.inner.sync_dir(path)
        self._point("after_shard_write")

    def read_into(self, path: str, offset: int, buf, nbytes: int, *,
                  hash: bool = True, direct: bool | None = None) -> int | None:
        return self.inner.read_into(path, offset, buf, nbytes, hash=hash, direct=direct)

    def cached(self, path: str) -> bool:
        return self.inner.cached(path)

    @property
    def write_streams(self) -> int:  # type: ignore[override]
        return self.inner.write_streams

    @property
    def read_streams(self) -> int:  # type: ignore[override]
        return self.inner.read_streams

    def publish_manifest(self, path: str, data: bytes) -> None:
        self.publish(path, data)  # (the kill points and the inner commit: see publish)

    def publish(self, path: str, data: bytes, *, durable: bool = True) -> None:
        manifest = path.endswith("/" + fmt.MANIFEST)
        if manifest:
            self._point("before_manifest")
            if self.kill_at == "manifest_tmp_written":
                d = path.rsplit("/", 1)[0]
                self.inner.publish(f"{d}/.{fmt.MANIFEST}.tmp-fault", data[: len(data) // 2])
                self._point("manifest_tmp_written")
        if manifest:  # a step's manifest is committed as the inner storage commits it
            self.inner.publish_manifest(path, data)
        else:
            self.inner.publish(path, data, durable=durable)
        if manifest:
            self._shared["committed"] = True
            self._point("after_manifest")

    def remove(self, path: str) -> None:
        self.inner.remove(path)

    def remove_dir(self, path: str) -> None:
        self.inner.remove_dir(path)

    def incomplete_uploads(self) -> list[dict]:
        return self.inner.incomplete_uploads()

    def abort_upload(self, upload: dict) -> None:
        self.inner.abort_upload(upload)

    def check_writable(self) -> None:
        self.inner.check_writable()


def kill_point(spec: str | None, rank: int) -> str | None:
    """``"<point>[@<rank>]"`` -> the point if it applies to ``rank``, else None."""
    if not spec:
        return None
    point, _, only = spec.partition("@")
    return point if not only or int(only) == rank else None


def open_faulty(root: str, *, rank: int, spec: str | None = None,
                throttle_mibps: float | None = None, **open_kw: Any) -> FaultyStorage:
    """The storage of ``root`` (opened as a Checkpointer would, with the ``FASTCKPT_*`` I/O
    options) wrapped for ``rank``: killed at ``spec`` (``"<point>[@<rank>]"``), throttled.
    Test workers pass ``spec=os.environ.get("FASTCKPT_TEST_FAULT")``."""
    from ..options import options_from_env
    from ..storage import open_storage
    opts = options_from_env()
    inner = open_storage(root, io_mode=opts.native, direct_io=opts.direct_io, **open_kw)
    return FaultyStorage(inner, kill_at=kill_point(spec, rank), rank=rank,
                         throttle_mibps=throttle_mibps)
