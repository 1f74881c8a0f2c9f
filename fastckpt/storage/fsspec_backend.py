"""Any fsspec file system (s3fs, gcsfs, memory, ...): streamed shard writes, single-PUT commit.

Object stores have no rename; a single PUT of a small object is atomic (readers see the whole
old object or the whole new one), so the manifest is published with one ``pipe_file`` call.

A shard upload that fails is *discarded*, never closed: closing an fsspec file after an error
commits the partial object (s3fs completes the multipart upload with the parts sent so far).
For buffered uploads (s3fs, gcsfs, ...: ``AbstractBufferedFile``) ``discard()`` aborts the
multipart/resumable upload and the file is marked closed so that its finaliser cannot commit
either; nothing becomes visible. File systems that write in place (``memory://``) have already
made the partial object visible, so it is removed. This holds for ``BaseException`` too
(KeyboardInterrupt, SystemExit from a preemption handler), which is re-raised unchanged.
"""

from __future__ import annotations

from typing import Sequence

import xxhash

from .. import _native
from .base import Storage, storage_error

_CHUNK = 16 << 20  # upload part size / write piece (s3 parts must be >= 5 MiB)
#: reads of more than 2 pieces are split into ranged GETs fetched concurrently (on async file
#: systems: s3fs, gcsfs); smaller reads are one request
_READ_PIECE = 32 << 20

#: protocols whose "directories" are key prefixes: makedirs is a no-op there (s3fs would
#: otherwise probe, and try to create, the bucket on every call)
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss",
                            "r2", "tos", "cos", "obs"})


class FsspecStorage(Storage):
    commit_strategy = "put"

    def __init__(self, url: str, *, io_mode: str = "auto", storage_options: dict) -> None:
        try:
            import fsspec
            fs, path = fsspec.core.url_to_fs(url, **storage_options)
        except ImportError as e:
            scheme = url.split("://", 1)[0]
            hint = {"s3": "pip install 'fastckpt[s3]'"}.get(scheme, f"install the fsspec "
                                                                    f"backend for {scheme}://")
            raise ImportError(f"cannot open {url}: {e}. {hint}") from e
        self.fs = fs
        self.protocol = url.split("://", 1)[0]
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.flat_namespace = bool(_OBJECT_STORES.intersection(protocols))
        self.io = _native.get_backend(io_mode)
        super().__init__(path)
        self.url = url

    def display(self, path: str) -> str:
        return f"{self.protocol}://{path}"

    def makedirs(self, path: str) -> None:
        if self.flat_namespace:
            return
        try:
            self.fs.makedirs(path, exist_ok=True)
        except FileExistsError:
            pass
        except Exception as e:
            raise storage_error(e, "creating the directory", self.display(path)) from e

    def listdir(self, path: str) -> list[str]:
        try:
            self.fs.invalidate_cache(path)
            names = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise storage_error(e, "listing", self.display(path)) from e
        return sorted({n.rstrip("/").rsplit("/", 1)[-1] for n in names})

    def read_bytes(self, path: str) -> bytes:
        try:
            return self.fs.cat_file(path)
        except Exception as e:
            raise storage_error(e, "reading", self.display(path)) from e

    def size(self, path: str) -> int | None:
        try:
            self.fs.invalidate_cache(path)
            return int(self.fs.info(path)["size"])
        except FileNotFoundError:
            return None
        except Exception as e:
            raise storage_error(e, "stat", self.display(path)) from e

    def write_shard(self, path: str, buf, nbytes: int, ranges: Sequence[tuple[int, int]], *,
                    hashes: Sequence[int] | None = None, whole: bool = True,
                    sync_dir: bool = True) -> tuple[int | None, list[int]]:
        mv = memoryview(buf).cast("B")[:nbytes]
        if len(mv) != nbytes:
            raise ValueError(f"buffer holds {len(mv)} bytes, asked to write {nbytes}")
        if hashes is not None and len(hashes) != len(ranges):
            raise ValueError(f"{len(hashes)} hashes given for {len(ranges)} ranges")
        h = xxhash.xxh3_64() if whole else None
        f = None
        pos = 0
        try:
            f = self.fs.open(path, "wb", block_size=_CHUNK)
            while pos < nbytes:
                piece = mv[pos:pos + _CHUNK]
                if h is not None:
                    h.update(piece)
                f.write(piece)
                pos += len(piece)
            f.close()  # the commit: completes the multipart upload / PUTs a small object
        except BaseException as e:
            if f is not None:
                self._abandon(f, path)
            if not isinstance(e, Exception):
                raise
            raise storage_error(e, "writing the shard", self.display(path), offset=pos) from e
        if hashes is None:
            hashes = [self.io.hash(mv[o:o + n], n) for o, n in ranges]
        return (h.intdigest() if h is not None else None), list(hashes)

    def _abandon(self, f, path: str) -> None:
        """Throw away a failed upload without committing it (see the module docstring)."""
        from fsspec.spec import AbstractBufferedFile
        if isinstance(f, AbstractBufferedFile):
            try:
                f.discard()  # s3fs: abort the multipart upload
            except Exception:
                pass
            f.closed = True  # close() -- and so __del__ -- would commit what was written
            return
        try:
            f.close()
        except Exception:
            pass
        try:  # written in place: the partial object is visible, remove it
            self.fs.rm_file(path)
        except Exception:
            pass

    def read_into(self, path: str, offset: int, buf, nbytes: int, *,
                  hash: bool = True) -> int | None:
        out = memoryview(buf).cast("B")
        if len(out) < nbytes:
            raise ValueError(f"buffer holds {len(out)} bytes, asked to read {nbytes}")
        if nbytes == 0:
            if self.size(path) is None:
                raise storage_error(FileNotFoundError(2, "no such object"), "reading",
                                    self.display(path), offset=offset)
            return xxhash.xxh3_64_intdigest(b"") if hash else None
        piece = _READ_PIECE if nbytes > 2 * _READ_PIECE else nbytes
        starts = list(range(offset, offset + nbytes, piece))
        ends = [min(s + piece, offset + nbytes) for s in starts]
        try:
            if len(starts) == 1:
                pieces = [self.fs.cat_file(path, start=offset, end=offset + nbytes)]
            else:
                pieces = self.fs.cat_ranges([path] * len(starts), starts, ends)
            for p in pieces:
                if isinstance(p, BaseException):
                    raise p
        except Exception as e:
            raise storage_error(e, "reading", self.display(path), offset=offset) from e
        h = xxhash.xxh3_64() if hash else None
        pos = 0
        for s, e, p in zip(starts, ends, pieces):
            if len(p) != e - s:
                got = pos + len(p)
                raise storage_error(EOFError(f"expected {nbytes} bytes, got {got} (the object "
                                             "ends early)"), "reading", self.display(path),
                                    offset=offset)
            out[pos:pos + len(p)] = p
            if h is not None:
                h.update(p)
            pos += len(p)
        return h.intdigest() if h is not None else None

    def publish(self, path: str, data: bytes, *, durable: bool = True) -> None:
        try:  # one PUT: atomic, and durable when it returns
            self.fs.pipe_file(path, bytes(data))
        except Exception as e:
            raise storage_error(e, "publishing", self.display(path)) from e

    def remove(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise storage_error(e, "removing", self.display(path)) from e
        finally:
            self.fs.invalidate_cache(path)

    def remove_dir(self, path: str) -> None:
        try:
            # another process may have written under path since this one last listed it
            self.fs.invalidate_cache(path)
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise storage_error(e, "removing", self.display(path)) from e
        finally:
            self.fs.invalidate_cache(path)
