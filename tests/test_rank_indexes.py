"""Per-rank chunk indexes (format version 4, ``CheckpointOptions.rank_indexes``): real gloo
process groups at 1, 2 and 4 ranks save FSDP2 states with indexes and load them back at every
other world size bit-exact; periodic saves with the plan reused stay indexed; the default keeps
one self-contained manifest below 16 ranks; an index that is damaged, missing, swapped or
crafted (re-checksummed into the manifest, as an attacker would) is an error naming the file and
rank, and a resume falls back to the older step; direct s3 saves and the local-first remote
tier carry the indexes (the moto server on 127.0.0.1). Skeletons every rank shares (their
hashes agree at the plan exchange) reach the coordinator from rank 0 alone."""

from __future__ import annotations

import contextlib
import json
import math
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
from tests.models import assert_same, fsdp_mlp, full_state, mlp, train_step

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
        assert doc["format_version"] == 4  # older readers ignore "inline"
        assert [e["file"] for e in body["indexes"]] == [
            idx.index_name(r, body["save_id"]) for r in range(n)]
        assert all("chunks" not in t for t in body["tensors"].values())  # only in the indexes
        # the DTensor shards' chunks are in the indexes only; the written-once tensors (the
        # optimizer's replicated step counts) are listed inline too, each once, by one rank
        inline = set(body["inline"])
        assert inline == {f for f, t in body["tensors"].items() if not t["dtensor"]}
        assert inline and all(f.endswith(".step") for f in inline), inline
        assert all(len(body["inline"][f]) == 1 for f in inline)
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


INLINE_DIFFERS = "not the ones its writers' indexes list"


def _outside(root, step):  # "w" is listed in the manifest's "inline" too: they differ
    _rewrite_index(root, step, lambda d: d["chunks"]["w"][0].update(offsets=[2999]))
    return INLINE_DIFFERS


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
    return INLINE_DIFFERS


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


def _grown(root, step):  # one byte more than the manifest pins
    with open(_index_path(root, step), "ab") as f:
        f.write(b" ")


@pytest.mark.parametrize("fault", [None, _missing, _grown, _damaged])
def test_resume_and_ls_check_the_indexes_in_a_listing_without_reading_them(tmp_path, fault):
    """``fastckpt resume`` (``newest_committed``), ``ls`` and ``verify --all``'s listing pick
    and describe steps from the manifest and one listing of the step directory: each index
    present with its pinned size, none read (at N ranks, N reads before every restart). A
    missing or resized index makes the step damaged, named, and the older step is resumed;
    a same-size damage is the load's and verify's to find (the load then falls back)."""
    from fastckpt.tools import describe_steps, newest_committed
    root = str(tmp_path / "listed")
    _two_steps(root)
    if fault:
        fault(root, 2)
    size = _doc(root, 2)["body"]["indexes"][0]["size"]
    want = {_missing: "is missing", _grown: f"holds {size + 1} bytes; the manifest says {size}"
            }.get(fault)
    skipped: list = []
    with _index_reads() as read:
        step, _, body = newest_committed(root, skipped=skipped)
        recs = {r.step: r for r in describe_steps(root, indexes="listed")}
    assert read == [], read
    assert recs[1].state == "committed" and recs[1].tensors == 2  # (w, b)
    if fault in (None, _damaged):
        assert step == 2 and not skipped and recs[2].state == "committed", (skipped, recs[2])
        assert "chunks" not in body["tensors"]["w"]  # (not read)
    else:
        name = idx.index_name(0, _doc(root, 2)["body"]["save_id"])
        assert step == 1 and len(skipped) == 1 and recs[2].state == "corrupt", recs[2]
        for msg in (str(skipped[0]), recs[2].error):
            assert f"the chunk index of rank 0 ({name})" in msg and want in msg, msg
    if fault is _damaged:  # the load reads it, finds it damaged, and loads step 1
        assert _load_step(root, None)["step"] == 1
        with pytest.raises(CorruptCheckpointError):
            verify_step(root, 2, record=False)
    # describe's default (gc decides on it) still reads and checks every index
    with _index_reads() as read:
        full = {r.step: r for r in describe_steps(root)}
    assert len(read) == (1 if fault in (_missing, _grown) else 2), read
    assert full[2].state == ("committed" if fault is None else "corrupt"), full[2]


@pytest.mark.parametrize("damaged", [False, True])
def test_gc_reads_the_indexes_of_the_steps_it_keeps_and_removes_the_older_unread(tmp_path,
                                                                                 damaged):
    """``fastckpt gc --keep 1`` over four indexed steps reads the newest step's index and no
    other (at N ranks, every index of every step was N reads per step) and removes the older
    three unread, re-checked from their manifests and listings. The newest damaged in place,
    its size kept: that read finds it, it is kept as damaged, the step before it is read and
    kept as the newest committed, and only the two older ones go."""
    from fastckpt.tools.gc import plan_gc, run_gc
    root = str(tmp_path / "gc")
    with fastckpt.Checkpointer(root, rank_indexes=1) as ck:
        for s in (1, 2, 3, 4):
            ck.save({"w": torch.full((3000,), float(s)), "step": s}, step=s, block=True)
    names = {s: os.path.basename(_index_path(root, s)) for s in (1, 2, 3, 4)}
    if damaged:
        _damaged(root, 4)
    with _index_reads() as read:
        actions = {a.record.step: a for a in plan_gc(root, 1)}
        run_gc(root, list(actions.values()))
    assert read == ([names[4], names[3]] if damaged else [names[4]]), read
    kept = {3, 4} if damaged else {4}
    assert {s for s, a in actions.items() if a.done} == {1, 2, 3} - kept
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == [
        fmt.step_dirname(s) for s in sorted(kept)]
    if damaged:
        assert actions[4].record.state == "corrupt" and "rank 0" in actions[4].record.error
        assert actions[3].record.latest and actions[3].reason == "newest committed step"
        dest = {"w": torch.zeros(3000), "step": 0}
        assert fastckpt.load(dest, root) == 3 and torch.equal(dest["w"], torch.full((3000,), 3.))
    else:
        assert actions[4].record.latest and actions[4].record.state == "committed"


@pytest.mark.parametrize("edit, want", [
    (lambda b: b["indexes"][0].update(file="../r00000-x.fci"), "not a valid index file name"),
    (lambda b: b["indexes"].append(dict(b["indexes"][0])), "one entry per rank"),
    (lambda b: b["tensors"]["w"].update(chunks=[]), "lists chunks"),
    (lambda b: b["inline"].update(w=[]), "hold 0 of the tensor's 3000 elements"),
    (lambda b: b["tensors"]["w"].update(per_rank=True), "inline chunks of a per-rank tensor"),
    (lambda b: b["inline"].update(evil=b["inline"]["w"]), "a tensor it does not hold"),
    (lambda b: b["inline"]["w"][0].update(file="../x.fck"), "which the manifest does not list"),
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
    # one listing gives the step's sizes (ListObjectsV2's); resume and ls check the index
    # against it, reading none (memory://, fsspec's listing, the same)
    from fastckpt.tools import describe_steps, newest_committed
    for where in (url, "memory://listed-idx"):
        if where.startswith("memory"):
            fastckpt.save(state, where, step=4, rank_indexes=1)
        st = open_storage(where, storage_options=_opts(s3) if where == url else None)
        d = st.join(fmt.step_dirname(4))
        body = fmt.decode_manifest(st.read_bytes(f"{d}/{fmt.MANIFEST}"), file="m")
        entry = body["indexes"][0]
        sizes = st.sizes(d)
        assert sizes[entry["file"]] == entry["size"], sizes
        assert sizes[fmt.MANIFEST] == st.size(f"{d}/{fmt.MANIFEST}")
        reads = []
        real = type(st).read_bytes
        type(st).read_bytes = lambda self, p, *a, **k: reads.append(p) or real(self, p, *a, **k)
        try:
            step, _, b = newest_committed(st)
            (rec,) = describe_steps(st, indexes="listed")
        finally:
            type(st).read_bytes = real
        assert step == 4 and "chunks" not in b["tensors"]["w"] and rec.committed, rec
        assert not [p for p in reads if p.endswith(idx.INDEX_SUFFIX)], reads


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


def _tiered_save(rank, world, local, url, opts, steps=(1,)):
    m = fsdp_mlp(0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    out = []
    for s in steps:
        train_step(m, opt, s, rank, world)
        h = fastckpt.save({"model": m, "optim": opt, "step": s}, local, step=s, remote=url,
                          storage_options=opts, rank_indexes=1)
        out.append((full_state(m, opt), h.remote_committed))
    return out[0] if len(out) == 1 else out


def _tiered_load(rank, world, local, url, opts):
    """A resume across the tiers with the local root gone: (step, state, the index files
    this rank read, from either tier)."""
    from fastckpt.storage.local import LocalStorage
    from fastckpt.storage.s3 import S3Storage
    read = []
    real = {c: c.read_bytes for c in (LocalStorage, S3Storage)}

    def spy(cls):
        def read_bytes(self, path, *a, **k):
            if path.endswith(idx.INDEX_SUFFIX):
                read.append(os.path.basename(path))
            return real[cls](self, path, *a, **k)
        return read_bytes
    for c in real:
        c.read_bytes = spy(c)
    try:
        m = fsdp_mlp(7)
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        got = fastckpt.load({"model": m, "optim": opt, "step": 0}, local, remote=url,
                            storage_options=opts)
    finally:
        for c, f in real.items():
            c.read_bytes = f
    return got, full_state(m, opt), read


def test_a_tiered_resume_reads_each_ranks_own_index_remotely(tmp_path, s3):
    """2 FSDP2 ranks save with a remote tier, the node's disk is lost, both resume from the
    object store: each rank's step discovery and load read its own index only (twice: the
    tiers' agreement, then the load), and the state comes back bit-exact."""
    local = str(tmp_path / "tier2")
    url = s3.url("tier-own")
    saved = run(_tiered_save, 2, local, url, _opts(s3))
    assert all(committed for _, committed in saved)
    save_id = _doc(local, 1)["body"]["save_id"]
    shutil.rmtree(local)
    for r, (step, got, read) in enumerate(run(_tiered_load, 2, local, url, _opts(s3))):
        assert step == 1
        assert set(read) == {idx.index_name(r, save_id)}, (r, read)
        assert_same(saved[0][0], got)


def test_a_damaged_remote_index_of_one_rank_makes_every_rank_resume_the_older_step(tmp_path,
                                                                                   s3):
    """Rank 1's index of step 2 is damaged in the object store and the local disk is gone:
    rank 0 alone would take step 2; the tiers' agreement sees rank 1 pass over a damaged step,
    every rank looks again with every index, and both resume step 1."""
    local = str(tmp_path / "tier3")
    url = s3.url("tier-damaged")
    saved = run(_tiered_save, 2, local, url, _opts(s3), (1, 2))
    name = _doc(local, 2)["body"]["indexes"][1]["file"]
    key = f"{s3.path('tier-damaged', fmt.step_dirname(2))}/{name}"
    data = bytearray(s3.fs.cat_file(key))
    data[len(data) // 2] ^= 0x20
    s3.fs.pipe_file(key, bytes(data))
    shutil.rmtree(local)
    for r, (step, got, read) in enumerate(run(_tiered_load, 2, local, url, _opts(s3))):
        assert step == 1, (r, step)
        assert_same(saved[0][0][0], got)


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


# ------------------------------------------------------- a rank reads its own index only

@contextlib.contextmanager
def _index_reads():
    """The names of the chunk index files read from local storage while inside, in order."""
    from fastckpt.storage.local import LocalStorage
    read = []
    real = LocalStorage.read_bytes

    def spy(self, path, *a, **k):
        if path.endswith(idx.INDEX_SUFFIX):
            read.append(os.path.basename(path))
        return real(self, path, *a, **k)
    LocalStorage.read_bytes = spy
    try:
        yield read
    finally:
        LocalStorage.read_bytes = real


def _load_reading(rank, world, root, plain=False, step=None):
    """Load ``root`` into a fresh FSDP2 (or, ``plain``, an unsharded) model + Adam; (the step
    loaded, the state, the index files this rank read)."""
    with _index_reads() as read:
        m = mlp(7) if plain else fsdp_mlp(7)
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        state = {"model": m, "optim": opt, "step": 0}
        got = fastckpt.load(state, root, step=step)
    return got, full_state(m, opt), read


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_loading_at_the_saved_world_size_reads_only_its_own_index(tmp_path, world):
    """FSDP2 at the saved world size: each rank reads the manifest and its own index (its
    shards, and the replicated step counts listed inline), not the others': a restart's reading
    stays flat in the world size (docs/scale.md). Bit-exact."""
    root = str(tmp_path / "own")
    want = run(_fsdp_save, world, root, (1, 2))[0][0]
    save_id = _doc(root, 2)["body"]["save_id"]
    for r, (step, got, read) in enumerate(run(_load_reading, world, root)):
        assert step == 2
        assert read == [idx.index_name(r, save_id)], (r, read)
        assert_same(want, got)


def test_another_sharding_at_the_same_world_size_reads_every_index(tmp_path):
    """Saved by 2 FSDP2 ranks, loaded by 2 ranks holding whole tensors: a rank's own index does
    not cover what it loads, so it reads every index (the coverage check) and loads bit-exact."""
    root = str(tmp_path / "resharded")
    want = run(_fsdp_save, 2, root, (1,))[0][0]
    save_id = _doc(root, 1)["body"]["save_id"]
    for r, (step, got, read) in enumerate(run(_load_reading, 2, root, True)):
        assert step == 1
        assert read[0] == idx.index_name(r, save_id), read  # its own, then both
        assert sorted(read) == sorted([read[0]] + [idx.index_name(k, save_id) for k in range(2)])
        assert_same(want, got)


def _load_reading_guess(rank, world, root, guess):
    """``_load_reading`` with the index guess replaced (``guess``: the saving ranks every rank
    is told to read first)."""
    if guess is not None:
        from fastckpt.engine import load as L
        L.writers_of = lambda body, boxes: frozenset(guess)
    return _load_reading(rank, world, root)


@pytest.mark.parametrize("saved,world,want_read", [
    # the 33-row weights and biases: 9 rows per saving rank at 4 (0-8, 9-17, 18-26, 27-32),
    # 17 per loading rank at 2; the 7-row ones: 2 per saving rank, 4 per loading rank
    (4, 2, [{0, 1}, {1, 2, 3}]),
    # saved at 2 (17 and 4 rows per rank), loaded at 4 (9 and 2 rows per rank)
    (2, 4, [{0}, {0, 1}, {1}, {1}]),
])
def test_a_restart_at_another_world_size_reads_the_indexes_its_rows_are_in(tmp_path, saved,
                                                                           world, want_read):
    """A restart on fewer or more nodes: each rank reads the indexes of the saving ranks whose
    rows of the FSDP2 shards it loads (an even split, as FSDP2 cuts; ~N/M + 1 of N indexes),
    not every index. Bit-exact against the save."""
    root = str(tmp_path / "elastic")
    want = run(_fsdp_save, saved, root, (1,))[0][0]
    save_id = _doc(root, 1)["body"]["save_id"]
    for r, (step, got, read) in enumerate(run(_load_reading, world, root)):
        assert step == 1
        assert sorted(read) == sorted(idx.index_name(k, save_id) for k in want_read[r]), (r, read)
        assert_same(want, got)


def _hsdp(rank, world, root, save):
    """HSDP-style DTensors on a 2 x 2 mesh (replicas x shards: ``Replicate, Shard(0)``):
    saved with per-rank indexes, or loaded at the same world size into fresh tensors; (the
    full tensors, the index files this rank read)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor, zeros

    mesh = init_device_mesh("cpu", (2, world // 2))
    place = [Replicate(), Shard(0)]
    if save:
        state = {f"w{i}": distribute_tensor(torch.arange(24.0).reshape(6, 4) + i, mesh, place)
                 for i in range(12)}
        with fastckpt.Checkpointer(root, rank_indexes=1) as ck:
            ck.save(state, step=1, block=True)
        return {k: v.full_tensor() for k, v in state.items()}, []
    with _index_reads() as read:
        state = {f"w{i}": zeros((6, 4), device_mesh=mesh, placements=place) for i in range(12)}
        fastckpt.load(state, root)
    return {k: v.full_tensor() for k, v in state.items()}, read


def _two_dim(rank, world, root, shape, save):
    """FSDP + TP-style DTensors sharded on two dims (``Shard(0), Shard(1)`` over a ``shape``
    mesh: rows over the first mesh dim, columns over the second), saved with per-rank indexes
    or loaded into fresh ones; (the full tensors, the index files this rank read)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor, zeros

    mesh = init_device_mesh("cpu", shape)
    place = [Shard(0), Shard(1)]
    dims = {"w": (8, 6), "u": (4, 10)}
    if save:
        state = {k: distribute_tensor(torch.arange(float(math.prod(d))).reshape(d) + i, mesh,
                                      place) for i, (k, d) in enumerate(dims.items())}
        with fastckpt.Checkpointer(root, rank_indexes=1) as ck:
            ck.save(state, step=1, block=True)
        return {k: v.full_tensor() for k, v in state.items()}, []
    with _index_reads() as read:
        state = {k: zeros(d, device_mesh=mesh, placements=place) for k, d in dims.items()}
        fastckpt.load(state, root)
    return {k: v.full_tensor() for k, v in state.items()}, read


@pytest.mark.parametrize("shape,want_read", [
    # the (2, 1) mesh: this mesh's first dim scaled (rows over 4: ranks {0, 1} hold rows 0-3
    # of w) or its second ((2, 2), as saved): either way rank 0's rows are in {0, 1}
    ((2, 1), [{0, 1}, {2, 3}]),
    # the (1, 2) mesh: as saved ((2, 2): rank 0's columns 0-2 of w in ranks {0, 2}) or columns
    # over 4 (w's columns 0-1 and 2-3 in ranks {0, 1}): the two guesses' union
    ((1, 2), [{0, 1, 2}, {1, 2, 3}]),
])
def test_a_two_dim_sharded_state_at_another_world_size_reads_the_indexes_its_boxes_meet(
        tmp_path, shape, want_read):
    """Saved by 4 ranks on a 2 x 2 mesh (FSDP + TP: ``Shard(0), Shard(1)``), restarted on 2:
    each rank reads the indexes of the saving ranks whose boxes, cut as torch cuts them on its
    mesh scaled to 4 ranks, meet its own, not every index. Bit-exact."""
    root = str(tmp_path / "2d")
    want = run(_two_dim, 4, root, (2, 2), True)[0][0]
    save_id = _doc(root, 1)["body"]["save_id"]
    for r, (got, read) in enumerate(run(_two_dim, 2, root, shape, False)):
        assert sorted(read) == sorted(idx.index_name(k, save_id) for k in want_read[r]), (r, read)
        for k, v in want.items():
            assert torch.equal(got[k], v), (r, k)


def _fsdp_tp(rank, world, root, shape, save):
    """FSDP2 + TP on a ``(dp, tp)`` mesh: a column-wise layer (FSDP2 cuts TP's ``Shard(0)``
    again: ``_StridedShard(0), Shard(0)``) and a row-wise one (``Shard(0), Shard(1)``), with
    Adam after a step; saved with per-rank indexes, or loaded into a fresh model; (the full
    state, the index files this rank read)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   parallelize_module)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0 if save else 1)
    m = torch.nn.Sequential(torch.nn.Linear(12, 16, bias=False), torch.nn.ReLU(),
                            torch.nn.Linear(16, 12, bias=False))
    parallelize_module(m, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
    fully_shard(m, mesh=mesh["dp"])
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    if save:
        m(torch.randn(4, 12)).pow(2).mean().backward()
        opt.step()
        with fastckpt.Checkpointer(root, rank_indexes=1) as ck:
            ck.save({"model": m, "optim": opt}, step=1, block=True)
        return full_state(m, opt), []
    with _index_reads() as read:
        fastckpt.load({"model": m, "optim": opt}, root)
    return full_state(m, opt), read


def test_fsdp2_with_tp_at_another_world_size_reads_the_indexes_its_boxes_meet(tmp_path):
    """Real FSDP2 + TP (its ``_StridedShard``), saved by 4 ranks on a 2 x 2 ``(dp, tp)`` mesh,
    restarted on 2 as 1 x 2: each rank reads the indexes its boxes meet on either guess (dp
    scaled: 2 x 2, as saved; tp scaled: 1 x 4), 3 of 4, where it read every index before.
    Weights and Adam moments bit-exact."""
    root = str(tmp_path / "tp")
    want = run(_fsdp_tp, 4, root, (2, 2), True)[0][0]
    save_id = _doc(root, 1)["body"]["save_id"]
    # rank 0 holds rows 0-7 of the column-wise weight (saved: in dp 0 and dp 1 of tp 0, ranks
    # 0 and 2; on 1 x 4, ranks 0 and 1) and columns 0-7 of the row-wise one (the same ranks)
    for r, (got, read) in enumerate(run(_fsdp_tp, 2, root, (1, 2), False)):
        assert sorted(read) == sorted(idx.index_name(k, save_id)
                                      for k in ({0, 1, 2}, {1, 2, 3})[r]), (r, read)
        assert_same(want, got)


def _stages(rank, world, root, save, indexes=1):
    """Two pipeline stages under FSDP2 (torchtitan's (pp, dp) mesh, pp outermost: each stage's
    layers sharded over its ``dp`` sub-mesh of consecutive ranks) with Adam after a step;
    saved with per-rank indexes, or loaded into a fresh stage; (the stage, its full state, the
    index files this rank read)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    grid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    stage = grid.get_local_rank("pp")
    full = mlp(0 if save else 5)
    m = torch.nn.ModuleDict({k: full[int(k)] for k in (("0", "2") if stage == 0 else ("4",))})
    for layer in m.values():
        fully_shard(layer, mesh=grid["dp"])
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    if save:
        x = torch.randn(4, 10 if stage == 0 else 33, generator=torch.Generator().manual_seed(7))
        for layer in m.values():
            x = torch.relu(layer(x))
        x.sum().backward()
        opt.step()
        with fastckpt.Checkpointer(root, rank_indexes=indexes) as ck:
            ck.save({"model": m, "optim": opt}, step=1, block=True)
        return stage, full_state(m, opt), []
    with _index_reads() as read:
        fastckpt.load({"model": m, "optim": opt}, root)
    return stage, full_state(m, opt), read


@pytest.mark.parametrize("indexes", [1, None])
def test_pipeline_stages_restart_at_another_world_size_reading_their_stages_indexes(
        tmp_path, indexes):
    """Two stages saved by 4 ranks (2 x 2: stage 0 on ranks 0-1, stage 1 on 2-3), restarted
    on 2 (2 x 1). Their skeletons differ by stage (refused at another world size before):
    each rank takes its stage's. With per-rank indexes, each rank's mesh is its stage's block
    of consecutive ranks, so it reads the indexes of the saving stage's ranks ({0, 1} and
    {2, 3}), not every index. Weights and Adam moments bit-exact."""
    root = str(tmp_path / "pp")
    saved = {stage: state for stage, state, _ in run(_stages, 4, root, True, indexes)}
    body = _doc(root, 1)["body"]
    assert "rank_trees" in body and ("indexes" in body) == (indexes == 1)
    for r, (stage, got, read) in enumerate(run(_stages, 2, root, False)):
        assert stage == r
        assert sorted(read) == sorted(idx.index_name(k, body["save_id"])
                                      for k in ((2 * r, 2 * r + 1) if indexes else ())), (r, read)
        assert_same(saved[stage], got)


def test_stage_skeletons_map_to_a_restarted_ranks_stage_only_when_blocks_are_whole():
    """A strict load at another world size takes the skeleton of the rank's block when the
    saved skeletons are equal within blocks of 2 or more consecutive ranks and hold other keys
    from block to block (pipeline stages, pp outermost); per-rank values (even equal in pairs
    by chance), interleaved stages, a world the blocks do not divide and a non-strict load are
    refused as before, naming the world sizes."""
    from fastckpt.errors import StateMismatchError
    a = {"model": {"0.w": {"$tensor": "model.0.w"}}}  # stage 0's modules
    b = {"model": {"4.w": {"$tensor": "model.4.w"}}}  # stage 1's

    def tree(trees, rank, world, stages=True):
        return fmt.tree_for_rank({"rank_trees": trees}, rank, world, file="m", stages=stages)
    assert [tree([a, a, b, b], r, 2) for r in range(2)] == [a, b]
    assert [tree([a, a, b, b], r, 6) for r in range(6)] == [a, a, a, b, b, b]
    assert [tree([a, a, a, a, b, b, b, b], r, 4) for r in range(4)] == [a, a, b, b]
    assert tree([a, a, b, b], 3, 4) == b  # (the saved world size: the rank's own)
    for trees, world, stages in (([a, b, a, b], 2, True),  # stages interleaved (pp inner)
                                 ([a, a, a, b], 2, True),  # blocks that are not whole
                                 ([{"s": 0, "r": 0}, {"s": 0, "r": 1}, b, b], 2, True),
                                 # per-rank values equal in pairs by chance: the same keys
                                 ([{"pos": 1}, {"pos": 1}, {"pos": 2}, {"pos": 2}], 2, True),
                                 ([a, b], 1, True),  # blocks of one rank: per rank
                                 ([a, a, b, b], 3, True),  # 3 ranks in 2 blocks
                                 ([a, a, b, b], 2, False)):  # a non-strict load
        with pytest.raises(StateMismatchError, match=f"loaded by exactly {len(trees)} ranks"):
            tree(trees, 0, world, stages)


def test_hsdp_replicas_at_the_saved_world_size_read_their_own_and_their_replicas_indexes(
        tmp_path):
    """A box replicated over a mesh dim is written by the replica its replicas elect
    (``solo.written``), so the rank holding it with that replica, its own index not covering
    it, reads that replica's index next: its replica group's indexes ({0, 2} or {1, 3}), not
    every index. Bit-exact."""
    root = str(tmp_path / "hsdp")
    want = run(_hsdp, 4, root, True)[0][0]
    save_id = _doc(root, 1)["body"]["save_id"]
    for r, (got, read) in enumerate(run(_hsdp, 4, root, False)):
        group = {r % 2, r % 2 + 2}  # (the rank and its replica: the mesh is [[0, 1], [2, 3]])
        # its own first (the FSDP case: enough); not covering its boxes, its replica's too
        assert read[0] == idx.index_name(r, save_id), (r, read)
        assert sorted(set(read)) == sorted(idx.index_name(k, save_id) for k in group), (r, read)
        for k, v in want.items():
            assert torch.equal(got[k], v), (r, k)


def test_a_wrong_index_guess_falls_back_to_every_index(tmp_path, caplog):
    """The guess is checked: told to read saving rank 0's index alone, a loading rank whose rows
    are elsewhere finds its boxes not covered, reads every index and loads bit-exact."""
    root = str(tmp_path / "guess")
    want = run(_fsdp_save, 4, root, (1,))[0][0]
    save_id = _doc(root, 1)["body"]["save_id"]
    every = sorted(idx.index_name(k, save_id) for k in range(4))
    for r, (step, got, read) in enumerate(run(_load_reading_guess, 2, root, [0])):
        assert step == 1
        assert read[0] == idx.index_name(0, save_id)  # the guess, then every index
        assert sorted(set(read)) == every, (r, read)
        assert_same(want, got)


def test_writers_of_places_each_box_in_the_even_split():
    body = {"world_size": 4, "inline": {"s": []},
            "tensors": {"w": {"shape": [33, 10]}, "b": {"shape": [7]}, "s": {"shape": []},
                        "z": {"shape": [0, 3]}}}
    fsdp = ((2,), (("S", 0),))  # FSDP2 at 2 ranks: Shard(0)
    # rows 9-26 of w lie in saving ranks 1 and 2 (9 rows each); the last row of b in rank 3
    assert idx.writers_of(body, {"w": ((9, 0), (18, 10), fsdp), "b": ((6,), (1,), fsdp)}) \
        == {1, 2, 3}
    assert idx.writers_of(body, {"s": ((), (), None)}) == frozenset()  # inline: no index
    assert idx.writers_of(body, {"z": ((0, 0), (0, 3), fsdp)}) == frozenset()  # an empty box
    assert idx.writers_of(body, {"w": ((0, 0), (33, 10), None)}) is None  # whole, not inline
    assert idx.writers_of(body, {"w": ((0,), (33,), fsdp)}) is None  # not w's dimensions
    assert idx.writers_of(body, {"w": ((0, 0), (33, 10), ((2,), (("S", 5),)))}) is None
    # a pipeline stage's mesh: block 1 of 2 (ranks 2-3 of 4 saved; rows 0-16 of w in rank 2)
    assert idx.writers_of(body, {"w": ((0, 0), (33, 10), ((1,), (("S", 0),), 1, 2))}) == {2, 3}
    assert idx.writers_of(body, {"w": ((0, 0), (17, 10), ((2,), (("S", 0),), 1, 2))}) == {2}
    assert idx.writers_of(body, {"w": ((0, 0), (17, 10), ((1,), (("S", 0),), 1, 3))}) is None
    # a 2 x 3 mesh scales to 4 ranks as 2 x 2, to 5 ranks on no dim: no guess
    two_three = ((2, 3), (("S", 0), ("S", 1)))
    assert idx.writers_of(body, {"w": ((0, 0), (17, 4), two_three)}) == {0}
    assert idx.writers_of({**body, "world_size": 5}, {"w": ((0, 0), (17, 4), two_three)}) is None
    assert idx.writers_of(body, {"missing": ((0,), (1,), fsdp)}) == frozenset()
    # replicated (HSDP's Replicate, Shard(0) on 2 x 1): every replica of the rows' shards
    assert idx.writers_of(body, {"w": ((0, 0), (17, 10), ((2, 1), (("R",), ("S", 0))))}) \
        == {0, 1, 2, 3}  # (2 x 2: rows 0-16 in {0, 2}; 4 x 1: every rank holds them)


def test_writers_of_meets_torchs_boxes_on_every_scaled_mesh():
    """Against torch's own cut (``_get_shard_size_and_offsets``, placement by placement: the
    exact rows each saving rank holds, strided ones included) for random shapes, meshes of
    1-3 dims and ``Shard`` / ``_StridedShard`` / ``Replicate`` placements (two mesh dims
    sharding one tensor dim included), loaded at a smaller or larger world size: the ranks
    ``writers_of`` names are exactly those whose non-empty boxes meet the loading rank's box,
    over each mesh dim that scales to the saved world size."""
    import itertools
    import random

    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard

    def rows_of(shape, mesh, coord, places):
        """Per tensor dim, the set of global rows the rank at ``coord`` holds (None: all)."""
        rows, local = [None] * len(shape), list(shape)
        for i, p in enumerate(places):
            if p[0] == "R":
                continue
            pl = Shard(p[1]) if p[0] == "S" else _StridedShard(p[1], split_factor=p[2])
            size, offs = _get_shard_size_and_offsets(local[p[1]], mesh[i], coord[i], pl,
                                                     rows[p[1]], shape[p[1]], False)
            local[p[1]], rows[p[1]] = size, offs if size else torch.arange(0)
        return [None if r is None else set(r.tolist()) for r in rows], local

    def fsdp_factor(places, mesh):  # FSDP2's split factor: the later mesh dims' on that dim
        return tuple(("T", p[1], max(1, math.prod(
            mesh[q] for q in range(i + 1, len(mesh))
            if places[q][0] in "ST" and places[q][1] == p[1]))) if p[0] == "T" else p
            for i, p in enumerate(places))

    rng, checked, strided, nested = random.Random(0), 0, 0, 0
    for _ in range(1200):
        shape = tuple(rng.randint(1, 40) for _ in range(rng.randint(1, 2)))
        mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        places = tuple(rng.choice([("S", rng.randrange(len(shape))), ("R",),
                                   ("T", rng.randrange(len(shape)), rng.randint(1, 4))])
                       for _ in mesh)
        if rng.random() < 0.7:
            places = fsdp_factor(places, mesh)
        m, f = math.prod(mesh), rng.choice([1, 2, 3, 4])
        n = m * f if rng.random() < 0.5 else max(1, m // f)
        mine, local = rows_of(shape, mesh, [rng.randrange(k) for k in mesh], places)
        if not all(local):
            continue  # (an empty box)
        spans = [(0, d) if r is None else (min(r), max(r) + 1) for r, d in zip(mine, shape)]
        if any(r is not None and len(r) != b - a for r, (a, b) in zip(mine, spans)):
            continue  # (rows that are not one box: refused on save)
        offsets, sizes = tuple(a for a, _ in spans), tuple(b - a for a, b in spans)
        body = {"world_size": n, "tensors": {"t": {"shape": list(shape)}}}
        got = idx.writers_of(body, {"t": (offsets, sizes, (mesh, places))})
        want, scaled = set(), False
        for k in range(len(mesh)):
            if mesh[k] * n % m:
                continue
            scaled, saved = True, (*mesh[:k], mesh[k] * n // m, *mesh[k + 1:])
            # FSDP2's split factor on the saving mesh: the later dims' there (a factor that
            # was not FSDP2's on this mesh stays)
            places_saved = tuple(
                fsdp_factor(places, saved)[i] if p[0] == "T" and p == fsdp_factor(places, mesh)[i]
                else p for i, p in enumerate(places))
            for r, c in enumerate(itertools.product(*map(range, saved))):
                theirs, size = rows_of(shape, saved, c, places_saved)
                if all(size) and all(t is None or any(a <= x < a + z for x in t)
                                     for t, a, z in zip(theirs, offsets, sizes)):
                    want.add(r)
        assert got == (frozenset(want) if scaled else None), (shape, mesh, places, n, got, want)
        checked += 1
        strided += any(p[0] == "T" for p in places)
        shards = [p[1] for p in places if p[0] in "ST"]
        nested += len(shards) > len(set(shards))
    assert checked > 800 and strided > 300 and nested > 200, (checked, strided, nested)


def test_a_damaged_index_of_another_rank_still_skips_the_step_on_every_rank(tmp_path, caplog):
    """Step 2's index of rank 1 is damaged: rank 0, reading only its own, would take step 2
    where rank 1 cannot; the load's agreement sees it and every rank reads every index again,
    so all skip step 2 and load step 1, as before own-index reads."""
    root = str(tmp_path / "other")
    run(_fsdp_save, 2, root, (1,))
    first = run(_load_reading, 2, root)
    run(_fsdp_save, 2, root, (2,))
    body = _doc(root, 2)["body"]
    p = os.path.join(_step_dir(root, 2), body["indexes"][1]["file"])
    data = bytearray(open(p, "rb").read())
    data[len(data) // 2] ^= 0x20
    open(p, "wb").write(bytes(data))
    out = run(_load_reading, 2, root)
    for r, (step, got, read) in enumerate(out):
        assert step == 1, (r, step)
        assert_same(first[r][1], got)
    # an explicit step 2 fails on every rank, naming rank 1's index
    for r, res in enumerate(run(_load_step_error, 2, root, 2)):
        assert "invalid chunk index of rank 1" in res, (r, res)


def _load_step_error(rank, world, root, step):
    try:
        _load_reading(rank, world, root, step=step)
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return str(e)
    return "loaded"


def test_read_manifest_own_gives_a_partial_body(tmp_path):
    """read_manifest(own=(r, N)) reads rank r's index alone (the others may be gone): the
    inline chunks and rank r's, validated chunk by chunk; the full read needs every index."""
    from fastckpt.manifest.discovery import is_partial
    root = str(tmp_path / "partial")
    run(_fsdp_save, 2, root, (3,))
    d = _step_dir(root, 3)
    full = read_manifest(open_storage(root), d, step=3)
    os.remove(os.path.join(d, full["indexes"][0]["file"]))
    st = open_storage(root)
    part = read_manifest(st, d, step=3, own=(1, 2))
    assert is_partial(part, (1, 2)) and not is_partial(part, (1, 4))
    for fqn, t in part["tensors"].items():
        if t["dtensor"]:
            assert {c["rank"] for c in t["chunks"]} == {1}, fqn
        assert "chunks" in t
    inline = [f for f, t in full["tensors"].items() if not t["dtensor"]]
    assert inline and all(part["tensors"][f]["chunks"] == full["tensors"][f]["chunks"]
                          for f in inline)
    # a manifest without inline chunks (written before they were): every index, always
    doc = _doc(root, 3)
    del doc["body"]["inline"]
    write_doc(root, 3, doc)
    assert not is_partial(read_manifest(st, d, step=3, chunks=False), (1, 2))
    with pytest.raises(CorruptCheckpointError, match="missing: rank 0"):
        read_manifest(st, d, step=3, own=(1, 2))
    with pytest.raises(CorruptCheckpointError, match="missing: rank 0"):
        read_manifest(st, d, step=3)
    with pytest.raises(CorruptCheckpointError, match="missing: rank 0"):
        read_manifest(st, d, step=3, own=(0, 2))
    # another world size reads every index
    with pytest.raises(CorruptCheckpointError, match="missing: rank 0"):
        read_manifest(st, d, step=3, own=(1, 4))
