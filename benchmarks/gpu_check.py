"""The GPU check of the fast-path issue: one short script (about 2-4 minutes on an H200 host).

    python benchmarks/gpu_check.py                    # 4 GiB state on cuda:0, writes under /tmp
    python benchmarks/gpu_check.py --size 256MiB --device cpu   # dry run of the code on a CPU

Measures, for a state of ``--size`` bytes (fp32 tensors of 128 MiB, as an FSDP shard of a
model + Adam state) on one GPU:

1. **pinned D2H**: ``copy_(non_blocking=True)`` of the whole state into page-locked host memory
   allocated once, then one synchronize; median of ``--reps`` (the pure copy time, the floor).
2. **fastckpt stall** (``cuda_stage="stream"``, the default, and ``"sync"``), saves 2.. of
   ``--saves`` (the first one pins its buffers): ``host`` = the time ``save`` takes to return;
   ``gpu`` = the time until the training stream has passed the copies (``save`` + a
   ``torch.cuda.synchronize()``). Ratio to the pure copy time; target <= 1.15.
3. **overlap**: a training step (``--matmuls`` bf16 matmuls on tensors outside the state)
   queued right after ``save`` returns: time from ``save`` to the step's end, against the step
   alone and the copy alone. ``serial`` = copy + step; ``overlapped`` would be max(copy, step).
   In "stream" mode the training stream waits for the copy on the GPU, so the step runs after
   it (expected ~serial); the host is free meanwhile (``host`` column). The step time while the
   background write of the previous save runs is also reported (host contention).
4. **load**: ``fastckpt.load`` into the device tensors with the page cache warm (the
   host-to-device side: pinned read buffers, non-blocking copies) against a pure pinned
   host-to-device copy of the same bytes.

Prints a table and writes JSON (``--json``, default ``$OUT/gpu_check.json`` when ``$OUT`` is
set, else ``bench-out/gpu_check.json``) with machine, commit and date.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # the working tree's fastckpt
from fastckpt.bench import common as C  # noqa: E402


def _sync(device) -> None:
    import torch
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=C.parse_size, default="4GiB",
                   help="state bytes (KiB/MiB/GiB and K/M/G binary, KB/MB/GB decimal)")
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dir", default="/tmp/fastckpt-gpu-check")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--saves", type=int, default=4)
    p.add_argument("--matmuls", type=int, default=20)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    import torch
    import fastckpt

    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu_check: CUDA is not available here (use --device cpu for a dry run)")
        return 2
    size = a.size
    tensor_bytes = min(128 << 20, size)
    n = max(1, size // tensor_bytes)
    state = {f"t{i}": torch.randn(tensor_bytes // 4, device=device) for i in range(n)}
    nbytes = sum(t.nbytes for t in state.values())
    gib = nbytes / (1 << 30)
    res: dict = {"machine": C.machine_info(a.dir if os.path.isdir(a.dir) else None),
                 "commit": C.git_commit(REPO_ROOT), "date": C.utc_now(), "state_bytes": nbytes,
                 "device": str(device), "torch": torch.__version__}
    if device.type == "cuda":
        res["gpu"] = torch.cuda.get_device_name(device)

    # 1. the pure pinned device-to-host copy
    pin = device.type == "cuda"
    host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in state.items()}
    copy_s = []
    for _ in range(a.reps):
        _sync(device)
        t0 = time.perf_counter()
        for k, t in state.items():
            host[k].copy_(t, non_blocking=True)
        _sync(device)
        copy_s.append(time.perf_counter() - t0)
    copy = statistics.median(copy_s)
    res["pinned_d2h"] = {"s": copy_s, "median_s": copy, "GBps": nbytes / copy / 1e9}
    del host

    # a training step outside the state
    if device.type == "cuda":
        x = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    else:
        x = torch.randn(512, 512, device=device)

    def step():
        y = x
        for _ in range(a.matmuls):
            y = torch.tanh(y @ x)
        return y

    step()
    _sync(device)
    step_s = []
    for _ in range(a.reps):
        t0 = time.perf_counter()
        step()
        _sync(device)
        step_s.append(time.perf_counter() - t0)
    step_alone = statistics.median(step_s)
    res["step_alone_s"] = step_alone

    # 2 + 3. fastckpt, both modes
    modes = {}
    for mode in ("stream", "sync"):
        shutil.rmtree(a.dir, ignore_errors=True)
        rows = []
        with fastckpt.Checkpointer(a.dir, keep_last=1, cuda_stage=mode) as ck:
            for i in range(a.saves):
                _sync(device)
                t0 = time.perf_counter()
                h = ck.save(state, step=i)
                t_host = time.perf_counter() - t0
                _sync(device)
                t_gpu = time.perf_counter() - t0
                # the next step, queued behind the save, while the write runs in the background
                t1 = time.perf_counter()
                step()
                _sync(device)
                t_step_during_write = time.perf_counter() - t1
                h.wait()
                # save + step back to back
                _sync(device)
                t2 = time.perf_counter()
                h = ck.save(state, step=10_000 + i)
                step()
                _sync(device)
                t_save_step = time.perf_counter() - t2
                h.wait()
                rows.append({"save": i + 1, "host_s": t_host, "gpu_s": t_gpu,
                             "step_during_write_s": t_step_during_write,
                             "save_then_step_s": t_save_step, "write_s": h.timings.get("total_s")})
            pinned = ck._stager.pinned_bytes if ck._stager is not None else 0
        later = rows[1:] or rows
        med = {k: statistics.median(r[k] for r in later)
               for k in ("host_s", "gpu_s", "step_during_write_s", "save_then_step_s")}
        modes[mode] = {"saves": rows, "median_later": med, "pinned_bytes": pinned,
                       "stall_over_copy": med["gpu_s"] / copy,
                       "host_over_copy": med["host_s"] / copy,
                       "save_then_step_over_serial": med["save_then_step_s"] / (copy + step_alone)}
    res["fastckpt"] = modes

    # 4. load into the device tensors (page cache warm: this is the host-to-device side) vs a
    # pure pinned host-to-device copy of the same bytes
    host = {k: torch.empty(t.shape, dtype=t.dtype, pin_memory=pin) for k, t in state.items()}
    for k, t in state.items():
        host[k].copy_(t)
    h2d_s = []
    for _ in range(a.reps):
        _sync(device)
        t0 = time.perf_counter()
        for k, t in state.items():
            t.copy_(host[k], non_blocking=True)
        _sync(device)
        h2d_s.append(time.perf_counter() - t0)
    del host
    shutil.rmtree(a.dir, ignore_errors=True)
    fastckpt.save(state, a.dir, step=1)
    load_s = []
    for _ in range(max(2, a.reps // 2)):
        _sync(device)
        t0 = time.perf_counter()
        fastckpt.load(state, a.dir)
        _sync(device)
        load_s.append(time.perf_counter() - t0)
    res["pinned_h2d"] = {"s": h2d_s, "median_s": statistics.median(h2d_s)}
    res["load_warm_cache"] = {"s": load_s, "median_s": statistics.median(load_s)}
    shutil.rmtree(a.dir, ignore_errors=True)

    print(f"state {gib:.2f} GiB on {res.get('gpu', device)}; torch {torch.__version__}")
    print(f"pinned D2H copy: {copy:.3f} s  ({nbytes / copy / 1e9:.1f} GB/s)   "
          f"step alone: {step_alone * 1e3:.1f} ms")
    print(f"{'mode':8} {'host s':>8} {'gpu s':>8} {'gpu/copy':>9} {'host/copy':>10} "
          f"{'save+step s':>12} {'/(copy+step)':>13} {'step in write':>14} {'pinned':>8}")
    for mode, m in modes.items():
        med = m["median_later"]
        print(f"{mode:8} {med['host_s']:8.3f} {med['gpu_s']:8.3f} {m['stall_over_copy']:9.2f} "
              f"{m['host_over_copy']:10.2f} {med['save_then_step_s']:12.3f} "
              f"{m['save_then_step_over_serial']:13.2f} "
              f"{med['step_during_write_s'] / step_alone:13.2f}x "
              f"{C.human_bytes(m['pinned_bytes']):>8}")
    print("target: gpu/copy <= 1.15 (saves 2..N, medians)")
    h2d, ld = res["pinned_h2d"]["median_s"], res["load_warm_cache"]["median_s"]
    print(f"load (page cache warm) {ld:.3f} s = {nbytes / ld / 1e9:.1f} GB/s; pinned H2D copy "
          f"{h2d:.3f} s = {nbytes / h2d / 1e9:.1f} GB/s; load / copy {ld / h2d:.2f}")
    out = a.json or os.path.join(os.environ.get("OUT") or os.path.join(REPO_ROOT, "bench-out"),
                                 "gpu_check.json")
    C.write_json(out, res)
    print(f"json: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
