"""Storage backends: where shard files and manifests live.

The surface is deliberately small (see :class:`Storage`); the commit protocol, retention and
the CLI are written once against it. ``open_storage`` picks the backend from the root: a plain
path or ``file://`` URL gets :class:`LocalStorage` (direct I/O, fsync, atomic rename); any other
fsspec URL (``s3://``, ``memory://``, ...) gets :class:`FsspecStorage` (single-PUT commit),
imported lazily with an install hint when its package is missing.
"""

from __future__ import annotations

from .base import Storage
from .local import LocalStorage

__all__ = ["Storage", "LocalStorage", "open_storage"]


def open_storage(root: str, *, io_mode: str = "auto", direct_io: bool = True,
                 storage_options: dict | None = None) -> Storage:
    root = str(root)
    if "://" not in root or root.startswith("file://"):
        path = root[len("file://"):] if root.startswith("file://") else root
        return LocalStorage(path, io_mode=io_mode, direct_io=direct_io)
    from .fsspec_backend import FsspecStorage
    return FsspecStorage(root, io_mode=io_mode, storage_options=storage_options or {})
