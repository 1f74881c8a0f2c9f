"""Any fsspec file system (s3fs, gcsfs, memory, ...): bounded remote calls, streamed shard
writes, single-PUT commit.

Object stores have no rename; a single PUT of a small object is atomic (readers see the whole
old object or the whole new one), so the manifest is published with one ``pipe_file`` call.

Every remote call is bounded in time. On async file systems (s3fs, gcsfs, ...) each call runs
as a coroutine on the file system's event loop and is waited for at most ``op_timeout_s``
(data transfers: one more second per 8 MiB), or until the deadline of a
:meth:`FsspecStorage.bounded` view when that comes first; then it is cancelled (the HTTP
request is torn down, and the client's retry loop with it) and a StorageError names the
operation, the URL and the bound that passed. Synchronous file systems (``memory://``) are
called directly: they have no network to hang on.

Shard uploads on s3 go through an ``S3File`` whose every request (begin, upload part, complete
or a one-shot PUT, abort) runs under those bounds. Other buffered file systems (gcsfs, ...)
upload through ``fs.open``: their requests are bounded only by their clients' own timeouts.

A shard upload that fails is *discarded*, never closed: closing an fsspec file after an error
commits the partial object (s3fs completes the multipart upload with the parts sent so far).
For buffered uploads (s3fs, gcsfs, ...: ``AbstractBufferedFile``) ``discard()`` aborts the
multipart/resumable upload and the file is marked closed so that its finaliser cannot commit
either; nothing becomes visible. File systems that write in place (``memory://``) have already
made the partial object visible, so it is removed. This holds for ``BaseException`` too
(KeyboardInterrupt, SystemExit from a preemption handler), which is re-raised unchanged.
That cleanup has its own short bound (``min(10 s, op_timeout_s)``), independent of a save
deadline that may have passed already. An s3 multipart upload it cannot abort (the endpoint
does not answer) is logged, recorded in :attr:`FsspecStorage.unaborted` and named in the
error; :meth:`FsspecStorage.incomplete_uploads` lists it and ``abort_upload`` aborts it later
(``fastckpt gc``). Unfinished multipart uploads are invisible to readers but are billed.

When fastckpt opens an s3 file system it sets the botocore timeouts and retries that
``storage_options["config_kwargs"]`` leaves out (:data:`S3_CONFIG_DEFAULTS`), so that a request
made outside these bounds (another user of the same file system, such as ``fastckpt bench``)
gives up on a silent endpoint after about 150 s instead of 375 s: s3fs itself tries a
timed-out request 5 times (not configurable per file system), each try being botocore's
attempts of up to ``read_timeout`` each.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import copy
import functools
import logging
import sys
import time
from typing import Sequence

import xxhash

from . import native as _native
from .base import Storage, storage_error

log = logging.getLogger("fastckpt")

_CHUNK = 16 << 20  # upload part size / write piece (s3 parts must be >= 5 MiB)
#: reads of more than 2 pieces are split into ranged GETs fetched concurrently (on async file
#: systems: s3fs, gcsfs); smaller reads are one request
_READ_PIECE = 32 << 20
#: the slowest transfer rate a remote call is given time for (bytes/s) on top of op_timeout_s
_MIN_RATE = 8 << 20
#: the longest an abort or removal after a failure may take (seconds), whatever the deadline
_CLEANUP_S = 10.0

#: botocore settings fastckpt gives an s3 file system where ``config_kwargs`` does not set
#: them: s3fs's own timeouts (a connection within 5 s, response bytes 15 s apart at most),
#: stated so they do not change under us, and 2 tries of a request instead of botocore's
#: default 5 ("legacy" mode), inside s3fs's own 5
S3_CONFIG_DEFAULTS = {"connect_timeout": 5, "read_timeout": 15,
                      "retries": {"total_max_attempts": 2, "mode": "standard"}}

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

    def _run(self, op: str, fn, *args, nbytes: int = 0, timeout: float | None = None, **kw):
        """``await fn(*args, **kw)`` on the file system's loop within the bound, else cancel it
        and raise TimeoutError saying which bound passed. ``timeout``: a fixed bound instead of
        the per-call one and the deadline (cleanup)."""
        if timeout is not None:
            bound: str | None = "the cleanup bound"
        else:
            timeout = self.op_timeout_s + nbytes / _MIN_RATE
            bound = (f"the per-call bound: op_timeout_s={self.op_timeout_s:g}"
                     + (" and time for the bytes" if nbytes else ""))
            left = None if self.deadline is None else self.deadline - time.monotonic()
            if left is not None and left < timeout:
                if left <= 0:
                    raise TimeoutError(f"the save deadline passed before {op} was sent")
                timeout, bound = left, None  # None: the deadline
        fut = asyncio.run_coroutine_threadsafe(fn(*args, **kw), self.fs.loop)
        try:
            done, _ = concurrent.futures.wait([fut], timeout=timeout)
        except BaseException:
            fut.cancel()
            raise
        if not done:
            fut.cancel()  # tears the request down; no retry loop keeps running
            if bound is None:
                raise TimeoutError(f"the save deadline passed: no answer to {op} within the "
                                   f"{timeout:.1f} s left")
            raise TimeoutError(f"no answer to {op} within {timeout:.1f} s ({bound})")
        return fut.result()

    def _call(self, name: str, *args, nbytes: int = 0, timeout: float | None = None, **kw):
        """``fs.<name>(*args, **kw)``: bounded on async file systems, direct on sync ones."""
        if not self._async:
            return getattr(self.fs, name)(*args, **kw)
        return self._run(name, getattr(self.fs, "_" + name), *args, nbytes=nbytes,
                         timeout=timeout, **kw)

    def _call_s3(self, method: str, *kwarglists: dict, nbytes: int = 0,
                 timeout: float | None = None, **kw):
        """One S3 request through s3fs (its error translation, its retries), bounded."""
        return self._run(method, self.fs._call_s3, method, *kwarglists, nbytes=nbytes,
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
            f = (_bounded_s3_file()(self, path) if self._s3
                 else self.fs.open(path, "wb", block_size=_CHUNK))
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
                f.discard()  # s3: abort the multipart upload (bounded, never raises)
            except Exception:
                pass
            f.closed = True  # close() -- and so __del__ -- would commit what was written
            return getattr(f, "left_behind", None)
        try:
            f.close()
        except Exception:
            pass
        try:  # written in place: the partial object is visible, remove it
            self._call("rm_file", path, timeout=self._cleanup_s)
        except Exception:
            pass
        return None

    def _abort_after_failure(self, bucket: str, key: str, upload_id: str | None) -> str | None:
        """Abort the multipart upload of a failed shard write within the cleanup bound; when it
        cannot be aborted, log and record it and return a note for the error message."""
        url = self.display(f"{bucket}/{key}")
        if upload_id is None:
            left = "may have left an unfinished multipart upload"
            why = "the request that begins one got no answer"
        else:
            try:
                self._call_s3("abort_multipart_upload", Bucket=bucket, Key=key,
                              UploadId=upload_id, timeout=self._cleanup_s)
                return None
            except FileNotFoundError:
                return None  # no such upload: nothing is left
            except Exception as e:
                left = "left an unfinished multipart upload"
                why = f"id {upload_id}; aborting it failed: {e}"
        self.unaborted.append({"url": url, "upload_id": upload_id, "when_unix": time.time()})
        log.warning("a failed shard write %s in s3 bucket %s, key %s (%s); `fastckpt gc` aborts "
                    "it", left, bucket, key, why)
        return f"{left} at {url} ({why}); `fastckpt gc` aborts it"

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
            self._call("rm", path, recursive=True)
        except FileNotFoundError:
            pass
        except Exception as e:
            raise storage_error(e, "removing", self.display(path)) from e
        finally:
            self.fs.invalidate_cache(path)

    # -- unfinished uploads (fastckpt gc) ------------------------------------------------------
    def incomplete_uploads(self) -> list[dict]:
        """s3: the multipart uploads begun under the root's key prefix and neither completed
        nor aborted, each ``{"url", "key", "upload_id", "initiated_unix"}``; other file
        systems: ``[]``."""
        if not self._s3:
            return []
        bucket, key, _ = self.fs.split_path(self.root)
        kw = {"Bucket": bucket, **({"Prefix": key.rstrip("/") + "/"} if key else {})}
        found = []
        try:
            while True:
                out = self._call_s3("list_multipart_uploads", **kw)
                found += [{"url": self.display(f"{bucket}/{u['Key']}"), "key": u["Key"],
                           "upload_id": u["UploadId"],
                           "initiated_unix": u["Initiated"].timestamp()}
                          for u in out.get("Uploads", [])]
                if not out.get("IsTruncated"):
                    return found
                kw.update(KeyMarker=out["NextKeyMarker"],
                          UploadIdMarker=out["NextUploadIdMarker"])
        except Exception as e:
            raise storage_error(e, "listing unfinished multipart uploads",
                                self.display(self.root)) from e

    def abort_upload(self, upload: dict) -> None:
        """Abort one upload of :meth:`incomplete_uploads` (or of :attr:`unaborted`, when its
        ``upload_id`` is known); one already gone is fine."""
        if not self._s3:
            return
        bucket, key, _ = self.fs.split_path(upload["url"])
        try:
            self._call_s3("abort_multipart_upload", Bucket=bucket, Key=key,
                          UploadId=upload["upload_id"])
        except FileNotFoundError:
            pass
        except Exception as e:
            raise storage_error(e, f"aborting the multipart upload {upload['upload_id']}",
                                upload["url"]) from e


@functools.cache
def _bounded_s3_file():
    """The class of s3 shard uploads, made on first use (s3fs is imported only for s3)."""
    from s3fs.core import S3File

    class BoundedS3File(S3File):
        """An ``S3File`` for writing whose every request runs under ``storage``'s bounds.

        ``S3File`` sends its requests through ``_call_s3`` (begin, upload part, complete, PUT),
        ``_abort_mpu`` (abort) and, for an empty file, the file system's ``touch``; the three
        are replaced here, the rest (buffering, part numbering, the commit, and the hooks the
        storage tests inject faults at) stays s3fs's. Parts go out one at a time.
        ``left_behind``: a note on an upload that could not be aborted, for the error.
        """

        def __init__(self, storage: FsspecStorage, path: str) -> None:
            fs = storage.fs
            extra = fs.s3_additional_kwargs
            super().__init__(fs, path, "wb", block_size=_CHUNK,
                             acl=extra.get("ACL", False) or extra.get("acl", False),
                             s3_additional_kwargs=dict(extra),
                             # an attribute since s3fs 2026.9; req_kw before
                             requester_pays=getattr(fs, "requester_pays",
                                                    bool(getattr(fs, "req_kw", None))))
            self.storage = storage
            self.left_behind: str | None = None

        def _call_s3(self, method, *kwarglist, **kwargs):
            body = kwargs.get("Body")
            try:
                # the arguments S3File._call_s3 passes (s3fs >= 2026.9 adds the payer's)
                payer = ((self._request_payer_kw,) if hasattr(self, "_request_payer_kw")
                         else ())
                return self.storage._call_s3(method, self.s3_additional_kwargs, *payer,
                                             *kwarglist,
                                             nbytes=len(body) if body is not None else 0,
                                             **kwargs)
            except BaseException as e:
                # cut short without an answer, the request may have begun an upload all the same
                if method == "create_multipart_upload" and (
                        isinstance(e, TimeoutError) or not isinstance(e, Exception)):
                    self.left_behind = self.storage._abort_after_failure(self.bucket, self.key,
                                                                         None)
                raise

        def _abort_mpu(self):
            if self.mpu:
                upload_id, self.mpu = self.mpu["UploadId"], None
                self.left_behind = self.storage._abort_after_failure(self.bucket, self.key,
                                                                     upload_id)

        def commit(self):
            if self.tell() == 0:  # S3File would create the empty object with an unbounded touch
                if self.buffer is not None:
                    acl = {"ACL": self.acl} if self.acl else {}
                    self._call_s3("put_object", Bucket=self.bucket, Key=self.key, Body=b"",
                                  **acl)
                    self.buffer = None
                return
            super().commit()

    return BoundedS3File
