"""``fastckpt.dcp.Writer``: ``dcp.save``/``dcp.async_save`` write fastckpt checkpoints (manifest
commit, checksums) that the engine, the CLI tools and DCP itself read back, resharded."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import fastckpt
import fastckpt.dcp
from fastckpt.errors import UnsupportedStateError
from fastckpt.tools.verify import verify_step
from tests.distributed import run
from tests.models import assert_same, fsdp_mlp, full_state, mlp, train_step


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # DCP's single-process warnings
        yield


def _state(seed=0):
    m = mlp(seed)
    return {"model": m.state_dict(), "n": 7, "cfg": {"lr": 0.5, "names": ["a", "b"]},
            "lst": [torch.arange(5), torch.ones(2, 3)]}


def _equal(a, b):
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


def test_dcp_save_is_a_fastckpt_checkpoint(root):
    state = _state()
    dcp.save(state, storage_writer=fastckpt.dcp.Writer(root, step=5))
    assert fastckpt.latest_step(root) == 5
    assert verify_step(root, 5, record=False).ok
    # the engine reads it whole, nested as saved (lists stay lists)
    got = fastckpt.read(root)
    assert _equal(got, state)
    # and DCP reads it back into a fresh state
    fresh = _state(3)
    fresh["n"], fresh["cfg"] = 0, {"lr": 0.0, "names": []}
    dcp.load(fresh, storage_reader=fastckpt.dcp.Reader(root))
    assert _equal(fresh, state)


def test_checkpoint_id_style(tmp_path):
    root = str(tmp_path / "run")
    state = _state()
    for step in (10, 20):
        state["n"] = step
        dcp.save(state, checkpoint_id=f"{root}/step-{step}", storage_writer=fastckpt.dcp.Writer())
    assert fastckpt.steps(root) == [10, 20]
    fresh = _state(4)
    dcp.load(fresh, checkpoint_id=f"{root}/step-10", storage_reader=fastckpt.dcp.Reader())
    assert fresh["n"] == 10 and _equal(fresh["model"], state["model"])
    dcp.load(fresh, checkpoint_id=root, storage_reader=fastckpt.dcp.Reader())  # the newest
    assert fresh["n"] == 20


def test_a_second_save_of_a_step_replaces_it(root):
    state = _state()
    dcp.save(state, storage_writer=fastckpt.dcp.Writer(root, step=1))
    first = set(os.listdir(f"{root}/step-0000000001"))
    state["model"] = mlp(9).state_dict()
    dcp.save(state, storage_writer=fastckpt.dcp.Writer(root, step=1))
    second = set(os.listdir(f"{root}/step-0000000001"))
    assert not (first & second) - {"manifest.json"}  # older shard files gone
    assert _equal(fastckpt.read(root)["model"], state["model"])
    assert verify_step(root, 1, record=False).ok


def test_async_save(root):
    state = _state()
    fut = dcp.async_save(state, storage_writer=fastckpt.dcp.Writer(root, step=3))
    fut.result(timeout=120)
    assert _equal(fastckpt.read(root), state)


def test_unpicklable_values_refused_and_nothing_committed(root):
    class Opaque:
        pass
    state = {"w": torch.ones(3), "thing": Opaque()}
    with pytest.raises(CheckpointException) as ei:  # DCP wraps every rank's error
        dcp.save(state, storage_writer=fastckpt.dcp.Writer(root, step=1))
    err = ei.value.failures[0][0]  # (exception, traceback) per failed rank
    assert isinstance(err, UnsupportedStateError)
    assert "key path 'thing'" in str(err)
    assert fastckpt.latest_step(root) is None


def test_a_root_and_step_are_required(tmp_path):
    with pytest.raises(CheckpointException) as ei:
        dcp.save({"w": torch.ones(1)}, storage_writer=fastckpt.dcp.Writer(str(tmp_path)))
    assert "needs a root and a step" in str(ei.value.failures[0][0])
    assert fastckpt.dcp.split_checkpoint_id("/a/b/step-12/") == ("/a/b", 12)
    assert fastckpt.dcp.split_checkpoint_id("/a/b") == ("/a/b", None)


def _fsdp_save(rank, world, root, use_async):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    m = fsdp_mlp(0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for s in range(2):
        train_step(m, opt, s, rank, world)
    msd, osd = get_state_dict(m, opt)
    state = {"model": msd, "optim": osd, "step": 2}
    w = fastckpt.dcp.Writer(root, step=2)
    if use_async:
        dcp.async_save(state, storage_writer=w).result(timeout=120)
    else:
        dcp.save(state, storage_writer=w)
    return full_state(m, opt)


def _fsdp_dcp_load(rank, world, root):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    m = fsdp_mlp(7)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    train_step(m, opt, 0, rank, world)  # optimizer state exists to load into
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd, "step": 0}
    dcp.load(sd, checkpoint_id=f"{root}/step-2", storage_reader=fastckpt.dcp.Reader())
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return sd["step"], full_state(m, opt)


def _fsdp_engine_load(rank, world, root):
    m = fsdp_mlp(7)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    train_step(m, opt, 0, rank, world)
    step = fastckpt.load({"model": m, "optim": opt}, root, strict=False)
    return step, full_state(m, opt)


@pytest.mark.parametrize("use_async", [False, True], ids=["save", "async_save"])
def test_fsdp2_two_ranks_resharded(tmp_path, use_async):
    """2-rank FSDP2 through dcp.save / dcp.async_save, read back on 1, 2 and 4 ranks by DCP
    through fastckpt.dcp.Reader and by fastckpt.load."""
    root = str(tmp_path / "c")
    want = run(_fsdp_save, 2, root, use_async)
    assert_same(want[0], want[1])
    assert verify_step(root, 2, record=False).ok
    for world in (1, 2, 4):
        for step, got in run(_fsdp_dcp_load, world, root):
            assert step == 2
            assert_same(want[0], got)
    for step, got in run(_fsdp_engine_load, 4, root):
        assert step == 2
        assert_same(want[0], got)


def test_a_tensor_inside_a_tuple_is_named(root):
    """DCP passes a tuple whole (it would pickle it): the error says so, naming the key."""
    with pytest.raises(CheckpointException) as ei:
        dcp.save({"pair": (torch.ones(2), 3)}, storage_writer=fastckpt.dcp.Writer(root, step=1))
    err = ei.value.failures[0][0]
    assert isinstance(err, UnsupportedStateError)
    assert "tensor inside a tuple" in str(err) and "pair" in str(err)


# ------------------------------------------------ the review of 2026-12-06 (DCP path)

def test_a_planner_that_casts_is_stored_as_dcp_load_would_give_it(tmp_path):
    # before 2026-12-06 a same-size cast (fp16 -> bf16) was stored under the metadata's
    # dtype: its bytes reinterpreted, silently
    from torch.distributed.checkpoint import DefaultSavePlanner

    class SaveAs(DefaultSavePlanner):
        def resolve_data(self, item):
            t = super().resolve_data(item)
            return t.to(torch.bfloat16) if isinstance(t, torch.Tensor) else t
    w = torch.tensor([1.0, 2.5, -3.0, 1000.0], dtype=torch.float16)
    dcp.save({"w": w.clone()}, checkpoint_id=str(tmp_path / "dcp"), planner=SaveAs())
    ref = {"w": torch.zeros(4, dtype=torch.float16)}
    dcp.load(ref, checkpoint_id=str(tmp_path / "dcp"))
    root = str(tmp_path / "fc")
    dcp.save({"w": w.clone()}, storage_writer=fastckpt.dcp.Writer(root, step=1),
             planner=SaveAs())
    got = {"w": torch.zeros(4, dtype=torch.float16)}
    dcp.load(got, storage_reader=fastckpt.dcp.Reader(root))
    assert torch.equal(got["w"], ref["w"]) and torch.equal(fastckpt.read(root)["w"], ref["w"])


def test_a_save_of_a_step_leaves_another_saves_files_of_that_step(tmp_path):
    # save B of step 5 commits while save A of step 5 is between its writes and its commit:
    # before 2026-12-06 A removed every file its manifest did not name (B's, and any other
    # save's in flight) and the step named missing files when B committed after it
    root = str(tmp_path)
    a = fastckpt.dcp.Writer(root, step=5)
    finish = a.finish

    def b_inside(metadata, results):
        dcp.save({"w": torch.full((8,), 2.0)}, storage_writer=fastckpt.dcp.Writer(root, step=5))
        finish(metadata, results)
    a.finish = b_inside
    dcp.save({"w": torch.full((8,), 1.0)}, storage_writer=a)
    assert torch.equal(fastckpt.read(root)["w"], torch.full((8,), 1.0))  # A replaced B
    d = os.path.join(root, "step-0000000005")
    assert sorted(os.listdir(d))[0] == "manifest.json" and len(os.listdir(d)) == 2  # B's gone
    # and the other order: A commits first, B (inside A's write) after it
    b = fastckpt.dcp.Writer(root, step=6)
    write = b.write_data

    def a_inside(plan, planner):
        dcp.save({"w": torch.full((8,), 3.0)}, storage_writer=fastckpt.dcp.Writer(root, step=6))
        return write(plan, planner)
    b.write_data = a_inside
    dcp.save({"w": torch.full((8,), 4.0)}, storage_writer=b)
    assert torch.equal(fastckpt.read(root)["w"], torch.full((8,), 4.0))
    assert verify_step(root, 5, record=False).ok and verify_step(root, 6, record=False).ok


@pytest.mark.parametrize("cfg", [{"$tensor": "y"}, {"$tuple": [1, 2]}, {"$lr": 0.1, "b": 2},
                                 {"$dict": [[1, 2]]}, {"$float": "nan"}])
def test_user_keys_that_look_like_tags_round_trip(tmp_path, cfg):
    # before 2026-12-06 the first came back as a tensor reference, the second as a tuple, and
    # the third failed the save ("malformed tagged value")
    state = {"y": torch.ones(3), "cfg": cfg}
    dcp.save(state, storage_writer=fastckpt.dcp.Writer(str(tmp_path), step=1))
    assert fastckpt.read(str(tmp_path))["cfg"] == cfg


def test_writer_options_it_does_not_use_are_refused():
    with pytest.raises(ValueError, match="does not use compression"):
        fastckpt.dcp.Writer("/tmp/x", step=1, compression="zstd")
    fastckpt.dcp.Writer("/tmp/x", step=1, commit_timeout_s=30)  # one it uses


def test_use_collectives_false_is_refused_by_name(tmp_path):
    with pytest.raises(UnsupportedStateError, match="needs use_collectives=True"):
        dcp.save({"w": torch.ones(2)}, storage_writer=fastckpt.dcp.Writer(str(tmp_path), step=1),
                 use_collectives=False)
    assert fastckpt.steps(str(tmp_path)) == []


def _rank_local(rank, world, root):
    # (each rank saves its own checkpoint without the process group: rank 0 of that save)
    r = os.path.join(root, f"r{rank}")
    dcp.save({"w": torch.full((4,), float(rank))}, storage_writer=fastckpt.dcp.Writer(r, step=1),
             no_dist=True)
    return fastckpt.read(r, collective=False)["w"].tolist()


def test_a_rank_local_save_on_rank_1_commits(tmp_path):
    # before 2026-12-06 rank 1 wrote "rank": 1 into a manifest of one rank: refused
    assert run(_rank_local, 2, str(tmp_path)) == [[0.0] * 4, [1.0] * 4]


def test_dcps_load_everything_helpers_nest_the_state(tmp_path):
    # the Reader's metadata carries the key paths (planner_data): before 2026-12-06 DCP's
    # load-everything planner returned flat dotted keys, and keys= raised AttributeError
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys
    state = {"model": {"w": torch.ones(2, 2), "b": torch.zeros(2)}, "extra": {"step": 3}}
    dcp.save(state, storage_writer=fastckpt.dcp.Writer(str(tmp_path), step=1))
    got = _load_state_dict_from_keys(storage_reader=fastckpt.dcp.Reader(str(tmp_path)))
    assert sorted(got) == ["extra", "model"] and got["extra"] == {"step": 3}
    assert torch.equal(got["model"]["w"], torch.ones(2, 2))
    got = _load_state_dict_from_keys(keys={"model"},
                                     storage_reader=fastckpt.dcp.Reader(str(tmp_path)))
    assert sorted(got) == ["model"] and sorted(got["model"]) == ["b", "w"]
