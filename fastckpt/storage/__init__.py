"""Storage backends: where shard files and manifests live.

The surface is deliberately small (see :class:`Storage`); the commit protocol, retention and
the CLI are written once against it. ``open_storage`` picks the backend from the root: a plain
path or ``file://`` URL gets :class:`LocalStorage` (direct I/O, fsync, atomic rename); any other
``s3://`` URL gets :class:`~fastckpt.storage.s3.S3Storage` (concurrent parts and ranged GETs,
conditional commit, retries), any other fsspec URL (``gs://``, ``memory://``, ...)
:class:`FsspecStorage` (single-PUT commit); both are imported lazily, with an install hint
when the file system's package is missing.
"""

from __future__ import annotations

from .base import Storage
from .local import LocalStorage

__all__ = ["Storage", "LocalStorage", "open_storage"]


def open_storage(root: str, *, io_mode: str = "auto", direct_io: bool = True,
                 storage_options: dict | None = None, remote: dict | None = None) -> Storage:
    """The backend for ``root``. ``remote``: settings of the s3 fast path (``part_bytes``,
    ``concurrency``, ``max_attempts``, ``conditional``; see ``CheckpointOptions``)."""
    root = str(root)
    if "://" not in root or root.startswith("file://"):
        path = root[len("file://"):] if root.startswith("file://") else root
        return LocalStorage(path, io_mode=io_mode, direct_io=direct_io)
    if root.split("://", 1)[0] in ("s3", "s3a"):
        from .s3 import S3Storage
        return S3Storage(root, io_mode=io_mode, storage_options=storage_options or {},
                         **(remote or {}))
    from .fsspec_backend import FsspecStorage
    return FsspecStorage(root, io_mode=io_mode, storage_options=storage_options or {})
