"""Plain torch.distributed.checkpoint (DCP) with fastckpt as its storage layer: FSDP2 on CPU.

    torchrun --nproc-per-node 2 examples/dcp_fsdp2.py --root /tmp/dcp-demo     # saves steps 2, 4
    torchrun --nproc-per-node 1 examples/dcp_fsdp2.py --root /tmp/dcp-demo     # resumes at 4, on 1 rank

The only fastckpt lines are the ``storage_writer=`` / ``storage_reader=`` arguments: DCP plans
the save as usual (each rank its own shards), fastckpt writes the files with checksums and
commits the step with its manifest; ``fastckpt ls /tmp/dcp-demo`` lists it.
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fastckpt
import fastckpt.dcp


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--every", type=int, default=2)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
    mesh = init_device_mesh("cpu", (world,))
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)

    start = fastckpt.latest_step(args.root) or 0
    if start:
        msd, osd = get_state_dict(model, optim)
        state = {"model": msd, "optim": osd, "step": 0}
        dcp.load(state, checkpoint_id=f"{args.root}/step-{start}",
                 storage_reader=fastckpt.dcp.Reader())                       # <- fastckpt
        set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
        if rank == 0:
            print(f"resumed step {state['step']} on {world} rank(s)")
    for step in range(start + 1, args.steps + 1):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}")
        if step % args.every == 0:
            msd, osd = get_state_dict(model, optim)
            dcp.save({"model": msd, "optim": osd, "step": step},
                     storage_writer=fastckpt.dcp.Writer(args.root, step=step))   # <- fastckpt
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
