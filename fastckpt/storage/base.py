"""The storage interface every backend implements."""

from __future__ import annotations

import abc
import errno
from typing import Sequence

from ..errors import StorageError, StorageTimeoutError

_HINTS = {
    errno.ENOSPC: "the device is full: free space or point the checkpoint root elsewhere",
    errno.EDQUOT: "the disk quota is exhausted",
    errno.EACCES: "permission denied: check the root's ownership and mode",
    errno.EPERM: "operation not permitted: check the root's ownership and mode",
    errno.EROFS: "the file system is read-only",
    errno.ENOENT: "no such file or directory",
}


def storage_error(e: BaseException, what: str, path: str, *, offset: int | None = None,
                  rank: int | None = None, note: str | None = None) -> StorageError:
    """Translate an OS/provider error into a StorageError that names the file and says why;
    ``note``: what the failure left behind, appended to the message."""
    code = getattr(e, "errno", None)
    hint = _HINTS.get(code, str(e)) if code is not None else str(e)
    cls = StorageTimeoutError if isinstance(e, TimeoutError) else StorageError
    err = cls(f"{what} failed: {hint}" + (f"; {note}" if note else ""), file=path,
              offset=offset, rank=rank)
    err.errno = code  # type: ignore[misc]
    return err


class ConditionFailed(StorageError):
    """A conditional write found the object not as required (put-if-absent over an existing
    object, If-Match over a changed one): someone else wrote it meanwhile."""


class Storage(abc.ABC):
    """A checkpoint root. Paths passed to the methods are absolute within the backend.

    Thread-safety: instances may be used from the training thread and the background writer
    at the same time; no method keeps per-call state on the instance.
    """

    def __init__(self, root: str) -> None:
        self.root = root.rstrip("/") or "/"

    def join(self, *parts: str) -> str:
        return "/".join([self.root, *parts])

    @property
    def is_local(self) -> bool:
        return False

    def bounded(self, deadline: float | None) -> "Storage":
        """A view of this storage whose calls finish, or raise StorageError, by ``deadline``
        (a ``time.monotonic()`` value; None: no deadline beyond the backend's own per-call
        bounds). The view shares everything else with this storage; making one is cheap.

        This base returns ``self``: a local disk's blocking system calls cannot be interrupted,
        so local calls are not bounded by a deadline. Remote backends override it.
        """
        return self

    def run(self, what: str, fn, *args, path: str | None = None):
        """``fn(*args)`` (calls on this storage) as one bounded call where a backend bounds its
        calls by handing them to threads (LocalStorage); this base calls it in place."""
        return fn(*args)

    def per_call(self, seconds: float) -> "Storage":
        """A view of this storage whose metadata calls each end, or raise StorageError, within
        ``seconds`` (a load's: it has no overall deadline). This base returns ``self``: remote
        backends bound every call already (``op_timeout_s``). LocalStorage overrides it."""
        return self

    def incomplete_uploads(self) -> list[dict]:
        """Uploads begun under the root and neither completed nor aborted (object stores'
        multipart uploads), for ``fastckpt gc``: each a dict with at least ``url`` and
        ``upload_id``. This base has none: ``[]``."""
        return []

    def abort_upload(self, upload: dict) -> None:
        """Abort one entry of :meth:`incomplete_uploads`; one already gone is fine. This base
        has no uploads: a no-op."""

    @abc.abstractmethod
    def makedirs(self, path: str) -> None:
        """Create a directory (and parents) durably; no-op on object stores."""

    @abc.abstractmethod
    def listdir(self, path: str) -> list[str]:
        """Base names of the entries of ``path``; ``[]`` when it does not exist."""

    def subdirs(self, path: str) -> list[str]:
        """Base names of the directories in ``path`` (step directories). This base: every
        entry (an object store's prefixes); LocalStorage leaves files and links out."""
        return self.listdir(path)

    def sizes(self, path: str) -> dict[str, int | None]:
        """Base name -> size in bytes of the entries of ``path`` (``{}`` when it does not
        exist), in one listing where the store gives sizes with it (local, S3, fsspec);
        here, one ``size`` per entry."""
        return {n: self.size(f"{path.rstrip('/')}/{n}") for n in self.listdir(path)}

    @abc.abstractmethod
    def read_bytes(self, path: str) -> bytes:
        """Read a whole (small) file."""

    @abc.abstractmethod
    def size(self, path: str) -> int | None:
        """Size in bytes, or None when the file does not exist."""

    @abc.abstractmethod
    def write_shard(self, path: str, buf, nbytes: int, ranges: Sequence[tuple[int, int]], *,
                    hashes: Sequence[int] | None = None, sync_dir: bool = True) -> list[int]:
        """Write ``buf[:nbytes]`` durably to ``path``; return the xxh3-64 of each range.

        ``hashes``: the ranges' hashes, already computed (staging fuses them into its copy), so
        the bytes are not read again. ``sync_dir=False``: the file is durable but its directory
        entry is not, until :meth:`sync_dir`.
        """

    #: whether :meth:`write_gathered` is available (zero-copy saves)
    gathered_writes = False

    def write_gathered(self, path: str, nbytes: int, segments, hash_ranges) -> list[int]:
        """Write a shard gathered from memory (see ``IOBackend.write_segments``), durably
        except for its directory entry (:meth:`sync_dir`); the hashes of ``hash_ranges``."""
        raise NotImplementedError(f"{type(self).__name__} has no gathered writes")

    def sync_dir(self, path: str) -> None:
        """Make the entries of the files written in directory ``path`` durable (no-op where
        writes are durable on return, as on object stores)."""

    @abc.abstractmethod
    def read_into(self, path: str, offset: int, buf, nbytes: int, *,
                  hash: bool = True, direct: bool | None = None) -> int | None:
        """Read ``nbytes`` at ``offset`` into ``buf``; return the xxh3-64 hash of them (None
        with ``hash=False``: the caller checks smaller ranges itself). ``direct``: bypass the
        page cache (local files; None: the storage's setting), see :meth:`cached`."""

    def cached(self, path: str) -> bool:
        """Whether ``path`` looks resident in the page cache (local files: probed without
        blocking); reads of cached data are faster through the cache than around it."""
        return False

    def conditional_writes(self) -> bool:
        """Whether :meth:`put_conditional` is available (object stores that honour
        ``If-None-Match`` / ``If-Match``). This base: False."""
        return False

    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        """(content, version tag) of a small object, None when missing (conditional stores)."""
        raise NotImplementedError(f"{type(self).__name__} has no conditional writes")

    def put_conditional(self, path: str, data: bytes, *, if_absent: bool = False,
                        if_match: str | None = None) -> str:
        """Put ``data`` only if no object is there (``if_absent``) or only over the version
        ``if_match``; its new version tag. :class:`ConditionFailed` otherwise."""
        raise NotImplementedError(f"{type(self).__name__} has no conditional writes")

    #: shard files one rank writes at once; object stores with concurrent parts raise it
    write_streams = 2
    #: spans one rank's reader fetches at once
    read_streams = 2

    def publish_manifest(self, path: str, data: bytes) -> None:
        """Publish a step's manifest: the commit point. This base: :meth:`publish`. Object
        stores that can put conditionally never overwrite a manifest unseen (see
        ``fastckpt.storage.s3``)."""
        self.publish(path, data)

    @abc.abstractmethod
    def publish(self, path: str, data: bytes, *, durable: bool = True) -> None:
        """Make ``data`` appear at ``path`` atomically and durably (the commit point).
        ``durable=False`` (hints nobody relies on, like ``latest``): atomic, not synced."""

    @abc.abstractmethod
    def remove(self, path: str) -> None:
        """Remove one file; missing is fine."""

    @abc.abstractmethod
    def remove_dir(self, path: str) -> None:
        """Remove a directory and everything under it; missing is fine."""

    def check_writable(self) -> None:
        """Raise StorageError early when the root cannot be written."""
        probe = self.join(".fastckpt-write-probe")
        try:
            self.makedirs(self.root)
            self.publish(probe, b"ok")
            self.remove(probe)
        except StorageError:
            raise
        except Exception as e:
            raise storage_error(e, "writing to the checkpoint root", self.root) from e
