#!/usr/bin/env python3
"""Each framework's own checkpointing against the same framework through fastckpt.

For every client (plain DCP, torchtitan, Lightning, Hugging Face) the same state is saved and
loaded by the client's default checkpointing and by its fastckpt integration, each operation in
a fresh process that builds its own state (as a restarted job does), INTERLEAVED (contenders
rotated each repetition), REPEATED (--reps), MEDIANS reported:

- **stall**: how long the training thread is blocked by the save call;
- **durable**: from the call until the checkpoint is on disk: fastckpt until its manifest is
  committed; the client's default until its call (and its async future) returned *plus* an
  fsync of every file it wrote when it does not fsync itself (torch.save, safetensors do not;
  DCP's FileSystemWriter does, and is not fsynced again);
- **load cold**: page cache dropped before the load; **load warm**: the checkpoint's files
  read into the page cache first (as right after a save, or a second load).

Every load is checked: the loaded state's fingerprint must equal the saved one. Imports
(fastckpt's engine, DCP) are done before anything is timed: a job pays them once, at start.

    python benchmarks/bench_clients.py --reps 3 --dir /work/bench_tmp
    python benchmarks/bench_clients.py --clients dcp --size 200MiB --reps 2

The clients' cases live in benchmarks/clients/ (one module per client).
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
REPO_ROOT = os.path.dirname(HERE)
sys.path.insert(0, REPO_ROOT)
sys.path.insert(0, HERE)
from fastckpt.bench import common as C  # noqa: E402

CLIENTS = ("dcp", "torchtitan", "lightning", "hf")
OPS = ("save", "load_cold", "load_warm")


# =========================================================================== child side


def child_main(pin: str, pout: str) -> int:
    return C.child_main(pin, pout, lambda payload: importlib.import_module(
        f"clients.{payload['client']}").run(payload))


# =========================================================================== parent side


def warm(path: str) -> None:
    """Read every file under ``path`` into the page cache."""
    for root, _, files in os.walk(path):
        for fn in files:
            with open(os.path.join(root, fn), "rb") as f:
                while f.read(16 << 20):
                    pass


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for fn in files:
            try:
                total += os.path.getsize(os.path.join(root, fn))
            except OSError:
                pass
    return total


def run_case(client: str, contender: str, rep: int, args, samples: list) -> None:
    path = os.path.join(args.dir, f"{client}-{contender}-r{rep}")
    shutil.rmtree(path, ignore_errors=True)
    try:
        ops = OPS if contender in args.loaders[client] else ("save",)
        for op in ops:
            if op != "save" and not samples[-1].get("ok"):
                s = {"ok": False, "error": "skipped: save failed"}
            else:
                if op == "load_warm":
                    warm(path)
                elif args.drop_caches:
                    C.drop_caches(required=True)
                payload = {"client": client, "contender": contender, "op": op, "path": path,
                           "size_bytes": args.size_bytes, "seed": args.seed}
                argv = [sys.executable, os.path.abspath(__file__), "--child"]
                s = C.run_child(argv, payload, timeout=args.timeout,
                                env=C.child_env(REPO_ROOT))
            s.update(client=client, contender=contender, op=op, rep=rep)
            if op == "save" and s.get("ok"):
                s["disk_bytes"] = dir_bytes(path)
            samples.append(s)
            if s.get("ok"):
                txt = "  ".join(f"{k} {s[k]:.3f} s" for k in ("stall_s", "durable_s", "load_s")
                                if k in s)
            else:
                txt = f"FAILED: {s.get('error')}"
            print(f"  {client:10s} {contender:18s} {op:9s} {txt}", flush=True)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def summarize(samples: list, client: str) -> list[dict[str, Any]]:
    rows = []
    contenders = []
    for s in samples:
        if s["client"] == client and s["contender"] not in contenders:
            contenders.append(s["contender"])
    for c in contenders:
        ss = [s for s in samples if s["client"] == client and s["contender"] == c]
        row: dict[str, Any] = {"client": client, "contender": c}
        for op, key, name in (("save", "stall_s", "stall"), ("save", "durable_s", "durable"),
                              ("load_cold", "load_s", "load_cold"),
                              ("load_warm", "load_s", "load_warm")):
            vals = [s[key] for s in ss if s["op"] == op and s.get("ok") and key in s]
            row[name] = C.median(vals)
            row[f"{name}_n"] = len(vals)
        sizes = [s.get("state_bytes") for s in ss if s["op"] == "save" and s.get("ok")]
        row["state_bytes"] = sizes[0] if sizes else None
        disk = [s.get("disk_bytes") for s in ss if s["op"] == "save" and s.get("ok")]
        row["disk_bytes"] = disk[0] if disk else None
        row["failed"] = [f"{s['op']} r{s['rep']}: {s.get('error')}" for s in ss if not s.get("ok")]
        rows.append(row)
    return rows


def ratios(samples: list, client: str, base: str, ours: str) -> dict[str, float | None]:
    """Median over repetitions of (base seconds / ours seconds) for each measure, paired by
    repetition: above 1 means fastckpt is faster."""
    out = {}
    for op, key, name in (("save", "stall_s", "stall"), ("save", "durable_s", "durable"),
                          ("load_cold", "load_s", "load_cold"),
                          ("load_warm", "load_s", "load_warm")):
        r = []
        for s in samples:
            if (s["client"], s["contender"], s["op"]) != (client, base, op) or not s.get("ok"):
                continue
            o = [t for t in samples if (t["client"], t["contender"], t["op"], t["rep"]) ==
                 (client, ours, op, s["rep"]) and t.get("ok")]
            if o and key in s and o[0].get(key):
                r.append(s[key] / o[0][key])
        out[name] = C.median(r)
    return out


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--clients", default=",".join(CLIENTS))
    p.add_argument("--size", default="400MiB", help="about this many bytes of state")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--dir", default="/tmp/fastckpt-bench-clients")
    p.add_argument("--json", default=os.path.join(REPO_ROOT, "bench-out", "clients.json"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false")
    args = p.parse_args(argv)
    args.clients = [c for c in args.clients.split(",") if c]
    bad = [c for c in args.clients if c not in CLIENTS]
    if bad:
        p.error(f"unknown client(s) {bad}; choose from {','.join(CLIENTS)}")
    args.size_bytes = C.parse_size(args.size)
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.drop_caches and not C.can_drop_caches():
        print("error: dropping the page cache needs root; or pass --no-drop-caches",
              file=sys.stderr)
        return 2
    os.makedirs(args.dir, exist_ok=True)
    t0 = time.perf_counter()
    cases: dict[str, dict] = {}
    args.loaders = {}
    for client in args.clients:
        mod = importlib.import_module(f"clients.{client}")
        cases[client] = {"contenders": list(mod.CONTENDERS), "pairs": mod.PAIRS,
                         "descriptions": mod.DESCRIPTIONS}
        args.loaders[client] = set(mod.LOADERS)
    print(f"clients: {', '.join(args.clients)}; state ~{C.human_bytes(args.size_bytes)}; "
          f"reps {args.reps}; cold cache by drop_caches: {args.drop_caches}")
    samples: list[dict[str, Any]] = []
    for rep in range(args.reps):
        for client in args.clients:
            order = C.rotations(cases[client]["contenders"], args.reps)[rep]
            print(f"--- rep {rep + 1}/{args.reps} {client}: {' -> '.join(order)}", flush=True)
            for c in order:
                run_case(client, c, rep, args, samples)
    # every load must give back what was saved
    for s in samples:
        if s["op"].startswith("load") and s.get("ok"):
            ref = [t for t in samples if (t["client"], t["contender"], t["op"], t["rep"]) ==
                   (s["client"], s["contender"], "save", s["rep"]) and t.get("ok")]
            if not ref or ref[0].get("fingerprint") != s.get("fingerprint"):
                s.update(ok=False, error="loaded state differs from the saved state")
                print(f"  {s['client']} {s['contender']} {s['op']} r{s['rep']}: loaded state "
                      "differs from the saved state", file=sys.stderr)
    for s in samples:
        s.pop("fingerprint", None)
    report_rows, report_ratios = [], []
    print()
    for client in args.clients:
        rows = summarize(samples, client)
        report_rows += rows
        print(f"{client}: medians (s)")
        print(f"  {'contender':18s} {'state MiB':>9s} {'stall':>7s} {'durable':>8s} "
              f"{'load cold':>9s} {'load warm':>9s}")

        def f(v: Any) -> str:
            return f"{v:.3f}" if isinstance(v, float) else "-"
        for r in rows:
            mib = (r["state_bytes"] or 0) / C.MiB
            print(f"  {r['contender']:18s} {mib:9.0f} {f(r['stall']):>7s} {f(r['durable']):>8s} "
                  f"{f(r['load_cold']):>9s} {f(r['load_warm']):>9s}"
                  + (f"  FAILED {r['failed']}" if r["failed"] else ""))
        for base, ours in cases[client]["pairs"]:
            rr = ratios(samples, client, base, ours)
            report_ratios.append({"client": client, "default": base, "fastckpt": ours, **rr})
            print(f"  {base} / {ours} (median of paired ratios, >1: fastckpt faster): "
                  + ", ".join(f"{k} {v:.2f}" if v is not None else f"{k} -"
                              for k, v in rr.items()))
    elapsed = time.perf_counter() - t0
    report = {"benchmark": "clients", "date_utc": C.utc_now(), "git": C.git_commit(REPO_ROOT),
              "machine": C.machine_info(args.dir), "versions": {
                  **C.base_versions(), **{p: C.pkg_version(p) for p in (
                      "lightning", "transformers", "accelerate", "torchtitan")}},
              "parameters": {"clients": args.clients, "size_bytes": args.size_bytes,
                             "reps": args.reps, "drop_caches": args.drop_caches,
                             "descriptions": {c: cases[c]["descriptions"] for c in cases}},
              "elapsed_s": elapsed, "medians": report_rows, "ratios": report_ratios,
              "samples": samples}
    print(f"\ntotal {elapsed:.0f} s; JSON: {C.write_json(args.json, report)}")
    return 1 if any(not s.get("ok") for s in samples) else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], sys.argv[3]))
    sys.exit(main(sys.argv[1:]))
