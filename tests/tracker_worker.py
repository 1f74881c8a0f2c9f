"""A small training loop that reports to an experiment tracker, for tests/test_trackers.py.

Each rank trains a linear model with SGD on data that is a pure function of (step, rank),
all-reduces the gradients when there are several ranks, logs ``loss`` to a
``fastckpt.trackers`` run every step, and calls ``ckpt.save(state, step=s + 1,
on_preempt=True)``: a stop signal ends it through the preemption trigger (exit 143 / 0 / 144)
with the tracker's exit hook. The state is ``{"model", "optim", "tracker"}``.

Two ways to start it:

* ``spawn(cfg)``: ``python -m tests.tracker_worker CFG_JSON`` as a fresh interpreter (one
  process): the exit goes through the interpreter's own shutdown (``atexit`` handlers, which
  MLflow and W&B register), as for a training script;
* ``launch(world, cfg)``: ``world`` gloo ranks forked from the tests' forkserver (torch already
  imported: they start in milliseconds).

cfg keys: root, out, tag, tracker ("wandb" or "mlflow"), tracking_uri (MLflow), env (set
before anything is imported), steps (run this many steps, then ``tracker.finish()``; default:
until stopped, at most MAX_STEPS), step_s, grace_s, cancel_signals, fail ("manifest": the
manifest's write fails with ENOSPC, so an emergency save fails: exit 144).

Files under ``cfg["out"]`` (per rank r):

* ``log-<tag>-r<r>.txt``: the rank's stdout and stderr (forked ranks),
* ``resumed-<tag>-r<r>.json``: ``{"step", "run_id"}`` right after ``ckpt.resume``, before the
  tracker starts (the run id the checkpoint gave this rank),
* ``started-<tag>-r<r>.json``: ``{"run_id"}`` after ``tracker.start``,
* ``ready-<tag>-r<r>``: this process has trained 3 steps (send the signal now),
* ``done-<tag>-r<r>.json``: ``{"last_step"}`` after a normal end (``tracker.finish()``).
"""

from __future__ import annotations

import json
import os
import sys
import time

MAX_STEPS = 1500  # a run that is never signalled ends on its own (and the test fails)


def _write(out: str, name: str, value: object) -> None:
    tmp = os.path.join(out, f".{name}.tmp")
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, os.path.join(out, name))


def _full_disk_at_commit() -> None:
    """Every manifest write of this process fails as on a full disk (ENOSPC): nothing can be
    committed, so the emergency save fails (exit 144)."""
    import errno

    from fastckpt.manifest import schema as fmt
    from fastckpt.testing import faults
    orig = faults.FaultyStorage.publish

    def publish(self, path, data, *, durable=True):
        if path.endswith("/" + fmt.MANIFEST):
            raise OSError(errno.ENOSPC, "No space left on device (injected)", path)
        return orig(self, path, data, durable=durable)
    faults.FaultyStorage.publish = publish


def _tracker(cfg: dict):
    from fastckpt import trackers
    if cfg["tracker"] == "wandb":
        import wandb
        settings = wandb.Settings(console="off", x_disable_stats=True, x_disable_meta=True,
                                  disable_git=True, save_code=False, silent=True)
        return trackers.WandbRun(project="fastckpt-test", settings=settings)
    return trackers.MlflowRun(experiment="fastckpt-test", tracking_uri=cfg["tracking_uri"])


def train(rank: int, world: int, cfg: dict) -> None:
    import torch
    import torch.distributed as dist

    import fastckpt
    from fastckpt.testing import faults
    out, tag = cfg["out"], cfg["tag"]
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    tracker = _tracker(cfg)
    state = {"model": model, "optim": opt, "tracker": tracker}
    kw: dict = {"grace_s": cfg.get("grace_s", 20.0)}
    if cfg.get("cancel_signals"):
        kw["cancel_signals"] = tuple(cfg["cancel_signals"])
    if cfg.get("fail") == "manifest":
        _full_disk_at_commit()
    ck = fastckpt.Checkpointer(faults.open_faulty(cfg["root"], rank=rank), **kw)
    start = ck.resume(state)
    _write(out, f"resumed-{tag}-r{rank}.json", {"step": start, "run_id": tracker.run_id})
    tracker.start(ck)
    _write(out, f"started-{tag}-r{rank}.json", {"run_id": tracker.run_id})
    first = start or 0
    last = first + (cfg.get("steps") or MAX_STEPS)
    for step in range(first, last):
        g = torch.Generator().manual_seed(step * 1000 + rank)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        if world > 1:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad.div_(world)
        opt.step()
        tracker.log({"loss": loss.item()}, step=step)
        if step == first + 2:
            open(os.path.join(out, f"ready-{tag}-r{rank}"), "w").close()
        time.sleep(cfg.get("step_s", 0.02))
        ck.save(state, step=step + 1, on_preempt=True)
    tracker.finish()
    ck.close()
    _write(out, f"done-{tag}-r{rank}.json", {"last_step": last - 1})


def _setup(cfg: dict) -> None:
    os.environ.update(cfg.get("env") or {})
    import logging
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")


def _entry(rank: int, world: int, port: int, cfg: dict) -> None:
    """A forked rank (``launch``)."""
    out, tag = cfg["out"], cfg["tag"]
    fd = os.open(os.path.join(out, f"log-{tag}-r{rank}.txt"), os.O_WRONLY | os.O_CREAT, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    _setup(cfg)
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        train(rank, world, cfg)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()


def launch(world: int, cfg: dict) -> list:
    """Start ``world`` ranks forked from the tests' forkserver; return the processes."""
    from tests.distributed import _context, free_port
    os.makedirs(cfg["out"], exist_ok=True)
    ctx = _context()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, cfg)) for r in range(world)]
    for p in procs:
        p.start()
    return procs


def spawn(cfg: dict):
    """Start one rank as a fresh interpreter; return the ``subprocess.Popen``."""
    import subprocess
    os.makedirs(cfg["out"], exist_ok=True)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    log = open(os.path.join(cfg["out"], f"log-{cfg['tag']}-r0.txt"), "ab")
    try:
        return subprocess.Popen([sys.executable, "-m", "tests.tracker_worker", json.dumps(cfg)],
                                cwd=repo, stdin=subprocess.DEVNULL, stdout=log,
                                stderr=subprocess.STDOUT)
    finally:
        log.close()


def main() -> None:
    cfg = json.loads(sys.argv[1])
    _setup(cfg)
    import torch
    torch.set_num_threads(1)
    train(0, 1, cfg)


if __name__ == "__main__":
    main()
