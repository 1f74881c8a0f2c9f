"""Run a function on N real processes with a gloo process group (CPU), collect results.

``run(fn, world_size, *args)`` spawns ``world_size`` fresh interpreters, initialises
``torch.distributed`` with gloo over a TCP store on 127.0.0.1, calls ``fn(rank, world_size,
*args)`` on each and returns the per-rank results (re-raising the first failure with its rank).
``fn`` must be importable (defined at module level of a test module).
"""

from __future__ import annotations

import io
import os
import socket
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, fn, args, q, env):
    os.environ.update(env or {})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        try:
            buf = io.BytesIO()  # tensors cross as bytes: no shared-memory handles to outlive us
            torch.save(fn(rank, world_size, *args), buf)
            q.put((rank, True, buf.getvalue()))
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        q.put((rank, False, f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))


_CTX = None


def _context():
    # a forkserver that imported torch once forks each rank in milliseconds; spawn would pay
    # the torch import (seconds on 2 cores) per rank per test
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "torch.distributed.fsdp",
                                     "torch.distributed.checkpoint", "fastckpt",
                                     "tests.distributed"])
    return _CTX


def run(fn, world_size: int, *args, timeout: float = 180.0, env: dict | None = None,
        allow_death: bool = False) -> list:
    """Per-rank results. With ``allow_death``, a rank that exits without reporting (killed)
    yields ``Died(exitcode)`` instead of failing the call."""
    import queue as queue_mod
    import time

    import torch
    ctx = _context()
    q = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, q, env))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, object] = {}
    errors: dict[int, str] = {}
    end = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world_size and time.monotonic() < end:
            try:
                rank, ok, value = q.get(timeout=0.5)
                (results if ok else errors)[rank] = value
                continue
            except queue_mod.Empty:
                pass
            dead = [r for r, p in enumerate(procs) if p.exitcode is not None
                    and r not in results and r not in errors]
            if dead and q.empty():
                time.sleep(0.5)  # let a last message from a rank that just exited arrive
                if not q.empty():
                    continue
                for r in dead:
                    if not allow_death:
                        errors[r] = f"exited with code {procs[r].exitcode} without a result"
                    else:
                        results[r] = Died(procs[r].exitcode)
        missing = [r for r in range(world_size) if r not in results and r not in errors]
        for r in missing:
            errors[r] = f"no result within {timeout}s"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        r = min(errors)
        raise AssertionError(f"rank {r} failed:\n{errors[r]}")
    return [results[r] if isinstance(results[r], Died)
            else torch.load(io.BytesIO(results[r]), weights_only=False)
            for r in range(world_size)]


class Died:
    def __init__(self, exitcode):
        self.exitcode = exitcode

    def __repr__(self):
        return f"Died({self.exitcode})"
