"""Starting and watching the ranks of a drill's job: :class:`Launcher` (``forkserver``,
``subprocess``; the ``slurm`` scenario brings its own), :class:`RankProcess` (one rank's
process) and :class:`Job` (a started job: progress, event logs, signals, exit codes)."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import subprocess
import sys
import time
from typing import Any, Callable

from .options import POLL_S, SIGKILL, DrillError

class RankProcess:
    """One running rank: ``pid``, ``poll()`` (exit code or None; negative: killed by that
    signal), ``signal(sig)``."""

    def __init__(self, rank: int, pid: int, poll: Callable[[], int | None]) -> None:
        self.rank = rank
        self.pid = pid
        self._poll = poll
        self.code: int | None = None
        self.ended_t: float | None = None  # Unix time the driver saw it gone

    def poll(self) -> int | None:
        if self.code is None:
            code = self._poll()
            if code is not None:
                self.code, self.ended_t = code, time.time()
        return self.code

    def signal(self, sig: int) -> bool:
        """Send ``sig``; False if the process is already gone."""
        if self.poll() is not None:
            return False
        try:
            os.kill(self.pid, sig)
            return True
        except ProcessLookupError:
            return False


class Launcher:
    """Starts the ranks of one job. ``start(job_path, world, env)`` -> one
    :class:`RankProcess` per rank, in rank order; each rank runs
    ``fastckpt.drill.worker.run(job_path)`` with ``env`` plus RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR, MASTER_PORT. Subclass it for another launcher (srun)."""

    name = "base"

    def start(self, job_path: str, world: int, env: dict[str, str]) -> list[RankProcess]:
        raise NotImplementedError

    def diagnose(self) -> str:
        """What the launcher knows about a job that did not do what the scenario needs
        (appended to the scenario's error); "" if nothing."""
        return ""

    def release(self) -> None:
        """End whatever this launcher started that is still there (called after each
        scenario, whatever happened)."""

    @staticmethod
    def rank_env(rank: int, world: int, port: int, env: dict[str, str]) -> dict[str, str]:
        return dict(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                    LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port), OMP_NUM_THREADS="1")


class ForkserverLauncher(Launcher):
    """Ranks forked from a multiprocessing fork server that imported torch once (each rank
    starts in milliseconds instead of seconds; the tests' launcher). Exit codes are the
    processes' own (143 from ``sys.exit``, -9 when SIGKILLed)."""

    name = "forkserver"
    PRELOAD = ["torch", "torch.distributed", "torch.distributed.fsdp",
               "torch.distributed.device_mesh", "fastckpt", "fastckpt.checkpointer",
               "fastckpt.drill.worker"]

    def __init__(self) -> None:
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(self.PRELOAD)

    def start(self, job_path: str, world: int, env: dict[str, str]) -> list[RankProcess]:
        from . import worker  # torch-free at import
        port = free_port()
        out = []
        for r in range(world):
            p = self.ctx.Process(target=worker._forked,
                                 args=(job_path, self.rank_env(r, world, port, env)),
                                 name=f"drill-rank{r}")
            p.start()
            out.append(RankProcess(r, p.pid, lambda p=p: p.exitcode))
        return out


class SubprocessLauncher(Launcher):
    """Each rank a fresh ``python -m fastckpt.drill.worker JOB`` (as a job script
    would start it; seconds per rank to import torch), in a session of its own (a Ctrl-C of
    the drill does not reach it: the drill kills what it started)."""

    name = "subprocess"

    def start(self, job_path: str, world: int, env: dict[str, str]) -> list[RankProcess]:
        from ..bench.common import child_env
        with open(job_path) as f:
            job = json.load(f)
        port = free_port()
        base = dict(child_env(), **env)
        out = []
        for r in range(world):
            log = open(os.path.join(job["out"], f"log-{job['tag']}-r{r}.txt"), "ab")
            p = subprocess.Popen([sys.executable, "-m", "fastckpt.drill.worker", job_path],
                                 env=self.rank_env(r, world, port, base), stdout=log,
                                 stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
            log.close()
            out.append(RankProcess(r, p.pid, p.poll))
        return out


LAUNCHERS: dict[str, Callable[[], Launcher]] = {"forkserver": ForkserverLauncher,
                                                "subprocess": SubprocessLauncher}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# -------------------------------------------------------------------------------------- jobs

def read_events(path: str) -> list[dict]:
    """A rank's events of its last run (from its last ``armed``); [] if none."""
    try:
        with open(path) as f:
            lines = f.readlines()
    except FileNotFoundError:
        return []
    evs: list[dict] = []
    for line in lines:
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line being written
        if isinstance(e, dict):
            if e.get("event") == "armed":
                evs = []
            evs.append(e)
    return evs


def _read_jsonl(path: str) -> list[dict]:
    out = []
    try:
        with open(path) as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except ValueError:
                    pass
    except FileNotFoundError:
        pass
    return out


class Job:
    """One started job: its ranks, files, and the signals the driver sent it."""

    def __init__(self, job: dict, procs: list[RankProcess]) -> None:
        self.job = job
        self.procs = procs
        self.world = len(procs)
        self.sent: list[dict] = []  # {"rank", "signal", "t", "delivered"}
        self.hung: list[int] = []
        self.notes: dict[str, Any] = {}  # what a scenario's act() observed (into "measured")

    def path(self, kind: str, rank: int, ext: str = "jsonl") -> str:
        return os.path.join(self.job["out"], f"{kind}-{self.job['tag']}-r{rank}.{ext}")

    def last_step(self, rank: int) -> int | None:
        rows = _read_jsonl(self.path("steps", rank))
        return rows[-1]["step"] if rows else None

    def events(self, rank: int) -> list[dict]:
        return read_events(os.path.join(self.job["root"], "events", f"rank{rank:05d}.jsonl"))

    def first(self, rank: int, names: tuple[str, ...]) -> dict | None:
        for e in self.events(rank):
            if e.get("event") in names:
                return e
        return None

    def log_tail(self, rank: int, n: int = 600) -> str:
        try:
            with open(self.path("log", rank, "txt"), errors="replace") as f:
                return f.read()[-n:].strip()
        except FileNotFoundError:
            return ""

    def ended(self) -> dict[int, int]:
        return {p.rank: c for p in self.procs if (c := p.poll()) is not None}

    def wait_steps(self, step: int, deadline: float) -> None:
        """Until every rank logged ``step``; DrillError if a rank ends or the deadline passes."""
        while True:
            steps = [self.last_step(r) for r in range(self.world)]
            if all(s is not None and s >= step for s in steps):
                return
            ended = self.ended()
            if ended:
                r = min(ended)
                raise DrillError(f"rank {r} exited {ended[r]} at step {steps[r]} before the "
                                 f"signal point (step {step}); its log "
                                 f"{self.path('log', r, 'txt')} ends: {self.log_tail(r)!r}")
            if time.monotonic() > deadline:
                raise DrillError(f"the job did not reach step {step} in time (ranks at steps "
                                 f"{steps}); logs: {self.path('log', 0, 'txt')}")
            time.sleep(0.02)

    def wait_event(self, rank: int, names: tuple[str, ...], deadline: float) -> dict | None:
        """The rank's first event among ``names`` (polled every POLL_S), None at the deadline or
        once the rank is gone without it."""
        while True:
            e = self.first(rank, names)
            if e is not None:
                return e
            if self.procs[rank].poll() is not None or time.monotonic() > deadline:
                return self.first(rank, names)
            time.sleep(POLL_S)

    def signal(self, rank: int, sig: int) -> bool:
        t = time.time()
        ok = self.procs[rank].signal(sig)
        self.sent.append({"rank": rank, "signal": signal.Signals(sig).name, "t": t,
                          "delivered": ok})
        return ok

    def wait(self, deadline: float) -> list[int | None]:
        """Every rank's exit code; ranks still running at ``deadline`` are SIGKILLed (listed
        in ``hung``, their code the kill's)."""
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.02)
        for p in self.procs:
            if p.poll() is None:
                self.hung.append(p.rank)
                p.signal(SIGKILL)
        end = time.monotonic() + 30
        while self.running() and time.monotonic() < end:
            time.sleep(0.02)
        return [p.poll() for p in self.procs]

    def running(self) -> list[int]:
        """The ranks still running (polls every rank: each end time is seen when it happens)."""
        return [p.rank for p in self.procs if p.poll() is None]

    def kill_all(self) -> None:
        for p in self.procs:
            p.signal(SIGKILL)

