"""The report of ``fastckpt bench``: medians per contender, the grace window the state needs,
the record the engine reads, and the chart. Torch-free (matplotlib only for the chart)."""

from __future__ import annotations

import io
import json
import math
import os
import sys
import time

from . import common
from .record import BENCH_FILE, BENCH_FORMAT, BENCH_VERSION, is_local, join, local_path

CONTENDERS = ("raw", "fastckpt", "torch", "dcp", "dcp4")
LABELS = {"raw": "raw I/O", "fastckpt": "fastckpt", "torch": "torch.save", "dcp": "DCP",
          "dcp4": "DCP 4 threads"}
PHASES = {"raw": ("raw write", "raw read"), "fastckpt": ("fastckpt save", "fastckpt load"),
          "torch": ("torch save", "torch load"), "dcp": ("dcp save", "dcp load"),
          "dcp4": ("dcp4 save", "dcp4 load")}
STATE_CONTENDERS = ("fastckpt", "torch", "dcp", "dcp4")
#: FileSystemWriter's thread_count per DCP contender (None: DCP's default, 1)
DCP_THREADS = {"dcp": None, "dcp4": 4}
DCP_CONTENDERS = tuple(DCP_THREADS)
#: how ``raw`` was measured: fio (local target, fio installed) or fastckpt's own I/O layer
RAW_SOURCES = {"fio": "fio: sequential O_DIRECT write (+end_fsync) / read, bs 16M, iodepth 8, "
                      "libaio, fio's own runtime, best of its layouts",
               "fastckpt-io": "fastckpt's I/O layer (Storage.write_shard / read_into), "
                              "one file per rank"}
LOAD_METHOD = ("restart: each load in fresh processes (one per rank, a new gloo group) that "
               "build the model and a fresh optimizer (no moments yet); page cache evicted; "
               "only the load timed, barrier to barrier, the slowest rank")
#: where the report and the chart go by default: TARGET/.fastckpt-bench/report.{json,png}
REPORT_DIR = ".fastckpt-bench"
DEFAULT_REPS = 3
DEFAULT_LAYERS = 16
INTERLEAVE = "every contender once per repetition, the order rotated by one each repetition"


def memory_needed(size: int, contenders: tuple[str, ...] | list[str]) -> int:
    """Bytes of memory a run needs, about: the savers' state, fastckpt's staging buffer (kept
    for the whole run) and, during a turn, the fresh loaders' state (plus torch.load's copy of
    it) or the raw I/O buffer."""
    c = set(contenders)
    has_state = bool(c & set(STATE_CONTENDERS))
    state = 1.0 if has_state else 0.0
    staging = 1.0 if "fastckpt" in c else 0.0
    loaders = (2.0 if "torch" in c else 1.0) if has_state else 0.0
    raw = 1.0 if "raw" in c else 0.0
    return int(round(size * (state + staging + max(loaders, raw) + 0.1)))


def report_paths(target: str) -> tuple[str, str]:
    """The default report and chart of a target: ``TARGET/.fastckpt-bench/report.json`` and
    ``report.png`` (next to the engine's record)."""
    d = join(target.rstrip("/") or "/", REPORT_DIR)
    return join(d, "report.json"), join(d, "report.png")


def write_output(dest: str, data: bytes) -> tuple[str, bool]:
    """Write ``data`` to ``dest`` (a local path or a URL) atomically, parents created; return
    (where it went, whether an existing file was replaced)."""
    from ..storage import open_storage
    if is_local(dest):
        p = os.path.abspath(local_path(dest))
        replaced = os.path.exists(p)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        open_storage(os.path.dirname(p)).publish(p, data)
        return p, replaced
    parent, _, name = dest.rstrip("/").rpartition("/")
    st = open_storage(parent)
    path = st.join(name)
    replaced = st.size(path) is not None
    st.publish(path, data)
    return dest, replaced


def write_record(doc: dict, target: str, out: str | None = None) -> str:
    """Write the engine-readable record atomically; return where it went."""
    data = (json.dumps(doc, indent=1) + "\n").encode()
    return write_output(out or join(target, BENCH_FILE), data)[0]


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


def summarize(raw: dict, *, state_size: int | None = None, step_drain_s: float = 30.0,
              barrier_s: float = 10.0, safety_fraction: float = 0.25,
              safety_min_s: float = 30.0) -> dict:
    """Turn :func:`run_bench`'s measurements into the report: per contender the medians over
    the repetitions (``write_s``/``read_s`` and the bandwidths derived from them) and every
    sample, ratios, the grace window, provenance."""
    import platform
    import socket

    from .. import __version__
    from ..storage.native import native_error
    per_rank = raw["per_rank"]
    r0 = per_rank[0]

    def samples(phase: str) -> list[float]:
        """Per repetition, the slowest rank's time (the phases end on a barrier)."""
        cols = [p["times"].get(phase) or [] for p in per_rank]
        n = min(len(c) for c in cols) if cols else 0
        return [max(c[i] for c in cols) for i in range(n)]

    def warm(phase: str) -> float | None:
        vals = [p.get("warmup", {}).get(phase) for p in per_rank]
        return max(vals) if vals and all(v is not None for v in vals) else None

    state_bytes = int(r0.get("state_bytes", raw["size"]))
    raw_bytes = int(r0.get("raw_bytes", raw["size"]))
    rows = []
    raw_info = raw.get("raw") or {}
    loads = r0.get("loads") or []
    for c in raw["contenders"]:
        nb = raw_bytes if c == "raw" else state_bytes
        ws_all, rs_all = samples(PHASES[c][0]), samples(PHASES[c][1])
        ws, rs = common.median(ws_all), common.median(rs_all)
        skipped = r0.get("skipped", {}).get(c)
        rows.append({"name": c, "label": LABELS[c], "bytes": nb, "write_s": ws, "read_s": rs,
                     "write_bytes_per_s": nb / ws if ws else None,
                     "read_bytes_per_s": nb / rs if rs else None, "skipped": skipped,
                     "n": min(len(ws_all), len(rs_all)), "write_s_samples": ws_all,
                     "read_s_samples": rs_all,
                     "warmup_write_s": warm(PHASES[c][0]), "warmup_read_s": warm(PHASES[c][1])})
        if c == "raw":
            rows[-1]["source"] = raw_info.get("source")
            if raw_info.get("source") == "fio":
                rows[-1]["label"] = "raw I/O (fio)"
        elif c in STATE_CONTENDERS:
            mine = [x for x in loads if x.get("contender") == c and x.get("rep") is not None]
            rows[-1].update(
                load_fresh_processes=True,
                load_verified=all(x.get("verified") for x in mine) if mine else None,
                load_setup_s_samples=[max(x["setup_s"]) for x in mine],
                load_process_s_samples=[max(x["process_s"]) for x in mine])
            if c in DCP_THREADS:
                rows[-1]["dcp_thread_count"] = DCP_THREADS[c] or 1
    by = {r["name"]: r for r in rows}
    rawr = by.get("raw")

    def paired(num: list, den: list, scale: float = 1.0) -> float | None:
        """The median over repetitions of num[i] / den[i] x scale (the contenders of one
        repetition ran side by side: a ratio of two medians would pair unlike ones); the
        ratio of the medians when the lists do not line up."""
        pairs = [(a, b) for a, b in zip(num, den) if a and b]
        if pairs and len(num) == len(den):
            return common.median([a / b * scale for a, b in pairs])
        mn, md = common.median([x for x in num if x]), common.median([x for x in den if x])
        return mn / md * scale if mn and md else None

    for r in rows:
        for k in ("write", "read"):
            r[f"{k}_vs_raw"] = None if not rawr else paired(
                rawr[f"{k}_s_samples"], r[f"{k}_s_samples"], r["bytes"] / rawr["bytes"])
    fck = by.get("fastckpt")
    speedup = {}
    if fck and fck["write_s"] and fck["read_s"]:
        for r in rows:
            if r["name"] in ("torch",) + DCP_CONTENDERS and r["write_s"] and r["read_s"]:
                speedup[r["name"]] = {"save": paired(r["write_s_samples"],
                                                     fck["write_s_samples"]),
                                      "load": paired(r["read_s_samples"], fck["read_s_samples"])}
        dcps = [r for r in rows if r["name"] in DCP_CONTENDERS and r["write_s"] and r["read_s"]]
        if dcps:  # against the best DCP of each repetition, phase by phase
            def best(k: str) -> list:
                n = min(len(r[f"{k}_s_samples"]) for r in dcps)
                return [min(r[f"{k}_s_samples"][i] for r in dcps) for i in range(n)]
            bw = min(dcps, key=lambda r: r["write_s"])
            br = min(dcps, key=lambda r: r["read_s"])
            speedup["dcp_best"] = {"save": paired(best("write"), fck["write_s_samples"]),
                                   "load": paired(best("read"), fck["read_s_samples"]),
                                   "save_by": bw["name"], "load_by": br["name"]}
    grace = None
    # the grace window from the slowest repetition's save (a window is sized for the worst)
    slowest = max(fck["write_s_samples"]) if fck and fck["write_s_samples"] else None
    save_bw = slowest and fck["bytes"] / slowest
    if save_bw:
        # the state the window is for: --state-size, else the larger of --size and the
        # synthetic state (its layers' width is rounded down: before 2026-12-06 the window
        # covered 75% of --size at 64 ranks)
        grace = grace_window(int(state_size or max(int(raw.get("size") or 0), state_bytes)),
                             save_bw, step_drain_s=step_drain_s,
                             barrier_s=barrier_s, safety_fraction=safety_fraction,
                             safety_min_s=safety_min_s)
    staged = samples("fastckpt staged")
    if raw.get("warmup", True):  # the warm-up's save was the first of the process
        first = {"save_s": warm("fastckpt save"), "staged_s": warm("fastckpt staged")}
    else:
        fs = samples("fastckpt save")
        first = {"save_s": fs[0] if fs else None, "staged_s": staged[0] if staged else None}
    evicted = [p.get("evicted") for p in per_rank]
    target = raw["target"]
    machine = common.machine_info(local_path(target) if is_local(target) else None)
    machine.update(host=socket.gethostname(), cpus=os.cpu_count(),
                   python=platform.python_version(), platform=platform.platform())
    versions = common.base_versions()
    versions["torch"] = _torch_version() or versions.get("torch")
    return {
        "format": "fastckpt-bench-report", "version": 1, "target": target,
        "measured_unix": raw["started_unix"],
        "measured": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(raw["started_unix"])),
        "elapsed_s": raw.get("elapsed_s"),
        "size_requested": raw["size"], "state_bytes": state_bytes, "raw_bytes": raw_bytes,
        "geometry": r0.get("geometry"),
        "ranks": raw["ranks"], "reps": raw.get("reps", 1), "warmup": raw.get("warmup", False),
        "interleave": INTERLEAVE, "orders": r0.get("orders", []),
        "load_method": raw.get("load"), "loads": loads,
        "raw_source": raw_info.get("source"),
        "raw_source_description": RAW_SOURCES.get(raw_info.get("source") or ""),
        "raw_source_reason": raw_info.get("reason"),
        "fio_version": raw_info.get("fio_version"),
        "raw_fio": r0.get("fio") or [],
        "statistic": "median over the repetitions of the slowest rank's time",
        "rows": rows, "fastckpt_speedup": speedup,
        "fastckpt_staged_s": common.median(staged), "fastckpt_staged_s_samples": staged,
        "fastckpt_first_save": first,
        "cache": ("cold (evicted)" if evicted and all(evicted) else
                  "n/a (fsspec URL)" if all(e is None for e in evicted)
                  else "warm (eviction failed)"),
        "grace": grace,
        "machine": machine, "git": common.git_commit(), "versions": versions,
        "fastckpt_version": __version__, "io_backend": r0.get("io_backend"),
        "native_error": native_error(),
        "torch_version": versions["torch"],
    }


def _torch_version() -> str | None:
    mod = sys.modules.get("torch")  # imported when the bench ran in this process
    return str(mod.__version__) if mod is not None else None


def engine_record(report: dict) -> dict:
    """The small record the engine reads (``ROOT/.fastckpt-bench.json``)."""
    by = {r["name"]: r for r in report["rows"]}

    def bw(name: str, k: str) -> float | None:
        r = by.get(name)
        if r and name == "fastckpt" and k == "write" and r.get("write_s_samples"):
            # the slowest repetition, as the grace window (before 2026-12-06 the median: the
            # trigger planned an emergency save with a typical rate, the window the worst)
            return r["bytes"] / max(r["write_s_samples"])
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
        # additive (readers ignore unknown keys): where raw_write/raw_read come from, and that
        # "load" is a restart load in fresh processes
        "raw_source": report.get("raw_source"), "load_method": "fresh-process restart",
        # the save's compression ("zstd", "auto"; None: plain): a job saving otherwise does not
        # take this record's rates (preempt/budget.py)
        "compression": report.get("compression"),
    }


def render_png(report: dict) -> bytes | None:
    """A bar chart of the median write/save and read/load bandwidth per method (PNG bytes);
    None without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    from ..tools.sizes import human_bytes
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
    ax.set_ylabel("GiB/s (median)")
    ax.set_title(f"fastckpt bench: {human_bytes(report['state_bytes'])}, {report['ranks']} "
                 f"rank(s), {report.get('reps', 1)} rep(s)\n{report['target']}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def write_png(report: dict, path: str) -> str | None:
    """:func:`render_png` written to ``path`` (a local path or a URL); where it went, or None
    without matplotlib."""
    data = render_png(report)
    return None if data is None else write_output(path, data)[0]
