"""A tiny data-parallel job for the real-Slurm tests (gloo, CPU), started by srun (RANK etc.
mapped from SLURM_* by ``fastckpt resume``) or by torchrun:
``slurm_worker.py ROOT STEPS OUT [STEP_S]``.

Every step's batch is a function of the step alone, so a run that is stopped, requeued and
resumed must produce exactly the losses and final parameters of an uninterrupted run. Rank 0
appends ``restart_count resumed_step`` to ``OUT/runs`` once it has resumed (``-1``: a fresh
start), ``step loss.hex() restart_count`` to ``OUT/losses`` after each step, and writes the
final parameters and Adam state to ``OUT/final.pt`` at the end."""

import os
import sys
import time

import torch
import torch.distributed as dist

import fastckpt


def main() -> None:
    root, steps, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    step_s = float(sys.argv[4]) if len(sys.argv) > 4 else 0.05
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim}
    ck = fastckpt.Checkpointer(root)  # the windows come from FASTCKPT_*_GRACE_S
    start = ck.resume(state)
    restarts = os.environ.get("SLURM_RESTART_COUNT", "0")
    if rank == 0:  # a run may have no step left to do (warned after the last): it shows here
        with open(os.path.join(out, "runs"), "a") as f:
            f.write(f"{restarts} {-1 if start is None else start}\n")
    for step in range(0 if start is None else start + 1, steps):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(8 * world, 16, generator=g)[rank * 8:(rank + 1) * 8]
        loss = model(x).pow(2).mean()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
        optim.step()
        optim.zero_grad()
        whole = loss.detach().clone()
        dist.all_reduce(whole)
        if rank == 0:
            with open(os.path.join(out, "losses"), "a") as f:
                f.write(f"{step} {whole.item().hex()} {restarts}\n")
        time.sleep(step_s)
        ck.save(state, step=step, on_preempt=True)
    ck.close()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optim": optim.state_dict()},
                   os.path.join(out, "final.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
