"""A small FSDP2 training job on CPU that checkpoints with fastckpt and resumes exactly.

    torchrun --nproc-per-node 2 examples/train_demo.py --root demo-out/ckpt --steps 60

Every rank trains the same model sharded with ``fully_shard`` (gloo, CPU), saves asynchronously
every ``--save-every`` steps, and on start resumes from the newest committed checkpoint. Losses
go to ``--loss-log`` (one JSON line per step, rank 0) so a stopped-and-resumed run can be compared
with an uninterrupted one.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import fastckpt


def build(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                            torch.nn.GELU(), torch.nn.Linear(256, 16))
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(10_000 + step)  # the data is a function of the step
    x, y = torch.randn(32, 64, generator=g), torch.randn(32, 16, generator=g)
    per = 32 // world
    return x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--loss-log", required=True)
    ap.add_argument("--step-sleep", type=float, default=0.05)
    args = ap.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    model = build()
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # RNGState: dropout, shuffling and sampling resume bit-exact too (none in this tiny model)
    state = {"model": model, "optim": optim, "step": 0, "data": {"epoch": 0},
             "rng": fastckpt.RNGState()}

    ckpt = fastckpt.Checkpointer(args.root, keep_last=3)
    start = ckpt.resume(state)
    first = 0 if start is None else state["step"]
    if rank == 0:
        print(f"[demo] world size {world}; "
              + ("fresh start" if start is None else f"resumed from step {start}"), flush=True)
    log = open(args.loss_log, "a") if rank == 0 else None
    for step in range(first, args.steps):
        x, y = batch(step, rank, world)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)
        state["step"] = step + 1
        if log:
            log.write(json.dumps({"step": step, "loss": loss.item() / world}) + "\n")
            log.flush()
        if (step + 1) % args.save_every == 0:
            h = ckpt.save(state, step=step + 1)  # returns once staged; commits in the background
            if rank == 0:
                print(f"[demo] step {step + 1}/{args.steps}: loss {loss.item() / world:.4f}; "
                      f"checkpoint staged in {h.timings['stage_s'] * 1e3:.1f} ms, committing "
                      "in the background", flush=True)
        time.sleep(args.step_sleep)
    ckpt.close()
    if rank == 0:
        print(f"[demo] finished {args.steps} steps", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
