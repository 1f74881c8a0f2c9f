#!/usr/bin/env python
"""Micro-benchmark of fastckpt's hot I/O path: native vs pure-Python backends vs fio, same bytes.

Writes --size bytes (default 1 GiB) from a page-aligned buffer to a file under --dir, then reads
it back with a cold page cache (``sync; echo 1 > /proc/sys/vm/drop_caches`` before every read,
needs root; otherwise the table says "warm").  Contenders are interleaved (a reproducible shuffle
in each repetition), repeated --repeat times; the table shows medians, MiB/s, the ratio to fio and CPU
seconds per GiB (getrusage of this process, all threads; for fio getrusage of the child).

Every in-process write includes open + fallocate + writes + ftruncate + fsync + close, i.e. the
whole ``write_file`` call the checkpoint engine makes.  fio runs
``--rw=write --bs=16M --iodepth=8 --ioengine=libaio --direct=1 --end_fsync=1`` and its MiB/s is
fio's own (bytes / job runtime, process start-up excluded).

    python benchmarks/bench_io.py                    # ~1-3 minutes
    python benchmarks/bench_io.py --size 256M --repeat 5 --json out.json
    python benchmarks/bench_io.py --sweep            # block size x depth for the native backend

Sizes, the cache drop, fio and provenance come from ``fastckpt.bench.common`` (``--size``:
``K/M/G`` and ``KiB/MiB/GiB`` are binary, ``KB/MB/GB`` decimal).
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import resource
import shutil
import statistics
import sys
import threading
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # the working tree's fastckpt

import xxhash  # noqa: E402

from fastckpt.bench import common as C  # noqa: E402
from fastckpt.bench.common import GiB, MiB, drop_caches  # noqa: E402
from fastckpt.storage import native as _native  # noqa: E402


def cpu_self() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def fill(buf: memoryview, n: int) -> None:
    """Random-ish, incompressible content: 64 MiB of urandom tiled, each tile's head perturbed."""
    tile = os.urandom(min(n, 64 * MiB))
    for off in range(0, n, len(tile)):
        m = min(len(tile), n - off)
        buf[off:off + m] = tile[:m]
        if m >= 8:
            buf[off:off + 8] = off.to_bytes(8, "little")


def fio_run(rw: str, path: str, size: int, bs: str, depth: int) -> dict:
    """One fio job (``fastckpt.bench.common.run_fio``: libaio, O_DIRECT, end_fsync on writes)."""
    c0 = cpu_children()
    r = C.run_fio(path, rw, size, bs=bs, iodepth=depth)
    if not r.get("ok"):
        raise RuntimeError(f"fio failed: {r.get('error')}")
    # fio's own usr/sys (percent of its job runtime): excludes the process start-up
    return {"seconds": r["runtime_s"], "wall_with_startup": r["wall_total_s"], "cpu": r["cpu_s"],
            "cpu_process_total": cpu_children() - c0, "mibps": r["bw_bytes_per_s"] / MiB}


def range_hashes(ret) -> list:
    """The ranges' hashes ``write_file`` returns (older versions: ``(whole, ranges)``)."""
    return list(ret[1] if isinstance(ret, tuple) else ret)


def with_busy_thread(fn):
    """Run fn while another Python thread spins holding the GIL (like a training loop would)."""
    def run():
        stop = threading.Event()

        def spin() -> None:
            x = 0
            while not stop.is_set():
                for _ in range(1000):
                    x += 1

        t = threading.Thread(target=spin, daemon=True)
        t.start()
        try:
            fn()
        finally:
            stop.set()
            t.join()
    run.busy = True
    return run


def timed(fn) -> dict:
    c0, t0 = cpu_self(), time.perf_counter()
    fn()
    dt, cpu = time.perf_counter() - t0, cpu_self() - c0
    return {"seconds": dt, "cpu": cpu}


def unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", default="1G", help="bytes per run (default 1G = 1 GiB; 1GB = 10^9)")
    ap.add_argument("--dir", default="/tmp/fastckpt-bench-io")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", dest="json_path", help="write the results as JSON here")
    ap.add_argument("--no-fio", action="store_true")
    ap.add_argument("--no-busy", action="store_true",
                    help="skip the '+GIL busy' rows (direct I/O while a Python thread spins)")
    ap.add_argument("--sweep", action="store_true",
                    help="instead: native direct write/read over block sizes x depths")
    args = ap.parse_args()

    try:
        size = C.parse_size(args.size)
    except ValueError as e:
        ap.error(f"--size: {e}")
    os.makedirs(args.dir, exist_ok=True)
    have_fio = not args.no_fio and shutil.which(C.FIO) is not None
    src = _native.aligned_buffer(size)
    dst = _native.aligned_buffer(size)
    fill(src, size)
    dst[:size] = src[:size]  # pre-fault the destination so no contender pays the first touch
    want = xxhash.xxh3_64_intdigest(src[:size])
    wpath = os.path.join(args.dir, "bench-write.bin")
    rpath = os.path.join(args.dir, "bench-read.bin")
    ranges = [(o, min(64 * MiB, size - o)) for o in range(0, size, 64 * MiB)]  # ~tensor-sized ranges
    want_ranges = [xxhash.xxh3_64_intdigest(src[o:o + n]) for o, n in ranges]

    nat = _native.native_available()
    if not nat:
        print(f"note: native backend unavailable ({_native.native_error()})", file=sys.stderr)

    def writer(be, direct):
        def run():
            got = be.write_file(wpath, src, size, ranges, direct=direct, fsync=True)
            assert range_hashes(got) == want_ranges, "hash mismatch"
        return run

    def reader(be, direct):
        def run():
            assert be.read_into(rpath, 0, dst, size, direct=direct) == want, "hash mismatch"
        return run

    if args.sweep:
        return sweep(args, size, src, dst, wpath, rpath, ranges, want, want_ranges, nat)

    py = _native.PythonBackend()
    contenders = []  # (name, kind, fn)
    nb = _native.NativeBackend() if nat else None
    backends = ([("native", nb)] if nat else []) + [("python", py)]
    for kind, make in (("write", writer), ("read", reader)):
        for name, b in backends:
            contenders += [(f"{name} direct", kind, make(b, True)),
                           (f"{name} buffered", kind, make(b, False))]
        # "+busy": the same direct I/O while another Python thread spins (GIL contention, as
        # when the training loop keeps running during a background save)
        if not args.no_busy:
            contenders += [(f"{name} direct+busy", kind, with_busy_thread(make(b, True)))
                           for name, b in backends]
        if have_fio:
            contenders.append(("fio libaio d8", kind, None))

    # hash-only throughput (memory-bound reference)
    hash_rows = {}
    for name, fn in [("xxhash pkg", lambda: xxhash.xxh3_64_intdigest(src[:size]))] + (
            [("native", lambda: nb.hash(src, size))] if nat else []):
        ts = [timed(fn)["seconds"] for _ in range(3)]
        hash_rows[name] = size / statistics.median(ts) / MiB

    samples: dict[tuple[str, str], list[dict]] = {(n, k): [] for n, k, _ in contenders}
    cold = True
    # the file every read contender reads (written once, not timed)
    _native.PythonBackend().write_file(rpath, src, size, [], direct=True, fsync=True)
    t_start = time.perf_counter()
    rng = random.Random(12345)  # a different, reproducible contender order in every repetition
    for rep in range(args.repeat):
        order = list(contenders)
        rng.shuffle(order)
        for kind in ("write", "read"):
            if kind == "write":
                # untimed warm-up: the first buffered write after the cache drops of a read phase
                # pays for first-touching fresh memory (very slow on VMs that hand freed guest
                # memory back to the host); do not let a contender pay it
                py.write_file(wpath, src, size, [], direct=False, fsync=True)
                unlink(wpath)
            for name, k, fn in order:
                if k != kind:
                    continue
                if kind == "write":
                    unlink(wpath)
                    os.sync()
                    r = fio_run("write", wpath, size, "16M", 8) if fn is None else timed(fn)
                    unlink(wpath)
                else:
                    cold &= drop_caches()
                    r = fio_run("read", rpath, size, "16M", 8) if fn is None else timed(fn)
                r.setdefault("mibps", size / r["seconds"] / MiB)
                if getattr(fn, "busy", False):
                    r["cpu"] = None  # includes the spinning thread: not comparable
                samples[(name, kind)].append(r)
                print(f"  rep {rep + 1} {kind:5s} {name:19s} {r['mibps']:8.0f} MiB/s", file=sys.stderr)
    unlink(rpath)
    elapsed = time.perf_counter() - t_start

    results = []
    for kind in ("write", "read"):
        fio_med = statistics.median(s["mibps"] for s in samples[("fio libaio d8", kind)]) if have_fio else None
        for name, k, _ in contenders:
            if k != kind:
                continue
            ss = samples[(name, kind)]
            med = statistics.median(s["mibps"] for s in ss)
            cpus = [s["cpu"] for s in ss if s["cpu"] is not None]
            cpu = statistics.median(cpus) / (size / GiB) if cpus else None
            results.append({"op": kind, "contender": name, "median_mibps": round(med, 1),
                             "min_mibps": round(min(s["mibps"] for s in ss), 1),
                             "max_mibps": round(max(s["mibps"] for s in ss), 1),
                             "ratio_to_fio": round(med / fio_med, 3) if fio_med else None,
                             "cpu_s_per_gib": round(cpu, 3) if cpu is not None else None, "samples": ss})

    print(f"\nfastckpt I/O benchmark: {size / MiB:.0f} MiB, {args.repeat} repeats, dir {args.dir}, "
          f"reads {'cold' if cold else 'WARM (could not drop caches)'} cache, {os.cpu_count()} CPUs, "
          f"load {os.getloadavg()[0]:.1f}, {elapsed:.0f}s")
    print(f"{'op':5s}  {'contender':19s} {'MiB/s':>8s} {'(min-max)':>13s} {'x fio':>6s} {'CPU s/GiB':>9s}")
    for r in results:
        ratio = f"{r['ratio_to_fio']:.2f}" if r["ratio_to_fio"] is not None else "-"
        cpu = f"{r['cpu_s_per_gib']:9.2f}" if r["cpu_s_per_gib"] is not None else f"{'-':>9s}"
        print(f"{r['op']:5s}  {r['contender']:19s} {r['median_mibps']:8.0f} "
              f"{'(' + str(int(r['min_mibps'])) + '-' + str(int(r['max_mibps'])) + ')':>13s} "
              f"{ratio:>6s} {cpu}")
    print("hash only (GiB/s): " + ", ".join(f"{k} {v / 1024:.1f}" for k, v in hash_rows.items()))

    if args.json_path:
        out = {"size": size, "repeat": args.repeat, "dir": args.dir, "cold_reads": cold,
               "cpus": os.cpu_count(), "kernel": platform.release(), "native": nat,
               "native_error": _native.native_error(), "block_size": _native.DEFAULT_BLOCK_SIZE,
               "depth": _native.DEFAULT_DEPTH, "hash_mibps": hash_rows, "results": results,
               "date_utc": C.utc_now(), "git": C.git_commit(REPO_ROOT),
               "machine": C.machine_info(args.dir), "versions": C.base_versions()}
        C.write_json(args.json_path, out)
    return 0


def sweep(args, size, src, dst, wpath, rpath, ranges, want, want_ranges, nat) -> int:
    """Block size x depth for the native backend (used to pick DEFAULT_BLOCK_SIZE/DEPTH)."""
    if not nat:
        print("sweep needs the native backend", file=sys.stderr)
        return 1
    configs = [(bs, d, True) for bs in (4 * MiB, 8 * MiB, 16 * MiB, 32 * MiB) for d in (1, 2, 4, 8)]
    configs += [(16 * MiB, d, False) for d in (1, 2, 4)]
    _native.PythonBackend().write_file(rpath, src, size, [], direct=True)
    res: dict = {c: {"write": [], "read": []} for c in configs}
    for rep in range(args.repeat):
        for bs, d, direct in configs[rep % len(configs):] + configs[:rep % len(configs)]:
            be = _native.NativeBackend(block_size=bs, depth=d)
            unlink(wpath)
            os.sync()
            t0 = time.perf_counter()
            got = be.write_file(wpath, src, size, ranges, direct=direct)
            assert range_hashes(got) == want_ranges
            res[(bs, d, direct)]["write"].append(size / (time.perf_counter() - t0) / MiB)
            unlink(wpath)
            drop_caches()
            t0 = time.perf_counter()
            assert be.read_into(rpath, 0, dst, size, direct=direct) == want
            res[(bs, d, direct)]["read"].append(size / (time.perf_counter() - t0) / MiB)
            print(f"  rep {rep + 1} {bs // MiB}M d{d} {'direct' if direct else 'buffered'}", file=sys.stderr)
    unlink(rpath)
    print(f"native, {size / MiB:.0f} MiB, median of {args.repeat} (MiB/s; write includes fsync, reads cold)")
    print(f"{'mode':>8s} {'block':>6s} {'depth':>5s} {'write':>7s} {'read':>7s}")
    rows = []
    for (bs, d, direct), v in res.items():
        w, r = statistics.median(v["write"]), statistics.median(v["read"])
        mode = "direct" if direct else "buffered"
        rows.append({"mode": mode, "block_mib": bs // MiB, "depth": d, "write_mibps": round(w),
                     "read_mibps": round(r)})
        print(f"{mode:>8s} {bs // MiB:5d}M {d:5d} {w:7.0f} {r:7.0f}")
    if args.json_path:
        C.write_json(args.json_path, {"size": size, "repeat": args.repeat, "sweep": rows,
                                      "date_utc": C.utc_now(), "git": C.git_commit(REPO_ROOT),
                                      "machine": C.machine_info(args.dir),
                                      "versions": C.base_versions()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
