"""The record ``fastckpt bench`` leaves in a root (``ROOT/.fastckpt-bench.json``): the measured
bandwidths the preemption trigger uses before its first save was measured. Torch-free."""

from __future__ import annotations

import json
import os
import stat

BENCH_FILE = ".fastckpt-bench.json"
BENCH_FORMAT = "fastckpt-bench"
BENCH_VERSION = 1


def is_local(url: str) -> bool:
    return "://" not in url or url.startswith("file://")


def local_path(url: str) -> str:
    return url[len("file://"):] if url.startswith("file://") else url


def join(url: str, *parts: str) -> str:
    return "/".join([url.rstrip("/"), *parts])


def read_bench(root: str, path: str | None = None) -> dict | None:
    """The engine-readable bench record of a root (``ROOT/.fastckpt-bench.json``) or of an
    explicit ``path``; None when absent or not a valid record. Keys: see docs/cli.md."""
    target = path or join(root, BENCH_FILE)
    try:
        if is_local(target):  # a regular file only, never a blocked open (a FIFO there
            # held the emergency path's estimate for good before 2026-12-06)
            fd = os.open(local_path(target), os.O_RDONLY | os.O_NONBLOCK)
            with os.fdopen(fd, "rb") as f:
                st = os.fstat(fd)
                if not stat.S_ISREG(st.st_mode) or st.st_size > 1 << 20:
                    return None
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


def measured_grace(root: str) -> tuple[int, str] | None:
    """(grace window in seconds, where it comes from) from ``fastckpt bench ROOT``'s record, for
    the job scripts (``fastckpt slurm``, ``fastckpt k8s``); None when there is none."""
    rec = read_bench(root) or {}
    g = rec.get("grace") if isinstance(rec.get("grace"), dict) else {}
    if not isinstance(g.get("seconds"), int) or g["seconds"] <= 0:
        return None
    return g["seconds"], (f"fastckpt bench record in {root} ({rec.get('measured', 'unknown date')}"
                          f": {g.get('state_bytes')} bytes at {g.get('save_bytes_per_s')} B/s)")
