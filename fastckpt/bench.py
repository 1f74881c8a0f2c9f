"""``fastckpt bench``: measure the user's own storage before a big job.

On a target (a local path or an fsspec URL, normally the checkpoint root or a directory on the
same file system) it measures, with ``ranks`` local processes each handling its share:

* raw write / read bandwidth: each rank writes one file of its share through fastckpt's I/O
  layer (``Storage.write_shard``: direct I/O where supported, parallel requests, fsync) and
  reads it back;
* fastckpt save / load of a synthetic model + Adam optimizer state of the requested size
  (fp32 parameters, ``exp_avg`` and ``exp_avg_sq``: one third each; sharded on dim 0 over
  the ranks as DTensors when ``ranks > 1``);
* ``torch.save`` / ``torch.load`` (one file per rank) and ``torch.distributed.checkpoint``
  (DCP) save / load of the same state, when importable.

Reads start from a cold page cache on local file systems (the files are fsynced, then evicted
with ``posix_fadvise(DONTNEED)``; no root needed). Each contender's files are removed after
its load, so the target needs about ``size`` bytes free.

From the measured fastckpt save bandwidth it computes the grace window a job needs to save its
state after a preemption notice::

    T_grace >= state_size / save_bandwidth + step_drain + barrier + safety
    safety = max(safety_min_s, safety_fraction * (the three terms before))

and the matching Slurm ``--signal`` lead time and Kubernetes ``terminationGracePeriodSeconds``.

The measured bandwidths are written for the engine to read later (:func:`read_bench`): by
default ``TARGET/.fastckpt-bench.json`` (format ``fastckpt-bench``, version 1; see
docs/cli.md). This module imports nothing heavy at import time, so reading that file is cheap.
"""

from __future__ import annotations

import json
import math
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Callable

BENCH_FILE = ".fastckpt-bench.json"
BENCH_FORMAT = "fastckpt-bench"
BENCH_VERSION = 1
CONTENDERS = ("raw", "fastckpt", "torch", "dcp")
LABELS = {"raw": "raw I/O", "fastckpt": "fastckpt", "torch": "torch.save", "dcp": "DCP"}

Emit = Callable[[dict], None]


class BenchError(Exception):
    """The benchmark could not run (a rank failed, the target refused a write, ...)."""


# --------------------------------------------------------------------------------- helpers

def _is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def _local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def _join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def evict(path: str) -> bool:
    """Drop a local file's (or a directory tree's) pages from the page cache; True if done."""
    if not hasattr(os, "posix_fadvise"):
        return False
    files = []
    if os.path.isdir(path):
        for d, _, names in os.walk(path):
            files += [os.path.join(d, n) for n in names]
    elif os.path.exists(path):
        files = [path]
    ok = True
    for p in files:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            ok = False
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        except OSError:
            ok = False
        finally:
            os.close(fd)
    return ok


def grace_window(state_bytes: int, save_bytes_per_s: float, *, step_drain_s: float = 30.0,
                 barrier_s: float = 10.0, safety_fraction: float = 0.25,
                 safety_min_s: float = 30.0) -> dict:
    """The preemption grace window for a state of ``state_bytes`` saved at the measured rate.

    Returns {"seconds": ceil(T_grace), "write_s", "step_drain_s", "barrier_s", "safety_s",
    "state_bytes", "save_bytes_per_s", "slurm_signal", "k8s_termination_grace_period_seconds"}.
    """
    write_s = state_bytes / save_bytes_per_s if save_bytes_per_s > 0 else float("inf")
    base = write_s + step_drain_s + barrier_s
    safety = max(safety_min_s, safety_fraction * base)
    total = base + safety
    secs = int(math.ceil(total)) if math.isfinite(total) else None
    return {"seconds": secs, "write_s": write_s, "step_drain_s": step_drain_s,
            "barrier_s": barrier_s, "safety_s": safety, "safety_fraction": safety_fraction,
            "state_bytes": state_bytes, "save_bytes_per_s": save_bytes_per_s,
            "slurm_signal": f"--signal=USR1@{secs}" if secs else None,
            "k8s_termination_grace_period_seconds": secs}


def read_bench(root: str, path: str | None = None) -> dict | None:
    """The engine-readable bench record of a root (``ROOT/.fastckpt-bench.json``) or of an
    explicit ``path``; None when absent or not a valid record. Keys: see docs/cli.md."""
    target = path or _join(root, BENCH_FILE)
    try:
        if _is_local(target):
            with open(_local_path(target), "rb") as f:
                data = f.read()
        else:
            import fsspec
            fs, p = fsspec.core.url_to_fs(target)
            data = fs.cat_file(p)
        doc = json.loads(data)
    except Exception:
        return None
    if not isinstance(doc, dict) or doc.get("format") != BENCH_FORMAT:
        return None
    if not isinstance(doc.get("version"), int) or doc["version"] > BENCH_VERSION:
        return None
    return doc


def write_record(doc: dict, target: str, out: str | None = None) -> str:
    """Write the engine-readable record atomically; return where it went."""
    data = (json.dumps(doc, indent=1) + "\n").encode()
    dest = out or _join(target, BENCH_FILE)
    from .storage import open_storage
    if _is_local(dest):
        p = os.path.abspath(_local_path(dest))
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open_storage(os.path.dirname(p)).publish(p, data)
        return p
    parent, _, name = dest.rstrip("/").rpartition("/")
    st = open_storage(parent)
    st.publish(st.join(name), data)
    return dest


# ----------------------------------------------------------------------------- the state

def synthetic_state(nbytes: int, rank: int = 0, world: int = 1, *, mesh: Any = None,
                    seed: int = 0) -> tuple[dict, int]:
    """A model + Adam state of about ``nbytes`` in total (this rank's share: nbytes / world).

    Returns (state, bytes this rank holds). Parameters, ``exp_avg`` and ``exp_avg_sq`` are fp32
    [rows, 1024] tensors (random values: incompressible); with a ``mesh`` they are DTensors
    sharded on dim 0 (rows per rank), like FSDP2.
    """
    import torch
    cols = 1024
    share = max(nbytes // world, 3 * 4 * cols)
    elems = share // 12  # param + exp_avg + exp_avg_sq, fp32
    layers = max(4, math.ceil(elems * 4 / (64 << 20)))
    rows = max(1, elems // layers // cols)
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if mesh is not None:
        from torch.distributed.tensor import DTensor, Shard

        def wrap(t):
            return DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
    else:
        def wrap(t):
            return t
    model, opt_state, names = {}, {}, []
    held = 0
    for i in range(layers):
        name = f"layers.{i}.weight"
        names.append(name)
        p, m, v = (torch.rand((rows, cols), generator=g) for _ in range(3))
        held += 3 * p.numel() * 4
        model[name] = wrap(p)
        opt_state[name] = {"step": torch.tensor(1.0), "exp_avg": wrap(m), "exp_avg_sq": wrap(v)}
    state = {"model": model,
             "optim": {"state": opt_state,
                       "param_groups": [{"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                         "weight_decay": 0.0, "params": names}]},
             "step": 1}
    return state, held


def _local_tensors(state: Any) -> Any:
    """The same structure with DTensors replaced by their local shards (for torch.save)."""
    import torch
    if isinstance(state, dict):
        return {k: _local_tensors(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_local_tensors(v) for v in state]
    if isinstance(state, torch.Tensor) and hasattr(state, "to_local"):
        return state.to_local()
    return state


def _copy_into(dst: Any, src: Any) -> None:
    import torch
    if isinstance(dst, dict):
        for k in dst:
            _copy_into(dst[k], src[k])
    elif isinstance(dst, torch.Tensor):
        (dst.to_local() if hasattr(dst, "to_local") else dst).copy_(src)


# ------------------------------------------------------------------------------- one rank

def run_rank(cfg: dict, rank: int, world: int, emit: Emit) -> dict:
    """Run every phase on this rank; return {phase: seconds} (+ "bytes", "skipped", ...).

    Collective when ``world > 1`` (the default process group must be initialised): every rank
    calls it; phases are separated by barriers so each timing covers all ranks' work.
    """
    import torch

    from ._native import aligned_buffer
    from .storage import open_storage

    dist = None
    if world > 1:
        import torch.distributed as dist  # noqa: F811
    work = cfg["work"]
    contenders = cfg["contenders"]
    out: dict[str, Any] = {"rank": rank, "times": {}, "skipped": {}, "evicted": None}
    local = _is_local(work)

    def barrier() -> None:
        if dist is not None:
            dist.barrier()

    def timed(name: str, fn: Callable[[], Any], nbytes: int) -> Any:
        barrier()
        emit({"event": "start", "phase": name})
        t0 = time.perf_counter()
        r = fn()
        barrier()
        dt = time.perf_counter() - t0
        out["times"][name] = dt
        emit({"event": "end", "phase": name, "seconds": dt, "bytes": nbytes})
        return r

    def cold(path_url: str) -> None:
        barrier()
        if local:
            ok = evict(_local_path(path_url))
            out["evicted"] = ok if out["evicted"] is None else (out["evicted"] and ok)
        barrier()

    def rm(url: str) -> None:
        barrier()
        if rank == 0:
            open_storage(url).remove_dir(open_storage(url).root)
        barrier()

    total = int(cfg["size"])
    share = total // world
    if "raw" in contenders:
        raw_dir = _join(work, "raw")
        rs = open_storage(raw_dir)
        if rank == 0:
            rs.makedirs(rs.root)
        barrier()
        n = max(4096, share // 4096 * 4096)
        buf = aligned_buffer(n)
        emit({"event": "start", "phase": "prepare raw data"})
        gen = torch.Generator().manual_seed(rank)
        torch.frombuffer(buf, dtype=torch.int64).random_(generator=gen)
        path = rs.join(f"r{rank:05d}.bin")
        timed("raw write", lambda: rs.write_shard(path, buf, n, []), n * world)
        cold(raw_dir)

        def read_all() -> None:
            step = 256 << 20
            for off in range(0, n, step):
                rs.read_into(path, off, buf[off:], min(step, n - off))
        timed("raw read", read_all, n * world)
        del buf
        rm(raw_dir)
        out["raw_bytes"] = n * world

    emit({"event": "start", "phase": "prepare state"})
    mesh = None
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh
        mesh = init_device_mesh("cpu", (world,))
    state, held = synthetic_state(total, rank, world, mesh=mesh, seed=int(cfg.get("seed", 0)))
    if dist is not None:
        tot = torch.tensor([held], dtype=torch.int64)
        dist.all_reduce(tot)
        state_bytes = int(tot.item())
    else:
        state_bytes = held
    out["state_bytes"] = state_bytes

    if "fastckpt" in contenders:
        from .checkpointer import Checkpointer
        fdir = _join(work, "fastckpt")
        with Checkpointer(fdir) as ck:
            def save(step: int, key: str) -> Callable[[], None]:
                def run() -> None:
                    t0 = time.perf_counter()
                    h = ck.save(state, step=step)
                    out["times"][key] = time.perf_counter() - t0
                    h.wait()
                return run
            # the first save of a process also allocates the staging buffer and probes the
            # root; a job that is preempted has normally saved before: the second is the one
            # that counts (the first is reported too)
            timed("fastckpt first save", save(1, "fastckpt first staged"), state_bytes)
            barrier()
            if rank == 0:
                from . import format as fmt
                ck.storage.remove_dir(ck.storage.join(fmt.step_dirname(1)))
            timed("fastckpt save", save(2, "fastckpt staged"), state_bytes)
            cold(fdir)
            timed("fastckpt load", lambda: ck.load(state), state_bytes)
        out["io_backend"] = ck.io_backend
        rm(fdir)

    if "torch" in contenders:
        tdir = _join(work, "torch")
        tpath = _join(tdir, f"r{rank:05d}.pt")
        ts = open_storage(tdir)
        if rank == 0:
            ts.makedirs(ts.root)
        barrier()
        plain = _local_tensors(state)

        def tsave() -> None:
            if local:
                with open(_local_path(tpath), "wb") as f:
                    torch.save(plain, f)
                    f.flush()
                    os.fsync(f.fileno())
            else:
                with ts.fs.open(ts.join(f"r{rank:05d}.pt"), "wb", block_size=16 << 20) as f:
                    torch.save(plain, f)

        def tload() -> None:
            if local:
                with open(_local_path(tpath), "rb") as f:
                    loaded = torch.load(f, map_location="cpu", weights_only=True)
            else:
                import io
                data = ts.fs.cat_file(ts.join(f"r{rank:05d}.pt"))
                loaded = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
            _copy_into(state["model"], loaded["model"])
            _copy_into(state["optim"]["state"], loaded["optim"]["state"])
        timed("torch save", tsave, state_bytes)
        cold(tdir)
        timed("torch load", tload, state_bytes)
        del plain
        rm(tdir)

    if "dcp" in contenders:
        ddir = _join(work, "dcp")
        try:
            import torch.distributed.checkpoint as dcp
            if local:
                writer = dcp.FileSystemWriter(_local_path(ddir))
                reader_fn = lambda: dcp.FileSystemReader(_local_path(ddir))  # noqa: E731
            else:
                from torch.distributed.checkpoint._fsspec_filesystem import (
                    FsspecReader, FsspecWriter)
                writer = FsspecWriter(ddir)
                reader_fn = lambda: FsspecReader(ddir)  # noqa: E731
        except Exception as e:  # not importable for this target: skip, say why
            out["skipped"]["dcp"] = f"{type(e).__name__}: {e}"
        else:
            import warnings
            no_dist = world == 1
            with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
                warnings.simplefilter("ignore", UserWarning)
                timed("dcp save", lambda: dcp.save(state, storage_writer=writer,
                                                   no_dist=no_dist), state_bytes)
                cold(ddir)
                timed("dcp load", lambda: dcp.load(state, storage_reader=reader_fn(),
                                                   no_dist=no_dist), state_bytes)
            rm(ddir)
    return out


# ------------------------------------------------------------------------------ the driver

def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_workers(cfg: dict, emit: Emit, timeout: float) -> list[dict]:
    """Run ``ranks`` worker processes (gloo on 127.0.0.1); return their results."""
    n = int(cfg["ranks"])
    port = _free_port()
    tmp = tempfile.mkdtemp(prefix="fastckpt-bench-")
    cfg_path = os.path.join(tmp, "config.json")
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    procs: list[subprocess.Popen] = []
    logs = []
    results: dict[int, dict] = {}
    errors: dict[int, str] = {}
    threads = max(1, (os.cpu_count() or 1) // n)
    try:
        for r in range(n):
            env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                       WORLD_SIZE=str(n), LOCAL_RANK=str(r), OMP_NUM_THREADS=str(threads))
            log = open(os.path.join(tmp, f"rank{r}.log"), "w+b")
            logs.append(log)
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "fastckpt.bench", "--worker", cfg_path,
                 os.path.join(tmp, f"result{r}.json")],
                stdout=subprocess.PIPE if r == 0 else subprocess.DEVNULL, stderr=log, env=env))

        def pump() -> None:
            assert procs[0].stdout is not None
            for line in procs[0].stdout:
                try:
                    ev = json.loads(line)
                except ValueError:
                    continue
                emit(ev)
        t = threading.Thread(target=pump, daemon=True)
        t.start()
        deadline = time.monotonic() + timeout
        first_fail: float | None = None
        while any(p.poll() is None for p in procs):
            if any(p.poll() not in (None, 0) for p in procs):
                first_fail = first_fail or time.monotonic()
                if time.monotonic() - first_fail > 10:  # the others wait on the dead rank
                    break
            if time.monotonic() > deadline:
                errors[-1] = f"timed out after {timeout:.0f} s"
                break
            time.sleep(0.1)
        t.join(timeout=5)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, p in enumerate(procs):
        rpath = os.path.join(tmp, f"result{r}.json")
        if os.path.exists(rpath):
            with open(rpath) as f:
                doc = json.load(f)
            if doc.get("ok"):
                results[r] = doc["result"]
            else:
                errors[r] = doc.get("error", "failed")
        elif r not in errors:
            logs[r].seek(0)
            tail = logs[r].read().decode(errors="replace").strip().splitlines()
            errors[r] = (tail[-1] if tail else f"exited with status {p.returncode}")
    for log in logs:
        log.close()
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    if errors or len(results) != n:
        real = {r: m for r, m in errors.items() if r >= 0 and "Connection" not in m} or errors
        r, m = sorted(real.items())[0]
        who = f"rank {r}" if r >= 0 else "the benchmark"
        raise BenchError(f"{who} failed: {m}")
    return [results[r] for r in range(n)]


def worker_main(argv: list[str]) -> int:
    """``python -m fastckpt.bench --worker CONFIG RESULT``: one rank of a multi-rank bench."""
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
        import datetime

        import torch
        import torch.distributed as dist
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        dist.init_process_group("gloo", rank=rank, world_size=world,
                                timeout=datetime.timedelta(minutes=30))
        try:
            doc = {"ok": True, "result": run_rank(cfg, rank, world, emit)}
        finally:
            dist.destroy_process_group()
    except BaseException as e:  # noqa: BLE001 - reported to the parent
        doc = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    tmp = res_path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f)
    os.replace(tmp, res_path)
    return 0 if doc["ok"] else 1


def run_bench(target: str, size: int, *, ranks: int = 1,
              contenders: tuple[str, ...] = CONTENDERS, keep_files: bool = False,
              emit: Emit | None = None, timeout: float = 24 * 3600.0,
              seed: int = 0) -> dict:
    """Run the benchmark; return the raw measurements (see :func:`summarize`).

    ``emit(event)`` receives {"event": "start"|"end", "phase", "seconds", "bytes"} from rank 0.
    Raises BenchError (a rank failed) or StorageError (the target cannot be written).
    """
    from .storage import open_storage
    emit = emit or (lambda ev: None)
    unknown = set(contenders) - set(CONTENDERS)
    if unknown:
        raise ValueError(f"unknown contender(s) {sorted(unknown)}; choose from {CONTENDERS}")
    target = target.rstrip("/") or "/"
    root = open_storage(target)
    root.check_writable()
    work = _join(target, f".fastckpt-bench-{uuid.uuid4().hex[:8]}")
    ws = open_storage(work)
    ws.makedirs(ws.root)
    cfg = {"work": work, "size": int(size), "ranks": int(ranks), "contenders": list(contenders),
           "seed": seed}
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
            "ranks": int(ranks), "contenders": list(contenders), "started_unix": t0,
            "per_rank": per_rank}


# ------------------------------------------------------------------------------ the report

def summarize(raw: dict, *, state_size: int | None = None, step_drain_s: float = 30.0,
              barrier_s: float = 10.0, safety_fraction: float = 0.25,
              safety_min_s: float = 30.0) -> dict:
    """Turn :func:`run_bench`'s measurements into the report (rows, ratios, grace window)."""
    import platform

    from . import __version__
    from ._native import native_error
    per_rank = raw["per_rank"]
    r0 = per_rank[0]

    def t(phase: str) -> float | None:
        vals = [p["times"].get(phase) for p in per_rank]
        return max(vals) if vals and all(v is not None for v in vals) else None
    state_bytes = int(r0.get("state_bytes", raw["size"]))
    raw_bytes = int(r0.get("raw_bytes", raw["size"]))
    rows = []
    for c in raw["contenders"]:
        key = {"raw": ("raw write", "raw read"), "fastckpt": ("fastckpt save", "fastckpt load"),
               "torch": ("torch save", "torch load"), "dcp": ("dcp save", "dcp load")}[c]
        nb = raw_bytes if c == "raw" else state_bytes
        ws, rs = t(key[0]), t(key[1])
        skipped = r0.get("skipped", {}).get(c)
        rows.append({"name": c, "label": LABELS[c], "bytes": nb, "write_s": ws, "read_s": rs,
                     "write_bytes_per_s": nb / ws if ws else None,
                     "read_bytes_per_s": nb / rs if rs else None, "skipped": skipped})
    by = {r["name"]: r for r in rows}
    rawr = by.get("raw")
    for r in rows:
        for k in ("write", "read"):
            bw, base = r[f"{k}_bytes_per_s"], rawr and rawr[f"{k}_bytes_per_s"]
            r[f"{k}_vs_raw"] = bw / base if bw and base else None
    fck = by.get("fastckpt")
    speedup = {}
    if fck and fck["write_s"]:
        for r in rows:
            if r["name"] in ("torch", "dcp") and r["write_s"] and r["read_s"]:
                speedup[r["name"]] = {"save": r["write_s"] / fck["write_s"],
                                      "load": r["read_s"] / fck["read_s"]}
    grace = None
    save_bw = fck and fck["write_bytes_per_s"]
    if save_bw:
        grace = grace_window(int(state_size or state_bytes), save_bw, step_drain_s=step_drain_s,
                             barrier_s=barrier_s, safety_fraction=safety_fraction,
                             safety_min_s=safety_min_s)
    staged = t("fastckpt staged")
    first = {"save_s": t("fastckpt first save"), "staged_s": t("fastckpt first staged")}
    evicted = [p.get("evicted") for p in per_rank]
    return {
        "format": "fastckpt-bench-report", "version": 1, "target": raw["target"],
        "measured_unix": raw["started_unix"],
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(raw["started_unix"])),
        "size_requested": raw["size"], "state_bytes": state_bytes, "raw_bytes": raw_bytes,
        "ranks": raw["ranks"], "rows": rows, "fastckpt_speedup": speedup,
        "fastckpt_staged_s": staged, "fastckpt_first_save": first,
        "cache": ("cold (evicted)" if evicted and all(evicted) else
                  "n/a (fsspec URL)" if all(e is None for e in evicted)
                  else "warm (eviction failed)"),
        "grace": grace,
        "machine": {"host": socket.gethostname(), "cpus": os.cpu_count(),
                    "python": platform.python_version(), "platform": platform.platform()},
        "fastckpt_version": __version__, "io_backend": r0.get("io_backend"),
        "native_error": native_error(),
        "torch_version": _torch_version(),
    }


def _torch_version() -> str | None:
    try:
        import torch
        return str(torch.__version__)
    except Exception:  # pragma: no cover
        return None


def engine_record(report: dict) -> dict:
    """The small record the engine reads (``ROOT/.fastckpt-bench.json``)."""
    by = {r["name"]: r for r in report["rows"]}

    def bw(name: str, k: str) -> float | None:
        r = by.get(name)
        return r and r.get(f"{k}_bytes_per_s")
    n = max(1, int(report["ranks"]))
    per_rank = {k: (v / n if v else None) for k, v in (
        ("save", bw("fastckpt", "write")), ("load", bw("fastckpt", "read")),
        ("raw_write", bw("raw", "write")), ("raw_read", bw("raw", "read")))}
    staged = report.get("fastckpt_staged_s")
    per_rank["stage"] = report["state_bytes"] / n / staged if staged else None
    return {
        "format": BENCH_FORMAT, "version": BENCH_VERSION, "target": report["target"],
        "measured_unix": report["measured_unix"], "measured": report["measured"],
        "host": report["machine"]["host"], "ranks": report["ranks"],
        "state_bytes": report["state_bytes"],
        "bandwidth_bytes_per_s": {"raw_write": bw("raw", "write"), "raw_read": bw("raw", "read"),
                                  "save": bw("fastckpt", "write"),
                                  "load": bw("fastckpt", "read")},
        "per_rank_bytes_per_s": per_rank,
        "save_staged_s": report.get("fastckpt_staged_s"),
        "grace": report.get("grace"), "fastckpt_version": report["fastckpt_version"],
        "io_backend": report.get("io_backend"),
    }


def write_png(report: dict, path: str) -> str | None:
    """A bar chart of write/save and read/load bandwidth per method; None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    from .tools import human_bytes
    rows = [r for r in report["rows"] if r["write_s"] or r["read_s"]]
    labels = [r["label"] for r in rows]
    gib = float(1 << 30)
    w = [(r["write_bytes_per_s"] or 0) / gib for r in rows]
    rd = [(r["read_bytes_per_s"] or 0) / gib for r in rows]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    x = range(len(rows))
    b1 = ax.bar([i - 0.2 for i in x], w, 0.4, label="write / save", color="#d9822b")
    b2 = ax.bar([i + 0.2 for i in x], rd, 0.4, label="read / load", color="#2b7bd9")
    for bars in (b1, b2):
        for b in bars:
            h = b.get_height()
            ax.annotate(f"{h:.2f}", (b.get_x() + b.get_width() / 2, h), ha="center",
                        va="bottom", fontsize=8)
    ax.set_xticks(list(x))
    ax.set_xticklabels(labels)
    ax.set_ylabel("GiB/s")
    ax.set_title(f"fastckpt bench: {human_bytes(report['state_bytes'])}, {report['ranks']} "
                 f"rank(s)\n{report['target']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
    return path


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--worker":
        sys.exit(worker_main(sys.argv[2:]))
    sys.exit("usage: fastckpt bench ... (this module's entry point is for the bench's workers)")
