#!/usr/bin/env python3
"""Coordination protocols at scale, simulated: thousands of ranks against one real c10d TCPStore.

    python benchmarks/bench_protocol.py --quick      # N = 64, 256, 1024: about a minute
    python benchmarks/bench_protocol.py              # N = 64, 256, 1024, 4096: several minutes
    python benchmarks/bench_protocol.py --ranks 256 --phases consensus_current,commit_current

No model and no process group: ``--procs`` worker processes (default 4) each hold N/procs
simulated ranks as threads, **each rank with its own TCPStore client connection** (and the
dedicated connections that fastckpt's ``Exchange`` clones from it for its blocking waits), all
talking to one real ``torch.distributed.TCPStore`` server (libuv backend, as torch.distributed
starts it) in a process of its own, whose CPU time is read around every phase. Results, with
machine, commit, versions and date: ``--json`` (default ``bench-out/protocol.json``) and a plot
(``--png``). ``--before`` (default ``bench-out/protocol-old.json``, the run of the protocol that
polled the store) is summarised into the JSON as the "before" column.

What runs (``current`` = fastckpt's own code, driven with minimal fake engine objects):

* ``idle_current``: N real ``fastckpt.preempt.trigger.Preemption`` triggers, each armed by its
  real ``install()`` (the signal trap's own ``install``, which takes the process's signal
  handlers, is replaced by the wakeup pipe an installed trap has: one trap per process), i.e.
  its signal thread (``_watch``) and its store watcher (``_watch_store``: ``Exchange.warm(2)``
  and one server-side wait on ``preempt/<k>/wake/<rank>``); store commands per second in a
  window after arming (and what arming cost), the server's CPU.
* ``consensus_current``: the same; one rank gets ``request_stop()`` (its signal thread wakes on
  the pipe, as on a signal, claims the wake-up and sets the N wake keys); every rank's real
  ``_agree`` (``consensus.collect``) runs; latency = the last rank's ``agreed`` minus the
  request. Past the deadline: how many ranks knew T.
* ``consensus_all_current``: the same with every rank's ``request_stop()`` at once, as an
  orchestrator signals every rank (srun's SIGTERM to every task, a pod's containers); latency
  from the first request.
* ``commit_current``: the real ``fastckpt.engine.commit.commit`` on every rank (rank 0
  coordinates, a no-op manifest callback); the ranks finish "writing" spread over
  ``--spread`` s; latency beyond the slowest writer until every rank has the verdict and until
  the coordinator has the acks and deleted the keys.
* ``gather_current``: the real ``Group.gather`` (the plan exchange: still all-to-all, every rank
  reads all N values, but with one server-side wait and ``multi_get``) with a tiny payload: the
  message pattern alone. The realistic payload (a 70B model + AdamW under FSDP: 2892 chunk
  specs and the state's skeleton per rank, ~0.7 MB) runs through the same real ``gather`` in
  ``plan_realistic`` at small N only (it moves N^2 x 0.7 MB), with the real ``make_plan`` timed
  on N such entries; larger N are modelled from those measurements.
* ``decide_current``: the plan exchange of a save whose layout did not change (every save after
  the first): fastckpt's real ``Group.decide`` (every rank's compact value to rank 0 only, one
  verdict back) with the real ``PlanExchange.decide`` answering "reuse" on rank 0.
* ``assign_current``: the plan exchange of a process's first save or a changed layout (after the
  verdict round): fastckpt's real ``Group.decide(..., each=True)`` with the real
  ``PlanExchange.assign`` on rank 0 and ``take`` on every rank (every rank's chunk list to rank 0
  only, each rank's own part back), with empty chunk lists: the message pattern. With the 70B
  entries (``assign_realistic``, ``--assign-worlds``, default 8, 32, 64; not with ``--quick``)
  rank 0 parses N lists of 2892 specs and plans every rank.

Every phase's ``Exchange`` objects are fresh (a phase is a job); the commit and gather phases
pre-open one dedicated connection per rank before their start (``warm(1)``: what the trigger's
``warm(2)`` leaves idle in a real job), the trigger phases open theirs as the real code does.

Honesty notes (docs/scale.md says more): this VM has 2 cores and runs in a gVisor sandbox, so
the clients (thousands of Python threads, GIL-bound per process) compete with the server for
the cores and the loopback is gVisor's network stack. Latencies measured here are therefore
upper bounds for the client side; the server's CPU seconds per phase (a single-threaded event
loop on rank 0's host in a real job) and the command counts are what transfer to a cluster.
The "ceiling" phase measures the server's CPU per command here.

The sandbox's DNS answers about 25 reverse lookups and then stalls 5 s; c10d reverse-resolves
the peer of every new connection (for its log lines), so opening thousands of clients would
take minutes. The script compiles a 10-line ``getnameinfo`` shim (numeric host) with gcc and
preloads it in its children (``--no-dns-shim`` to disable); nothing measured goes through it.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from types import SimpleNamespace
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # the working tree's fastckpt (the children get it first too)
from fastckpt.bench import common as C  # noqa: E402
from fastckpt.manifest import schema as fmt  # noqa: E402

HOST = "127.0.0.1"
MULTI_GET_BATCH = 1024  # keys per multi_get (fastckpt.engine.dist.MULTI_GET_BATCH)
#: TCPStore client calls -> server commands (torch/csrc/distributed/c10d/TCPStore.cpp: get and
#: multi_get send a WAIT for their keys first; set and append are sent without waiting for a
#: reply; a new client (``clone``) sends VALIDATE and PING; a wait that times out sends
#: CANCEL_WAIT, counted as ``wait_timeout``)
COMMANDS = {"set": 1, "get": 2, "check": 1, "add": 1, "delete_key": 1, "wait": 1,
            "multi_get": 2, "multi_set": 1, "append": 1, "compare_set": 1, "clone": 2,
            "wait_timeout": 1}
TARGETS = {"consensus_s": 0.5, "idle_cmds_per_s": 2000, "commit_s": 1.0}  # at 4096 ranks
ALL_PHASES = ("idle_current", "consensus_current", "consensus_all_current", "commit_current",
              "gather_current", "decide_current", "assign_current")
#: the all-to-all plan exchange (every rank reads N values): its client side grows as N^2 here
HEAVY_CURRENT = ("gather_current",)
QUICK_PHASES = ALL_PHASES

# 70B-class decoder (Llama-3-70B geometry): 80 layers, hidden 8192, MLP 28672, 8 KV heads of
# 128, vocabulary 128256, untied embeddings
L70B = {"layers": 80, "hidden": 8192, "inter": 28672, "kv": 1024, "vocab": 128256}


SHIM_C = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <netdb.h>
#include <sys/socket.h>
typedef int (*gni_t)(const struct sockaddr *, socklen_t, char *, socklen_t, char *,
                     socklen_t, int);
int getnameinfo(const struct sockaddr *sa, socklen_t salen, char *host, socklen_t hostlen,
                char *serv, socklen_t servlen, int flags) {
    static gni_t real;
    if (!real) real = (gni_t)dlsym(RTLD_NEXT, "getnameinfo");
    return real(sa, salen, host, hostlen, serv, servlen, flags | NI_NUMERICHOST);
}
"""


def build_shim() -> str | None:
    path = os.path.join(tempfile.gettempdir(), f"fastckpt-bench-nodns-{os.getuid()}.so")
    if os.path.exists(path):
        return path
    src = path[:-3] + ".c"
    with open(src, "w") as f:
        f.write(SHIM_C)
    r = subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", path + ".tmp", src, "-ldl"],
                       capture_output=True, text=True)
    if r.returncode != 0:
        print(f"(no DNS shim: gcc failed: {r.stderr.strip()[:200]})", file=sys.stderr)
        return None
    os.replace(path + ".tmp", path)
    return path


# ---------------------------------------------------------------------------- counting

class Counted:
    """A store wrapper counting client calls, server commands and bytes (keys + values). Its
    clones (``clone()``: the dedicated connections of ``Exchange.wait``) are counted too, into
    the same totals."""

    def __init__(self, store: Any, root: "Counted | None" = None) -> None:
        self._s = store
        self._root = root if root is not None else self
        if root is None:
            self._lock = threading.Lock()
            self.calls: dict[str, int] = {}
            self.cmds = 0
            self.nbytes = 0

    def _tick(self, name: str, nbytes: int) -> None:
        r = self._root
        with r._lock:
            r.calls[name] = r.calls.get(name, 0) + 1
            r.cmds += COMMANDS[name]
            r.nbytes += nbytes

    def snapshot(self) -> tuple[int, int, dict]:
        r = self._root
        with r._lock:
            return r.cmds, r.nbytes, dict(r.calls)

    def clone(self) -> "Counted":
        c = self._s.clone()
        self._tick("clone", 0)
        return Counted(c, self._root)

    def set(self, k: str, v: bytes) -> None:
        self._tick("set", len(k) + len(v))
        self._s.set(k, v)

    def get(self, k: str) -> bytes:
        v = self._s.get(k)
        self._tick("get", 2 * len(k) + len(v))
        return v

    def check(self, keys: list[str]) -> bool:
        self._tick("check", sum(map(len, keys)))
        return self._s.check(keys)

    def add(self, k: str, n: int) -> int:
        self._tick("add", len(k) + 8)
        return self._s.add(k, n)

    def delete_key(self, k: str) -> bool:
        self._tick("delete_key", len(k))
        return self._s.delete_key(k)

    def wait(self, keys: list[str], timeout: datetime.timedelta) -> None:
        self._tick("wait", sum(map(len, keys)))
        try:
            self._s.wait(keys, timeout)
        except Exception:
            self._tick("wait_timeout", 0)
            raise

    def multi_get(self, keys: list[str]) -> list[bytes]:
        try:  # (a WAIT for the keys, then MULTI_GET: a timed-out WAIT is cancelled)
            vals = self._s.multi_get(keys)
        except Exception:
            self._tick("wait", sum(map(len, keys)))
            self._tick("wait_timeout", 0)
            raise
        self._tick("multi_get", 2 * sum(map(len, keys)) + sum(map(len, vals)))
        return vals

    def set_timeout(self, timeout: datetime.timedelta) -> None:
        self._s.set_timeout(timeout)  # (the client's own: no command)

    def append(self, k: str, v: bytes) -> None:
        self._tick("append", len(k) + len(v))
        self._s.append(k, v)

    def multi_set(self, keys: list[str], vals: list[bytes]) -> None:
        self._tick("multi_set", sum(map(len, keys)) + sum(map(len, vals)))
        self._s.multi_set(keys, vals)


def _td(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=max(0.001, seconds))

# --------------------------------------------------------------- the 70B FSDP plan entry

def model_tensors() -> list[tuple[str, tuple]]:
    """(state key, global shape) of the 70B model's parameters, in the order fastckpt's
    ``flatten`` lists ``{"model": model}`` (HF Llama naming)."""
    g = L70B
    h, i, kv = g["hidden"], g["inter"], g["kv"]
    out = [("model.model.embed_tokens.weight", (g["vocab"], h))]
    for n in range(g["layers"]):
        p = f"model.model.layers.{n}."
        out += [(p + "self_attn.q_proj.weight", (h, h)), (p + "self_attn.k_proj.weight", (kv, h)),
                (p + "self_attn.v_proj.weight", (kv, h)), (p + "self_attn.o_proj.weight", (h, h)),
                (p + "mlp.gate_proj.weight", (i, h)), (p + "mlp.up_proj.weight", (i, h)),
                (p + "mlp.down_proj.weight", (h, i)), (p + "input_layernorm.weight", (h,)),
                (p + "post_attention_layernorm.weight", (h,))]
    out += [("model.model.norm.weight", (h,)), ("model.lm_head.weight", (g["vocab"], h))]
    return out


def param_count() -> int:
    total = 0
    for _, shape in model_tensors():
        n = 1
        for d in shape:
            n *= d
        total += n
    return total


def skeleton_tree() -> Any:
    """The skeleton fastckpt's real ``flatten`` gives ``{"model": m, "optim": AdamW}`` for a
    model with the 70B model's module names (tiny dimensions: the skeleton holds names only)."""
    import torch
    from torch import nn

    from fastckpt.engine.state import flatten

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.self_attn = nn.Module()
            for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(self.self_attn, n, nn.Linear(2, 2, bias=False))
            self.mlp = nn.Module()
            for n in ("gate_proj", "up_proj", "down_proj"):
                setattr(self.mlp, n, nn.Linear(2, 2, bias=False))
            self.input_layernorm = nn.RMSNorm(2)
            self.post_attention_layernorm = nn.RMSNorm(2)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(2, 2)
            self.model.layers = nn.ModuleList([Layer() for _ in range(L70B["layers"])])
            self.model.norm = nn.RMSNorm(2)
            self.lm_head = nn.Linear(2, 2, bias=False)

    m = Model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    for p in m.parameters():
        p.grad = torch.zeros_like(p)
    opt.step()
    flat = flatten({"model": m, "optim": opt})
    return flat.skeleton


def stage_tensors(stage: int, pp: int) -> list[tuple[str, tuple]]:
    """The 70B model's parameters a pipeline stage holds (torchtitan's split: the layers in
    ``pp`` consecutive runs, the embedding on the first stage, the norm and the head on the
    last; the full model's names kept)."""
    if pp == 1:
        return model_tensors()
    layers = L70B["layers"]
    lo, hi = stage * layers // pp, (stage + 1) * layers // pp
    out = []
    for fqn, shape in model_tensors():
        if ".layers." in fqn:
            if lo <= int(fqn.split(".layers.")[1].split(".")[0]) < hi:
                out.append((fqn, shape))
        elif ("embed_tokens" in fqn) == (stage == 0) and ("embed_tokens" in fqn
                                                           or stage == pp - 1):
            out.append((fqn, shape))
    return out


def plan_entry(rank: int, world: int, tree: Any, solo: bool = False, rng: bool = False,
               pp: int = 1) -> dict:
    """Rank ``rank``'s value in the plan exchange (``Engine._plan``) for the 70B model + AdamW
    under FSDP2 over ``world`` ranks: every parameter and both moments a dim-0 ``Shard``
    DTensor (fp32: FSDP2 keeps fp32 sharded parameters, bf16 only for compute), ``step`` a
    regular 0-dim tensor (fingerprinted), in ``ChunkSpec`` field order; with ``solo`` each
    non-empty shard marked as ``local_chunks`` marks it (one mesh of the whole world), without
    it the specs as they were before 2026-12-05 (every chunk sent to rank 0); with ``rng``
    also ``fastckpt.RNGState``'s torch generator state, different on every rank (per rank).
    With ``pp`` pipeline stages of consecutive ranks (``stage_tensors``), each stage's
    tensors are sharded over its world / pp ranks on its own mesh (torchtitan's ``dp``)."""
    specs = []
    size = world // pp
    stage, world, rank = rank // size, size, rank % size
    if rng:
        specs.append(["rng.torch", "uint8", [5056], [0], [5056], 5056, False, f"{rank:016x}",
                      *[None] * solo])
    mesh = [f"3f81cb0f4a815f{stage:02x}"] if solo else []
    for fqn, shape in stage_tensors(stage, pp):
        d0 = shape[0]
        chunk = -(-d0 // world)
        lo = min(d0, rank * chunk)
        rows = max(0, min(d0, lo + chunk) - lo)
        offs = [lo] + [0] * (len(shape) - 1)
        sizes = [rows] + list(shape[1:])
        nbytes = 4 * rows * (shape[1] if len(shape) > 1 else 1)
        box = mesh  # (an empty box of a non-empty tensor too, as local_chunks marks it)
        specs.append([fqn, "float32", list(shape), offs, sizes, nbytes, True, None, *box])
        ofqn = "optim.state." + fqn[len("model."):]
        specs.append([ofqn + ".step", "float32", [], [], [], 4, False, "5d1c0a5e3f1b2c4d",
                      *[None] * len(mesh)])
        for k in ("exp_avg", "exp_avg_sq"):
            specs.append([f"{ofqn}.{k}", "float32", list(shape), offs, sizes, nbytes, True,
                          None, *box])
    return {"save_id": "0123456789ab", "specs": specs, "tree": tree, "error": None,
            "aliases": 0}


def first_values(world: int, ranks: Any, tree: Any, rng: bool = False,
                 pp: int = 1) -> list[dict]:
    """Each of ``ranks``' value in a first save's full plan exchange (``Engine._plan``), as the
    real ``PlanExchange`` makes it: rank 0's verdict carries the hashes of its table and list,
    and a rank whose own are the same sends None for them (under FSDP2: every rank); under
    ``pp`` stages the verdict (from every rank's first value, as the real one) names the first
    rank of each other stage, which alone sends its stage's table and list."""
    from fastckpt.engine.plan import PlanExchange
    # (one stage: every other rank's first value names nothing rank 0's does not: its own
    # alone gives the same verdict, without building every rank's entry in each worker)
    voters = range(world) if pp > 1 else [0]
    exs = {r: PlanExchange() for r in voters}
    specs = {r: plan_entry(r, world, tree, True, rng, pp)["specs"] for r in voters}
    values = [exs[r].value("0123456789ab", specs[r], error=None, aliases=0) for r in voters]
    verdict = json.loads(json.dumps(exs[0].decide(json.loads(json.dumps(values)))))
    out = []
    for r in ranks:
        ex = exs.get(r) or PlanExchange()
        ex.apply(verdict, 1)
        mine = specs[r] if r in specs else plan_entry(r, world, tree, True, rng, pp)["specs"]
        out.append(ex.full_value("0123456789ab", mine, rank=r, error=None, aliases=0))
    return out


def result_entry(rank: int, world: int) -> dict:
    """Rank ``rank``'s commit result (``Writer._write_and_commit``): its shard files of up to
    256 MiB, each with its chunks (key, box, place in the file, checksum). The replicated
    ``step`` scalars go to ranks round-robin (``make_plan``'s least-loaded holder)."""
    files, chunks, size, piece = [], [], 0, 0
    for j, s in enumerate(plan_entry(rank, world, None)["specs"]):
        fqn, _, _, offs, sizes, nbytes, dtensor, _ = s
        if (not dtensor and j % world != rank) or nbytes == 0:
            continue
        chunks.append({"fqn": fqn, "offsets": offs, "sizes": sizes, "offset": size,
                       "length": nbytes, "checksum": f"{(j * 2654435761) & (2**64 - 1):016x}"})
        size += -(-nbytes // 4096) * 4096
        if size >= 256 << 20:
            files.append({"file": fmt.shard_name(rank, "0123456789ab", piece), "piece": piece,
                          "size": size, "chunks": chunks})
            chunks, size, piece = [], 0, piece + 1
    if chunks:
        files.append({"file": fmt.shard_name(rank, "0123456789ab", piece), "piece": piece,
                      "size": size, "chunks": chunks})
    return {"ok": True, "files": files}


# ----------------------------------------------------------------------------- server

def server_main() -> None:
    import resource

    import torch.distributed as dist
    store = dist.TCPStore(HOST, 0, is_master=True, wait_for_workers=False,
                          timeout=_td(3600))
    print(store.port, flush=True)
    for line in sys.stdin:
        if line.strip() == "cpu":
            ru = resource.getrusage(resource.RUSAGE_SELF)
            print(json.dumps({"cpu": ru.ru_utime + ru.ru_stime, "rss_kib": ru.ru_maxrss}),
                  flush=True)
    del store


# ------------------------------------------------- the plan exchange when the plan is reused

#: the value every rank sends when its layout did not change (PlanExchange.value, compact: a
#: layout hash, one hash of its shared replicated tensors' fingerprints)
REUSE_VALUE = {"save_id": "0123456789ab", "base": "0123456789aa",
               "hash": "3f" * 16, "rep": "9e" * 16, "error": None, "aliases": 0,
               "up_busy": False}


def reuse_plans(world: int) -> Any:
    """A real ``PlanExchange`` in the state a full exchange of ``world`` ranks leaves (every
    rank's layout hash, one group of ranks holding the same replicated tensors), so that its
    real ``decide`` answers "reuse" to :data:`REUSE_VALUE` from every rank."""
    from fastckpt.engine.plan import PlanExchange, SavePlan, _Reusable
    plans = PlanExchange()
    plans._last = _Reusable(REUSE_VALUE["base"], SavePlan(REUSE_VALUE["base"], 0, world, (), {}),
                            [REUSE_VALUE["hash"]] * world, [], [], [0] * world, True)
    return plans


# ----------------------------------------------------------------------------- worker

class TimedEvent(threading.Event):
    t: float | None = None

    def set(self) -> None:  # noqa: A003
        if self.t is None:
            self.t = time.time()
        super().set()


class Worker:
    def __init__(self, a: argparse.Namespace) -> None:
        import torch.distributed as dist
        self.dist = dist
        self.port, self.wid = a.port, a.wid
        self.world, self.ranks = 0, []
        self.ctl = dist.TCPStore(HOST, a.port, is_master=False, wait_for_workers=False,
                                 timeout=_td(3600))
        self._clients: list[Any] = []

    def configure(self, spec: dict) -> dict:
        """Hold ranks [lo, hi) of a job of ``world`` ranks: one client connection per rank
        (kept across jobs: a new job reuses the first ones and opens what it lacks)."""
        self.world, self.ranks = spec["world"], list(range(spec["lo"], spec["hi"]))
        t = time.time()
        while len(self._clients) < len(self.ranks):
            self._clients.append(self.dist.TCPStore(
                HOST, self.port, is_master=False, wait_for_workers=False, timeout=_td(600)))
        return {"connect_s": round(time.time() - t, 3)}

    @property
    def clients(self) -> list[Any]:
        return self._clients[:len(self.ranks)]

    @staticmethod
    def exchange(client: Any, warm: int = 0) -> tuple[Any, Counted]:
        """A fresh ``fastckpt.engine.dist.Exchange`` on the rank's client, its store counted
        (clones included); ``warm``: dedicated connections opened now (``Exchange.warm``)."""
        from fastckpt.engine.dist import Exchange
        ex = Exchange(prefix="fastckpt", store=client)
        cnt = Counted(ex._store)
        ex._store = cnt
        if warm:
            ex.warm(warm)
        return ex, cnt

    @staticmethod
    def release(exs: list) -> int:
        """Close the dedicated connections a phase's exchanges hold idle (their objects go
        with the phase; the Preemption objects are in reference cycles, so without this the
        sockets would stay open until the cyclic collector runs)."""
        n = 0
        for ex in exs:
            with ex._cond:
                n += len(ex._idle)
                ex._idle.clear()
        gc.collect()
        return n

    @staticmethod
    def sleep_until(t: float) -> bool:
        d = t - time.time()
        if d > 0:
            time.sleep(d)
        return d >= 0

    def progress(self, i: int, done: Any, counters: list[Counted], end: float) -> None:
        """(main thread) Wait for ``done()`` (the number of local ranks finished) or ``end``;
        publish progress every 0.5 s so that a capped phase still reports something."""
        while True:
            n = done()
            cmds = sum(c.snapshot()[0] for c in counters)
            self.ctl.set(f"prog/{i}/{self.wid}", json.dumps({"done": n, "cmds": cmds}).encode())
            if n >= len(self.ranks) or time.time() >= end:
                return
            time.sleep(0.5)

    @staticmethod
    def totals(counters: list[Counted], before: list | None = None) -> dict:
        cmds = nbytes = 0
        calls: dict[str, int] = {}
        for j, c in enumerate(counters):
            cm, nb, cl = c.snapshot()
            if before is not None:
                cm0, nb0, cl0 = before[j]
                cm, nb = cm - cm0, nb - nb0
                cl = {k: v - cl0.get(k, 0) for k, v in cl.items()}
            cmds += cm
            nbytes += nb
            for k, v in cl.items():
                if v:
                    calls[k] = calls.get(k, 0) + v
        return {"cmds": cmds, "bytes": nbytes, "calls": calls}

    # -- fastckpt's real trigger -------------------------------------------------------------
    def preemptions(self, spec: dict) -> tuple[list, list[Counted]]:
        from fastckpt.options import CheckpointOptions
        from fastckpt.preempt import trigger
        opts = CheckpointOptions(grace_s=spec["grace_s"], teardown_s=0.0, preempt_exit=False)
        out, counters = [], []
        for r, client in zip(self.ranks, self.clients):
            ex, cnt = self.exchange(client)
            ckpt = SimpleNamespace(
                options=opts, rank=r, world_size=self.world, on_saved=[], on_exit=[],
                root="/nonexistent", storage=SimpleNamespace(root="/nonexistent",
                                                             is_local=False),
                group=SimpleNamespace(exchange=ex, collective=True),
                inflight=lambda: (None, 0))
            p = trigger.Preemption(ckpt)
            p.prefix = spec["prefix"]  # one prefix for the whole simulated job
            # the signal trap's install() takes the process's signal handlers (one trap per
            # process): the simulated ranks get what it leaves, the wakeup pipe
            rfd, wfd = os.pipe()
            os.set_blocking(rfd, False)
            os.set_blocking(wfd, False)
            p.trap._rfd, p.trap._wfd = rfd, wfd
            p.trap.install = lambda: None
            p.agreed = TimedEvent()
            p.last_seen = 1000 + (r * 7919) % 5  # the steps the training threads passed
            p.woke = None  # when its store watcher woke (the real _agree starts)

            def agree(wake: bytes, p: Any = p, real: Any = p._agree) -> None:
                p.woke = time.time()
                real(wake)
            p._agree = agree
            out.append(p)
            counters.append(cnt)
        return out, counters

    @staticmethod
    def install_all(pre: list) -> None:
        """The real ``Preemption.install()`` on every rank: the signal thread and the store
        watcher (its ``warm(2)`` and its wait)."""
        for p in pre:
            p.install()

    @staticmethod
    def armed(counters: list[Counted]) -> int:
        """Ranks whose store watcher has sent its wait."""
        return sum(c.snapshot()[2].get("wait", 0) > 0 for c in counters)

    @staticmethod
    def close_all(pre: list, limit: float = 30.0) -> int:
        """The real ``Preemption.close()`` on every rank, concurrently (each joins its two
        threads: one after another, 1024 ranks would take minutes); returns how many hung."""
        ths = [threading.Thread(target=p.close, daemon=True) for p in pre]
        for t in ths:
            t.start()
        end = time.time() + limit
        for t in ths:
            t.join(max(0.0, end - time.time()))
        return sum(t.is_alive() for t in ths)

    def phase_idle_current(self, i: int, spec: dict) -> dict:
        pre, counters = self.preemptions(spec)
        late = not self.sleep_until(spec["t0"])
        self.install_all(pre)
        self.sleep_until(spec["t_a"])
        armed = self.armed(counters)
        arm = self.totals(counters)
        before = [c.snapshot() for c in counters]
        self.sleep_until(spec["t_b"])
        res = self.totals(counters, before)
        res.update(late=late, armed=armed, arm_cmds=arm["cmds"], arm_calls=arm["calls"],
                   close_hung=self.close_all(pre))
        self.release([p.ex for p in pre])
        return res

    def phase_consensus_current(self, i: int, spec: dict) -> dict:
        pre, counters = self.preemptions(spec)
        late = not self.sleep_until(spec["t0"])
        self.install_all(pre)
        t_sig = None
        sig = spec["signaller"]
        self.sleep_until(spec["t_sig"])
        armed = self.armed(counters)
        arm = [c.snapshot() for c in counters]
        if sig == "all":  # the orchestrator signals every rank at once (srun, a pod)
            t_sig = time.time()
            for p in pre:
                p.request_stop()
        elif sig in self.ranks:
            t_sig = time.time()
            pre[self.ranks.index(sig)].request_stop()
        self.progress(i, lambda: sum(p.agreed.is_set() for p in pre), counters, spec["end"])
        self.ctl.set(f"fin/{i}/{self.wid}", b"1")  # the driver reads the server's CPU now
        unfinished = sum(not p.agreed.is_set() for p in pre)
        res = self.totals(counters, arm)  # the commands from the signal on
        per_rank = sorted(c.snapshot()[0] - a[0] for c, a in zip(counters, arm))
        res.update(t_sig=t_sig, late=late, armed=armed,
                   agreed=[p.agreed.t if p.failure is None else None for p in pre],
                   steps=[p.stop_step for p in pre], passed=[p.last_seen for p in pre],
                   woke=[p.woke for p in pre],
                   failures=[str(p.failure)[:200] for p in pre if p.failure is not None][:3],
                   n_failed=sum(p.failure is not None for p in pre), unfinished=unfinished,
                   cmds_per_rank_max=per_rank[-1] if per_rank else None,
                   cmds_per_rank_median=per_rank[len(per_rank) // 2] if per_rank else None)
        res["close_hung"] = self.close_all(pre)
        self.release([p.ex for p in pre])
        return res

    # -- commit and gather -------------------------------------------------------------------
    def run_ranks(self, i: int, spec: dict, body: Any, counters: list[Counted]) -> dict:
        """One thread per local rank running ``body(j, r)`` at its start time; (t_start,
        t_end, error) per rank. The commands before the start (warming) are not counted."""
        n = len(self.ranks)
        starts = [spec["t0"] + spec.get("spread", 0.0) * random.Random(r).random()
                  for r in self.ranks]
        ends: list[float | None] = [None] * n
        errors: list[str | None] = [None] * n
        before = [c.snapshot() for c in counters]
        late = time.time() > spec["t0"]

        def run(j: int, r: int) -> None:
            self.sleep_until(starts[j])
            starts[j] = max(starts[j], time.time())  # a late thread starts late
            try:
                body(j, r)
            except Exception as e:  # noqa: BLE001
                errors[j] = f"{type(e).__name__}: {e}"[:300]
            ends[j] = time.time()
        ths = [threading.Thread(target=run, args=(j, r), daemon=True)
               for j, r in enumerate(self.ranks)]
        for t in ths:
            t.start()
        self.progress(i, lambda: sum(e is not None for e in ends), counters, spec["end"])
        self.ctl.set(f"fin/{i}/{self.wid}", b"1")  # the driver reads the server's CPU now
        res = self.totals(counters, before)
        res.update(ranks=self.ranks, starts=starts, ends=ends, late=late,
                   errors=[e for e in errors if e][:3],
                   n_errors=sum(e is not None for e in errors),
                   unfinished=sum(t is None for t in ends),
                   ok=[e is None and t is not None for e, t in zip(errors, ends)])
        return res

    def phase_commit_current(self, i: int, spec: dict) -> dict:
        from fastckpt.engine.commit import commit
        exs = [self.exchange(c, warm=1) for c in self.clients]
        result = spec["result"]

        def body(j: int, r: int) -> None:
            commit(exs[j][0], save_id=spec["prefix"], rank=r, world_size=self.world,
                   result=result, deadline=time.monotonic() + spec["deadline_s"],
                   coordinator=lambda results: {"step": 1, "n": len(results)})
        res = self.run_ranks(i, spec, body, [c for _, c in exs])
        self.release([e for e, _ in exs])
        return res

    def groups(self, spec: dict) -> tuple[list, list]:
        """A real ``Group`` per simulated rank (each on its own client, one connection warm)
        and their command counters."""
        from fastckpt.engine.dist import Group
        groups, counters = [], []
        for r, c in zip(self.ranks, self.clients):
            g = object.__new__(Group)
            g.collective, g.rank, g.world_size = True, r, self.world
            g._prefix, g._seq = spec["prefix"], 0
            g._exchange, cnt = self.exchange(c, warm=1)
            groups.append(g)
            counters.append(cnt)
        return groups, counters

    def phase_gather_current(self, i: int, spec: dict) -> dict:
        payload = spec.get("payload")
        tree = None
        if payload is None:  # the realistic 70B entry
            tree = skeleton_tree()
        groups, counters = self.groups(spec)
        values = [payload if payload is not None else plan_entry(r, self.world, tree)
                  for r in self.ranks]

        def body(j: int, r: int) -> None:
            out = groups[j].gather(values[j], timeout_s=spec["deadline_s"], what="bench")
            assert len(out) == self.world
        res = self.run_ranks(i, spec, body, counters)
        self.release([g._exchange for g in groups])
        return res

    def phase_decide_current(self, i: int, spec: dict) -> dict:
        """fastckpt's real ``Group.decide`` with the real ``PlanExchange.decide`` on rank 0:
        the whole plan exchange of a save whose layout did not change."""
        groups, counters = self.groups(spec)
        plans = reuse_plans(self.world)

        def body(j: int, r: int) -> None:
            out = groups[j].decide(dict(REUSE_VALUE), plans.decide if r == 0 else None,
                                   timeout_s=spec["deadline_s"], what="bench")
            assert out["how"] == "reuse", out
        res = self.run_ranks(i, spec, body, counters)
        self.release([g._exchange for g in groups])
        return res

    def phase_assign_current(self, i: int, spec: dict) -> dict:
        """fastckpt's real ``Group.decide(each=True)`` with the real ``PlanExchange.assign``
        on rank 0 and ``take`` on every rank: a full plan exchange (the first save)."""
        import functools

        from fastckpt.engine.plan import PlanExchange
        groups, counters = self.groups(spec)
        tree = skeleton_tree() if spec.get("payload") is None else None
        values = (first_values(self.world, self.ranks, tree) if tree is not None else
                  [PlanExchange().full_value("0123456789ab", [], rank=r, error=None, aliases=0)
                   for r in self.ranks])
        plans = [PlanExchange() for _ in self.ranks]

        def body(j: int, r: int) -> None:
            fn = functools.partial(plans[j].assign, step=1) if r == 0 else None
            answer = groups[j].decide(values[j], fn, each=True, timeout_s=spec["deadline_s"],
                                      what="bench")
            plan = plans[j].take(answer, r, 1)
            assert plan.world_size == self.world and plans[j].how == "exchanged"
        res = self.run_ranks(i, spec, body, counters)
        self.release([g._exchange for g in groups])
        return res

    def serve(self) -> None:
        self.ctl.set(f"ready/{self.wid}", b"1")
        i = 0
        while True:
            i += 1
            self.ctl.wait([f"phase/{i}"], _td(3600))
            spec = json.loads(self.ctl.get(f"phase/{i}"))
            if spec["kind"] == "exit":
                return
            kind = spec["kind"]
            if kind == "configure":
                lo, hi = spec["bounds"][self.wid], spec["bounds"][self.wid + 1]
                res = self.configure({"world": spec["world"], "lo": lo, "hi": hi})
                self.ctl.set(f"done/{i}/{self.wid}", json.dumps(res).encode())
                continue
            fn = {"idle_current": self.phase_idle_current,
                  "consensus_current": self.phase_consensus_current,
                  "consensus_all_current": self.phase_consensus_current,
                  "commit_current": self.phase_commit_current,
                  "gather_current": self.phase_gather_current,
                  "plan_realistic": self.phase_gather_current,
                  "decide_current": self.phase_decide_current,
                  "assign_current": self.phase_assign_current,
                  "assign_realistic": self.phase_assign_current}[kind]
            t = time.time()
            res = fn(i, spec)
            res["worker_s"] = round(time.time() - t, 3)
            gc.collect()
            self.ctl.set(f"done/{i}/{self.wid}", json.dumps(res).encode())


def worker_main(a: argparse.Namespace) -> None:
    import logging
    logging.getLogger("fastckpt").setLevel(logging.ERROR)
    logging.getLogger("fastckpt.preempt").setLevel(logging.ERROR)
    threading.stack_size(512 << 10)
    Worker(a).serve()


def hammer_main(a: argparse.Namespace) -> None:
    """(ceiling) ``--threads`` clients calling one command in a loop for ``--seconds``, for
    each of CEILING_OPS in turn (the driver says go)."""
    import torch.distributed as dist
    threading.stack_size(512 << 10)
    clients = [dist.TCPStore(HOST, a.port, is_master=False, wait_for_workers=False,
                             timeout=_td(60)) for _ in range(a.threads)]
    for op, vbytes in CEILING_OPS:
        clients[0].set(f"v{vbytes}", b"x" * vbytes)
        counts = [0] * a.threads
        go = threading.Event()

        def run(j: int) -> None:
            c = clients[j]
            key = f"v{vbytes}"
            go.wait()
            end = time.time() + a.seconds
            n = 0
            while time.time() < end:
                if op == "add":
                    c.add("n", 0)
                elif op == "get":
                    c.get(key)
                else:
                    c.check([key])
                n += 1
            counts[j] = n
        ths = [threading.Thread(target=run, args=(j,)) for j in range(a.threads)]
        for t in ths:
            t.start()
        print("ready", flush=True)
        sys.stdin.readline()
        go.set()
        for t in ths:
            t.join()
        print(json.dumps({"calls": sum(counts)}), flush=True)


# ----------------------------------------------------------------------------- driver

def proc_cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class Job:
    """The store server and ``procs`` worker processes; ``configure(world)`` spreads a job of
    ``world`` simulated ranks over the workers (the connections stay open between jobs)."""

    def __init__(self, procs: int, env: dict) -> None:
        import torch.distributed as dist
        self.env = env
        self.server = subprocess.Popen([sys.executable, __file__, "--_server"], env=env,
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.port = int(self.server.stdout.readline())
        self.ctl = dist.TCPStore(HOST, self.port, is_master=False, wait_for_workers=False,
                                 timeout=_td(3600))
        t = time.time()
        self.workers = [subprocess.Popen(
            [sys.executable, __file__, "--_worker", "--port", str(self.port), "--wid", str(w)],
            env=env) for w in range(procs)]
        self.ctl.wait([f"ready/{w}" for w in range(procs)], _td(300))
        self.start_s = time.time() - t
        self.i = 0
        self.world = 0

    def configure(self, world: int) -> float:
        k = len(self.workers)
        bounds = [world * w // k for w in range(k + 1)]
        t = time.time()
        res, _ = self.run({"kind": "configure", "world": world, "bounds": bounds}, 600)
        if res is None:
            raise RuntimeError(f"configuring {world} ranks failed")
        self.world = world
        return time.time() - t

    def server_cpu(self) -> float:
        self.server.stdin.write("cpu\n")
        self.server.stdin.flush()
        return json.loads(self.server.stdout.readline())["cpu"]

    def workers_cpu(self) -> float:
        return sum(proc_cpu(p.pid) for p in self.workers)

    def run(self, spec: dict, cap: float) -> tuple[list[dict] | None, dict]:
        """Run one phase; (per-worker results or None if capped, server/worker CPU)."""
        self.i += 1
        i = self.i
        s0, w0, t0 = self.server_cpu(), self.workers_cpu(), time.time()
        self.ctl.set(f"phase/{i}", json.dumps(spec).encode())
        keys = [f"done/{i}/{w}" for w in range(len(self.workers))]
        window = mark = fin = None
        if "t_mark" in spec:  # the server's CPU from the signal / the start on
            time.sleep(max(0.0, spec["t_mark"] - time.time()))
            mark = self.server_cpu()
            try:  # until every worker's ranks finished (before they close their connections)
                self.ctl.wait([f"fin/{i}/{w}" for w in range(len(self.workers))],
                              _td(cap - (time.time() - t0)))
                fin = self.server_cpu()
            except Exception:
                fin = None
        if "t_a" in spec:  # idle phases: the server's CPU over the window only
            time.sleep(max(0.0, spec["t_a"] - time.time()))
            sa, wa = self.server_cpu(), self.workers_cpu()
            time.sleep(max(0.0, spec["t_b"] - time.time()))
            window = self.server_cpu() - sa
            wwindow = self.workers_cpu() - wa
        try:
            self.ctl.wait(keys, _td(cap - (time.time() - t0)))
            out = [json.loads(v) for v in self.ctl.multi_get(keys)]
        except Exception:
            out = None
        s1 = self.server_cpu()
        cpu = {"server_cpu_s": s1 - s0, "workers_cpu_s": self.workers_cpu() - w0,
               "wall_s": time.time() - t0}
        if mark is not None:
            # the protocol's: from the signal / the start until every rank finished (not the
            # close of the phase's triggers and connections that follows)
            cpu["server_cpu_after_mark_s"] = (fin if fin is not None else s1) - mark
            cpu["server_cpu_incl_close_s"] = s1 - mark
        if window is not None:
            cpu["server_cpu_window_s"] = window
            cpu["workers_cpu_window_s"] = wwindow
        if out is None:
            prog = []
            for w in range(len(self.workers)):
                try:
                    if self.ctl.check([f"prog/{i}/{w}"]):
                        prog.append(json.loads(self.ctl.get(f"prog/{i}/{w}")))
                except Exception:
                    pass
            cpu["progress"] = {"done": sum(p["done"] for p in prog),
                               "cmds": sum(p["cmds"] for p in prog), "workers": len(prog)}
        return out, cpu

    def close(self, force: bool = False) -> None:
        if getattr(self, "closed", False):
            return
        self.closed = True
        if not force:
            self.i += 1
            try:
                self.ctl.set(f"phase/{self.i}", json.dumps({"kind": "exit"}).encode())
            except Exception:
                force = True
        for p in self.workers:
            try:
                p.wait(5 if not force else 0.01)
            except subprocess.TimeoutExpired:
                pass
            if p.poll() is None:
                p.kill()
                p.wait()
        try:
            self.server.stdin.close()
            self.server.wait(5)
        except Exception:
            self.server.kill()
            self.server.wait()


def _lat(res: list[dict], world: int) -> dict:
    """Consensus phases: latency from the request to each rank's agreement on T."""
    t_sig = min((r["t_sig"] for r in res if r.get("t_sig") is not None), default=None)
    agreed = [t for r in res for t in r["agreed"]]
    steps = {s for r in res for s in r["steps"]}
    passed = [s for r in res for s in r["passed"]]
    done = sorted(t for t in agreed if t is not None)
    out: dict[str, Any] = {
        "knew_T": len(done), "of": world, "n_failed": sum(r.get("n_failed", 0) for r in res),
        "armed_at_signal": sum(r.get("armed", 0) for r in res),
        "stop_steps": sorted(s for s in steps if s is not None),
        "expected_T": max(passed) + 1 if passed else None,
        "late_start": any(r.get("late") for r in res),
        "cmds_per_rank_max": max((r.get("cmds_per_rank_max") or 0) for r in res),
        "failures": [f for r in res for f in r.get("failures", [])][:3]}
    woke = sorted(t for r in res for t in r.get("woke", []) if t is not None)
    if woke and t_sig is not None:  # the store watchers' wake-ups (the start of _agree)
        out["woken"] = len(woke)
        out["woke_median_s"] = round(woke[len(woke) // 2] - t_sig, 4)
        out["woke_last_s"] = round(woke[-1] - t_sig, 4)
    if done and t_sig is not None:
        out["first_s"] = round(done[0] - t_sig, 4)
        out["median_s"] = round(done[len(done) // 2] - t_sig, 4)
        out["last_s"] = round(done[-1] - t_sig, 4) if len(done) == world else None
    return out


def summarize_phase(kind: str, spec: dict, res: list[dict] | None, cpu: dict,
                    world: int) -> dict:
    out: dict[str, Any] = {"server_cpu_s": round(cpu["server_cpu_s"], 4),
                           "workers_cpu_s": round(cpu["workers_cpu_s"], 3),
                           "wall_s": round(cpu["wall_s"], 3)}
    if "server_cpu_after_mark_s" in cpu:
        out["server_cpu_protocol_s"] = round(cpu["server_cpu_after_mark_s"], 4)
        out["server_cpu_incl_close_s"] = round(cpu["server_cpu_incl_close_s"], 4)
    out["deadline_s"] = spec["deadline_s"]
    if res is None:
        out.update(stuck=True, progress=cpu.get("progress"))
        return out
    cmds = sum(r["cmds"] for r in res)
    nbytes = sum(r["bytes"] for r in res)
    calls: dict[str, int] = {}
    for r in res:
        for k, v in r["calls"].items():
            calls[k] = calls.get(k, 0) + v
    out.update(commands=cmds, bytes=nbytes, calls=calls,
               commands_per_rank=round(cmds / world, 2))
    unfinished = sum(r.get("unfinished", 0) for r in res)
    if unfinished:
        out["unfinished"] = unfinished
    hung = sum(r.get("close_hung", 0) for r in res)
    if hung:
        out["close_hung"] = hung
    if cmds:
        out["server_us_per_cmd"] = round(
            1e6 * cpu.get("server_cpu_window_s", cpu["server_cpu_s"]) / cmds, 2)
    if kind.startswith("idle"):
        w = spec["t_b"] - spec["t_a"]
        arm_calls: dict[str, int] = {}
        for r in res:
            for k, v in r.get("arm_calls", {}).items():
                arm_calls[k] = arm_calls.get(k, 0) + v
        out.update(window_s=w, cmds_per_s=round(cmds / w, 1),
                   server_cpu_frac=round(cpu["server_cpu_window_s"] / w, 3),
                   workers_cpu_frac=round(cpu["workers_cpu_window_s"] / w, 2),
                   armed=sum(r.get("armed", 0) for r in res),
                   late_start=any(r.get("late") for r in res),
                   arm_commands=sum(r.get("arm_cmds", 0) for r in res), arm_calls=arm_calls)
        out["demanded_cmds_per_s"] = 0.0  # no store probe left in the trigger
    elif kind.startswith("consensus"):
        out.update(_lat(res, world))
        out["deadline_s"] = spec["deadline_s"]
    else:
        starts, ends, ok = {}, {}, {}
        for r in res:
            for rank, s0, e, k in zip(r["ranks"], r["starts"], r["ends"], r["ok"]):
                starts[rank], ends[rank], ok[rank] = s0, e, k
        out["n_errors"] = sum(r["n_errors"] for r in res)
        out["errors"] = [e for r in res for e in r["errors"]][:3]
        out["late_start"] = any(r.get("late") for r in res)
        out["deadline_s"] = spec["deadline_s"]
        if not starts:
            return out
        slowest = max(starts.values())
        good = [e for rank, e in ends.items() if ok[rank]]
        others = [e for rank, e in ends.items() if rank != 0 and ok[rank]]
        if kind.startswith("commit"):
            if len(others) == world - 1 and others:
                out["verdict_all_s"] = round(max(others) - slowest, 4)
            if ok.get(0):
                out["coordinator_s"] = round(ends[0] - slowest, 4)
            if len(good) == world:
                out["beyond_slowest_s"] = round(max(good) - slowest, 4)
        elif len(good) == world:
            out["all_have_plan_s"] = round(max(good) - slowest, 4)
            if others:
                out["all_but_rank0_s"] = round(max(others) - slowest, 4)
            if ok.get(0):
                out["rank0_s"] = round(ends[0] - slowest, 4)
        out["ok_ranks"] = len(good)
    return out


def phase_spec(kind: str, world: int, a: argparse.Namespace, tag: str) -> dict:
    """A phase's parameters. Every protocol runs under its own deadline ``a.cap`` (the real
    code's: the consensus gives up at the grace deadline less the margin, the commit at its
    deadline, the gather at its timeout), so a phase that cannot finish ends by itself, and
    the summary says how far it got. ``end``: when the workers stop waiting for their ranks."""
    lead = (0.3 if a.quick else 0.5) + world / 2000  # objects, threads built before t0
    arm = (0.3 if a.quick else 0.5) + world / 2000  # the triggers' install: threads, clones
    now = time.time()
    cap = a.cap
    # the all-to-all gather's client side (N ranks parsing N values each) is N^2 Python work on
    # this VM's 2 cores; at 4096 it gets a longer cap and the summary says how far it got
    heavy = kind in HEAVY_CURRENT and world >= 1024
    if heavy and world >= 4096:
        cap = max(cap, 20.0)
    t0 = now + lead
    spec: dict[str, Any] = {"kind": kind, "prefix": f"{kind}/{tag}", "t0": t0,
                            "deadline_s": cap, "grace_s": cap}
    if kind.startswith("idle"):
        spec["t_a"] = t0 + arm
        spec["t_b"] = spec["t_a"] + a.window
        spec["end"] = spec["t_b"] + 5.0 + world / 200
        spec["grace_s"] = 600.0
    elif kind.startswith("consensus"):
        spec["t_sig"] = t0 + arm
        spec["signaller"] = "all" if kind == "consensus_all_current" else world - 1
        # consensus.collect gives up at the grace deadline less preempt_margin_s (1 s)
        spec["grace_s"] = cap + 1.0
        spec["end"] = spec["t_sig"] + cap + 3
    elif kind.startswith("commit"):
        spec["spread"] = a.spread
        spec["result"] = {"ok": True, "files": [{"file": "r00000-0123456789ab-0000.shard",
                                                 "piece": 0, "size": 1 << 30, "chunks": []}]}
        spec["end"] = t0 + a.spread + cap + 8
    else:
        if kind in ("gather_current", "assign_current"):
            spec["payload"] = {"save_id": "0123456789ab", "specs": [], "tree": None,
                               "error": None, "aliases": 0}
        elif kind in ("plan_realistic", "assign_realistic"):
            spec["payload"] = None
        spec["end"] = t0 + cap + 5
    spec["cap"] = spec["end"] - now + 15  # the driver's wait for the workers (they close)
    if not kind.startswith("idle"):
        spec["t_mark"] = spec.get("t_sig", t0) - 0.02
    return spec


def run_world(job: "Job", world: int, a: argparse.Namespace, env: dict,
              phases: list[str], last: bool = False) -> tuple["Job", dict]:
    out: dict[str, Any] = {"world": world, "phases": {}}
    out["connect_s"] = round(job.configure(world), 2)
    print(f"N={world}: {len(job.workers)} worker processes, {world} clients "
          f"({out['connect_s']:.1f} s to open what was missing)", flush=True)
    for kind in phases:
        if a.quick and world >= 1024 and kind in HEAVY_CURRENT:
            print(f"  {kind:18s} skipped (--quick, N >= 1024)", flush=True)
            continue
        reps = a.reps if kind in ("consensus_current", "consensus_all_current",
                                  "commit_current") else 1
        rows = []
        for rep in range(reps):
            spec = phase_spec(kind, world, a, f"{world}.{rep}")
            res, cpu = job.run(spec, spec["cap"] + 15)
            row = summarize_phase(kind, spec, res, cpu, world)
            row["loadavg_1m"] = round(os.getloadavg()[0], 1)
            rows.append(row)
            print(f"  {kind:18s} rep {rep}: " + ", ".join(
                f"{k}={v}" for k, v in row.items()
                if k not in ("calls", "errors", "stop_steps", "failures", "arm_calls")),
                flush=True)
            if res is None or row.get("unfinished") or row.get("close_hung"):
                # threads may still run: start afresh
                job.close(force=True)
                if not (last and kind == phases[-1]):
                    time.sleep(2.0)  # the killed processes' sockets are torn down
                    job = Job(a.procs, env)
                    job.configure(world)
                break
        out["phases"][kind] = rows
    return job, out




CEILING_OPS = (("add", 0), ("check", 16), ("get", 700_000))


def ceiling(a: argparse.Namespace, env: dict) -> dict:
    """The server's throughput and CPU per command here: 2 client processes x 8 threads
    calling one command in a loop (add; check of one key; get of a 700 kB value)."""
    out = {}
    server = subprocess.Popen([sys.executable, __file__, "--_server"], env=env,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    port = server.stdout.readline().strip()
    secs = 0.5 if a.quick else 2.0
    hs = [subprocess.Popen([sys.executable, __file__, "--_hammer", "--port", port,
                            "--threads", "8", "--seconds", str(secs)], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
          for _ in range(2)]

    def scpu() -> float:
        server.stdin.write("cpu\n")
        server.stdin.flush()
        return json.loads(server.stdout.readline())["cpu"]
    for op, vbytes in CEILING_OPS:
        for h in hs:
            h.stdout.readline()  # ready
        c0 = scpu()
        for h in hs:
            h.stdin.write("go\n")
            h.stdin.flush()
        calls = sum(json.loads(h.stdout.readline())["calls"] for h in hs)
        cpu = scpu() - c0
        cmds = calls * COMMANDS[op]
        out[op] = {"value_bytes": vbytes, "calls": calls, "commands": cmds, "seconds": secs,
                   "cmds_per_s": round(cmds / secs), "server_cpu_s": round(cpu, 3),
                   "server_cpu_frac": round(cpu / secs, 3),
                   "server_us_per_cmd": round(1e6 * cpu / cmds, 2),
                   "ceiling_cmds_per_s": round(cmds / cpu) if cpu > 0 else None}
        if vbytes > 1000:
            out[op]["server_mb_per_cpu_s"] = round(calls * vbytes / 1e6 / cpu, 1)
        print(f"ceiling {op}: {out[op]}", flush=True)
    for h in hs:
        h.wait()
    import torch.distributed as dist
    c = dist.TCPStore(HOST, int(port), is_master=False, wait_for_workers=False, timeout=_td(60))
    for _ in range(200):
        c.add("rtt", 0)
    t = time.perf_counter()
    for _ in range(2000):
        c.add("rtt", 0)
    out["rtt_us"] = round((time.perf_counter() - t) / 2000 * 1e6, 1)
    print(f"one client's add round trip here: {out['rtt_us']} us", flush=True)
    del c
    server.stdin.close()
    server.wait()
    return out


def plan_cpu(worlds: list[int]) -> dict:
    """Client-side cost of the plan exchange's payload: entry size, json.loads of one entry,
    and the real ``make_plan`` over N entries (rank 0 runs it once, on a full exchange)."""
    from fastckpt.engine.plan import make_plan
    tree = skeleton_tree()
    out: dict[str, Any] = {"tensors": len(model_tensors()), "params": param_count()}
    e = json.dumps(plan_entry(0, 64, tree)).encode()
    t = time.perf_counter()
    for _ in range(5):
        json.loads(e)
    out["entry_bytes_at_64"] = len(e)
    out["specs_per_rank"] = len(plan_entry(0, 64, tree)["specs"])
    out["tree_bytes"] = len(json.dumps(tree))
    out["loads_s_per_entry"] = round((time.perf_counter() - t) / 5, 4)
    out["make_plan"], out["manifest"] = {}, {}
    for n in worlds:
        raw = [json.dumps(plan_entry(r, n, tree)).encode() for r in range(n)]
        t = time.perf_counter()
        gathered = [json.loads(x) for x in raw]
        t1 = time.perf_counter()
        make_plan(gathered, 0, 1)
        t2 = time.perf_counter()
        out["make_plan"][n] = {"entry_bytes": round(sum(map(len, raw)) / n),
                               "loads_s": round(t1 - t, 3), "make_plan_s": round(t2 - t1, 3)}
        print(f"plan payload N={n}: {out['make_plan'][n]}", flush=True)
        out["manifest"][n] = manifest_cost(n, gathered, tree)
        print(f"commit payload N={n}: {out['manifest'][n]}", flush=True)
        out.setdefault("reuse", {})[n] = reuse_cost(n, gathered)
        print(f"plan reuse N={n}: {out['reuse'][n]}", flush=True)
        del raw, gathered
    return out


def reuse_cost(n: int, gathered: list) -> dict:
    """fastckpt's real ``PlanExchange`` with the 70B entries: the first save (the verdict
    round, then the chunk lists to rank 0 alone, which parses N of them, plans every rank with
    ``assign`` and answers each rank with its own part, which that rank turns into its plan with
    ``take``) against a later save whose layout did not change (every rank's compact value to
    rank 0, whose ``decide`` answers "reuse"). Bytes of one rank's values, rank 0's
    ``json.loads`` of N values + ``assign`` or ``decide``, one rank's own ``value`` (hashing its
    layout) and ``apply``."""
    from fastckpt.engine.plan import PlanExchange
    specs = [g["specs"] for g in gathered]
    ex = PlanExchange()
    firsts = [json.dumps(v).encode() for v in first_values(n, range(n), None)]
    ex.value("0123456789ab", plan_entry(0, n, None, True)["specs"], error=None, aliases=0)
    ex.decide([json.loads(firsts[0])])  # (rank 0's own value: its table and list kept)
    ex.full_value("0123456789ab", plan_entry(0, n, None, True)["specs"], rank=0, error=None,
                  aliases=0)
    t = time.perf_counter()
    got = [json.loads(x) for x in firsts]
    common, parts = ex.assign(got, 1)
    t1 = time.perf_counter()
    sent = [json.dumps(p).encode() for p in parts]
    t_enc = time.perf_counter() - t1
    ex.take((common, parts[0]), 0, 1)
    assert ex.how == "exchanged"
    other = PlanExchange()
    other.full_value("0123456789ab", plan_entry(n - 1, n, None, True)["specs"], rank=n - 1,
                     error=None, aliases=0)  # (its own chunks, which take merges in)
    t_take = time.perf_counter()
    other.take((json.loads(json.dumps(common)), json.loads(sent[-1])), n - 1, 1)
    t_take = time.perf_counter() - t_take
    # every rank's value after the first exchange (each rank's PlanExchange holds the same
    # base and, under FSDP, the same watched places as rank 0's)
    later = [json.dumps(ex.value("0123456789ac", specs[r], error=None, aliases=0)).encode()
             for r in range(n)]
    t2 = time.perf_counter()
    verdict = ex.decide([json.loads(x) for x in later])
    t3 = time.perf_counter()
    assert verdict["how"] == "reuse", verdict
    t4 = time.perf_counter()
    ex.value("0123456789ad", specs[0], error=None, aliases=0)
    ex.apply(verdict, 2)
    own_s = time.perf_counter() - t4
    return {"first_value_bytes": round(sum(map(len, firsts)) / n),
            "first_rank0_loads_and_assign_s": round(t1 - t, 3),
            "first_rank0_encode_parts_s": round(t_enc, 3),
            "first_part_bytes": round(sum(map(len, sent)) / n),
            "first_other_rank_take_s": round(t_take, 4),
            "reused_value_bytes": round(sum(map(len, later)) / n),
            "verdict_bytes": len(json.dumps({"ok": verdict})),
            "reused_rank0_loads_and_decide_s": round(t3 - t2, 4),
            "own_value_and_apply_s": round(own_s, 4)}


def assign_cost(worlds: list[int], old_max: int = 256, reps: int = 3,
                rng: bool = False, pp: int = 1) -> dict:
    """Rank 0's side of a first save's full plan exchange with the 70B entries, alone (no
    store): ``json.loads`` of the N values as they arrive + the real ``PlanExchange.assign`` +
    encoding the N parts. ``now``: the values ``PlanExchange.full_value`` sends (the shards
    each rank alone holds stay with it; a table or list equal to rank 0's goes as None);
    ``all_lists`` (N <= ``old_max``): every rank's full chunk list, as before 2026-12-05,
    through the same code. Interleaved, ``reps`` each, median. ``rng``: every rank also holds
    its own RNG state (per rank: its list differs from rank 0's by that fingerprint). ``pp``:
    pipeline stages (``plan_entry``)."""
    from fastckpt.engine.plan import PlanExchange
    out: dict = {}
    for n in worlds:
        t = time.perf_counter()
        now = [json.dumps(v).encode() for v in first_values(n, range(n), None, rng, pp)]
        setup = time.perf_counter() - t
        old = None
        if n <= old_max:
            old = [json.dumps({"save_id": "0123456789ab", "hash": v["hash"],
                               "specs": plan_entry(r, n, None, rng=rng, pp=pp)["specs"],
                               "error": None,
                               "aliases": 0}).encode()
                   for r, v in enumerate(json.loads(x) for x in now)]
        zero = plan_entry(0, n, None, True, rng, pp)["specs"]
        res: dict = {"now": [], "all_lists": []}
        for _ in range(reps):
            for kind, raw in (("now", now), ("all_lists", old)):
                if raw is None:
                    continue
                ex = PlanExchange()
                ex.value("0123456789ab", zero, error=None, aliases=0)
                ex.full_value("0123456789ab", zero, rank=0, error=None, aliases=0)
                values = common = parts = sent = None  # (the last contender's: not alive)
                gc.collect()
                t = time.perf_counter()
                values = [json.loads(x) for x in raw]
                t1 = time.perf_counter()
                common, parts = ex.assign(values, 1)
                t2 = time.perf_counter()
                sent = [json.dumps(p).encode() for p in parts]
                t3 = time.perf_counter()
                res[kind].append({"loads_s": t1 - t, "assign_s": t2 - t1, "encode_s": t3 - t2,
                                  "total_s": t3 - t})
                res[kind + "_bytes_in"] = sum(map(len, raw))
                res[kind + "_bytes_out"] = sum(map(len, sent))
        row = {"setup_s": round(setup, 1)}
        for kind in ("now", "all_lists"):
            if res[kind]:
                row[kind] = {k: round(statistics.median(x[k] for x in res[kind]), 4)
                             for k in res[kind][0]}
                row[kind]["bytes_in"] = res[kind + "_bytes_in"]
                row[kind]["bytes_out"] = res[kind + "_bytes_out"]
        out[n] = row
        print(f"assign N={n}: {row}", flush=True)
        del now, old
    return out


def manifest_cost(n: int, gathered: list, tree: Any) -> dict:
    """The coordinator's side of the commit with realistic results: N results through the
    store (bytes), parsed, and the real ``Writer._coordinate`` building and encoding the
    manifest (its publish captured, nothing written); one self-contained manifest (format
    1-3) and per-rank chunk indexes (format 4, ``rank_indexes``: each rank encodes its own
    index, its result names it), with every rank's skeleton and with rank 0's alone (what
    fastckpt sends when the skeleton hashes agreed). Then a reader's side: turning the manifest bytes (and, for
    format 4, the N index files' bytes, in memory) into the validated body every load plans
    from (``decode_manifest`` / ``index.expand``)."""
    import dataclasses

    from fastckpt.engine.plan import make_plan
    from fastckpt.engine.writer import Writer
    from fastckpt.manifest import index as idx
    plan = make_plan(gathered, 0, 1)
    entries = [result_entry(r, n) for r in range(n)]

    def coordinate(raw: list[bytes], plan: Any) -> tuple[float, float, bytes]:
        t = time.perf_counter()
        results = [json.loads(x) for x in raw]
        t1 = time.perf_counter()
        got: dict[str, bytes] = {}
        keep = lambda path, data: got.__setitem__("data", data)  # noqa: E731
        st = SimpleNamespace(publish=keep, publish_manifest=keep)
        job = SimpleNamespace(plan=plan, step_dir="step-1", user_meta={}, files=None)
        Writer._coordinate(SimpleNamespace(lease=None), job, results, st)
        return t1 - t, time.perf_counter() - t1, got["data"]

    # each result carries its rank's skeleton (the coordinator's only copy of it)
    raw = [json.dumps({**e, "tree": tree}).encode() for e in entries]
    loads_s, coord_s, data = coordinate(raw, plan)
    t = time.perf_counter()
    fmt.decode_manifest(data, file="manifest.json")
    read_s = time.perf_counter() - t
    out = {"result_bytes_per_rank": round(sum(map(len, raw)) / n),
           "results_loads_s": round(loads_s, 3), "coordinate_s": round(coord_s, 3),
           "manifest_bytes": len(data), "reader_decode_s": round(read_s, 3)}
    # format 4: every rank encodes its own index (timed on rank 0's, all alike under FSDP)
    t = time.perf_counter()
    docs = [idx.encode_index(r, "0123456789ab", e["files"]) for r, e in enumerate(entries)]
    encode_s = (time.perf_counter() - t) / n

    sharded = {fqn for fqn, m in plan.tensors.items() if m["dtensor"]}

    def raw4(shared: bool) -> list[bytes]:
        # as Writer sends them: names and sizes, the index entry, the chunks of tensors that
        # are not DTensor shards (listed inline by the coordinator, format 5)
        return [json.dumps({"ok": True, "files": [
            {k: f[k] for k in ("file", "piece", "size")} for f in e["files"]],
            "index": {"file": idx.index_name(r, "0123456789ab"), **entry},
            "inline": [{**c, "file": f["file"]} for f in e["files"] for c in f["chunks"]
                       if c["fqn"] not in sharded],
            **({"tree": tree} if r == 0 or not shared else {})}).encode()
            for r, (e, (_, entry)) in enumerate(zip(entries, docs))]
    # every rank's skeleton (as before skeletons were sent once), then what fastckpt sends
    # under FSDP: rank 0's alone (their hashes agreed at the plan exchange)
    all_trees = raw4(False)
    loads_t, coord_t, _ = coordinate(all_trees, dataclasses.replace(plan, indexed=True))
    shared = raw4(True)
    loads4_s, coord4_s, data4 = coordinate(shared, dataclasses.replace(
        plan, indexed=True, same_tree=True))
    t = time.perf_counter()
    body = fmt.decode_manifest(data4, file="manifest.json")
    t1 = time.perf_counter()
    idx.expand(body, [d for d, _ in docs], file="manifest.json", step_dir="step-1")
    t2 = time.perf_counter()
    # a restart at the saved world size: a rank decodes the manifest and merges its own index
    # (rank n // 2: a middle rank); the merged body's chunks, its own plus the inline ones
    own = n // 2
    body = fmt.decode_manifest(data4, file="manifest.json")
    part = idx.expand(body, [d if r == own else None for r, (d, _) in enumerate(docs)],
                      file="manifest.json", step_dir="step-1", own=frozenset({own}))
    t3 = time.perf_counter()
    # a restart on half the nodes (M = N/2, FSDP2's even split on dim 0): a middle rank's
    # boxes, the saving ranks whose indexes hold them (index.writers_of), those merged
    m, mr = max(1, n // 2), max(1, n // 2) // 2
    boxes = {}
    for fqn, tt in body["tensors"].items():
        shape = tt["shape"]
        if fqn in body.get("inline", {}) or not shape:
            continue
        rows = -(-shape[0] // m)
        lo = min(shape[0], mr * rows)
        boxes[fqn] = (tuple([lo] + [0] * (len(shape) - 1)),
                      tuple([min(shape[0], lo + rows) - lo] + list(shape[1:])),
                      ((m,), (("S", 0),)))
    t4 = time.perf_counter()
    sel = idx.writers_of(body, boxes)
    half = idx.expand(fmt.decode_manifest(data4, file="manifest.json"),
                      [d if r in sel else None for r, (d, _) in enumerate(docs)],
                      file="manifest.json", step_dir="step-1", own=sel)
    t5 = time.perf_counter()
    pick = step_pick_cost(data4, docs)
    inline_chunks = sum(len(cs) for cs in body.get("inline", {}).values())
    out["indexed"] = {"index_bytes_per_rank": round(sum(len(d) for d, _ in docs) / n),
                      "rank_encode_index_s": round(encode_s, 4),
                      "every_tree": {"result_bytes_per_rank": round(sum(map(len, all_trees)) / n),
                                     "results_loads_s": round(loads_t, 3),
                                     "coordinate_s": round(coord_t, 3)},
                      "result_bytes_per_rank": round(sum(map(len, shared)) / n),
                      "results_loads_s": round(loads4_s, 3), "coordinate_s": round(coord4_s, 3),
                      "manifest_bytes": len(data4), "reader_decode_s": round(t1 - t, 3),
                      "reader_expand_s": round(t2 - t1, 3),
                      "inline_chunks": inline_chunks,
                      "reader_own_s": round(t3 - t2, 3),
                      "reader_own_chunks": sum(len(t["chunks"])
                                               for t in part["tensors"].values()),
                      "reader_half_world": {"world": m, "rank": mr, "indexes_read": len(sel),
                                            "s": round(t5 - t4, 3),
                                            "chunks": sum(len(tt["chunks"])
                                                          for tt in half["tensors"].values())},
                      "step_pick": pick}
    return out


def step_pick_cost(data: bytes, docs: list) -> dict:
    """What picking the step to resume costs (``fastckpt resume``, ``ls``: one process; under
    srun, once per rank): the manifest and its N index files written to a local step directory,
    then ``find_step`` reading and merging every index (before 2026-12-06) against
    ``newest_committed`` (the manifest and one listing: each index there with its pinned
    size). Page cache warm (the files were just written): the reading side's CPU, not a
    disk's. Medians of 3, interleaved.

    And ``fastckpt gc --keep 1``'s plan over four such steps: every index of every step read
    (``describe_steps``' reading mode, what gc decided on before 2026-12-06) against
    ``plan_gc`` (the newest step's indexes read, the older steps listed)."""
    import shutil
    import tempfile

    from fastckpt.manifest import index as idx
    from fastckpt.manifest.discovery import find_step
    from fastckpt.storage import open_storage
    from fastckpt.tools import describe_steps, newest_committed
    from fastckpt.tools.gc import plan_gc
    tmp = tempfile.mkdtemp(prefix="fastckpt-pick-")
    try:
        d = os.path.join(tmp, fmt.step_dirname(1))
        os.makedirs(d)
        save_id = json.loads(data)["body"]["save_id"]
        for r, (doc, _) in enumerate(docs):
            with open(os.path.join(d, idx.index_name(r, save_id)), "wb") as f:
                f.write(doc)
        with open(os.path.join(d, fmt.MANIFEST), "wb") as f:
            f.write(data)
        st = open_storage(tmp)
        every, listed = [], []
        for _ in range(3):
            t = time.perf_counter()
            find_step(st)
            every.append(time.perf_counter() - t)
            t = time.perf_counter()
            newest_committed(st)
            listed.append(time.perf_counter() - t)
        # steps 2-4: the same files, the manifest's step edited (and re-checksummed)
        for step in (2, 3, 4):
            sd = os.path.join(tmp, fmt.step_dirname(step))
            shutil.copytree(d, sd)
            doc = json.loads(data)
            doc["body"]["step"] = step
            doc["checksum"] = fmt._body_checksum(doc["body"])
            with open(os.path.join(sd, fmt.MANIFEST), "w") as f:
                json.dump(doc, f)
        gc_every, gc_plan = [], []
        for _ in range(3):
            t = time.perf_counter()
            recs = describe_steps(st)
            gc_every.append(time.perf_counter() - t)
            t = time.perf_counter()
            acts = plan_gc(st, 1)
            gc_plan.append(time.perf_counter() - t)
        assert [r.state for r in recs] == ["committed"] * 4, recs
        assert [a.remove for a in acts] == [True, True, True, False], acts
        return {"every_index_s": round(statistics.median(every), 3),
                "listed_s": round(statistics.median(listed), 4),
                "gc_keep1_of_4": {"every_index_s": round(statistics.median(gc_every), 3),
                                  "plan_gc_s": round(statistics.median(gc_plan), 3)},
                "index_bytes": sum(len(doc) for doc, _ in docs)}
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def realistic_gather(job: "Job", worlds: list[int], a: argparse.Namespace,
                     kind: str = "plan_realistic") -> dict:
    """The real Group.gather (``plan_realistic``) or the real full plan exchange through rank 0
    (``assign_realistic``) with the 70B entries (~0.36-0.7 MB each) at small N."""
    out = {}
    for n in worlds:
        job.configure(n)
        spec = phase_spec(kind, n, a, f"real{n}")
        shift = 2.0 + n / 8  # building the skeleton and the entries
        for k in ("t0", "t_mark", "end", "cap"):
            spec[k] += shift
        res, cpu = job.run(spec, spec["cap"])
        row = summarize_phase("gather", spec, res, cpu, n)
        out[n] = row
        print(f"{kind}, realistic entries, N={n}: " + ", ".join(
            f"{k}={v}" for k, v in row.items() if k not in ("calls", "errors")), flush=True)
    return out


# ------------------------------------------------------------------------- models, table

def gather_model(plan: dict, ceil: dict, worlds: list[int]) -> dict:
    """The current plan exchange with realistic entries at N ranks, from measured parts: the
    server moves N^2 entries (N readers x N values; server CPU per MB from the ceiling's get),
    its command count 3N^2 + O(N) (server CPU per command from the ceiling's check), each rank
    parses N entries and runs make_plan over N x 2892 specs (both linear in N, measured)."""
    mb_per_s = ceil["get"]["server_mb_per_cpu_s"]
    us_cmd = ceil["check"]["server_us_per_cmd"]
    mp = plan["make_plan"]
    n_ref = max(int(k) for k in mp)
    per_n_client = (mp[n_ref]["loads_s"] + mp[n_ref]["make_plan_s"]) / n_ref
    out = {}
    for n in worlds:
        entry = json.dumps(plan_entry(0, n, [])).__len__() + plan["tree_bytes"]
        server_s = n * n * entry / 1e6 / mb_per_s + 3 * n * n * us_cmd / 1e6
        client_s = per_n_client * n
        # the server's work and each rank's parse + make_plan overlap at best: the larger is
        # a lower bound, their sum what a rank sees if they do not overlap at all
        out[n] = {"entry_bytes": entry, "bytes_through_server": n * n * entry,
                  "bytes_per_rank": n * entry, "server_cpu_s": round(server_s, 2),
                  "per_rank_parse_plan_s": round(client_s, 2),
                  "lower_bound_s": round(max(server_s, client_s), 2),
                  "no_overlap_s": round(server_s + client_s, 2)}
    return out


#: assumed round trip from a rank to the store on rank 0's host in a real cluster (kernel TCP
#: inside a data centre; this VM's loopback, gVisor's network stack, is measured as rtt_us)
CLUSTER_RTT_US = 50.0


def critical_rounds(kind: str, world: int) -> float:
    """Sequential store round trips on the critical path of fastckpt's protocols (b = multi_get
    batches of 1024 keys; a set seen by a waiter = one round trip: the set's way there and the
    wait's answer back; get and multi_get = WAIT + the read: 2):

    consensus: the signaller's ``add signalled`` (1), its wake ``multi_set`` + the watcher's
      wait answering (1), its ``multi_get`` of the wake value (2), ``append`` + ``add`` (1),
      the last reporter's ``get reports`` (2), ``set reports/all`` + the waits answering (1),
      ``multi_get`` (2): 10 (the signaller's wake ``multi_set`` of all N keys, one per 1024,
      is sent without a reply: store CPU, counted in the measured server CPU); every rank
      signalled at once (``consensus_all_current``): the same path;
    commit (until the coordinator is done): last result set + the coordinator's wait (1),
      multi_get 2b, outcome set + the waits (1), multi_get (2), delete (1), append + add (1),
      acked set + the coordinator's wait (1), 4 deletes (4): 11 + 2b;
    gather (every rank but 0): last value set + the waits (1), multi_get 2b, add (1): 2 + 2b
      (rank 0 then waits for ``done`` and deletes the N + 2 keys one by one: N + 3 more);
    decide_current: value set + rank 0's wait (1), its multi_get 2b, answer set + waits (1),
      multi_get (2), add (1);
    assign_current: as decide_current, + rank 0's multi_set of the parts before the answer (b),
      each rank's get of its part (2) and its delete (1): 8 + 3b."""
    b = -(-world // MULTI_GET_BATCH)
    return {"consensus_current": 10, "consensus_all_current": 10, "commit_current": 11 + 2 * b, "gather_current": 2 + 2 * b,
            "decide_current": 5 + 2 * b, "assign_current": 8 + 3 * b}[kind]


def _finished(rows: list[dict]) -> list[dict]:
    return [r for r in rows if not r.get("stuck") and not r.get("unfinished")
            and not r.get("n_errors") and not r.get("n_failed")]


def cluster_model(doc: dict) -> dict:
    """What the curves say for a real cluster, where every rank has its own cores and only
    the store server (one event-loop thread on rank 0's host) and the round trips are shared:
    estimate = the server CPU the phase consumed here from the signal / start on (an upper
    bound: gVisor's syscalls make each command dearer than on a bare host) + the critical
    path's round trips (``critical_rounds``) at CLUSTER_RTT_US. Where a phase did not finish
    here, its server CPU is extrapolated from the largest N where it did (x (N/N0)^2 for the
    all-to-all gather, x N/N0 otherwise). Idle: the commands measured per second x the
    server's CPU per command."""
    ce = doc["ceiling"]
    c_add = ce["add"]["server_us_per_cmd"] / 1e6
    ceil_cmds = min(ce["add"]["ceiling_cmds_per_s"], ce["check"]["ceiling_cmds_per_s"])
    rtt = CLUSTER_RTT_US / 1e6
    out: dict[str, Any] = {"rtt_assumed_us": CLUSTER_RTT_US, "server_us_per_add": c_add * 1e6,
                           "server_ceiling_cmds_per_s": ceil_cmds, "worlds": {}}
    last_ok: dict[str, tuple[int, float]] = {}
    for w in doc["worlds"]:
        run = doc["runs"].get(str(w), {}).get("phases", {})
        idle = [r.get("cmds_per_s") for r in run.get("idle_current", [])
                if r.get("cmds_per_s") is not None]
        m: dict[str, Any] = {}
        if idle:
            m["idle_cmds_per_s"] = C.median(idle)
            m["idle_server_core"] = round(C.median(idle) * c_add, 4)
        for kind in ("consensus_current", "consensus_all_current", "commit_current",
                     "gather_current", "decide_current", "assign_current"):
            rounds = critical_rounds(kind, w)
            cpu = [r["server_cpu_protocol_s"] for r in _finished(run.get(kind, []))
                   if r.get("server_cpu_protocol_s") is not None]
            if cpu:
                c, how = C.median(cpu), "measured"
                last_ok[kind] = (w, c)
            elif kind in last_ok:
                w0, c0 = last_ok[kind]
                c = c0 * (w / w0) ** (2 if kind == "gather_current" else 1)
                how = f"extrapolated from N={w0}"
            else:
                continue
            m[f"{kind}_server_cpu_s"] = round(c, 4)
            m[f"{kind}_server_cpu_source"] = how
            m[f"{kind}_rounds"] = rounds
            m[f"{kind}_est_s"] = round(c + rounds * rtt, 3)
        m["gather_current_rank0_deletes_s"] = round((w + 3) * rtt, 3)
        out["worlds"][str(w)] = m
    return out


def cmds_of(row: dict) -> Any:
    return row.get("commands", (row.get("progress") or {}).get("cmds"))


def before_summary(path: str) -> dict | None:
    """The run of the protocol that polled the store (``--before``), summarised per N."""
    try:
        with open(path) as f:
            old = json.load(f)
    except (OSError, ValueError):
        return None
    out: dict[str, Any] = {"file": os.path.relpath(os.path.abspath(path), REPO_ROOT),
                           "date": old.get("date"), "git": old.get("git"),
                           "elapsed_s": old.get("elapsed_s"),
                           "loadavg_start": old.get("loadavg_start"), "worlds": {}}
    for w, run in old.get("runs", {}).items():
        ph = run["phases"]

        def med(kind: str, key: str) -> Any:
            rows = ph.get(kind, [])
            vals = [r.get(key) for r in rows if r.get(key) is not None]
            if vals:
                return C.median(vals)
            return did_not_finish(rows, int(w)) if rows else None

        def first(kind: str, key: str) -> Any:
            rows = ph.get(kind, [])
            if not rows:
                return None
            return cmds_of(rows[0]) if key == "commands" else rows[0].get(key)
        out["worlds"][w] = {
            "idle_cmds_per_s": med("idle_current", "cmds_per_s"),
            "idle_demanded_cmds_per_s": med("idle_current", "demanded_cmds_per_s"),
            "consensus_s": med("consensus_current", "last_s"),
            "consensus_commands": first("consensus_current", "commands"),
            "consensus_server_cpu_s": first("consensus_current", "server_cpu_protocol_s"),
            "commit_s": med("commit_current", "beyond_slowest_s"),
            "commit_commands": first("commit_current", "commands"),
            "commit_server_cpu_s": first("commit_current", "server_cpu_protocol_s"),
            "gather_s": med("gather_current", "all_have_plan_s"),
            "gather_commands": first("gather_current", "commands"),
            "gather_server_cpu_s": first("gather_current", "server_cpu_protocol_s"),
            "proto_consensus_fanout_s": med("consensus_fanout", "last_s"),
            "proto_consensus_commands": first("consensus_fanout", "commands"),
            "proto_commit_s": med("commit_proto", "beyond_slowest_s"),
            "proto_commit_commands": first("commit_proto", "commands"),
            "proto_gather_s": med("decide_current", "all_have_plan_s"),
        }
    out["cluster_model"] = (old.get("cluster_model") or {}).get("worlds")
    return out
#: per-rank write bandwidth of fastckpt measured on this VM (docs/benchmarks.md): the emergency
#: save with 2 ranks sharing one virtio disk (bench_preempt.py, 2026-11-30), and one process's
#: zero-copy save against fio's best layout (bench_clients.py, 2026-12-01)
VM_EMERGENCY_MIBPS_PER_RANK = (1068, 1201)
VM_SAVE_MIBPS_ONE_PROCESS = 2011
VM_FIO_BEST_MIBPS = 1661
#: /work/shared/REFERENCE.md, section 3 (not measured here)
REF = {"nvme_gen4_gbps": (3.0, 5.0), "nvme_gen5_gbps": (6.6, 7.0), "nvme_reachable": 0.9,
       "s3_conn_mbps": (85, 90), "s3_put_per_s_per_prefix": 3500, "s3_part_mib": 16,
       "d2h_pinned_gbps": (52, 57)}
WRITE_STREAMS = 2  # fastckpt/engine/writer.py: shard files a rank writes at once


def deployment_model(doc: dict) -> dict:
    """The target deployment: a 70B model + AdamW under FSDP2 on 8 nodes x 8 GPUs."""
    ranks, per_node = 64, 8
    params = param_count()
    out: dict[str, Any] = {"params": params, "ranks": ranks, "ranks_per_node": per_node}
    states = {
        "fsdp2_fp32_params_m_v": 12,  # what get_model/optimizer_state_dict hold under FSDP2
        "bf16_weights_fp32_master_m_v": 14,  # + a separate bf16 weight copy
    }
    for name, bpp in states.items():
        total = params * bpp
        rank = total / ranks
        node = rank * per_node
        row: dict[str, Any] = {"bytes_per_param": bpp, "total_gb": round(total / 1e9, 1),
                               "per_rank_gb": round(rank / 1e9, 2),
                               "per_node_gb": round(node / 1e9, 1)}
        nvme = {
            "1 x Gen4 per node (4 GB/s)": 1 * 4.0 * REF["nvme_reachable"],
            "4 x Gen4 per node (RAID0)": 4 * 4.0 * REF["nvme_reachable"],
            "8 x Gen5 per node (one per GPU)": 8 * 6.6 * REF["nvme_reachable"],
            "this VM's disk, if a node had one (measured)":
                2 * C.median(VM_EMERGENCY_MIBPS_PER_RANK) * (1 << 20) / 1e9,
        }
        row["local_nvme_s"] = {k: round(node / 1e9 / v, 1) for k, v in nvme.items()}
        row["this_vm_per_rank_s"] = round(rank / (C.median(VM_EMERGENCY_MIBPS_PER_RANK)
                                                  * (1 << 20)), 1)
        row["d2h_s"] = round(rank / 1e9 / REF["d2h_pinned_gbps"][0], 2)
        conn = C.median(REF["s3_conn_mbps"]) * 1e6
        s3 = {}
        for conns in (WRITE_STREAMS, 8, 16):
            bw = conns * conn
            puts = ranks * bw / (REF["s3_part_mib"] << 20)
            s3[f"{conns} connections per rank"] = {
                "s": round(rank / bw, 1), "per_node_gbit_s": round(per_node * bw * 8 / 1e9, 1),
                "puts_per_s": round(puts), "over_prefix_limit": puts >
                REF["s3_put_per_s_per_prefix"]}
        row["object_store"] = s3
        out[name] = row
    # protocol costs at 64 ranks, measured here
    run = doc["runs"].get("64", {}).get("phases", {})

    def med(kind: str, key: str) -> Any:
        vals = [r.get(key) for r in run.get(kind, []) if r.get(key) is not None]
        return C.median(vals) if vals else None
    b64 = ((doc.get("before") or {}).get("worlds") or {}).get("64", {})
    plan = doc.get("plan_payload", {})
    mp = plan.get("make_plan", {}).get("64") or plan.get("make_plan", {}).get(64)
    man = plan.get("manifest", {}).get("64") or plan.get("manifest", {}).get(64)
    gm = (doc.get("gather_model") or {}).get("64") or (doc.get("gather_model") or {}).get(64)
    out["protocol_at_64"] = {
        "consensus_s": med("consensus_current", "last_s"),
        "consensus_before_s": b64.get("consensus_s"),
        "commit_s": med("commit_current", "beyond_slowest_s"),
        "commit_before_s": b64.get("commit_s"),
        "plan_exchange_tiny_s": med("gather_current", "all_have_plan_s"),
        "plan_exchange_tiny_before_s": b64.get("gather_s"),
        "plan_exchange_reused_s": med("decide_current", "all_have_plan_s"),
        "plan_exchange_first_tiny_s": med("assign_current", "all_have_plan_s"),
        "plan_exchange_first_realistic": ((doc.get("assign_realistic") or {}).get(64)
                                          or (doc.get("assign_realistic") or {}).get("64")),
        "plan_exchange_realistic_model": gm,
        "make_plan_and_loads_at_64": mp,
        "manifest_at_64": man,
    }
    return out


def did_not_finish(rows: list[dict], world: int) -> str | None:
    """'>D s (k/N)': the protocol missed its deadline D; k ranks had finished by the end."""
    if not rows:
        return None
    r = rows[0]
    done = r.get("knew_T", r.get("ok_ranks"))
    if r.get("stuck"):
        done = (r.get("progress") or {}).get("done", 0)
    return f">{r.get('deadline_s', '?')}s ({done}/{world})"


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def print_table(doc: dict) -> None:
    before = (doc.get("before") or {}).get("worlds", {})
    rows = []
    for w in doc["worlds"]:
        run = doc["runs"].get(str(w)) or doc["runs"].get(w)
        if not run:
            continue
        ph = run["phases"]
        b = before.get(str(w), {})

        def med(kind: str, key: str) -> Any:
            vals = [r.get(key) for r in ph.get(kind, []) if r.get(key) is not None]
            if not vals:
                return did_not_finish(ph.get(kind, []), w)
            return C.median(vals) if isinstance(vals[0], (int, float)) else vals[0]
        rows.append({
            "N": w,
            "idle cmd/s old": b.get("idle_cmds_per_s"), "new": med("idle_current", "cmds_per_s"),
            "consensus s old": b.get("consensus_s"), "new ": med("consensus_current", "last_s"),
            "commit s old": b.get("commit_s"), "new  ": med("commit_current", "beyond_slowest_s"),
            "gather s old": b.get("gather_s"), "new   ": med("gather_current", "all_have_plan_s"),
            "cmds/rank cons": med("consensus_current", "commands_per_rank"),
            "commit": med("commit_current", "commands_per_rank"),
            "store CPU cons": med("consensus_current", "server_cpu_protocol_s"),
            "all signalled s": med("consensus_all_current", "last_s"),
            "store CPU all": med("consensus_all_current", "server_cpu_protocol_s"),
            "commit ": med("commit_current", "server_cpu_protocol_s"),
            "plan reused s": med("decide_current", "all_have_plan_s"),
            "plan first s": med("assign_current", "all_have_plan_s"),
        })
    if rows:
        keys = list(rows[0])
        print(" | ".join(k.strip() for k in keys))
        for r in rows:
            print(" | ".join(_fmt(r[k]) for k in keys))


def write_png(doc: dict, path: str) -> str | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception:
        return None
    ws = [w for w in doc["worlds"] if str(w) in doc["runs"]]
    before = (doc.get("before") or {}).get("worlds", {})
    old_cm = (doc.get("before") or {}).get("cluster_model") or {}

    def series(kind: str, key: str) -> tuple[list, list]:
        xs, ys = [], []
        for w in ws:
            vals = [r.get(key) for r in doc["runs"][str(w)]["phases"].get(kind, [])
                    if r.get(key) is not None]
            if vals and C.median(vals) > 0:
                xs.append(w)
                ys.append(C.median(vals))
        return xs, ys

    def old(key: str) -> tuple[list, list]:
        xs = [int(w) for w in before if isinstance(before[w].get(key), (int, float))
              and before[w][key] > 0]
        xs.sort()
        return xs, [before[str(x)][key] for x in xs]
    cm = (doc.get("cluster_model") or {}).get("worlds", {})

    def model(m: dict, key: str) -> tuple[list, list]:
        xs = sorted(int(w) for w in m if (m[w] or {}).get(key))
        return xs, [m[str(x)][key] for x in xs]
    fig, axs = plt.subplots(2, 2, figsize=(11, 8))
    panels = (  # (axes, key before, before's cluster bound, phase, key now, model key, ...)
        (axs[0][0], "consensus_s", "consensus_current_min_s", "before, lower bound on a cluster",
         "consensus_current", "last_s", "fastckpt now (wake keys, collect), measured",
         "consensus_current_est_s", "consensus_s", "target (+1 step)",
         "stop consensus: signal -> last rank knows T (s)"),
        (axs[0][1], "commit_s", "commit_current_min_s",
         f"before, coordinator's 8N round trips at {CLUSTER_RTT_US:g} us",
         "commit_current", "beyond_slowest_s", "fastckpt now, measured",
         "commit_current_est_s", "commit_s", "target", "commit beyond the slowest writer (s)"))
    for (ax, k_old, k_bound, l_bound, phase, k_now, l_now, k_model, k_target, l_target,
         title) in panels:
        ax.plot(*old(k_old), "o-", c="C0", alpha=0.5, label="before (polling), measured")
        ax.plot(*model(old_cm, k_bound), "--", c="C0", alpha=0.5, label=l_bound)
        ax.plot(*series(phase, k_now), "o-", c="C1", label=l_now)
        ax.plot(*model(cm, k_model), "--", c="C1", label="fastckpt now, estimate on a cluster")
        ax.axhline(TARGETS[k_target], ls=":", c="gray", label=l_target)
        ax.set_title(title)
    ax = axs[1][0]
    ax.plot(*old("idle_demanded_cmds_per_s"), "k--", alpha=0.5, label="before, demanded")
    ax.plot(*old("idle_cmds_per_s"), "o-", c="C0", alpha=0.5, label="before, achieved here")
    xs, ys = [], []
    for w in ws:
        vals = [r.get("cmds_per_s") for r in doc["runs"][str(w)]["phases"].get(
            "idle_current", []) if r.get("cmds_per_s") is not None]
        if vals:
            xs.append(w)
            ys.append(max(C.median(vals), 0.1))
    ax.plot(xs, ys, "o-", c="C1", label="fastckpt now (0 plotted as 0.1)")
    ax.axhline(TARGETS["idle_cmds_per_s"], ls=":", c="gray", label="target")
    ax.set_title("idle store load (commands/s)")
    ax = axs[1][1]
    ax.plot(*old("gather_s"), "o-", c="C0", alpha=0.5, label="before, tiny values")
    ax.plot(*series("gather_current", "all_have_plan_s"), "o-", c="C1",
            label="fastckpt now (all-to-all, wait + multi_get), tiny values")
    ax.plot(*model(cm, "gather_current_est_s"), "--", c="C1",
            label="fastckpt now, store CPU + round trips on a cluster")
    ax.plot(*series("decide_current", "all_have_plan_s"), "o-", c="C2",
            label="fastckpt now, plan reused: Group.decide (values to rank 0 only)")
    ax.plot(*series("assign_current", "all_have_plan_s"), "o-", c="C3",
            label="fastckpt now, first save: Group.decide(each=True), tiny lists")
    gm = doc.get("gather_model") or {}
    if gm:
        xs = sorted(int(k) for k in gm)
        ax.plot(xs, [gm[str(x)]["lower_bound_s"] if str(x) in gm else gm[x]["lower_bound_s"]
                     for x in xs], "k--", label="all-to-all with 70B values (model)")
    ax.set_title("plan exchange (s)")
    for row in axs:
        for ax in row:
            if any(len(line.get_xdata()) for line in ax.get_lines()
                   if line.get_linestyle() != ":"):
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
            ax.set_xlabel("ranks")
            ax.legend(fontsize=7)
            ax.grid(True, which="both", alpha=0.3)
    fig.suptitle("fastckpt coordination protocols vs ranks, before (polling) and now: one real "
                 "TCPStore, simulated ranks on a shared 2-core VM (solid: measured here, "
                 "dashed: cluster model)", fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=90)
    return path
def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="N up to 1024, short windows")
    p.add_argument("--ranks", default=None, help="comma-separated world sizes")
    p.add_argument("--procs", type=int, default=4, help="worker processes per job")
    p.add_argument("--phases", default=None,
                   help=f"comma-separated, of: {', '.join(ALL_PHASES)} (--quick: fewer)")
    p.add_argument("--reps", type=int, default=3, help="consensus repetitions (N <= 256)")
    p.add_argument("--window", type=float, default=None, help="idle measurement window (s)")
    p.add_argument("--cap", type=float, default=None, help="cap per phase (s)")
    p.add_argument("--spread", type=float, default=0.5,
                   help="commit: the ranks finish writing over this many seconds")
    p.add_argument("--plan-worlds", default=None, help="N for the realistic all-to-all gather")
    p.add_argument("--assign-worlds", default=None,
                   help="N for the realistic full plan exchange through rank 0")
    p.add_argument("--no-dns-shim", action="store_true")
    p.add_argument("--json", default=os.path.join(REPO_ROOT, "bench-out", "protocol.json"))
    p.add_argument("--png", default=os.path.join(REPO_ROOT, "bench-out", "protocol.png"))
    p.add_argument("--before", default=os.path.join(REPO_ROOT, "bench-out", "protocol-old.json"),
                   help="an earlier run (the polling protocol) summarised as the 'before' column")
    p.add_argument("--_server", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_hammer", action="store_true", help=argparse.SUPPRESS)
    for k in ("port", "world", "wid", "lo", "hi", "threads", "value-bytes"):
        p.add_argument(f"--{k}", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--op", default="add", help=argparse.SUPPRESS)
    p.add_argument("--seconds", type=float, default=2.0, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a._server:
        return server_main()
    if a._worker:
        return worker_main(a)
    if a._hammer:
        return hammer_main(a)

    worlds = [int(x) for x in (a.ranks or ("64,256,1024" if a.quick else
                                           "64,256,1024,4096")).split(",")]
    a.window = a.window or (0.5 if a.quick else 3.0)
    a.cap = a.cap or (4.0 if a.quick else 10.0)
    a.spread = 0.2 if a.quick and a.spread == 0.5 else a.spread
    if a.quick:
        a.reps = 1
    phases = [x for x in (a.phases or ",".join(QUICK_PHASES if a.quick else ALL_PHASES)
                          ).split(",") if x]
    plan_worlds = [int(x) for x in (a.plan_worlds if a.plan_worlds is not None else
                                    ("" if a.quick else "4,8,16")).split(",") if x]
    assign_worlds = [int(x) for x in (a.assign_worlds if a.assign_worlds is not None else
                                      ("" if a.quick else "8,32,64")).split(",") if x]
    env = C.child_env(REPO_ROOT)
    env["TORCH_CPP_LOG_LEVEL"] = "ERROR"  # a timed-out c10d wait logs warnings
    shim = None if a.no_dns_shim else build_shim()
    if shim:
        env["LD_PRELOAD"] = shim
        if os.environ.get("LD_PRELOAD") != shim:  # this process opens clients too
            os.execve(sys.executable, [sys.executable] + sys.argv,
                      dict(os.environ, LD_PRELOAD=shim))
    t_start = time.time()
    doc: dict[str, Any] = {
        "format": "fastckpt-bench-protocol", "version": 2, "date": C.utc_now(),
        "machine": C.machine_info(), "git": C.git_commit(), "versions": C.base_versions(),
        "args": {k: v for k, v in vars(a).items() if not k.startswith("_")},
        "worlds": worlds, "targets_at_4096": TARGETS,
        "dns_shim": bool(shim), "commands_per_call": COMMANDS, "runs": {},
        "loadavg_start": os.getloadavg(), "cluster_rtt_assumed_us": CLUSTER_RTT_US,
        "before": before_summary(a.before),
    }
    job = None
    try:
        doc["ceiling"] = ceiling(a, env)
        if "gather_current" in phases and not a.quick:
            doc["plan_payload"] = plan_cpu([8, 32, 64])
        job = Job(a.procs, env)
        doc["workers_start_s"] = round(job.start_s, 2)
        if "gather_current" in phases and not a.quick:
            if plan_worlds:
                doc["plan_realistic"] = realistic_gather(job, plan_worlds, a)
            doc["gather_model"] = gather_model(doc["plan_payload"], doc["ceiling"],
                                               sorted(set(plan_worlds + worlds)))
        if "assign_current" in phases and not a.quick and assign_worlds:
            doc["assign_realistic"] = realistic_gather(job, assign_worlds, a, "assign_realistic")
        for w in worlds:
            job, doc["runs"][str(w)] = run_world(job, w, a, env, phases, last=w == worlds[-1])
        doc["cluster_model"] = cluster_model(doc)
        doc["deployment_70b"] = deployment_model(doc)
    finally:
        doc["elapsed_s"] = round(time.time() - t_start, 1)
        doc["loadavg_end"] = os.getloadavg()
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        C.write_json(a.json, doc)
        print(f"wrote {a.json} ({doc['elapsed_s']} s)")
        if job is not None:
            job.close()
    print_table(doc)
    png = write_png(doc, a.png)
    if png:
        print(f"wrote {png}")


if __name__ == "__main__":
    main()
