"""Any fsspec file system (gcsfs, adlfs, ``memory://``, ...): bounded remote calls, streamed
shard writes, single-PUT commit. ``s3://`` has its own fast path on top of this class
(:mod:`fastckpt.storage.s3`: concurrent parts and ranged GETs, conditional commit, retries).

Object stores have no rename; a single PUT of a small object is atomic (readers see the whole
old object or the whole new one), so the manifest is published with one ``pipe_file`` call.

Every remote call is bounded in time. On async file systems (s3fs, gcsfs, ...) each call runs
as a coroutine on the file system's event loop and is waited for at most ``op_timeout_s``
(data transfers: one more second per 8 MiB), or until the deadline of a
:meth:`FsspecStorage.bounded` view when that comes first; then it is cancelled (the HTTP
request is torn down, and the client's retry loop with it) and a StorageError names the
operation, the URL and the bound that passed. Synchronous file systems (``memory://``, and
networked ones: sftp, ftp, webdav, hdfs) are called on a small shared pool of threads
(:data:`SYNC_THREADS`) and waited for within the same bound; a call that does not return by
then is left to its thread (nothing can stop it) and a StorageError is raised, so a save or a
load never waits past its bound. Shard uploads go through ``fs.open``, one stream: their
requests are bounded only by their clients' own timeouts.

A shard upload that fails is *discarded*, never closed: closing an fsspec file after an error
commits the partial object (a buffered upload completes with the parts sent so far). For
buffered uploads (gcsfs, ...: ``AbstractBufferedFile``) ``discard()`` aborts the resumable /
multipart upload and the file is marked closed so that its finaliser cannot commit either;
nothing becomes visible. File systems that write in place (``memory://``) have already made
the partial object visible, so it is removed. This holds for ``BaseException`` too
(KeyboardInterrupt, SystemExit from a preemption handler), which is re-raised unchanged.
That cleanup has its own short bound (``min(10 s, op_timeout_s)``), independent of a save
deadline that may have passed already.

When fastckpt opens an s3 file system it sets the botocore timeouts and retries that
``storage_options["config_kwargs"]`` leaves out (:data:`S3_CONFIG_DEFAULTS`): s3fs's own
timeouts (a connection within 5 s, response bytes 15 s apart at most), stated so they do not
change under us, and one try per request: fastckpt's choke point
(``fastckpt.storage.s3.S3Storage._request``) retries, so no request is retried by two layers.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import errno
import logging
import re
import sys
import threading
import time
from typing import Sequence

import xxhash

from . import bounded as _bounded
from . import native as _native
from .base import Storage, storage_error
from .threads import Threads

log = logging.getLogger("fastckpt")

#: characters fsspec's rm/expand_path take as a glob pattern
_GLOB = re.compile(r"[*?\[]")
#: protocols without directories (a path's prefix is no object)
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss"})
_CHUNK = 16 << 20  # upload part size / write piece (s3 parts must be >= 5 MiB)
#: reads of more than 2 pieces are split into ranged GETs fetched concurrently (on async file
#: systems: s3fs, gcsfs); smaller reads are one request
_READ_PIECE = 32 << 20
#: the slowest transfer rate a remote call is given time for (bytes/s) on top of op_timeout_s
_MIN_RATE = _bounded.MIN_RATE
#: the longest an abort or removal after a failure may take (seconds), whatever the deadline
_CLEANUP_S = 10.0
#: threads that run the calls of synchronous file systems (shared by every root of the
#: process; a call stuck for ever holds one: the others still run, and a call that waits for
#: a free thread still ends at its bound)
SYNC_THREADS = 8
_sync_pool: list = []
_sync_lock = threading.Lock()


def _sync_threads() -> Threads:
    with _sync_lock:
        if not _sync_pool:
            _sync_pool.append(Threads(SYNC_THREADS, "fastckpt-fsspec"))
        return _sync_pool[0]

#: botocore settings fastckpt gives an s3 file system where ``config_kwargs`` does not set
#: them (see the module docstring): one try per request, fastckpt retries
S3_CONFIG_DEFAULTS = {"connect_timeout": 5, "read_timeout": 15,
                      "retries": {"total_max_attempts": 1, "mode": "standard"},
                      # no CRC32 of every part on the event loop's thread (botocore >= 1.36
                      # computes one by default; S3-compatible stores that predate it refuse
                      # its trailers): fastckpt's own xxh3 checksums are checked on every load
                      "request_checksum_calculation": "when_required",
                      "response_checksum_validation": "when_required"}

#: protocols whose "directories" are key prefixes: makedirs is a no-op there (s3fs would
#: otherwise probe, and try to create, the bucket on every call)
_OBJECT_STORES = frozenset({"s3", "s3a", "gs", "gcs", "az", "abfs", "abfss", "adl", "oss",
                            "r2", "tos", "cos", "obs"})


def _with_s3_defaults(storage_options: dict) -> dict:
    config = dict(storage_options.get("config_kwargs") or {})
    for k, v in S3_CONFIG_DEFAULTS.items():
        config.setdefault(k, copy.deepcopy(v))
    return {**storage_options, "config_kwargs": config}


def _is_s3fs(fs) -> bool:
    s3fs = sys.modules.get("s3fs")  # an S3FileSystem means s3fs is imported already
    return s3fs is not None and isinstance(fs, s3fs.S3FileSystem)


class FsspecStorage(Storage):
    """A checkpoint root on an fsspec file system; see the module docstring for the bounds.

    ``op_timeout_s``: the longest one remote call may take (data transfers get one more second
    per 8 MiB). Thread-safe like every :class:`Storage`; views made by :meth:`bounded` share
    the file system and :attr:`unaborted` with it.
    """


    def __init__(self, url: str, *, io_mode: str = "auto", storage_options: dict,
                 op_timeout_s: float = 120.0) -> None:
        if not op_timeout_s > 0:
            raise ValueError(f"op_timeout_s must be a positive number of seconds, got "
                             f"{op_timeout_s!r}")
        scheme = url.split("://", 1)[0]
        if scheme in ("s3", "s3a"):
            storage_options = _with_s3_defaults(storage_options)
        try:
            import fsspec
            fs, path = fsspec.core.url_to_fs(url, **storage_options)
        except ImportError as e:
            hint = {"s3": "pip install 'fastckpt[s3]'"}.get(scheme, f"install the fsspec "
                                                                    f"backend for {scheme}://")
            raise ImportError(f"cannot open {url}: {e}. {hint}") from e
        self.fs = fs
        self.protocol = scheme
        protocols = fs.protocol if isinstance(fs.protocol, (tuple, list)) else (fs.protocol,)
        self.flat_namespace = bool(_OBJECT_STORES.intersection(protocols))
        self.io = _native.get_backend(io_mode)
        super().__init__(path)
        self.url = url
        self.op_timeout_s = float(op_timeout_s)
        #: the ``time.monotonic()`` deadline of this view (None: per-call bounds only)
        self.deadline: float | None = None
        #: multipart uploads a failed shard write could not abort, shared with every view:
        #: ``{"url", "upload_id", "when_unix"}`` each; ``upload_id`` None when the request that
        #: begins the upload got no answer (the endpoint may or may not have begun one)
        self.unaborted: list[dict] = []
        self._async = bool(getattr(fs, "async_impl", False))
        if not self._async:  # (its threads start here, never at exit: see threads.py)
            _sync_threads()
        self._s3 = _is_s3fs(fs)

    def bounded(self, deadline: float | None) -> "FsspecStorage":
        """A view whose every remote call finishes or raises StorageError by ``deadline``
        (``time.monotonic()``; None: the per-call bound only). Cleanup after a failure gets its
        own short bound past the deadline (see the module docstring)."""
        view = copy.copy(self)
        view.deadline = deadline
        return view

    def display(self, path: str) -> str:
        return f"{self.protocol}://{path}"

    # -- bounded remote calls ------------------------------------------------------------------
    @property
    def _cleanup_s(self) -> float:
        return min(_CLEANUP_S, self.op_timeout_s)

    def _bound(self, op: str, nbytes: int = 0, timeout: float | None = None
               ) -> tuple[float, str | None]:
        """(seconds, which bound) for one call: ``timeout`` (a fixed bound: cleanup), else the
        per-call bound or what is left of the deadline, whichever is sooner (bound None)."""
        if timeout is not None:
            return timeout, "the cleanup bound"
        timeout = self.op_timeout_s + nbytes / _MIN_RATE
        bound: str | None = (f"the per-call bound: op_timeout_s={self.op_timeout_s:g}"
                             + (" and time for the bytes" if nbytes else ""))
        left = None if self.deadline is None else self.deadline - time.monotonic()
        if left is not None and left < timeout:
            if left <= 0:
                raise TimeoutError(f"the save deadline passed before {op} was sent")
            timeout, bound = left, None  # None: the deadline
        return timeout, bound

    @staticmethod
    def _wait(op, fut, timeout: float, bound: str | None):
        """The result of ``fut`` within ``timeout``, else cancel it and raise TimeoutError
        saying which bound passed (``op``: the call's name, or a callable that says which
        request was under way)."""
        try:
            done, _ = concurrent.futures.wait([fut], timeout=timeout)
        except BaseException:
            fut.cancel()
            raise
        if not done:
            fut.cancel()  # tears the request down; no retry loop keeps running
            name = op() if callable(op) else op
            if bound is None:
                raise TimeoutError(f"the save deadline passed: no answer to {name} within the "
                                   f"{timeout:.1f} s left")
            raise TimeoutError(f"no answer to {name} within {timeout:.1f} s ({bound})")
        return fut.result()

    def _run(self, op: str, fn, *args, nbytes: int = 0, timeout: float | None = None, **kw):
        """``await fn(*args, **kw)`` on the file system's loop within the bound, else cancel it
        and raise TimeoutError saying which bound passed. ``timeout``: a fixed bound instead of
        the per-call one and the deadline (cleanup)."""
        timeout, bound = self._bound(op, nbytes, timeout)
        fut = asyncio.run_coroutine_threadsafe(fn(*args, **kw), self.fs.loop)
        return self._wait(op, fut, timeout, bound)

    def _call(self, name: str, *args, nbytes: int = 0, timeout: float | None = None, **kw):
        """``fs.<name>(*args, **kw)`` within the bound: a coroutine on an async file system's
        loop, a call on a pool thread of a synchronous one."""
        if not self._async:
            bound_s, bound = self._bound(name, nbytes, timeout)
            fut = _sync_threads().submit(getattr(self.fs, name), *args, **kw)
            return self._wait(name, fut, bound_s, bound)
        return self._run(name, getattr(self.fs, "_" + name), *args, nbytes=nbytes,
                         timeout=timeout, **kw)

    # -- Storage -------------------------------------------------------------------------------
    def makedirs(self, path: str) -> None:
        if self.flat_namespace:
            return
        try:
            self._call("makedirs", path, exist_ok=True)
        except FileExistsError:
            pass
        except Exception as e:
            raise storage_error(e, "creating the directory", self.display(path)) from e

    def listdir(self, path: str) -> list[str]:
        try:
            self.fs.invalidate_cache(path)
            names = self._call("ls", path, detail=False)
        except FileNotFoundError:
            return []
        except Exception as e:
            raise storage_error(e, "listing", self.display(path)) from e
        return sorted({n.rstrip("/").rsplit("/", 1)[-1] for n in names})

    def sizes(self, path: str) -> dict[str, int | None]:
        try:
            self.fs.invalidate_cache(path)
            infos = self._call("ls", path, detail=True)
        except FileNotFoundError:
            return {}
        except Exception as e:
            raise storage_error(e, "listing", self.display(path)) from e
        return {str(i.get("name", "")).rstrip("/").rsplit("/", 1)[-1]: (
            None if i.get("type") == "directory" or i.get("size") is None else int(i["size"]))
            for i in infos}

    def read_bytes(self, path: str) -> bytes:
        try:
            return self._call("cat_file", path)
        except Exception as e:
            raise storage_error(e, "reading", self.display(path)) from e

    def size(self, path: str) -> int | None:
        try:
            self.fs.invalidate_cache(path)
            return int(self._call("info", path)["size"])
        except FileNotFoundError:
            return None
        except Exception as e:
            raise storage_error(e, "stat", self.display(path)) from e

    def write_shard(self, path: str, buf, nbytes: int, ranges: Sequence[tuple[int, int]], *,
                    hashes: Sequence[int] | None = None, sync_dir: bool = True) -> list[int]:
        mv = memoryview(buf).cast("B")[:nbytes]
        if len(mv) != nbytes:
            raise ValueError(f"buffer holds {len(mv)} bytes, asked to write {nbytes}")
        if hashes is not None and len(hashes) != len(ranges):
            raise ValueError(f"{len(hashes)} hashes given for {len(ranges)} ranges")
        f = None
        pos = 0
        try:
            f = self.fs.open(path, "wb", block_size=_CHUNK)
            while pos < nbytes:
                piece = mv[pos:pos + _CHUNK]
                f.write(piece)
                pos += len(piece)
            f.close()  # the commit: completes the multipart upload / PUTs a small object
        except BaseException as e:
            note = self._abandon(f, path) if f is not None else None
            if not isinstance(e, Exception):
                raise
            raise storage_error(e, "writing the shard", self.display(path), offset=pos,
                                note=note) from e
        if hashes is None:
            hashes = [self.io.hash(mv[o:o + n], n) for o, n in ranges]
        return list(hashes)

    def _abandon(self, f, path: str) -> str | None:
        """Throw away a failed upload without committing it (see the module docstring); return
        a note on what could not be cleaned up, for the error message."""
        from fsspec.spec import AbstractBufferedFile
        if isinstance(f, AbstractBufferedFile):
            try:
                f.discard()  # abort the multipart / resumable upload
            except Exception:
                pass
            f.closed = True  # close() -- and so __del__ -- would commit what was written
            return None
        try:
            f.close()
        except Exception:
            pass
        try:  # written in place: the partial object is visible, remove it
            self._call("rm_file", path, timeout=self._cleanup_s)
        except Exception:
            pass
        return None

    def read_into(self, path: str, offset: int, buf, nbytes: int, *,
                  hash: bool = True, direct: bool | None = None) -> int | None:
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
                pieces = [self._call("cat_file", path, start=offset, end=offset + nbytes,
                                     nbytes=nbytes)]
            else:
                pieces = self._call("cat_ranges", [path] * len(starts), starts, ends,
                                    nbytes=nbytes)
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
            self._call("pipe_file", path, bytes(data), nbytes=len(data))
        except Exception as e:
            raise storage_error(e, "publishing", self.display(path)) from e

    def _remove_literal(self, path: str) -> None:
        """``path`` and everything under it, each name taken literally (no glob expansion):
        files one call each, then the directories where the backend has them."""
        found = self._call("find", path, withdirs=True, detail=True)
        dirs = [p for p, i in found.items() if i.get("type") == "directory"]
        for p in sorted(set(found) - set(dirs)):
            self._call("rm_file", p)
        protocols = self.fs.protocol if isinstance(self.fs.protocol, tuple) else (
            self.fs.protocol,)
        if _OBJECT_STORES.intersection(protocols):
            return  # (no directories there; rmdir would name a bucket)
        for p in sorted(dirs, key=len, reverse=True) + [path]:
            try:
                self._call("rmdir", p)
            except (FileNotFoundError, NotImplementedError):
                pass
            except OSError as e:  # (not empty: written meanwhile; the next pass removes it)
                if getattr(e, "errno", None) not in (None, errno.ENOTEMPTY):
                    raise

    def remove(self, path: str) -> None:
        try:
            self._call("rm_file", path)
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
            if _GLOB.search(path):  # fsspec's rm expands [ * ?: another root's files
                self._remove_literal(path)  # (before 2026-12-06 removed them)
            else:
                self._call("rm", path, recursive=True)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise storage_error(e, "removing", self.display(path)) from e
        finally:
            self.fs.invalidate_cache(path)
