"""``fastckpt bench``: measure the user's own storage before a big job (docs/cli.md, "bench").

On a target (a local path or an fsspec URL; it must exist unless ``create``), with ``ranks``
local processes each handling its share, it measures:

* ``raw``: the device's limit. On a local target with fio (``raw`` ``auto``/``fio``): fio's
  sequential O_DIRECT write (+ end_fsync) / read, timed by fio's own runtime (several files:
  the group's), the best of :data:`FIO_LAYOUTS` (:func:`.fio.best_of_layouts`). Otherwise
  (URLs, no fio, ``fastckpt-io``) each rank writes and reads one file of its share through
  fastckpt's I/O layer (``Storage.write_shard``). The report says which and why;
* ``fastckpt`` (``Checkpointer.save(...).wait()``, one Checkpointer for the run /
  ``fastckpt.load``), ``torch`` (``torch.save`` / ``torch.load``, a file per rank), ``dcp``
  and ``dcp4`` (``torch.distributed.checkpoint``, FileSystemWriter at its default thread
  count and at 4) on a model + Adam state of ``size`` (:mod:`.state`; sharded over the ranks).

Saves run in the ``ranks`` long-lived processes that hold the state, as in a job. Every load
is a restart: ``ranks`` fresh processes (a new gloo group) build the model and a fresh
optimizer (no moments yet), the checkpoint is evicted from the page cache, and only the load is
timed (barrier to barrier, the slowest rank); the loaded state is checked (xxh3 per tensor).
An untimed warm-up round of saves (``warmup``; its fastckpt save is reported as a process's
first), then ``reps`` repetitions, every contender once each, the order rotated
(:func:`~.common.rotations`); medians over the repetitions. Each turn is save, load, remove.

From the fastckpt save bandwidth, the grace window (:func:`~.report.grace_window`). Outputs:
the report and chart (``TARGET/.fastckpt-bench/report.{json,png}``) and the record the engine
reads (``TARGET/.fastckpt-bench.json``, :func:`~.record.read_bench`). Nothing heavy is imported
at import time; the measuring functions import torch.
"""

from __future__ import annotations

import io
import json
import os
import sys
import time
import uuid
from contextlib import ExitStack
from typing import Any, Callable

from . import common, fio
from .record import BENCH_FILE, is_local, join, local_path, read_bench
# the report half of the bench, importable from here as before
from .report import (CONTENDERS, DCP_THREADS, DEFAULT_LAYERS, DEFAULT_REPS, INTERLEAVE, LABELS,
                     LOAD_METHOD, PHASES, REPORT_DIR, STATE_CONTENDERS, engine_record,
                     grace_window, memory_needed, render_png, report_paths, summarize,
                     write_output, write_png, write_record)

__all__ = ["BenchError", "memory_needed", "run_rank", "worker_main", "loader_main",
           "check_target", "run_bench", "raw_source", "FIO_LAYOUTS", "RAW_MODES", "CONTENDERS",
           "LABELS", "PHASES", "STATE_CONTENDERS", "REPORT_DIR", "DEFAULT_REPS", "DEFAULT_LAYERS",
           "INTERLEAVE", "engine_record", "grace_window", "render_png", "report_paths",
           "summarize", "write_output", "write_png", "write_record", "mem_available", "evict",
           "read_bench", "BENCH_FILE", "is_local", "local_path", "join"]

Emit = Callable[[dict], None]

# kept under their old names: the CLI and users call them from here
mem_available = common.mem_available
evict = common.evict

#: the fio layouts tried each repetition (as benchmarks/bench_saveload.py; with ``ranks > 2``
#: one file per rank too): (files written at once, fio's --fallocate)
FIO_LAYOUTS = fio.LAYOUTS
RAW_MODES = fio.RAW_MODES
MEMORY_LOAD = "memory:// lives in one process: a fresh model + optimizer in the saving process"


class BenchError(Exception):
    """The benchmark could not run (a rank failed, the target refused a write, ...)."""


def _fingerprint(model: Any, optim: Any) -> list[str]:
    """``name:xxh3`` of every tensor of this rank's share of the state."""
    import torch
    import xxhash

    from . import state as S
    out = []
    for name, t in S.state_tensors(model, optim):
        t = t.to_local() if hasattr(t, "to_local") else t
        b = t.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        out.append(f"{name}:{xxhash.xxh3_64_hexdigest(b)}")
    return out


def raw_source(mode: str, target: str, work: str) -> dict:
    """How ``raw`` is measured (:func:`.fio.source`: fio where it works in ``work``, else
    fastckpt's I/O layer and why); BenchError for ``fio`` where it cannot run."""
    try:
        return fio.source(mode, local_path(work) if is_local(target) else None)
    except RuntimeError as e:
        raise BenchError(str(e)) from None


# ------------------------------------------------------------------------------- one rank

def run_rank(cfg: dict, rank: int, world: int, emit: Emit) -> dict:
    """Run the warm-up and every repetition on this rank (a saver); return its samples.

    ``{"times": {phase: [seconds per timed repetition]}, "warmup": {phase: seconds},
    "orders": [{"rep", "order"} per round], "skipped", "evicted", "state_bytes", "loads",
    "fio", ...}``. Collective when ``world > 1`` (the default process group is initialised);
    barriers separate the phases. Rank 0 starts the fresh loaders (:func:`_run_loaders`) and
    fio; every rank records the figures (a load: its loader rank's time).
    """
    import torch

    from ..engine import dist
    from ..storage import open_storage
    from ..storage.native import aligned_buffer
    from . import state as S

    work = cfg["work"]
    contenders = list(cfg["contenders"])
    reps = int(cfg.get("reps", DEFAULT_REPS))
    raw_src = (cfg.get("raw") or {}).get("source") or "fastckpt-io"
    out: dict[str, Any] = {"rank": rank, "times": {}, "warmup": {}, "skipped": {},
                           "evicted": None, "orders": [], "loads": [], "fio": []}
    local = is_local(work)

    def barrier() -> None:
        if world > 1:
            dist.barrier()

    def on_rank0(fn: Callable[[], dict], what: str) -> dict:
        """``fn()`` run by rank 0 while the others wait; its result on every rank (an error
        is raised on every rank, none is left waiting)."""
        res: dict[str, Any] | None = None
        if rank == 0:
            try:
                res = fn()
            except Exception as e:
                res = {"error": f"{type(e).__name__}: {e}"}
        res = dist.all_gather_object(res)[0] if world > 1 else res
        if res is None or "error" in res:
            raise BenchError(f"{what}: {res and res['error']}")
        return res

    def record(name: str, rep: int | None, dt: float) -> None:
        if rep is None:
            out["warmup"][name] = dt
        else:
            out["times"].setdefault(name, []).append(dt)

    def timed(name: str, rep: int | None, fn: Callable[[], Any], nbytes: int) -> Any:
        barrier()
        emit({"event": "start", "phase": name, "rep": rep, "reps": reps})
        t0 = time.perf_counter()
        r = fn()
        barrier()
        dt = time.perf_counter() - t0
        record(name, rep, dt)
        emit({"event": "end", "phase": name, "seconds": dt, "bytes": nbytes, "rep": rep,
              "reps": reps})
        return r

    def evicted(ok: bool | None) -> None:
        if ok is not None:
            out["evicted"] = ok if out["evicted"] is None else (out["evicted"] and ok)

    def cold(path_url: str) -> None:
        barrier()
        if local:
            evicted(common.evict(local_path(path_url)))
        barrier()

    def rm_dir(url: str) -> None:
        barrier()
        if rank == 0:
            st = open_storage(url)
            st.remove_dir(st.root)
        barrier()

    fingerprints: list[list[str]] = []

    def fresh_load(c: str, location: str, rep: int | None, nbytes: int, **job: Any) -> None:
        """Time ``c``'s load of ``location`` in ``world`` fresh processes (a restart)."""
        name = PHASES[c][1]
        barrier()
        emit({"event": "start", "phase": name, "rep": rep, "reps": reps})
        job.update(contender=c, location=location, fingerprints=fingerprints)
        res = on_rank0(lambda: _run_loaders(cfg, job, world), f"{LABELS[c]} load")
        record(name, rep, res["seconds"][rank])
        evicted(res["evicted"])
        if rank == 0:
            out["loads"].append({"contender": c, "rep": rep, **res})
        emit({"event": "end", "phase": name, "seconds": max(res["seconds"]), "bytes": nbytes,
              "rep": rep, "reps": reps, "verified": res["verified"]})

    size = int(cfg["size"])
    turns: dict[str, Callable[[int | None], None]] = {}
    finals: list[Callable[[], None]] = []
    with ExitStack() as stack:
        if "raw" in contenders:
            raw_dir = join(work, "raw")
            rs = open_storage(raw_dir)
            if rank == 0:
                rs.makedirs(rs.root)
            n = max(4096, size // world // 4096 * 4096)
            rpath = rs.join(f"r{rank:05d}.bin")
            out["raw_bytes"] = n * world

            def raw_io_turn(rep: int | None) -> None:
                buf = aligned_buffer(n)  # per turn: not held while the others run
                torch.frombuffer(buf, dtype=torch.int64).random_(
                    generator=torch.Generator().manual_seed(rank))
                timed("raw write", rep, lambda: rs.write_shard(rpath, buf, n, []), n * world)
                cold(raw_dir)

                def read_all() -> None:
                    step = 256 << 20
                    for off in range(0, n, step):
                        rs.read_into(rpath, off, buf[off:], min(step, n - off))
                timed("raw read", rep, read_all, n * world)
                del buf
                rs.remove(rpath)

            def raw_fio_turn(rep: int | None) -> None:
                barrier()
                emit({"event": "start", "phase": "raw write", "rep": rep, "reps": reps})
                extra = [(world, "native"), (world, "none")] if world > 2 else []
                res = on_rank0(lambda: fio.best_of_layouts(
                    local_path(raw_dir), n * world, list(FIO_LAYOUTS) + extra), "raw I/O (fio)")
                for k in ("write", "read"):
                    record(f"raw {k}", rep, res[f"{k}_s"])
                    emit({"event": "end", "phase": f"raw {k}", "seconds": res[f"{k}_s"],
                          "bytes": n * world, "rep": rep, "reps": reps,
                          "layout": res[f"{k}_layout"]})
                if rank == 0:
                    out["fio"].append({"rep": rep, **res})
            turns["raw"] = raw_fio_turn if raw_src == "fio" else raw_io_turn
            finals.append(lambda: rm_dir(raw_dir))

        if set(contenders) & set(STATE_CONTENDERS):
            emit({"event": "start", "phase": "prepare state"})
            mesh = None
            if world > 1:
                from torch.distributed.device_mesh import init_device_mesh
                mesh = init_device_mesh("cpu", (world,))
            geom = S.geometry(size, layers=int(cfg.get("layers", DEFAULT_LAYERS)), world=world)
            model, optim = S.model_adam(geom, seed=int(cfg.get("seed", 0)), mesh=mesh,
                                        rank=rank)
            state = {"model": model, "optim": optim, "step": 1}
            nb = geom["state_bytes"]
            out["state_bytes"] = nb
            out["geometry"] = geom
            cfg = dict(cfg, geometry=geom)
            # what every fresh load must reproduce, per rank (the savers never change it)
            fingerprints[:] = dist.all_gather_object(_fingerprint(model, optim))

        if "fastckpt" in contenders:
            from ..checkpointer import Checkpointer
            from ..manifest import schema as fmt
            fdir = join(work, "fastckpt")
            ck = stack.enter_context(Checkpointer(fdir, compression=cfg.get("compression")))
            steps = [0]

            def fastckpt_turn(rep: int | None) -> None:
                steps[0] += 1
                step = steps[0]

                def save() -> None:
                    t0 = time.perf_counter()
                    h = ck.save(state, step=step)
                    record("fastckpt staged", rep, time.perf_counter() - t0)
                    h.wait()
                timed("fastckpt save", rep, save, nb)
                if rep is not None:
                    fresh_load("fastckpt", fdir, rep, nb, step=step)
                barrier()
                if rank == 0:
                    ck.storage.remove_dir(ck.storage.join(fmt.step_dirname(step)))
                barrier()
            turns["fastckpt"] = fastckpt_turn
            out["io_backend"] = ck.io_backend
            finals.append(lambda: rm_dir(fdir))

        if "torch" in contenders:
            tdir = join(work, "torch")
            ts = open_storage(tdir)
            if rank == 0:
                ts.makedirs(ts.root)
            tname = ts.join(f"r{rank:05d}.pt")

            def tsave() -> None:
                if local:
                    with open(local_path(tname), "wb") as f:
                        S.torch_save(model, optim, f)
                        f.flush()
                        os.fsync(f.fileno())
                else:
                    with ts.fs.open(tname, "wb", block_size=16 << 20) as f:
                        S.torch_save(model, optim, f)

            def torch_turn(rep: int | None) -> None:
                timed("torch save", rep, tsave, nb)
                if rep is not None:
                    fresh_load("torch", tdir, rep, nb)
                barrier()
                ts.remove(tname)
            turns["torch"] = torch_turn
            finals.append(lambda: rm_dir(tdir))

        for c in ("dcp", "dcp4"):
            if c not in contenders:
                continue
            try:
                writer = _dcp_io(local, DCP_THREADS[c])[0]
            except Exception as e:  # not importable for this target: skip, say why
                out["skipped"][c] = f"{type(e).__name__}: {e}"
                continue
            dcp_n = [0]

            def dcp_turn(rep: int | None, c: str = c, writer: Any = writer,
                         dcp_n: list = dcp_n) -> None:
                dcp_n[0] += 1
                ddir = join(work, f"{c}-{dcp_n[0]}")  # a fresh directory each turn
                timed(PHASES[c][0], rep, lambda: S.dcp_save(model, optim, writer(ddir),
                                                            no_dist=world == 1), nb)
                if rep is not None:
                    fresh_load(c, ddir, rep, nb)
                rm_dir(ddir)
            turns[c] = dcp_turn
        barrier()

        active = [c for c in contenders if c in turns]
        rounds: list[tuple[int | None, list[str]]] = []
        if cfg.get("warmup", True):
            rounds.append((None, list(active)))
        rounds += list(enumerate(common.rotations(active, reps)))
        for rep, order in rounds:
            out["orders"].append({"rep": rep, "order": order})
            for c in order:
                turns[c](rep)
    for fin in finals:  # after the Checkpointer closed
        fin()
    return out


def _dcp_io(local: bool, threads: int | None) -> tuple[Callable[[str], Any], Callable[[str], Any]]:
    """DCP's (writer, reader) factories for a directory URL: FileSystemWriter/Reader on local
    paths, the fsspec ones for URLs; ``threads``: the writer's ``thread_count`` (None: its
    default)."""
    kw = {} if threads is None else {"thread_count": threads}
    if local:
        from torch.distributed.checkpoint import FileSystemReader as R, FileSystemWriter as W
        return (lambda d: W(local_path(d), **kw)), (lambda d: R(local_path(d)))
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
    return (lambda d: FsspecWriter(d, **kw)), FsspecReader


# ------------------------------------------------------------------- restart loads (fresh)

def _spawn(kind: str, payload: dict, n: int, timeout: float,
           on_line: Callable[[int, str], None] | None = None) -> list[dict]:
    """Run ``n`` ranks of ``python -m fastckpt.bench.storage --KIND`` (savers: ``worker``,
    fresh loaders: ``loader``; gloo on 127.0.0.1); their results, or BenchError."""
    argv = [sys.executable, "-m", "fastckpt.bench.storage", f"--{kind}"]
    res = common.run_gloo_children(argv, payload, n, timeout, on_line=on_line)
    bad = common.first_failure(res)
    if bad:
        who = "the benchmark" if bad[1].startswith("timed out") else (
            f"rank {bad[0]}" if kind == "worker" else f"loader rank {bad[0]}")
        raise BenchError(f"{who} failed: {bad[1]}")
    return res


def _run_loaders(cfg: dict, job: dict, world: int) -> dict:
    """One restart load (``job``: contender, location, fingerprints, ...) in ``world`` fresh
    processes; ``{"seconds": [per rank], "setup_s", "process_s", "verified", "evicted", ...}``."""
    payload = dict(job, work=cfg["work"], geometry=cfg["geometry"],
                   seed=int(cfg.get("seed", 0)))
    if cfg["work"].startswith("memory://"):  # it lives in this process: a fresh state here
        one = _load_rank(payload, 0, 1)
        res = [dict(one, child_total={"wall_s": one["setup_s"] + one["seconds"]})]
    else:
        res = _spawn("loader", payload, world, float(cfg.get("timeout", 24 * 3600.0)))
    return {"seconds": [x["seconds"] for x in res], "setup_s": [x["setup_s"] for x in res],
            "verified": all(x["verified"] for x in res),
            "mismatched": sorted({n for x in res for n in x.get("mismatched", [])})[:10],
            "evicted": res[0]["evicted"], "loaded_step": res[0].get("loaded_step"),
            "process_s": [x["child_total"]["wall_s"] for x in res],
            "pids": [x["pid"] for x in res], "threads": res[0]["torch_threads"]}


def _load_rank(p: dict, rank: int, world: int) -> dict:
    """One loader: a fresh model + optimizer (seed + 1: a load shows), evict, time the load
    (barrier to barrier), check it against the saver's fingerprint."""
    import gc

    import torch

    from ..engine import dist
    from . import state as S
    t0 = time.perf_counter()
    c, loc, local = p["contender"], p["location"], is_local(p["work"])
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
    model, optim = S.model_adam(p["geometry"], seed=int(p["seed"]) + 1, stepped=False,
                                mesh=mesh, rank=rank)
    ret: list[Any] = [None]
    state: dict[str, Any] = {}
    if c == "fastckpt":
        from .. import checkpointer  # the engine is imported before the clock starts
        from ..engine import core  # noqa: F401
        state = {"model": model, "optim": optim, "step": 0}

        def load() -> None:
            ret[0] = checkpointer.load(state, loc)
    elif c == "torch":
        from ..storage import open_storage
        ts = open_storage(loc)
        tname = ts.join(f"r{rank:05d}.pt")

        def load() -> None:
            if local:
                with open(local_path(tname), "rb") as f:
                    _torch_load_fresh(model, optim, f, mesh)
            else:
                _torch_load_fresh(model, optim, io.BytesIO(ts.fs.cat_file(tname)), mesh)
    else:
        import torch.distributed.checkpoint  # noqa: F401
        import torch.distributed.checkpoint.state_dict  # noqa: F401
        reader = _dcp_io(local, None)[1](loc)

        def load() -> None:
            S.dcp_load(model, optim, reader, no_dist=world == 1)
    gc.collect()
    setup_s = time.perf_counter() - t0
    dist.barrier()
    ev = None
    if local:
        ev = common.evict(local_path(loc)) if rank == 0 else None
        ev = dist.all_gather_object(ev)[0]
    dist.barrier()
    t1 = time.perf_counter()
    load()
    dist.barrier()
    dt = time.perf_counter() - t1
    fp, want = _fingerprint(model, optim), p["fingerprints"][rank]
    bad = [a.split(":")[0] for a, b in zip(fp, want) if a != b]
    if len(fp) != len(want):
        bad.append(f"{len(fp)} tensors loaded, {len(want)} saved")
    if c == "fastckpt" and (ret[0] != p.get("step") or state.get("step") != 1):
        bad.append(f"step: loaded {ret[0]!r} (state {state.get('step')!r}), saved "
                   f"{p.get('step')!r}")
    return {"seconds": dt, "setup_s": setup_s, "evicted": ev, "verified": not bad,
            "mismatched": bad[:10], "loaded_step": ret[0],
            "torch_threads": torch.get_num_threads(), "pid": os.getpid()}


def _torch_load_fresh(model: Any, optim: Any, f: Any, mesh: Any) -> None:
    """``torch.load`` into a fresh model + optimizer as a restarted job does (sharded: the
    model's local shards copied in, the moments wrapped as DTensors for ``load_state_dict``)."""
    import torch

    from . import state as S
    if mesh is None:
        S.torch_load(model, optim, f)
        return
    from torch.distributed.tensor import DTensor, Shard
    sd = torch.load(f, map_location="cpu", weights_only=True)
    S._copy_into(model.state_dict(), sd["model"])
    osd = sd["optim"]
    for st in osd["state"].values():
        for k, v in list(st.items()):
            if k != "step" and hasattr(v, "dim") and v.dim() > 0:
                st[k] = DTensor.from_local(v, mesh, [Shard(0)], run_check=False)
    optim.load_state_dict(osd)
    del sd, osd


def _child_main(kind: str, argv: list[str]) -> int:
    """One rank started by :func:`_spawn`: ``worker`` (a saver, :func:`run_rank`; its events
    go to stdout as JSON lines from rank 0) or ``loader`` (:func:`_load_rank`)."""
    cfg_path, res_path = argv[0], argv[1]
    with open(cfg_path) as f:
        cfg = json.load(f)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])

    def emit(ev: dict) -> None:
        if rank == 0:
            sys.stdout.write(json.dumps(ev) + "\n")
            sys.stdout.flush()
    doc: dict[str, Any]
    try:
        import torch

        from ..engine import dist
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        if world > 1:  # savers wait in a collective while rank 0 runs fio or fresh loaders
            dist.init_gloo(rank, world, timeout_s=max(1800.0, float(cfg.get("timeout", 0))))
        try:
            doc = ({"ok": True, "result": run_rank(cfg, rank, world, emit)} if kind == "worker"
                   else {"ok": True, **_load_rank(cfg, rank, world)})
        finally:
            dist.destroy()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        doc = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    tmp = res_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, res_path)
    return 0 if doc["ok"] else 1


def worker_main(argv: list[str]) -> int:
    """``python -m fastckpt.bench.storage --worker CONFIG RESULT``: one saver rank."""
    return _child_main("worker", argv)


def loader_main(argv: list[str]) -> int:
    """``python -m fastckpt.bench.storage --loader CONFIG RESULT``: one rank of a restart load."""
    return _child_main("loader", argv)


def check_target(target: str, *, create: bool = False) -> None:
    """A local target must be an existing directory; ``create``: make it if missing. Raises
    FileNotFoundError (missing) or NotADirectoryError. Object-store URLs have no directories
    to check (a missing bucket fails at the first write)."""
    if not is_local(target):
        return
    p = local_path(target)
    if os.path.isdir(p):
        return
    if os.path.exists(p):
        raise NotADirectoryError(f"{target} is not a directory")
    if not create:
        raise FileNotFoundError(f"{target} does not exist")
    os.makedirs(p, exist_ok=True)


def run_bench(target: str, size: int, *, ranks: int = 1,
              contenders: tuple[str, ...] = CONTENDERS, reps: int = DEFAULT_REPS,
              warmup: bool = True, layers: int = DEFAULT_LAYERS, keep_files: bool = False,
              create: bool = False, emit: Emit | None = None, timeout: float = 24 * 3600.0,
              seed: int = 0, raw: str = "auto", compression: str | None = None) -> dict:
    """Run the benchmark; return the raw measurements (see :func:`summarize`).

    ``emit(event)`` receives {"event": "start"|"end", "phase", "seconds", "bytes", "rep",
    "reps"} from rank 0 (``rep`` None: the warm-up round). ``raw``: how the raw limit is
    measured (:data:`RAW_MODES`, :func:`raw_source`); ``compression``: fastckpt's setting
    (None, "zstd", "auto"). Raises FileNotFoundError (a local
    ``target`` is missing and not ``create``), BenchError (a rank or a loader failed; raw=fio
    where fio cannot run) or StorageError (the target cannot be written).
    """
    from ..storage import open_storage
    emit = emit or (lambda ev: None)
    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        raise ValueError(f"unknown contender(s) {sorted(unknown)}; choose from {CONTENDERS}")
    if reps < 1:
        raise ValueError("reps must be >= 1")
    if raw not in RAW_MODES:
        raise ValueError(f"raw must be one of {RAW_MODES}")
    target = target.rstrip("/") or "/"
    check_target(target, create=create)
    root = open_storage(target)
    root.check_writable()
    work = join(target, f".fastckpt-bench-{uuid.uuid4().hex[:8]}")
    ws = open_storage(work)
    ws.makedirs(ws.root)
    cfg = {"work": work, "size": int(size), "ranks": int(ranks), "contenders": list(contenders),
           "reps": int(reps), "warmup": bool(warmup), "layers": int(layers), "seed": seed,
           "timeout": float(timeout), "raw": None, "compression": compression}
    t0 = time.time()
    try:
        if "raw" in contenders:
            cfg["raw"] = raw_source(raw, target, work)
        if ranks == 1:
            per_rank = [run_rank(cfg, 0, 1, emit)]
        else:
            def on_line(i: int, line: str) -> None:
                if i == 0 and line.startswith("{"):
                    try:
                        emit(json.loads(line))
                    except ValueError:
                        pass
            per_rank = [x["result"] for x in _spawn("worker", cfg, ranks, timeout, on_line)]
    finally:
        if not keep_files:
            try:
                ws.remove_dir(ws.root)
            except Exception:
                pass
    return {"target": target, "work": work if keep_files else None, "size": int(size),
            "ranks": int(ranks), "contenders": list(contenders), "reps": int(reps),
            "warmup": bool(warmup), "layers": int(layers), "compression": compression,
            "started_unix": t0, "elapsed_s": time.time() - t0, "raw": cfg["raw"],
            "load": LOAD_METHOD if not work.startswith("memory://") else MEMORY_LOAD,
            "per_rank": per_rank}


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] in ("--worker", "--loader"):
        sys.exit(_child_main(sys.argv[1][2:], sys.argv[2:]))
    sys.exit("usage: fastckpt bench ... (this module's entry point is for the bench's workers)")
