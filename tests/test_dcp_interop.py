"""A fastckpt checkpoint loads with plain ``torch.distributed.checkpoint.load``."""

from __future__ import annotations

import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._nested_dict import flatten_state_dict

import fastckpt
from fastckpt.engine.state import flatten
from tests.distributed import run
from tests.models import fsdp_mlp, full_state, mlp, train_step


def test_fqns_match_dcp_flattening():
    state = {"model": mlp(0).state_dict(), "lst": [torch.ones(1), {"x": torch.zeros(2)}],
             "plain": [1, 2], "n": 3}
    ours = set(flatten(state).tensors)
    theirs = {k for k, v in flatten_state_dict(state)[0].items() if isinstance(v, torch.Tensor)}
    assert ours == theirs


def test_dcp_load_single_process(root):
    m = mlp(0)
    fastckpt.save({"model": m, "step": 9, "cfg": {"lr": 0.5}}, root, step=9)
    sd = {"model": mlp(3).state_dict(), "step": 0, "cfg": {"lr": 0.0}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.load(sd, storage_reader=fastckpt.FastCkptReader(root))
    assert sd["step"] == 9 and sd["cfg"] == {"lr": 0.5}
    for k, v in m.state_dict().items():
        assert torch.equal(sd["model"][k], v)


def _save_fsdp(rank, world, root):
    m = fsdp_mlp(0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    train_step(m, opt, 0, rank, world)
    fastckpt.save({"model": m, "optim": opt}, root, step=1)
    return full_state(m, opt)


def _dcp_load_fsdp(rank, world, root):
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    m = fsdp_mlp(5)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    msd, osd = get_state_dict(m, opt)
    sd = {"model": msd, "optim": osd}
    dcp.load(sd, storage_reader=fastckpt.FastCkptReader(root))
    set_state_dict(m, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    return full_state(m, opt)


def test_dcp_load_fsdp2_resharded(tmp_path):
    root = str(tmp_path / "c")
    want = run(_save_fsdp, 2, root)[0]
    for got in run(_dcp_load_fsdp, 4, root):
        assert want.keys() == got.keys()
        for k in want:
            assert torch.equal(want[k], got[k]), k
