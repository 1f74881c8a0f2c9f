"""Shared helpers for the fastckpt benchmarks.

Everything in here is deliberately free of torch imports so that the parent
("driver") process of a benchmark stays small and does not perturb the page
cache / CPU of the measured child processes.

Reusable pieces:

* ``parse_size`` / ``fmt_bytes``          -- "200MiB" <-> bytes
* ``machine_info`` / ``git_commit`` / ``utc_now`` / ``base_versions``
* ``drop_caches``                          -- sync + echo 1 > /proc/sys/vm/drop_caches
* ``OpMeter``                              -- wall / CPU / peak-RSS-delta around one operation
* ``run_child``                            -- run one measured operation in a fresh subprocess
* ``run_fio`` / ``parse_fio_json``         -- fio baseline runner
* ``median`` / ``summarize`` / ``format_table`` / ``write_json``
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Iterable, Sequence

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30

# Single letters are binary, like fio/dd ("16M" == 16 MiB); "MB" is decimal.
_UNITS = {
    "": 1, "b": 1,
    "k": KiB, "kb": 1000, "kib": KiB,
    "m": MiB, "mb": 1000**2, "mib": MiB,
    "g": GiB, "gb": 1000**3, "gib": GiB,
    "t": 1 << 40, "tb": 1000**4, "tib": 1 << 40,
}


# --------------------------------------------------------------------------- sizes


def parse_size(text: str | int) -> int:
    """Parse "1.5GiB", "200MiB", "512M", "1e9" ... into bytes.

    KiB/MiB/GiB and the single letters K/M/G are binary (fio convention);
    KB/MB/GB are decimal.
    """
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m:
        raise ValueError(f"cannot parse size {text!r}")
    num, unit = float(m.group(1)), m.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(f"unknown size unit {m.group(2)!r} in {text!r}")
    return int(num * _UNITS[unit])


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, div in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


# --------------------------------------------------------------------------- machine / provenance


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def mount_of(path: str) -> dict[str, Any]:
    """Longest-prefix match of ``path`` against /proc/self/mounts."""
    real = os.path.realpath(path)
    # the directory may not exist yet: walk up to an existing ancestor
    while not os.path.exists(real) and real != "/":
        real = os.path.dirname(real)
    best: dict[str, Any] = {}
    text = _read("/proc/self/mounts") or ""
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 4:
            continue
        dev, mnt, fstype, opts = parts[:4]
        mnt = mnt.replace("\\040", " ")
        if real == mnt or real.startswith(mnt.rstrip("/") + "/") or mnt == "/":
            if len(mnt) >= len(best.get("mountpoint", "")):
                best = {"device": dev, "mountpoint": mnt, "fstype": fstype,
                        "options": opts}
    return best


def machine_info(bench_dir: str | None = None) -> dict[str, Any]:
    info: dict[str, Any] = {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "arch": platform.machine(),
        "nproc": os.cpu_count(),
    }
    try:
        info["nproc_affinity"] = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        pass
    cpuinfo = _read("/proc/cpuinfo") or ""
    m = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.M)
    info["cpu_model"] = m.group(1).strip() if m else platform.processor() or None
    meminfo = _read("/proc/meminfo") or ""
    m = re.search(r"^MemTotal:\s*(\d+)\s*kB", meminfo, re.M)
    info["mem_total_bytes"] = int(m.group(1)) * KiB if m else None
    if bench_dir is not None:
        mnt = mount_of(bench_dir)
        info["bench_dir"] = os.path.abspath(bench_dir)
        info["fs_type"] = mnt.get("fstype")
        info["fs_device"] = mnt.get("device")
        info["fs_mountpoint"] = mnt.get("mountpoint")
        info["fs_mount_options"] = mnt.get("options")
        dev = mnt.get("device", "")
        if dev.startswith("/dev/"):
            blk = os.path.basename(os.path.realpath(dev))
            base = re.sub(r"p?\d+$", "", blk) if not os.path.exists(
                f"/sys/block/{blk}") else blk
            for key, rel in (("rotational", "queue/rotational"),
                             ("scheduler", "queue/scheduler"),
                             ("discard_max_bytes", "queue/discard_max_bytes")):
                v = _read(f"/sys/block/{base}/{rel}")
                if v is not None:
                    info[f"disk_{key}"] = v.strip()
    return info


def git_commit(repo: str = REPO_ROOT) -> dict[str, Any]:
    """HEAD commit and dirty flag; never raises (repo may have no commits)."""
    out: dict[str, Any] = {"commit": None, "dirty": None}
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True,
                           text=True, timeout=10)
        if r.returncode == 0:
            out["commit"] = r.stdout.strip()
        else:
            out["error"] = (r.stderr.strip().splitlines() or ["git rev-parse failed"])[0]
        r = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           cwd=repo, capture_output=True, text=True, timeout=10)
        if r.returncode == 0:
            out["dirty"] = bool(r.stdout.strip())
    except (OSError, subprocess.SubprocessError) as e:
        out["error"] = str(e)
    return out


def pkg_version(name: str) -> str | None:
    try:
        from importlib import metadata
        return metadata.version(name)
    except Exception:
        return None


def base_versions() -> dict[str, Any]:
    return {
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "torch": pkg_version("torch"),
        "fio": fio_version(),
    }


def child_env() -> dict[str, str]:
    """Environment for child processes: the working tree's packages come first."""
    env = dict(os.environ)
    pp = env.get("PYTHONPATH")
    env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + pp if pp else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# --------------------------------------------------------------------------- page cache


def drop_caches(required: bool = False) -> bool:
    """``sync; echo 1 > /proc/sys/vm/drop_caches``.  Returns False if not permitted
    (non-root) unless ``required`` in which case it raises."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        return True
    except OSError as e:
        if required:
            raise RuntimeError(
                f"cannot drop the page cache ({e}); run as root or pass --no-drop-caches"
            ) from e
        return False


def can_drop_caches() -> bool:
    return os.access("/proc/sys/vm/drop_caches", os.W_OK)


# --------------------------------------------------------------------------- per-op meter


def _status_kib(field_name: str) -> int | None:
    text = _read("/proc/self/status") or ""
    m = re.search(rf"^{field_name}:\s*(\d+)\s*kB", text, re.M)
    return int(m.group(1)) if m else None


def _reset_peak_rss() -> bool:
    # Linux >= 4.0: writing 5 to clear_refs resets VmHWM (the peak RSS) to the current RSS.
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _cpu_s(ru: resource.struct_rusage) -> float:
    return ru.ru_utime + ru.ru_stime


@dataclass
class OpMeter:
    """Measure one operation inside the process doing it.

    CPU = getrusage(RUSAGE_SELF) (all threads) + getrusage(RUSAGE_CHILDREN)
    (helper processes that were waited for) deltas.  Peak RSS delta = VmHWM
    after the operation minus VmRSS right before it, with VmHWM reset just
    before the operation (falls back to ru_maxrss if the reset is refused).
    """

    result: dict[str, Any] = field(default_factory=dict)

    def __enter__(self) -> "OpMeter":
        self._hwm_reset = _reset_peak_rss()
        self._rss0_kib = _status_kib("VmRSS")
        self._maxrss0_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        self._self0 = resource.getrusage(resource.RUSAGE_SELF)
        self._child0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        t1 = time.perf_counter()
        self1 = resource.getrusage(resource.RUSAGE_SELF)
        child1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        hwm_kib = _status_kib("VmHWM") if self._hwm_reset else None
        if hwm_kib is None:  # fallback: lifetime peak, only meaningful if it grew
            hwm_kib = max(self1.ru_maxrss, self._rss0_kib or 0)
        rss0 = self._rss0_kib or 0
        self.result.update(
            wall_s=t1 - self._t0,
            cpu_user_s=(self1.ru_utime - self._self0.ru_utime)
            + (child1.ru_utime - self._child0.ru_utime),
            cpu_sys_s=(self1.ru_stime - self._self0.ru_stime)
            + (child1.ru_stime - self._child0.ru_stime),
            rss_before_bytes=rss0 * KiB,
            peak_rss_bytes=hwm_kib * KiB,
            peak_rss_delta_bytes=max(0, hwm_kib - rss0) * KiB,
            peak_rss_method="VmHWM-reset" if self._hwm_reset else "ru_maxrss",
            minflt=self1.ru_minflt - self._self0.ru_minflt,
            majflt=self1.ru_majflt - self._self0.ru_majflt,
            inblock=self1.ru_inblock - self._self0.ru_inblock,
            oublock=self1.ru_oublock - self._self0.ru_oublock,
        )
        self.result["cpu_s"] = self.result["cpu_user_s"] + self.result["cpu_sys_s"]


# --------------------------------------------------------------------------- subprocess runner


def run_child(argv: Sequence[str], payload: dict[str, Any], timeout: float,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``argv + [payload_json_file, result_json_file]`` in a fresh process.

    The child writes its measurement dict as JSON to the result file.  Returns
    that dict (or ``{"ok": False, "error": ...}``), plus ``child_total`` with the
    wall time and wait4() rusage of the whole child (setup included, for reference).
    """
    with tempfile.TemporaryDirectory(prefix="fastckpt-bench-ipc-") as td:
        pin = os.path.join(td, "in.json")
        pout = os.path.join(td, "out.json")
        with open(pin, "w") as f:
            json.dump(payload, f)
        t0 = time.perf_counter()
        proc = subprocess.Popen(list(argv) + [pin, pout], env=env or child_env(),
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
        output_chunks: list[str] = []
        import threading

        def _pump() -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                output_chunks.append(line)

        th = threading.Thread(target=_pump, daemon=True)
        th.start()
        deadline = t0 + timeout
        status = ru = None
        timed_out = False
        while True:
            pid, status, ru = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                timed_out = True
                proc.kill()
                _, status, ru = os.wait4(proc.pid, 0)
                break
            time.sleep(0.02)
        proc.returncode = os.waitstatus_to_exitcode(status)
        th.join(timeout=5)
        wall = time.perf_counter() - t0
        output = "".join(output_chunks)
        res: dict[str, Any]
        try:
            with open(pout) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {"ok": False}
        if timed_out:
            res = {"ok": False, "error": f"timed out after {timeout:.0f}s"}
        elif proc.returncode != 0 and res.get("ok", False):
            res["ok"] = False
        if not res.get("ok", False) and "error" not in res:
            tail = output.strip().splitlines()[-5:]
            res["error"] = f"exit code {proc.returncode}: " + " | ".join(tail)
        res["child_total"] = {
            "wall_s": wall,
            "cpu_user_s": ru.ru_utime if ru else None,
            "cpu_sys_s": ru.ru_stime if ru else None,
            "maxrss_bytes": ru.ru_maxrss * KiB if ru else None,
            "returncode": proc.returncode,
        }
        if not res.get("ok", False):
            res["output_tail"] = output[-4000:]
        return res


# --------------------------------------------------------------------------- fio


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
            extra: Iterable[str] = (), timeout: float = 900) -> dict[str, Any]:
    """Run one fio job; return parsed numbers plus the command line and wall time.

    For writes ``end_fsync`` defaults to True so the time is "to durable", like
    the fsync'd contenders (fio includes the final fsync in its runtime).
    """
    if end_fsync is None:
        end_fsync = "write" in rw
    cmd = [FIO, f"--name=bench-{rw}", f"--filename={filename}", f"--rw={rw}",
           f"--bs={bs}", f"--iodepth={iodepth}", f"--ioengine={ioengine}",
           f"--direct={int(direct)}", f"--size={size}", "--output-format=json"]
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


# --------------------------------------------------------------------------- statistics / table


def median(xs: Iterable[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return statistics.median(vals) if vals else None


def summarize(samples: list[dict[str, Any]], baseline: str | None = "fio",
              keys: tuple[str, str] = ("contender", "op")) -> list[dict[str, Any]]:
    """Group samples (dicts with keys[0], keys[1], rep, ok, seconds, bytes, cpu_s,
    peak_rss_delta_bytes) and compute medians.

    ``x_baseline`` is the median over repetitions of the per-repetition
    throughput ratio contender/baseline (paired by rep and op) -- robust to
    slow drifts of a noisy machine; ``x_baseline_of_medians`` is the ratio of
    the median throughputs.
    """
    groups: dict[tuple[str, str], list[dict[str, Any]]] = {}
    order: list[tuple[str, str]] = []
    for s in samples:
        k = (s[keys[0]], s[keys[1]])
        if k not in groups:
            groups[k] = []
            order.append(k)
        groups[k].append(s)

    def tput(s: dict[str, Any]) -> float | None:
        if not s.get("ok") or not s.get("seconds"):
            return None
        return s["bytes"] / s["seconds"]

    base_by_rep: dict[tuple[str, int], float | None] = {}
    if baseline is not None:
        for s in samples:
            if s[keys[0]] == baseline:
                base_by_rep[(s[keys[1]], s["rep"])] = tput(s)

    rows = []
    for k in order:
        ss = groups[k]
        ok = [s for s in ss if s.get("ok")]
        secs = [s["seconds"] for s in ok]
        row: dict[str, Any] = {
            keys[0]: k[0], keys[1]: k[1], "n": len(ok), "n_failed": len(ss) - len(ok),
            "median_s": median(secs),
            "min_s": min(secs) if secs else None,
            "max_s": max(secs) if secs else None,
            "median_bytes": median(s["bytes"] for s in ok),
            "median_MiBps": median((tput(s) or 0) / MiB for s in ok) if ok else None,
            "median_cpu_s": median(s.get("cpu_s") for s in ok),
            "median_cpu_s_per_GiB": median(
                s["cpu_s"] / (s["bytes"] / GiB) for s in ok if s.get("cpu_s") is not None
            ),
            "median_peak_rss_delta_bytes": median(
                s.get("peak_rss_delta_bytes") for s in ok),
            "errors": sorted({s.get("error", "?") for s in ss if not s.get("ok")}),
        }
        if baseline is not None:
            ratios = []
            for s in ok:
                b = base_by_rep.get((k[1], s["rep"]))
                t = tput(s)
                if b and t:
                    ratios.append(t / b)
            row["x_baseline"] = median(ratios)
        rows.append(row)
    if baseline is not None:
        base_med = {r[keys[1]]: r["median_MiBps"] for r in rows if r[keys[0]] == baseline}
        for r in rows:
            b = base_med.get(r[keys[1]])
            r["x_baseline_of_medians"] = (r["median_MiBps"] / b
                                          if b and r["median_MiBps"] else None)
    return rows


def _fmt(v: Any, spec: str) -> str:
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return format(v, spec)


def format_table(rows: list[dict[str, Any]],
                 columns: Sequence[tuple[str, str, str]]) -> str:
    """columns: (header, key, format-spec).  A key may be callable(row) -> value."""
    cells = [[h for h, _, _ in columns]]
    for r in rows:
        line = []
        for _, key, spec in columns:
            v = key(r) if callable(key) else r.get(key)
            line.append(_fmt(v, spec))
        cells.append(line)
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    out = []
    for n, line in enumerate(cells):
        out.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                             for i, (c, w) in enumerate(zip(line, widths))))
        if n == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)


def write_json(path: str, obj: Any) -> str:
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path
