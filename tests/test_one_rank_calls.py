"""Frameworks that call the checkpoint code on one rank only (Lightning's DDP strategy calls
``CheckpointIO.save_checkpoint`` on rank 0 while rank 1 waits in its barrier): no hang, an
error naming the ranks that did not arrive, and a rank-local mode (issue 10, defect 2)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import fastckpt
from tests import distributed


def _rank0_saves_alone(rank: int, world: int, root: str):
    state = {"w": torch.full((4,), 1.0)}
    out = None
    if rank == 0:  # what Lightning's DDP strategy does
        t0 = time.monotonic()
        try:
            fastckpt.save(state, root, step=1, plan_timeout_s=3)
            out = "saved"
        except fastckpt.CollectiveTimeoutError as e:
            out = (time.monotonic() - t0, e.missing_ranks, str(e))
    dist.barrier()  # the framework's barrier after its checkpoint hook
    return out


def test_a_save_on_one_rank_fails_naming_the_others(root):
    out = distributed.run(_rank0_saves_alone, 2, root, timeout=90)
    took, missing, msg = out[0]
    assert missing == [1] and took < 3 + 5, out
    assert "rank(s) [1] did not arrive" in msg and "collective=False" in msg


def _rank_local(rank: int, world: int, root: str):
    state = {"w": torch.full((4,), 7.0), "step": 3}
    if rank == 0:
        fastckpt.save(state, root, step=3, collective=False)
    dist.barrier()
    dest = {"w": torch.zeros(4), "step": 0}  # every rank loads the whole replicated state
    step = fastckpt.load(dest, root, collective=False)
    return step, dest["w"].tolist(), dest["step"]


def test_rank_local_mode_saves_on_one_rank_and_loads_on_each(root):
    out = distributed.run(_rank_local, 2, root, timeout=90)
    assert out == [(3, [7.0] * 4, 3)] * 2
    import json
    import os
    doc = json.load(open(os.path.join(root, "step-0000000003", "manifest.json")))
    assert doc["body"]["world_size"] == 1


def _rank0_loads_alone(rank: int, world: int, root: str):
    if rank == 0:
        fastckpt.save({"w": torch.ones(2)}, root, step=1, collective=False)
    dist.barrier()
    out = None
    if rank == 0:
        try:
            fastckpt.load({"w": torch.zeros(2)}, root, plan_timeout_s=2)
        except fastckpt.CollectiveTimeoutError as e:
            out = e.missing_ranks
    dist.barrier()
    return out


def test_a_load_on_one_rank_fails_naming_the_others(root):
    assert distributed.run(_rank0_loads_alone, 2, root, timeout=90)[0] == [1]
