"""Multi-node on one machine: two real torchrun agents (c10d rendezvous, gloo on CPU) acting as
two "nodes" of 2 ranks each, every agent run the way docs/preemption.md recommends for
torchrun, under ``fastckpt resume ROOT --supervise --`` (torchrun exits 1 after its workers
exit 143; the supervisor exits with the ranks' stop code). Each node (supervisor + agent, one
session; workers, each in its own session as torchrun starts them) is signalled or killed as
a whole from the test. ``tests/multinode_worker.py`` runs ``tests.preempt_worker.train``.

1. SIGTERM to node 1's workers only: all 4 ranks agree on one stop step over the store,
   commit it and exit 143; both supervisors exit 143; a restart of both nodes resumes
   bit-exact against an uninterrupted 4-rank run.
2. SIGKILL of the whole node 1 during the emergency save after a SIGTERM to its workers: the
   survivors exit 144 within the deadline + 5 s naming ranks 2 and 3; the previous periodic
   step verifies and a restart of both nodes resumes from it bit-exact.
3. The same with node 0, which also hosts the ranks' c10d store (in torchrun's group-rank-0
   agent): the survivors exit 144 at once, naming ranks 0 and 1 (the ranks lost with the
   store: ``fastckpt.engine.dist.store_host``).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch

import fastckpt
from fastckpt import preempt
from tests.distributed import free_port
from tests.preempt_worker import launch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(REPO, "tests", "multinode_worker.py")
TOTAL = 80  # steps of every run (the baseline's too)
NODES, PER_NODE = 2, 2
WORLD = NODES * PER_NODE


# ----------------------------------------------------------------------------------- helpers

def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a parent that is gone or busy does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _ours(pid: int, token: str) -> bool:
    """The process carries this job's ``MN_JOB`` token (not a stranger that reused the pid)."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return f"MN_JOB={token}".encode() in f.read().split(b"\0")
    except OSError:
        return False


def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except FileNotFoundError:
        return []


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = _children(todo.pop())
        out += kids
        todo += kids
    return out


def _events(root: str, rank: int, since: float) -> list[dict]:
    path = os.path.join(root, "events", f"rank{rank:05d}.jsonl")
    if not os.path.exists(path):
        return []
    out = []
    with open(path) as f:
        for line in f:
            try:
                e = json.loads(line)
            except ValueError:  # a line cut by SIGKILL
                continue
            if e["t"] >= since:
                out.append(e)
    return out


def _one(evs: list[dict], name: str) -> dict:
    found = [e for e in evs if e["event"] == name]
    assert found, (name, [e["event"] for e in evs])
    return found[-1]


def _losses(out: str, tag: str, rank: int = 0) -> list[dict]:
    path = os.path.join(out, f"losses-{tag}-r{rank}.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


class Job:
    """One run of the job: for each node, ``fastckpt resume ROOT --supervise -- python -m
    torch.distributed.run --nnodes 2 --nproc-per-node 2 --node-rank N --rdzv-backend c10d ...``
    started in its own session. Node 0's agent hosts the rendezvous store (``is_host``) and is
    started first, so it is the rendezvous' rank 0 (ranks are given in the order of the agents'
    pids), which hosts the ranks' store: node 0 = ranks 0-1, node 1 = ranks 2-3."""

    def __init__(self, tmp, cfg: dict, rdzv_id: str) -> None:
        self.cfg, self.rdzv_id = cfg, rdzv_id
        self.out, self.tag, self.root = cfg["out"], cfg["tag"], cfg["root"]
        os.makedirs(self.out, exist_ok=True)
        self.cfg_path = os.path.join(self.out, f"cfg-{self.tag}.json")
        with open(self.cfg_path, "w") as f:
            json.dump(cfg, f)
        self.sups: list[subprocess.Popen] = []
        self.logs: list[str] = []
        self.workers: dict[int, dict] = {}  # rank -> pid file (pid, group_rank, node)
        self.t_start = 0.0
        self.token = f"{os.getpid()}-{time.time_ns()}"  # in the environment of every process

    def start(self) -> "Job":
        self.t_start = time.time()
        port = free_port()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO, "MN_JOB": self.token}
        for n in range(NODES):
            log = os.path.join(self.out, f"node{n}-{self.tag}.log")
            self.logs.append(log)
            cmd = [sys.executable, "-m", "fastckpt.cli", "resume", self.root, "--supervise", "--",
                   sys.executable, "-m", "torch.distributed.run", "--nnodes", str(NODES),
                   "--nproc-per-node", str(PER_NODE), "--node-rank", str(n),
                   "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                   "--rdzv-id", self.rdzv_id, "--rdzv-conf", f"is_host={int(n == 0)}",
                   "--local-addr", "127.0.0.1", "--max-restarts", "0", WORKER, self.cfg_path]
            with open(log, "w") as f:
                self.sups.append(subprocess.Popen(cmd, env={**env, "MN_NODE": str(n)}, stdout=f,
                                                  stderr=subprocess.STDOUT,
                                                  start_new_session=True))
            if n == 0:  # its torchrun gets the lower pid
                end = time.monotonic() + 60
                while not _children(self.sups[0].pid):
                    assert self.sups[0].poll() is None, self.tail()
                    assert time.monotonic() < end, "node 0's supervisor started no torchrun"
                    time.sleep(0.01)
        return self

    def tail(self, n: int = 3000) -> str:
        text = ""
        for log in self.logs:
            with open(log) as f:
                text += f"--- {os.path.basename(log)}\n{f.read()[-n:]}"
        for r in range(WORLD):
            p = os.path.join(self.out, f"log-{self.tag}-r{r}.txt")
            if os.path.exists(p):
                with open(p) as f:
                    text += f"--- rank {r}\n{f.read()[-n:]}"
        return text

    def ranks(self, timeout: float = 90.0) -> dict[int, dict]:
        """Every rank's pid file (they are written before the process group starts)."""
        end = time.monotonic() + timeout
        while len(self.workers) < WORLD:
            for r in range(WORLD):
                p = os.path.join(self.out, f"pid-{self.tag}-r{r}.json")
                if r not in self.workers and os.path.exists(p):
                    with open(p) as f:
                        self.workers[r] = json.load(f)
            if len(self.workers) < WORLD:
                assert all(s.poll() is None for s in self.sups), self.tail()
                assert time.monotonic() < end, f"ranks did not start:\n{self.tail()}"
                time.sleep(0.02)
        return self.workers

    def node_ranks(self, node: int) -> list[int]:
        return sorted(r for r, w in self.ranks().items() if w["node"] == str(node))

    def wait_step(self, step: int, timeout: float = 90.0) -> int:
        end = time.monotonic() + timeout
        while True:
            ls = _losses(self.out, self.tag)
            if ls and ls[-1]["step"] >= step:
                return ls[-1]["step"]
            assert all(s.poll() is None for s in self.sups), self.tail()
            assert time.monotonic() < end, f"rank 0 did not reach step {step}:\n{self.tail()}"
            time.sleep(0.01)

    def signal_workers(self, node: int, sig: int) -> None:
        for r in self.node_ranks(node):
            os.kill(self.workers[r]["pid"], sig)

    def _kill(self, pid: int) -> None:
        if _ours(pid, self.token):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass

    def kill_node(self, node: int) -> None:
        """SIGKILL every process of the node: supervisor and agent (the session's process group)
        and the workers (torchrun starts each in a session of its own)."""
        pids = [self.workers[r]["pid"] for r in self.node_ranks(node)]
        assert self.sups[node].poll() is None, self.tail()  # so its pid is still its own
        os.killpg(self.sups[node].pid, signal.SIGKILL)
        for pid in pids:
            self._kill(pid)

    def wait(self, timeout: float) -> list[int]:
        """Each node's supervisor exit code; everything still running then is killed and the
        test fails."""
        end = time.monotonic() + timeout
        for s in self.sups:
            try:
                s.wait(max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        codes = [s.poll() for s in self.sups]
        if None in codes:
            text = self.tail()
            self.cleanup()
            raise AssertionError(f"nodes still running after {timeout} s: {codes}\n{text}")
        return codes

    def worker_codes(self) -> dict[int, int]:
        """Each worker's exit code as its torchrun agent reported it (the failure summary it
        prints when a worker exits non-zero)."""
        out = {}
        for log in self.logs:
            with open(log) as f:
                for rank, code in re.findall(r"rank\s*:\s*(\d+) \(local_rank: \d+\)\s*\n"
                                             r"\s*exitcode\s*:\s*(-?\d+)", f.read()):
                    out[int(rank)] = int(code)
        return dict(sorted(out.items()))

    def launcher_codes(self) -> dict[int, int]:
        """What each node's torchrun exited with, as its supervisor recorded it."""
        path = os.path.join(self.root, "events", "supervisor.jsonl")
        by_pid = {s.pid: n for n, s in enumerate(self.sups)}
        out = {}
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    e = json.loads(line)
                    if e["t"] >= self.t_start and e.get("pid") in by_pid:
                        out[by_pid[e["pid"]]] = e["launcher_code"]
        return out

    def cleanup(self) -> list[int]:
        """Kill whatever is left of every node; the pids still running after it (none)."""
        for r in range(WORLD):  # pid files not read yet
            p = os.path.join(self.out, f"pid-{self.tag}-r{r}.json")
            if r not in self.workers and os.path.exists(p):
                try:
                    with open(p) as f:
                        self.workers[r] = json.load(f)
                except ValueError:
                    pass
        pids = [w["pid"] for w in self.workers.values()]
        for s in self.sups:
            if s.poll() is None:  # not reaped: the pid (and process group id) is still its own
                pids.extend(_descendants(s.pid))
                os.killpg(s.pid, signal.SIGKILL)
        for pid in pids:
            self._kill(pid)
        for s in self.sups:
            try:
                s.wait(10)
            except subprocess.TimeoutExpired:
                pass
        end = time.monotonic() + 10

        def running() -> list[int]:
            return [p for p in pids if _alive(p) and _ours(p, self.token)]
        while running() and time.monotonic() < end:
            time.sleep(0.05)
        return running() + [s.pid for s in self.sups if s.poll() is None]


@pytest.fixture
def jobs():
    """Every job a test starts; whatever is still running at the end is killed, and a test
    that leaked a process fails."""
    started: list[Job] = []
    yield started
    leaked = []
    for j in started:
        leaked += j.cleanup()
    assert not leaked, f"processes still running after the test: {leaked}"


def _cfg(tmp, tag: str, **kw) -> dict:
    cfg = {"root": str(tmp / "ckpt"), "out": str(tmp / "out"), "tag": tag, "total": TOTAL,
           "step_s": 0.0}
    cfg.update(kw)
    return cfg


_BASE: dict = {}


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """An uninterrupted 4-rank run of the same loop (forked ranks, the same gloo all-reduces
    among 4 ranks): losses and rank 0's final model and optimizer state."""
    if not _BASE:
        tmp = tmp_path_factory.mktemp("base")
        cfg = _cfg(tmp, "base")
        procs = launch(WORLD, cfg)
        end = time.monotonic() + 120
        for p in procs:
            p.join(max(0.1, end - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        assert [p.exitcode for p in procs] == [0] * WORLD
        _BASE["losses"] = _losses(cfg["out"], "base")
        _BASE["final"] = torch.load(os.path.join(cfg["out"], "final-base-r0.pt"))
    return _BASE


def _resume_exact(tmp, jobs, cfg: dict, stop: int, baseline: dict, rdzv_id: str) -> tuple:
    """Restart both nodes on the root: they resume from ``stop`` and everything equals the
    uninterrupted run (losses of every step, parameters and Adam moments)."""
    rcfg = dict(cfg, tag="resumed", step_s=0.0)
    for k in ("throttle_mibps", "save_every", "save_steps"):
        rcfg.pop(k, None)
    job = Job(tmp, rcfg, rdzv_id)
    jobs.append(job)
    job.start()
    codes = job.wait(120)
    assert codes == [0, 0], (codes, job.tail())
    assert job.node_ranks(0) == [0, 1] and job.node_ranks(1) == [2, 3]
    for r in range(WORLD):
        with open(os.path.join(cfg["out"], f"resumed-resumed-r{r}")) as f:
            assert json.load(f) == stop
    got = [x for x in _losses(cfg["out"], cfg["tag"]) if x["step"] <= stop]
    got += _losses(cfg["out"], "resumed")
    assert [x["step"] for x in got] == list(range(TOTAL))
    assert [float.hex(x["loss"]) for x in got] == \
        [float.hex(x["loss"]) for x in baseline["losses"]]
    final = torch.load(os.path.join(cfg["out"], "final-resumed-r0.pt"))
    for k, v in baseline["final"]["model"].items():
        assert torch.equal(final["model"][k], v), k
    for pid, st in baseline["final"]["optim"]["state"].items():
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(final["optim"]["state"][pid][k], st[k]), (pid, k)
    return codes, time.time() - job.t_start


# ------------------------------------------------------------------------------------- tests

@pytest.mark.timeout(240)
def test_sigterm_to_one_node_stops_both_nodes_at_one_step(tmp_path, jobs, baseline):
    grace = 20.0
    cfg = _cfg(tmp_path, "run", step_s=0.03, grace_s=grace, save_every=4)
    job = Job(tmp_path, cfg, "mn-term")
    jobs.append(job)
    job.start()
    assert job.node_ranks(0) == [0, 1] and job.node_ranks(1) == [2, 3], job.workers
    job.wait_step(9)  # periodic saves of steps 4 and 8 were issued
    t_sig = time.time()
    job.signal_workers(1, signal.SIGTERM)  # node 1's ranks only
    codes = job.wait(90)
    took = time.time() - t_sig
    launcher = job.launcher_codes()
    stops, exits = set(), {}
    for r in range(WORLD):
        evs = _events(cfg["root"], r, job.t_start)
        c = _one(evs, "consensus")
        assert c["t"] >= t_sig, c
        stops.add(c["stop_step"])
        ex = _one(evs, "exit")
        exits[r] = ex["code"]
        assert ex["t"] - t_sig <= grace + 5.0, ex
        assert _one(evs, "barrier")["ok"]
        sigs = [e for e in evs if e["event"] == "signal"]
        assert (len(sigs) > 0) == (r in (2, 3)), (r, sigs)  # node 0 learned it over the store
    assert len(stops) == 1, stops
    stop = stops.pop()
    # rank 0 logged step 9's loss, so it had passed save(step=8, on_preempt=True): T >= 9
    assert stop >= 9, stop
    for r in range(WORLD):
        assert _one(_events(cfg["root"], r, job.t_start), "commit")["step"] == stop
    assert exits == {r: preempt.EXIT_PREEMPTED for r in range(WORLD)}, (exits, job.tail())
    assert os.path.exists(os.path.join(cfg["root"], f"step-{stop:010d}", "manifest.json"))
    # the supervisors exit with the ranks' code; torchrun itself does not (recorded)
    assert codes == [preempt.EXIT_PREEMPTED] * NODES, (codes, launcher, job.tail())
    assert sorted(launcher) == [0, 1] and 0 not in launcher.values(), launcher
    assert job.worker_codes() == exits, job.worker_codes()  # the processes' own codes
    rcodes, rtook = _resume_exact(tmp_path, jobs, cfg, stop, baseline, "mn-term-2")
    print(f"\nSIGTERM to node 1: stop step {stop}, rank exits {exits} (torchrun saw "
          f"{job.worker_codes()}), supervisors {codes}, "
          f"torchrun {launcher}, stopped {took:.1f} s after the signal; "
          f"restart {rcodes} in {rtook:.1f} s")


KILL_GRACE = 7.0  # the emergency save needs ~2.5 s of the ~5 s left at the decision


def _kill_node_in_emergency_save(tmp, jobs, victim: int) -> dict:
    """Node ``victim``'s workers get SIGTERM; while every rank writes the emergency checkpoint
    (1 MiB of padding per rank through a 0.5 MiB/s throttle: 2 s; step 2 was saved and
    measured the same way), the whole node is SIGKILLed. Returns what happened."""
    cfg = _cfg(tmp, "run", step_s=0.05, grace_s=KILL_GRACE, save_steps=[2], mib=1,
               throttle_mibps=0.5)
    job = Job(tmp, cfg, f"mn-kill{victim}")
    jobs.append(job)
    job.start()
    assert job.node_ranks(0) == [0, 1] and job.node_ranks(1) == [2, 3], job.workers
    lost = job.node_ranks(victim)
    manifest = os.path.join(cfg["root"], "step-0000000002", "manifest.json")
    end = time.monotonic() + 90
    while not os.path.exists(manifest):
        assert all(s.poll() is None for s in job.sups), job.tail()
        assert time.monotonic() < end, f"step 2 was not committed:\n{job.tail()}"
        time.sleep(0.02)
    job.wait_step(_losses(cfg["out"], "run")[-1]["step"] + 2)  # the commit's acks are in
    t_sig = time.time()
    job.signal_workers(victim, signal.SIGTERM)

    def writing(r: int) -> bool:
        """Inside the emergency save's (throttled) write: its shard file is there, and the
        rank has not reported it yet (that comes after the throttle's 2 s)."""
        starts = [e for e in _events(cfg["root"], r, t_sig) if e["event"] == "save_start"]
        if not starts:
            return False
        d = os.path.join(cfg["root"], f"step-{starts[-1]['step']:010d}")
        return os.path.isdir(d) and any(n.startswith(f"r{r:05d}-") for n in os.listdir(d))
    end = time.monotonic() + KILL_GRACE
    while not all(writing(r) for r in lost):
        assert all(s.poll() is None for s in job.sups), job.tail()
        assert time.monotonic() < end, f"no emergency save on node {victim}:\n{job.tail()}"
        time.sleep(0.01)
    t_kill = time.time()
    job.kill_node(victim)
    survivor = 1 - victim
    end = time.monotonic() + KILL_GRACE + 60
    while job.sups[survivor].poll() is None and time.monotonic() < end:
        time.sleep(0.05)
    t_down = time.time()
    codes = job.wait(1)
    alive = job.node_ranks(survivor)
    stop = _one(_events(cfg["root"], alive[0], t_sig), "consensus")["stop_step"]
    for r in lost:  # killed inside the save: it never ended there
        evs = _events(cfg["root"], r, t_sig)
        assert _one(evs, "save_start")["step"] == stop
        assert not [e for e in evs if e["event"] in ("save_end", "commit", "exit")], evs
    exits = {}
    for r in alive:
        evs = _events(cfg["root"], r, t_sig)
        assert _one(evs, "consensus")["stop_step"] == stop
        assert _one(evs, "decision")["decision"] in ("save", "wait_then_save")
        exits[r] = _one(evs, "exit")
    assert not os.path.exists(os.path.join(cfg["root"], f"step-{stop:010d}", "manifest.json"))
    return {"job": job, "cfg": cfg, "t_sig": t_sig, "t_kill": t_kill, "t_down": t_down,
            "codes": codes, "launcher": job.launcher_codes(), "workers": job.worker_codes(),
            "stop": stop, "lost": lost,
            "alive": alive, "exits": exits}


def _verify_step_2(root: str) -> None:
    """The previous committed step is the newest and verifies."""
    v = subprocess.run([sys.executable, "-m", "fastckpt.cli", "verify", root],
                       capture_output=True, text=True, timeout=60)
    assert v.returncode == 0 and "step 2: OK" in v.stdout, v.stdout + v.stderr
    assert fastckpt.latest_step(root) == 2


@pytest.mark.timeout(240)
def test_node_killed_during_the_emergency_save(tmp_path, jobs, baseline):
    """Node 1 (ranks 2-3) is lost in the emergency save: ranks 0-1 (and the store, on node
    0's agent) survive, fail the save at its deadline naming ranks 2 and 3, exit 144."""
    k = _kill_node_in_emergency_save(tmp_path, jobs, victim=1)
    job, t_sig = k["job"], k["t_sig"]
    for r, ex in k["exits"].items():
        assert ex["code"] == preempt.EXIT_FAILED, (ex, job.tail())
        assert sorted(ex["missing"] or []) == [2, 3], ex
        assert k["t_kill"] < ex["t"] <= t_sig + KILL_GRACE + 5.0, (ex, t_sig, k["t_kill"])
    assert k["codes"] == [preempt.EXIT_FAILED, -signal.SIGKILL], (k["codes"], job.tail())
    assert k["workers"] == {0: 144, 1: 144}, k["workers"]  # what node 0's torchrun saw
    _verify_step_2(k["cfg"]["root"])
    rcodes, rtook = _resume_exact(tmp_path, jobs, k["cfg"], 2, baseline, "mn-kill1-2")
    print(f"\nnode 1 killed in the emergency save of step {k['stop']}: survivors' exits "
          f"{ {r: (e['code'], e['missing']) for r, e in k['exits'].items()} }, supervisors "
          f"{k['codes']}, torchrun {k['launcher']} (it saw workers exit {k['workers']}), last "
          f"survivor exit "
          f"{max(e['t'] for e in k['exits'].values()) - t_sig:.1f} s after the signal, node 0 "
          f"down after {k['t_down'] - t_sig:.1f} s; restart {rcodes} in {rtook:.1f} s")


@pytest.mark.timeout(240)
def test_store_host_node_killed_during_the_emergency_save(tmp_path, jobs):
    """Node 0 is lost in the emergency save: ranks 0-1 and the ranks' c10d store (torchrun's
    group-rank-0 agent hosts it, and the rendezvous store: node 1's agent dies of a
    RendezvousConnectionError and SIGTERMs its workers mid-save, which changes nothing). Ranks
    2-3 exit 144 soon (the store is gone) naming ranks 0 and 1, the previous step verifies."""
    k = _kill_node_in_emergency_save(tmp_path, jobs, victim=0)
    job, t_sig = k["job"], k["t_sig"]
    for r, ex in k["exits"].items():
        assert ex["code"] == preempt.EXIT_FAILED, (ex, job.tail())
        assert sorted(ex["missing"] or []) == [0, 1], ex
        assert k["t_kill"] < ex["t"] <= t_sig + KILL_GRACE + 5.0, (ex, t_sig, k["t_kill"])
    assert k["codes"] == [-signal.SIGKILL, preempt.EXIT_FAILED], (k["codes"], job.tail())
    _verify_step_2(k["cfg"]["root"])
    print(f"\nnode 0 killed in the emergency save of step {k['stop']}: survivors' exits "
          f"{ {r: (e['code'], e['missing']) for r, e in k['exits'].items()} }, supervisors "
          f"{k['codes']}, torchrun {k['launcher']} (it saw workers exit {k['workers']}), last "
          f"survivor exit "
          f"{max(e['t'] for e in k['exits'].values()) - t_sig:.1f} s after the signal")
