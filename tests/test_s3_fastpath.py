"""The s3 fast path against a model of a real store: the moto server on 127.0.0.1 behind
``tests/s3throttle.py`` (a child process that caps each connection, adds a round trip per
request, answers with 503 SlowDown / 500 / 403 on demand, and can die mid-transfer).

What is checked: parts and ranged GETs really go out at once (the proxy counts the requests in
flight), throttling and server errors are retried and the rest are not, every failure is a
StorageError naming the URL and what to do, no credential reaches a log line or an error,
the manifest commit is conditional (put-if-absent, If-Match over the manifest it replaces,
plain PUTs where the store does not honour conditions), and a store that dies mid-upload
leaves no manifest, no unfinished upload that `fastckpt gc` cannot abort, and the previous
step loadable. Speed is not asserted here: benchmarks/bench_s3.py measures it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
import torch
import xxhash

import fastckpt
from fastckpt import StorageError
from fastckpt.storage import open_storage
from fastckpt.storage.native import aligned_buffer
from fastckpt.storage.s3 import S3RequestError, S3Storage
from tests.s3throttle import ThrottleProxy

pytest_plugins = ["tests.s3fixtures"]

pytestmark = [pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
              pytest.mark.timeout(180)]

MiB = 1 << 20
KEY, SECRET = "AKIAFASTCKPTNOTLOGGED", "s3cr3t-that-must-never-be-logged"


@pytest.fixture
def proxy(s3):
    with ThrottleProxy(s3.server.port) as p:
        yield p


def _options(s3, endpoint: str) -> dict:
    client = dict(s3.storage_options["client_kwargs"], endpoint_url=endpoint)
    return {**s3.storage_options, "client_kwargs": client, "skip_instance_cache": True,
            "key": KEY, "secret": SECRET}  # moto accepts any credentials


def _storage(s3, proxy, prefix: str = "run", **remote) -> S3Storage:
    st = open_storage(s3.url(prefix), storage_options=_options(s3, proxy.endpoint),
                      remote=remote)
    assert isinstance(st, S3Storage)
    return st


def _staged(data: bytes) -> memoryview:
    buf = aligned_buffer(max(len(data), 1))
    buf[:len(data)] = data
    return buf


def _h(b) -> int:
    return xxhash.xxh3_64_intdigest(bytes(b))


def _read(st, path: str, n: int) -> bytes:
    buf = aligned_buffer(max(n, 1))
    st.read_into(path, 0, buf, n)
    return bytes(buf[:n])


# ------------------------------------------------------------------------------- concurrency

def test_parts_and_ranges_are_in_flight_together(s3, proxy):
    proxy.set_latency(0.05)  # each request holds its slot a little: they overlap
    st = _storage(s3, proxy, part_bytes=5 * MiB, concurrency=4)
    n = 40 * MiB
    data = os.urandom(n)
    assert st.write_shard(st.join("a.fck"), _staged(data), n, [(0, n)]) == [_h(data)]
    up = proxy.stats()
    assert up["max_in_flight"] == 4, up  # 8 parts, 4 at a time, never more
    proxy.reset_stats()
    assert _read(st, st.join("a.fck"), n) == data
    down = proxy.stats()
    assert down["max_in_flight"] == 4 and down["requests"].get("GET") == 8, down

    # past botocore's default pool of 10 connections: the storage raises it to its concurrency
    many = _storage(s3, proxy, part_bytes=5 * MiB, concurrency=16)
    proxy.reset_stats()
    many.write_shard(many.join("m.fck"), _staged(data * 2), 2 * n, [])  # 16 parts
    assert proxy.stats()["max_in_flight"] == 16

    one = _storage(s3, proxy, part_bytes=5 * MiB, concurrency=1)
    proxy.reset_stats()
    one.write_shard(one.join("b.fck"), _staged(data), n, [])
    assert proxy.stats()["max_in_flight"] == 1  # the single stream a plain client would use


def test_an_engine_save_through_a_capped_store_uses_many_connections(s3, proxy):
    proxy.set_rate(16 * MiB)  # per connection: one stream would take 2 s for this state
    url = s3.url("eng")
    opts = _options(s3, proxy.endpoint)
    state = {"a": torch.randn(6 * MiB // 4), "b": torch.randn(20 * MiB // 4), "n": 3}
    with fastckpt.Checkpointer(url, storage_options=opts, remote_part_bytes=5 * MiB) as ck:
        ck.save(state, step=1, block=True)
    assert proxy.stats()["max_in_flight"] >= 4
    proxy.reset_stats()
    dest = {"a": torch.zeros_like(state["a"]), "b": torch.zeros_like(state["b"]), "n": 0}
    assert fastckpt.load(dest, url, storage_options=opts) == 1
    assert torch.equal(dest["a"], state["a"]) and torch.equal(dest["b"], state["b"])
    assert dest["n"] == 3
    assert proxy.stats()["max_in_flight"] >= 4


# ------------------------------------------------------------------------- the choke point

def test_slowdown_and_server_errors_are_retried(s3, proxy):
    st = _storage(s3, proxy, part_bytes=5 * MiB)
    proxy.inject(503, count=3, method="PUT", query_contains="partNumber")
    proxy.inject(500, count=2, method="GET")
    n = 12 * MiB
    data = os.urandom(n)
    st.write_shard(st.join("r.fck"), _staged(data), n, [])
    assert _read(st, st.join("r.fck"), n) == data
    assert proxy.stats()["injected"] == 5
    assert st.stats["retries"] == 5 and st.stats["throttled"] == 3
    assert s3.multipart_uploads() == []


def test_throttling_that_does_not_stop_fails_naming_it(s3, proxy):
    st = _storage(s3, proxy, part_bytes=5 * MiB, max_attempts=3)
    proxy.inject(503, count=None, method="PUT", query_contains="partNumber")
    p = st.join("t.fck")
    with pytest.raises(StorageError) as ei:
        st.write_shard(p, _staged(os.urandom(11 * MiB)), 11 * MiB, [])
    msg = str(ei.value)
    assert st.display(p) in msg and "SlowDown" in msg and "503" in msg and "3 tries" in msg
    assert isinstance(ei.value.__cause__, S3RequestError)
    proxy.clear_faults()
    assert st.size(p) is None and s3.multipart_uploads() == []  # aborted: nothing left


def test_access_denied_is_not_retried_and_says_what_to_check(s3, proxy):
    st = _storage(s3, proxy)
    proxy.inject(403, count=None, method="PUT")
    p = st.join("step-0000000001", "manifest.json")
    with pytest.raises(StorageError) as ei:
        st.publish(p, b"{}")
    msg = str(ei.value)
    assert st.display(p) in msg and "access denied" in msg and "403" in msg
    assert "tries" not in msg and st.stats["retries"] == 0
    assert ei.value.errno == 13  # EACCES
    with pytest.raises(StorageError, match="access denied"):
        st.check_writable()


def test_a_missing_bucket_is_named(s3):
    st = open_storage(f"s3://no-such-bucket-{os.getpid()}/run",
                      storage_options=s3.storage_options)
    with pytest.raises(StorageError) as ei:
        st.write_shard(st.join("x.fck"), _staged(b"x" * 10), 10, [])
    assert "bucket does not exist" in str(ei.value) and "no-such-bucket" in str(ei.value)
    with pytest.raises(StorageError, match="bucket does not exist"):
        st.listdir(st.root)


def test_credentials_are_never_in_a_log_line_or_an_error(s3, proxy, caplog):
    caplog.set_level(logging.DEBUG, logger="fastckpt")
    st = _storage(s3, proxy, part_bytes=5 * MiB, max_attempts=2)
    proxy.inject(503, count=None, method="PUT")
    errors = []
    for call in (lambda: st.write_shard(st.join("c.fck"), _staged(b"c" * (11 * MiB)),
                                        11 * MiB, []),
                 lambda: st.publish(st.join("m.json"), b"{}")):
        with pytest.raises(StorageError) as ei:
            call()
        errors.append(str(ei.value) + repr(ei.value.__cause__))
    proxy.clear_faults()
    proxy.inject(403, count=None, method="GET")
    with pytest.raises(StorageError) as ei:
        st.read_bytes(st.join("m.json"))
    errors.append(str(ei.value))
    logged = [r.getMessage() for r in caplog.records if r.name.startswith("fastckpt")]
    assert logged and any("again in" in m for m in logged)  # the retries were logged
    for text in logged + errors:
        assert SECRET not in text and KEY not in text, text


# ------------------------------------------------------------------------------ the commit

def test_the_manifest_is_put_if_absent_and_replaced_only_as_read(s3, proxy, monkeypatch):
    st = _storage(s3, proxy)
    p = st.join("step-0000000005", "manifest.json")
    st.publish_manifest(p, b'{"save": "a"}')
    assert st.conditional_writes()
    st.publish_manifest(p, b'{"save": "a"}')  # an earlier try that landed: the same bytes
    st.publish_manifest(p, b'{"save": "b"}')  # a re-save of the step replaces it
    assert st.read_bytes(p) == b'{"save": "b"}'
    # another writer puts a manifest between this one's read and its PUT: never overwritten
    real = S3Storage.read_bytes

    def racing(self, path):
        got = real(self, path)
        s3.fs.pipe_file(path, b'{"save": "other"}')
        return got
    monkeypatch.setattr(S3Storage, "read_bytes", racing)
    with pytest.raises(StorageError, match="manifest changed while this save committed"):
        st.publish_manifest(p, b'{"save": "c"}')
    monkeypatch.undo()
    assert st.read_bytes(p) == b'{"save": "other"}'
    assert [k for k in s3.keys("run") if "probe" in k] == []  # the probe cleaned up


def test_a_store_that_ignores_conditions_gets_plain_puts_with_a_warning(s3, proxy, monkeypatch,
                                                                         caplog):
    real = S3Storage._request

    async def ignoring(self, op, path, until, **kw):  # a store that drops the headers
        kw.pop("IfNoneMatch", None)
        kw.pop("IfMatch", None)
        return await real(self, op, path, until, **kw)
    monkeypatch.setattr(S3Storage, "_request", ignoring)
    st = _storage(s3, proxy)
    assert not st.conditional_writes()
    assert any("does not honour conditional writes" in r.getMessage() for r in caplog.records)
    st.publish_manifest(st.join("m"), b"1")
    st.publish_manifest(st.join("m"), b"2")
    assert st.read_bytes(st.join("m")) == b"2"
    strict = _storage(s3, proxy, conditional="require")
    with pytest.raises(StorageError, match="conditional='require'"):
        strict.publish_manifest(strict.join("m"), b"3")


def test_a_store_that_refuses_conditions_is_probed_once(s3, proxy):
    proxy.inject(501, code="NotImplemented", message="If-None-Match is not implemented",
                 count=1, method="PUT", path_contains="cond-probe")
    st = _storage(s3, proxy)
    assert not st.conditional_writes() and not st.conditional_writes()
    assert proxy.stats()["injected"] == 1
    off = _storage(s3, proxy, conditional="off")
    proxy.reset_stats()
    assert not off.conditional_writes() and proxy.stats()["requests"] == {}


# -------------------------------------------------------------------------- a store dying

def test_a_store_killed_mid_upload_loses_nothing(s3, proxy, capsys):
    """Step 1 committed; the store dies while step 2 uploads (every connection reset), and is
    back a moment later: the save fails naming the URL, step 2 has no manifest, no unfinished
    upload is left that gc does not abort, and step 1 loads bit-exact."""
    from fastckpt import cli
    proxy.set_rate(8 * MiB)  # step 2 takes a few seconds: the kill lands mid-upload
    url = s3.url("killed")
    opts = _options(s3, proxy.endpoint)
    state = {"w": torch.randn(24 * MiB // 4), "step": 1}
    with fastckpt.Checkpointer(url, storage_options=opts, remote_part_bytes=5 * MiB,
                               remote_max_attempts=2, commit_timeout_s=20) as ck:
        ck.save(state, step=1, block=True)
        first = state["w"].clone()
        state["w"].add_(1.0)
        proxy.reset_stats()
        h = ck.save(dict(state, step=2), step=2)
        t0 = time.monotonic()
        while proxy.stats()["bytes_up"] < 4 * MiB and time.monotonic() - t0 < 30:
            time.sleep(0.05)
        proxy.kill()
        threading.Timer(1.0, proxy.restart).start()
        with pytest.raises(fastckpt.FastCkptError) as ei:
            h.wait(timeout=120)
        assert "killed/step-0000000002" in str(ei.value) + str(ei.value.__cause__)
    time.sleep(1.5)
    assert not [k for k in s3.keys("killed") if k.endswith("step-0000000002/manifest.json")]
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["gc", url, "--grace", "0", "--yes", "--json"])
    assert s3.multipart_uploads() == []
    dest = {"w": torch.zeros_like(first), "step": 0}
    assert fastckpt.load(dest, url, storage_options=s3.storage_options) == 1
    assert torch.equal(dest["w"], first) and dest["step"] == 1


# ------------------------------------------------------------------------ the writer lease

def test_the_lease_on_s3_is_taken_with_conditional_writes(s3, proxy, caplog):
    """Of writers racing for a free lease exactly one wins (put-if-absent, no read-back
    wait); an expired lease is taken over with If-Match; the old holder learns it at its next
    renewal; a second job is refused naming the holder."""
    from fastckpt import WriterLockedError
    from fastckpt.lease import WriterLease
    stores = [_storage(s3, proxy, "lease") for _ in range(4)]
    for st in stores:  # each client's session is made by its first request: not in the race,
        st.size(st.join("warm"))  # whose calls are bounded by renew_s (1 s) each
    leases = [WriterLease(st, ttl_s=3, renew_s=1) for st in stores]
    assert all(lease._cond for lease in leases)
    won, lost = [], []

    def take(lease):
        try:
            won.append(lease.acquire())
        except WriterLockedError as e:
            lost.append(e)
    threads = [threading.Thread(target=take, args=(lease,)) for lease in leases]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(won) == 1 and len(lost) == 3, (won, lost)
    holder = won[0]
    assert all("another job" in str(e) for e in lost)
    holder._stop.set()  # the holder stops renewing (a stopped process): its lease expires
    holder._thread.join()
    time.sleep(3.2)
    taker = WriterLease(_storage(s3, proxy, "lease"), ttl_s=30, renew_s=10).acquire()
    caplog.clear()
    holder._stop.clear()
    holder.renew()  # over its own last version: refused, and said
    assert any("was taken over" in r.getMessage() for r in caplog.records)
    rec = json.loads(s3.fs.cat_file(s3.path("lease", ".writer.json")))
    assert rec["owner"] == taker.owner
    with pytest.raises(WriterLockedError, match="another job"):
        WriterLease(_storage(s3, proxy, "lease"), ttl_s=30, renew_s=10, wait_s=0.5).acquire()
    taker.release()
    assert not s3.fs.exists(s3.path("lease", ".writer.json"))


def test_a_lease_write_whose_answer_was_lost_is_its_own(s3, proxy):
    """A conditional PUT of the lease lands, its answer is lost, the retry fails the
    condition (the object is there now): the record read back is this holder's own, so the
    take and the renewal succeed. Before 2026-12-06 the take reported "another job took the
    writer lease" describing itself, and after a lost renewal answer every later renewal
    failed (a stale version): after the TTL another job could take a live holder's lease."""
    import botocore.exceptions as bx
    from fastckpt import WriterLockedError
    from fastckpt.lease import WriterLease
    st = _storage(s3, proxy, "lost")
    assert st.conditional_writes()
    client = st._run("session", st.fs.set_session)
    real, lost = client.put_object, []

    async def put_object(**kw):
        out = await real(**kw)
        cond = "IfNoneMatch" if "IfNoneMatch" in kw else "IfMatch" if "IfMatch" in kw else None
        if kw["Key"].endswith(".writer.json") and cond and cond not in lost:
            lost.append(cond)  # it landed; the answer never arrives (the client retries)
            raise bx.ConnectionClosedError(endpoint_url=proxy.endpoint)
        return out
    client.put_object = put_object
    lease = WriterLease(st, ttl_s=30, renew_s=10).acquire()
    lease.renew()
    lease.renew()  # over the version the lost answer carried: read back
    assert lost == ["IfNoneMatch", "IfMatch"]
    rec = json.loads(s3.fs.cat_file(s3.path("lost", ".writer.json")))
    assert rec == lease.record
    with pytest.raises(WriterLockedError, match="another job is writing"):
        WriterLease(_storage(s3, proxy, "lost"), ttl_s=30, renew_s=10, wait_s=0.5).acquire()
    lease.release()
    assert not s3.fs.exists(s3.path("lost", ".writer.json"))


@pytest.mark.parametrize("junk", [b"", b'{"owner": "abc", "rene', b"[]"])
def test_an_unreadable_lease_record_on_a_conditional_store_is_taken_over(s3, proxy, junk):
    # before 2026-12-06: put-if-absent over an object that is there, refused for good
    from fastckpt.lease import WriterLease
    s3.fs.pipe_file(s3.path("junk", ".writer.json"), junk)
    lease = WriterLease(_storage(s3, proxy, "junk"), ttl_s=30, renew_s=10, wait_s=2).acquire()
    rec = json.loads(s3.fs.cat_file(s3.path("junk", ".writer.json")))
    assert rec["owner"] == lease.owner
    lease.release()

