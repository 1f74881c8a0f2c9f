"""Benchmark procedure and results: interleaved order, medians, tables, JSON. Torch-free."""

from __future__ import annotations

import json
import os
import statistics
from typing import Any, Iterable, Sequence

MiB = 1 << 20
GiB = 1 << 30

def rotations(names: Sequence[str], reps: int) -> list[list[str]]:
    """The interleaved order of each repetition: every contender once per repetition, the
    order rotated by one each time (``A B C``, ``B C A``, ``C A B``, ...), so that slow drifts
    of the machine hit every contender alike."""
    names = list(names)
    n = len(names) or 1
    return [names[r % n:] + names[:r % n] for r in range(reps)]


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
                 columns: Sequence[tuple[str, Any, str]]) -> str:
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
    """Write ``obj`` as indented JSON to ``path`` atomically (parents created); the absolute
    path."""
    path = os.path.abspath(path)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False, default=str)
        f.write("\n")
    os.replace(tmp, path)
    return path
