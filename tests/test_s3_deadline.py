"""No remote call waits without a bound: S3Storage when the endpoint stops answering.

The moto server on 127.0.0.1 sits behind ``tests/s3proxy.py``, a TCP proxy that can fall
silent (accepts and reads, never answers). Against it: a shard upload under a save deadline
raises StorageError soon after the deadline, whether the silence starts before the upload or
after its first part, and leaves no object and no upload that ``incomplete_uploads`` cannot
find and ``abort_upload`` cannot abort; every other call raises within its per-call bound;
without silence everything still round-trips. The server's own view is read directly (the
``s3`` fixture's file system), never through the proxy.
"""

from __future__ import annotations

import os
import time

import pytest
import xxhash

from fastckpt import StorageError
from fastckpt.storage.native import aligned_buffer
from fastckpt.storage.fsspec_backend import S3_CONFIG_DEFAULTS
from fastckpt.storage.s3 import S3Storage
from tests.s3proxy import SilentProxy

pytest_plugins = ["tests.s3fixtures"]  # the s3_server (one per session) and s3 fixtures

pytestmark = [pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
              pytest.mark.timeout(120)]  # a hang is a failure, not a stuck run

MiB = 1 << 20
SLACK_S = 5.0  # scheduling and teardown on a loaded machine: this is a no-hang bound


@pytest.fixture
def proxy(s3):
    with SilentProxy(s3.server.port) as p:
        yield p


def _options(s3, endpoint: str, **extra) -> dict:
    """The fixture's storage options (its credentials) with another endpoint, and a file
    system of their own (no instance shared with another test)."""
    client = dict(s3.storage_options["client_kwargs"], endpoint_url=endpoint)
    return {**s3.storage_options, "client_kwargs": client, "skip_instance_cache": True, **extra}


def _storage(s3, proxy, **kw) -> S3Storage:
    """A storage on the bucket's ``run`` prefix that reaches the server through the proxy."""
    return S3Storage(s3.url("run"), storage_options=_options(s3, proxy.endpoint), **kw)


def _staged(data: bytes) -> memoryview:
    buf = aligned_buffer(max(len(data), 1))
    buf[:len(data)] = data
    return buf


def _h(b) -> int:
    return xxhash.xxh3_64_intdigest(bytes(b))


def _upload_ids(s3) -> list[str]:
    return [u["UploadId"] for u in s3.multipart_uploads()]


def _timed_write(st, path: str, n: int) -> tuple[StorageError, float]:
    buf = _staged(os.urandom(n))
    t0 = time.monotonic()
    with pytest.raises(StorageError) as ei:
        st.write_shard(path, buf, n, [(0, n)])
    return ei.value, time.monotonic() - t0


def test_upload_to_a_silent_endpoint_ends_at_the_deadline(s3, proxy):
    st = _storage(s3, proxy)  # the default per-call bound (120 s) is not what ends the wait
    p = st.join("r00000-silent.fck")
    proxy.silence()
    err, took = _timed_write(st.bounded(time.monotonic() + 3), p, 40 * MiB)
    assert took < 3 + 10 + SLACK_S, took  # the deadline, the cleanup bound, slack
    msg = str(err)
    assert st.display(p) in msg and "deadline passed" in msg and "create_multipart_upload" in msg
    # the request that begins the upload got no answer: it is recorded, the error says so
    assert [u["upload_id"] for u in st.unaborted] == [None]
    assert st.unaborted[0]["url"] == st.display(p) and "fastckpt gc" in msg

    proxy.resume()
    assert s3.keys() == []
    assert st.incomplete_uploads() == [] and _upload_ids(s3) == []  # nothing reached moto


def test_silence_after_the_first_part_ends_at_the_deadline(s3, proxy, caplog):
    # one part at a time, so that which parts got through is fixed; the abort after the
    # failure gets min(10, 4) s
    st = _storage(s3, proxy, op_timeout_s=4, concurrency=1, part_bytes=16 * MiB)
    p = st.join("r00001-mid.fck")
    proxy.silence(after_bytes=20 * MiB)  # part 1 (16 MiB) goes through, part 2 does not
    err, took = _timed_write(st.bounded(time.monotonic() + 5), p, 40 * MiB)
    assert proxy.silent and proxy.forwarded == 20 * MiB
    assert took < 5 + 4 + SLACK_S, took
    msg = str(err)
    assert st.display(p) in msg and "deadline passed" in msg and "upload_part" in msg
    # the abort was tried under its own bound, not the deadline that had passed already
    assert "no answer to abort_multipart_upload within 4.0 s" in msg and took > 5 + 4 - 0.5
    # the abort could not reach the server either: logged, recorded, named in the error
    assert len(st.unaborted) == 1
    left = st.unaborted[0]
    assert left["url"] == st.display(p) and left["upload_id"] in msg and "fastckpt gc" in msg
    assert abs(left["when_unix"] - time.time()) < 60
    warned = [r.getMessage() for r in caplog.records if r.name == "fastckpt"]
    assert len(warned) == 1 and s3.bucket in warned[0] and "run/r00001-mid.fck" in warned[0]
    assert left["upload_id"] in warned[0]

    proxy.resume()
    assert s3.keys() == []  # nothing visible
    assert _upload_ids(s3) == [left["upload_id"]]
    parts = s3.fs.call_s3("list_parts", Bucket=s3.bucket, Key="run/r00001-mid.fck",
                          UploadId=left["upload_id"])["Parts"]
    assert [x["PartNumber"] for x in parts] == [1]  # the silence began mid-upload
    listed = st.incomplete_uploads()
    assert [(u["url"], u["upload_id"]) for u in listed] == [(left["url"], left["upload_id"])]
    st.abort_upload(listed[0])
    assert _upload_ids(s3) == [] and s3.keys() == []
    st.abort_upload(listed[0])  # already gone: fine


def test_every_call_is_bounded_when_silent(s3, proxy):
    st = _storage(s3, proxy, op_timeout_s=1)
    small, shard = st.join("a", "manifest.json"), st.join("a", "r00000-x.fck")
    setup = _storage(s3, proxy)  # (the default bound: a loaded CI host once took > 1 s here)
    setup.publish(small, b"{}")
    setup.write_shard(shard, _staged(b"s" * MiB), MiB, [])
    proxy.silence()
    upload = {"url": st.display(shard), "upload_id": "no-such-upload"}
    calls = {  # name: (call, the URL its error must name)
        "size": (lambda: st.size(small), small),
        "listdir": (lambda: st.listdir(st.join("a")), st.join("a")),
        "read_bytes": (lambda: st.read_bytes(small), small),
        "read_into": (lambda: st.read_into(shard, 0, aligned_buffer(MiB), MiB), shard),
        "publish": (lambda: st.publish(small, b"{ }"), small),
        "remove": (lambda: st.remove(small), small),
        "remove_dir": (lambda: st.remove_dir(st.join("a")), st.join("a")),
        "incomplete_uploads": (lambda: st.incomplete_uploads(), st.root),
        "abort_upload": (lambda: st.abort_upload(upload), shard),
    }
    for name, (call, path) in calls.items():
        t0 = time.monotonic()
        with pytest.raises(StorageError) as ei:
            call()
        took = time.monotonic() - t0
        assert took < 1 + 1 + SLACK_S, (name, took)  # op_timeout_s, 1 MiB at 8 MiB/s, slack
        msg = str(ei.value)
        assert "no answer" in msg and "op_timeout_s=1" in msg, (name, msg)
        assert st.display(path) in msg, (name, msg)

    # a save deadline sooner than the per-call bound ends the wait first
    t0 = time.monotonic()
    with pytest.raises(StorageError, match="deadline passed") as ei:
        st.bounded(time.monotonic() + 0.5).size(small)
    assert time.monotonic() - t0 < 0.5 + SLACK_S and st.display(small) in str(ei.value)
    # a deadline already passed: nothing is sent
    with pytest.raises(StorageError, match="deadline passed before head_object was sent"):
        st.bounded(time.monotonic() - 1).size(small)

    proxy.resume()
    assert st.read_bytes(small) == b"{}"  # nothing was changed by the calls that timed out
    assert st.listdir(st.join("a")) == ["manifest.json", "r00000-x.fck"]


def test_round_trip_through_the_proxy(s3, proxy):
    st = _storage(s3, proxy)
    view = st.bounded(time.monotonic() + 60)
    for name, n in (("big.fck", 40 * MiB), ("small.fck", 3 * MiB + 1), ("empty.fck", 0)):
        data = os.urandom(n)
        p = view.join(name)
        ranges = [(0, n), (n // 3, n // 2)]
        assert view.write_shard(p, _staged(data), n, ranges) == [
            _h(data[o:o + k]) for o, k in ranges]
        assert view.size(p) == n
        k = min(n, 5 * MiB)
        buf = aligned_buffer(max(k, 1))
        assert view.read_into(p, n - k, buf, k) == _h(data[n - k:])
        assert bytes(buf[:k]) == data[n - k:]
    s3.fs.invalidate_cache()
    assert s3.fs.info(s3.path("run", "big.fck"))["ETag"].strip('"').endswith("-5")  # 8 MiB
    assert _upload_ids(s3) == [] and st.unaborted == []
    view.publish(view.join("m", "manifest.json"), b'{"step": 1}')
    assert view.read_bytes(view.join("m", "manifest.json")) == b'{"step": 1}'
    assert view.listdir(view.root) == ["big.fck", "empty.fck", "m", "small.fck"]
    view.remove(view.join("small.fck"))
    view.remove_dir(view.join("m"))
    assert s3.keys() == ["run/big.fck", "run/empty.fck"]


def test_incomplete_uploads_under_the_root_only(s3, proxy):
    begun = {}
    for key in ("run/step-1/r00000-a.fck", "run/r00001-b.fck", "run2/c.fck", "other/d.fck"):
        begun[key] = s3.fs.call_s3("create_multipart_upload", Bucket=s3.bucket,
                                   Key=key)["UploadId"]
    st = _storage(s3, proxy)
    listed = st.incomplete_uploads()
    assert sorted((u["key"], u["upload_id"]) for u in listed) == sorted(
        (k, begun[k]) for k in ("run/step-1/r00000-a.fck", "run/r00001-b.fck"))
    for u in listed:
        assert u["url"] == f"s3://{s3.bucket}/{u['key']}"
        assert isinstance(u["initiated_unix"], float)  # moto reports a fixed date
    st.abort_upload(listed[0])
    assert sorted(_upload_ids(s3)) == sorted(v for k, v in begun.items() if k != listed[0]["key"])
    assert [u["upload_id"] for u in st.incomplete_uploads()] == [listed[1]["upload_id"]]


def test_s3_client_defaults_fill_only_what_the_user_left_out(s3):
    opts = _options(s3, s3.endpoint, config_kwargs={"read_timeout": 5})
    st = S3Storage(s3.url("run"), storage_options=opts)
    assert st.fs.config_kwargs == {**S3_CONFIG_DEFAULTS, "read_timeout": 5,
                                   "max_pool_connections": st.concurrency}
    assert opts["config_kwargs"] == {"read_timeout": 5}  # the caller's dict is left alone


# ------------------------------------------------------------------------- the engine on top

def test_save_to_a_silent_store_fails_within_its_deadline(s3, proxy, capsys):
    """The defect as a user met it: ``save().wait()`` on an endpoint that stops answering
    blocked 834 s. Now the save fails soon after its deadline (commit_timeout_s), names the URL,
    the last committed step stays loadable, and `fastckpt gc` aborts what could not be."""
    import torch

    import fastckpt
    from fastckpt import cli
    opts = _options(s3, proxy.endpoint)
    url = s3.url("eng")
    state = {"w": torch.arange(40 * MiB // 4, dtype=torch.float32), "step": 1}
    with fastckpt.Checkpointer(url, storage_options=opts, commit_timeout_s=3) as ck:
        ck.save(state, step=1).wait()
        proxy.silence(after_bytes=20 * MiB)  # step 2's first part goes through, then silence
        t0 = time.monotonic()
        h = ck.save(dict(state, step=2), step=2)
        with pytest.raises(fastckpt.FastCkptError) as ei:
            h.wait(timeout=120)
        took = time.monotonic() - t0
        # the write deadline, the commit's own (the other ranks wait that long), the bounded
        # abort and cleanup, and the lease's bounded check: far from 834 s
        assert took < 3 + 3 + 10 + 10 + SLACK_S, took
        assert "eng/step-0000000002" in str(ei.value.__cause__ or ei.value) or \
            "eng/step-0000000002" in str(ei.value)
        proxy.resume()
    # what was committed survives and loads (directly, not through the proxy)
    dest = {"w": torch.zeros_like(state["w"]), "step": 0}
    assert fastckpt.load(dest, url, storage_options=s3.storage_options) == 1
    assert torch.equal(dest["w"], state["w"])
    # whatever upload the failed save could not abort, gc lists and aborts (no grace: the
    # failed save is over)
    direct = s3.url("eng")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        cli.main(["gc", direct, "--grace", "0", "--yes", "--json"])
    out = capsys.readouterr().out
    import json
    doc = json.loads(out)
    assert doc["uploads"] and doc["uploads_aborted"] == doc["uploads"]
    assert "eng/step-0000000002/" in doc["uploads"][0]["url"]
    assert _upload_ids(s3) == []
