"""``fastckpt slurm ROOT -- CMD``: print an sbatch script for CMD, its grace window from
``fastckpt bench``'s measurement. The script is built by :mod:`fastckpt.tools.slurm`."""

from __future__ import annotations

import os
import subprocess

import click

from ..tools.slurm import default_logs, sbatch_script
from .base import EXIT_OK, EXIT_USAGE, CliError, _echo, cli, grace_window, job_name, write_or_print

SLURM_EXIT_CODES = """\b
Exit codes:
  0    the script was printed (or written to --output)
  2    usage error: no grace window (no bench record in ROOT and no --grace), a bad name,
       no CMD"""


def cluster_kill_wait() -> int | None:
    """This cluster's KillWait (``scontrol show config``), None where scontrol is absent."""
    try:
        out = subprocess.run(["scontrol", "show", "config"], capture_output=True, text=True,
                             timeout=5).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    for line in out.splitlines():
        parts = line.split()
        if len(parts) >= 3 and parts[0] == "KillWait" and parts[2].isdigit():
            return int(parts[2])
    return None


@cli.command(epilog=SLURM_EXIT_CODES)
@click.argument("root")
@click.argument("cmd", nargs=-1, required=True, type=click.UNPROCESSED)
@click.option("--grace", type=click.IntRange(min=1), default=None,
              help="Seconds the emergency save needs; default: the window `fastckpt bench "
                   "ROOT` measured for the state.")
@click.option("--nodes", type=click.IntRange(min=1), default=1)
@click.option("--ntasks-per-node", type=click.IntRange(min=1), default=1,
              help="Ranks per node (with torchrun: --nproc-per-node).")
@click.option("--launcher", type=click.Choice(["srun", "torchrun"]), default="srun",
              help="srun: one task per rank (RANK etc. mapped from SLURM_* by fastckpt); "
                   "torchrun: one torchrun per node under srun.")
@click.option("--name", default=None, help="The job's name (default: from ROOT).")
@click.option("--time", "time_limit", default=None, help="#SBATCH --time.")
@click.option("--partition", default=None, help="#SBATCH --partition.")
@click.option("--logs", default=None, help="Directory of the job's and the tasks' logs, "
                                           "created now (default: ROOT/logs).")
@click.option("-o", "--output", type=click.Path(dir_okay=False, writable=True), default=None,
              help="Write the script here instead of stdout.")
def slurm(root: str, cmd: tuple[str, ...], grace: int | None, nodes: int, ntasks_per_node: int,
          launcher: str, name: str | None, time_limit: str | None, partition: str | None,
          logs: str | None, output: str | None) -> int:
    """An sbatch script running CMD checkpointed under ROOT: SIGUSR1 the grace window before
    the time limit, passed to the ranks through srun; the supervisor requeues the job on a
    preemption (exit 143) with StartTime=now, and does not requeue a cancelled one; each
    signal's window told to the ranks (scancel: KillWait). Submit it with sbatch."""
    grace, source = grace_window(root, grace)
    kill_wait = cluster_kill_wait()
    try:
        text = sbatch_script(root=root, cmd=list(cmd), grace_s=grace, source=source,
                             name=name or job_name(root), nodes=nodes,
                             ntasks_per_node=ntasks_per_node, launcher=launcher,
                             time_limit=time_limit, partition=partition, logs=logs,
                             kill_wait=kill_wait)
    except ValueError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    if kill_wait is not None and kill_wait < grace:
        _echo(f"fastckpt: warning: this cluster's KillWait is {kill_wait} s, less than the "
              f"{grace} s the save needs: after scancel or a preemption the ranks keep the last "
              "committed step when the save does not fit (the time limit's SIGUSR1 gives the "
              "whole window)", err=True)
    logs = logs or default_logs(root)
    try:  # Slurm opens --output before the script runs: the directory must exist
        os.makedirs(logs, exist_ok=True)
    except OSError as e:
        _echo(f"fastckpt: warning: cannot create the log directory {logs} ({e.strerror}): "
              "create it before sbatch, or the job fails to launch", err=True)
    write_or_print(text, output)
    return EXIT_OK
