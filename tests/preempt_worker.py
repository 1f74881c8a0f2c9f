"""A small data-parallel training loop on N real gloo ranks, for the preemption tests.

``launch(world, cfg)`` starts ``world`` processes (forked from the tests' forkserver, so each
starts in milliseconds) and returns them: the test sends real signals to ``p.pid`` and reads
``p.exitcode``. Each rank trains a tiny MLP with Adam on data that is a pure function of
(step, rank), all-reduces the gradients, calls ``ckpt.save(state, step=s, on_preempt=True)``
every step, and writes under ``cfg["out"]``:

* ``losses-<tag>-r<rank>.jsonl``: ``{"step", "loss"}`` per finished step (the test's clock),
* ``final-<tag>-r<rank>.pt``: model and optimizer state after the last step (if it got there),
* ``log-<tag>-r<rank>.txt``: the rank's stdout and stderr.

cfg keys: root, out, tag, total, step_s, grace_s, save_every, mib (padding per rank),
save_steps, throttle_mibps, throttle_after_periodic,
fault_after_periodic ("point@rank" armed after the first periodic save),
slow_resume_s, long_step ({rank: [step, seconds]}), consensus, cancel_signals,
staging_cap_mib, remote ({"url", "options", "local_survives"}: a remote tier), root_options
(storage options of an object-store root), event_log.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from tests.distributed import _context, free_port


class SlowLoad:
    """A stateful object whose load takes a while (to signal a rank during ``resume``)."""

    def __init__(self, out: str, tag: str, rank: int, seconds: float) -> None:
        self.marker = os.path.join(out, f"resuming-{tag}-r{rank}")
        self.seconds = seconds

    def state_dict(self) -> dict:
        return {"v": 1}

    def load_state_dict(self, sd: dict) -> None:
        open(self.marker, "w").close()
        time.sleep(self.seconds)


def _entry(rank: int, world: int, port: int, cfg: dict) -> None:
    out, tag = cfg["out"], cfg["tag"]
    fd = os.open(os.path.join(out, f"log-{tag}-r{rank}.txt"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    import logging

    import torch.distributed as dist
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(rank, world, cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()


def train(rank: int, world: int, cfg: dict) -> None:
    import torch.distributed as dist

    import fastckpt
    out, tag = cfg["out"], cfg["tag"]
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    n = int(cfg.get("mib", 0) * (1 << 20)) // 4
    state = {"model": model, "optim": opt, "pad": {f"r{rank}": torch.zeros(n)}, "note": "x"}
    if cfg.get("slow_resume_s"):
        state["slow"] = SlowLoad(out, tag, rank, cfg["slow_resume_s"])
    kw = {"grace_s": cfg.get("grace_s", 20.0), "commit_timeout_s": 30}
    if cfg.get("consensus"):
        kw["preempt_consensus"] = cfg["consensus"]
    if cfg.get("cancel_signals"):
        kw["cancel_signals"] = tuple(cfg["cancel_signals"])
    if cfg.get("staging_cap_mib"):
        kw["staging_cap_bytes"] = int(cfg["staging_cap_mib"] * (1 << 20))
    if cfg.get("remote"):  # a remote tier: {"url", "options", "local_survives"}
        kw.update(remote=cfg["remote"]["url"], remote_storage_options=cfg["remote"]["options"],
                  local_survives=cfg["remote"].get("local_survives", False))
    from fastckpt.testing import faults
    if cfg.get("event_log"):
        kw["event_log"] = cfg["event_log"]
    storage = faults.open_faulty(cfg["root"], rank=rank, throttle_mibps=cfg.get("throttle_mibps"),
                                 **({"storage_options": cfg["root_options"]}
                                    if cfg.get("root_options") else {}))
    ck = fastckpt.Checkpointer(storage, **kw)
    start = ck.resume(state)
    with open(os.path.join(out, f"resumed-{tag}-r{rank}"), "w") as f:
        f.write(json.dumps(start))
    first = 0 if start is None else start + 1
    losses = open(os.path.join(out, f"losses-{tag}-r{rank}.jsonl"), "a", buffering=1)
    long_step = (cfg.get("long_step") or {}).get(str(rank))
    for step in range(first, cfg["total"]):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x, y = torch.randn(32, 16, generator=g), torch.randn(32, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad.div_(world)
        opt.step()
        state["pad"][f"r{rank}"].fill_(step)
        avg = loss.detach().clone()
        dist.all_reduce(avg)
        losses.write(json.dumps({"step": step, "loss": avg.item() / world, "t": time.time()})
                     + "\n")
        if long_step and step == long_step[0]:
            time.sleep(long_step[1])
        every = cfg.get("save_every")
        if (every and step > 0 and step % every == 0) or step in cfg.get("save_steps", ()):
            ck.save(state, step=step)
            if cfg.get("fault_after_periodic"):
                ck.wait()
                storage.arm(kill_at=faults.kill_point(cfg["fault_after_periodic"], rank))
            if cfg.get("throttle_after_periodic"):
                ck.wait()
                storage.arm(throttle_mibps=cfg["throttle_after_periodic"])
            open(os.path.join(out, f"saved-{tag}-r{rank}"), "w").close()
        time.sleep(cfg.get("step_s", 0.02))
        ck.save(state, step=step, on_preempt=True)
    ck.close()
    torch.save({"model": model.state_dict(), "optim": opt.state_dict()},
               os.path.join(out, f"final-{tag}-r{rank}.pt"))


def launch(world: int, cfg: dict) -> list:
    """Start ``world`` ranks running ``train``; return the processes."""
    os.makedirs(cfg["out"], exist_ok=True)
    ctx = _context()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, cfg)) for r in range(world)]
    for p in procs:
        p.start()
    return procs
