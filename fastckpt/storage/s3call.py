"""The choke point of every S3 request fastckpt makes (``S3Calls._request``), and what it is
built from: the in-flight limit, request bodies that are views of fastckpt's buffers, and the
classification of errors.

**The choke point** (:meth:`S3Calls._request`): every S3 request goes through it. Throttling (503 SlowDown, 429, Throttling*), server errors (500, 502, 503, 504,
InternalError, RequestTimeout) and broken connections are retried up to ``max_attempts``
times with capped, fully jittered exponential backoff (``RETRY_BASE_S`` doubling up to
``RETRY_CAP_S``), never past the call's bound or the save's deadline; everything else fails at
once, mapped to a :class:`~fastckpt.errors.StorageError` that names the operation, the URL
and what to do (403 AccessDenied: the credentials' permissions; InvalidAccessKeyId /
SignatureDoesNotMatch: the credentials; NoSuchBucket: the bucket's name). botocore's own
retries are off unless the user's ``config_kwargs`` sets them (:data:`S3_CONFIG_DEFAULTS`), so
no request is retried by two layers. Credentials are never logged: messages carry the URL,
the operation, the HTTP status and S3's error code and message.
"""

from __future__ import annotations

import asyncio
import errno
import io
import logging
import random
import time

from ..errors import StorageError
from .base import storage_error

log = logging.getLogger("fastckpt")

#: default size of one UploadPart / ranged GET (S3: parts of 5 MiB to 5 GiB, at most 10,000)
PART_BYTES = 8 << 20
#: default requests in flight per process; 32 x ~85 MB/s is about 22 Gb/s (a 10-25 Gb/s NIC)
CONCURRENCY = 32
#: default tries of one request (the first and the retries)
MAX_ATTEMPTS = 8
RETRY_BASE_S = 0.1
RETRY_CAP_S = 5.0
#: the retries' jitter: a generator of fastckpt's own (``random``'s module functions draw from
#: the user's generator: a retried request would shift the job's random stream)
_JITTER = random.Random()
MIN_PART = 5 << 20
MAX_PARTS = 10_000

#: S3 error codes that say "slow down"
_THROTTLE_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "ThrottledException",
    "RequestThrottled", "RequestThrottledException", "TooManyRequestsException",
    "RequestLimitExceeded", "BandwidthLimitExceeded", "ProvisionedThroughputExceededException",
    "EC2ThrottledException"})
#: S3 error codes worth another try (throttling, server-side trouble)
_RETRY_CODES = _THROTTLE_CODES | {"InternalError", "ServiceUnavailable", "RequestTimeout",
                                  "RequestTimeoutException", "PriorRequestNotComplete",
                                  "OperationAborted"}
_RETRY_STATUS = frozenset({429, 500, 502, 503, 504})

#: what to tell the user for the errors a retry cannot fix
_HINTS = {
    "AccessDenied": "access denied: the credentials in use are not allowed to do this under "
                    "this prefix (check the IAM and bucket policies)",
    "AllAccessDisabled": "all access to this object has been disabled",
    "InvalidAccessKeyId": "the access key id was not recognised: check the credentials",
    "SignatureDoesNotMatch": "the request signature was rejected: check the secret key and "
                             "the region",
    "ExpiredToken": "the session token has expired: refresh the credentials",
    "InvalidToken": "the session token is malformed or invalid: check the credentials",
    "NoSuchBucket": "the bucket does not exist: check the bucket name in the URL",
    "NoSuchKey": "no such object",
    "NoSuchUpload": "no such multipart upload (completed or aborted already)",
    "PreconditionFailed": "a conditional write found the object changed",
    "EntityTooSmall": "a multipart part was below the store's minimum part size",
}


#: set in a response whose request was tried again after a try that got no answer
LOST_TRY = "FastckptLostTry"


class S3RequestError(Exception):
    """A request that failed (after its retries): S3's code, the HTTP status, the message."""

    def __init__(self, op: str, url: str, code: str | None, status: int | None, message: str,
                 attempts: int) -> None:
        self.op, self.url, self.code, self.status = op, url, code, status
        self.attempts = attempts
        self.lost = False  # a try got no HTTP answer (set by the choke point)
        hint = _HINTS.get(code or "", "")
        what = " ".join(x for x in (str(status) if status else "", code or "") if x)
        tries = f" after {attempts} tries" if attempts > 1 else ""
        super().__init__(f"{op}: {hint + '; ' if hint else ''}"
                         f"{'HTTP ' + what + ': ' if what else ''}{message}{tries}")

    @property
    def gone(self) -> bool:
        """No such object (not: no such bucket)."""
        return self.code in ("NoSuchKey", "404", "NotFound") or (
            self.status == 404 and self.code != "NoSuchBucket")


class _Body(io.RawIOBase):
    """A file-like view of ``mv`` for botocore and aiohttp: ``read`` hands out slices of the
    caller's buffer (no copy), ``seek``/``tell`` let botocore sign and rewind it."""

    def __init__(self, mv: memoryview) -> None:
        super().__init__()
        self._mv = mv
        self._pos = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def read(self, n: int = -1):  # type: ignore[override]
        end = len(self._mv) if n is None or n < 0 else min(len(self._mv), self._pos + n)
        out = self._mv[self._pos:end]
        self._pos = end
        return out

    def readinto(self, b) -> int:
        out = self.read(len(b))
        b[:len(out)] = out
        return len(out)

    def seek(self, offset: int, whence: int = 0) -> int:
        base = {0: 0, 1: self._pos, 2: len(self._mv)}[whence]
        self._pos = max(0, min(len(self._mv), base + offset))
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._mv)

    def close(self) -> None:  # aiohttp may close what it sent: the view stays the caller's
        pass

    def drop(self) -> None:
        """Forget the caller's buffer once the request is over: a body kept alive by the HTTP
        client's objects (a response, an exception's traceback) must not pin it (an mmap or
        a pooled buffer that has a view exported cannot be closed)."""
        self._mv = memoryview(b"")
        self._pos = 0


def _error_info(e: BaseException) -> tuple[str | None, int | None, str]:
    """(S3 error code, HTTP status, message) of a botocore error; (None, None, str) else."""
    resp = getattr(e, "response", None)
    if isinstance(resp, dict):
        err = resp.get("Error") or {}
        status = (resp.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        code = err.get("Code")
        if code is not None:
            code = str(code)
        return code, status, str(err.get("Message") or e)
    return None, None, f"{type(e).__name__}: {e}"


def _retryable(e: BaseException) -> bool:
    code, status, _ = _error_info(e)
    if code is not None or status is not None:
        return code in _RETRY_CODES or status in _RETRY_STATUS
    # no answer: a connection refused, reset or cut mid-response, a socket timeout
    import aiohttp
    import botocore.exceptions as bx
    return isinstance(e, (bx.HTTPClientError, bx.ConnectionError, aiohttp.ClientError,
                          asyncio.IncompleteReadError, ConnectionError, _ShortRead,
                          asyncio.TimeoutError))


class _ShortRead(Exception):
    """A GET whose body ended before the bytes its range asked for."""


class _Limit:
    """The process's in-flight request limit, shared by every view of one storage; the
    semaphore is made on first use, on the event loop that uses it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._sem: asyncio.Semaphore | None = None

    def get(self) -> asyncio.Semaphore:
        if self._sem is None:
            self._sem = asyncio.Semaphore(self.n)
        return self._sem


class S3Calls:
    """The request methods of :class:`~fastckpt.storage.s3.S3Storage` (a mixin: it uses the
    storage's client, limit, stats, bounds and ``display``)."""

    def _split(self, path: str) -> tuple[str, str]:
        bucket, key, _ = self.fs.split_path(path)
        return bucket, key

    async def _request(self, op: str, path: str, until: float, *, body: memoryview | None = None,
                       into: memoryview | None = None, whole: bool = False,
                       bucket_op: bool = False, **kw):
        """One S3 request ``op`` (a client method: "put_object", "upload_part", ...) on
        ``path``, in a slot of the in-flight limit, with retries (see the module docstring)
        until the monotonic time ``until``. ``body``: sent as the request body (a fresh view
        per try); ``into``: a GET's body is streamed into it (its length is the range's);
        ``whole``: a GET's whole body is read, as bytes, into ``out["Body"]``; ``bucket_op``:
        a request on the bucket (listings), ``path`` only names what it concerns."""
        bucket, key = self._split(path)
        url = self.display(path)
        client = await self.fs.set_session()
        attempt = 0
        lost = False  # a try got no answer: the store may still apply it
        while True:
            attempt += 1
            args = dict(kw, Bucket=bucket) if bucket_op else dict(kw, Bucket=bucket, Key=key)
            sent = args["Body"] = _Body(body) if body is not None else None
            if sent is None:
                del args["Body"]
            try:
                async with self._limit.get():
                    self.stats["requests"] += 1
                    out = await getattr(client, op)(**args)
                    if into is not None:
                        await self._read_body(out["Body"], into)
                        self.stats["bytes_down"] += len(into)
                    elif whole:
                        stream = out["Body"]
                        try:
                            data = await stream.read()
                        finally:
                            stream.close()
                        if len(data) != int(out.get("ContentLength", len(data))):
                            raise _ShortRead(f"the body ended after {len(data)} of "
                                             f"{out['ContentLength']} bytes")
                        out["Body"] = data
                        self.stats["bytes_down"] += len(data)
                    elif sent is not None:
                        self.stats["bytes_up"] += len(body)
                        sent.drop()
                    if lost and isinstance(out, dict):  # an earlier try may have been applied
                        out[LOST_TRY] = True
                    return out
            except asyncio.CancelledError:
                raise
            except Exception as e:  # noqa: BLE001 - classified below
                if sent is not None:
                    sent.drop()
                code, status, msg = _error_info(e)
                lost = lost or (code is None and status is None)
                if code in _THROTTLE_CODES or status in (429, 503):
                    self.stats["throttled"] += 1
                left = until - time.monotonic()
                sleep = _JITTER.uniform(0, min(RETRY_CAP_S, RETRY_BASE_S * 2 ** (attempt - 1)))
                if not _retryable(e) or attempt >= self.max_attempts or sleep >= left:
                    err = S3RequestError(op, url, code, status, msg, attempt)
                    err.lost = lost
                    raise err from e
                self.stats["retries"] += 1
                log.debug("fastckpt: %s %s: %s (try %d of %d), again in %.2f s", op, url,
                          code or msg, attempt, self.max_attempts, sleep)
                await asyncio.sleep(sleep)

    @staticmethod
    async def _read_body(stream, into: memoryview) -> None:
        pos, n = 0, len(into)
        try:
            while pos < n:
                got = await stream.readinto(into[pos:])
                if not got:
                    raise _ShortRead(f"the body ended after {pos} of {n} bytes")
                pos += got
        finally:
            stream.close()

    def _submit(self, op: str, coro_fn, *args, nbytes: int = 0, timeout: float | None = None,
                **kw):
        """Start ``coro_fn(*args, until=..., **kw)`` on the loop under the bound (see
        ``FsspecStorage._run``); returns (future, timeout, bound description)."""
        timeout, bound = self._bound(op, nbytes, timeout)
        until = time.monotonic() + timeout
        fut = asyncio.run_coroutine_threadsafe(coro_fn(*args, until=until, **kw), self.fs.loop)
        return fut, timeout, bound

    def _op(self, op: str, path: str, *, nbytes: int = 0, timeout: float | None = None,
            what: str, offset: int | None = None, missing_ok: bool = False, **kw):
        """One bounded request through the choke point; errors as StorageError naming the
        URL (``what``: the operation in words). ``missing_ok``: NoSuchKey returns None."""
        try:
            fut, t, bound = self._submit(op, self._request, op, path, nbytes=nbytes,
                                         timeout=timeout, **kw)
            return self._wait(op, fut, t, bound)
        except S3RequestError as e:
            gone = e.gone
            if missing_ok and gone:
                return None
            err = StorageError(f"{what} failed: {e}", file=self.display(path), offset=offset)
            err.errno = errno.ENOENT if gone else (errno.EACCES if e.status == 403 else None)
            # a try without an HTTP answer (a connection cut): the store may still apply it
            err.answered = not e.lost  # type: ignore[attr-defined]
            raise err from e
        except Exception as e:
            raise storage_error(e, what, self.display(path), offset=offset) from e

    # -- Storage: small calls ------------------------------------------------------------------

async def _all(coros) -> list:
    """Run the coroutines at once; the first failure cancels the rest (and waits for them)
    and is raised. Results in order."""
    tasks = [asyncio.ensure_future(c) for c in coros]
    try:
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in tasks:
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise t.exception()
        return [t.result() for t in tasks]
    finally:
        for t in tasks:
            if not t.done():
                t.cancel()
        rest = [t for t in tasks if not t.done()]
        if rest:
            await asyncio.wait(rest)

