#!/usr/bin/env python3
"""Preemption benchmark: on_preempt call cost, signal-to-consensus latency, signal-to-commit.

    python benchmarks/bench_preempt.py                          # 2 ranks, 768 MiB per rank
    python benchmarks/bench_preempt.py --mib 64 --reps 2        # quick check
    python benchmarks/bench_preempt.py --world 4 --mib 0        # latency only, 4 ranks

Three measurements, each repeated (``--reps``), medians reported, with machine, commit,
versions and date recorded in the JSON (``--json``, default ``bench-out/preempt.json``):

1. **call cost**: ``ckpt.save(state, step=s, on_preempt=True)`` with no stop requested, in one
   process (no collective runs on this path whatever the world size): ns per call.
2. **signal-to-consensus**: ``--world`` real ranks (gloo, CPU) run a loop of ``--step-ms``
   steps; SIGTERM goes to the last rank only; latency = the slowest rank's ``consensus`` event
   minus the signal time (from the ranks' event logs).
3. **signal-to-commit**: the same job with ``--mib`` MiB of fp32 state per rank. The ranks make
   one ordinary save first (warm-up: allocates the staging buffer, measures the bandwidth the
   budget uses); then the signal; time to the last rank's ``commit`` event, against the target
   ``1.25 x bytes per rank / measured write bandwidth + 1 s``.

Every job is a fresh set of processes. The disk bandwidth is the one fastckpt measured on the
warm-up save of the same job (both ranks writing at once, as in the emergency save).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # the working tree's fastckpt (the children get it first too)
from fastckpt.bench import common as C  # noqa: E402


# ------------------------------------------------------------------------------------ child

def child(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    import fastckpt
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    n = max(args.mib * C.MiB // 4, 1024)  # (an empty tensor trips a staging bug)
    state = {"w": {f"r{rank}": torch.full((n,), float(rank))}, "step": 0}
    ck = fastckpt.Checkpointer(args.root, grace_s=args.grace, event_log=args.events)
    if args.mib:
        ck.save(state, step=0).wait()  # warm-up: staging buffer, bandwidth sample
    dist.barrier()
    print("ready", flush=True)
    step = 1
    while True:
        time.sleep(args.step_ms / 1000)
        state["step"] = step
        ck.save(state, step=step, on_preempt=True)
        step += 1


def _job(a: argparse.Namespace, mib: int, tag: str) -> dict:
    root = os.path.join(a.dir, tag)
    shutil.rmtree(root, ignore_errors=True)
    events = os.path.join(root, "events")
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = C.child_env(REPO_ROOT)
    procs = []
    for r in range(a.world):
        e = dict(env, MASTER_ADDR="127.0.0.1", MASTER_PORT=port, RANK=str(r),
                 WORLD_SIZE=str(a.world), LOCAL_RANK=str(r))
        procs.append(subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "--child", "--root", root,
             "--events", events, "--mib", str(mib), "--grace", str(a.grace),
             "--step-ms", str(a.step_ms)], env=e, stdout=subprocess.PIPE, text=True))
    for p in procs:
        line = p.stdout.readline()
        if not line.startswith("ready"):
            raise RuntimeError(f"rank did not start: {line!r}")
    time.sleep(0.5)
    t_sig = time.time()
    procs[-1].send_signal(signal.SIGTERM)
    codes = [p.wait(timeout=a.grace + 30) for p in procs]
    evs = []
    for r in range(a.world):
        with open(os.path.join(events, f"rank{r:05d}.jsonl")) as f:
            evs.append([json.loads(x) for x in f if x.strip()])

    def last(r, name):
        xs = [e for e in evs[r] if e["event"] == name]
        return xs[-1] if xs else None

    cons = [last(r, "consensus") for r in range(a.world)]
    commits = [last(r, "commit") for r in range(a.world)]
    out = {"tag": tag, "mib_per_rank": mib, "exit_codes": codes,
           "consensus_s": max(c["t"] - t_sig for c in cons) if all(cons) else None,
           "commit_s": (max(c["t"] - t_sig for c in commits) if all(commits) else None),
           "decision": (last(0, "decision") or {}).get("decision")}
    if mib:
        saves = [last(r, "save_end") for r in range(a.world)]
        out["emergency_save_s"] = max(s["seconds"] for s in saves) if all(saves) else None
        if all(saves):  # the emergency save's own write bandwidth (slowest rank)
            w = max(s["timings"]["write_s"] for s in saves)
            out["emergency_write_mibps"] = round(mib / w, 1) if w > 0 else None
            if w > 0:
                out["target_from_emergency_bw_s"] = 1.25 * w + 1.0
        # the warm-up save's bandwidth as fastckpt measured it (the budget's input)
        d = last(0, "decision") or {}
        out["bytes_per_rank"] = mib * C.MiB
        bw = _measured_bw(root, a.world)
        out["write_mibps"] = bw
        if bw:
            out["target_s"] = 1.25 * mib / bw + 1.0
        out["est_save_s"] = d.get("est_save_s")
    shutil.rmtree(root, ignore_errors=True)
    return out


def _measured_bw(root: str, world: int) -> float | None:
    """Write bandwidth per rank (MiB/s) measured on the warm-up save (rank 0's estimate)."""
    path = os.path.join(root, "events", "rank00000.jsonl")
    with open(path) as f:
        for line in f:
            e = json.loads(line)
            if e["event"] == "estimate":
                return e.get("write_mibps")
    return None


def call_cost(a: argparse.Namespace) -> list[float]:
    import tempfile

    import torch

    import fastckpt
    out = []
    with tempfile.TemporaryDirectory(dir=a.dir) as d:
        ck = fastckpt.Checkpointer(d, grace_s=30)
        st = {"w": torch.zeros(10)}
        for _ in range(a.reps + 1):  # first repetition is a warm-up
            n = 200_000
            t0 = time.perf_counter()
            for i in range(n):
                ck.save(st, step=i, on_preempt=True)
            out.append((time.perf_counter() - t0) / n * 1e9)
        ck.close()
    return out[1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--mib", type=int, default=768, help="state MiB per rank (0: skip part 3)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--grace", type=float, default=60.0)
    ap.add_argument("--step-ms", type=float, default=50.0)
    ap.add_argument("--dir", default="/tmp/fastckpt-bench-preempt")
    ap.add_argument("--json", default=os.path.join(REPO_ROOT, "bench-out", "preempt.json"))
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--root", help=argparse.SUPPRESS)
    ap.add_argument("--events", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        child(a)
        return 0
    os.makedirs(a.dir, exist_ok=True)
    result = {"date": C.utc_now(), "machine": C.machine_info(a.dir),
              "git": C.git_commit(REPO_ROOT),
              "versions": C.base_versions(), "args": vars(a)}
    cost = call_cost(a)
    result["call_cost_ns"] = cost
    print(f"on_preempt call, no stop: median {C.median(cost):.0f} ns/call over {len(cost)} reps")
    lat = [_job(a, 0, f"latency{i}") for i in range(a.reps)]
    result["latency_jobs"] = lat
    print(f"signal-to-consensus, {a.world} ranks, {a.step_ms:.0f} ms steps: median "
          f"{C.median(j['consensus_s'] for j in lat):.3f} s "
          f"(all: {[round(j['consensus_s'], 3) for j in lat]}), exit codes "
          f"{[j['exit_codes'] for j in lat]}")
    if a.mib:
        com = [_job(a, a.mib, f"commit{i}") for i in range(a.reps)]
        result["commit_jobs"] = com
        for j in com:
            print(f"signal-to-commit, {a.world} x {a.mib} MiB: {j['commit_s']:.2f} s "
                  f"(emergency save {j['emergency_save_s']:.2f} s; measured write "
                  f"{j['write_mibps']} MiB/s per rank on the warm-up save, "
                  f"{j.get('emergency_write_mibps')} MiB/s on the emergency save; target "
                  f"1.25 x bytes/bw + 1 s = {j.get('target_s', float('nan')):.2f} s with the "
                  f"warm-up bw, {j.get('target_from_emergency_bw_s', float('nan')):.2f} s with "
                  f"the emergency save's; decision {j['decision']}; "
                  f"exit codes {j['exit_codes']})")
        ok = [j["commit_s"] is not None and j.get("target_s") and j["commit_s"] <= j["target_s"]
              for j in com]
        print(f"within target: {sum(ok)}/{len(ok)}; median signal-to-commit "
              f"{C.median(j['commit_s'] for j in com):.2f} s")
    C.write_json(a.json, result)
    print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
