"""Async save: training stall per save, host memory across saves, and training slowdown.

    python benchmarks/bench_async.py                 # 1.5 GiB state, 10 saves, as the issue asks
    python benchmarks/bench_async.py --size 256MiB --saves 5 --train-steps 60   # quick

Each contender runs in a fresh subprocess (``--child``), one after the other, repeated
``--reps`` times in rotated order; medians are reported:

* ``fastckpt``: ``Checkpointer.save`` of model + Adam state, ``--saves`` times; the stall is
  the time ``save`` takes to return (staged). The child also times two copies of the same
  bytes into already-touched buffers (best of 3 each): torch's ``copy_`` (on its intra-op
  threads: what a DCP stager does) and the fastest copy this host does, the native
  ``copy_many`` on as many threads (non-temporal stores; the floor fastckpt's own staging
  copy runs at since 2026-12-05), then runs ``--saves``
  more saves each right after a timed memcpy (paired: the median of stall/memcpy is the ratio
  least moved by this VM's shifting memory bandwidth), and records the process's RSS
  after every save and its peak above the state's own.
* ``dcp_async``: ``torch.distributed.checkpoint.async_save`` of the same state (DCP's own
  staging), the time the call takes to return; ``.result()`` before the next save.
* ``dcp_async_stager``: the same with one ``DefaultStager`` reused across saves, DCP's best
  setting on CPU (the stall is until its staging completed).
* ``paired``: fastckpt and DCP's best setting **in one process, save after save**, each round
  with a warm memcpy of the same bytes, in rotating order: the ratio fastckpt / DCP at the
  same moment (the headline comparison), against DCP's staging alone and with the
  ``get_state_dict`` call a DCP user makes at each save.
* ``train`` / ``train_ckpt``: a small CPU training loop without checkpoints, and the same loop
  with an async ``Checkpointer.save`` every ``--every`` steps; steps per second.

The state is ``fastckpt.bench.state``'s model + Adam (8 square Linear layers, moments as after
one step), the one ``fastckpt bench`` and bench_saveload.py save. Results: a table and JSON
(``--json``), with machine, commit, versions and date (``fastckpt.bench.common``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # the working tree's fastckpt (the children get it first too)
from fastckpt.bench import common as C  # noqa: E402
from fastckpt.bench import state as S  # noqa: E402


def _rss_mib() -> tuple[float, float]:
    vals = {}
    for line in open("/proc/self/status"):
        if line.startswith(("VmRSS:", "VmHWM:")):
            k, v = line.split(":")
            vals[k] = int(v.split()[0]) / 1024
    return vals["VmRSS"], vals["VmHWM"]


def _state(size: int, seed: int = 0):
    """Model + Adam (moments as after one step) of about ``size`` bytes: (model, optim,
    state bytes, width)."""
    geom = S.geometry(size, layers=8)
    m, opt = S.model_adam(geom, seed=seed)
    return m, opt, geom["state_bytes"], geom["width"]


def _fast_copier(dst, src):
    """The fastest copy of ``src`` into ``dst`` (lists of tensors) on this host: the native
    ``copy_many`` on fastckpt's staging thread count (None where the extension is not built)."""
    from fastckpt.engine.staging import copy_threads
    from fastckpt.storage import native
    if not native.native_available():
        return None
    io, threads = native.get_backend("require"), copy_threads(None)
    jobs = [(d.data_ptr(), s.data_ptr(), s.nbytes) for d, s in zip(dst, src)]

    def run() -> float:
        t = time.perf_counter()
        io.copy_many(jobs, threads)
        return time.perf_counter() - t
    return run


def child_fastckpt(a) -> dict:
    import torch

    import fastckpt
    m, opt, nbytes, _ = _state(a.size)
    base_rss, _ = _rss_mib()
    C.reset_peak_rss()
    stalls, rss = [], []
    with fastckpt.Checkpointer(a.dir, keep_last=2) as ck:
        state = {"model": m, "optim": opt}
        for i in range(a.saves):
            t = time.perf_counter()
            h = ck.save(state, step=i)
            stalls.append(time.perf_counter() - t)
            h.wait()
            rss.append(_rss_mib()[0] - base_rss)
            time.sleep(0.2)
        pool = ck._pool.nbytes
    peak = _rss_mib()[1] - base_rss
    # the memcpy floor: the same bytes into buffers that were already touched
    src = [p.detach() for p in m.parameters()] + [v for s in opt.state.values()
                                                  for v in s.values() if v.dim() > 0]
    dst = [torch.empty_like(t) for t in src]
    for d, s in zip(dst, src):
        d.copy_(s)
    copies = []
    for _ in range(3):
        t = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s)
        copies.append(time.perf_counter() - t)
    fast = _fast_copier(dst, src)
    fast_copies = [fast() for _ in range(3)] if fast else [float("nan")]
    # paired: each save right after a timed memcpy of the same bytes, so both see the same
    # moment's memory bandwidth (this VM's moves by tens of percent between seconds); after the
    # RSS measurement above, since the memcpy's destination is a second copy of the state
    paired = []
    with fastckpt.Checkpointer(a.dir, keep_last=2) as ck:
        state = {"model": m, "optim": opt}
        ck.save(state, step=1000).wait()  # allocate and touch the pool
        for i in range(a.saves):
            t = time.perf_counter()
            for d, s in zip(dst, src):
                d.copy_(s)
            floor = time.perf_counter() - t
            t = time.perf_counter()
            h = ck.save(state, step=1001 + i)
            paired.append((time.perf_counter() - t, floor))
            h.wait()
            time.sleep(0.2)
    return {"bytes": nbytes, "stalls": stalls, "rss_after_save_mib": rss, "peak_rss_mib": peak,
            "pool_bytes": pool, "memcpy_s": min(copies), "memcpy_fast_s": min(fast_copies),
            "paired_stall_memcpy_s": paired}


def child_dcp_async(a, stager: bool = False) -> dict:
    """DCP ``async_save``; ``stager``: its best setting on CPU, one ``DefaultStager`` reused
    across saves (no pinned or shared memory, staging done in the call: measured fastest of
    its StagingOptions here). The stall is until the state may be changed again: the call's
    return, or its ``staging_completion`` when it returns an ``AsyncSaveResponse``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict
    m, opt, nbytes, _ = _state(a.size)
    reused = None
    if stager:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        reused = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                              use_async_staging=False,
                                              use_non_blocking_copy=False))
    stalls = []
    try:
        for i in range(min(a.saves, 5)):
            msd, osd = get_state_dict(m, opt)
            path = os.path.join(a.dir, f"dcp-{i}")
            t = time.perf_counter()
            fut = dcp.async_save({"model": msd, "optim": osd},
                                 storage_writer=FileSystemWriter(path), async_stager=reused)
            if hasattr(fut, "staging_completion"):
                fut.staging_completion.result()
                stalls.append(time.perf_counter() - t)
                fut.upload_completion.result()
            else:
                stalls.append(time.perf_counter() - t)
                fut.result()
            shutil.rmtree(path, ignore_errors=True)
            time.sleep(0.2)
    finally:
        if reused is not None:
            reused.close()
    return {"bytes": nbytes, "stalls": stalls}


def child_paired(a) -> dict:
    """fastckpt's stall against DCP's best async setting **in one process, save after save**:
    the same state, a reused ``Checkpointer`` and one reused ``DefaultStager``, each round a
    warm memcpy of the same bytes, a fastckpt save and a DCP ``async_save`` in a rotating
    order, each waited for before the next. Paired ratios compare the two at the same moment
    (this VM's memory bandwidth moves by tens of percent between seconds, which unpaired
    medians from separate processes do not cancel). DCP's stall is reported twice: staging
    only (as ``child_dcp_async``), and with the ``get_state_dict`` call a DCP user makes at each
    save (fastckpt's stall includes its own equivalent: walking the model and optimizer)."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict import get_state_dict

    import fastckpt
    m, opt, nbytes, _ = _state(a.size)
    src = [p.detach() for p in m.parameters()] + [v for s in opt.state.values()
                                                  for v in s.values() if v.dim() > 0]
    dst = [torch.empty_like(t) for t in src]
    stager = DefaultStager(StagingOptions(use_pinned_memory=False, use_shared_memory=False,
                                          use_async_staging=False, use_non_blocking_copy=False))
    rounds: list[dict] = []
    n = [0]
    memfast = _fast_copier(dst, src)

    def memcpy() -> float:
        t = time.perf_counter()
        for d, s in zip(dst, src):
            d.copy_(s)
        return time.perf_counter() - t

    def fast(ck) -> float:
        n[0] += 1
        t = time.perf_counter()
        h = ck.save({"model": m, "optim": opt}, step=n[0])
        dt = time.perf_counter() - t
        h.wait()
        return dt

    def dcp_save() -> tuple[float, float]:
        n[0] += 1
        path = os.path.join(a.dir, f"dcp-{n[0]}")
        t = time.perf_counter()
        msd, osd = get_state_dict(m, opt)
        t_sd = time.perf_counter() - t
        t = time.perf_counter()
        fut = dcp.async_save({"model": msd, "optim": osd},
                             storage_writer=FileSystemWriter(path), async_stager=stager)
        if hasattr(fut, "staging_completion"):
            fut.staging_completion.result()
            dt = time.perf_counter() - t
            fut.upload_completion.result()
        else:
            dt = time.perf_counter() - t
            fut.result()
        shutil.rmtree(path, ignore_errors=True)
        return dt, t_sd
    try:
        with fastckpt.Checkpointer(os.path.join(a.dir, "fc"), keep_last=2) as ck:
            memcpy(), fast(ck), dcp_save()  # allocate and touch every buffer once
            order = ["memcpy", "fastckpt", "dcp"]
            for i in range(a.saves):
                r: dict = {"order": order[i % 3:] + order[:i % 3]}
                for what in r["order"]:
                    if what == "memcpy":  # both floors, one after the other
                        r["memcpy_s"] = memcpy()
                        r["memcpy_fast_s"] = memfast() if memfast else float("nan")
                    elif what == "fastckpt":
                        r["fastckpt_s"] = fast(ck)
                    else:
                        r["dcp_stage_s"], r["dcp_state_dict_s"] = dcp_save()
                    time.sleep(0.1)
                rounds.append(r)
    finally:
        stager.close()
    return {"bytes": nbytes, "rounds": rounds}


def child_train(a, with_ckpt: bool) -> dict:
    import torch

    import fastckpt
    torch.manual_seed(0)
    m, opt, nbytes, w = _state(a.train_size)
    x = torch.randn(a.batch, w)
    ck = fastckpt.Checkpointer(a.dir, keep_last=2) if with_ckpt else None
    state = {"model": m, "optim": opt, "step": 0}
    for i in range(5):  # warm-up (and the first save, which allocates the pool)
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if ck:
        ck.save(state, step=0).wait()
    t = time.perf_counter()
    for i in range(1, a.train_steps + 1):
        m(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        state["step"] = i
        if ck and i % a.every == 0:
            ck.save(state, step=i)
    if ck:
        ck.close()
    dt = time.perf_counter() - t
    return {"bytes": nbytes, "steps": a.train_steps, "seconds": dt,
            "steps_per_s": a.train_steps / dt}


def run_child(a, mode: str) -> dict:
    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", mode,
                          "--size", str(a.size), "--train-size", str(a.train_size),
                          "--saves", str(a.saves), "--train-steps", str(a.train_steps),
                          "--every", str(a.every), "--batch", str(a.batch), "--dir", a.dir],
                         capture_output=True, text=True, env=C.child_env(REPO_ROOT),
                         timeout=1800)
    shutil.rmtree(a.dir, ignore_errors=True)
    if out.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=C.parse_size, default=C.parse_size("1.5GiB"),
                    help="state bytes (KiB/MiB/GiB and K/M/G binary, KB/MB/GB decimal)")
    ap.add_argument("--train-size", type=C.parse_size, default=C.parse_size("256MiB"))
    ap.add_argument("--saves", type=int, default=10)
    ap.add_argument("--train-steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/fastckpt-bench-async")
    ap.add_argument("--json", default=os.path.join(REPO_ROOT, "bench-out", "async.json"))
    ap.add_argument("--child")
    a = ap.parse_args()
    if a.child:
        fn = {"fastckpt": child_fastckpt, "dcp_async": child_dcp_async,
              "dcp_async_stager": lambda a: child_dcp_async(a, stager=True),
              "paired": child_paired,
              "train": lambda a: child_train(a, False),
              "train_ckpt": lambda a: child_train(a, True)}[a.child]
        print(json.dumps(fn(a)))
        return
    modes = ["fastckpt", "dcp_async", "dcp_async_stager", "paired", "train", "train_ckpt"]
    raw: dict[str, list] = {m: [] for m in modes}
    for rep, order in enumerate(C.rotations(modes, a.reps)):
        for mode in order:
            r = run_child(a, mode)
            raw[mode].append(r)
            print(f"rep {rep + 1} {mode}: " + json.dumps(
                {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()
                 if k not in ("stalls", "rss_after_save_mib", "rounds",
                              "paired_stall_memcpy_s")}), flush=True)
    med = statistics.median
    f = raw["fastckpt"]
    stall_later = med([med(r["stalls"][1:]) for r in f])
    stall_first = med([r["stalls"][0] for r in f])
    memcpy = med([r["memcpy_s"] for r in f])
    paired = med([med(st / fl for st, fl in r["paired_stall_memcpy_s"]) for r in f])
    dcp_stall = med([med(r["stalls"][1:]) for r in raw["dcp_async"]])
    dcp_best = med([med(r["stalls"][1:]) for r in raw["dcp_async_stager"]])
    pr = [x for r in raw["paired"] for x in r["rounds"]]
    vs_stage = med([x["fastckpt_s"] / x["dcp_stage_s"] for x in pr])
    vs_sd = med([x["fastckpt_s"] / (x["dcp_stage_s"] + x["dcp_state_dict_s"]) for x in pr])
    dcp_memcpy = med([x["dcp_stage_s"] / x["memcpy_s"] for x in pr])
    fast_memcpy = med([x["fastckpt_s"] / x["memcpy_s"] for x in pr])
    memcpy_fast = med([r["memcpy_fast_s"] for r in f])
    fast_floor = med([x["fastckpt_s"] / x["memcpy_fast_s"] for x in pr])
    dcp_floor = med([x["dcp_stage_s"] / x["memcpy_fast_s"] for x in pr])
    rss = [r["rss_after_save_mib"] for r in f]
    peak = med([r["peak_rss_mib"] for r in f])
    state_mib = f[0]["bytes"] / C.MiB
    slow = med([t["steps_per_s"] for t in raw["train_ckpt"]]) / med(
        [t["steps_per_s"] for t in raw["train"]])
    summary = {
        "state_mib": state_mib,
        "stall_first_s": stall_first, "stall_later_s": stall_later, "memcpy_s": memcpy,
        "stall_over_memcpy": stall_later / memcpy, "stall_over_memcpy_paired": paired,
        "dcp_async_stall_s": dcp_stall,
        "stall_over_dcp_async": stall_later / dcp_stall,
        "dcp_async_reused_stager_stall_s": dcp_best,
        "stall_over_dcp_async_best": stall_later / dcp_best,
        "paired_rounds": len(pr),
        "paired_fastckpt_over_dcp_best_staging": vs_stage,
        "paired_fastckpt_over_dcp_best_with_state_dict": vs_sd,
        "paired_fastckpt_over_memcpy": fast_memcpy, "paired_dcp_best_over_memcpy": dcp_memcpy,
        "memcpy_fast_s": memcpy_fast, "stall_over_memcpy_fast": stall_later / memcpy_fast,
        "paired_fastckpt_over_memcpy_fast": fast_floor,
        "paired_dcp_best_over_memcpy_fast": dcp_floor,
        "paired_dcp_state_dict_s": med([x["dcp_state_dict_s"] for x in pr]),
        "peak_rss_above_state_mib": peak, "rss_budget_mib": 1.1 * state_mib + 200,
        "rss_after_each_save_mib": rss,
        "train_slowdown_ratio": slow,
        "train_state_mib": raw["train"][0]["bytes"] / C.MiB,
    }
    print("\nasync save, medians over", a.reps, "runs")
    print(f"  state {state_mib:.0f} MiB; stall 1st save {stall_first:.3f} s, later saves "
          f"{stall_later:.3f} s; memcpy {memcpy:.3f} s (best of 3) -> {stall_later / memcpy:.2f} x "
          f"memcpy; paired (each save right after a memcpy, median of the ratios) {paired:.2f} x")
    print(f"  fastest copy (native copy_many, non-temporal, fastckpt's thread count) "
          f"{memcpy_fast:.3f} s -> {stall_later / memcpy_fast:.2f} x; paired {fast_floor:.3f} x "
          f"(DCP best {dcp_floor:.3f} x)")
    print(f"  DCP async_save stall {dcp_stall:.3f} s -> fastckpt/DCP {stall_later / dcp_stall:.2f}")
    print(f"  DCP async_save with a reused DefaultStager (its best here) {dcp_best:.3f} s -> "
          f"fastckpt/DCP-best {stall_later / dcp_best:.2f}")
    print(f"  paired in one process ({len(pr)} rounds, medians of the ratios): fastckpt / DCP "
          f"best (staging only) {vs_stage:.3f}; with DCP's get_state_dict "
          f"{vs_sd:.3f}; fastckpt / memcpy {fast_memcpy:.3f}; DCP best / memcpy {dcp_memcpy:.3f}")
    print(f"  peak RSS above the state's own {peak:.0f} MiB (budget 1.1 x state + 200 = "
          f"{1.1 * state_mib + 200:.0f}); RSS after saves (run 1): "
          + ", ".join(f"{v:.0f}" for v in rss[0]))
    print(f"  training with async saves every {a.every} steps: {slow:.3f} x the speed without")
    doc = {"benchmark": "bench_async", "machine": C.machine_info(a.dir),
           "git": C.git_commit(REPO_ROOT),
           "date": C.utc_now(), "versions": C.base_versions(), "params": vars(a),
           "raw": raw, "summary": summary}
    print("JSON:", C.write_json(a.json, doc))


if __name__ == "__main__":
    main()
