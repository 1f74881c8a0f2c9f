#!/usr/bin/env python3
"""The planning step's own cost on one rank: ``local_chunks`` over a 70B model + AdamW state.

Every save (periodic or emergency, reused plan or not) starts on the training thread with
``fastckpt.engine.chunks.local_chunks``: each tensor's box of the global tensor, its bytes, the
fingerprints of the regular tensors and, above one rank, the marking of the DTensor boxes the
rank writes without rank 0 (``ChunkSpec.solo``). That time is part of the async stall.

The state is the 70B geometry of ``bench_protocol.py`` (Llama-3-70B: 723 parameters) with
AdamW: 2169 DTensors (parameter, exp_avg, exp_avg_sq) and 723 scalar ``step`` tensors, as
``get_optimizer_state_dict`` gives them under FSDP2. The DTensors are FSDP2's ``Shard(0)``
over all N ranks (``fsdp``) or HSDP's ``(Replicate, Shard(0))`` on an R x N/R mesh (``hsdp``,
where each replicated box is elected too). Simulated: one process plays rank ``--rank`` of
N through torch's fake process group (``torch.testing._internal.distributed.fake_pg``, no
communication), and the local tensors are on the ``meta`` device (no memory: the boxes, the
marking and the bookkeeping are the real code; the scalars are real CPU tensors, fingerprinted
as in a save). Reported: medians of ``--reps`` calls, in ms and in us per tensor, with
``world=1`` (no marking) beside the real world, and torch's ``__create_chunk_list__`` over the
same DTensors (the box computation per tensor that ``local_chunks`` does once per mesh,
placements and global shape).

    python benchmarks/bench_plan_step.py --world 64 --reps 9
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, HERE)
from fastckpt.bench import common as C  # noqa: E402


def state(mesh, placements, world: int) -> dict:
    import torch
    from torch.distributed.tensor import DTensor

    from bench_protocol import model_tensors
    out = {}
    shard = mesh.size(len(placements) - 1)
    where = mesh.get_coordinate()[-1]
    for fqn, shape in model_tensors():
        rows = -(-shape[0] // shard)  # torch's split: ceil, the last ones short or empty
        mine = max(0, min(rows, shape[0] - where * rows))
        local_shape = (mine, *shape[1:])
        stride = tuple(int(torch.tensor(shape[k + 1:]).prod()) for k in range(len(shape)))
        for kind in ("param", "exp_avg", "exp_avg_sq"):
            key = fqn if kind == "param" else f"optim.state.{fqn}.{kind}"
            out[key] = DTensor.from_local(torch.empty(local_shape, device="meta"), mesh,
                                          placements, run_check=False, shape=shape,
                                          stride=stride)
        out[f"optim.state.{fqn}.step"] = torch.tensor(1.0)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world", type=int, default=64)
    p.add_argument("--rank", type=int, default=5)
    p.add_argument("--replicas", type=int, default=8, help="R of the hsdp layout")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", default=os.path.join(REPO_ROOT, "bench-out", "plan-step.json"))
    a = p.parse_args()
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from fastckpt.engine.plan import local_chunks
    torch.set_num_threads(1)
    dist.init_process_group("fake", store=FakeStore(), rank=a.rank, world_size=a.world)
    layouts = {"fsdp": (init_device_mesh("cpu", (a.world,)), [Shard(0)]),
               "hsdp": (init_device_mesh("cpu", (a.replicas, a.world // a.replicas)),
                        [Replicate(), Shard(0)])}
    out = {}
    for name, (mesh, placements) in layouts.items():
        st = state(mesh, placements, a.world)
        dts = [t for t in st.values() if hasattr(t, "device_mesh")]
        calls = {"local_chunks, world 1 (no marking)": lambda: local_chunks(st, digests=True),
                 f"local_chunks, world {a.world}": lambda: local_chunks(
                     st, digests=True, world=a.world),
                 "torch __create_chunk_list__ per DTensor": lambda: [
                     t.__create_chunk_list__() for t in dts]}
        times: dict = {k: [] for k in calls}
        for _ in range(a.reps):  # interleaved
            for k, f in calls.items():
                t = time.perf_counter()
                f()
                times[k].append(time.perf_counter() - t)
        specs, _ = local_chunks(st, digests=True, world=a.world)
        row = {"tensors": len(st), "dtensors": len(dts),
               "solo": sum(1 for s in specs if s.solo), "writes": sum(
                   1 for s in specs if s.solo and s.writes and s.nbytes),
               "distinct_boxes": len({(tuple(t.placements), tuple(t.shape)) for t in dts}),
               "ms": {k: round(statistics.median(v) * 1e3, 2) for k, v in times.items()}}
        row["us_per_tensor"] = {k: round(v * 1e3 / len(st), 2) for k, v in row["ms"].items()}
        out[name] = row
        print(f"{name} ({row['tensors']} tensors, {row['dtensors']} DTensors, "
              f"{row['distinct_boxes']} distinct (placements, shape); {row['solo']} solo, "
              f"{row['writes']} written by rank {a.rank})")
        for k, v in row["ms"].items():
            print(f"  {k:42s} {v:8.2f} ms  {row['us_per_tensor'][k]:6.2f} us/tensor")
    return C.record(a.json, "plan_step", REPO_ROOT, parameters=vars(a), layouts=out)


if __name__ == "__main__":
    sys.exit(main())
