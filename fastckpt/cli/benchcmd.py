"""``fastckpt bench``: measure the storage and print the grace window the state needs."""

from __future__ import annotations

import json
import math
import os

import click

from ..errors import StorageError
from .base import (EXIT_CODES_HELP, EXIT_OK, EXIT_PROBLEM, EXIT_STORAGE, EXIT_USAGE, CliError,
                   _add_row, _echo, _emit_json, _hb, _print_table, _progress, _rate, _set_json,
                   SizeType, _storage, _table, cli)

# ---------------------------------------------------------------------------------- bench

@cli.command(epilog=EXIT_CODES_HELP)
@click.argument("target")
@click.option("--size", type=SizeType(), default="1GiB", show_default=True,
              help="State size to benchmark (model + optimizer, all ranks together).")
@click.option("--ranks", type=click.IntRange(1, 1024), default=1, show_default=True,
              help="Local processes (gloo on 127.0.0.1), each saving its share.")
@click.option("--reps", type=click.IntRange(1, 1000), default=3, show_default=True,
              help="Timed repetitions of every contender, interleaved; medians are reported.")
@click.option("--warmup/--no-warmup", default=True, show_default=True,
              help="An untimed first round of every contender (its fastckpt save is reported "
                   "as a process's first save).")
@click.option("--state-size", type=SizeType(), default=None,
              help="The real job's state size for the grace window (default: --size).")
@click.option("--step-drain", type=float, default=30.0, show_default=True, metavar="S",
              help="Seconds to finish the running training step.")
@click.option("--barrier", type=float, default=10.0, show_default=True, metavar="S",
              help="Seconds for all ranks to reach the checkpoint.")
@click.option("--safety", type=float, default=0.25, show_default=True, metavar="FRACTION",
              help="Safety margin as a fraction of the rest (at least --safety-min).")
@click.option("--safety-min", type=float, default=30.0, show_default=True, metavar="S")
@click.option("--contenders", default=",".join(("raw", "fastckpt", "torch", "dcp", "dcp4")),
              show_default=True, help="Comma list of raw,fastckpt,torch,dcp,dcp4 (dcp4: DCP's "
              "FileSystemWriter with thread_count=4).")
@click.option("--raw", "raw_mode", type=click.Choice(["auto", "fio", "fastckpt-io"]),
              default="auto", show_default=True,
              help="How the raw I/O limit is measured: fio on a local TARGET when installed "
                   "(auto; fio: fail without it), else fastckpt's own I/O layer.")
@click.option("--report", default=None, metavar="PATH",
              help="Where to write the full JSON report ('' to skip) "
                   "[default: TARGET/.fastckpt-bench/report.json].")
@click.option("--png", default=None, metavar="PATH",
              help="Where to write the chart ('' to skip; needs matplotlib) [default: beside "
                   "the report, with .png].")
@click.option("--out", default=None, help="Where to write the bandwidth record the engine "
              "reads [default: TARGET/.fastckpt-bench.json].")
@click.option("--no-record", is_flag=True, help="Do not write the engine's bandwidth record.")
@click.option("--create", is_flag=True, help="Create TARGET if it does not exist (otherwise a "
              "missing TARGET is an error).")
@click.option("--keep-files", is_flag=True, help="Leave the benchmark's files under TARGET.")
@click.option("--force", is_flag=True, help="Run even if memory or disk looks too small.")
@click.option("--compression", type=click.Choice(["none", "zstd", "auto"]), default="none",
              show_default=True, help="fastckpt's compression setting for its saves (the "
              "synthetic state is random-initialised: weights of a trained model compress "
              "more, see docs/benchmarks.md).")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def bench(target: str, size: int, ranks: int, reps: int, warmup: bool, state_size: int | None,
          step_drain: float, barrier: float, safety: float, safety_min: float, contenders: str,
          raw_mode: str, report: str | None, png: str | None, out: str | None, no_record: bool,
          create: bool, keep_files: bool, force: bool, compression: str, as_json: bool) -> int:
    """Benchmark checkpoint I/O on TARGET (a path or URL) and size the preemption window.

    Measures the raw write/read limit (fio on a local TARGET when installed, else fastckpt's
    I/O layer), fastckpt save/load of a synthetic model + Adam state of --size, and
    torch.save and DCP (default threads and 4 threads) on the same state: a warm-up round of
    saves, then --reps repetitions with the contenders interleaved (the order rotated each
    time). Every load is a restart: --ranks fresh processes build the model and a fresh
    optimizer, then load from a cold page cache. Prints a table of medians with ratios
    (fastckpt against the best DCP of the run), writes the JSON report and a PNG chart
    (TARGET/.fastckpt-bench/), then the grace window the job needs

    \b
      T_grace >= state/save_bandwidth + step drain + barrier + safety
      safety   = max(--safety-min, --safety x (the rest))

    with the matching Slurm --signal lead time and Kubernetes terminationGracePeriodSeconds.
    The measured bandwidths go to TARGET/.fastckpt-bench.json (or --out) for the engine.
    TARGET must exist (or pass --create). Needs about 4x --size of free memory and 1x of free
    space on TARGET.
    """
    _set_json(as_json)
    from ..bench import storage as B
    cont = tuple(c.strip() for c in contenders.split(",") if c.strip())
    bad = set(cont) - set(B.CONTENDERS)
    if bad or not cont:
        raise click.BadParameter(f"unknown {sorted(bad)}; choose from {','.join(B.CONTENDERS)}",
                                 param_hint="--contenders")
    for name, v in (("--safety", safety), ("--step-drain", step_drain), ("--barrier", barrier),
                    ("--safety-min", safety_min)):  # (NaN passed `< 0` and dropped the window)
        if not math.isfinite(v) or v < 0:
            raise click.BadParameter(f"must be a number >= 0, got {v}", param_hint=name)
    if ranks > 1 and target.startswith("memory://"):
        raise click.BadParameter("memory:// lives in one process; --ranks > 1 needs storage "
                                 "the rank processes share", param_hint="--ranks")
    target = target.rstrip("/") or "/"
    if raw_mode == "fio" and "raw" in cont:
        from ..bench import fio
        if not B.is_local(target):
            raise click.BadParameter("fio measures local paths only (the target is a URL)",
                                     param_hint="--raw")
        if fio.fio_version() is None:
            raise click.BadParameter(f"fio is not installed ({fio.FIO!r} not found; set $FIO)",
                                     param_hint="--raw")
    if B.is_local(target):
        p = B.local_path(target)
        if not os.path.exists(p) and not create:
            raise CliError(f"{target} does not exist", EXIT_USAGE,
                           hint="check the path; create it, or pass --create to let the "
                                "benchmark create it")
        if os.path.exists(p) and not os.path.isdir(p):
            raise CliError(f"cannot benchmark {target}: not a directory", EXIT_STORAGE)
    need = B.memory_needed(size, cont)
    avail = B.mem_available()
    if avail is not None and need > avail and not force:
        raise CliError(f"--size {_hb(size)} needs about {_hb(need)} of free memory, "
                       f"{_hb(avail)} is available", EXIT_USAGE,
                       hint="use a smaller --size (and --state-size for the real one), "
                            "or --force")
    if B.is_local(target) and not force:
        import shutil
        probe = os.path.abspath(B.local_path(target))
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        free = shutil.disk_usage(probe).free
        if free < size * 1.05:
            raise CliError(f"{target} has {_hb(free)} free, the benchmark needs about "
                           f"{_hb(size * 1.05)}", EXIT_USAGE, hint="use a smaller --size or "
                           "--force")
    _storage(target)  # a clear error for a missing fsspec backend
    default_report, default_png = B.report_paths(target)
    report_to = default_report if report is None else report
    if png is None:
        png_to = (os.path.splitext(report_to)[0] + ".png") if report else default_png
    else:
        png_to = png
    notes: list[str] = []
    with _progress() as prog:
        task = prog.add_task("starting", total=None) if prog else None

        def emit(ev: dict) -> None:
            if prog is None:
                return
            rep = ev.get("rep")
            when = "" if "reps" not in ev else (
                "warm-up" if rep is None else f"rep {rep + 1}/{ev['reps']}")
            if ev.get("event") == "start":
                prog.update(task, description=f"{when} {ev['phase']}".strip())
            elif ev.get("event") == "end":
                prog.console.print(f"  {when:<9} {ev['phase']:<14} {ev['seconds']:8.2f} s  "
                                   f"{_rate(ev.get('bytes'), ev.get('seconds')):>12}",
                                   highlight=False, markup=False)
        try:
            raw = B.run_bench(target, size, ranks=ranks, contenders=cont, reps=reps,
                              warmup=warmup, keep_files=keep_files, create=create, emit=emit,
                              raw=raw_mode,  # (before 2026-12-06 --compression was dropped)
                              compression=None if compression == "none" else compression)
        except B.BenchError as e:
            raise CliError(f"benchmark failed: {e}", EXIT_PROBLEM) from None
        except FileNotFoundError as e:  # removed meanwhile
            raise CliError(str(e), EXIT_USAGE, hint="pass --create to create it") from None
        except NotADirectoryError as e:
            raise CliError(f"cannot benchmark {target}: {e}", EXIT_STORAGE) from None
    rep = B.summarize(raw, state_size=state_size, step_drain_s=step_drain, barrier_s=barrier,
                      safety_fraction=safety, safety_min_s=safety_min)
    rep["compression"] = raw.get("compression")
    if state_size and state_size > 8 * size:  # (a drive's write cache, the server's memory)
        notes.append(f"note: the window for --state-size {_hb(state_size)} is scaled up from "
                     f"a {_hb(size)} run, {state_size / size:.0f}x: a small run can fit a "
                     "drive's or a server's cache; measure with --size near the state a node "
                     "writes")
    bad_loads = [r["label"] for r in rep["rows"] if r.get("load_verified") is False]
    if bad_loads:
        notes.append(f"WARNING: the state loaded by {', '.join(bad_loads)} differs from the "
                     "saved one (see loads[].mismatched in the report)")
    files: dict[str, str | None] = {"report": None, "png": None, "record": None}
    rep["files"] = files
    own = B.join(target, B.REPORT_DIR)

    def where(dest: str) -> str:
        return os.path.abspath(B.local_path(dest)) if B.is_local(dest) else dest

    def put(kind: str, dest: str, data: bytes, what: str) -> None:
        try:
            files[kind], replaced = B.write_output(dest, data)
        except (StorageError, OSError) as e:
            files[kind] = None
            notes.append(f"note: could not write {what} to {dest}: {e}")
            return
        ours = (where(dest).startswith(where(own) + "/")
                or where(dest) == where(B.join(target, B.BENCH_FILE)))
        if replaced and not ours:  # a file the user may care about
            notes.append(f"note: replaced the existing file {files[kind]}")
    if png_to:
        data = B.render_png(rep)
        if data is None:
            notes.append("note: no PNG chart: matplotlib is not installed "
                         "(pip install matplotlib)")
        else:
            put("png", png_to, data, "the chart")
    if not no_record and rep.get("grace") is None and "fastckpt" not in cont:
        notes.append("note: no bandwidth record written: fastckpt was not measured (a record "
                     "without it would replace the grace window of an earlier run)")
    elif not no_record:
        put("record", out or B.join(target, B.BENCH_FILE),
            (json.dumps(B.engine_record(rep), indent=1) + "\n").encode(), "the bandwidth record")
    rep["notes"] = notes
    if report_to:  # last: it lists the other files (and itself)
        files["report"] = where(report_to)
        put("report", report_to, (json.dumps(rep, indent=1, default=str) + "\n").encode(),
            "the report")
    if as_json:
        _emit_json(rep)
    else:
        _print_bench(rep)
    for ln in notes:
        _echo(ln, err=True)
    return EXIT_OK


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v else "-"


def _print_bench(rep: dict) -> None:
    gib = float(1 << 30)
    _echo(f"fastckpt bench: {rep['target']}  state {_hb(rep['state_bytes'])}, {rep['ranks']} "
          f"rank(s), I/O backend {rep.get('io_backend') or '-'}, page cache {rep['cache']}"
          f", compression {rep.get('compression') or 'none'}")
    n = rep.get("reps", 1)
    warm = "after a warm-up round of saves" if rep.get("warmup") else "no warm-up"
    _echo(f"medians of {n} repetition{'s' if n != 1 else ''}, contenders interleaved (order "
          f"rotated each repetition), {warm}")
    if any(r.get("load_fresh_processes") for r in rep["rows"]):
        if str(rep.get("load_method")).startswith("restart"):
            _echo(f"loads: restarts, in {rep['ranks']} fresh process(es) per load that build "
                  "the model and a fresh optimizer; only the load is timed")
        else:
            _echo(f"loads: {rep.get('load_method')}")
    src = rep.get("raw_source")
    if src == "fio":
        _echo(f"raw I/O: {rep.get('fio_version') or 'fio'}, sequential O_DIRECT, fio's own "
              "runtime, best of its layouts (1 or 2 files, preallocated or not)")
    elif src:
        _echo(f"raw I/O: fastckpt's I/O layer (not fio: {rep.get('raw_source_reason')})")
    t = _table("METHOD", "WRITE/SAVE", "GiB/s", "VS RAW", "READ/LOAD", "GiB/s", "VS RAW")
    for r in rep["rows"]:
        if r.get("skipped"):
            _add_row(t, r["label"], "skipped", "", "", "", "", r["skipped"][:60])
            continue
        _add_row(t, r["label"],
                  f"{r['write_s']:.2f} s" if r["write_s"] else "-",
                  f"{r['write_bytes_per_s'] / gib:.2f}" if r["write_bytes_per_s"] else "-",
                  _x(r["write_vs_raw"]),
                  f"{r['read_s']:.2f} s" if r["read_s"] else "-",
                  f"{r['read_bytes_per_s'] / gib:.2f}" if r["read_bytes_per_s"] else "-",
                  _x(r["read_vs_raw"]))
    _print_table(t)
    names = {"torch": "torch.save", "dcp": "DCP (default, 1 thread)", "dcp4": "DCP (4 threads)"}
    for name, sp in rep["fastckpt_speedup"].items():
        if name == "dcp_best":
            continue
        _echo(f"fastckpt vs {names.get(name, name)}: save {sp['save']:.2f}x, load "
              f"{sp['load']:.2f}x (>1: fastckpt is faster)")
    best = rep["fastckpt_speedup"].get("dcp_best")
    if best:
        short = {"dcp": "default", "dcp4": "4 threads"}
        _echo(f"fastckpt vs the best DCP: save {best['save']:.2f}x (DCP "
              f"{short.get(best['save_by'], best['save_by'])}), load {best['load']:.2f}x (DCP "
              f"{short.get(best['load_by'], best['load_by'])})")
    if rep.get("fastckpt_staged_s") is not None:
        _echo(f"training blocked by a fastckpt save (staging): {rep['fastckpt_staged_s']:.2f} s")
    first = rep.get("fastckpt_first_save") or {}
    if first.get("save_s"):
        _echo(f"first fastckpt save of a process (allocates the staging buffer): "
              f"{first['save_s']:.2f} s, of which staging {first['staged_s']:.2f} s")
    g = rep.get("grace")
    if g and g["seconds"]:
        _echo("")
        _echo(f"Grace window for a {_hb(g['state_bytes'])} state (fastckpt save at "
              f"{_hb(g['save_bytes_per_s'])}/s):")
        _echo(f"  T_grace >= {g['write_s']:.2f} s write + {g['step_drain_s']:.0f} s step drain + "
              f"{g['barrier_s']:.0f} s barrier + {g['safety_s']:.0f} s safety = {g['seconds']} s")
        _echo(f"  Slurm:      #SBATCH --signal=USR1@{g['seconds']}   (B:USR1@{g['seconds']} when "
              "the batch script itself runs training; for preemption, GraceTime >= "
              f"{g['seconds']} s)")
        _echo(f"  Kubernetes: terminationGracePeriodSeconds: {g['seconds']}")
        _echo(f"  the ranks:  FASTCKPT_GRACE_S={g['seconds']} (or FASTCKPT_SIGNAL_GRACE_S="
              f"\"SIGUSR1={g['seconds']},SIGTERM=<KillWait>\"): without it they assume the "
              "platform's default; `fastckpt slurm` / `fastckpt k8s` set it for you")
    f = rep.get("files", {})
    wrote = [f"{label} {f[k]}" for k, label in (("report", "report"), ("png", "chart"),
                                                  ("record", "record")) if f.get(k)]
    if wrote:
        _echo("wrote " + ", ".join(wrote))


