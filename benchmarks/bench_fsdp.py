#!/usr/bin/env python3
"""FSDP2 save/load benchmark: fastckpt vs DCP on 2 and 4 real ranks (gloo, CPU).

Every operation (one save, one load) runs on a FRESH set of N rank processes (gloo process group
over 127.0.0.1) that build the same FSDP2 model (``fully_shard`` per layer and at the root, a stack
of square fp32 ``nn.Linear``) and its AdamW, stepped once so that the moments exist. The
contenders save that state the way a user does:

* ``fastckpt``: ``fastckpt.save({"model": model, "optim": optim}, root, step=1)`` (blocks until
  committed) / ``fastckpt.load(state, root)`` into a freshly built model + AdamW;
* ``dcp`` (``FileSystemWriter`` defaults: ``thread_count=1``), ``dcp2``, ``dcp4`` (``thread_count``
  2 and 4), and ``dcp1`` (explicit 1: the same as the default): ``get_state_dict(model, optim)`` +
  ``dcp.save(.., storage_writer=FileSystemWriter(path, ..))`` / ``get_state_dict`` + ``dcp.load`` +
  ``set_state_dict``;
* ``dcp_async`` (optional): ``dcp.async_save(..).result()`` (timed until durable; the stall is
  recorded too) / the same load as ``dcp``.

A save is timed from a barrier to the end of the call on every rank (committed, fsynced); the
figure is the span over ranks (last end minus first start, ``CLOCK_MONOTONIC`` is machine-wide).
A load is timed the same way, from a barrier in processes that did nothing but build the fresh
model + optimizer; before it the checkpoint's pages are evicted from the page cache (see
``--cache``). Every local shard of every tensor is hashed (xxh3-64) after the save and after the
load: a load must reproduce the saved bytes exactly, rank by rank.

Per repetition: for each world size, the contenders in rotated order (``C.rotations``); medians
and paired ratios (DCP time / fastckpt time of the same repetition and world size, so > 1 means
fastckpt is faster) go to the JSON.

    python benchmarks/bench_fsdp.py                                    # N=2,4, 1.5 GiB, 3 reps
    python benchmarks/bench_fsdp.py --size 128MiB --reps 1 --ranks 2   # quick check
    python benchmarks/bench_fsdp.py --profile                          # + sampled stacks
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import subprocess
import sys
import threading
import time
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # the working tree's fastckpt (the children get it first too)
from fastckpt.bench import common as C  # noqa: E402
from fastckpt.bench import state as S  # noqa: E402

CONTENDERS = ("fastckpt", "dcp", "dcp1", "dcp2", "dcp4", "dcp_async")
DEFAULT_CONTENDERS = ("fastckpt", "dcp", "dcp2", "dcp4")
DCP_THREADS = {"dcp": None, "dcp1": 1, "dcp2": 2, "dcp4": 4, "dcp_async": None}
DESCRIPTIONS = {
    "fastckpt": "fastckpt.save({'model': m, 'optim': o}, root, step=1) / "
                "fastckpt.load(state, root) (fresh model + AdamW)",
    "dcp": "get_state_dict + dcp.save(FileSystemWriter(path)) [defaults: thread_count=1, "
           "sync_files=True] / get_state_dict + dcp.load(FileSystemReader) + set_state_dict",
    "dcp1": "same as dcp with FileSystemWriter(path, thread_count=1)",
    "dcp2": "same as dcp with FileSystemWriter(path, thread_count=2)",
    "dcp4": "same as dcp with FileSystemWriter(path, thread_count=4)",
    "dcp_async": "get_state_dict + dcp.async_save(FileSystemWriter(path)).result() (timed until "
                 "durable; stall recorded) / same load as dcp",
}
OPS = ("save", "load")


# =========================================================================== child side (a rank)


class StackSampler:
    """A tiny all-threads sampling profiler: every ``interval`` s, the stack of every thread
    (``sys._current_frames``); counts self (innermost frame) and inclusive (any frame) samples
    per function. Python frames only: time inside C code (a write, a memcpy, torch) is charged
    to the Python function that called it."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval = interval
        self.self_counts: collections.Counter = collections.Counter()
        self.incl_counts: collections.Counter = collections.Counter()
        self.n = 0
        self.idle = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _name(code: Any) -> str:
        f = code.co_filename
        for marker in ("site-packages/", "fastckpt/", "benchmarks/"):
            i = f.rfind(marker)
            if i >= 0:
                f = f[i + (len("site-packages/") if marker == "site-packages/" else 0):]
                break
        return f"{f}:{code.co_firstlineno}:{code.co_name}"

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval):
            for tid, frame in sys._current_frames().items():
                if tid == me:
                    continue
                names = []
                f = frame
                while f is not None:
                    names.append(self._name(f.f_code))
                    f = f.f_back
                if not names:
                    continue
                # a thread blocked in a Python-level wait (idle pool workers, a queue, an
                # Event) is not doing the operation's work: counted apart
                if names[0].startswith(("threading.py", "queue.py")) or "/threading.py:" in \
                        names[0] or "/queue.py:" in names[0]:
                    self.idle += 1
                    continue
                self.n += 1
                self.self_counts[names[0]] += 1
                for n in set(names):
                    self.incl_counts[n] += 1

    def __enter__(self) -> "StackSampler":
        self._t0 = time.perf_counter()
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join()
        self.wall = time.perf_counter() - self._t0

    def report(self, top: int = 25) -> dict[str, Any]:
        return {"interval_s": self.interval, "samples": self.n, "idle_samples": self.idle,
                "self": [[k, v * self.interval] for k, v in self.self_counts.most_common(top)],
                "inclusive": [[k, v * self.interval]
                              for k, v in self.incl_counts.most_common(top)]}


#: functions timed by ``--trace`` ("module:Class.attr" or "module:function"), where a
#: caller looks them up (a name imported into another module is patched there too)
TRACE_TARGETS = (
    # fastckpt load
    "fastckpt.engine.core:Engine.load", "fastckpt.engine.load:_load_once",
    "fastckpt.engine.load:find_step", "fastckpt.engine.load:plan_load",
    "fastckpt.engine.state:_optim_sd", "fastckpt.engine.state:_fresh_plain_optimizer",
    "fastckpt.engine.reader:FastCkptReader.check_files",
    "fastckpt.engine.reader:FastCkptReader.read_metadata",
    "fastckpt.engine.reader:FastCkptReader.read_data",
    "fastckpt.engine.reader:FastCkptReader._read_direct",
    "fastckpt.engine.reader:FastCkptReader._read_direct_io",
    "fastckpt.storage.native:NativeBackend.read_to",
    "fastckpt.storage.native:NativeBackend.read_into",
    "fastckpt.storage.native:NativeBackend.copy",
    "fastckpt.storage.native:NativeBackend.hash",
    "fastckpt.engine.dist:Group.gather",
    # fastckpt save
    "fastckpt.checkpointer:Checkpointer.__init__", "fastckpt.engine.core:Engine.close",
    "fastckpt.engine.core:Engine._plan", "fastckpt.engine.core:Engine._claim_root",
    "fastckpt.engine.core:Engine._split", "fastckpt.engine.core:Engine._write_from_memory",
    "fastckpt.engine.writer:Writer._write_and_commit", "fastckpt.engine.writer:Writer._write_piece",
    "fastckpt.engine.writer:Writer._coordinate", "fastckpt.engine.writer:Writer._housekeep",
    "fastckpt.engine.writer:commit",
    "fastckpt.storage.native:NativeBackend.write_segments",
    "fastckpt.storage.native:NativeBackend.write_file",
    # DCP (both tools run it: fastckpt's load goes through dcp.load)
    "torch.distributed.checkpoint:load", "torch.distributed.checkpoint:save",
    "torch.distributed.checkpoint.state_dict:get_state_dict",
    "torch.distributed.checkpoint.state_dict:set_state_dict",
    "torch.distributed.checkpoint.state_dict:_init_optim_state",
    "torch.distributed.checkpoint.default_planner:DefaultLoadPlanner.create_local_plan",
    "torch.distributed.checkpoint.default_planner:DefaultSavePlanner.create_local_plan",
    "torch.distributed.checkpoint.filesystem:FileSystemReader.read_data",
    "torch.distributed.checkpoint.filesystem:_FileSystemWriter.write_data",
    "torch.distributed.checkpoint.filesystem:_FileSystemWriter.finish",
    "torch.distributed.checkpoint.filesystem:_write_files_from_queue",
)


class Tracer:
    """Wraps :data:`TRACE_TARGETS`: every call's (thread, start, end) relative to ``t0``."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()
        self.events: list[tuple[str, str, float, float]] = []
        self._lock = threading.Lock()
        self.patched: list[str] = []

    def _wrap(self, name: str, fn: Any) -> Any:
        import functools

        @functools.wraps(fn)
        def wrapper(*a: Any, **k: Any) -> Any:
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                e = time.perf_counter()
                with self._lock:
                    self.events.append((name, threading.current_thread().name, t, e))
        return wrapper

    def install(self) -> None:
        import importlib
        done: dict[int, Any] = {}
        for target in TRACE_TARGETS:
            mod_name, attr = target.split(":")
            try:
                mod = importlib.import_module(mod_name)
            except ImportError:
                continue
            owner, leaf = mod, attr
            if "." in attr:
                cls, leaf = attr.split(".")
                owner = getattr(mod, cls, None)
                if owner is None:
                    continue
            fn = owner.__dict__.get(leaf) if isinstance(owner, type) else getattr(owner, leaf, None)
            if fn is None:
                continue
            w = done.get(id(fn)) or self._wrap(target.split(":")[1], fn)
            done[id(fn)] = w
            setattr(owner, leaf, w)
            self.patched.append(target)
            if not isinstance(owner, type):  # the same function imported by name elsewhere
                for m in list(sys.modules.values()):
                    if m is not None and m is not mod and getattr(m, "__dict__", {}).get(
                            leaf) is fn and (m.__name__ or "").startswith(("fastckpt", "torch")):
                        setattr(m, leaf, w)

    def report(self, t_start: float) -> dict[str, Any]:
        """Per function: calls, total seconds (summed over calls and threads), the first start
        and the last end relative to the timed operation's start."""
        agg: dict[str, dict[str, Any]] = {}
        for name, thread, t, e in self.events:
            a = agg.setdefault(name, {"calls": 0, "total_s": 0.0, "first_start_s": t - t_start,
                                      "last_end_s": e - t_start, "threads": set()})
            a["calls"] += 1
            a["total_s"] += e - t
            a["first_start_s"] = min(a["first_start_s"], t - t_start)
            a["last_end_s"] = max(a["last_end_s"], e - t_start)
            a["threads"].add(thread.split("_")[0])
        for a in agg.values():
            a["threads"] = sorted(a["threads"])
        return dict(sorted(agg.items(), key=lambda kv: kv[1]["first_start_s"]))


def _build(geom: dict[str, Any], seed: int, stepped: bool) -> tuple[Any, Any, Any]:
    """(model, optim, mesh): FSDP2 over all ranks, params filled from ``seed`` and the rank;
    ``stepped``: AdamW took one step with random (deterministic) gradients."""
    import math

    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    w, layers = geom["width"], geom["layers"]
    mesh = init_device_mesh("cpu", (world,))
    with torch.device("meta"):
        model = nn.Sequential(*[nn.Linear(w, w) for _ in range(layers)])
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    bound = 1.0 / math.sqrt(w)
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().uniform_(-bound, bound, generator=g)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if stepped:
        for p in model.parameters():
            loc = p.to_local()
            grad = torch.empty_like(loc).uniform_(-1e-2, 1e-2, generator=g)
            p.grad = DTensor.from_local(grad, p.device_mesh, p.placements, run_check=False,
                                        shape=p.shape, stride=p.stride())
        optim.step()
        optim.zero_grad(set_to_none=True)
    return model, optim, mesh


def _local(t: Any) -> Any:
    return t.to_local() if hasattr(t, "to_local") else t


def _hashes(model: Any, optim: Any) -> dict[str, Any]:
    """xxh3-64 of every local shard (model state_dict, optimizer state per param), with its
    shape and dtype: equal hashes = bit-exact."""
    import torch
    import xxhash

    out: dict[str, Any] = {}
    names = {id(p): n for n, p in model.named_parameters()}
    items = [(f"model.{k}", v) for k, v in model.state_dict().items()]
    for group in optim.param_groups:
        for p in group["params"]:
            for k, v in sorted(optim.state.get(p, {}).items()):
                if isinstance(v, torch.Tensor):
                    items.append((f"optim.{names[id(p)]}.{k}", v))
    for name, t in items:
        loc = _local(t).detach().contiguous()
        buf = loc.reshape(-1).view(torch.uint8).numpy() if loc.numel() else b""
        out[name] = [xxhash.xxh3_64_hexdigest(buf), list(loc.shape), str(loc.dtype)]
    return out


def _op(contender: str, op: str, model: Any, optim: Any, path: str) -> dict[str, Any]:
    import warnings

    if contender == "fastckpt":
        import fastckpt
        state = {"model": model, "optim": optim}
        if op == "save":
            h = fastckpt.save(state, path, step=1)
            return {"fastckpt_timings": dict(getattr(h, "timings", {}) or {})}
        return {"loaded_step": fastckpt.load(state, path)}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    t0 = time.perf_counter()
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    t_sd = time.perf_counter() - t0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", (UserWarning, FutureWarning))
        if op == "save":
            n = DCP_THREADS[contender]
            writer = FileSystemWriter(path) if n is None else FileSystemWriter(path, thread_count=n)
            if contender == "dcp_async":
                fut = dcp.async_save(sd, storage_writer=writer)
                stall = time.perf_counter() - t0
                fut.result()
                return {"get_state_dict_s": t_sd, "async_stall_s": stall}
            dcp.save(sd, storage_writer=writer)
            return {"get_state_dict_s": t_sd}
        dcp.load(sd, storage_reader=FileSystemReader(path))
        t1 = time.perf_counter()
        set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        return {"get_state_dict_s": t_sd, "dcp_load_s": t1 - t0 - t_sd,
                "set_state_dict_s": time.perf_counter() - t1}


def _child(payload: dict[str, Any]) -> dict[str, Any]:
    import gc

    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint  # noqa: F401  (import cost is setup, not measured)
    import torch.distributed.fsdp  # noqa: F401

    contender, op, path = payload["contender"], payload["op"], payload["path"]
    if contender == "fastckpt":
        import fastckpt
        fastckpt.save, fastckpt.load  # noqa: B018  (the lazy package: import the engine now)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    t_setup = time.perf_counter()
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        # loads start from a different, fresh model (seed+1) and an optimizer without state
        seed = payload["seed"] + (1 if op == "load" else 0)
        model, optim, _ = _build(payload["geometry"], seed, stepped=(op == "save"))
        before = _hashes(model, optim) if op == "load" else None
        gc.collect()
        tracer = None
        if payload.get("trace"):
            tracer = Tracer()
            tracer.install()
        setup_s = time.perf_counter() - t_setup
        dist.barrier()
        dist.barrier()  # the second one: every rank has left the first, starts are closer
        sampler = StackSampler() if payload.get("profile") else None
        meter = C.OpMeter()
        if sampler:
            sampler.__enter__()
        with meter:
            extra = _op(contender, op, model, optim, path)
        if sampler:
            sampler.__exit__(None, None, None)
        t_end = time.perf_counter()
        t_start = t_end - meter.result["wall_s"]
        hashes = _hashes(model, optim)
        nbytes = sum(_local(t).nbytes for _, t in S.state_tensors(model, optim))
        dist.barrier()
    finally:
        dist.destroy_process_group()
    res = dict(meter.result)
    res.update(extra)
    res.update(rank=rank, world=world, t_start=t_start, t_end=t_end, setup_s=setup_s,
               local_bytes=nbytes, hashes=hashes, torch_threads=torch.get_num_threads(),
               loadavg_after=list(os.getloadavg()))
    if before is not None:
        res["changed_by_load"] = sum(before.get(k) != v for k, v in hashes.items())
    if sampler:
        res["profile"] = sampler.report()
    if tracer:
        res["trace"] = tracer.report(t_start)
    return res


def child_main(pin: str, pout: str) -> int:
    return C.child_main(pin, pout, _child)


# =========================================================================== parent side


def rm_rf(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    elif os.path.lexists(path):
        os.unlink(path)


def dir_stats(path: str) -> tuple[int, int]:
    """(files, bytes on disk)."""
    n = total = 0
    for root, _, files in os.walk(path):
        for fn in files:
            try:
                total += os.lstat(os.path.join(root, fn)).st_blocks * 512
                n += 1
            except OSError:
                pass
    return n, total


def resident_bytes(path: str) -> int | None:
    """Bytes of ``path``'s files in the page cache (``fincore``), None if unknown."""
    files = [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    if not files or not shutil.which("fincore"):
        return None
    try:
        r = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *files], capture_output=True,
                           text=True, timeout=60)
        return sum(int(x) for x in r.stdout.split()) if r.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def run_op(contender: str, op: str, world: int, path: str, rep: int, geom: dict[str, Any],
           args) -> dict[str, Any]:
    """One operation on ``world`` fresh rank processes; the sample (span over ranks)."""
    payload = {"contender": contender, "op": op, "path": path, "rep": rep, "seed": args.seed,
               "geometry": geom, "profile": args.profile, "trace": args.trace}
    port = C.free_port()
    envs = []
    for r in range(world):
        env = C.child_env(REPO_ROOT)
        # as torchrun does with more than one process per node: one intra-op thread per rank
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                   WORLD_SIZE=str(world), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(world),
                   OMP_NUM_THREADS=str(args.threads_per_rank))
        envs.append(env)
    argv = [sys.executable, os.path.abspath(__file__), "--child"]
    load0 = os.getloadavg()
    res = C.run_children([argv] * world, payload, timeout=args.timeout, envs=envs)
    s: dict[str, Any] = {"contender": contender, "op": op, "world": world, "rep": rep,
                         "path": path, "loadavg_before": list(load0),
                         "loadavg_after": list(os.getloadavg())}
    bad = [r for r in res if not r.get("ok")]
    if bad:
        s.update(ok=False, error=bad[0].get("error", "?"),
                 output_tail=bad[0].get("output_tail", bad[0].get("traceback")), ranks=res)
        return s
    s["ok"] = True
    s["seconds"] = max(r["t_end"] for r in res) - min(r["t_start"] for r in res)
    s["max_rank_s"] = max(r["wall_s"] for r in res)
    s["start_skew_s"] = max(r["t_start"] for r in res) - min(r["t_start"] for r in res)
    s["bytes"] = sum(r["local_bytes"] for r in res)
    s["cpu_s"] = sum(r["cpu_s"] for r in res)
    s["peak_rss_delta_bytes"] = max(r["peak_rss_delta_bytes"] for r in res)
    s["hashes"] = [r["hashes"] for r in res]
    keep = ("wall_s", "cpu_s", "cpu_user_s", "cpu_sys_s", "peak_rss_delta_bytes", "setup_s",
            "local_bytes", "fastckpt_timings", "get_state_dict_s", "dcp_load_s",
            "set_state_dict_s", "async_stall_s", "loaded_step", "changed_by_load", "profile", "trace",
            "torch_threads", "inblock", "oublock", "majflt", "minflt")
    s["ranks"] = [{k: r[k] for k in keep if k in r} | {"child_total": r.get("child_total")}
                  for r in res]
    return s


def fmt(s: dict[str, Any]) -> str:
    if not s.get("ok"):
        return f"FAILED: {s.get('error', '?')}"
    extra = ""
    if s["contender"] == "fastckpt" and s["op"] == "save":
        t = s["ranks"][0].get("fastckpt_timings", {})
        extra = "  r0 " + " ".join(f"{k[:-2]}={v:.2f}" for k, v in t.items())
    elif s["op"] == "load" and "dcp_load_s" in s["ranks"][0]:
        r = s["ranks"][0]
        extra = (f"  r0 gsd={r['get_state_dict_s']:.2f} load={r['dcp_load_s']:.2f} "
                 f"set={r['set_state_dict_s']:.2f}")
    return (f"{s['seconds']:7.2f} s  {s['bytes'] / s['seconds'] / C.MiB:7.1f} MiB/s  "
            f"cpu {s['cpu_s']:6.1f} s  load {s['loadavg_before'][0]:.1f}{extra}")


def run_pair(c: str, world: int, rep: int, geom: dict[str, Any], args,
             samples: list[dict[str, Any]]) -> None:
    path = os.path.join(args.dir, f"n{world}-{c}-r{rep}")
    rm_rf(path)
    os.sync()  # nobody's dirty pages (a previous rm, another job) are flushed during our save
    try:
        save = run_op(c, "save", world, path, rep, geom, args)
        if save.get("ok"):
            save["files"], save["disk_bytes"] = dir_stats(path)
        samples.append(save)
        print(f"  N={world} {c:9s} save {fmt(save)}", flush=True)
        if not save.get("ok"):
            samples.append({"contender": c, "op": "load", "world": world, "rep": rep,
                            "ok": False, "error": "skipped: save failed"})
            return
        if args.cache == "drop":
            cache = "dropped" if C.drop_caches(required=True) else "kept"
        elif args.cache == "evict":
            cache = "evicted" if C.evict(path) else "evict failed"
        else:
            cache = "warm"
        resident = resident_bytes(path)
        load = run_op(c, "load", world, path, rep, geom, args)
        load.update(cache=cache, resident_before_bytes=resident)
        if load.get("ok"):
            same = [a == b for a, b in zip(save["hashes"], load["hashes"])]
            load["verified"] = all(same) and len(same) == world
            load["n_tensors_checked"] = sum(len(h) for h in load["hashes"])
            if not load["verified"]:
                bad = sorted(k for a, b in zip(save["hashes"], load["hashes"])
                             for k in set(a) | set(b) if a.get(k) != b.get(k))
                load.update(ok=False, error=f"loaded state differs from saved: {bad[:5]} "
                                            f"({len(bad)} tensors)")
            steps = {r.get("loaded_step") for r in load["ranks"]}
            if c == "fastckpt" and steps != {1}:
                load.update(ok=False, error=f"fastckpt.load returned {steps}, want 1")
        samples.append(load)
        print(f"  N={world} {c:9s} load {fmt(load)}  [{cache}, resident "
              f"{'?' if resident is None else C.human_bytes(resident)}]"
              f"{'' if not load.get('ok') else ' bit-exact' if load['verified'] else ''}",
              flush=True)
    finally:
        rm_rf(path)


def paired(samples: list[dict[str, Any]], contenders: list[str], worlds: list[int],
           reps: int) -> list[dict[str, Any]]:
    """Per (world, op): the median time of every contender and, paired by repetition, the
    speedup of fastckpt over each DCP setting and over DCP's best setting of that repetition
    (DCP time / fastckpt time: > 1 = fastckpt faster; the target is >= 1.3)."""
    by = {(s["world"], s["op"], s["contender"], s["rep"]): s for s in samples}
    dcps = [c for c in contenders if c.startswith("dcp")]
    rows = []
    for world in worlds:
        for op in OPS:
            row: dict[str, Any] = {"world": world, "op": op}
            for c in contenders:
                ts = [by[(world, op, c, r)]["seconds"] for r in range(reps)
                      if by.get((world, op, c, r), {}).get("ok")]
                row[f"median_s.{c}"] = C.median(ts)
                row[f"samples_s.{c}"] = ts
            if "fastckpt" in contenders and dcps:
                per_rep = []
                for r in range(reps):
                    f = by.get((world, op, "fastckpt", r))
                    if not (f and f.get("ok")):
                        continue
                    d = {c: by[(world, op, c, r)]["seconds"] for c in dcps
                         if by.get((world, op, c, r), {}).get("ok")}
                    if not d:
                        continue
                    best = min(d, key=d.get)
                    per_rep.append({"rep": r, "fastckpt_s": f["seconds"], "dcp_best": best,
                                    "dcp_best_s": d[best],
                                    "x_vs_best": d[best] / f["seconds"],
                                    **{f"x_vs_{c}": t / f["seconds"] for c, t in d.items()}})
                row["per_rep"] = per_rep
                row["x_vs_dcp_best"] = C.median(p["x_vs_best"] for p in per_rep)
                for c in dcps:
                    row[f"x_vs_{c}"] = C.median(p.get(f"x_vs_{c}") for p in per_rep)
                row["meets_1.3x"] = (row["x_vs_dcp_best"] is not None
                                     and row["x_vs_dcp_best"] >= 1.3)
            rows.append(row)
    return rows


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--ranks", default="2,4", help="comma-separated world sizes")
    p.add_argument("--size", default="1.5GiB",
                   help="total state over all ranks: params + AdamW exp_avg + exp_avg_sq (fp32)")
    p.add_argument("--layers", type=int, default=16, help="square nn.Linear layers")
    p.add_argument("--reps", type=int, default=3, help="repetitions (medians are reported)")
    p.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                   help=f"comma-separated subset of {','.join(CONTENDERS)}")
    p.add_argument("--dir", default="/tmp/fastckpt-bench-fsdp",
                   help="where checkpoints are written (one fresh subdirectory per save)")
    p.add_argument("--json", default=os.path.join(REPO_ROOT, "bench-out", "fsdp.json"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache", choices=("evict", "drop", "warm"), default="evict",
                   help="before each load: evict the checkpoint's files from the page cache "
                        "(fdatasync + posix_fadvise DONTNEED, no root; only our files), drop "
                        "the whole machine's page cache (root; disturbs other jobs), or nothing")
    p.add_argument("--threads-per-rank", type=int, default=1,
                   help="OMP_NUM_THREADS of each rank (torchrun's default with >1 rank per node)")
    p.add_argument("--profile", action="store_true",
                   help="sample every thread's Python stack every 5 ms during the timed "
                        "operation; top functions per rank in the JSON")
    p.add_argument("--trace", action="store_true",
                   help="time the main fastckpt and DCP functions of the operation (calls, "
                        "seconds, first start / last end) per rank, in the JSON")
    p.add_argument("--timeout", type=float, default=900, help="seconds per operation")
    args = p.parse_args(argv)
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bad = [c for c in args.contenders if c not in CONTENDERS]
    if bad:
        p.error(f"unknown contender(s) {bad}; choose from {','.join(CONTENDERS)}")
    try:
        args.worlds = [int(x) for x in args.ranks.split(",") if x.strip()]
        args.size_bytes = C.parse_size(args.size)
    except ValueError as e:
        p.error(str(e))
    if args.reps < 1 or not args.worlds or min(args.worlds) < 1:
        p.error("--reps and --ranks must be >= 1")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    if args.cache == "drop" and not C.can_drop_caches():
        print("error: --cache drop needs root", file=sys.stderr)
        return 2
    # one geometry for every world size (rows shard evenly over each): the same state
    lcm = 1
    for w in args.worlds:
        lcm = lcm * w // __import__("math").gcd(lcm, w)
    geom = S.geometry(args.size_bytes, layers=args.layers, world=lcm)
    os.makedirs(args.dir, exist_ok=True)
    machine = C.machine_info(args.dir)
    git = C.git_commit(REPO_ROOT)
    try:
        git["short"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT,
                                      capture_output=True, text=True).stdout.strip()
        git["status_porcelain"] = subprocess.run(
            ["git", "status", "--porcelain"], cwd=REPO_ROOT, capture_output=True,
            text=True).stdout.splitlines()
    except OSError:
        pass
    print(f"state: {C.human_bytes(geom['state_bytes'])} = {geom['layers']} x FSDP2 "
          f"Linear({geom['width']}, {geom['width']}) fp32 + AdamW exp_avg/exp_avg_sq; "
          f"ranks {args.worlds}; contenders {args.contenders}; reps {args.reps}; "
          f"cache before loads: {args.cache}")
    print(f"dir: {machine['bench_dir']} ({machine.get('fs_type')} on {machine.get('fs_device')})"
          f"; commit {git.get('short')}{' (dirty)' if git.get('dirty') else ''}; "
          f"load average {os.getloadavg()}")

    samples: list[dict[str, Any]] = []
    loads: list[list[float]] = [list(os.getloadavg())]
    for rep, order in enumerate(C.rotations(args.contenders, args.reps)):
        worlds = args.worlds if rep % 2 == 0 else args.worlds[::-1]
        for world in worlds:
            print(f"--- rep {rep + 1}/{args.reps}, N={world}: {' -> '.join(order)}", flush=True)
            for c in order:
                run_pair(c, world, rep, geom, args, samples)
                loads.append(list(os.getloadavg()))

    rows = paired(samples, args.contenders, args.worlds, args.reps)
    elapsed = time.perf_counter() - t_start
    print(f"\nmedians (s) and fastckpt speedup (DCP s / fastckpt s, paired per rep, median); "
          f"total {elapsed:.0f} s")
    dcps = [c for c in args.contenders if c.startswith("dcp")]
    cols = [("N", "world", "d"), ("op", "op", "")]
    cols += [(f"{c} s", f"median_s.{c}", ".2f") for c in args.contenders]
    if "fastckpt" in args.contenders and dcps:
        cols += [(f"x {c}", f"x_vs_{c}", ".2f") for c in dcps]
        cols += [("x DCP best", "x_vs_dcp_best", ".2f"),
                 (">=1.3", lambda r: "yes" if r.get("meets_1.3x") else "NO", "")]
    print(C.format_table(rows, cols))
    failed = [s for s in samples if not s.get("ok")]
    for s in failed:
        print(f"  FAILED N={s['world']} {s['contender']} {s['op']} rep {s['rep']}: "
              f"{s.get('error')}", file=sys.stderr)
    verified = [s.get("verified") for s in samples if s["op"] == "load" and s.get("ok")]
    print(f"loads verified bit-exact: {sum(bool(v) for v in verified)}/"
          f"{sum(1 for s in samples if s['op'] == 'load')}")
    for s in samples:
        s.pop("hashes", None)
    la = [l[0] for l in loads]
    report = {
        "benchmark": "fsdp",
        "date_utc": C.utc_now(),
        "git": git,
        "machine": machine,
        "versions": C.base_versions(),
        "parameters": {
            "size_requested": args.size, "geometry": geom, "ranks": args.worlds,
            "reps": args.reps, "contenders": args.contenders,
            "descriptions": {c: DESCRIPTIONS[c] for c in args.contenders},
            "dir": os.path.abspath(args.dir), "seed": args.seed, "cache": args.cache,
            "threads_per_rank": args.threads_per_rank, "profile": args.profile,
            "trace": args.trace,
            "timing": "save/load: last rank's end minus first rank's start, each rank starting "
                      "right after a barrier (CLOCK_MONOTONIC); max_rank_s: the slowest rank's "
                      "own span",
            "x": "DCP seconds / fastckpt seconds of the same rep and world size (paired); "
                 "x_vs_dcp_best uses the fastest DCP setting of that rep",
            "interleave": "per rep: world sizes (order alternating), contenders rotated by one",
        },
        "load_average": {"samples_1min": loads, "min_1min": min(la), "max_1min": max(la),
                         "median_1min": C.median(la), "nproc": os.cpu_count()},
        "elapsed_s": elapsed,
        "results": rows,
        "samples": samples,
    }
    out = C.write_json(args.json, report)
    print(f"JSON: {out}")
    return 1 if failed else 0


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(child_main(sys.argv[2], sys.argv[3]))
    sys.exit(main(sys.argv[1:]))
