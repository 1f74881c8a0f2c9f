"""Any fsspec file system (s3fs, gcsfs, memory, ...): streamed shard writes, single-PUT commit.

Object stores have no rename; a single PUT of a small object is atomic (readers see the whole
old object or the whole new one), so the manifest is published with one ``pipe_file`` call.
A shard upload that fails is discarded (multipart aborted) rather than closed, because closing
an fsspec file after an error commits the partial object.
"""

from __future__ import annotations

from typing import Sequence

import xxhash

from .. import _native
from .base import Storage, storage_error

_CHUNK = 16 << 20


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
        self.io = _native.get_backend(io_mode)
        super().__init__(path)
        self.url = url

    def display(self, path: str) -> str:
        return f"{self.protocol}://{path}"

    def makedirs(self, path: str) -> None:
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

    def write_shard(self, path: str, buf, nbytes: int,
                    ranges: Sequence[tuple[int, int]]) -> tuple[int, list[int]]:
        mv = memoryview(buf).cast("B")[:nbytes]
        h = xxhash.xxh3_64()
        f = None
        pos = 0
        try:
            f = self.fs.open(path, "wb", block_size=_CHUNK)
            while pos < nbytes:
                piece = mv[pos:pos + _CHUNK]
                h.update(piece)
                f.write(piece)
                pos += len(piece)
            f.close()
        except Exception as e:
            if f is not None and hasattr(f, "discard"):
                try:
                    f.discard()
                except Exception:
                    pass
            raise storage_error(e, "writing the shard", self.display(path), offset=pos) from e
        return h.intdigest(), [self.io.hash(mv[o:o + n], n) for o, n in ranges]

    def read_into(self, path: str, offset: int, buf, nbytes: int) -> int:
        try:
            data = self.fs.cat_file(path, start=offset, end=offset + nbytes)
        except Exception as e:
            raise storage_error(e, "reading", self.display(path), offset=offset) from e
        if len(data) != nbytes:
            raise storage_error(EOFError(f"expected {nbytes} bytes, got {len(data)}"), "reading",
                                self.display(path), offset=offset)
        memoryview(buf).cast("B")[:nbytes] = data
        return xxhash.xxh3_64_intdigest(data)

    def publish(self, path: str, data: bytes) -> None:
        try:
            self.fs.pipe_file(path, data)
        except Exception as e:
            raise storage_error(e, "publishing", self.display(path)) from e

    def remove(self, path: str) -> None:
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise storage_error(e, "removing", self.display(path)) from e

    def remove_dir(self, path: str) -> None:
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise storage_error(e, "removing", self.display(path)) from e
