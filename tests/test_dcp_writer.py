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
