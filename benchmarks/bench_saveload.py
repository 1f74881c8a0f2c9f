#!/usr/bin/env python3
"""Side-by-side save/load benchmark: fastckpt vs torch.save vs DCP vs fio.

One run measures every contender on the SAME deterministic state (a stack of
fp32 Linear layers + Adam exp_avg/exp_avg_sq as after one step: the builder of
``fastckpt.bench.state``, which ``fastckpt bench`` uses too), with a COLD page
cache before every save and every load, INTERLEAVED (round-robin over the
contenders, order rotated each repetition), REPEATED (--reps) and reports
MEDIANS.  Every contender operation runs in a fresh subprocess.  The helpers
(sizes, machine info, cache drop, meter, child runner, fio, medians) are
``fastckpt.bench.common``.

    python benchmarks/bench_saveload.py                       # ~1.5 GiB, 3 reps
    python benchmarks/bench_saveload.py --size 200MiB --reps 2
    python benchmarks/bench_saveload.py --contenders torch,dcp,dcp4,fio

See benchmarks/README.md for the meaning of the columns and the caveats.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # the working tree's fastckpt (the children get it first too)
from fastckpt.bench import common as C  # noqa: E402
from fastckpt.bench import state as S  # noqa: E402

CONTENDERS = ("fastckpt", "torch", "dcp", "dcp2", "dcp4", "dcp8", "fio")
#: DCP's FileSystemWriter thread counts (its best one differs by host: try them)
DCP_THREADS = {"dcp2": 2, "dcp4": 4, "dcp8": 8}
DESCRIPTIONS = {
    "fastckpt": "fastckpt.save(state, path, step=1) / fastckpt.load(state, path)",
    "torch": "torch.save(state_dicts, f)+flush+fsync / torch.load(weights_only=True)"
             "+load_state_dict",
    "dcp": "dcp.save(get_state_dict(..), FileSystemWriter(path)) / dcp.load(FileSystemReader)",
    "dcp2": "dcp.save(.., FileSystemWriter(path, thread_count=2)) / dcp.load(FileSystemReader)",
    "dcp4": "dcp.save(.., FileSystemWriter(path, thread_count=4)) / dcp.load(FileSystemReader)",
    "dcp8": "dcp.save(.., FileSystemWriter(path, thread_count=8)) / dcp.load(FileSystemReader)",
    "fio": "fio seq O_DIRECT write (+end_fsync) / read, bs=16M iodepth=8 libaio; the best of "
           "1 and 2 files at once, preallocated or not; fio's own runtime",
}
OPS = ("save", "load")


# =========================================================================== child side


def _fingerprint(model, optim) -> list[float]:
    import torch

    fp = []
    with torch.no_grad():
        for _, t in S.state_tensors(model, optim):
            fp.append(float(torch.sum(t, dtype=torch.float64)))
    return fp


def _op_fastckpt(op: str, model, optim, path: str) -> dict[str, Any]:
    import fastckpt

    state = {"model": model, "optim": optim}
    if op == "save":
        fastckpt.save(state, path, step=1)
        return {}
    step = fastckpt.load(state, path)
    return {"loaded_step": step}


def _op_torch(op: str, model, optim, path: str) -> dict[str, Any]:
    fname = os.path.join(path, "checkpoint.pt")
    if op == "save":
        os.makedirs(path, exist_ok=True)
        with open(fname, "wb") as f:
            S.torch_save(model, optim, f)
            f.flush()
            os.fsync(f.fileno())
        return {}
    with open(fname, "rb") as f:
        S.torch_load(model, optim, f)
    return {}


def _op_dcp(op: str, model, optim, path: str, thread_count: int | None) -> dict[str, Any]:
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    if op == "save":
        writer = (FileSystemWriter(path) if thread_count is None
                  else FileSystemWriter(path, thread_count=thread_count))
        S.dcp_save(model, optim, writer, no_dist=True)
        return {}
    S.dcp_load(model, optim, FileSystemReader(path), no_dist=True)
    return {}


def _child(payload: dict[str, Any]) -> dict[str, Any]:
    import gc
    import warnings

    warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
    import torch

    contender, op, path = payload["contender"], payload["op"], payload["path"]
    geom = payload["geometry"]
    if contender == "fastckpt":
        fn = _op_fastckpt
    elif contender == "torch":
        fn = _op_torch
    elif contender == "dcp":
        fn = lambda o, m, opt, p: _op_dcp(o, m, opt, p, None)  # noqa: E731
    elif contender in DCP_THREADS:
        fn = lambda o, m, opt, p: _op_dcp(o, m, opt, p, DCP_THREADS[contender])  # noqa: E731
    else:
        raise ValueError(f"unknown contender {contender!r}")
    if contender == "fastckpt":
        import fastckpt  # import cost is setup, not measured: the package is lazy (PEP 562),
        fastckpt.save, fastckpt.load  # so touch the entry points to import the engine here
    if contender.startswith("dcp"):  # the same for DCP (before 2026-12-06 its imports, read
        import torch.distributed.checkpoint  # noqa: F401  cold after the cache drop, were
        import torch.distributed.checkpoint.state_dict  # noqa: F401  timed: ~0.065 s a save)

    t_setup = time.perf_counter()
    # loads start from a *different* fresh model+optimizer (seed+1) so that a
    # successful load is visible in the fingerprint
    seed = payload["seed"] + (1 if op == "load" else 0)
    fresh = op == "load" and payload.get("load_into") == "fresh"
    model, optim = S.model_adam(geom, seed=seed, stepped=not fresh)
    nbytes = sum(t.nbytes for _, t in S.state_tensors(model, optim))
    gc.collect()
    setup_s = time.perf_counter() - t_setup
    dropped = C.drop_caches(required=True) if payload["drop_caches"] else False

    meter = C.OpMeter()
    with meter:
        extra = fn(op, model, optim, path)

    res = dict(meter.result)
    res.update(extra)
    if fresh:  # the moments exist now (created by the load)
        nbytes = sum(t.nbytes for _, t in S.state_tensors(model, optim))
    res.update(bytes=nbytes, seconds=res["wall_s"], setup_s=setup_s,
               cache_dropped=dropped, torch_threads=torch.get_num_threads(),
               fingerprint=_fingerprint(model, optim))
    return res


def child_main(pin: str, pout: str) -> int:
    return C.child_main(pin, pout, _child)


# =========================================================================== parent side


def fastckpt_available() -> tuple[bool, str]:
    """Probe in a subprocess (keeps torch out of the driver process)."""
    code = ("import sys, fastckpt\n"
            "ok = callable(getattr(fastckpt, 'save', None)) and "
            "callable(getattr(fastckpt, 'load', None))\n"
            "print(getattr(fastckpt, '__version__', '') or '')\n"
            "sys.exit(0 if ok else 3)\n")
    try:
        r = subprocess.run([sys.executable, "-c", code], env=C.child_env(REPO_ROOT),
                           capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        return False, f"probe failed: {e}"
    if r.returncode == 0:
        return True, r.stdout.strip() or C.pkg_version("fastckpt") or "unknown"
    if r.returncode == 3:
        return False, "fastckpt is importable but has no save()/load() yet"
    last = (r.stderr.strip().splitlines() or ["import failed"])[-1]
    return False, f"cannot import fastckpt ({last})"


def dir_bytes(path: str) -> int:
    total = 0
    for root, _, files in os.walk(path):
        for fn in files:
            try:
                total += os.lstat(os.path.join(root, fn)).st_blocks * 512
            except OSError:
                pass
    return total


def rm_rf(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


#: the fio layouts tried each repetition; fio's figure is the best of them: (files, fallocate)
FIO_LAYOUTS = ((1, "native"), (1, "none"), (2, "native"), (2, "none"))


def fio_sample(rw: str, path: str, nbytes: int, args) -> dict[str, Any]:
    """fio's best of its layouts (1 and 2 files written at once, preallocated or not; reads:
    of the 1- and 2-file layouts), each timed by fio's own reported runtime, never the wall
    clock (its start-up is ~0.5 s here). Every layout is kept under ``layouts``."""
    os.makedirs(path, exist_ok=True)
    bs = C.parse_size(args.fio_bs)
    layouts = FIO_LAYOUTS if "write" in rw else tuple(l for l in FIO_LAYOUTS if l[1] == "native")
    tried = []
    for files, falloc in layouts:
        size = -(-nbytes // (bs * files)) * bs * files  # whole blocks in every file
        d = os.path.join(path, f"fio-{files}f-{falloc}" if "write" in rw else f"fio-{files}f-native")
        os.makedirs(d, exist_ok=True)
        dropped = C.drop_caches(required=True) if args.drop_caches else False
        r = C.run_fio(os.path.join(d, "fio.dat"), rw, size, bs=args.fio_bs,
                      iodepth=args.fio_iodepth, timeout=args.timeout, numjobs=files,
                      fallocate=falloc if "write" in rw else None)
        r.update(layout=f"{files} file(s), fallocate={falloc}", cache_dropped=dropped)
        if r.get("ok") and r["io_bytes"] != size:
            r.update(ok=False, error=f"fio moved {r['io_bytes']} bytes, expected {size}")
        tried.append(r)
    ok = [r for r in tried if r.get("ok")]
    if not ok:
        return {**tried[0], "layouts": tried}
    best = dict(min(ok, key=lambda r: r["runtime_s"] / r["io_bytes"]))
    best.update(bytes=best["io_bytes"], seconds=best["runtime_s"], peak_rss_delta_bytes=None,
                layouts=tried)
    return best


def child_sample(contender: str, op: str, path: str, rep: int, geom: dict[str, Any],
                 args) -> dict[str, Any]:
    payload = {"contender": contender, "op": op, "path": path, "rep": rep,
               "seed": args.seed, "geometry": geom, "drop_caches": args.drop_caches,
               "load_into": args.load_into}
    argv = [sys.executable, os.path.abspath(__file__), "--child"]
    return C.run_child(argv, payload, timeout=args.timeout, env=C.child_env(REPO_ROOT))


def fmt_sample(s: dict[str, Any]) -> str:
    if not s.get("ok"):
        return f"FAILED: {s.get('error', '?')}"
    mibps = s["bytes"] / s["seconds"] / C.MiB
    cpu = s.get("cpu_s")
    rss = s.get("peak_rss_delta_bytes")
    parts = [f"{s['seconds']:7.2f} s", f"{mibps:8.1f} MiB/s"]
    if cpu is not None:
        parts.append(f"cpu {cpu:6.2f} s")
    if rss is not None:
        parts.append(f"rss +{rss / C.MiB:.0f} MiB")
    if "child_total" in s:
        parts.append(f"(child {s['child_total']['wall_s']:.1f} s)")
    return "  ".join(parts)


def run_pair(c: str, path: str, rep: int, geom: dict[str, Any], args,
             samples: list[dict[str, Any]]) -> None:
    """Save then (cold) load one contender into/from ``path``; append both samples."""
    for op in OPS:
        if op == "load" and not samples[-1].get("ok"):
            s = {"ok": False, "error": "skipped: save failed"}
        elif c == "fio":
            s = fio_sample("write" if op == "save" else "read", path,
                           geom["state_bytes"], args)
        else:
            s = child_sample(c, op, path, rep, geom, args)
        s.update(contender=c, op=op, rep=rep, path=path)
        if op == "save" and s.get("ok"):
            s["disk_bytes"] = dir_bytes(path)
        samples.append(s)
        print(f"  {c:9s} {op:4s} {fmt_sample(s)}", flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", default="1.5GiB",
                   help="total state bytes: params + Adam exp_avg + exp_avg_sq (fp32); "
                        "KiB/MiB/GiB and K/M/G are binary, KB/MB/GB decimal")
    p.add_argument("--layers", type=int, default=16,
                   help="number of square nn.Linear layers the model is made of")
    p.add_argument("--reps", type=int, default=3, help="repetitions (medians are reported)")
    p.add_argument("--contenders", default=",".join(CONTENDERS),
                   help=f"comma-separated subset of {','.join(CONTENDERS)}")
    p.add_argument("--dir", default="/tmp/fastckpt-bench",
                   help="where checkpoints are written (one fresh subdirectory per save)")
    p.add_argument("--json", default=os.path.join(REPO_ROOT, "bench-out", "saveload.json"),
                   help="where to write the JSON report")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--load-into", choices=("stepped", "fresh"), default="fresh",
                   help="what loads start from: a freshly built model + optimizer (no moments "
                        "yet: as a restarted job builds it; each tool creates the moments its "
                        "own way) or one that already took a step (its moments exist)")
    p.add_argument("--fio-bs", default="16M")
    p.add_argument("--fio-iodepth", type=int, default=8)
    p.add_argument("--timeout", type=float, default=900,
                   help="seconds allowed for one child process / fio run")
    p.add_argument("--no-drop-caches", dest="drop_caches", action="store_false",
                   help="do not drop the page cache (warm cache; for non-root smoke tests)")
    args = p.parse_args(argv)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bad = [c for c in args.contenders if c not in CONTENDERS]
    if bad:
        p.error(f"unknown contender(s) {bad}; choose from {','.join(CONTENDERS)}")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    try:
        args.size_bytes = C.parse_size(args.size)
    except ValueError as e:
        p.error(f"--size: {e}")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    size = args.size_bytes
    geom = S.geometry(size, layers=args.layers)
    os.makedirs(args.dir, exist_ok=True)

    if args.drop_caches and not C.can_drop_caches():
        print("error: dropping the page cache needs root (write access to "
              "/proc/sys/vm/drop_caches); rerun as root or pass --no-drop-caches "
              "(warm-cache numbers, not comparable)", file=sys.stderr)
        return 2

    versions = C.base_versions()
    skipped: dict[str, str] = {}
    contenders = list(args.contenders)
    if "fastckpt" in contenders:
        ok, info = fastckpt_available()
        if ok:
            versions["fastckpt"] = info
        else:
            skipped["fastckpt"] = info
            contenders.remove("fastckpt")
            print(f"SKIP fastckpt: {info}", file=sys.stderr)
    if "fio" in contenders and versions.get("fio") is None:
        skipped["fio"] = "fio not found (set $FIO)"
        contenders.remove("fio")
        print("SKIP fio: fio not found (set $FIO)", file=sys.stderr)
    if not contenders:
        print("nothing to run", file=sys.stderr)
        return 2

    machine = C.machine_info(args.dir)
    print(f"state: {C.human_bytes(geom['state_bytes'])} = {geom['layers']} x "
          f"Linear({geom['width']}, {geom['width']}) fp32 params "
          f"({C.human_bytes(geom['param_bytes'])}) + Adam exp_avg + exp_avg_sq")
    print(f"dir: {machine['bench_dir']} ({machine.get('fs_type')} on "
          f"{machine.get('fs_device')}, {machine.get('fs_mount_options')})")
    print(f"contenders: {', '.join(contenders)}; reps: {args.reps}; cold cache: "
          f"{args.drop_caches}")

    samples: list[dict[str, Any]] = []
    for rep, order in enumerate(C.rotations(contenders, args.reps)):
        print(f"--- rep {rep + 1}/{args.reps}: {' -> '.join(order)}")
        for c in order:
            path = os.path.join(args.dir, f"{c}-r{rep}")
            rm_rf(path)
            try:
                run_pair(c, path, rep, geom, args, samples)
            finally:  # also on Ctrl-C: don't leave GiBs behind
                rm_rf(path)

    # --- correctness: every load must reproduce the saved state
    save_fp = {(s["contender"], s["rep"]): s.get("fingerprint") for s in samples
               if s["op"] == "save" and s.get("ok")}
    for s in samples:
        if s["op"] == "load" and s.get("ok") and "fingerprint" in s:
            ref = save_fp.get((s["contender"], s["rep"]))
            s["verified"] = ref is not None and s["fingerprint"] == ref
            if not s["verified"]:
                s["ok"] = False
                s["error"] = "loaded state differs from saved state"
                print(f"  {s['contender']} load rep {s['rep']}: loaded state differs "
                      f"from saved state", file=sys.stderr)
            if s["contender"] == "fastckpt" and s.get("loaded_step") not in (1, None):
                s["ok"] = False
                s["error"] = f"fastckpt.load returned step {s.get('loaded_step')!r}, want 1"
    for s in samples:  # fingerprints are long and only needed for the check above
        s.pop("fingerprint", None)
    actual = {s["bytes"] for s in samples if s.get("ok") and s["contender"] != "fio"}
    if actual and actual != {geom["state_bytes"]}:
        print(f"warning: children report state bytes {sorted(actual)} != computed "
              f"{geom['state_bytes']}", file=sys.stderr)

    baseline = "fio" if "fio" in contenders else None
    rows = C.summarize(samples, baseline=baseline)
    columns = [
        ("contender", "contender", ""),
        ("op", "op", ""),
        ("n", "n", "d"),
        ("median s", "median_s", ".3f"),
        ("min-max s", lambda r: (f"{r['min_s']:.2f}-{r['max_s']:.2f}"
                                 if r["min_s"] is not None else None), ""),
        ("MiB/s", "median_MiBps", ".1f"),
        ("x fio", "x_baseline", ".2f"),
        ("CPU s/GiB", "median_cpu_s_per_GiB", ".2f"),
        ("peak RSS delta MiB", lambda r: (r["median_peak_rss_delta_bytes"] / C.MiB
                                          if r["median_peak_rss_delta_bytes"] is not None
                                          else None), ".0f"),
    ]
    elapsed = time.perf_counter() - t_start
    print()
    print(f"state {C.human_bytes(geom['state_bytes'])}, {args.reps} reps, medians; "
          f"cold cache: {args.drop_caches}; total {elapsed:.0f} s")
    print(C.format_table(rows, columns))
    for r in rows:
        if r["n_failed"]:
            print(f"  {r['contender']} {r['op']}: {r['n_failed']} failed: "
                  f"{'; '.join(r['errors'])}", file=sys.stderr)
    for c, why in skipped.items():
        print(f"  skipped {c}: {why}")

    report = {
        "benchmark": "saveload",
        "date_utc": C.utc_now(),
        "git": C.git_commit(REPO_ROOT),
        "machine": machine,
        "versions": versions,
        "parameters": {
            "size_requested": args.size, "size_bytes_requested": size,
            "geometry": geom, "reps": args.reps, "contenders": contenders,
            "contenders_requested": args.contenders, "skipped": skipped,
            "descriptions": {c: DESCRIPTIONS[c] for c in contenders},
            "dir": os.path.abspath(args.dir), "seed": args.seed, "load_into": args.load_into,
            "drop_caches": args.drop_caches, "fio_bs": args.fio_bs,
            "fio_iodepth": args.fio_iodepth, "timeout_s": args.timeout,
            "interleave": "round-robin per rep, order rotated by one each rep",
            "x_fio": "median over reps of (contender MiB/s / fio MiB/s of same rep and op)",
        },
        "elapsed_s": elapsed,
        "medians": rows,
        "samples": samples,
    }
    out = C.write_json(args.json, report)
    print(f"\nJSON: {out}")
    failed = any(not s.get("ok") for s in samples)
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], sys.argv[3]))
    sys.exit(main(sys.argv[1:]))
