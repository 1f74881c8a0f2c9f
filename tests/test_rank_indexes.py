"""Per-rank chunk indexes (format version 4, ``CheckpointOptions.rank_indexes``): real gloo
process groups at 1, 2 and 4 ranks save FSDP2 states with indexes and load them back at every
other world size bit-exact; periodic saves with the plan reused stay indexed; the default keeps
one self-contained manifest below 16 ranks; an index that is damaged, missing, swapped or
crafted (re-checksummed into the manifest, as an attacker would) is an error naming the file and
rank, and a resume falls back to the older step; direct s3 saves and the local-first remote
tier carry the indexes (the moto server on 127.0.0.1). Skeletons every rank shares (their
hashes agree at the plan exchange) reach the coordinator from rank 0 alone."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import xxhash

import fastckpt
from fastckpt.errors import CorruptCheckpointError
from fastckpt.manifest import index as idx
from fastckpt.manifest import schema as fmt
from fastckpt.manifest.discovery import read_manifest
from fastckpt.options import CheckpointOptions
from fastckpt.storage import open_storage
from fastckpt.tools.verify import verify_step
from tests.crafted import read_doc, write_doc
from tests.distributed import run
from tests.models import assert_same, fsdp_mlp, full_state, train_step

pytest_plugins = ["tests.s3fixtures"]

MiB = 1 << 20


def _fsdp_save(rank, world, root, steps=(3,)):
    m = fsdp_mlp(0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    with fastckpt.Checkpointer(root, rank_indexes=1) as ck:
        for s in steps:
            train_step(m, opt, s, rank, world)
            ck.save({"model": m, "optim": opt, "step": s}, step=s, block=True)
        how = ck._plans.how
    return full_state(m, opt), how


def _fsdp_load(rank, world, roots):
    out = []
    for root in roots:
        m = fsdp_mlp(7)
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        state = {"model": m, "optim": opt, "step": 0}
        out.append((fastckpt.load(state, root), full_state(m, opt)))
    return out


def _step_dir(root: str, step: int) -> str:
    return os.path.join(root, fmt.step_dirname(step))


def _doc(root: str, step: int) -> dict:
    return read_doc(root, step)


def test_indexed_fsdp2_saves_load_at_every_world_size(tmp_path):
    roots = {n: str(tmp_path / f"saved{n}") for n in (1, 2, 4)}
    want = {n: run(_fsdp_save, n, roots[n])[0][0] for n in roots}
    for n, root in roots.items():
        doc = _doc(root, 3)
        body = doc["body"]
        assert doc["format_version"] == 4
        assert [e["file"] for e in body["indexes"]] == [
            idx.index_name(r, body["save_id"]) for r in range(n)]
        assert all("chunks" not in t for t in body["tensors"].values())  # only in the indexes
        for e in body["indexes"]:
            data = open(os.path.join(_step_dir(root, 3), e["file"]), "rb").read()
            assert len(data) == e["size"]
            assert fmt.hexdigest(xxhash.xxh3_64_intdigest(data)) == e["checksum"]
        rep = verify_step(root, 3, record=False)
        assert rep.ok, rep
    for m in (1, 2, 4):
        for r, per_root in enumerate(run(_fsdp_load, m, [roots[n] for n in (1, 2, 4)])):
            for n, (step, got) in zip((1, 2, 4), per_root):
                assert step == 3
                assert_same(want[n], got)  # saved at n ranks, loaded at m: bit-exact
    # 4 ranks each indexed their own quarter of every FSDP2 weight
    body = read_manifest(open_storage(roots[4]), _step_dir(roots[4], 3), step=3)
    assert sorted(c["rank"] for c in body["tensors"]["model.2.weight"]["chunks"]) == [0, 1, 2, 3]


def test_periodic_saves_reuse_the_plan_and_stay_indexed(tmp_path):
    root = str(tmp_path / "periodic")
    out = run(_fsdp_save, 2, root, (1, 2, 3))
    assert [how for _, how in out] == ["reused", "reused"]
    for s in (1, 2, 3):
        body = _doc(root, s)["body"]
        assert len(body["indexes"]) == 2
        names = set(os.listdir(_step_dir(root, s)))
        # exactly the committed save's files: shards, the two indexes and the manifest
        assert names == set(body["files"]) | {e["file"] for e in body["indexes"]} | {
            fmt.MANIFEST}
    for r, per_root in enumerate(run(_fsdp_load, 2, [root])):
        assert per_root[0][0] == 3
        assert_same(out[r][0], per_root[0][1])


def _default_save(rank, world, root):
    fastckpt.save({"w": torch.arange(10.0) + rank, "step": 1}, root, step=1)
    return True


def test_the_default_keeps_one_manifest_below_16_ranks(tmp_path):
    root = str(tmp_path / "default")
    run(_default_save, 2, root)
    doc = _doc(root, 1)
    assert "indexes" not in doc["body"] and doc["format_version"] < 4
    assert not [n for n in os.listdir(_step_dir(root, 1)) if n.endswith(idx.INDEX_SUFFIX)]
    assert CheckpointOptions().rank_indexes == 16


# --------------------------------------------------------------------- damaged and crafted

def _two_steps(root: str) -> dict:
    """Steps 1 and 2 of a one-rank state, both indexed; the state of step 1."""
    states = {}
    with fastckpt.Checkpointer(root, rank_indexes=1) as ck:
        for s in (1, 2):
            g = torch.Generator().manual_seed(s)
            states[s] = {"w": torch.randn(3000, generator=g), "b": torch.randn(5, generator=g),
                         "step": s}
            ck.save(states[s], step=s, block=True)
    return states[1]


def _dest() -> dict:
    return {"w": torch.zeros(3000), "b": torch.zeros(5), "step": 0}


def _index_path(root: str, step: int) -> str:
    e = _doc(root, step)["body"]["indexes"][0]
    return os.path.join(_step_dir(root, step), e["file"])


def _rewrite_index(root: str, step: int, edit) -> None:
    """Edit step's index of rank 0 and re-pin it in the manifest (size and checksum recomputed,
    the manifest re-checksummed): what an attacker who can write the checkpoint does."""
    path = _index_path(root, step)
    doc = json.loads(open(path, "rb").read())
    edit(doc)
    data = json.dumps(doc).encode()
    with open(path, "wb") as f:
        f.write(data)
    man = _doc(root, step)
    man["body"]["indexes"][0].update(
        size=len(data), checksum=fmt.hexdigest(xxhash.xxh3_64_intdigest(data)))
    write_doc(root, step, man)


def _load_step(root: str, step: int | None) -> dict:
    dest = _dest()
    fastckpt.load(dest, root, step=step)
    return dest


def _damaged(root, step):
    p = _index_path(root, step)
    data = bytearray(open(p, "rb").read())
    data[len(data) // 2] ^= 0x20
    open(p, "wb").write(bytes(data))
    return "do not match the manifest's size"


def _missing(root, step):
    os.remove(_index_path(root, step))
    return "chunk indexes that are missing: rank 0"


def _swapped(root, step):  # the index of step 1 in place of step 2's: another save's
    shutil.copy(_index_path(root, 1), _index_path(root, step))
    return "do not match the manifest's size"


def _outside(root, step):
    _rewrite_index(root, step, lambda d: d["chunks"]["w"][0].update(offsets=[2999]))
    return "lies outside the shape"


def _foreign_tensor(root, step):
    _rewrite_index(root, step, lambda d: d["chunks"].__setitem__("evil", d["chunks"]["w"]))
    return "lists a tensor the manifest does not hold"


def _foreign_file(root, step):
    _rewrite_index(root, step, lambda d: d["chunks"]["w"][0].update(file="../../etc/passwd"))
    return "which is not one of rank 0's files"


def _other_rank(root, step):
    _rewrite_index(root, step, lambda d: d.update(rank=1))
    return "not the index of rank 0"


def _past_the_file(root, step):
    _rewrite_index(root, step, lambda d: d["chunks"]["w"][0].update(offset=1 << 40))
    return "past its recorded size"


@pytest.mark.parametrize("fault", [_damaged, _missing, _swapped, _outside, _foreign_tensor,
                                   _foreign_file, _other_rank, _past_the_file])
def test_a_bad_index_is_named_and_the_older_step_loads(tmp_path, fault, caplog):
    root = str(tmp_path / "bad")
    older = _two_steps(root)
    want = fault(root, 2)
    with pytest.raises(CorruptCheckpointError) as ei:
        _load_step(root, 2)
    msg = str(ei.value)
    assert want in msg, msg
    assert idx.index_name(0, _doc(root, 2)["body"]["save_id"]) in msg or "manifest.json" in msg
    dest = _load_step(root, None)  # a resume skips the damaged step, naming it
    assert dest["step"] == 1 and torch.equal(dest["w"], older["w"])
    assert "skipping step 2" in caplog.text
    with pytest.raises(CorruptCheckpointError):
        verify_step(root, 2, record=False)


@pytest.mark.parametrize("edit, want", [
    (lambda b: b["indexes"][0].update(file="../r00000-x.fci"), "not a valid index file name"),
    (lambda b: b["indexes"].append(dict(b["indexes"][0])), "one entry per rank"),
    (lambda b: b["tensors"]["w"].update(chunks=[]), "lists chunks"),
    (lambda b: b["indexes"][0].update(size=-1), "not a valid index file name, size"),
])
def test_a_crafted_manifest_index_entry_is_refused(tmp_path, edit, want):
    root = str(tmp_path / "crafted")
    _two_steps(root)
    doc = _doc(root, 2)
    edit(doc["body"])
    write_doc(root, 2, doc)
    with pytest.raises(CorruptCheckpointError, match="manifest") as ei:
        _load_step(root, 2)
    assert want in str(ei.value)


def test_rank_indexes_option_is_validated():
    for bad in (0, -3, 2.5, "16"):
        with pytest.raises(ValueError, match="rank_indexes"):
            CheckpointOptions(rank_indexes=bad)


# --------------------------------------------------------------------------- object stores

def _opts(s3) -> dict:
    return {**s3.storage_options, "skip_instance_cache": True}


def test_a_direct_s3_save_writes_and_reads_its_index(s3):
    url = s3.url("direct-idx")
    state = {"w": torch.randn(MiB // 4), "step": 4}
    fastckpt.save(state, url, step=4, storage_options=_opts(s3), rank_indexes=1)
    keys = s3.keys("direct-idx")
    assert [k for k in keys if k.endswith(idx.INDEX_SUFFIX)]
    dest = {"w": torch.zeros(MiB // 4), "step": 0}
    assert fastckpt.load(dest, url, storage_options=_opts(s3)) == 4
    assert torch.equal(dest["w"], state["w"])


def test_the_remote_tier_uploads_each_ranks_index(tmp_path, s3):
    local = str(tmp_path / "tier")
    url = s3.url("tier-idx")
    state = {"w": torch.randn(MiB // 4), "step": 5}
    h = fastckpt.save(state, local, step=5, remote=url, storage_options=_opts(s3),
                      rank_indexes=1)
    assert h.remote_committed
    name = _doc(local, 5)["body"]["indexes"][0]["file"]
    remote = s3.path("tier-idx", fmt.step_dirname(5))
    assert s3.fs.cat_file(f"{remote}/{name}") == open(
        os.path.join(_step_dir(local, 5), name), "rb").read()
    shutil.rmtree(local)  # the node is gone: resume from the remote tier
    dest = {"w": torch.zeros(MiB // 4), "step": 0}
    assert fastckpt.load(dest, local, remote=url, storage_options=_opts(s3)) == 5
    assert torch.equal(dest["w"], state["w"])


# ---------------------------------------------------------------- skeletons sent once

def _tree_senders(rank, world, root, per_rank_value):
    """Which ranks' commit results carried their skeleton, over a first save (full plan
    exchange) and a second one (plan reused)."""
    from fastckpt.engine import writer
    sent = []
    real = writer.commit

    def spy(*a, **k):
        sent.append("tree" in k["result"])
        return real(*a, **k)
    writer.commit = spy
    m = fsdp_mlp(0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    with fastckpt.Checkpointer(root) as ck:
        for s in (1, 2):
            train_step(m, opt, s, rank, world)
            state = {"model": m, "optim": opt, "step": s}
            if per_rank_value:
                state["data"] = {"pos": 100 * s + rank}
            ck.save(state, step=s, block=True)
    writer.commit = real
    return sent


@pytest.mark.parametrize("per_rank_value", [False, True])
def test_only_rank_0_sends_a_skeleton_every_rank_shares(tmp_path, per_rank_value):
    root = str(tmp_path / "trees")
    sent = run(_tree_senders, 2, root, per_rank_value)
    assert sent[0] == [True, True]
    assert sent[1] == ([True, True] if per_rank_value else [False, False])
    body = _doc(root, 2)["body"]
    assert ("rank_trees" in body) == per_rank_value and ("tree" in body) != per_rank_value
    out = run(_load_data, 2, root, per_rank_value)
    for r, (step, data) in enumerate(out):
        assert step == 2
        assert data == ({"pos": 200 + r} if per_rank_value else None)


def _load_data(rank, world, root, per_rank_value):
    m = fsdp_mlp(7)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    state = {"model": m, "optim": opt, "step": 0}
    if per_rank_value:
        state["data"] = {"pos": None}
    step = fastckpt.load(state, root)
    return step, state.get("data")
