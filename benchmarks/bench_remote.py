#!/usr/bin/env python3
"""The remote tier and compression, end to end through a model of a real object store.

The store: the moto S3 server (a child process on 127.0.0.1) behind ``tests/s3throttle.py``
(another child) capping each connection at ``--rate`` and adding ``--latency`` per request
(see benchmarks/bench_s3.py, whose server setup this reuses).

**Part 1, tiering** (``--parts tiered``): the same state saved every repetition by three
Checkpointers, each kept for the run as a training job keeps its own, interleaved (order
rotated each rep), medians of ``--reps``:

- ``direct``: ``Checkpointer("s3://...")``: the stall (``save`` returning), and the time until
  the manifest is committed on the store;
- ``tiered``: ``Checkpointer(local, remote="s3://...")``: the stall, the local commit, and the
  time until the remote manifest is committed (``wait_remote``);
- ``local``: ``Checkpointer(local)``: the stall and the local commit, for reference.

**Part 2, compression** (``--parts compression``): a realistic state (a small GPT trained
``--train-steps`` steps with AdamW on CPU, benchmarks/bench_compression.py's model: fp32
weights, a bf16 copy, AdamW's two moments; tiled to ``--size``: blocks are compressed
independently, so tiling does not change the ratio) saved with ``compression`` None, "auto"
and "zstd" to three targets: the throttled store, the local disk (``--local``) and tmpfs
(/dev/shm: a target faster than the encoders). One Checkpointer per (target, setting), an
untimed warm-up save first (what "auto" measures the target on), then blocking saves,
interleaved; each save's stored bytes and time, and a restart load of it in a fresh process
(which allocates its state first; only the load is timed).

    python benchmarks/bench_remote.py --out bench-out/remote.json     # ~10 min on 2 cores
    python benchmarks/bench_remote.py --quick                         # a smoke run

The JSON holds every sample, the machine, the date and the git commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, HERE)
from fastckpt.bench import common as C  # noqa: E402

MiB = 1 << 20


# ------------------------------------------------------------------------------- the states

def plain_state(nbytes: int, n: int = 8) -> dict:
    import torch
    g = torch.Generator().manual_seed(0)
    per = nbytes // n // 4
    return {f"t{i}": torch.randn(per, generator=g) for i in range(n)}


def trained_state(nbytes: int, steps: int) -> tuple[dict, dict]:
    """The trained GPT's families as tensors, tiled to about ``nbytes``."""
    import torch
    import bench_compression as BZ
    ns = argparse.Namespace(steps=steps, vocab=1024, width=256, layers=6, seq=64, batch=8,
                            lr=1e-3, seed=0, no_init=True, verbose=False)
    fams, info = BZ.train(ns)
    dtypes = {"w_fp32": torch.float32, "w_bf16": torch.bfloat16, "adam_m": torch.float32,
              "adam_v": torch.float32}
    total = sum(len(b) for b, _ in fams.values())
    reps = max(1, round(nbytes / total))
    state = {}
    for name, (raw, _) in fams.items():
        t = torch.frombuffer(bytearray(raw), dtype=dtypes[name])
        state[name] = t.repeat(reps)
    info["tiled"] = reps
    return state, info


def _shapes(state: dict) -> dict:
    return {k: [list(v.shape), str(v.dtype).replace("torch.", "")] for k, v in state.items()}


def _hash(state: dict) -> str:
    import xxhash
    h = xxhash.xxh3_128()
    for k in sorted(state):
        h.update(state[k].contiguous().view(-1).view(__import__("torch").uint8).numpy())
    return h.hexdigest()


# ------------------------------------------------------------------------ fresh-process loads

def _load_child(p: dict) -> dict:
    import torch

    import fastckpt
    state = {k: torch.empty(shape, dtype=getattr(torch, dt)) for k, (shape, dt)
             in p["shapes"].items()}
    for t in state.values():
        t.zero_()  # a restarted job's tensors exist before the load (its model, its buffers)
    t0 = time.perf_counter()
    kw = {"storage_options": p.get("options")} if p.get("options") else {}
    if p.get("remote"):
        kw["remote"] = p["remote"]
    step = fastckpt.load(state, p["root"], **kw)
    dt = time.perf_counter() - t0
    if _hash(state) != p["hash"]:
        raise RuntimeError("the loaded state differs from the saved one")
    return {"load_s": dt, "step": step}


def fresh_load(p: dict, timeout: float = 600) -> dict:
    res = C.run_child([sys.executable, os.path.abspath(__file__), "--child"], p, timeout,
                      env=_env())
    if not res.get("ok"):
        raise RuntimeError(f"load child failed: {res.get('error')}\n{res.get('output_tail')}")
    return res


def _env() -> dict:
    import bench_s3
    return bench_s3.aws_env()


# ------------------------------------------------------------------------------------ parts

def _opts(endpoint: str) -> dict:
    import bench_s3
    return {"key": bench_s3.KEY, "secret": bench_s3.SECRET, "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": endpoint, "region_name": bench_s3.REGION}}


def part_tiered(store: Any, args, work: str) -> list[dict]:
    import fastckpt
    import bench_s3
    state = plain_state(args.size)
    nbytes = sum(t.nbytes for t in state.values())
    opts = _opts(store.proxy.endpoint)
    cks = {"direct": fastckpt.Checkpointer(f"s3://{bench_s3.BUCKET}/direct",
                                           storage_options=opts, keep_last=1),
           "tiered": fastckpt.Checkpointer(os.path.join(work, "tiered"),
                                           remote=f"s3://{bench_s3.BUCKET}/tiered",
                                           storage_options=opts, keep_last=1),
           "local": fastckpt.Checkpointer(os.path.join(work, "local"), keep_last=1)}
    samples = []
    names = list(cks)
    try:
        for rep in range(-1, args.reps):  # rep -1: the untimed warm-up (pools, lease, probe)
            order = names[rep % len(names):] + names[:rep % len(names)]
            for name in order:
                ck = cks[name]
                step = rep + 2
                t0 = time.perf_counter()
                h = ck.save(state, step=step)
                stall = time.perf_counter() - t0
                h.wait()
                local = time.perf_counter() - t0
                h.wait_remote()
                remote = time.perf_counter() - t0 if name == "tiered" else None
                s = {"part": "tiered", "contender": name, "rep": rep, "bytes": nbytes,
                     "stall_s": stall, "committed_s": local, "remote_committed_s": remote,
                     "durable_off_node_s": remote if name == "tiered" else (
                         local if name == "direct" else None)}
                if rep >= 0:
                    samples.append(s)
                print(f"  tiered rep {rep} {name:<7} stall {stall:6.3f} s  committed "
                      f"{local:6.2f} s" + (f"  remote {remote:6.2f} s" if remote else ""),
                      flush=True)
    finally:
        for ck in cks.values():
            ck.close()
    return samples


def part_compression(store: Any, args, work: str) -> tuple[list[dict], dict]:
    import fastckpt
    import bench_s3
    state, info = trained_state(args.size, args.train_steps)
    digest = _hash(state)
    raw = sum(t.nbytes for t in state.values())
    opts = _opts(store.proxy.endpoint)
    shm = tempfile.mkdtemp(prefix="fastckpt-bench-", dir="/dev/shm")
    targets = {"s3": (lambda m: f"s3://{bench_s3.BUCKET}/z-{m}", opts),
               "local": (lambda m: os.path.join(work, f"z-{m}"), None),
               "tmpfs": (lambda m: os.path.join(shm, f"z-{m}"), None)}
    modes = ("none", "auto", "zstd")
    cks = {}
    samples = []
    try:
        for t, (root, o) in targets.items():
            for m in modes:
                kw = {"storage_options": o} if o else {}
                cks[(t, m)] = fastckpt.Checkpointer(root(m), keep_last=1,
                                                    compression=None if m == "none" else m,
                                                    **kw)
        keys = list(cks)
        for rep in range(-1, args.reps):
            order = keys[rep % len(keys):] + keys[:rep % len(keys)]
            for key in order:
                t, m = key
                ck = cks[key]
                step = rep + 2
                t0 = time.perf_counter()
                h = ck.save(state, step=step, block=True)
                dt = time.perf_counter() - t0
                s = {"part": "compression", "target": t, "mode": m, "rep": rep, "raw": raw,
                     "stored": h.bytes_written, "save_s": dt,
                     "compressed": bool(h.compression.get("compress")),
                     "why": h.compression.get("why"), "auto": h.compression}
                if rep >= 0:
                    root, o = targets[t]
                    s.update(fresh_load({"root": root(m), "options": o,
                                         "shapes": _shapes(state), "hash": digest}))
                    samples.append(s)
                print(f"  compression rep {rep} {t:<5} {m:<4} stored {h.bytes_written / raw:5.3f}"
                      f" of raw  save {dt:6.2f} s" + (f"  load {s['load_s']:6.2f} s"
                                                      if "load_s" in s else "")
                      + f"  ({s['why']})", flush=True)
    finally:
        for ck in cks.values():
            ck.close()
        shutil.rmtree(shm, ignore_errors=True)
    return samples, info


# ------------------------------------------------------------------------------- the report

def _med(xs: list) -> float | None:
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def report(samples: list[dict]) -> dict:
    out: dict = {}
    tiered = [s for s in samples if s["part"] == "tiered"]
    if tiered:
        rows = {}
        for name in ("direct", "tiered", "local"):
            ss = [s for s in tiered if s["contender"] == name]
            rows[name] = {k: _med([s[k] for s in ss]) for k in
                          ("stall_s", "committed_s", "remote_committed_s", "durable_off_node_s")}
        d, t = rows["direct"], rows["tiered"]
        rows["ratios"] = {
            "stall_tiered_over_direct": t["stall_s"] / d["stall_s"],
            "local_commit_tiered_over_direct_commit": t["committed_s"] / d["committed_s"],
            "remote_commit_tiered_over_direct": t["remote_committed_s"] / d["committed_s"]}
        out["tiered"] = rows
        print("\ntiering (medians):")
        for name in ("direct", "tiered", "local"):
            r = rows[name]
            print(f"  {name:<7} stall {r['stall_s']:.3f} s  committed {r['committed_s']:.2f} s"
                  + (f"  remote committed {r['remote_committed_s']:.2f} s"
                     if r["remote_committed_s"] else ""))
        print("  " + ", ".join(f"{k} {v:.2f}x" for k, v in rows["ratios"].items()))
    comp = [s for s in samples if s["part"] == "compression"]
    if comp:
        rows = {}
        for t in ("s3", "local", "tmpfs"):
            for m in ("none", "auto", "zstd"):
                ss = [s for s in comp if s["target"] == t and s["mode"] == m]
                if ss:
                    rows[f"{t}/{m}"] = {"stored_over_raw": _med([s["stored"] / s["raw"]
                                                                 for s in ss]),
                                        "save_s": _med([s["save_s"] for s in ss]),
                                        "load_s": _med([s["load_s"] for s in ss]),
                                        "compressed": sum(s["compressed"] for s in ss),
                                        "n": len(ss), "why": ss[-1]["why"]}
        out["compression"] = rows
        print("\ncompression (medians; save and load x: none / this):")
        for t in ("s3", "local", "tmpfs"):
            base = rows.get(f"{t}/none")
            for m in ("none", "auto", "zstd"):
                r = rows.get(f"{t}/{m}")
                if r and base:
                    print(f"  {t:<5} {m:<4} stored {r['stored_over_raw']:.3f} of raw  save "
                          f"{r['save_s']:6.2f} s ({base['save_s'] / r['save_s']:.2f}x)  load "
                          f"{r['load_s']:6.2f} s ({base['load_s'] / r['load_s']:.2f}x)  "
                          f"compressed {r['compressed']}/{r['n']}  {r['why']}")
    return out


def main(argv: list[str]) -> int:
    if argv[:1] == ["--child"]:
        return C.child_main(argv[1], argv[2], _load_child)
    import bench_s3
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", default="256MiB")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rate", default="16MiB", help="per-connection cap (default 16MiB/s)")
    ap.add_argument("--latency", type=float, default=0.01)
    ap.add_argument("--parts", default="tiered,compression")
    ap.add_argument("--train-steps", type=int, default=300)
    ap.add_argument("--local", default=os.path.join(REPO_ROOT, "bench-out", "remote-work"),
                    help="the local disk's directory")
    ap.add_argument("--quick", action="store_true", help="32 MiB, 1 rep, 50 training steps")
    ap.add_argument("--out", default=os.path.join(REPO_ROOT, "bench-out", "remote.json"))
    args = ap.parse_args(argv)
    if args.quick:
        args.size, args.reps, args.train_steps = "32MiB", 1, 50
    args.size = C.parse_size(args.size)
    args.rate_bps = float(C.parse_size(args.rate))
    args.stock_moto = False
    os.makedirs(args.local, exist_ok=True)
    work = tempfile.mkdtemp(prefix="run-", dir=args.local)
    store = bench_s3.Store(args)
    samples: list[dict] = []
    info = None
    t0 = time.time()
    try:
        parts = args.parts.split(",")
        if "tiered" in parts:
            samples += part_tiered(store, args, work)
        if "compression" in parts:
            got, info = part_compression(store, args, work)
            samples += got
    finally:
        store.stop()
        shutil.rmtree(work, ignore_errors=True)
    summary = report(samples)
    doc = {"date": C.utc_now(), "machine": C.machine_info(args.local),
           "commit": C.git_commit(REPO_ROOT), "versions": C.base_versions(),
           "settings": {"size": args.size, "reps": args.reps, "rate_bps": args.rate_bps,
                        "latency_s": args.latency, "parts": args.parts,
                        "train_steps": args.train_steps},
           "model": info, "seconds": time.time() - t0, "summary": summary,
           "samples": samples}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1, default=str)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
