"""torchrun entry point for the multi-node tests (``tests/test_multinode.py``):

    python -m torch.distributed.run --nnodes 2 --nproc-per-node 2 ... \\
        tests/multinode_worker.py CFG.json

Each worker is one rank of the job (RANK, WORLD_SIZE, GROUP_RANK from torchrun). It first
writes ``<out>/pid-<tag>-r<rank>.json`` (its pid, torchrun's group rank, and ``MN_NODE``, the
"node" the test started its agent as) so that the test can signal or kill one node's workers,
then initialises gloo from torchrun's environment and runs ``tests.preempt_worker.train``: the
same data-parallel Adam loop (``save(..., on_preempt=True)`` every step, periodic saves,
padding, throttled writes) as the forkserver preemption tests, with the same outputs under
``<out>`` (losses, final state, ``resumed-<tag>-r<rank>``). Its stdout and stderr go to
``<out>/log-<tag>-r<rank>.txt``.
"""

from __future__ import annotations

import json
import logging
import os
import sys


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    out, tag = cfg["out"], cfg["tag"]
    os.makedirs(out, exist_ok=True)
    fd = os.open(os.path.join(out, f"log-{tag}-r{rank}.txt"),
                 os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    info = {"pid": os.getpid(), "rank": rank, "group_rank": int(os.environ["GROUP_RANK"]),
            "local_rank": int(os.environ["LOCAL_RANK"]), "node": os.environ.get("MN_NODE")}
    path = os.path.join(out, f"pid-{tag}-r{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(info, f)
    os.replace(path + ".tmp", path)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")

    import torch
    import torch.distributed as dist

    from tests.preempt_worker import train
    torch.set_num_threads(1)
    log = logging.getLogger("multinode_worker")
    log.info("rank %d: imports done", rank)
    dist.init_process_group("gloo")
    log.info("rank %d: process group ready", rank)
    try:
        train(rank, world, cfg)
    finally:
        log.info("rank %d: training ended", rank)
        if dist.is_initialized():
            dist.destroy_process_group()
        log.info("rank %d: process group destroyed", rank)
        sys.stdout.flush()
        sys.stderr.flush()


if __name__ == "__main__":
    main()
