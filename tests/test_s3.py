"""End to end through S3: the public API against the moto server on 127.0.0.1.

save/load bit-exact, retention, corruption detection and a 2-rank FSDP2 save loaded at world
size 1, all with ``s3://`` roots and ``storage_options``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

import fastckpt
from fastckpt import CorruptCheckpointError
from tests.distributed import run
from tests.models import assert_same, fsdp_mlp, full_state, mlp, train_step

pytest_plugins = ["tests.s3fixtures"]  # the s3_server (one per session) and s3 fixtures

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnraisableExceptionWarning")


def _trained(seed: int = 0, steps: int = 2):
    m = mlp(seed)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for s in range(steps):
        train_step(m, opt, s)
    return m, opt


def _state(m, opt, step: int) -> dict:
    return {"model": m, "optim": opt, "step": step,
            "extra": {"bf16": torch.linspace(-1, 1, 7).to(torch.bfloat16),
                      "ints": torch.arange(5, dtype=torch.int16)},
            "cfg": {"lr": 0.1, "name": "run1", "pair": (1, None), "inf": math.inf}}


def _fresh_state():
    m = mlp(9)
    opt = torch.optim.Adam(m.parameters(), lr=5.0)  # no moments yet, another lr
    state = {"model": m, "optim": opt, "step": 0,
             "extra": {"bf16": torch.zeros(7, dtype=torch.bfloat16),
                       "ints": torch.zeros(5, dtype=torch.int16)},
             "cfg": {"lr": None, "name": None, "pair": None, "inf": None}}
    return m, opt, state


def test_save_load_bit_exact(s3):
    m, opt = _trained()
    url = s3.url("run1")
    h = fastckpt.save(_state(m, opt, 7), url, step=7, storage_options=s3.storage_options)
    assert h.committed and h.bytes_written > 0
    keys = s3.keys("run1")
    shards = [k for k in keys if k.endswith(".fck")]
    assert len(shards) == 1
    assert sorted(set(keys) - set(shards)) == ["run1/latest", "run1/step-0000000007/manifest.json"]
    assert s3.multipart_uploads() == []  # nothing half-written left behind
    assert json.loads(s3.fs.cat_file(s3.path("run1", "latest"))) == {"step": 7}

    m2, opt2, state = _fresh_state()
    got = fastckpt.load(state, url, storage_options=s3.storage_options)
    assert got == 7 and state["step"] == 7
    assert_same(full_state(m, opt), full_state(m2, opt2))
    assert opt2.param_groups[0]["lr"] == 1e-2
    assert torch.equal(state["extra"]["bf16"], torch.linspace(-1, 1, 7).to(torch.bfloat16))
    assert torch.equal(state["extra"]["ints"], torch.arange(5, dtype=torch.int16))
    assert state["cfg"] == {"lr": 0.1, "name": "run1", "pair": (1, None), "inf": math.inf}


def test_retention_keeps_the_two_newest(s3):
    m, opt = _trained(steps=1)
    url = s3.url("ret")
    with fastckpt.Checkpointer(url, keep_last=2, storage_options=s3.storage_options) as ck:
        for step in (10, 20, 30, 40):
            train_step(m, opt, step)
            ck.save({"model": m, "optim": opt, "step": step}, step=step, block=True)
        assert ck.latest_step() == 40
    steps = sorted({k.split("/")[1] for k in s3.keys("ret") if k.count("/") == 2})
    assert steps == ["step-0000000030", "step-0000000040"]
    assert not [k for k in s3.keys("ret") if "/.inflight-" in k]
    m2, opt2, _ = _fresh_state()
    state = {"model": m2, "optim": opt2, "step": 0}
    assert fastckpt.load(state, url, storage_options=s3.storage_options) == 40
    assert_same(full_state(m, opt), full_state(m2, opt2))
    # the older kept step loads too
    state = {"model": mlp(3), "step": 0}
    assert fastckpt.load(state, url, step=30, strict=False,
                         storage_options=s3.storage_options) == 30


def _corrupt_one_weight(s3, name: str) -> tuple[str, str, bytearray]:
    """Save under ``name``, flip one bit of model.0.weight in its shard object via s3fs."""
    m, opt = _trained()
    url = s3.url(name)
    fastckpt.save(_state(m, opt, 5), url, step=5, storage_options=s3.storage_options)
    mkey = s3.path(name, "step-0000000005", "manifest.json")
    body = json.loads(s3.fs.cat_file(mkey))["body"]
    chunk = body["tensors"]["model.0.weight"]["chunks"][0]
    shard = s3.path(name, "step-0000000005", chunk["file"])
    data = bytearray(s3.fs.cat_file(shard))
    data[chunk["offset"] + 3] ^= 0x01  # one bit of one weight
    s3.fs.pipe_file(shard, bytes(data))
    return url, shard, data


def test_corrupt_shard_is_detected(s3):
    url, shard, data = _corrupt_one_weight(s3, "bad")
    name = shard.rsplit("/", 1)[1]
    with pytest.raises(CorruptCheckpointError) as ei:
        fastckpt.load(_fresh_state()[2], url, storage_options=s3.storage_options)
    msg = str(ei.value)
    assert name in msg and "checksum mismatch" in msg and "model.0.weight" in msg
    assert ei.value.file == shard and ei.value.key == "model.0.weight"

    # a truncated shard object is named too, before any byte of it is used
    s3.fs.pipe_file(shard, bytes(data[:-1]))
    with pytest.raises(CorruptCheckpointError, match=name) as ei:
        fastckpt.load(_fresh_state()[2], url, storage_options=s3.storage_options)
    assert "truncated" in str(ei.value) and ei.value.file == shard


# ------------------------------------------------------------------------------- two ranks

def _save_two_ranks(rank, world, url, storage_options):
    from tests.s3fixtures import guard_this_process
    guard = guard_this_process()  # this rank, too, talks to 127.0.0.1 only
    m = fsdp_mlp(0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for s in range(2):
        train_step(m, opt, s, rank, world)
    with fastckpt.Checkpointer(url, storage_options=storage_options) as ck:
        ck.save({"model": m, "optim": opt, "step": 2}, step=2, block=True)
    assert not guard.violations, guard.violations
    return full_state(m, opt)


def test_two_ranks_save_to_s3_load_at_one(s3):
    url = s3.url("dist")
    want = run(_save_two_ranks, 2, url, s3.storage_options, env=s3.env)
    assert_same(want[0], want[1])
    body = json.loads(s3.fs.cat_file(s3.path("dist", "step-0000000002", "manifest.json")))["body"]
    assert body["world_size"] == 2 and len(body["files"]) == 2  # both ranks wrote a shard
    assert len(body["tensors"]["model.2.weight"]["chunks"]) == 2  # really sharded
    m, opt, _ = _fresh_state()
    state = {"model": m, "optim": opt, "step": 0}
    assert fastckpt.load(state, url, storage_options=s3.storage_options) == 2
    assert state["step"] == 2
    assert_same(want[0], full_state(m, opt))
