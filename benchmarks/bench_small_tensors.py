#!/usr/bin/env python3
"""Many small tensors: per-tensor overhead of a save and a load, fastckpt against DCP.

The state: ``--count`` fp32 tensors of 1-64 KiB each (sizes uniform, seeded) plus ``--big`` 64
MiB tensors, one process (a rank's shard of a model with many small parameters, norms and
biases, or an optimizer's per-parameter state). Each operation runs in a fresh process that
builds the state first (not timed); contenders rotated each repetition; page cache dropped
before every load (cold, as a restart); medians. Loads go into freshly allocated tensors and
every load is checked bit-exact against the saved values.

- ``fastckpt``: ``fastckpt.save(state, root, step=1)`` / ``fastckpt.load(state, root)``
- ``dcp4``: ``dcp.save(state, storage_writer=FileSystemWriter(path, thread_count=4))`` (its
  best thread count here) / ``dcp.load(state, storage_reader=FileSystemReader(path))``

The report gives each median and the time per tensor (total / count: for 1-64 KiB tensors
that is mostly per-tensor overhead, the 4 large tensors being ~256 MiB of ~3.4 GiB) and the
paired ratio DCP / fastckpt per repetition.

    python benchmarks/bench_small_tensors.py --count 100000 --reps 3 --dir /work/bench_tmp/small
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, REPO_ROOT)
from fastckpt.bench import common as C  # noqa: E402

CONTENDERS = ("fastckpt", "dcp4")


def build(count: int, big: int, seed: int) -> dict:
    import torch
    g = torch.Generator().manual_seed(seed)
    sizes = torch.randint(256, 16385, (count,), generator=g).tolist()  # fp32: 1-64 KiB
    state = {f"small.{i}": torch.randn(n, generator=g) for i, n in enumerate(sizes)}
    for i in range(big):
        state[f"big.{i}"] = torch.randn(16 << 20, generator=g)
    return state


def child_main(pin: str, pout: str) -> int:
    import warnings
    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed.checkpoint as dcp

    import fastckpt
    import fastckpt.checkpointer  # noqa: F401 - imports are set-up, not the operation
    import fastckpt.engine.load  # noqa: F401
    torch.set_num_threads(1)
    p = json.load(open(pin))
    state = build(p["count"], p["big"], p["seed"])
    path, c = p["path"], p["contender"]
    res: dict[str, Any] = {"ok": True, "tensors": len(state),
                           "bytes": sum(t.nbytes for t in state.values())}
    if p["op"] == "save":
        t0 = time.perf_counter()
        if c == "fastckpt":
            fastckpt.save(state, path, step=1)
        else:
            dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=4))
        res["seconds"] = time.perf_counter() - t0
    else:
        dst = {k: torch.empty_like(v) for k, v in state.items()}
        C.drop_caches(required=p["drop_caches"])
        t0 = time.perf_counter()
        if c == "fastckpt":
            fastckpt.load(dst, path)
        else:
            dcp.load(dst, storage_reader=dcp.FileSystemReader(path))
        res["seconds"] = time.perf_counter() - t0
        bad = [k for k in state if not torch.equal(state[k], dst[k])]
        if bad:
            res.update(ok=False, error=f"{len(bad)} tensors differ after the load, e.g. {bad[0]}")
    with open(pout, "w") as f:
        json.dump(res, f)
    return 0


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child_main(sys.argv[2], sys.argv[3])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--count", type=int, default=100_000)
    ap.add_argument("--big", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dir", default="/tmp/fastckpt-bench-small")
    ap.add_argument("--json", default=os.path.join(REPO_ROOT, "bench-out", "small-tensors.json"))
    ap.add_argument("--timeout", type=float, default=1800)
    ap.add_argument("--no-drop-caches", dest="drop_caches", action="store_false")
    a = ap.parse_args()
    t_start = time.time()
    samples = []
    for rep, order in enumerate(C.rotations(list(CONTENDERS), a.reps)):
        print(f"--- rep {rep + 1}/{a.reps}: {' -> '.join(order)}", flush=True)
        for c in order:
            path = os.path.join(a.dir, c)
            shutil.rmtree(path, ignore_errors=True)
            os.makedirs(a.dir, exist_ok=True)
            for op in ("save", "load"):
                payload = {"contender": c, "op": op, "path": path, "count": a.count,
                           "big": a.big, "seed": a.seed, "drop_caches": a.drop_caches}
                s = C.run_child([sys.executable, os.path.abspath(__file__), "--child"],
                                payload, timeout=a.timeout, env=C.child_env(REPO_ROOT))
                s.update(contender=c, op=op, rep=rep)
                samples.append(s)
                if s.get("ok"):
                    print(f"  {c:9s} {op:4s} {s['seconds']:8.3f} s  "
                          f"{s['seconds'] / s['tensors'] * 1e6:7.1f} us/tensor", flush=True)
                else:
                    print(f"  {c:9s} {op:4s} FAILED: {s.get('error')}", flush=True)
            shutil.rmtree(path, ignore_errors=True)
    med: dict = {}
    for c in CONTENDERS:
        for op in ("save", "load"):
            v = [s["seconds"] for s in samples if s.get("ok") and s["contender"] == c
                 and s["op"] == op]
            med[f"{c}/{op}"] = C.median(v) if v else None
    ratios = {}
    for op in ("save", "load"):
        per = [a_["seconds"] / b["seconds"] for a_ in samples for b in samples
               if a_.get("ok") and b.get("ok") and a_["rep"] == b["rep"] and a_["op"] == op
               == b["op"] and a_["contender"] == "dcp4" and b["contender"] == "fastckpt"]
        ratios[op] = {"per_rep": per, "median": C.median(per) if per else None}
    n = next(s["tensors"] for s in samples if s.get("ok"))
    nbytes = next(s["bytes"] for s in samples if s.get("ok"))
    print(f"\n{n} tensors, {nbytes / C.MiB:.0f} MiB; medians over {a.reps} reps")
    for k, v in med.items():
        if v is not None:
            print(f"  {k:14s} {v:8.3f} s  {v / n * 1e6:7.1f} us/tensor")
    for op, r in ratios.items():
        if r["median"] is not None:
            print(f"  DCP-4 / fastckpt {op}: {r['median']:.2f} "
                  f"(per rep {', '.join(f'{x:.2f}' for x in r['per_rep'])})")
    doc = {"benchmark": "small_tensors", "date_utc": C.utc_now(), "git": C.git_commit(REPO_ROOT),
           "machine": C.machine_info(a.dir), "versions": C.base_versions(),
           "parameters": vars(a), "elapsed_s": time.time() - t_start, "medians_s": med,
           "ratios": ratios, "tensors": n, "bytes": nbytes, "samples": samples}
    print("JSON:", C.write_json(a.json, doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
