"""Helpers shared by the client cases (child side)."""

from __future__ import annotations

import os
import time
from typing import Any


def fsync_tree(path: str) -> None:
    """fsync every file under ``path`` and every directory (what a tool that does not fsync
    leaves to be done before its checkpoint is durable)."""
    for root, dirs, files in os.walk(path):
        for fn in files:
            fd = os.open(os.path.join(root, fn), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def fingerprint(tree: Any) -> list:
    """A float64 sum per tensor (DTensors whole) and the plain values, in key order."""
    import torch
    out: list = []

    def walk(x: Any, key: str) -> None:
        if isinstance(x, torch.Tensor):
            t = x.full_tensor() if hasattr(x, "full_tensor") else x
            out.append([key, float(t.detach().double().sum()) if t.numel() else 0.0])
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k], f"{key}.{k}")
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{key}.{i}")
        elif isinstance(x, (int, float, str, bool)) or x is None:
            out.append([key, x])
    walk(tree, "")
    return out


def nbytes(tree: Any) -> int:
    import torch
    total = 0

    def walk(x: Any) -> None:
        nonlocal total
        if isinstance(x, torch.Tensor):
            t = x.to_local() if hasattr(x, "to_local") else x
            total += t.numel() * t.element_size()
        elif isinstance(x, dict):
            for v in x.values():
                walk(v)
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
    walk(tree)
    return total


class Clock:
    """``with Clock() as c: ...``; ``c.s`` the seconds."""

    def __enter__(self) -> "Clock":
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.s = time.perf_counter() - self.t0


def init_single_rank_group() -> None:
    """A gloo process group of one (what torchrun --nproc_per_node 1 gives)."""
    import socket

    import torch.distributed as dist
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1",
                      LOCAL_RANK="0")
    dist.init_process_group("gloo", rank=0, world_size=1)


def warm_imports() -> None:
    """Import what a save or load will import lazily, before anything is timed (a job pays
    its imports once, at start-up, not in each checkpoint)."""
    import torch.distributed.checkpoint  # noqa: F401
    import torch.distributed.checkpoint.state_dict  # noqa: F401

    import fastckpt.checkpointer  # noqa: F401
    import fastckpt.dcp  # noqa: F401
    import fastckpt.engine.load  # noqa: F401
    import fastckpt.engine.reader  # noqa: F401
