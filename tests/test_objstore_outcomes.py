"""The object-storage path's ambiguous outcomes (s3 fast path, fsspec backend, the commit):
a manifest write that times out and lands late, a conditional re-save whose answer was lost,
an object removed under a reader, a CreateMultipartUpload retried after a lost answer.

Found by a review on 2026-12-06; each test failed on the code before its fix, for the reason
its comment states. Network faults are simulated in the client (an answer dropped, a request
held and applied late) against the real S3 server on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

import fastckpt
from fastckpt import StorageError
from fastckpt.storage import open_storage
from fastckpt.storage.native import aligned_buffer
from fastckpt.storage.s3 import S3Storage

pytest_plugins = ["tests.s3fixtures"]

pytestmark = [pytest.mark.timeout(120)]

MiB = 1 << 20


def _st(s3, prefix="run", **remote) -> S3Storage:
    opts = {**s3.storage_options, "skip_instance_cache": True}
    st = open_storage(s3.url(prefix), storage_options=opts, remote=remote or None)
    assert isinstance(st, S3Storage)
    return st


def _staged(data: bytes):
    buf = aligned_buffer(max(len(data), 1))
    buf[:len(data)] = data
    return buf


# Before 2026-12-06: a manifest PUT that times out client-side is treated as "not committed"
# after one immediate read-back; the store may still apply the request it received (a slow store
# is why the call timed out), so the manifest lands later naming shards every rank has removed.
def test_manifest_put_that_lands_after_its_timeout_never_names_removed_shards(s3, monkeypatch):
    import json
    url = s3.url("late")
    opts = {**s3.storage_options, "skip_instance_cache": True}
    state = {"w": torch.arange(1000, dtype=torch.float32), "step": 1}
    real = S3Storage._request
    landed = threading.Event()
    armed = {"on": False}

    async def request(self, op, path, until, **kw):
        if armed["on"] and op == "put_object" and path.endswith("step-0000000002/manifest.json"):
            armed["on"] = False
            body = bytes(kw["body"])

            def server_applies_it_late():  # the store got the whole request; it commits late
                s3.fs.pipe_file(path, body)
                landed.set()
            threading.Timer(4.0, server_applies_it_late).start()
            await asyncio.sleep(3600)  # ... and its answer never comes back in time
        return await real(self, op, path, until, **kw)
    monkeypatch.setattr(S3Storage, "_request", request)
    with fastckpt.Checkpointer(url, storage_options=opts, commit_timeout_s=2.0) as ck:
        ck.save(state, step=1, block=True)
        armed["on"] = True
        state["w"] += 1
        failed = None
        try:
            ck.save(state, step=2, block=True)
        except Exception as e:  # noqa: BLE001
            failed = e
    assert landed.wait(10)
    s3.fs.invalidate_cache()
    mkey = s3.path("late", "step-0000000002", "manifest.json")
    assert s3.fs.exists(mkey)
    body = json.loads(s3.fs.cat_file(mkey))["body"]
    there = set(s3.keys("late/step-0000000002"))
    missing = [f for f in body["files"] if f"late/step-0000000002/{f}" not in there]
    # the save was reported as failed and yet a manifest now names files that were removed
    assert not missing, (f"save reported {type(failed).__name__}: {failed}; the late manifest "
                         f"names removed shard(s) {missing}")


def _slow_manifest_fs():
    from fsspec.implementations.memory import MemoryFileSystem

    class SlowManifest(MemoryFileSystem):
        protocol = "fastckpt-review-slowmanifest"
        armed = threading.Event()
        release = threading.Event()
        landed = threading.Event()

        def pipe_file(self, path, value, **kw):
            if SlowManifest.armed.is_set() and path.endswith("manifest.json"):
                SlowManifest.armed.clear()
                SlowManifest.release.wait(30)
                out = super().pipe_file(path, value, **kw)
                SlowManifest.landed.set()
                return out
            return super().pipe_file(path, value, **kw)
    return SlowManifest


# Before 2026-12-06 (fsspec_backend, synchronous file systems): the manifest's pipe_file is left
# running on its pool thread when its bound passes; nothing stops it, so it lands after the save
# was reported failed and every rank removed its shards.
def test_sync_fsspec_manifest_put_left_to_its_thread_never_names_removed_shards():
    import json
    import uuid

    import fsspec
    from fastckpt.storage.fsspec_backend import FsspecStorage
    fs_cls = _slow_manifest_fs()
    fsspec.register_implementation(fs_cls.protocol, fs_cls, clobber=True)
    root = f"{fs_cls.protocol}://r-{uuid.uuid4().hex[:8]}/root"
    st = FsspecStorage(root, storage_options={}, op_timeout_s=30)
    state = {"w": torch.arange(1000, dtype=torch.float32)}
    failed = None
    try:
        with fastckpt.Checkpointer(st, commit_timeout_s=1.5) as ck:
            ck.save(state, step=1, block=True)
            fs_cls.armed.set()
            state["w"] += 1
            try:
                ck.save(state, step=2, block=True)
            except Exception as e:  # noqa: BLE001
                failed = e
    finally:
        fs_cls.release.set()  # the store answers again: the abandoned PUT completes
    assert failed is not None
    assert fs_cls.landed.wait(10)
    d = st.join("step-0000000002")
    body = json.loads(st.read_bytes(f"{d}/manifest.json"))["body"]
    there = set(st.listdir(d))
    missing = [f for f in body["files"] if f not in there]
    assert not missing, (f"save reported {type(failed).__name__}: {failed}; the late manifest "
                         f"names removed shard(s) {missing}")


def _lose_answer_once(st, monkeypatch, op_name, *, match=None):
    """The next ``op_name`` request (whose args ``match`` accepts) reaches the store and is
    applied, but its answer is lost: the connection breaks before the response (a retryable
    error for the choke point, which then tries again)."""
    import aiohttp
    st.size(st.join("warm-up"))  # the client exists from here on
    client = asyncio.run_coroutine_threadsafe(st.fs.set_session(), st.fs.loop).result(10)
    meth = getattr(client, op_name)
    hit = {"n": 0}

    async def wrapped(**args):
        out = await meth(**args)
        if hit["n"] == 0 and (match is None or match(args)):
            hit["n"] += 1
            raise aiohttp.ServerDisconnectedError()
        return out
    monkeypatch.setattr(client, op_name, wrapped)
    return hit


# Before 2026-12-06: CreateMultipartUpload is retried by the choke point after its answer was
# lost (the store began an upload, the connection broke before the reply): the retry begins a
# second upload, the shard completes through it, and the first is never aborted: every such
# retry leaves an unfinished multipart upload behind (only `fastckpt gc` finds it).
def test_a_retried_create_multipart_upload_leaves_no_unfinished_upload(s3, monkeypatch):
    st = _st(s3, part_bytes=5 * MiB)
    n = 11 * MiB
    data = bytes(range(256)) * (n // 256)
    hit = _lose_answer_once(st, monkeypatch, "create_multipart_upload")
    st.write_shard(st.join("a.fck"), _staged(data), n, [])
    assert hit["n"] == 1 and st.read_bytes(st.join("a.fck")) == data  # the write succeeded
    left = [(u["Key"], u["UploadId"]) for u in s3.multipart_uploads()]
    assert left == [], f"unfinished multipart upload(s) left behind: {left}"


# Before 2026-12-06: on s3 a shard read of an object that is gone (retention removed the step
# while a reader loaded it) raises a StorageError with no ENOENT errno and no FileNotFoundError
# cause, so the reader's is_missing() misses it: the load calls the step "damaged" and resumes
# from an OLDER step instead of starting again on the newer one that retention kept.
def test_a_step_retired_under_an_s3_reader_restarts_on_the_newer_step(s3, monkeypatch, caplog):
    url = s3.url("ret")
    opts = {**s3.storage_options, "skip_instance_cache": True}
    with fastckpt.Checkpointer(url, storage_options=opts) as ck:
        for step in (1, 2, 3):
            ck.save({"w": torch.full((1000,), float(step))}, step=step, block=True)
    # step 3 is "not committed yet": set aside, put back by the writer mid-load below
    d3 = s3.path("ret", "step-0000000003")
    side = s3.path("side")
    s3.fs.copy(d3, side, recursive=True)
    s3.fs.rm(d3, recursive=True)
    s3.fs.invalidate_cache()
    real = S3Storage.read_into
    done = {"n": 0}

    def read_into(self, path, *a, **kw):
        if done["n"] == 0 and "step-0000000002/" in path and path.endswith(".fck"):
            done["n"] = 1  # the writer commits step 3, then its retention removes step 2
            s3.fs.copy(side, d3, recursive=True)
            s3.fs.rm(s3.path("ret", "step-0000000002", "manifest.json"))
            s3.fs.rm(s3.path("ret", "step-0000000002"), recursive=True)
            s3.fs.invalidate_cache()
        return real(self, path, *a, **kw)
    monkeypatch.setattr(S3Storage, "read_into", read_into)
    dest = {"w": torch.zeros(1000)}
    got = fastckpt.load(dest, url, storage_options=opts)
    assert done["n"] == 1
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert got == 3 and float(dest["w"][0]) == 3.0, (got, warned)


# Before 2026-12-06: publish_manifest's If-Match PUT (a re-save replacing a committed manifest)
# is retried by the choke point after its answer was lost; the retry fails its condition against
# the manifest the first try put, and publish_manifest reports "the manifest changed while this
# save committed ... not committed" without looking at what is there (the If-None-Match path
# does). Callers that trust that error (fastckpt convert --force onto s3) then remove the new
# shards, which the new manifest names: the step is destroyed.
def test_an_if_match_manifest_put_whose_answer_was_lost_is_committed(s3, monkeypatch, tmp_path):
    from fastckpt.convert import convert
    src = str(tmp_path / "ckpt.pt")
    torch.save({"w": torch.arange(1000, dtype=torch.float32)}, src)
    url = s3.url("conv")
    opts = {**s3.storage_options, "skip_instance_cache": True}
    convert(src, url, step=5, storage_options=opts)
    torch.save({"w": torch.arange(1000, dtype=torch.float32) * 2}, src)
    real = S3Storage.publish_manifest

    def publish_manifest(self, path, data):
        hit = _lose_answer_once(self, monkeypatch, "put_object",
                                match=lambda a: "IfMatch" in a)
        try:
            return real(self, path, data)
        finally:
            assert hit["n"] == 1
    monkeypatch.setattr(S3Storage, "publish_manifest", publish_manifest)
    err = None
    try:
        convert(src, url, step=5, force=True, storage_options=opts)
    except StorageError as e:
        err = e
    monkeypatch.undo()
    dest = {"w": torch.zeros(1000)}
    try:
        got = fastckpt.load(dest, url, step=5, storage_options=opts)
    except Exception as e:  # noqa: BLE001
        got = e
    assert got == 5, f"convert raised {err!r}; the step no longer loads: {got!r}"
