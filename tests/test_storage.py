"""The Storage contract, written once and run against every backend.

``StorageContract`` holds the tests; each backend is a subclass that provides the ``st``
fixture (a fresh, empty root) and a few hooks: LocalStorage on tmp_path, FsspecStorage on
``memory://`` and S3Storage on ``s3://bucket/prefix`` through the moto server on 127.0.0.1.
S3-specific behaviour (multipart boundary, concurrent parts, aborted uploads, unreachable
endpoint) follows.
"""

from __future__ import annotations

import errno
import gc
import os
import socket
import threading
import uuid

import pytest
import xxhash

from fastckpt import StorageError
from fastckpt.storage.native import aligned_buffer
from fastckpt.storage import LocalStorage, Storage, open_storage
from fastckpt.storage.fsspec_backend import FsspecStorage
from fastckpt.storage.s3 import S3Storage

# an fsspec file left unclosed commits itself (or fails loudly) in __del__: make that an error
pytest_plugins = ["tests.s3fixtures"]  # the s3_server (one per session) and s3 fixtures

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")

MiB = 1 << 20
SIZES = [0, 1, 5 * MiB + 7, 40 * MiB]  # 40 MiB is 5 parts of 8 MiB on s3


def _data(n: int) -> bytes:
    return os.urandom(n) if n else b""


def _staged(data: bytes) -> memoryview:
    buf = aligned_buffer(len(data))
    buf[:len(data)] = data
    return buf


def _h(b) -> int:
    return xxhash.xxh3_64_intdigest(bytes(b))


class _InjectedFault(OSError):
    def __init__(self) -> None:
        super().__init__(errno.EIO, "injected fault: the connection dropped mid-upload")


class StorageContract:
    """Every backend passes these. Subclasses provide the ``st`` fixture and the hooks."""

    #: a shard write that fails leaves no object at its path (object stores: aborted upload)
    failed_write_leaves_nothing = True

    # -- hooks -------------------------------------------------------------------------------
    def unwritable(self, st: Storage, request) -> Storage:
        """A storage whose root cannot be written."""
        raise NotImplementedError

    def inject_write_failure(self, st: Storage, monkeypatch, after: int,
                             exc: type[BaseException] = _InjectedFault) -> None:
        """Make the next shard write raise ``exc`` once ``after`` bytes went out."""
        raise NotImplementedError

    def visible(self, st: Storage, path: str) -> bool:
        return st.size(path) is not None

    def pending_uploads(self, request) -> list:
        """Uploads begun and neither completed nor aborted (object stores)."""
        return []

    # -- makedirs / listdir ------------------------------------------------------------------
    def test_join(self, st):
        assert st.join("a", "b") == st.root + "/a/b"
        assert not st.root.endswith("/") or st.root == "/"

    def test_makedirs_nested_and_idempotent(self, st):
        d = st.join("a", "b", "c")
        st.makedirs(d)
        st.makedirs(d)
        st.publish(d + "/f", b"x")
        assert st.listdir(st.join("a", "b")) == ["c"]
        assert st.read_bytes(d + "/f") == b"x"

    def test_listdir_missing_is_empty(self, st):
        assert st.listdir(st.join("nope")) == []
        assert st.listdir(st.join("nope", "deeper")) == []

    def test_listdir_base_names_sorted(self, st):
        for rel in ("d/b/x", "d/b/y", "d/a", "d/c/z/w", "d2/q"):
            parent = st.join(*rel.split("/")[:-1])
            st.makedirs(parent)
            st.publish(st.join(*rel.split("/")), rel.encode())
        assert st.listdir(st.join("d")) == ["a", "b", "c"]
        assert st.listdir(st.join("d", "b")) == ["x", "y"]
        assert st.listdir(st.join("d", "c")) == ["z"]
        assert {"d", "d2"} <= set(st.listdir(st.root))

    # -- read_bytes / size --------------------------------------------------------------------
    def test_read_bytes_and_size(self, st):
        st.makedirs(st.root)
        p = st.join("small")
        st.publish(p, b"hello\x00world")
        assert st.read_bytes(p) == b"hello\x00world"
        assert st.size(p) == 11
        st.publish(st.join("empty"), b"")
        assert st.size(st.join("empty")) == 0
        assert st.read_bytes(st.join("empty")) == b""

    def test_size_missing_is_none(self, st):
        assert st.size(st.join("missing")) is None
        assert st.size(st.join("no", "such", "file")) is None

    def test_read_bytes_missing_names_the_path(self, st):
        p = st.join("missing.json")
        with pytest.raises(StorageError) as ei:
            st.read_bytes(p)
        assert p.lstrip("/") in str(ei.value) and p.lstrip("/") in ei.value.file

    # -- write_shard / read_into --------------------------------------------------------------
    @pytest.mark.parametrize("n", SIZES, ids=["0B", "1B", "5MiB+7", "40MiB"])
    def test_write_shard_hashes_and_read_back(self, st, n):
        data = _data(n)
        st.makedirs(st.join("s"))
        p = st.join("s", "r00000-abc.fck")
        ranges = [(0, n), (0, min(n, 100)), (n // 3, n // 3), (n - min(n, 1), min(n, 1))]
        if n > 2 * MiB:
            ranges += [(4096, MiB), (MiB + 13, 2 * MiB)]
        hashes = st.write_shard(p, _staged(data), n, ranges)
        assert hashes == [_h(data[o:o + k]) for o, k in ranges]
        assert st.size(p) == n
        assert st.listdir(st.join("s")) == ["r00000-abc.fck"]
        # read back at offsets (unaligned ones included), into aligned buffers
        for off, k in [(0, n), (n // 2, n - n // 2), (min(n, 4097), max(0, min(n - 4097, 3))),
                       (max(0, n - 1), min(n, 1))] + ([(17 * MiB + 5, 20 * MiB)]
                                                      if n > 38 * MiB else []):
            buf = aligned_buffer(max(k, 1))
            assert st.read_into(p, off, buf, k) == _h(data[off:off + k]), (off, k)
            assert bytes(buf[:k]) == data[off:off + k], (off, k)

    def test_write_shard_only_first_nbytes(self, st):
        data = _data(10000)
        st.makedirs(st.root)
        p = st.join("part.fck")
        hs = st.write_shard(p, _staged(data), 5000, [(10, 20), (0, 5000)])
        assert hs == [_h(data[10:30]), _h(data[:5000])]
        assert st.size(p) == 5000

    def test_write_shard_overwrites(self, st):
        st.makedirs(st.root)
        p = st.join("again.fck")
        st.write_shard(p, _staged(b"a" * 9000), 9000, [])
        st.write_shard(p, _staged(b"b" * 100), 100, [])
        assert st.size(p) == 100
        buf = aligned_buffer(100)
        assert st.read_into(p, 0, buf, 100) == _h(b"b" * 100)

    def test_read_into_missing_names_the_path(self, st):
        p = st.join("gone.fck")
        with pytest.raises(StorageError) as ei:
            st.read_into(p, 0, aligned_buffer(4096), 10)
        assert p.lstrip("/") in str(ei.value)

    def test_read_into_past_the_end_fails(self, st):
        st.makedirs(st.root)
        p = st.join("short.fck")
        st.write_shard(p, _staged(b"z" * 100), 100, [])
        with pytest.raises(StorageError) as ei:
            st.read_into(p, 50, aligned_buffer(4096), 100)
        assert p.lstrip("/") in str(ei.value)

    def test_concurrent_shard_writes(self, st):
        """The training thread and the writer thread may use one instance at once."""
        st.makedirs(st.join("c"))
        blobs = {i: _data(MiB + i) for i in range(4)}
        out, errs = {}, []

        def w(i):
            try:
                out[i] = st.write_shard(st.join("c", f"{i}.fck"), _staged(blobs[i]),
                                        len(blobs[i]), [(0, 10)])
            except BaseException as e:  # pragma: no cover - reported below
                errs.append(e)
        ts = [threading.Thread(target=w, args=(i,)) for i in blobs]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errs
        for i, b in blobs.items():
            assert out[i] == [_h(b[:10])]
            assert st.size(st.join("c", f"{i}.fck")) == len(b)

    # -- failures -----------------------------------------------------------------------------
    def test_failed_shard_write_is_a_storage_error_and_leaves_nothing(self, st, monkeypatch,
                                                                      request):
        n = 40 * MiB
        data = _data(n)
        st.makedirs(st.join("f"))
        p = st.join("f", "r00001-dead.fck")
        with monkeypatch.context() as mp, pytest.raises(StorageError) as ei:
            self.inject_write_failure(st, mp, after=20 * MiB)
            st.write_shard(p, _staged(data), n, [(0, n)])
        assert p.lstrip("/") in str(ei.value)
        assert "injected fault" in str(ei.value) or "injected fault" in str(ei.value.__cause__)
        if self.failed_write_leaves_nothing:
            assert not self.visible(st, p)
            assert "r00001-dead.fck" not in st.listdir(st.join("f"))
            assert self.pending_uploads(request) == []  # s3: the multipart upload was aborted
        # the storage is still usable afterwards
        assert st.write_shard(p, _staged(b"ok"), 2, [(0, 2)]) == [_h(b"ok")]
        assert st.read_bytes(p) == b"ok"

    def test_check_writable(self, st):
        st.check_writable()  # the root need not exist yet
        assert ".fastckpt-write-probe" not in st.listdir(st.root)

    def test_check_writable_fails_naming_the_root(self, st, request):
        bad = self.unwritable(st, request)
        with pytest.raises(StorageError) as ei:
            bad.check_writable()
        assert bad.root.lstrip("/") in str(ei.value)

    # -- publish ------------------------------------------------------------------------------
    def test_publish_manifest_commits_and_replaces(self, st):
        """The commit point: a first manifest, the same bytes again (a retried commit), a
        re-save's manifest over it; conditional where the backend can (s3)."""
        st.makedirs(st.join("s"))
        p = st.join("s", "manifest.json")
        st.publish_manifest(p, b'{"a": 1}')
        st.publish_manifest(p, b'{"a": 1}')
        st.publish_manifest(p, b'{"a": 2}')
        assert st.read_bytes(p) == b'{"a": 2}'
        assert st.listdir(st.join("s")) == ["manifest.json"]

    def test_conditional_writes_where_offered(self, st):
        """put-if-absent and If-Match: exactly the writes whose condition holds land."""
        from fastckpt.storage.base import ConditionFailed
        if not st.conditional_writes():
            with pytest.raises(NotImplementedError):
                st.put_conditional(st.join("c"), b"1", if_absent=True)
            return
        p = st.join("c")
        v1 = st.put_conditional(p, b"1", if_absent=True)
        with pytest.raises(ConditionFailed):
            st.put_conditional(p, b"x", if_absent=True)
        data, tag = st.read_versioned(p)
        assert data == b"1" and tag == v1
        v2 = st.put_conditional(p, b"2", if_match=v1)
        with pytest.raises(ConditionFailed):
            st.put_conditional(p, b"3", if_match=v1)  # a stale version
        assert st.read_versioned(p) == (b"2", v2)
        assert st.read_versioned(st.join("missing")) is None

    def test_publish_creates_then_overwrites(self, st):
        st.makedirs(st.join("m"))
        p = st.join("m", "manifest.json")
        st.publish(p, b"old" * 10)
        assert st.read_bytes(p) == b"old" * 10
        st.publish(p, b"new!")
        assert st.read_bytes(p) == b"new!"
        assert st.size(p) == 4
        assert st.listdir(st.join("m")) == ["manifest.json"]  # no temporaries left behind

    def test_publish_is_atomic_for_readers(self, st):
        """A reader polling while the object is replaced sees the whole old or the whole new."""
        st.makedirs(st.join("a"))
        p = st.join("a", "manifest.json")
        old, new = b"o" * (MiB + 1), b"n" * (2 * MiB - 3)
        st.publish(p, old)
        seen, bad, stop = set(), [], threading.Event()

        def reader():
            while not stop.is_set():
                try:
                    b = st.read_bytes(p)
                except Exception as e:  # a missing object is a torn publish too
                    bad.append(repr(e))
                    continue
                if b not in (old, new):
                    bad.append(f"torn read: {len(b)} bytes")
                seen.add(b[:1])
        t = threading.Thread(target=reader)
        t.start()
        try:
            for i in range(12):
                st.publish(p, new if i % 2 == 0 else old)
        finally:
            stop.set()
            t.join()
        assert not bad, bad[:3]
        assert st.read_bytes(p) == old
        assert seen  # the reader did run

    # -- remove / remove_dir -----------------------------------------------------------------
    def test_remove_and_missing_ok(self, st):
        st.makedirs(st.root)
        p = st.join("x")
        st.publish(p, b"1")
        st.remove(p)
        assert st.size(p) is None
        st.remove(p)
        st.remove(st.join("never", "was"))

    def test_remove_dir_recursive_and_missing_ok(self, st):
        for rel in ("step-1/a", "step-1/sub/b", "step-10/c", "step-1x"):
            parts = rel.split("/")
            st.makedirs(st.join(*parts[:-1]))
            st.publish(st.join(*parts), b"data")
        st.remove_dir(st.join("step-1"))
        assert st.listdir(st.join("step-1")) == []
        assert st.size(st.join("step-1", "sub", "b")) is None
        # siblings sharing the name as a prefix survive
        assert st.read_bytes(st.join("step-10", "c")) == b"data"
        assert st.read_bytes(st.join("step-1x")) == b"data"
        assert "step-1" not in st.listdir(st.root)
        st.remove_dir(st.join("step-1"))
        st.remove_dir(st.join("never"))


# ----------------------------------------------------------------------------------- backends

class TestLocalStorage(StorageContract):
    # a local partial shard stays until the coordinator or retention removes it: no manifest
    # references it, so it is harmless (object stores must not even show it)
    failed_write_leaves_nothing = False

    @pytest.fixture
    def st(self, tmp_path):
        return LocalStorage(str(tmp_path / "root"))

    def unwritable(self, st, request):
        blocker = os.path.join(os.path.dirname(st.root), "a-file")
        with open(blocker, "wb") as f:
            f.write(b"not a directory")
        return LocalStorage(os.path.join(blocker, "root"))

    def inject_write_failure(self, st, monkeypatch, after, exc=_InjectedFault):
        real = st.io

        class Failing:
            def __getattr__(self, name):
                return getattr(real, name)

            def write_file(self, path, buf, nbytes, ranges, **kw):
                with open(path, "wb") as f:  # some bytes reached the file, then the device failed
                    f.write(bytes(memoryview(buf)[:min(after, nbytes)]))
                raise exc()
        monkeypatch.setattr(st, "io", Failing())

    def test_error_hint_for_full_device(self, st, monkeypatch):
        class Full(OSError):
            def __init__(self):
                super().__init__(errno.ENOSPC, "No space left on device")
        self.inject_write_failure(st, monkeypatch, after=0, exc=Full)
        st.makedirs(st.root)
        with pytest.raises(StorageError, match="device is full") as ei:
            st.write_shard(st.join("x.fck"), _staged(b"abc"), 3, [])
        assert ei.value.errno == errno.ENOSPC


class _FsspecExtras:
    def test_large_read_in_concurrent_pieces(self, st, monkeypatch):
        from fastckpt.storage import fsspec_backend
        monkeypatch.setattr(fsspec_backend, "_READ_PIECE", 64 * 1024)
        n = MiB + 3
        data = _data(n)
        st.makedirs(st.root)
        p = st.join("pieces.fck")
        st.write_shard(p, _staged(data), n, [])
        for off, k in ((0, n), (1, n - 1), (70000, 200001), (5, 128 * 1024 + 1)):
            buf = aligned_buffer(k)
            assert st.read_into(p, off, buf, k) == _h(data[off:off + k]), (off, k)
            assert bytes(buf[:k]) == data[off:off + k]
        with pytest.raises(StorageError, match="pieces.fck"):  # short, or a range past the end
            st.read_into(p, n - 200000, aligned_buffer(300000), 300000)


class TestMemoryStorage(_FsspecExtras, StorageContract):
    @pytest.fixture
    def st(self):
        root = f"memory://fastckpt-test-{uuid.uuid4().hex[:12]}/root"
        st = open_storage(root)
        assert isinstance(st, FsspecStorage)
        yield st
        try:
            st.fs.rm(st.root.rsplit("/", 1)[0], recursive=True)
        except FileNotFoundError:
            pass

    def unwritable(self, st, request):
        st.makedirs(st.join("x"))
        st.publish(st.join("x", "a-file"), b"not a directory")
        return open_storage("memory://" + st.join("x", "a-file", "root").lstrip("/"))

    def inject_write_failure(self, st, monkeypatch, after, exc=_InjectedFault):
        from fsspec.implementations.memory import MemoryFile
        real = MemoryFile.write

        def write(self, data):
            if self.tell() + len(data) > after:
                raise exc()
            return real(self, data)
        monkeypatch.setattr(MemoryFile, "write", write)


class TestS3Storage(StorageContract):
    @pytest.fixture
    def st(self, s3):
        st = open_storage(s3.url("prefix", "run"), storage_options=s3.storage_options)
        assert isinstance(st, S3Storage)
        return st

    def unwritable(self, st, request):
        s3 = request.getfixturevalue("s3")
        return open_storage(f"s3://no-such-bucket-{uuid.uuid4().hex[:8]}/run",
                            storage_options=s3.storage_options)

    def pending_uploads(self, request):
        return request.getfixturevalue("s3").multipart_uploads()

    def inject_write_failure(self, st, monkeypatch, after, exc=_InjectedFault):
        """Part and PUT requests whose bytes would take the upload past ``after`` fail (the
        parts go out at once: which ones got through before is not fixed)."""
        real = S3Storage._request
        sent = {"n": 0}

        async def request(self, op, path, until, *, body=None, **kw):
            if body is not None and op in ("upload_part", "put_object"):
                if sent["n"] + len(body) > after:
                    raise exc()
                sent["n"] += len(body)
            return await real(self, op, path, until, body=body, **kw)
        monkeypatch.setattr(S3Storage, "_request", request)

    # -- s3 only -----------------------------------------------------------------------------
    def test_multipart_boundary(self, st, s3):
        """Up to part_bytes (8 MiB) one PUT; above it a multipart upload of 8 MiB parts sent
        at once, completed."""
        st.makedirs(st.root)
        for name, n in (("small.fck", 5 * MiB + 7), ("exact.fck", 8 * MiB),
                        ("big.fck", 40 * MiB + 1)):
            data = _data(n)
            st.write_shard(st.join(name), _staged(data), n, [])
            assert st.read_bytes(st.join(name)) == data
        s3.fs.invalidate_cache()
        etags = {k: s3.fs.info(st.join(k))["ETag"].strip('"')
                 for k in ("small.fck", "exact.fck", "big.fck")}
        assert "-" not in etags["small.fck"] and "-" not in etags["exact.fck"]
        assert etags["big.fck"].endswith("-6")  # 5 x 8 MiB + 1 byte
        assert s3.multipart_uploads() == []
        assert s3.keys() == ["prefix/run/big.fck", "prefix/run/exact.fck", "prefix/run/small.fck"]

    def test_parts_and_ranges_go_out_at_once(self, s3):
        """An upload's parts and a read's ranges are in flight together, at most
        ``concurrency`` of them in the whole process."""
        st = open_storage(s3.url("conc"), storage_options=s3.storage_options,
                          remote={"part_bytes": 5 * MiB, "concurrency": 3})
        real = S3Storage._request
        now, peak = {"n": 0}, {"n": 0}
        import asyncio

        async def request(self, op, path, until, **kw):
            now["n"] += 1
            peak["n"] = max(peak["n"], now["n"])
            try:
                await asyncio.sleep(0.05)  # long enough for the others to start
                return await real(self, op, path, until, **kw)
            finally:
                now["n"] -= 1
        n = 30 * MiB
        data = _data(n)
        mp = pytest.MonkeyPatch()
        try:
            mp.setattr(S3Storage, "_request", request)
            st.write_shard(st.join("c.fck"), _staged(data), n, [])
            up = peak["n"]
            peak["n"] = 0
            buf = aligned_buffer(n)
            assert st.read_into(st.join("c.fck"), 0, buf, n) == _h(data)
        finally:
            mp.undo()
        assert up >= 3 and peak["n"] >= 3  # begin, then 6 parts of which 3 at once
        assert st.stats["requests"] >= 1 + 6 + 1 + 6

    def test_failure_in_the_last_part_aborts_the_upload(self, st, s3, monkeypatch):
        """One part fails for good: the others are cancelled, the upload aborted, nothing
        visible, and the error names the URL and the part's offset."""
        real = S3Storage._request

        async def request(self, op, path, until, **kw):
            if op == "upload_part" and kw.get("PartNumber") == 3:
                raise _InjectedFault()
            return await real(self, op, path, until, **kw)
        n = 24 * MiB  # parts 1-3 of 8 MiB
        p = st.join("last.fck")
        with monkeypatch.context() as mp, pytest.raises(StorageError, match="injected fault") \
                as ei:
            mp.setattr(S3Storage, "_request", request)
            st.write_shard(p, _staged(_data(n)), n, [])
        assert ei.value.offset == 16 * MiB and "last.fck" in str(ei.value)
        assert st.size(p) is None
        assert s3.keys() == []
        assert s3.multipart_uploads() == []

    def test_interrupt_mid_upload_commits_nothing(self, st, s3, monkeypatch):
        """KeyboardInterrupt/SystemExit (a preemption handler) in the calling thread while the
        parts are in flight: re-raised as is, the upload cancelled and aborted, nothing
        visible."""
        import time as _time
        real_io = st.io

        class Interrupting:
            def __getattr__(self, name):
                return getattr(real_io, name)

            def hash(self, buf, n):  # runs while the parts are in flight
                t0 = _time.monotonic()
                while st.stats["bytes_up"] == 0 and _time.monotonic() - t0 < 30:
                    _time.sleep(0.01)
                raise KeyboardInterrupt
        monkeypatch.setattr(st, "io", Interrupting())
        n = 40 * MiB
        p = st.join("interrupted.fck")
        with pytest.raises(KeyboardInterrupt):
            st.write_shard(p, _staged(_data(n)), n, [(0, n)])
        gc.collect()
        assert st.stats["bytes_up"] > 0  # it was interrupted mid-upload
        assert st.size(p) is None
        assert s3.keys() == []
        assert s3.multipart_uploads() == []

    def test_failed_small_write_leaves_nothing(self, st, s3, monkeypatch):
        p = st.join("small.fck")
        with monkeypatch.context() as mp, pytest.raises(StorageError, match="injected fault"):
            self.inject_write_failure(st, mp, after=MiB)
            st.write_shard(p, _staged(_data(3 * MiB)), 3 * MiB, [])
        assert s3.keys() == [] and s3.multipart_uploads() == []

    def test_makedirs_does_not_touch_the_bucket(self, st, s3):
        st.makedirs(st.join("a", "b"))
        assert s3.keys() == []  # object stores have no directories: nothing to create
        other = open_storage(f"s3://missing-{uuid.uuid4().hex[:8]}/x",
                             storage_options=s3.storage_options)
        other.makedirs(other.join("y"))  # never creates a bucket
        s3.fs.invalidate_cache()
        assert not s3.fs.exists(other.root.split("/", 1)[0])

    def test_unreachable_endpoint_is_a_storage_error(self, s3):
        with socket.socket() as s:  # a loopback port with nothing listening
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        opts = {"key": "test", "secret": "test", "skip_instance_cache": True,
                "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{port}",
                                  "region_name": "us-east-1"},
                "config_kwargs": {"retries": {"max_attempts": 1, "mode": "standard"},
                                  "connect_timeout": 2}}
        # two tries, not the default eight: a refused connection is retried (with backoff) and
        # then named; eight tries would only add ~25 s of backoff to this test
        st = open_storage(f"s3://{s3.bucket}/run", storage_options=opts,
                          remote={"max_attempts": 2})
        with pytest.raises(StorageError) as ei:
            st.check_writable()
        assert f"{s3.bucket}/run" in str(ei.value) and "after 2 tries" in str(ei.value)
        with pytest.raises(StorageError) as ei:
            st.read_bytes(st.join("manifest.json"))
        assert f"{s3.bucket}/run/manifest.json" in str(ei.value)
        assert "EndpointConnectionError" in str(ei.value) and "after 2 tries" in str(ei.value)

    def test_guard_refuses_non_loopback(self, s3):
        with socket.socket() as s, pytest.raises(ConnectionRefusedError, match="test guard"):
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: refused before any packet is sent
        assert s3.guard.violations == ["('192.0.2.1', 9)"]
        s3.guard.violations.clear()


def test_an_fsspec_root_with_glob_characters_removes_only_its_own_steps():
    """fsspec's ``rm`` takes ``[``, ``*`` and ``?`` in a path as a glob pattern: retention and
    ``fastckpt gc`` in a root ``.../run[1]`` removed the steps of the root ``.../run1`` and left
    their own shards behind (before 2026-12-06). Real fsspec memory:// file system (gcsfs
    and adlfs expand paths the same way; S3 deletes by prefix)."""
    import fsspec
    import torch

    import fastckpt
    from fastckpt.tools import plan_gc, run_gc
    fs = fsspec.filesystem("memory")
    b = f"b-{uuid.uuid4().hex[:8]}"
    other, root = f"memory://{b}/run1", f"memory://{b}/run[1]"
    with fastckpt.Checkpointer(other) as ck:
        for s in (1, 2, 3):
            ck.save({"w": torch.full((64,), float(s))}, step=s, block=True)
    with fastckpt.Checkpointer(root, keep_last=1) as ck:
        for s in (1, 2, 3):
            ck.save({"w": torch.full((64,), float(s))}, step=s, block=True)
    assert fastckpt.steps(other) == [1, 2, 3] and fastckpt.steps(root) == [3]
    assert not [p for p in fs.store if p.startswith(f"/{b}/run[1]/step-0000000001")]
    other2, root2 = f"memory://{b}/x", f"memory://{b}/[x]"
    for r in (other2, root2):
        with fastckpt.Checkpointer(r) as ck:
            for s in (1, 2):
                ck.save({"w": torch.full((64,), float(s))}, step=s, block=True)
    acts = run_gc(root2, plan_gc(root2, keep=1))
    assert [a.record.step for a in acts if a.done] == [1]
    assert fastckpt.steps(other2) == [1, 2] and fastckpt.steps(root2) == [2]
