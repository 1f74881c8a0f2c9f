"""Local file systems: direct I/O shard writes, fsync, atomic rename commit."""

from __future__ import annotations

import os
import shutil
import uuid
from typing import Sequence

from .. import _native
from .base import Storage, storage_error


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(Storage):
    commit_strategy = "rename"

    def __init__(self, root: str, *, io_mode: str = "auto", direct_io: bool = True) -> None:
        super().__init__(os.path.abspath(os.path.expanduser(root)))
        self.io = _native.get_backend(io_mode)
        self.direct_io = direct_io

    @property
    def is_local(self) -> bool:
        return True

    def makedirs(self, path: str) -> None:
        if os.path.isdir(path):
            return
        try:
            os.makedirs(path, exist_ok=True)
            _fsync_dir(os.path.dirname(path.rstrip("/")) or "/")
        except OSError as e:
            raise storage_error(e, "creating the directory", path) from e

    def listdir(self, path: str) -> list[str]:
        try:
            return sorted(os.listdir(path))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise storage_error(e, "listing", path) from e

    def read_bytes(self, path: str) -> bytes:
        try:
            with open(path, "rb") as f:
                return f.read()
        except OSError as e:
            raise storage_error(e, "reading", path) from e

    def size(self, path: str) -> int | None:
        try:
            return os.stat(path).st_size
        except FileNotFoundError:
            return None
        except OSError as e:
            raise storage_error(e, "stat", path) from e

    def write_shard(self, path: str, buf, nbytes: int, ranges: Sequence[tuple[int, int]], *,
                    hashes: Sequence[int] | None = None, whole: bool = True,
                    sync_dir: bool = True) -> tuple[int | None, list[int]]:
        if hashes is not None and len(hashes) != len(ranges):
            raise ValueError(f"{len(hashes)} hashes given for {len(ranges)} ranges")
        try:
            fh, rh = self.io.write_file(path, buf, nbytes, [] if hashes is not None else ranges,
                                        direct=self.direct_io, fsync=True, whole=whole)
            if sync_dir:
                _fsync_dir(os.path.dirname(path))
            return fh, list(hashes) if hashes is not None else rh
        except OSError as e:
            raise storage_error(e, "writing the shard", path) from e

    gathered_writes = True

    def write_gathered(self, path: str, nbytes: int, segments, hash_ranges) -> list[int]:
        try:
            return self.io.write_segments(path, nbytes, segments, hash_ranges,
                                          direct=self.direct_io, fsync=True)
        except OSError as e:
            raise storage_error(e, "writing the shard", path) from e

    def sync_dir(self, path: str) -> None:
        try:
            _fsync_dir(path)
        except OSError as e:
            raise storage_error(e, "syncing the directory", path) from e

    def read_into(self, path: str, offset: int, buf, nbytes: int, *,
                  hash: bool = True) -> int | None:
        try:
            return self.io.read_into(path, offset, buf, nbytes, direct=self.direct_io, hash=hash)
        except (OSError, EOFError) as e:
            raise storage_error(e, "reading", path, offset=offset) from e

    def publish(self, path: str, data: bytes, *, durable: bool = True) -> None:
        d = os.path.dirname(path)
        tmp = os.path.join(d, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            if durable:
                _fsync_dir(d)
        except OSError as e:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise storage_error(e, "publishing", path) from e

    def remove(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error(e, "removing", path) from e

    def remove_dir(self, path: str) -> None:
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error(e, "removing", path) from e
