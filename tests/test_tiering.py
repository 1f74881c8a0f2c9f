"""Local-first tiering: ``Checkpointer(local, remote="s3://...")`` against the moto server on
127.0.0.1 (behind tests/s3throttle.py where a slow or failing store matters).

Every save commits locally, then uploads and commits the same manifest remotely; a step that
comes while an upload runs is deferred and the newest deferred one is uploaded next; retention
per tier; resume takes the newest step of either tier (from the local root when it has it,
else the remote one, and from the remote one when the local copy is damaged) and says which;
an upload that fails leaves the local commit and nothing visible remotely; a local shard that
changed on disk is not uploaded; 2 ranks lose their local root (a Spot VM) and resume
bit-exact from the remote tier. The emergency decision for the remote tier is checked here as
a function; tests/test_tiered_preempt.py stops real jobs.
"""

from __future__ import annotations

import json
import os
import shutil
import time

import pytest
import torch

import fastckpt
from fastckpt.engine import tiering
from fastckpt.preempt import budget
from tests.distributed import run
from tests.models import assert_same, fsdp_mlp, full_state, train_step
from tests.s3throttle import ThrottleProxy

pytest_plugins = ["tests.s3fixtures"]

pytestmark = [pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning"),
              pytest.mark.timeout(240)]

MiB = 1 << 20


@pytest.fixture
def proxy(s3):
    with ThrottleProxy(s3.server.port) as p:
        yield p


def _opts(s3, endpoint: str | None = None) -> dict:
    client = dict(s3.storage_options["client_kwargs"], endpoint_url=endpoint or s3.endpoint)
    return {**s3.storage_options, "client_kwargs": client, "skip_instance_cache": True}


def _state(seed: int, mib: float = 2.0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {"w": torch.randn(int(mib * MiB) // 4, generator=g), "b": torch.randn(7, generator=g),
            "step": seed}


def _dest(mib: float = 2.0) -> dict:
    return {"w": torch.zeros(int(mib * MiB) // 4), "b": torch.zeros(7), "step": -1}


def _remote_steps(s3, prefix: str) -> list[int]:
    keys = s3.keys(prefix)
    return sorted(int(k.split("/")[1].split("-")[1]) for k in keys
                  if k.endswith("/manifest.json"))


# --------------------------------------------------------------------------- save and upload

def test_a_save_commits_locally_then_remotely(tmp_path, s3):
    local = str(tmp_path / "run")
    with fastckpt.Checkpointer(local, remote=s3.url("t1"), storage_options=_opts(s3)) as ck:
        h = ck.save(_state(1), step=1)
        assert h.remote_state == "pending"
        h.wait()
        h.wait_remote(timeout=60)
        assert h.remote_state == "committed" and h.remote_committed
    d = os.path.join(local, "step-0000000001")
    remote = s3.path("t1", "step-0000000001")
    with open(os.path.join(d, "manifest.json"), "rb") as f:
        assert s3.fs.cat_file(f"{remote}/manifest.json") == f.read()  # the same commit
    for name in os.listdir(d):
        if name.endswith(".fck"):
            with open(os.path.join(d, name), "rb") as f:
                assert s3.fs.cat_file(f"{remote}/{name}") == f.read()
    assert json.loads(open(os.path.join(local, tiering.TIERS_FILE)).read()) == {
        "remote": s3.url("t1")}
    assert s3.multipart_uploads() == []


def test_one_shot_save_and_load_with_remote(tmp_path, s3):
    local = str(tmp_path / "one")
    h = fastckpt.save(_state(3), local, step=3, remote=s3.url("one"), storage_options=_opts(s3))
    assert h.remote_committed  # the one-shot save returns once both tiers committed
    shutil.rmtree(local)
    dest = _dest()
    assert fastckpt.load(dest, local, remote=s3.url("one"), storage_options=_opts(s3)) == 3
    assert torch.equal(dest["w"], _state(3)["w"]) and dest["step"] == 3


def test_steps_that_come_while_uploading_are_deferred_and_the_newest_follows(tmp_path, s3,
                                                                            proxy):
    proxy.set_rate(4 * MiB)  # an upload of 2 MiB takes ~0.5 s: the saves below come faster
    local = str(tmp_path / "run")
    with fastckpt.Checkpointer(local, remote=s3.url("t2"), storage_options=_opts(
            s3, proxy.endpoint), keep_last=2, remote_keep_last=3) as ck:
        handles = []
        for step in range(1, 6):
            h = ck.save(_state(step), step=step)
            h.wait()
            handles.append(h)
        states = [h.remote_state for h in handles]
        assert states[0] in ("pending", "committed") and "deferred" in states[1:], states
    # close() waited for the chain: the newest step reached the remote tier; the ones replaced
    # while deferred stayed local (skipped)
    assert handles[-1].remote_state == "committed", [h.remote_state for h in handles]
    assert any(h.remote_state == "skipped" for h in handles[1:-1])
    remote = _remote_steps(s3, "t2")
    assert remote[-1] == 5 and remote[0] == 1 and len(remote) <= 3
    assert sorted(int(n.split("-")[1]) for n in os.listdir(local)
                  if n.startswith("step-")) == [4, 5]  # local retention caught up
    assert s3.multipart_uploads() == []


def test_retention_per_tier(tmp_path, s3):
    local = str(tmp_path / "ret")
    with fastckpt.Checkpointer(local, remote=s3.url("ret"), storage_options=_opts(s3),
                               keep_last=1, remote_keep_last=2) as ck:
        for step in (10, 20, 30, 40):
            h = ck.save(_state(step, 0.5), step=step, block=True)
            h.wait_remote(timeout=60)  # each one uploaded: none deferred
    assert ck.steps() == [40]
    assert _remote_steps(s3, "ret") == [30, 40]


# ----------------------------------------------------------------------------------- resume

def test_resume_takes_the_newest_of_either_tier_and_says_which(tmp_path, s3, caplog):
    local = str(tmp_path / "res")
    url = s3.url("res")
    with fastckpt.Checkpointer(local, remote=url, storage_options=_opts(s3)) as ck:
        ck.save(_state(1), step=1, block=True).wait_remote(timeout=60)
        ck.save(_state(2), step=2, block=True).wait_remote(timeout=60)
    # both tiers have step 2: the local root is read
    with fastckpt.Checkpointer(local, remote=url, storage_options=_opts(s3)) as ck:
        dest = _dest()
        assert ck.resume(dest) == 2 and ck.last_load == {"step": 2, "tier": "local",
                                                         "root": local}
    # a damaged local shard: step 2 is read from the remote tier instead, with a warning
    d = os.path.join(local, "step-0000000002")
    shard = next(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".fck"))
    with open(shard, "r+b") as f:  # a byte of w (the padding is not read by a load)
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(os.path.getsize(shard) // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    with fastckpt.Checkpointer(local, remote=url, storage_options=_opts(s3)) as ck:
        dest = _dest()
        assert ck.resume(dest) == 2 and ck.last_load["tier"] == "remote"
        assert torch.equal(dest["w"], _state(2)["w"])
    assert any("did not load from the local tier" in r.getMessage() for r in caplog.records)
    # the node is gone (a new, empty local root): the remote tier's newest step
    fresh = str(tmp_path / "fresh")
    with fastckpt.Checkpointer(fresh, remote=url, storage_options=_opts(s3)) as ck:
        dest = _dest()
        assert ck.resume(dest) == 2 and ck.last_load == {"step": 2, "tier": "remote",
                                                         "root": url}
        assert torch.equal(dest["w"], _state(2)["w"]) and dest["step"] == 2
    # a newer local step than the remote's (its upload never happened): the local one
    fastckpt.save(_state(3), local, step=3)
    with fastckpt.Checkpointer(local, remote=url, storage_options=_opts(s3)) as ck:
        assert ck.resume(_dest()) == 3 and ck.last_load["tier"] == "local"
    # neither tier has anything
    with fastckpt.Checkpointer(str(tmp_path / "none"), remote=s3.url("none"),
                               storage_options=_opts(s3)) as ck:
        assert ck.resume(_dest()) is None


def test_a_remote_tier_that_cannot_be_listed_fails_the_resume_by_name(tmp_path, s3, proxy,
                                                                      capsys, monkeypatch):
    # before 2026-12-06 a failed listing counted as "no step there": a fresh node resumed
    # nothing (None: training from scratch, whose saves then replaced the remote steps), a
    # node with an older local step loaded that one
    url = s3.url("lst")
    opts = _opts(s3, proxy.endpoint)
    with fastckpt.Checkpointer(str(tmp_path / "a"), remote=url, storage_options=opts) as ck:
        for step in (1, 2):
            ck.save(_state(step), step=step, block=True).wait_remote(timeout=60)
    older = str(tmp_path / "older")
    fastckpt.save(_state(1), older, step=1)
    proxy.inject(503, code="SlowDown", count=None, method="GET", query_contains="list-type")
    for local in (str(tmp_path / "fresh"), older):
        with fastckpt.Checkpointer(local, remote=url, storage_options=opts,
                                   remote_max_attempts=2) as ck:
            dest = _dest()
            with pytest.raises(fastckpt.StorageError,
                               match=r"rank 0: resume across tiers: could not list the remote "
                                     r"tier.*SlowDown.*nothing was loaded"):
                ck.resume(dest)
            assert dest["step"] == -1 and not dest["w"].any()  # untouched
            # a step asked for by number that a tier holds loads all the same
            if local == older:
                assert ck.load(dest, step=1) == 1 and dest["step"] == 1
    # the CLI says so too (exit 4), instead of "no checkpoint, start fresh" (exit 3)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint)
    fastckpt.save(_state(1), str(tmp_path / "c"), step=1)
    with open(tmp_path / "c" / ".tiers.json", "w") as f:
        json.dump({"remote": url}, f)
    from fastckpt import cli
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()  # (the CLI's file system: through the proxy)
    try:
        capsys.readouterr()
        with pytest.raises(SystemExit) as e:
            cli.main(["resume", str(tmp_path / "c")])
        assert e.value.code == 4 and "could not be read" in capsys.readouterr().err
        proxy.clear_faults()
        code, out = _cli(capsys, "resume", str(tmp_path / "c"), "--json")
        assert code == 0 and json.loads(out)["step"] == 2 and json.loads(out)["tier"] == "remote"
    finally:
        s3fs.S3FileSystem.clear_instance_cache()


def test_a_step_deferred_while_the_chain_ends_is_uploaded(tmp_path, s3, monkeypatch):
    # the upload of step 1 ends while step 2 (planned as deferred: the uploader was busy) is
    # still being written: the chain waits for it. Before 2026-12-06 the chain ended without
    # it: remote_state stayed "deferred" (wait_remote() without a timeout: for good) and
    # close() skipped it, so the newest step never went up
    from fastckpt.storage.local import LocalStorage
    from fastckpt.testing.faults import FaultyStorage
    real = tiering.Tier._upload_file

    def slow_link(self, st, up, f, dest):
        time.sleep(0.6)
        return real(self, st, up, f, dest)
    monkeypatch.setattr(tiering.Tier, "_upload_file", slow_link)
    local = FaultyStorage(LocalStorage(str(tmp_path / "d")))
    with fastckpt.Checkpointer(local, remote=s3.url("dfr"), storage_options=_opts(s3)) as ck:
        h1 = ck.save(_state(1), step=1, block=True)
        local.arm(throttle_mibps=1.5)  # step 2's 2 MiB take ~1.4 s: past step 1's upload
        h2 = ck.save(_state(2), step=2)
        assert h2.remote_state == "deferred"
        h1.wait_remote(timeout=60)
        h2.wait_remote(timeout=60)
        assert h2.remote_state == "committed"
    assert _remote_steps(s3, "dfr") == [1, 2]


def test_a_save_committed_after_the_tier_froze_is_marked_skipped(tmp_path, s3):
    # a preemption froze the tier (only the emergency path uploads): a save that commits
    # after that is not uploaded, and says so (before 2026-12-06 its remote_state stayed
    # "pending": wait_remote() without a timeout waited for good)
    with fastckpt.Checkpointer(str(tmp_path / "f"), remote=s3.url("frz"),
                               storage_options=_opts(s3)) as ck:
        ck.tier.freeze()
        h = ck.save(_state(1), step=1, block=True)
        assert h.committed and h.remote_state == "skipped"
        assert h.wait_remote(timeout=1) is h
    assert _remote_steps(s3, "frz") == []


def test_retried_requests_leave_the_users_random_stream_alone(tmp_path, s3, proxy):
    import random
    random.seed(1234)
    before = random.getstate()
    proxy.inject(503, code="SlowDown", count=3, method="PUT")
    fastckpt.save(_state(1), s3.url("rnd"), step=1, storage_options=_opts(s3, proxy.endpoint))
    assert proxy.stats()["injected"] == 3  # three requests were answered 503 and retried
    assert random.getstate() == before  # (the jitter had drawn from random's own generator)


def _sharded(world: int, seed: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(64, 1024, generator=g) if seed else torch.zeros(64, 1024)
    return {"w": distribute_tensor(full, init_device_mesh("cpu", (world,)), [Shard(0)]),
            "step": seed}


def _tiered_save(rank, world, local, remote):
    from fastckpt.storage.local import LocalStorage
    with fastckpt.Checkpointer(local, remote=LocalStorage(remote)) as ck:
        ck.save(_sharded(world, 1), step=1, block=True).wait_remote(timeout=60)


def _tiered_resume(rank, world, local, remote):
    from fastckpt.storage.local import LocalStorage
    with fastckpt.Checkpointer(local, remote=LocalStorage(remote), plan_timeout_s=20) as ck:
        st = _sharded(world, 0)
        step = ck.resume(st)
        return step, ck.last_load["tier"], torch.equal(st["w"].full_tensor(),
                                                       _sharded(world, 1)["w"].full_tensor())


def _flip_middle(data: bytes) -> bytes:
    i = len(data) // 2  # a byte of w (the padding is not read by a load)
    return data[:i] + bytes([data[i] ^ 0xFF]) + data[i + 1:]


def test_a_step_damaged_in_every_tier_resumes_from_the_newest_older_step(tmp_path, s3, caplog):
    """Step 3 is damaged in both tiers (a flipped byte in the local shard and in the remote
    object), step 4 exists only locally (its upload never happened) and is damaged too: a
    resume loads step 2, the newest older step, with a warning for each, as a plain root's
    load does (before 2026-12-06 every restart of a tiered job failed on it). A step asked for
    by number still raises."""
    local, url = str(tmp_path / "fb"), s3.url("fb")
    with fastckpt.Checkpointer(local, remote=url, storage_options=_opts(s3)) as ck:
        for step in (2, 3):
            ck.save(_state(step), step=step, block=True).wait_remote(timeout=60)
    fastckpt.save(_state(4), local, step=4)  # local only
    for step in (3, 4):
        d = os.path.join(local, f"step-{step:010d}")
        shard = next(os.path.join(d, n) for n in os.listdir(d) if n.endswith(".fck"))
        with open(shard, "rb") as f:
            data = f.read()
        with open(shard, "wb") as f:
            f.write(_flip_middle(data))
    key = next(k for k in s3.keys("fb/step-0000000003") if k.endswith(".fck"))
    s3.fs.pipe_file(s3.path(key), _flip_middle(s3.fs.cat_file(s3.path(key))))
    with fastckpt.Checkpointer(local, remote=url, storage_options=_opts(s3)) as ck:
        dest = _dest()
        assert ck.resume(dest) == 2 and ck.last_load["tier"] == "local"
        assert torch.equal(dest["w"], _state(2)["w"]) and dest["step"] == 2
        with pytest.raises(fastckpt.CorruptCheckpointError):
            ck.load(_dest(), step=3)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("step 4 does not load from any tier" in m for m in msgs), msgs
    assert any("step 3 does not load from any tier" in m for m in msgs), msgs


def test_a_chunk_damaged_for_one_rank_only_is_loaded_from_the_remote_tier(tmp_path):
    # rank 1's rows are damaged locally: rank 1 reads a bad checksum, rank 0 hears of it.
    # Before 2026-12-06 rank 0 raised a plain FastCkptError (no fallback) while rank 1 went
    # on to the remote tier alone and timed out in its agreement
    local, remote = str(tmp_path / "loc"), str(tmp_path / "rem")
    run(_tiered_save, 2, local, remote)
    d = os.path.join(local, "step-0000000001")
    with open(os.path.join(d, "manifest.json")) as f:
        body = json.load(f)["body"]
    c = next(c for c in body["tensors"]["w"]["chunks"] if c["offsets"][0] == 32)
    with open(os.path.join(d, c["file"]), "r+b") as f:
        f.seek(c["offset"] + 10)
        b = f.read(1)
        f.seek(c["offset"] + 10)
        f.write(bytes([b[0] ^ 1]))
    assert run(_tiered_resume, 2, local, remote) == [(1, "remote", True)] * 2


# --------------------------------------------------------------------------------- failures

def test_a_failed_upload_keeps_the_local_commit_and_shows_nothing_remotely(tmp_path, s3,
                                                                          proxy):
    local = str(tmp_path / "fail")
    url = s3.url("fail")
    with fastckpt.Checkpointer(local, remote=url, storage_options=_opts(s3, proxy.endpoint),
                               remote_max_attempts=2) as ck:
        ck.save(_state(1), step=1, block=True).wait_remote(timeout=60)
        proxy.inject(403, count=None, method="PUT", path_contains="step-0000000002")
        h = ck.save(_state(2), step=2, block=True)
        assert h.committed  # locally
        with pytest.raises(fastckpt.SaveFailedError) as ei:  # every rank's verdict
            h.wait_remote(timeout=60)
        assert "access denied" in str(ei.value) and "step-0000000002" in str(ei.value)
        assert h.remote_state == "failed"
        proxy.clear_faults()
        ck.save(_state(3), step=3, block=True).wait_remote(timeout=60)  # training goes on
    assert _remote_steps(s3, "fail") == [1, 3]
    assert not [k for k in s3.keys("fail") if "step-0000000002" in k]  # its files removed
    assert s3.multipart_uploads() == []


def test_a_local_shard_that_changed_is_not_uploaded(tmp_path, s3, monkeypatch):
    real = tiering.Tier._upload_file

    def rot(self, st, up, f, dest):  # the local disk flips a byte after the commit
        path = os.path.join(up.local_dir, f["file"])
        with open(path, "r+b") as fh:
            fh.seek(8)
            b = fh.read(1)
            fh.seek(8)
            fh.write(bytes([b[0] ^ 1]))
        return real(self, st, up, f, dest)
    monkeypatch.setattr(tiering.Tier, "_upload_file", rot)
    local = str(tmp_path / "rot")
    with fastckpt.Checkpointer(local, remote=s3.url("rot"), storage_options=_opts(s3)) as ck:
        h = ck.save(_state(1), step=1, block=True)
        with pytest.raises(fastckpt.FastCkptError) as ei:
            h.wait_remote(timeout=60)
    msg = str(ei.value) + str(ei.value.__cause__)
    assert "changed since it was written" in msg and ".fck" in msg
    assert _remote_steps(s3, "rot") == [] and not [k for k in s3.keys("rot") if k.endswith(
        ".fck")]


def test_remote_retention_keeps_a_newer_step_other_ranks_are_uploading(tmp_path, s3,
                                                                      monkeypatch):
    """The coordinator's housekeeping after a remote commit runs while the other ranks'
    uploaders have moved on (a rank frozen by a preemption starts its emergency upload at
    once): a partial step newer than the committed one is an upload in flight, never removed.
    An older partial step (an upload abandoned earlier) still is. CI caught this with indexes:
    rank 1's files of the emergency step were removed, and the step committed without them."""
    real = tiering.apply_retention
    newer = s3.path("keep", "step-0000000006", "r00001-0b7a5056c12f-000.fck")
    older = s3.path("keep", "step-0000000002", "r00001-5b9d9443bc8e-000.fck")

    def racing(st, *a, **kw):  # rank 1's emergency upload, written as the coordinator scans
        if not st.is_local:
            s3.fs.pipe(newer, b"x" * 100)
            s3.fs.pipe(older, b"y" * 100)
        return real(st, *a, **kw)
    monkeypatch.setattr(tiering, "apply_retention", racing)
    with fastckpt.Checkpointer(str(tmp_path / "keep"), remote=s3.url("keep"),
                               storage_options=_opts(s3), keep_last=1) as ck:
        ck.save(_state(4, 0.25), step=4, block=True).wait_remote(timeout=60)
    keys = s3.keys("keep")
    assert any(k.endswith("step-0000000006/r00001-0b7a5056c12f-000.fck") for k in keys), keys
    assert not any("step-0000000002" in k for k in keys), keys  # abandoned: removed
    assert _remote_steps(s3, "keep") == [4]


def test_a_remote_file_gone_before_the_commit_fails_the_upload(tmp_path, s3, monkeypatch):
    """The coordinator lists the remote step directory before it puts the manifest: a file the
    manifest names that is not there (removed by anything since its rank uploaded it) fails
    the upload, naming the file, instead of committing a step that does not load."""
    real = tiering.Tier._publish
    gone = []

    def remove_one(self, up, st, d):
        name = sorted(f["file"] for f in up.files if f["file"].endswith(".fck"))[0]
        s3.fs.rm(f"{d}/{name}")
        gone.append(name)
        return real(self, up, st, d)
    monkeypatch.setattr(tiering.Tier, "_publish", remove_one)
    local = str(tmp_path / "gone")
    with fastckpt.Checkpointer(local, remote=s3.url("gone"), storage_options=_opts(s3)) as ck:
        h = ck.save(_state(1, 0.25), step=1, block=True)
        assert h.committed  # locally
        with pytest.raises(fastckpt.FastCkptError) as ei:
            h.wait_remote(timeout=60)
    msg = str(ei.value) + str(ei.value.__cause__)
    assert gone and gone[0] in msg and "not published" in msg, msg
    assert _remote_steps(s3, "gone") == []
    dest = _dest(0.25)
    assert fastckpt.load(dest, local) == 1 and torch.equal(dest["w"], _state(1, 0.25)["w"])


def test_remote_needs_a_local_root(s3):
    with pytest.raises(ValueError, match="needs a local root"):
        fastckpt.Checkpointer(s3.url("a"), remote=s3.url("b"), storage_options=_opts(s3))


# ----------------------------------------------------------------------- 2 ranks, node lost

def _two_ranks(rank, world, local, url, opts, phase):
    torch.manual_seed(0)
    m = fsdp_mlp(0, width=64)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    if phase == "save":
        for s in range(3):
            train_step(m, opt, s, rank, world)
        with fastckpt.Checkpointer(local, remote=url, storage_options=opts) as ck:
            ck.save({"model": m, "optim": opt}, step=3, block=True).wait_remote(timeout=90)
        return full_state(m, opt)
    m2 = fsdp_mlp(5, width=64)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    with fastckpt.Checkpointer(local, remote=url, storage_options=opts) as ck:
        step = ck.resume({"model": m2, "optim": opt2})
        return step, ck.last_load, full_state(m2, opt2)


def test_two_ranks_lose_the_node_and_resume_from_the_remote_tier(tmp_path, s3):
    local = str(tmp_path / "spot")
    url = s3.url("spot")
    saved = run(_two_ranks, 2, local, url, _opts(s3), "save", timeout=180, env=s3.env)
    shutil.rmtree(local)  # the Spot VM is gone, and its NVMe with it
    got = run(_two_ranks, 2, local, url, _opts(s3), "load", timeout=180, env=s3.env)
    for rank in range(2):
        step, where, state = got[rank]
        assert step == 3 and where["tier"] == "remote"
        assert_same(saved[rank], state)


# ------------------------------------------------------------------- the emergency decision

def _rep(left=10.0, est=1.0, up=2.0, up_step=None, up_left=0.0, up_piece=None,
         committed=None):
    return {"left_s": left, "est_s": est, "bytes": 1, "inflight_step": None,
            "inflight_left_s": 0.0, "inflight_piece_s": 0.0, "up_est_s": up,
            "up_inflight_step": up_step, "up_inflight_left_s": up_left,
            "up_inflight_piece_s": up_left if up_piece is None else up_piece,
            "committed_step": committed}


@pytest.mark.parametrize("reports,survives,want", [
    # the new step fits locally and remotely: upload it
    ([_rep(left=10, est=1, up=3)], False, ("upload", "save")),
    ([_rep(left=10, est=1, up=3), _rep(left=10, est=2, up=6.5)], True, ("upload", "save")),
    ([_rep(left=10, est=1, up=3), _rep(left=10, est=2, up=7.5)], True, ("skip", "save")),
    # the new step's upload does not fit, an older upload in flight does: finish it; on a Spot
    # VM the local save is skipped (it would be lost with the node), on a shared FS it is kept
    ([_rep(left=5, est=1, up=6, up_step=4, up_left=3)], False, ("finish", "skip")),
    ([_rep(left=5, est=1, up=6, up_step=4, up_left=3)], True, ("finish", "save")),
    # nothing fits remotely: the local save alone
    ([_rep(left=5, est=1, up=6, up_step=4, up_left=9)], False, ("skip", "save")),
    ([_rep(left=5, est=1, up=6)], True, ("skip", "save")),
    # the local save itself does not fit: nothing new; an upload in flight may still finish
    ([_rep(left=2, est=5, up=1, up_step=4, up_left=1)], False, ("finish", "skip")),
    # the stop's step was committed already (a save at that step waited for): it is uploaded
    # (before 2026-12-06 never: the restart from the remote tier lost those steps) unless its
    # own upload is under way, which then finishes
    ([_rep(left=10, up=3, committed=8)], False, ("upload", "committed")),
    ([_rep(left=10, up=3, up_step=4, up_left=2, committed=8)], False, ("upload", "committed")),
    ([_rep(left=10, up=3, up_step=8, up_left=2, committed=8)], False, ("finish", "committed")),
    # superseding an older upload stops it between files: its file under way (4 s) comes
    # before the new upload (6 s), 10 s > the 9 s left; before 2026-12-06: 1 + 6 s "fit"
    ([_rep(left=10, est=1, up=6, up_step=4, up_left=8, up_piece=4)], True, ("finish", "save")),
    ([_rep(left=10, est=1, up=6, up_step=4, up_left=8, up_piece=2)], True, ("upload", "save")),
])
def test_the_remote_decision(reports, survives, want):
    decision, nums = budget.decide(reports, step=8, margin=1.0)
    remote, local, why = budget.decide_remote(reports, decision, nums, 1.0, survives, step=8)
    assert (remote, local) == want, why
    assert why


# ------------------------------------------------------------------------------------ the CLI

def _cli(capsys, *args):
    from fastckpt import cli
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        cli.main(list(args))
    return e.value.code, capsys.readouterr().out


def test_ls_resume_and_verify_show_both_tiers(tmp_path, s3, capsys):
    local = str(tmp_path / "cli")
    url = s3.url("cli")
    with fastckpt.Checkpointer(local, remote=url, storage_options=_opts(s3)) as ck:
        ck.save(_state(1), step=1, block=True).wait_remote(timeout=60)
    fastckpt.save(_state(2), local, step=2)  # newer, local only
    code, out = _cli(capsys, "ls", local, "--json")
    doc = json.loads(out)
    assert code == 0 and [r["step"] for r in doc["steps"]] == [1, 2]
    assert doc["remote"]["root"] == url and [r["step"] for r in doc["remote"]["steps"]] == [1]
    code, out = _cli(capsys, "resume", local, "--json")
    assert json.loads(out)["step"] == 2 and json.loads(out)["tier"] == "local"
    shutil.rmtree(os.path.join(local, "step-0000000002"))
    shutil.rmtree(os.path.join(local, "step-0000000001"))
    code, out = _cli(capsys, "resume", local, "--json")  # only the remote tier has a step
    doc = json.loads(out)
    assert code == 0 and doc["step"] == 1 and doc["tier"] == "remote" and doc["path"].startswith(
        url)
    code, out = _cli(capsys, "verify", local, "--tier", "remote", "--json")
    doc = json.loads(out)
    assert code == 0 and doc["ok"] and [s["tier"] for s in doc["steps"]] == ["remote"]
    assert not [k for k in s3.keys("cli") if ".verified-" in k]  # nothing written there


def test_a_tiers_record_naming_a_local_path_is_ignored(tmp_path, capsys):
    from fastckpt.manifest import schema as fmt
    victim = tmp_path / "victim"
    fastckpt.save(_state(5), str(victim), step=5)
    local = tmp_path / "crafted"
    fastckpt.save(_state(1), str(local), step=1)
    (local / fmt.TIERS).write_text(json.dumps({"remote": f"file://{victim}"}))
    code, out = _cli(capsys, "resume", str(local), "--json")
    assert json.loads(out)["step"] == 1 and json.loads(out)["tier"] == "local"
    code, out = _cli(capsys, "ls", str(local), "--json")
    assert "remote" not in json.loads(out)


def test_keep_steps_holds_on_both_tiers(tmp_path):
    """``keep_steps`` (the Hugging Face callback's best step) survives the tier's retention
    after each upload, locally and remotely, as on an untiered root (before 2026-12-06 both
    tiers' retention after an upload removed it). The remote tier is a second local root
    here: the retention code is the same for every backend."""
    from fastckpt.storage import open_storage
    local, remote = tmp_path / "local", tmp_path / "remote"
    remote.mkdir()
    with fastckpt.Checkpointer(str(local), remote=open_storage(str(remote)), keep_last=2) as ck:
        ck.keep_steps({2})
        for s in range(1, 7):
            ck.save({"w": torch.full((1000,), float(s))}, step=s).wait().wait_remote(timeout=60)
    assert fastckpt.steps(str(local)) == [2, 5, 6]
    assert fastckpt.steps(str(remote)) == [2, 5, 6]
