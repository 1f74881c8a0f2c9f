"""A tiny data-parallel job for torchrun (gloo, CPU) with ``on_preempt`` saves, for the
supervisor tests: ``torchrun ... tests/torchrun_worker.py ROOT STEPS PROGRESS [crash_at]``.
Rank 0 appends each finished step to PROGRESS."""

import sys
import time

import torch
import torch.distributed as dist

import fastckpt


def main() -> None:
    root, steps, progress = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    crash_at = int(sys.argv[4]) if len(sys.argv) > 4 else -1
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = {"model": model, "optim": optim}
    ck = fastckpt.Checkpointer(root, grace_s=20)
    start = ck.resume(state)
    for step in range(0 if start is None else start + 1, steps):
        if step == crash_at:
            raise RuntimeError(f"rank {rank}: crashing at step {step} (on purpose)")
        model(torch.ones(4, 8) * step).pow(2).mean().backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
        optim.step()
        optim.zero_grad()
        if rank == 0:
            with open(progress, "a") as f:
                f.write(f"{step}\n")
        time.sleep(0.05)
        ck.save(state, step=step, on_preempt=True)
    ck.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
