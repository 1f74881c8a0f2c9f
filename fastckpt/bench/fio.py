"""fio, the raw device limit the benchmarks compare against: running it and reading its own
reported runtime (its start-up, ~0.5 s on small VMs, is not I/O), and the best of several
layouts (:func:`best_of_layouts`, ``fastckpt bench``'s raw figure). Torch-free."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import time
from typing import Any, Iterable

FIO = os.environ.get("FIO", "fio")


def fio_version() -> str | None:
    try:
        r = subprocess.run([FIO, "--version"], capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def parse_fio_json(text: str, rw: str) -> dict[str, Any]:
    """Extract time / bytes / CPU of the single job from fio's JSON output.

    fio reports usr_cpu / sys_cpu as percentages of the job's runtime; they are
    converted to CPU seconds here.
    """
    # fio may print warnings before the JSON document
    start = text.find("{")
    data = json.loads(text[start:])
    job = data["jobs"][0]
    d = "write" if "write" in rw else "read"
    io = job[d]
    runtime_ms = io.get("runtime") or job.get("job_runtime")
    job_runtime_ms = job.get("job_runtime", runtime_ms)
    usr = float(job.get("usr_cpu", 0.0)) / 100.0 * job_runtime_ms / 1000.0
    sys_ = float(job.get("sys_cpu", 0.0)) / 100.0 * job_runtime_ms / 1000.0
    return {
        "fio_version": data.get("fio version"),
        "runtime_s": runtime_ms / 1000.0,
        "job_runtime_s": job_runtime_ms / 1000.0,
        "io_bytes": int(io["io_bytes"]),
        "bw_bytes_per_s": float(io["bw_bytes"]),
        "iops": float(io.get("iops", 0.0)),
        "clat_mean_ms": float(io.get("clat_ns", {}).get("mean", 0.0)) / 1e6,
        "usr_cpu_pct": float(job.get("usr_cpu", 0.0)),
        "sys_cpu_pct": float(job.get("sys_cpu", 0.0)),
        "cpu_user_s": usr,
        "cpu_sys_s": sys_,
        "cpu_s": usr + sys_,
        "error": int(job.get("error", 0)),
    }


def run_fio(filename: str, rw: str, size: int, bs: str = "16M", iodepth: int = 8,
            ioengine: str = "libaio", direct: bool = True, end_fsync: bool | None = None,
            extra: Iterable[str] = (), timeout: float = 900, numjobs: int = 1,
            fallocate: str | None = None) -> dict[str, Any]:
    """Run one fio job; return parsed numbers plus the command line and wall time.

    For writes ``end_fsync`` defaults to True so the time is "to durable", like
    the fsync'd contenders (fio includes the final fsync in its runtime).
    ``numjobs`` > 1: that many jobs at once, each on its own file (``filename`` + ``.N``) of
    ``size / numjobs`` bytes, reported as one group (the runtime is the slowest job's, the
    bytes the sum). ``fallocate``: fio's ``--fallocate`` (``none``: no preallocation).
    """
    if end_fsync is None:
        end_fsync = "write" in rw
    if numjobs > 1:
        where = [f"--directory={os.path.dirname(filename) or '.'}",
                 f"--filename_format={os.path.basename(filename)}.$jobnum",
                 f"--numjobs={numjobs}", "--group_reporting", f"--size={size // numjobs}"]
    else:
        where = [f"--filename={filename}", f"--size={size}"]
    cmd = [FIO, f"--name=bench-{rw}", *where, f"--rw={rw}",
           f"--bs={bs}", f"--iodepth={iodepth}", f"--ioengine={ioengine}",
           f"--direct={int(direct)}", "--output-format=json"]
    if fallocate is not None:
        cmd.append(f"--fallocate={fallocate}")
    if end_fsync:
        cmd.append("--end_fsync=1")
    cmd += list(extra)
    t0 = time.perf_counter()
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError) as e:
        return {"ok": False, "error": str(e), "cmd": cmd}
    wall = time.perf_counter() - t0
    if r.returncode != 0:
        return {"ok": False, "cmd": cmd, "wall_total_s": wall,
                "error": f"fio exit {r.returncode}: {r.stderr.strip()[-500:]}"}
    try:
        res = parse_fio_json(r.stdout, rw)
    except (ValueError, KeyError, IndexError) as e:
        return {"ok": False, "cmd": cmd, "error": f"cannot parse fio output: {e}"}
    res.update(ok=res["error"] == 0, cmd=" ".join(cmd), wall_total_s=wall)
    return res


# ------------------------------------------------------------- the best of several layouts

#: the layouts tried for one figure (as benchmarks/bench_saveload.py): (files written at once,
#: fio's --fallocate); reads use the preallocated ones. fio's figure is the best of them.
LAYOUTS = ((1, "native"), (1, "none"), (2, "native"), (2, "none"))
BS = 16 << 20
IODEPTH = 8


#: how ``fastckpt bench`` measures ``raw``: ``auto`` (fio where it works, else fastckpt's I/O
#: layer), ``fio`` (fio or fail), ``fastckpt-io``
RAW_MODES = ("auto", "fio", "fastckpt-io")


def source(mode: str, directory: str | None) -> dict[str, Any]:
    """How the raw limit is measured: ``{"source": "fio" | "fastckpt-io", "reason",
    "fio_version"}``; ``directory``: a local directory on the target (None: the target is a
    URL). ``auto``: fio where a probe write succeeds there (:func:`probe`), else
    ``fastckpt-io`` with the ``reason``; ``fio``: RuntimeError instead of the fallback."""
    if mode not in RAW_MODES:
        raise ValueError(f"raw must be one of {RAW_MODES}")
    if mode == "fastckpt-io":
        return {"source": mode, "reason": "asked for (raw=fastckpt-io)", "fio_version": None}
    why = ("fio measures local paths only (the target is a URL)" if directory is None
           else probe(directory))
    if why is None:
        return {"source": "fio", "reason": None, "fio_version": fio_version()}
    if mode == "fio":
        raise RuntimeError(f"raw=fio: {why}")
    return {"source": "fastckpt-io", "reason": why, "fio_version": fio_version()}


def probe(directory: str, timeout: float = 120) -> str | None:
    """None when fio can write (O_DIRECT, libaio, fsync) in ``directory``, else why not."""
    if fio_version() is None:
        return f"fio is not installed ({FIO!r} not found; set $FIO)"
    d = os.path.join(directory, "fio-probe")
    os.makedirs(d, exist_ok=True)
    try:
        r = run_fio(os.path.join(d, "probe.dat"), "write", 1 << 20, bs="1M", iodepth=1,
                    timeout=timeout)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    return None if r.get("ok") else f"fio failed there: {str(r.get('error'))[-300:]}"


def best_of_layouts(directory: str, nbytes: int, layouts: Iterable[tuple[int, str]] = LAYOUTS,
                    *, bs: int = BS, iodepth: int = IODEPTH,
                    timeout: float = 900) -> dict[str, Any]:
    """fio's best sequential write and read of ``nbytes`` in ``directory`` over ``layouts``.

    Each layout is written (and, when preallocated, evicted from the page cache and read
    back), then removed, so that the disk holds one layout at a time. Times are fio's own
    runtime (several files: the group's, i.e. the slowest job's), scaled to ``nbytes`` where
    fio moved whole blocks more: ``{"write_s", "read_s", "write_layout", "read_layout",
    "layouts": [every run]}``. Raises RuntimeError when no layout could write or read.
    """
    from .common import evict
    tried: list[dict[str, Any]] = []
    for files, falloc in layouts:
        b = bs if nbytes // files >= bs else 1 << 20
        size = -(-nbytes // (b * files)) * b * files  # whole blocks in every file
        d = os.path.join(directory, f"fio-{files}f-{falloc}")
        os.makedirs(d, exist_ok=True)
        try:
            for rw in ("write", "read"):
                if rw == "read":
                    if falloc != "native" or not tried[-1]["ok"]:
                        break
                    evict(d)
                r = run_fio(os.path.join(d, "fio.dat"), rw, size, bs=f"{b >> 20}M",
                            iodepth=iodepth, numjobs=files, timeout=timeout,
                            fallocate=falloc if rw == "write" else None)
                if r.get("ok") and r["io_bytes"] != size:
                    r.update(ok=False, error=f"fio moved {r['io_bytes']} bytes, expected {size}")
                if r.get("ok") and not r["runtime_s"] > 0:
                    r["runtime_s"] = 0.001  # fio reports whole milliseconds
                tried.append({"rw": rw, "layout": f"{files} file(s), fallocate={falloc}",
                              "files": files, "fallocate": falloc, "ok": bool(r.get("ok")),
                              "error": None if r.get("ok") else r.get("error"),
                              **{k: r.get(k) for k in ("runtime_s", "job_runtime_s",
                                                       "io_bytes", "bw_bytes_per_s",
                                                       "wall_total_s", "cmd")}})
        finally:
            shutil.rmtree(d, ignore_errors=True)
    out: dict[str, Any] = {"layouts": tried}
    for rw in ("write", "read"):
        ok = [r for r in tried if r["rw"] == rw and r["ok"]]
        if not ok:
            errs = sorted({str(r["error"]) for r in tried if r["rw"] == rw})
            raise RuntimeError(f"fio could not {rw} in {directory}: "
                               f"{'; '.join(errs) or 'no run'}")
        best = min(ok, key=lambda r: r["runtime_s"] / r["io_bytes"])
        out[f"{rw}_s"] = best["runtime_s"] * nbytes / best["io_bytes"]
        out[f"{rw}_layout"] = best["layout"]
    return out
