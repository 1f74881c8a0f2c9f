"""fio, the raw device limit the benchmarks compare against: running it and reading its own
reported runtime (its start-up, ~0.5 s on small VMs, is not I/O). Torch-free."""

from __future__ import annotations

import json
import os
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
