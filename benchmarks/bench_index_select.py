#!/usr/bin/env python3
"""Which chunk indexes a rank restarted at another world size reads, and what choosing costs.

A checkpoint saved by N ranks with per-rank indexes (``rank_indexes``) is restarted on M ranks
(fewer nodes, a lost node, more nodes). Each restarted rank plans its boxes from the manifest
and reads only the indexes of the saving ranks whose boxes meet its own
(``fastckpt.manifest.index.writers_of``: its mesh with one dim scaled to N ranks, every saving
rank's box cut as torch cuts it). This measures, for a middle restarted rank of the 70B state
of ``bench_protocol.py`` (Llama-3-70B's 723 parameters and AdamW's two moments: 2169 boxes),
the number of indexes it reads against the N of a full read, and the time of ``writers_of``
(medians of ``--reps``), under three layouts:

* ``fsdp``: FSDP2, ``Shard(0)`` over all ranks;
* ``hsdp``: ``(Replicate, Shard(0))`` on an R x N/R mesh, restarted as R' x N/R (both dims
  are tried: the union);
* ``fsdp_tp``: FSDP2 + TP as torchtitan lays it out on a ``(dp, tp)`` mesh, TP fixed: column-
  wise weights and the embedding ``(_StridedShard(0), Shard(0))``, row-wise ones
  ``(Shard(0), Shard(1))``, norms ``(Shard(0), Replicate)``;
* ``fsdp_pp``: pipeline stages (``--pp``, pp outermost) with FSDP2 on each stage's ``dp``
  sub-mesh, a middle stage's rank: its stage's tensors, its mesh the stage's block.

The restarted rank's boxes are torch's (``_compute_local_shape_and_global_offset`` on its
coordinate; no process group, no memory).

    python benchmarks/bench_index_select.py --saved 4096 --restarted 2048 --tp 8 --replicas 8
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


def _tp_places(fqn: str, shape: tuple, tp: int) -> tuple:
    if len(shape) == 1:
        return (("S", 0), ("R",))
    if "o_proj" in fqn or "down_proj" in fqn:
        return (("S", 0), ("S", 1))
    return (("T", 0, tp), ("S", 0))


def boxes(mesh: tuple, placer, tensors: list, block: tuple = ()) -> dict:
    """fqn -> (offsets, sizes, layout) of the middle rank of ``mesh`` (each coordinate half
    way), for the parameters and both moments; ``block``: (stage, stages) of a stage's mesh."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
    from torch.distributed.tensor.placement_types import _StridedShard

    def torch_placement(p):
        return (Shard(p[1]) if p[0] == "S" else Replicate() if p[0] == "R"
                else _StridedShard(p[1], split_factor=p[2]))
    coord = [k // 2 for k in mesh]
    out = {}
    for fqn, shape in tensors:
        places = placer(fqn, shape)
        sizes, offsets = _compute_local_shape_and_global_offset(
            shape, mesh, coord, [torch_placement(p) for p in places])
        for key in (fqn, f"optim.state.{fqn}.exp_avg", f"optim.state.{fqn}.exp_avg_sq"):
            out[key] = (tuple(offsets), tuple(sizes), (tuple(mesh), places, *block))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--saved", type=int, default=4096, help="N: the saving world size")
    p.add_argument("--restarted", type=int, default=2048, help="M: the restarted world size")
    p.add_argument("--tp", type=int, default=8)
    p.add_argument("--replicas", type=int, default=8, help="R of the saved hsdp layout")
    p.add_argument("--pp", type=int, default=8, help="stages of the fsdp_pp layout")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--json", default=os.path.join(REPO_ROOT, "bench-out", "index-select.json"))
    a = p.parse_args()
    from bench_protocol import model_tensors, stage_tensors

    from fastckpt.manifest.index import writers_of
    n, m = a.saved, a.restarted
    body = {"world_size": n, "tensors": {}}
    for fqn, shape in model_tensors():
        for key in (fqn, f"optim.state.{fqn}.exp_avg", f"optim.state.{fqn}.exp_avg_sq"):
            body["tensors"][key] = {"shape": list(shape)}
    shards = n // a.replicas
    every, stage = model_tensors(), a.pp // 2
    layouts = {"fsdp": ((m,), lambda f, s: (("S", 0),), every, ()),
               "hsdp": ((max(1, m // shards), shards), lambda f, s: (("R",), ("S", 0)), every,
                        ()),
               "fsdp_tp": ((m // a.tp, a.tp), lambda f, s: _tp_places(f, s, a.tp), every, ()),
               "fsdp_pp": ((m // a.pp,), lambda f, s: (("S", 0),),
                           stage_tensors(stage, a.pp), (stage, a.pp))}
    out = {}
    for name, (mesh, placer, tensors, block) in layouts.items():
        bx = boxes(mesh, placer, tensors, block)
        times, sel = [], None
        for _ in range(a.reps):
            t = time.perf_counter()
            sel = writers_of(body, bx)
            times.append(time.perf_counter() - t)
        row = {"restarted_mesh": list(mesh), "boxes": len(bx),
               "indexes_read": None if sel is None else len(sel), "of": n,
               "ranks": None if not sel else [min(sel), max(sel)],
               "writers_of_ms": round(statistics.median(times) * 1e3, 2)}
        out[name] = row
        print(f"{name:8s} {n} -> mesh {mesh}: {row['indexes_read']} of {n} indexes "
              f"({len(bx)} boxes), writers_of {row['writers_of_ms']:.2f} ms")
    return C.record(a.json, "index_select", REPO_ROOT, parameters=vars(a), layouts=out)


if __name__ == "__main__":
    sys.exit(main())
