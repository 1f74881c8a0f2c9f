"""``fastckpt bench``: measure the user's own storage before a big job.

On a target (a local path or an fsspec URL, normally the checkpoint root or a directory on the
same file system; it must exist unless ``create``) it measures, with ``ranks`` local processes
each handling its share:

* ``raw``: raw write / read bandwidth: each rank writes one file of its share through
  fastckpt's I/O layer (``Storage.write_shard``: direct I/O where supported, parallel requests,
  fsync) and reads it back;
* ``fastckpt``: ``Checkpointer.save(...).wait()`` / ``Checkpointer.load`` of a model + Adam
  optimizer of the requested size (:mod:`.state`: the same builder benchmarks/ uses; sharded on
  dim 0 over the ranks as DTensors when ``ranks > 1``), one Checkpointer for the whole run;
* ``torch``: ``torch.save`` / ``torch.load`` of the state dicts (one file per rank) and
  ``dcp``: ``torch.distributed.checkpoint`` save / load of the same state, when importable.

Procedure (as in benchmarks/): an untimed warm-up round of every contender (``warmup``; its
fastckpt save is reported as the first save of a process, which allocates the staging buffer),
then ``reps`` repetitions, each running every contender once, the order rotated by one each
repetition (:func:`~.common.rotations`); the report gives medians over the repetitions and
every sample. Each contender's turn is save, evict, load, remove its files: the target needs
about ``size`` bytes free. Reads start from a cold page cache on local file systems (the files
are fsynced, then evicted with ``posix_fadvise(DONTNEED)``; no root needed).

From the measured fastckpt save bandwidth it computes the grace window a job needs to save its
state after a preemption notice::

    T_grace >= state_size / save_bandwidth + step_drain + barrier + safety
    safety = max(safety_min_s, safety_fraction * (the three terms before))

and the matching Slurm ``--signal`` lead time and Kubernetes ``terminationGracePeriodSeconds``.

Outputs: the full report and its chart (default ``TARGET/.fastckpt-bench/report.json`` and
``report.png``) and the record the engine reads (:func:`~.record.read_bench`), by default
``TARGET/.fastckpt-bench.json`` (format ``fastckpt-bench``, version 1; see docs/cli.md). This
module imports nothing heavy at import time; the measuring functions import torch.
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

from . import common
from .record import BENCH_FILE, is_local, join, local_path, read_bench
# the report half of the bench, importable from here as before
from .report import (CONTENDERS, DEFAULT_LAYERS, DEFAULT_REPS, INTERLEAVE, LABELS, PHASES,
                     REPORT_DIR, STATE_CONTENDERS, engine_record, grace_window, render_png,
                     report_paths, summarize, write_output, write_png, write_record)

__all__ = ["BenchError", "memory_needed", "run_rank", "worker_main", "check_target", "run_bench",
           "CONTENDERS", "LABELS", "PHASES", "STATE_CONTENDERS", "REPORT_DIR", "DEFAULT_REPS",
           "DEFAULT_LAYERS", "INTERLEAVE", "engine_record", "grace_window", "render_png",
           "report_paths", "summarize", "write_output", "write_png", "write_record",
           "mem_available", "evict", "read_bench", "BENCH_FILE", "is_local", "local_path",
           "join"]

Emit = Callable[[dict], None]

# kept under their old names: the CLI and users call them from here
mem_available = common.mem_available
evict = common.evict


class BenchError(Exception):
    """The benchmark could not run (a rank failed, the target refused a write, ...)."""


def memory_needed(size: int, contenders: tuple[str, ...] | list[str]) -> int:
    """Bytes of memory a run needs, about: the state, fastckpt's staging buffer (kept for the
    whole run) and, during a turn, torch.load's copy of the state or the raw I/O buffer."""
    c = set(contenders)
    state = 1.0 if c & set(STATE_CONTENDERS) else 0.0
    staging = 1.0 if "fastckpt" in c else 0.0
    turn = 1.0 if c & {"torch", "raw"} else 0.0
    return int(size * (state + staging + turn + 0.1))


# ------------------------------------------------------------------------------- one rank

def run_rank(cfg: dict, rank: int, world: int, emit: Emit) -> dict:
    """Run the warm-up and every repetition on this rank; return its samples.

    ``{"times": {phase: [seconds per timed repetition]}, "warmup": {phase: seconds},
    "orders": [[contender, ...] per round], "skipped", "evicted", "state_bytes", ...}``.
    Collective when ``world > 1`` (the default process group must be initialised): every rank
    calls it; phases are separated by barriers so each timing covers all ranks' work.
    """
    import torch

    from ..engine import dist
    from ..storage import open_storage
    from ..storage.native import aligned_buffer
    from . import state as S

    work = cfg["work"]
    contenders = list(cfg["contenders"])
    reps = int(cfg.get("reps", DEFAULT_REPS))
    out: dict[str, Any] = {"rank": rank, "times": {}, "warmup": {}, "skipped": {},
                           "evicted": None, "orders": []}
    local = is_local(work)

    def barrier() -> None:
        if world > 1:
            dist.barrier()

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

    def cold(path_url: str) -> None:
        barrier()
        if local:
            ok = common.evict(local_path(path_url))
            out["evicted"] = ok if out["evicted"] is None else (out["evicted"] and ok)
        barrier()

    def rm_dir(url: str) -> None:
        barrier()
        if rank == 0:
            st = open_storage(url)
            st.remove_dir(st.root)
        barrier()

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

            def raw_turn(rep: int | None) -> None:
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
            turns["raw"] = raw_turn
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

        if "fastckpt" in contenders:
            from ..checkpointer import Checkpointer
            from ..manifest import schema as fmt
            fdir = join(work, "fastckpt")
            ck = stack.enter_context(Checkpointer(fdir))
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
                cold(fdir)
                timed("fastckpt load", rep, lambda: ck.load(state), nb)
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

            def tload() -> None:
                if local:
                    with open(local_path(tname), "rb") as f:
                        S.torch_load(model, optim, f)
                else:
                    S.torch_load(model, optim, io.BytesIO(ts.fs.cat_file(tname)))

            def torch_turn(rep: int | None) -> None:
                timed("torch save", rep, tsave, nb)
                cold(tdir)
                timed("torch load", rep, tload, nb)
                ts.remove(tname)
            turns["torch"] = torch_turn
            finals.append(lambda: rm_dir(tdir))

        if "dcp" in contenders:
            try:
                import torch.distributed.checkpoint as dcp
                if local:
                    def writer(d: str) -> Any:
                        return dcp.FileSystemWriter(local_path(d))

                    def reader(d: str) -> Any:
                        return dcp.FileSystemReader(local_path(d))
                else:
                    from torch.distributed.checkpoint._fsspec_filesystem import (
                        FsspecReader, FsspecWriter)
                    writer, reader = FsspecWriter, FsspecReader
            except Exception as e:  # not importable for this target: skip, say why
                out["skipped"]["dcp"] = f"{type(e).__name__}: {e}"
            else:
                dcp_n = [0]
                no_dist = world == 1

                def dcp_turn(rep: int | None) -> None:
                    dcp_n[0] += 1
                    ddir = join(work, f"dcp-{dcp_n[0]}")  # a fresh directory each turn
                    timed("dcp save", rep, lambda: S.dcp_save(model, optim, writer(ddir),
                                                              no_dist=no_dist), nb)
                    cold(ddir)
                    timed("dcp load", rep, lambda: S.dcp_load(model, optim, reader(ddir),
                                                              no_dist=no_dist), nb)
                    rm_dir(ddir)
                turns["dcp"] = dcp_turn
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


# ------------------------------------------------------------------------------ the driver

def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(cfg: dict, emit: Emit, timeout: float) -> list[dict]:
    """Run ``ranks`` worker processes (gloo on 127.0.0.1, :func:`.common.run_children`);
    return their results."""
    n = int(cfg["ranks"])
    port = _free_port()
    threads = max(1, (os.cpu_count() or 1) // n)
    base = common.child_env()
    envs = [dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                 WORLD_SIZE=str(n), LOCAL_RANK=str(r), OMP_NUM_THREADS=str(threads))
            for r in range(n)]
    argv = [sys.executable, "-m", "fastckpt.bench.storage", "--worker"]

    def on_line(i: int, line: str) -> None:
        if i == 0 and line.startswith("{"):
            try:
                ev = json.loads(line)
            except ValueError:
                return
            emit(ev)
    res = common.run_children([argv] * n, cfg, timeout, envs=envs, on_line=on_line)
    errors = {r: x.get("error", "failed") for r, x in enumerate(res) if not x.get("ok")}
    if errors:
        # a rank that lost its peer fails with a connection error: name the one that failed
        real = {r: m for r, m in errors.items() if "Connection" not in m} or errors
        r, m = sorted(real.items())[0]
        who = "the benchmark" if m.startswith("timed out") else f"rank {r}"
        raise BenchError(f"{who} failed: {m}")
    return [x["result"] for x in res]


def worker_main(argv: list[str]) -> int:
    """``python -m fastckpt.bench.storage --worker CONFIG RESULT``: one rank of a multi-rank
    bench (started by :func:`.common.run_children`)."""
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
        dist.init_gloo(rank, world)
        try:
            doc = {"ok": True, "result": run_rank(cfg, rank, world, emit)}
        finally:
            dist.destroy()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        doc = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    tmp = res_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, res_path)
    return 0 if doc["ok"] else 1


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
              seed: int = 0) -> dict:
    """Run the benchmark; return the raw measurements (see :func:`summarize`).

    ``emit(event)`` receives {"event": "start"|"end", "phase", "seconds", "bytes", "rep",
    "reps"} from rank 0 (``rep`` None: the warm-up round). Raises FileNotFoundError (a local
    ``target`` is missing and not ``create``), BenchError (a rank failed) or StorageError (the
    target cannot be written).
    """
    from ..storage import open_storage
    emit = emit or (lambda ev: None)
    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        raise ValueError(f"unknown contender(s) {sorted(unknown)}; choose from {CONTENDERS}")
    if reps < 1:
        raise ValueError("reps must be >= 1")
    target = target.rstrip("/") or "/"
    check_target(target, create=create)
    root = open_storage(target)
    root.check_writable()
    work = join(target, f".fastckpt-bench-{uuid.uuid4().hex[:8]}")
    ws = open_storage(work)
    ws.makedirs(ws.root)
    cfg = {"work": work, "size": int(size), "ranks": int(ranks), "contenders": list(contenders),
           "reps": int(reps), "warmup": bool(warmup), "layers": int(layers), "seed": seed}
    t0 = time.time()
    try:
        if ranks == 1:
            per_rank = [run_rank(cfg, 0, 1, emit)]
        else:
            per_rank = _run_workers(cfg, emit, timeout)
    finally:
        if not keep_files:
            try:
                ws.remove_dir(ws.root)
            except Exception:
                pass
    return {"target": target, "work": work if keep_files else None, "size": int(size),
            "ranks": int(ranks), "contenders": list(contenders), "reps": int(reps),
            "warmup": bool(warmup), "layers": int(layers), "started_unix": t0,
            "elapsed_s": time.time() - t0, "per_rank": per_rank}


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2:]))
    sys.exit("usage: fastckpt bench ... (this module's entry point is for the bench's workers)")
