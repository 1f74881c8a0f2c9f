"""``fastckpt drill [OUT_DIR]``: preempt a real training job on purpose, per scenario, and
check what fastckpt promises (one stop step, the commit in the window, the exit codes, a
bit-exact restart). The work is done by :mod:`fastckpt.drill`, usable from Python."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile

import click

from ..drill import (DEFAULT_SCENARIOS, LAUNCHERS, MATRIX_HEADERS, DrillOptions, failures,
                     matrix_rows, notes, run_drill, write_timeline_png)
from .base import (EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, CliError, _add_row, _echo, _emit_json,
                   SizeType, _print_table, _set_json, _table, cli)

DRILL_EXIT_CODES = """\b
Exit codes:
  0    every scenario that ran passed (a skipped one, e.g. slurm without a
       cluster, is not a failure)
  1    a scenario failed (the lines after the matrix name each failed check)
  2    usage error (a bad option, OUT_DIR holds something else than a drill)
  70   internal error (a bug)    130  interrupted (the drill's ranks are killed)"""


@cli.command(epilog=DRILL_EXIT_CODES)
@click.argument("out_dir", required=False)
@click.option("--ranks", type=click.IntRange(2, 256), default=2, show_default=True,
              help="Processes of the training job (gloo on CPU; NCCL when each has a GPU).")
@click.option("--size", type=SizeType(0), default="32MiB", show_default=True,
              help="State per rank: a padding tensor beside the model and AdamW state.")
@click.option("--grace", type=click.FloatRange(min=0, min_open=True), default=10.0,
              show_default=True, metavar="S", help="Grace window of each scenario (seconds).")
@click.option("--scenario", "scenarios", multiple=True, metavar="NAME",
              help=f"Run only this scenario (repeatable); default: all of "
                   f"{', '.join(DEFAULT_SCENARIOS)}, and slurm when a Slurm cluster answers "
                   "(sinfo).")
@click.option("--short-window", type=click.FloatRange(min=0, min_open=True), default=None,
              metavar="S", help="short-window's grace window [default: min(--grace, 3)].")
@click.option("--steps", type=click.IntRange(min=1), default=30, show_default=True,
              help="Training steps of every job.")
@click.option("--step-ms", type=click.FloatRange(min=0), default=30.0, show_default=True,
              help="Milliseconds each step sleeps beside its compute.")
@click.option("--launcher", type=click.Choice(sorted(LAUNCHERS)), default="forkserver",
              show_default=True, help="forkserver: ranks forked from a server that imported "
              "torch once (fast); subprocess: each rank a fresh python process.")
@click.option("--backend", type=click.Choice(["auto", "gloo", "nccl"]), default="auto",
              show_default=True)
@click.option("--seed", type=int, default=0, show_default=True,
              help="The staggered scenario's signal order and gaps.")
@click.option("--json", "json_path", default=None, metavar="F",
              help="Write the JSON report to F ('-': print it on stdout instead of the "
                   "matrix) [default: OUT_DIR/drill.json].")
@click.option("--png", "png_path", default=None, metavar="F",
              help="Write the timeline chart to F ('' to skip; needs matplotlib) "
                   "[default: OUT_DIR/drill.png].")
def drill(out_dir: str | None, ranks: int, size: int, grace: float, scenarios: tuple[str, ...],
          short_window: float | None, steps: int, step_ms: float, launcher: str, backend: str,
          seed: int, json_path: str | None, png_path: str | None) -> int:
    """Preempt a small real training job on purpose and check the outcome.

    Runs the job (FSDP2 + AdamW, --size of state per rank) once uninterrupted as the
    reference, then once per scenario, each a fresh job: one-rank (SIGTERM to one rank),
    staggered (SIGTERM to every rank, 50-200 ms apart), peer-killed (SIGTERM, then SIGKILL of
    another rank as its emergency save starts), short-window (a window the state does not
    fit), and slurm when a Slurm cluster answers (the job submitted with sbatch as
    `fastckpt slurm` prints it, then scancel; selected without a cluster it is reported as
    skipped). After each, the job restarts from its newest committed checkpoint (slurm: a
    fresh sbatch), runs to the end and is compared bit-exact with the reference (every rank's
    losses and final tensors).

    Prints a pass/fail matrix (signal propagation and consensus latency in ms, the emergency
    save against the window, the decision, exit codes per rank, restart bit-exact), writes
    the JSON report and a PNG timeline. Checkpoints, event logs and each rank's log stay in
    OUT_DIR/<scenario>/ (default OUT_DIR: a new temporary directory).
    """
    to_stdout = json_path == "-"
    _set_json(to_stdout)
    try:
        opts = DrillOptions(out_dir=out_dir or "", ranks=ranks, size_bytes=size, grace_s=grace,
                            short_window_s=short_window, scenarios=tuple(scenarios),
                            steps=steps, step_s=step_ms / 1000.0, launcher=launcher,
                            backend=backend, seed=seed)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    if out_dir is None:  # only once the options are valid: no empty directory left behind
        out_dir = tempfile.mkdtemp(prefix="fastckpt-drill-")
        opts = dataclasses.replace(opts, out_dir=out_dir)
    json_path = os.path.join(out_dir, "drill.json") if json_path is None else json_path
    png_path = os.path.join(out_dir, "drill.png") if png_path is None else png_path

    def log(line: str) -> None:
        _echo(f"[drill] {line}", err=True)

    log(f"{ranks} ranks x {size / (1 << 20):g} MiB, grace {grace:g} s, scenarios "
        f"{', '.join(opts.chosen)}; output in {out_dir}")
    try:
        result = run_drill(opts, log=log)
    except ValueError as e:  # OUT_DIR is not ours
        raise CliError(str(e), EXIT_USAGE) from None
    written = []
    if png_path and all(sc.get("skipped") for sc in result["scenarios"]):
        log("no timeline chart: no scenario ran")
    elif png_path:
        try:
            got = write_timeline_png(result, png_path)
        except OSError as e:
            raise CliError(f"cannot write the chart {png_path}: {e}", EXIT_PROBLEM) from None
        if got is None:
            log("no timeline chart: matplotlib is not installed (pip install matplotlib)")
        else:
            result["png"] = got
            written.append(got)
    if to_stdout:
        _emit_json(result)
    else:
        text = json.dumps(result, indent=1, default=str)
        try:
            os.makedirs(os.path.dirname(os.path.abspath(json_path)), exist_ok=True)
            with open(json_path, "w", encoding="utf-8") as f:
                f.write(text + "\n")
        except OSError as e:
            raise CliError(f"cannot write the report {json_path}: {e}", EXIT_PROBLEM) from None
        written.insert(0, json_path)
        t = _table(*MATRIX_HEADERS)
        for row in matrix_rows(result):
            _add_row(t, *row)
        _print_table(t)
        for line in notes(result):
            _echo(line)
        for line in failures(result):
            _echo(f"FAIL {line}")
        skipped = len(result.get("skipped") or {})
        n = len(result["scenarios"]) - skipped
        ok = sum(1 for s in result["scenarios"] if s["passed"])
        _echo(f"{ok} of {n} scenario(s) passed"
              + (f" ({skipped} skipped)" if skipped else "")
              + f" in {result['wall_s']:.1f} s ({ranks} ranks x {size / (1 << 20):g} MiB); "
              f"wrote {', '.join(written)}")
        if ok < n:
            _echo(f"logs of each rank: {out_dir}/<scenario>/log-*.txt; events: "
                  f"{out_dir}/<scenario>/ckpt/events/")
    sys.stdout.flush()
    return EXIT_OK if result["passed"] else EXIT_PROBLEM
