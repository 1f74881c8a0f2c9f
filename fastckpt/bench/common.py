"""The benchmark library shared by ``fastckpt bench`` and the scripts in benchmarks/.

Torch-free at import (and in every function): the driver of a benchmark stays small, so it
neither perturbs the page cache and CPU of the measured processes nor slows the CLI's start.

* sizes: :func:`parse_size` / :func:`human_bytes` (re-exported from :mod:`fastckpt.tools.sizes`,
  the one parser and printer: ``4GB`` = 4x10^9, ``4G`` = ``4GiB`` = 2^32);
* provenance: :func:`machine_info`, :func:`git_commit`, :func:`base_versions`, :func:`utc_now`;
* page cache: :func:`drop_caches` (the whole machine, root) and :func:`evict` (given files,
  ``posix_fadvise(DONTNEED)``, no root); :func:`mem_available`;
* measuring: :class:`OpMeter` (wall / CPU / peak RSS around one operation);
* processes: :func:`run_child` / :func:`run_children` (fresh processes with a JSON payload in
  and a JSON result out), :func:`child_env`;
* fio: :func:`run_fio` / :func:`parse_fio_json`;
* procedure and results: :func:`rotations` (interleaved order per repetition),
  :func:`median`, :func:`summarize`, :func:`format_table`, :func:`write_json`.

Functions here are thread-safe unless they say otherwise (:class:`OpMeter` instances are not
shared between threads).
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import re
import resource
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from ..tools.sizes import human_bytes, parse_size

__all__ = [
    "KiB", "MiB", "GiB", "parse_size", "human_bytes", "utc_now", "mount_of", "machine_info",
    "git_commit", "source_checkout", "pkg_version", "base_versions", "child_env", "drop_caches",
    "can_drop_caches", "evict", "mem_available", "OpMeter", "reset_peak_rss", "run_child",
    "run_children", "run_gloo_children", "first_failure", "free_port", "FIO", "fio_version",
    "parse_fio_json", "run_fio", "rotations", "median", "summarize", "format_table",
    "write_json", "provenance", "record",
]

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30


# --------------------------------------------------------------------- machine / provenance

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
    """Host, CPU, memory, kernel; with ``bench_dir`` (a local path) its file system, device,
    mount options and the disk's queue settings."""
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


def source_checkout() -> str | None:
    """The git working tree fastckpt is imported from (an editable install or a checkout on
    ``PYTHONPATH``), or None for an installed package."""
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    return top if os.path.exists(os.path.join(top, ".git")) else None


def git_commit(repo: str | None = None) -> dict[str, Any]:
    """HEAD commit and dirty flag of ``repo`` (default: fastckpt's own checkout); never raises
    (no checkout, no commits, no git: ``commit`` None and an ``error``)."""
    out: dict[str, Any] = {"commit": None, "dirty": None}
    repo = repo or source_checkout()
    if repo is None:
        out["error"] = "fastckpt is not imported from a git checkout"
        return out
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
    """python, torch (from the package metadata: torch is not imported), fastckpt, fio."""
    from .. import __version__
    return {
        "python": sys.version.split()[0],
        "python_executable": sys.executable,
        "torch": pkg_version("torch"),
        "fastckpt": __version__,
        "fio": fio_version(),
    }


def provenance(repo: str, bench_dir: str | None = None) -> dict[str, Any]:
    """What every benchmark record carries: the date, the commit, the machine, the versions."""
    return {"date_utc": utc_now(), "git": git_commit(repo), "machine": machine_info(bench_dir),
            "versions": base_versions()}


def record(path: str, benchmark: str, repo: str, **fields: Any) -> int:
    """Write a benchmark's JSON record (its name, :func:`provenance`, ``fields``) to ``path``,
    print where; 0 (the script's exit status)."""
    from .stats import write_json
    print("JSON:", write_json(path, {"benchmark": benchmark, **provenance(repo), **fields}))
    return 0


def child_env(path: str | None = None) -> dict[str, str]:
    """Environment for child processes: ``path`` (default: the directory fastckpt is imported
    from) first on ``PYTHONPATH``, so that children import the same fastckpt."""
    env = dict(os.environ)
    first = path or os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pp = env.get("PYTHONPATH")
    env["PYTHONPATH"] = first + (os.pathsep + pp if pp else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


# ------------------------------------------------------------------------------ page cache

def drop_caches(required: bool = False) -> bool:
    """``sync; echo 1 > /proc/sys/vm/drop_caches`` (the whole machine). Returns False if not
    permitted (non-root) unless ``required``, in which case it raises RuntimeError."""
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


def evict(path: str) -> bool:
    """Drop a local file's (or a directory tree's) pages from the page cache: fdatasync, then
    ``posix_fadvise(DONTNEED)``; no root needed. True if every file was evicted."""
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


def mem_available() -> int | None:
    """``MemAvailable`` of /proc/meminfo in bytes; None where there is none."""
    m = re.search(r"^MemAvailable:\s*(\d+)\s*kB", _read("/proc/meminfo") or "", re.M)
    return int(m.group(1)) * KiB if m else None


# ------------------------------------------------------------------------------ per-op meter

def _status_kib(field_name: str) -> int | None:
    text = _read("/proc/self/status") or ""
    m = re.search(rf"^{field_name}:\s*(\d+)\s*kB", text, re.M)
    return int(m.group(1)) if m else None


def reset_peak_rss() -> bool:
    """Reset the process's peak RSS (VmHWM) to its current RSS (Linux >= 4.0); False if
    refused."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@dataclass
class OpMeter:
    """Measure one operation inside the process doing it (a context manager).

    CPU = getrusage(RUSAGE_SELF) (all threads) + getrusage(RUSAGE_CHILDREN)
    (helper processes that were waited for) deltas.  Peak RSS delta = VmHWM
    after the operation minus VmRSS right before it, with VmHWM reset just
    before the operation (falls back to ru_maxrss if the reset is refused).
    """

    result: dict[str, Any] = field(default_factory=dict)

    def __enter__(self) -> "OpMeter":
        self._hwm_reset = reset_peak_rss()
        self._rss0_kib = _status_kib("VmRSS")
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


# ------------------------------------------------------------------------- child processes

def child_main(pin: str, pout: str, body: Callable[[dict[str, Any]], dict[str, Any]]) -> int:
    """(a benchmark's child process) ``body(payload read from pin)``, its result dict written
    to ``pout`` with ``"ok": true``; anything raised goes to the parent as ``error`` and
    ``traceback`` instead (exit status 1)."""
    import traceback
    with open(pin) as f:
        payload = json.load(f)
    res: dict[str, Any] = {"ok": False}
    rc = 1
    try:
        res.update(body(payload))
        res["ok"] = True
        rc = 0
    except BaseException as e:  # noqa: BLE001 - report everything to the parent
        res["error"] = f"{type(e).__name__}: {e}".strip()[:1000]
        res["traceback"] = traceback.format_exc()[-4000:]
    with open(pout, "w") as f:
        json.dump(res, f)
    return rc


def run_children(argvs: Sequence[Sequence[str]], payload: dict[str, Any], timeout: float, *,
                 envs: Sequence[dict[str, str]] | None = None,
                 on_line: Callable[[int, str], None] | None = None,
                 fail_grace_s: float = 10.0) -> list[dict[str, Any]]:
    """Run ``argvs[i] + [payload_json_file, result_json_file_i]`` as concurrent processes.

    Each child writes its result dict (with ``"ok": true``) as JSON to its result file. Returns
    the results in order; a child that failed gets ``{"ok": False, "error": ...,
    "output_tail": ...}``. Each result also gets ``child_total``: the child's wall time and
    wait4() rusage (setup included, for reference). ``on_line(i, line)`` is called from a
    reader thread for every line child ``i`` prints (stdout and stderr together). When one
    child fails, the others get ``fail_grace_s`` to finish (they may be waiting on it) before
    they are killed; past ``timeout`` every child still running is killed.
    """
    n = len(argvs)
    with tempfile.TemporaryDirectory(prefix="fastckpt-bench-ipc-") as td:
        pin = os.path.join(td, "in.json")
        outs = [os.path.join(td, f"out{i}.json") for i in range(n)]
        with open(pin, "w") as f:
            json.dump(payload, f)
        t0 = time.perf_counter()
        procs: list[subprocess.Popen] = []
        chunks: list[list[str]] = [[] for _ in range(n)]
        threads = []
        status: list[Any] = [None] * n
        rusage: list[Any] = [None] * n
        walls: list[float | None] = [None] * n
        timed_out = [False] * n

        def pump(i: int, proc: subprocess.Popen) -> None:
            assert proc.stdout is not None
            for line in proc.stdout:
                chunks[i].append(line)
                if len(chunks[i]) > 2000:
                    del chunks[i][:1000]
                if on_line is not None:
                    try:
                        on_line(i, line)
                    except Exception:  # a display problem must not hang the child
                        pass

        try:
            for i, argv in enumerate(argvs):
                env = envs[i] if envs is not None else child_env()
                p = subprocess.Popen(list(argv) + [pin, outs[i]], env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, errors="replace")
                procs.append(p)
                th = threading.Thread(target=pump, args=(i, p), daemon=True)
                th.start()
                threads.append(th)
            deadline = t0 + timeout
            first_fail: float | None = None
            while any(s is None for s in status):
                for i, p in enumerate(procs):
                    if status[i] is None:
                        pid, st, ru = os.wait4(p.pid, os.WNOHANG)
                        if pid:
                            status[i], rusage[i] = st, ru
                            walls[i] = time.perf_counter() - t0
                            if os.waitstatus_to_exitcode(st) != 0 and first_fail is None:
                                first_fail = time.perf_counter()
                now = time.perf_counter()
                kill = now > deadline or (first_fail is not None
                                          and now - first_fail > fail_grace_s)
                if kill:
                    for i, p in enumerate(procs):
                        if status[i] is None:
                            timed_out[i] = now > deadline
                            p.kill()
                            _, status[i], rusage[i] = os.wait4(p.pid, 0)
                            walls[i] = time.perf_counter() - t0
                    break
                time.sleep(0.02)
        finally:
            for i, p in enumerate(procs):  # an exception (Ctrl-C) in here: leave no orphan
                if status[i] is None:
                    p.kill()
                    _, status[i], rusage[i] = os.wait4(p.pid, 0)
        for th in threads:
            th.join(timeout=5)
        results = []
        for i, p in enumerate(procs):
            p.returncode = os.waitstatus_to_exitcode(status[i])
            output = "".join(chunks[i])
            res: dict[str, Any]
            try:
                with open(outs[i]) as f:
                    res = json.load(f)
            except (OSError, ValueError):
                res = {"ok": False}
            if timed_out[i]:
                res = {"ok": False, "error": f"timed out after {timeout:.0f}s"}
            elif p.returncode != 0 and res.get("ok", False):
                res["ok"] = False
            if not res.get("ok", False) and "error" not in res:
                tail = output.strip().splitlines()[-5:]
                res["error"] = f"exit code {p.returncode}: " + " | ".join(tail)
            ru = rusage[i]
            res["child_total"] = {
                "wall_s": walls[i],
                "cpu_user_s": ru.ru_utime if ru else None,
                "cpu_sys_s": ru.ru_stime if ru else None,
                "maxrss_bytes": ru.ru_maxrss * KiB if ru else None,
                "returncode": p.returncode,
            }
            if not res.get("ok", False):
                res["output_tail"] = output[-4000:]
            results.append(res)
        return results


def run_child(argv: Sequence[str], payload: dict[str, Any], timeout: float,
              env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``argv + [payload_json_file, result_json_file]`` in a fresh process; its result
    (see :func:`run_children`)."""
    return run_children([argv], payload, timeout, envs=[env] if env is not None else None)[0]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's store)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_gloo_children(argv: Sequence[str], payload: dict[str, Any], n: int, timeout: float, *,
                      on_line: Callable[[int, str], None] | None = None
                      ) -> list[dict[str, Any]]:
    """:func:`run_children` of ``n`` copies of ``argv``, as the ranks of one process group:
    ``MASTER_ADDR=127.0.0.1``, a fresh ``MASTER_PORT``, ``RANK``/``LOCAL_RANK``,
    ``WORLD_SIZE`` and ``OMP_NUM_THREADS`` (the CPUs shared out) in their environments."""
    port, threads = free_port(), max(1, (os.cpu_count() or 1) // n)
    base = child_env()
    envs = [dict(base, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(r),
                 WORLD_SIZE=str(n), LOCAL_RANK=str(r), OMP_NUM_THREADS=str(threads))
            for r in range(n)]
    return run_children([list(argv)] * n, payload, timeout, envs=envs, on_line=on_line)


def first_failure(results: Sequence[dict[str, Any]]) -> tuple[int, str] | None:
    """(index, error) of the child that failed first in effect: one that lost a peer fails
    with a connection error, so the others are named before it; None when all are ok."""
    errors = {i: str(x.get("error", "failed")) for i, x in enumerate(results) if not x.get("ok")}
    if not errors:
        return None
    real = {i: m for i, m in errors.items() if "Connection" not in m} or errors
    return sorted(real.items())[0]


# fio and the statistics live in their own modules; this is the one import for scripts
from .fio import FIO, fio_version, parse_fio_json, run_fio  # noqa: E402
from .stats import format_table, median, rotations, summarize, write_json  # noqa: E402
