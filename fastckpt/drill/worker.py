"""One rank of the ``fastckpt drill`` training job (the only drill module that imports torch).

    RANK=0 WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=29500 \\
        python -m fastckpt.drill.worker JOB.json

The driver (:mod:`fastckpt.drill`) writes ``JOB.json`` and starts one process per rank;
this module trains a small model sharded with FSDP2 (``fully_shard``; gloo on CPU, NCCL on
CUDA) with AdamW, dropout (per-rank RNG, saved with :class:`fastckpt.RNGState`) and a padding
tensor of ``pad_bytes`` per rank beside them, so that a save of the state takes measurable
time. Every step ends with ``ckpt.save(state, step=s, on_preempt=True)`` (``s`` = steps done);
the steps in ``save_at`` are also saved synchronously (the committed checkpoint a preemption
that cannot save falls back to).

Job keys: ``root``, ``out``, ``tag``, ``total`` (steps), ``step_s`` (sleep per step),
``grace_s``, ``pad_bytes``, ``save_at`` (list of steps), ``throttle_mibps`` (a slow disk:
shard writes of each rank share that bandwidth, via :mod:`fastckpt.testing.faults`),
``throttle_to_window_s`` (the same, at the bandwidth that writes this rank's state in that
many seconds),
``backend`` (``auto``/``gloo``/``nccl``), ``tamper`` (drill self-tests only: ``"param-ulp"``
moves one parameter by one ulp after the resume, a restart that is not bit-exact).

Files written under ``out`` (per rank ``r``):

* ``steps-<tag>-r<r>.jsonl``: ``{"step", "loss", "t"}`` per finished step (``loss`` is the
  all-reduced mean, written with ``repr`` precision so that two runs compare exactly);
* ``resumed-<tag>-r<r>.json``: ``{"start": steps done by the checkpoint loaded, or null}``;
* ``final-<tag>-r<r>.json``: after the last step, a SHA-256 of every local tensor (parameter
  shards, AdamW ``exp_avg``/``exp_avg_sq``/``step``, the padding) with dtype and shape;
* ``log-<tag>-r<r>.txt``: the rank's stdout and stderr (the driver redirects them);
* under Slurm (``--task``, see :func:`task`): ``task-<tag>-r<r>.json`` and
  ``exit-<tag>-r<r>.json``, the rank's pid and the exit code it exits with.

Exit codes are fastckpt's: 0 the job finished (or was cancelled), 143 preempted, 144 the
emergency path failed; 1 an error (traceback in the log).
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import sys
import time
from typing import Any


def _device(backend: str):
    import torch
    if backend == "auto":
        backend = "nccl" if torch.cuda.is_available() and \
            torch.cuda.device_count() >= int(os.environ.get("LOCAL_WORLD_SIZE",
                                                            os.environ["WORLD_SIZE"])) else "gloo"
    if backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", os.environ["RANK"]))
        torch.cuda.set_device(local)
        return backend, torch.device("cuda", local)
    return backend, torch.device("cpu")


def build(device: Any) -> Any:
    """The model: 16 -> 64 -> 64 -> 4 MLP with dropout, every Linear sharded with FSDP2."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Dropout(0.1),
                            torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    m.to(device)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    return fully_shard(m, mesh=mesh)


def batch(step: int, rank: int, world: int, device):
    """This rank's part of the global batch of ``step`` (a pure function of the step)."""
    import torch
    g = torch.Generator().manual_seed(10_000 + step)
    per = 8
    x, y = torch.randn(per * world, 16, generator=g), torch.randn(per * world, 4, generator=g)
    return (x[rank * per:(rank + 1) * per].to(device), y[rank * per:(rank + 1) * per].to(device))


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _digest(t) -> dict:
    import torch
    t = _local(t).detach().cpu().contiguous()
    raw = t.reshape(-1).view(torch.uint8)
    return {"sha256": hashlib.sha256(raw.numpy().tobytes()).hexdigest(),
            "dtype": str(t.dtype).replace("torch.", ""), "shape": list(t.shape)}


def digests(model, optim, pad: dict) -> dict:
    """name -> digest of every local tensor of this rank's training state."""
    out = {}
    names = {id(p): n for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        out[f"param/{n}"] = _digest(p)
    for p, st in optim.state.items():
        for k, v in sorted(st.items()):
            if hasattr(v, "shape"):
                out[f"optim/{names.get(id(p), '?')}/{k}"] = _digest(v)
    for k, v in pad.items():
        out[f"pad/{k}"] = _digest(v)
    return out


def _tamper(model) -> None:
    """Move the first element of the first parameter shard by one ulp (drill self-test)."""
    import torch
    with torch.no_grad():
        p = _local(next(model.parameters())).view(-1)
        if p.numel():
            p[0] = torch.nextafter(p[0], torch.tensor(float("inf"), dtype=p.dtype,
                                                      device=p.device))


def train(job: dict) -> None:
    import torch
    import torch.distributed as dist

    import fastckpt
    rank, world = dist.get_rank(), dist.get_world_size()
    _, device = _device(job.get("backend", "auto"))
    out, tag = job["out"], job["tag"]
    model = build(device)
    optim = torch.optim.AdamW(model.parameters(), lr=3e-3)
    torch.manual_seed(1000 + rank)  # dropout differs per rank: RNGState saves one per rank
    pad = {f"r{rank}": torch.zeros(max(1, int(job.get("pad_bytes", 0)) // 4), device=device)}
    state = {"model": model, "optim": optim, "pad": pad, "step": 0,
             "rng": fastckpt.RNGState()}
    from fastckpt.testing import faults
    storage = faults.open_faulty(job["root"], rank=rank, throttle_mibps=job.get("throttle_mibps"))
    if job.get("throttle_to_window_s"):
        # a disk on which this rank's state takes the whole window to write: the parameter
        # shards, AdamW's two moments of each, the padding (an underestimate: slower still)
        nbytes = sum(_local(p).numel() * p.element_size() for p in model.parameters()) * 3 \
            + sum(t.numel() * t.element_size() for t in pad.values())
        storage.arm(throttle_mibps=nbytes / (1 << 20) / float(job["throttle_to_window_s"]))
    ckpt = fastckpt.Checkpointer(storage, grace_s=job["grace_s"], commit_timeout_s=60)
    start = ckpt.resume(state)
    first = 0 if start is None else int(state["step"])
    with open(os.path.join(out, f"resumed-{tag}-r{rank}.json"), "w") as f:
        json.dump({"start": start, "first_step": first}, f)
    if job.get("tamper") == "param-ulp" and start is not None:
        _tamper(model)
    steps = open(os.path.join(out, f"steps-{tag}-r{rank}.jsonl"), "a", buffering=1)
    save_at = set(job.get("save_at") or ())
    model.train()
    for step in range(first, int(job["total"])):
        x, y = batch(step, rank, world, device)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        loss = loss.detach()
        dist.all_reduce(loss)
        pad[f"r{rank}"].fill_(step)
        state["step"] = step + 1
        steps.write(json.dumps({"step": step, "loss": loss.item() / world, "t": time.time()})
                    + "\n")
        if step + 1 in save_at:
            ckpt.save(state, step=step + 1).wait(60)  # committed before the next step
        time.sleep(float(job.get("step_s", 0.05)))
        ckpt.save(state, step=step + 1, on_preempt=True)  # exits 143/0/144 on a stop
    ckpt.close()
    steps.close()
    tmp = os.path.join(out, f".final-{tag}-r{rank}.json")
    with open(tmp, "w") as f:
        json.dump({"step": state["step"], "tensors": digests(model, optim, pad)}, f)
    os.replace(tmp, os.path.join(out, f"final-{tag}-r{rank}.json"))


def run(job_path: str, *, redirect: bool = False) -> int:
    """Run this rank (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment) of the
    job in ``job_path``; the exit code. ``redirect``: send stdout/stderr to the rank's log."""
    with open(job_path) as f:
        job = json.load(f)
    rank = int(os.environ["RANK"])
    if redirect:
        fd = os.open(os.path.join(job["out"], f"log-{job['tag']}-r{rank}.txt"),
                     os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    import logging
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    backend, _ = _device(job.get("backend", "auto"))
    from datetime import timedelta
    dist.init_process_group(backend, timeout=timedelta(seconds=60))
    try:
        train(job)
    finally:  # a stop exits through SystemExit after fastckpt destroyed the group
        if dist.is_initialized():
            dist.destroy_process_group()
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


def _write_json(path: str, obj: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with
    the pid, it names one process (a reused pid has another)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def task(job_path: str) -> int:
    """One rank as a Slurm task: ``srun ... fastckpt resume ROOT -q -- python -m
    fastckpt.drill.worker --task JOB.json`` (``fastckpt resume`` execs, so this process
    is the task srun started). It has to be: proctrack/cgroup sends scancel's SIGTERM only to
    the step's tasks (slurmstepd's children), SIGKILL to every process; a rank started by a
    wrapper between srun and it never sees the SIGTERM (measured on Slurm 22.05).

    Slurm reports no per-task exit code for a cancelled step, so the rank records its own,
    beside what it writes as any rank (logs redirected into ``log-<tag>-r<r>.txt``):

    * ``task-<tag>-r<r>.json`` at the start: pid, start time in ticks (the pid's identity),
      host, time, Slurm job/step/task ids, the rendezvous address;
    * ``exit-<tag>-r<r>.json`` at the exit: the code it exits with and how (``SystemExit``,
      ``return``, ``exception``, or ``os._exit``: fastckpt's unclean exit and its watchdog
      call it, and this process wraps it to write the record first). A rank killed by a
      signal (SIGKILL after KillWait) leaves none: the driver then sees the process gone
      without a record."""
    with open(job_path) as f:
        job = json.load(f)
    rank = int(os.environ["RANK"])
    out, tag = job["out"], job["tag"]
    pid = os.getpid()
    _write_json(os.path.join(out, f"task-{tag}-r{rank}.json"), {
        "rank": rank, "pid": pid, "start_ticks": start_ticks(pid),
        "host": socket.gethostname(), "t": time.time(),
        "job_id": os.environ.get("SLURM_JOB_ID"), "step_id": os.environ.get("SLURM_STEP_ID"),
        "procid": os.environ.get("SLURM_PROCID"), "world_size": os.environ.get("WORLD_SIZE"),
        "master": f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"})
    exit_path = os.path.join(out, f"exit-{tag}-r{rank}.json")

    def record(code: int, how: str) -> None:
        try:
            _write_json(exit_path, {"rank": rank, "pid": pid, "code": code, "how": how,
                                    "t": time.time()})
        except OSError:
            pass

    real_exit = os._exit

    def _exit(code: int) -> None:  # fastckpt's unclean exit and its watchdog
        record(int(code), "os._exit")
        real_exit(code)

    os._exit = _exit  # type: ignore[assignment]
    code, how = 1, "exception"
    try:
        code = run(job_path, redirect=True)
        how = "return"
        return code
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        how = "SystemExit"
        raise
    finally:
        record(code, how)


def _forked(job_path: str, env: dict) -> None:
    """Entry of a rank started by the driver's fork server (torch already imported)."""
    os.environ.update(env)
    code = run(job_path, redirect=True)
    sys.exit(code)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--task":
        sys.exit(task(sys.argv[2]))
    if len(sys.argv) != 2:
        print("usage: python -m fastckpt.drill.worker [--task] JOB.json (RANK, "
              "WORLD_SIZE, MASTER_ADDR, MASTER_PORT in the environment)", file=sys.stderr)
        sys.exit(2)
    sys.exit(run(sys.argv[1]))
