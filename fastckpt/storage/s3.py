"""``s3://`` roots: concurrent multipart uploads and ranged GETs straight from and into
fastckpt's buffers, a conditional manifest commit, and one choke point for every S3 request.

Real object stores cap each connection (about 85-90 MB/s on S3) and add a round trip per
request, so one stream per rank cannot move a multi-GB shard inside a 15-30 s grace window.
:class:`S3Storage` keeps up to ``concurrency`` requests in flight per process (all files, all
writer and reader threads, one limit) on the aiobotocore client that s3fs opened (its
credentials, endpoint and botocore settings), on s3fs's event loop:

* **Uploads** (``write_shard``, one call per shard file): a file up to ``part_bytes`` is one
  PutObject; a larger one is CreateMultipartUpload, UploadPart for every ``part_bytes`` slice
  at once (each waiting for a slot of the limit), CompleteMultipartUpload. Each part's body is
  a view of the caller's staging buffer, read by the HTTP client in 256 KiB pieces (no copy of
  the part is made first; Python 3.11's asyncio copies what the socket does not take at once
  into its transport buffer, a bounded amount per connection). The chunk checksums are
  computed on the calling thread while the parts are in flight.
* **Downloads** (``read_into``): a range up to ``part_bytes`` is one ranged GetObject; a larger
  one is split into ``part_bytes`` ranges fetched at once, each streamed into its slice of the
  caller's buffer.
* **The commit** (``publish_manifest``): PutObject with ``If-None-Match: *`` (put-if-absent).
  A 412 means the step already has a manifest: the same bytes are ours (an earlier attempt of
  this PUT landed and its answer was lost); otherwise it is a re-save of a committed step,
  replaced with ``If-Match: <the ETag just read>``, so a manifest another writer put meanwhile
  is never overwritten unseen. Whether the store honours the conditions is probed once per
  storage (``conditional="auto"``): a store that ignores them (it overwrites a key that
  ``If-None-Match: *`` must have protected) or refuses them (501, 400) gets plain PUTs, with a
  warning; ``"require"`` makes that an error, ``"off"`` skips the probe. Without conditions, two
  writers committing one step at the same moment are not told apart: the writer lease
  (fastckpt/lease.py) is what keeps a second writer out.
* **Failures**: a failed or interrupted upload is aborted (AbortMultipartUpload under its own
  short bound, even when the save's deadline has passed); nothing becomes visible, because an
  object appears only with its complete request. An upload that cannot be aborted is logged,
  recorded in :attr:`unaborted` and named in the error; ``fastckpt gc`` aborts it later.

**The choke point**: every S3 request goes through ``S3Calls._request`` (fastckpt/storage/s3call.py):
retries of throttling, server errors and broken connections with capped, jittered backoff
within the deadline; the rest mapped to clear errors; no credential ever logged.

Every call is bounded as in :mod:`fastckpt.storage.fsspec_backend` (``op_timeout_s`` plus time
for the bytes, or the deadline of a :meth:`~FsspecStorage.bounded` view, whichever comes
first; then it is cancelled and raises).

**Why aiobotocore (through s3fs)** and not boto3's transfer manager or the AWS CRT: s3fs is
already how fsspec users configure S3 (credentials, endpoints, botocore settings), and its
client is asynchronous, so 32-64 requests in flight are coroutines on one event loop, not
threads; every request can be cancelled at a deadline (the CRT's and s3transfer's threads
cannot be bounded that way); conditional PUTs are plain parameters (s3transfer's
``upload_file`` cannot send ``If-None-Match``). The price is Python per request (signing,
and over plain http a SHA-256 of every body for the signature, on the loop's thread): see
docs/benchmarks.md for where that sits against the clients a user would otherwise pick.
"""

from __future__ import annotations

import errno
import logging
import threading
import time
import uuid
from typing import Sequence

from ..errors import StorageError
from .base import ConditionFailed, storage_error
from .fsspec_backend import FsspecStorage
from .s3call import (CONCURRENCY, LOST_TRY, MAX_ATTEMPTS, MAX_PARTS, MIN_PART, PART_BYTES,
                     S3Calls, S3RequestError, _all, _Limit, _ShortRead)

log = logging.getLogger("fastckpt")


def _refused(e: StorageError) -> bool:
    """A conditional PUT the store refused (412: its condition did not hold)."""
    return isinstance(e.__cause__, S3RequestError) and e.__cause__.status == 412

#: (endpoint, bucket) -> whether it honours conditional writes, probed once per process
_COND: dict = {}
_COND_LOCK = threading.Lock()

__all__ = ["S3Storage", "S3RequestError", "PART_BYTES", "CONCURRENCY", "MAX_ATTEMPTS"]


class S3Storage(S3Calls, FsspecStorage):
    """A checkpoint root on S3 (or an S3-compatible store); see the module docstring.

    ``part_bytes``: the size of one part and of one ranged GET; ``concurrency``: requests in
    flight per process; ``max_attempts``: tries of one request; ``conditional``: "auto",
    "require" or "off" (conditional manifest PUTs). Thread-safe; views made by ``bounded``
    share the client, the limit, :attr:`stats` and :attr:`unaborted`.
    """

    def __init__(self, url: str, *, io_mode: str = "auto", storage_options: dict,
                 op_timeout_s: float = 120.0, part_bytes: int = PART_BYTES,
                 concurrency: int = CONCURRENCY, max_attempts: int = MAX_ATTEMPTS,
                 conditional: str = "auto") -> None:
        if not (isinstance(part_bytes, int) and part_bytes >= MIN_PART):
            raise ValueError(f"part_bytes must be an int >= {MIN_PART} (S3's minimum part "
                             f"size), got {part_bytes!r}")
        if not (isinstance(concurrency, int) and concurrency >= 1):
            raise ValueError(f"concurrency must be a positive int, got {concurrency!r}")
        if not (isinstance(max_attempts, int) and max_attempts >= 1):
            raise ValueError(f"max_attempts must be a positive int, got {max_attempts!r}")
        if conditional not in ("auto", "require", "off"):
            raise ValueError(f"conditional must be 'auto', 'require' or 'off', got "
                             f"{conditional!r}")
        # botocore keeps 10 connections per client unless told: as many as requests in flight
        config = dict(storage_options.get("config_kwargs") or {})
        config.setdefault("max_pool_connections", concurrency)
        storage_options = {**storage_options, "config_kwargs": config}
        super().__init__(url, io_mode=io_mode, storage_options=storage_options,
                         op_timeout_s=op_timeout_s)
        if not self._s3:
            raise ValueError(f"{url} did not open an s3fs file system")
        self.part_bytes = part_bytes
        self.concurrency = concurrency
        self.max_attempts = max_attempts
        self.conditional = conditional
        self._limit = _Limit(concurrency)
        #: shared by every view: requests sent, retries, throttling answers, bytes moved
        self.stats = {"requests": 0, "retries": 0, "throttled": 0, "bytes_up": 0,
                      "bytes_down": 0}

    #: shard files a writer thread of one rank uploads at once (their parts share the limit)
    @property
    def write_streams(self) -> int:
        return max(2, min(8, self.concurrency // 4))

    #: spans a reader of one rank fetches at once
    @property
    def read_streams(self) -> int:
        return max(2, min(8, self.concurrency // 8))

    # -- the choke point -----------------------------------------------------------------------

    def listdir(self, path: str) -> list[str]:
        return sorted(self._list(path))

    def sizes(self, path: str) -> dict[str, int | None]:
        return self._list(path)

    def _list(self, path: str) -> dict[str, int | None]:
        """name -> size (None: a "directory", a common prefix) of the objects under ``path/``,
        one level, from ListObjectsV2's pages."""
        bucket, key = self._split(path)
        prefix = key.rstrip("/") + "/" if key else ""
        names: dict[str, int | None] = {}
        token = None
        while True:
            kw = {"Prefix": prefix, "Delimiter": "/"}
            if token:
                kw["ContinuationToken"] = token
            out = self._op("list_objects_v2", path, what="listing", bucket_op=True, **kw) or {}
            for c in out.get("Contents", []):
                names[c["Key"][len(prefix):].rstrip("/")] = c.get("Size")
            for p in out.get("CommonPrefixes", []):
                names.setdefault(p["Prefix"][len(prefix):].rstrip("/"), None)
            token = out.get("NextContinuationToken")
            if not out.get("IsTruncated") or not token:
                break
        return {n: v for n, v in names.items() if n and "/" not in n}

    def read_bytes(self, path: str) -> bytes:
        # one GET of the whole object: a reader sees one version of it, never two halves
        out = self._op("get_object", path, what="reading", whole=True)
        return out["Body"]

    def size(self, path: str) -> int | None:
        out = self._op("head_object", path, what="stat", missing_ok=True)
        return None if out is None else int(out["ContentLength"])

    def publish(self, path: str, data: bytes, *, durable: bool = True) -> None:
        # one PUT: atomic, and durable when it returns
        self._op("put_object", path, nbytes=len(data), body=memoryview(bytes(data)),
                 what="publishing")

    def remove(self, path: str) -> None:
        self._op("delete_object", path, what="removing")

    def remove_dir(self, path: str) -> None:
        bucket, key = self._split(path)
        prefix = key.rstrip("/") + "/"
        token = None
        while True:
            kw = {"Prefix": prefix}
            if token:
                kw["ContinuationToken"] = token
            out = self._op("list_objects_v2", path, what="listing", bucket_op=True, **kw) or {}
            keys = [c["Key"] for c in out.get("Contents", [])]
            for i in range(0, len(keys), 1000):
                res = self._op("delete_objects", path, what="removing", bucket_op=True,
                               Delete={"Objects": [{"Key": k} for k in keys[i:i + 1000]],
                                       "Quiet": True}) or {}
                if res.get("Errors"):
                    e = res["Errors"][0]
                    raise StorageError(f"removing failed for {len(res['Errors'])} object(s), "
                                       f"first {e.get('Key')}: {e.get('Code')}: "
                                       f"{e.get('Message')}", file=self.display(path))
            token = out.get("NextContinuationToken")
            if not out.get("IsTruncated") or not token:
                return

    # -- the commit ----------------------------------------------------------------------------
    def conditional_writes(self) -> bool:
        """Whether the store honours ``If-None-Match: *`` (probed once per endpoint and bucket
        in a process: a probe object is put twice, the second PUT must be refused with 412;
        the probe also shows the root is writable, see :meth:`check_writable`)."""
        if self.conditional == "off":
            return False
        key = (str(self.fs.client_kwargs.get("endpoint_url")), self._split(self.root)[0])
        with _COND_LOCK:
            known = _COND.get(key)
        if known is None:
            known, why = self._probe()
            with _COND_LOCK:
                _COND[key] = known
            if not known:
                log.warning("fastckpt: %s does not honour conditional writes (%s): manifests "
                            "and the writer lease are put unconditionally", self.display(
                                self.root), why)
        if not known and self.conditional == "require":
            raise StorageError("the store does not honour conditional writes; "
                               "conditional='require'", file=self.display(self.root))
        return known

    def _probe(self) -> tuple[bool, str]:
        probe = self.join(f".fastckpt-cond-probe-{uuid.uuid4().hex[:12]}")
        try:
            try:
                self._op("put_object", probe, body=memoryview(b"1"), IfNoneMatch="*",
                         what="probing the root (a conditional write)")
            except StorageError as e:
                cause = e.__cause__
                if isinstance(cause, S3RequestError) and cause.status in (400, 501):
                    # refused the condition: a plain write shows the root is writable
                    self._op("put_object", probe, body=memoryview(b"1"), what="writing a probe")
                    return False, f"it refused the condition: {cause}"
                raise
            try:
                self._op("put_object", probe, body=memoryview(b"2"), IfNoneMatch="*",
                         what="probing conditional writes")
                return False, "it overwrote an object that If-None-Match: * protected"
            except StorageError as e:
                cause = e.__cause__
                if isinstance(cause, S3RequestError) and cause.status == 412:
                    return True, ""
                return False, f"it answered {e}"
        finally:
            try:
                self.remove(probe)
            except StorageError:
                pass

    def check_writable(self) -> None:
        """The root can be written (and, unless ``conditional="off"``, whether conditions are
        honoured: one probe does both, once per process)."""
        if self.conditional == "off":
            return super().check_writable()
        key = (str(self.fs.client_kwargs.get("endpoint_url")), self._split(self.root)[0])
        with _COND_LOCK:
            probed = key in _COND
        if probed:
            return super().check_writable()
        self.conditional_writes()

    def read_versioned(self, path: str) -> tuple[bytes, str] | None:
        out = self._op("get_object", path, what="reading", whole=True, missing_ok=True)
        return None if out is None else (out["Body"], out["ETag"])

    def put_conditional(self, path: str, data: bytes, *, if_absent: bool = False,
                        if_match: str | None = None) -> str:
        kw = {"IfNoneMatch": "*"} if if_absent else {"IfMatch": if_match}
        try:
            out = self._op("put_object", path, nbytes=len(data), body=memoryview(bytes(data)),
                           what="publishing", **kw)
        except StorageError as e:
            cause = e.__cause__
            if isinstance(cause, S3RequestError) and (cause.status == 412 or (
                    if_match and cause.code in ("NoSuchKey", "404"))):
                raise ConditionFailed(f"{'an object is there' if if_absent else 'the object changed'}"
                                      " (someone else wrote it)", file=self.display(path)) from e
            raise
        return out["ETag"]

    def publish_manifest(self, path: str, data: bytes) -> None:
        """The commit point: put ``data`` at ``path`` only if no manifest is there, or over the
        manifest that is there as read just before (a re-save of the step); see the module
        docstring."""
        if not self.conditional_writes():
            return self.publish(path, data)
        data = bytes(data)
        try:
            self._op("put_object", path, nbytes=len(data), body=memoryview(data),
                     IfNoneMatch="*", what="publishing")
            return
        except StorageError as e:
            if not _refused(e):
                raise
        # a manifest is there: ours (an earlier try's answer was lost), or a committed save of
        # this step that this one replaces, only as it is now
        out, ours = self._holds(path, data)
        if ours:
            return
        try:
            if out is None:  # removed in between: put-if-absent again
                self._op("put_object", path, nbytes=len(data), body=memoryview(data),
                         IfNoneMatch="*", what="publishing")
            else:
                self._op("put_object", path, nbytes=len(data), body=memoryview(data),
                         IfMatch=out["ETag"], what="publishing")
        except StorageError as e:
            if _refused(e):
                # ours, when a try whose answer was lost wrote it (its retry then fails the
                # condition): before 2026-12-06 that was "not committed" for a committed save
                if self._holds(path, data)[1]:
                    return
                raise StorageError("the manifest changed while this save committed (another "
                                   "writer?): not committed", file=self.display(path)) from e
            raise

    def _holds(self, path: str, data: bytes) -> tuple[dict | None, bool]:
        """(the HEAD of the object at ``path``, None if there is none; whether it is ``data``)."""
        out = self._op("head_object", path, what="publishing", missing_ok=True)
        return out, out is not None and self.read_bytes(path) == data

    # -- shards --------------------------------------------------------------------------------
    def _part(self, nbytes: int) -> int:
        part = max(self.part_bytes, -(-nbytes // MAX_PARTS))
        return part

    def write_shard(self, path: str, buf, nbytes: int, ranges: Sequence[tuple[int, int]], *,
                    hashes: Sequence[int] | None = None, sync_dir: bool = True) -> list[int]:
        mv = memoryview(buf).cast("B")[:nbytes]
        if len(mv) != nbytes:
            raise ValueError(f"buffer holds {len(mv)} bytes, asked to write {nbytes}")
        if hashes is not None and len(hashes) != len(ranges):
            raise ValueError(f"{len(hashes)} hashes given for {len(ranges)} ranges")
        # the request under way, the upload id once CreateMultipartUpload answered, whether
        # the upload completed, and an event set when the upload's coroutine has ended
        state: dict = {"ended": threading.Event()}
        try:
            fut, t, bound = self._submit("upload", self._upload, path, mv, state,
                                         nbytes=nbytes)
            try:
                if hashes is None:  # while the parts are in flight
                    hashes = [self.io.hash(mv[o:o + n], n) for o, n in ranges]
            except BaseException:
                fut.cancel()
                raise
            self._wait(lambda: state.get("op", "upload"), fut, t, bound)
            if state.get("strays"):
                note = self._abort_strays(path, state["upload_id"])
                if note:
                    log.warning("fastckpt: writing %s: %s", self.display(path), note)
        except BaseException as e:
            note = self._after_failed_upload(path, state, e)
            if not isinstance(e, Exception):
                raise
            msg = str(e) if isinstance(e, S3RequestError) else None
            if msg is not None:
                raise StorageError("writing the shard failed: " + msg + (
                    f"; {note}" if note else ""), file=self.display(path),
                    offset=state.get("failed_at")) from e
            raise storage_error(e, "writing the shard", self.display(path),
                                offset=state.get("failed_at"), note=note) from e
        return list(hashes)

    async def _upload(self, path: str, mv: memoryview, state: dict, *, until: float) -> None:
        try:
            await self._upload_parts(path, mv, state, until)
        finally:
            state["ended"].set()  # its requests are over (a cancelled part's too)

    async def _upload_parts(self, path: str, mv: memoryview, state: dict, until: float) -> None:
        n = len(mv)
        part = self._part(n)
        state["begun"] = True
        if n <= part:
            state["op"] = "put_object"
            await self._request("put_object", path, until, body=mv)
            state["done"] = True
            return
        state["op"] = "create_multipart_upload"
        state["multipart"] = True
        up = await self._request("create_multipart_upload", path, until)
        state["upload_id"] = up["UploadId"]
        state["strays"] = bool(up.get(LOST_TRY))  # a try whose answer was lost began one too
        state["op"] = "upload_part"
        starts = list(range(0, n, part))

        async def one(i: int, s: int) -> dict:
            try:
                out = await self._request("upload_part", path, until, body=mv[s:s + part],
                                          UploadId=up["UploadId"], PartNumber=i + 1)
            except BaseException:
                state.setdefault("failed_at", s)
                raise
            return {"ETag": out["ETag"], "PartNumber": i + 1}

        parts = await _all(one(i, s) for i, s in enumerate(starts))
        state["op"] = "complete_multipart_upload"
        await self._request("complete_multipart_upload", path, until, UploadId=up["UploadId"],
                            MultipartUpload={"Parts": parts})
        state["done"] = True

    def _after_failed_upload(self, path: str, state: dict, e: BaseException) -> str | None:
        """Abort the multipart upload a failed shard write began (its own bound); a note on
        what could not be cleaned up, for the error message."""
        if not state.get("begun"):
            return None
        # parts still in flight when the upload was cancelled could land after an abort
        # (S3 then keeps them): abort once the upload's requests are over
        state["ended"].wait(self._cleanup_s)
        if state.get("done") or not state.get("multipart"):
            # a PUT (which may have landed), or an upload that completed before the cancel
            # took: remove what no manifest will reference
            try:
                self._op("delete_object", path, timeout=self._cleanup_s, what="removing")
            except StorageError as err:
                return f"the completed object could not be removed: {err}"
            return None
        bucket, key = self._split(path)
        uid = state.get("upload_id")
        if uid is None and self._abort_strays(path, None) is None:
            return None  # (the begin request got no answer: what it began, if any, aborted)
        note = self._abort_after_failure(bucket, key, uid)
        if uid is not None and state.get("strays"):
            note = note or self._abort_strays(path, uid)
        return note

    def _abort_strays(self, path: str, ours: str | None) -> str | None:
        """Abort the unfinished multipart uploads of ``path``'s key but ``ours``: begun by a
        CreateMultipartUpload try whose answer was lost (the retry began another; before
        2026-12-06 the first was left for `fastckpt gc`). A shard's key is this save's and
        rank's own, so every such upload is this write's. A note on what is left, or None."""
        bucket, key = self._split(path)
        try:
            out = self._op("list_multipart_uploads", path, what="listing unfinished multipart "
                           "uploads", bucket_op=True, timeout=self._cleanup_s, Prefix=key) or {}
            for u in out.get("Uploads", []):
                if u["Key"] == key and u["UploadId"] != ours:
                    self._op("abort_multipart_upload", path, UploadId=u["UploadId"],
                             timeout=self._cleanup_s, what="aborting a stray multipart upload")
        except StorageError as e:
            return f"may have left an unfinished multipart upload ({e}); `fastckpt gc` aborts it"
        return None

    def _abort_after_failure(self, bucket: str, key: str, upload_id: str | None) -> str | None:
        url = self.display(f"{bucket}/{key}")
        if upload_id is None:
            left = "may have left an unfinished multipart upload"
            why = "the request that begins one got no answer"
        else:
            try:
                self._op("abort_multipart_upload", f"{bucket}/{key}", UploadId=upload_id,
                         timeout=self._cleanup_s, what="aborting the multipart upload")
                return None
            except StorageError as e:
                cause = e.__cause__
                if isinstance(cause, S3RequestError) and cause.code == "NoSuchUpload":
                    return None  # no such upload: nothing is left
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
            return self.io.hash(out[:0], 0) if hash else None
        self._read_range(path, offset, out[:nbytes], nbytes)
        return self.io.hash(out[:nbytes], nbytes) if hash else None

    def _read_range(self, path: str, offset: int, out: memoryview, nbytes: int) -> None:
        try:
            fut, t, bound = self._submit("get_object", self._download, path, offset, out,
                                         nbytes=nbytes)
            self._wait("get_object", fut, t, bound)
        except S3RequestError as e:
            if isinstance(e.__cause__, _ShortRead) or e.code == "InvalidRange":
                raise storage_error(EOFError(f"expected {nbytes} bytes at offset {offset} "
                                             "(the object ends early)"), "reading",
                                    self.display(path), offset=offset) from e
            err = StorageError(f"reading failed: {e}", file=self.display(path), offset=offset)
            if e.gone:  # (removed under the reader: not damage; before 2026-12-06 a load
                err.errno = errno.ENOENT  # fell back to an older step for it)
            raise err from e
        except Exception as e:
            raise storage_error(e, "reading", self.display(path), offset=offset) from e

    async def _download(self, path: str, offset: int, out: memoryview, *, until: float) -> None:
        part = self.part_bytes
        n = len(out)

        async def one(s: int) -> None:
            k = min(part, n - s)
            await self._request("get_object", path, until, into=out[s:s + k],
                                Range=f"bytes={offset + s}-{offset + s + k - 1}")
        await _all(one(s) for s in range(0, n, part))

    # -- unfinished uploads (fastckpt gc) ------------------------------------------------------
    def incomplete_uploads(self) -> list[dict]:
        bucket, key = self._split(self.root)
        kw = {"Prefix": key.rstrip("/") + "/"} if key else {}
        found = []
        while True:
            out = self._op("list_multipart_uploads", self.root, what="listing unfinished "
                           "multipart uploads", bucket_op=True, **kw) or {}
            found += [{"url": self.display(f"{bucket}/{u['Key']}"), "key": u["Key"],
                       "upload_id": u["UploadId"],
                       "initiated_unix": u["Initiated"].timestamp()}
                      for u in out.get("Uploads", [])]
            if not out.get("IsTruncated"):
                return found
            kw.update(KeyMarker=out["NextKeyMarker"], UploadIdMarker=out["NextUploadIdMarker"])

    def abort_upload(self, upload: dict) -> None:
        url = upload["url"].split("://", 1)[-1]
        try:
            self._op("abort_multipart_upload", url, UploadId=upload["upload_id"],
                     what=f"aborting the multipart upload {upload['upload_id']}")
        except StorageError as e:
            cause = e.__cause__
            if isinstance(cause, S3RequestError) and (cause.code == "NoSuchUpload"
                                                       or cause.status == 404):
                return
            raise


