"""The cross-rank protocols over a real c10d TCPStore: O(1) store commands per rank, no polling.

docs/scale.md measures them with up to 4096 simulated ranks (``benchmarks/bench_protocol.py``);
these tests pin the properties that make them scale, with real stores and real processes:

* an armed, idle preemption trigger sends the store nothing (it used to probe it every 0.1 s);
* a stop costs each rank a handful of commands, whatever the world size;
* the commit, the report/reduce exchange and the gather name the ranks that are missing, clean
  their keys up, and wait on the server (a thread's wait does not hold the shared client);
* the ranks lost with the store are named from where the store lives (``store_host``).
"""

from __future__ import annotations

import os
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as tdist

import fastckpt
from fastckpt.engine import dist as _dist
from fastckpt.engine.commit import commit
from fastckpt.errors import CollectiveTimeoutError, CommitTimeoutError
from fastckpt.preempt.consensus import PeerLost, collect
from tests.distributed import free_port, run


class Counting:
    """A store proxy logging (time, command) for every call, and the keys of every ``set`` and
    ``multi_set`` to ``writes``; its clones log to the same lists."""

    def __init__(self, store, log: list, writes: list | None = None) -> None:
        self._s, self.log = store, log
        self.writes = writes if writes is not None else []

    def __getattr__(self, name):
        fn = getattr(self._s, name)

        def call(*args):
            self.log.append((time.monotonic(), name))
            if name == "set":
                self.writes.append(args[0])
            elif name == "multi_set":
                self.writes.extend(args[0])
            out = fn(*args)
            return Counting(out, self.log, self.writes) if name == "clone" else out
        return call


def _counted_exchanges(writes: list | None = None) -> list:
    """Wrap the store of every Exchange created from now on in this process; return the log
    (and the keys written, to ``writes``)."""
    log: list = []
    orig = _dist.Exchange.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        if self._store is not None:
            self._store = Counting(self._store, log, writes)
    _dist.Exchange.__init__ = init
    return log


def _idle_then_stop(rank, world, root):
    log = _counted_exchanges()
    ck = fastckpt.Checkpointer(root, grace_s=30, preempt_exit=False)
    st = {"w": torch.full((64,), float(rank))}
    t0 = time.monotonic()
    step = 0
    while time.monotonic() - t0 < 2.0:  # armed and idle: training steps only
        assert ck.save(st, step=step, on_preempt=True) is None
        step += 1
        time.sleep(0.01)
    idle = [c for t, c in log if t0 + 0.5 <= t]  # after the watchers' first wait
    h, t_stop = _stop_and_save(ck, st, step, rank == world - 1)
    p = ck.preemption
    agreed = [c for t, c in log if t_stop <= t and c not in ("clone",)]
    out = {"idle": idle, "stop_step": p.stop_step, "code": p.exit_code, "committed": h.committed}
    ev = [e for e in _events(root, rank) if e["event"] == "consensus"]
    out["consensus"] = ev[-1]
    out["cmds_after_stop"] = len(agreed)
    ck.close()
    return out


def _stop_and_save(ck, st, step, request: bool):
    """(every rank, after its steps) At the same moment as the others: ask for a stop here if
    ``request``, then train on until the emergency save's handle; (it, the moment)."""
    tdist.barrier()
    t_stop = time.monotonic()
    if request:
        ck.preemption.request_stop()
    h = None
    while h is None:
        h = ck.save(st, step=step, on_preempt=True)
        step += 1
        time.sleep(0.005)
        assert time.monotonic() - t_stop < 30
    return h, t_stop


def _events(root, rank):
    import json
    with open(os.path.join(root, "events", f"rank{rank:05d}.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("world", [2, 4])
def test_idle_trigger_sends_nothing_and_a_stop_costs_o1_per_rank(tmp_path, world):
    res = run(_idle_then_stop, world, str(tmp_path / "ck"))
    for r, o in enumerate(res):
        assert o["idle"] == [], (r, o["idle"][:10])  # the old watcher: ~15 probes per rank
        assert o["code"] == 143 and o["committed"]
    assert len({o["stop_step"] for o in res}) == 1
    # everything after the stop request, including the emergency save's plan exchange,
    # commit and exit barrier: a fixed number on every rank, plus the signalled rank's N
    # wake-ups and the coordinator's deletes of the gathers' N values. This emergency save is
    # the job's first save: its plan exchange is the verdict round and then rank 0's decision
    # (each rank's own part). Measured at worlds 2, 4 and 8 (2026-12-04): ranks 1..N-2 34-40,
    # the signalled rank 37-41 + N, rank 0 53-56 + 3N; one timed wait more or less (a get that
    # finds its key or waits for it) moves a count by one or two, so the bounds leave 5.
    per_rank = [o["cmds_after_stop"] for o in res]
    assert all(n <= 45 for n in per_rank[1:-1]), per_rank
    assert per_rank[-1] <= 45 + world and per_rank[0] <= 60 + 5 * world, per_rank
    print(f"\nworld {world}: store commands per rank from the stop request to the exit: "
          f"{per_rank}; consensus {res[0]['consensus']['agreed_after_s']} s after the request")


def _all_signalled(rank, world, root):
    writes: list = []
    log = _counted_exchanges(writes)
    ck = fastckpt.Checkpointer(root, grace_s=30, preempt_exit=False)
    st = {"w": torch.full((64,), float(rank))}
    step = 0
    for _ in range(5):
        assert ck.save(st, step=step, on_preempt=True) is None
        step += 1
    # every rank, as srun / a pod / torchrun's agent signal them
    h, t_stop = _stop_and_save(ck, st, step, True)
    p = ck.preemption
    out = {"stop_step": p.stop_step, "code": p.exit_code, "committed": h.committed,
           "wake_writes": [k for k in writes if "/wake/" in k],
           "cmds_after_stop": len([c for t, c in log if t_stop <= t and c != "clone"])}
    ck.close()
    return out


def test_every_rank_signalled_at_once_wakes_each_rank_once(tmp_path):
    """An orchestrator signals every rank at once: the first rank to count itself in wakes all
    N, each later one only its own watcher (2N - 1 wake writes in all, where every signalled
    rank waking every rank was N^2 and a 4096-rank job agreed on nothing in its deadline:
    docs/scale.md). Every rank stops at the same step and the emergency save commits."""
    world = 4
    res = run(_all_signalled, world, str(tmp_path / "ck"))
    assert len({o["stop_step"] for o in res}) == 1
    assert all(o["code"] == 143 and o["committed"] for o in res)
    counts = sorted(len(o["wake_writes"]) for o in res)
    assert counts == [1] * (world - 1) + [world], [o["wake_writes"] for o in res]
    for r, o in enumerate(res):
        if len(o["wake_writes"]) == 1:  # a later one: its own key, none of the others'
            assert o["wake_writes"][0].endswith(f"/wake/{r}"), o["wake_writes"]
    # the same fixed cost per rank as one signal (above), without an N term on any rank but 0
    per_rank = [o["cmds_after_stop"] for o in res]
    print(f"\nevery rank signalled, world {world}: store commands per rank from the stop "
          f"request to the exit: {per_rank}")
    assert all(n <= 47 for n in per_rank[1:]) and per_rank[0] <= 62 + 5 * world, per_rank


# --------------------------------------------------------------- threads on one real store

@pytest.fixture
def store():
    s = tdist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=30))
    yield s
    del s


def _client(store):
    return tdist.TCPStore("127.0.0.1", store.port, 1, False, timeout=timedelta(seconds=30))


def _threads(n, fn, skip=()):
    out = {}

    def one(r):
        try:
            out[r] = fn(r)
        except Exception as e:  # noqa: BLE001
            out[r] = e
    ts = [threading.Thread(target=one, args=(r,)) for r in range(n) if r not in skip]
    t0 = time.monotonic()
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    return out, time.monotonic() - t0


def test_commit_over_a_real_store_cleans_up_and_names_the_missing(store):
    world = 8
    exs = [_dist.Exchange(store=_client(store)) for _ in range(world)]
    keys0 = store.num_keys()

    def one(r, save_id, deadline_s):
        return commit(exs[r], save_id=save_id, rank=r, world_size=world, result={"ok": True},
                      deadline=time.monotonic() + deadline_s,
                      coordinator=lambda res: {"n": len(res)})
    out, _ = _threads(world, lambda r: one(r, "a", 10))
    assert all(o == {"ok": True, "n": world} for o in out.values()), out
    assert store.num_keys() == keys0  # results, outcome, acks, counters: all deleted
    out, took = _threads(world, lambda r: one(r, "b", 1.0), skip=(5,))
    assert took < 1.0 + 5
    for r, o in out.items():
        assert isinstance(o, CommitTimeoutError) and o.missing_ranks == [5], (r, o)


def test_a_cancelled_commit_stops_waiting_and_rank_0_decides_nothing(store):
    # an upload that a preemption superseded on ranks whose peer never submitted it (its tier
    # froze first): before 2026-12-06 they waited for the peer until the commit deadline,
    # and the emergency upload queued behind missed the grace window
    world = 3
    exs = [_dist.Exchange(store=_client(store)) for _ in range(world)]
    cancel = threading.Event()
    decided = []

    def one(r):
        return commit(exs[r], save_id="cx", rank=r, world_size=world, result={"ok": True},
                      deadline=time.monotonic() + 60, cancel=cancel,
                      coordinator=lambda res: decided.append(1) or {})
    threading.Timer(0.5, cancel.set).start()
    out, took = _threads(world, one, skip=(2,))  # rank 2 never reports
    assert took < 5, took
    assert not decided  # nothing committed
    assert isinstance(out[0], CommitTimeoutError) and not out[0].outcome_unknown
    assert isinstance(out[1], CommitTimeoutError) and out[1].outcome_unknown  # keeps its files
    assert "cancelled" in str(out[1]) and "rank 1" in str(out[1])


def test_collect_names_the_missing_and_reduces_once(store):
    world = 16
    exs = [_dist.Exchange(store=_client(store)) for _ in range(world)]
    calls = []

    def reduce(lines):
        calls.append(len(lines))
        return max(x["v"] for x in lines)
    out, _ = _threads(world, lambda r: collect(exs[r], "k1", r, world, {"v": r * 3},
                                               time.monotonic() + 10, "test", reduce))
    assert set(out.values()) == {45} and calls == [world]
    out, took = _threads(world, lambda r: collect(exs[r], "k2", r, world, {"v": r},
                                                  time.monotonic() + 1.0, "test", reduce),
                         skip=(3, 9))
    assert took < 1.0 + 5
    for o in out.values():
        assert isinstance(o, PeerLost) and o.missing == [3, 9], o


def test_exchange_wait_is_one_server_side_wait(store):
    """Waiting for N keys: one wait, then multi_get; no probing while the keys do not exist."""
    log: list = []
    ex = _dist.Exchange(store=_client(store))
    ex._store = Counting(ex._store, log)
    keys = [f"k/{i}" for i in range(2000)]

    def later():
        time.sleep(0.5)
        for k in keys:
            store.set("fastckpt/" + k, k.encode())
    threading.Thread(target=later).start()
    found, missing = ex.wait(keys, time.monotonic() + 20)
    assert not missing and found["k/1999"] == b"k/1999"
    names = [c for _, c in log]
    # no idle connection: one check on the shared one (a dead store fails it at once) before
    # the clone; the values in batches of 1024
    assert names == ["check", "clone", "wait", "multi_get", "multi_get"], names
    log.clear()
    found, missing = ex.wait(["k/0", "never"], time.monotonic() + 0.3)
    assert missing == ["never"] and found == {"k/0": b"k/0"}
    names = [c for _, c in log]  # the pooled connection: no check first, no clone; up to
    # 1024 keys a multi_get waits on the server (its connection's timeout: the deadline)
    assert names[:2] == ["set_timeout", "multi_get"] and "clone" not in names, names
    # (the timed-out connection is dropped) the keys there: a check on the shared connection
    log.clear()
    assert ex.wait(["k/5", "k/6"], time.monotonic() + 20) == (
        {"k/5": b"k/5", "k/6": b"k/6"}, [])
    assert [c for _, c in log] == ["check", "multi_get"], log
    for expect in (["check", "clone", "set_timeout", "multi_get"], ["set_timeout", "multi_get"]):
        log.clear()  # keys set later: a new connection, then the pooled one; one multi_get
        # (2 commands) each time, where a wait and then a multi_get were 3
        late = [f"late{len(expect)}/{i}" for i in range(3)]
        threading.Timer(0.3, lambda: [store.set("fastckpt/" + k, b"x") for k in late]).start()
        assert ex.wait(late, time.monotonic() + 20) == ({k: b"x" for k in late}, [])
        assert [c for _, c in log] == expect, log


def test_gather_over_a_real_store(store):
    world = 6
    groups = []
    for _ in range(world):
        g = _dist.Group.__new__(_dist.Group)
        g.collective, g.world_size = True, world
        g._prefix, g._seq = "gather/t", 0
        g._exchange = _dist.Exchange(store=_client(store))
        groups.append(g)
    for r, g in enumerate(groups):
        g.rank = r
    keys0 = store.num_keys()
    out, _ = _threads(world, lambda r: groups[r].gather({"r": r}, timeout_s=10, what="t"))
    assert all(o == [{"r": r} for r in range(world)] for o in out.values()), out
    assert store.num_keys() == keys0
    out, _ = _threads(world, lambda r: groups[r].gather(r, timeout_s=1.0, what="plan"),
                      skip=(4,))
    for o in out.values():
        assert isinstance(o, CollectiveTimeoutError) and o.missing_ranks == [4]
        assert "plan: rank(s) [4] did not arrive" in str(o)


def _groups(store, world, prefix):
    groups = []
    for r in range(world):
        g = _dist.Group.__new__(_dist.Group)
        g.collective, g.world_size, g.rank = True, world, r
        g._prefix, g._seq = prefix, 0
        g._exchange = _dist.Exchange(store=_client(store))
        groups.append(g)
    return groups


def test_decide_sends_the_values_to_rank_0_only_and_names_the_missing(store):
    """Group.decide (the plan exchange's first step): rank 0 reads N values, every rank gets
    its one answer, nothing is left in the store; a rank that does not arrive is named on every
    rank (rank 0 answers before the others stop waiting), a missing rank 0 too; an error of
    rank 0's function is raised everywhere."""
    world = 6
    groups = _groups(store, world, "decide/t")
    keys0 = store.num_keys()
    out, _ = _threads(world, lambda r: groups[r].decide(
        {"r": r}, lambda vs: {"sum": sum(v["r"] for v in vs)}, timeout_s=10, what="t"))
    assert all(o == {"sum": 15} for o in out.values()), out
    assert store.num_keys() == keys0
    # O(1) store commands per rank (rank 0: O(N) deletes), where gather's reads are O(N) each
    log: list = []
    for g in groups:
        g._exchange._store = Counting(g._exchange._store, log)
        g._exchange._idle.clear()  # (its connections are clones of the counted store now)
    out, _ = _threads(world, lambda r: groups[r].decide(r, len, timeout_s=10, what="t"))
    assert all(o == world for o in out.values())
    assert len(log) <= 8 * world + 12, [c for _, c in log]
    # rank 0: the values, then the "done" key; every other rank: its answer
    assert sum(c == "multi_get" for _, c in log) == 2 + (world - 1), [c for _, c in log]
    out, took = _threads(world, lambda r: groups[r].decide(r, len, timeout_s=2.0, what="plan"),
                         skip=(4,))
    assert took < 4
    for o in out.values():
        assert isinstance(o, CollectiveTimeoutError) and o.missing_ranks == [4], o
        assert "plan: rank(s) [4] did not arrive" in str(o)
    groups = _groups(store, world, "decide/0")  # (rank 4 missed a round: its count is behind)
    out, took = _threads(world, lambda r: groups[r].decide(r, len, timeout_s=1.0, what="plan"),
                         skip=(0,))
    for o in out.values():
        assert isinstance(o, CollectiveTimeoutError) and o.missing_ranks == [0], o
        assert "no answer from rank 0" in str(o)

    def boom(vs):
        raise ValueError("broken plan")
    groups = _groups(store, world, "decide/e")
    out, _ = _threads(world, lambda r: groups[r].decide(r, boom, timeout_s=5, what="plan"))
    assert isinstance(out[0], ValueError)
    assert all(isinstance(o, fastckpt.errors.FastCkptError) and "broken plan" in str(o)
               for r, o in out.items() if r), out


def test_decide_each_sends_every_rank_its_own_part_only(store):
    """Group.decide(each=True) (the full plan exchange: rank 0 plans every rank): rank r gets
    the common answer and parts[r], no rank reads another's part, nothing is left in the
    store, O(1) commands per rank (rank 0's parts go in one multi_set); a wrong number of
    parts is an error raised on every rank."""
    world = 5
    groups = _groups(store, world, "decide/each")
    keys0 = store.num_keys()
    log: list = []
    for g in groups:
        g._exchange._store = Counting(g._exchange._store, log)

    def plan(vs):
        return {"n": len(vs)}, [{"mine": v["r"] * 10} for v in vs]
    out, _ = _threads(world, lambda r: groups[r].decide(
        {"r": r}, plan, each=True, timeout_s=10, what="t"))
    for r, o in out.items():
        assert tuple(o) == ({"n": world}, {"mine": r * 10}), (r, o)
    assert store.num_keys() == keys0
    assert sum(c == "multi_set" for _, c in log) == 1
    assert len(log) <= 9 * world + 12, [c for _, c in log]
    groups = _groups(store, world, "decide/each-bad")
    out, _ = _threads(world, lambda r: groups[r].decide(
        r, lambda vs: ({}, [1]), each=True, timeout_s=5, what="plan"))
    assert all(isinstance(o, fastckpt.errors.FastCkptError) or isinstance(o, ValueError)
               for o in out.values()), out
    assert all("1 parts for 5 ranks" in str(o) for o in out.values()), out
    # one rank: no store at all
    g1 = _dist.Group(collective=False)
    assert g1.decide(7, lambda vs: ("c", [vs[0] + 1]), each=True, timeout_s=1, what="t") == \
        ("c", 8)


def test_set_many_bounds_each_command_by_bytes_and_keys(store, monkeypatch):
    """Exchange.set_many: a multi_set command carries at most MULTI_SET_BYTES (unless one
    value alone is larger: it goes alone) and MULTI_GET_BATCH keys; every value arrives."""
    monkeypatch.setattr(_dist, "MULTI_SET_BYTES", 1000)
    monkeypatch.setattr(_dist, "MULTI_GET_BATCH", 4)
    sizes = [400, 400, 400, 3000, 10, 10, 10, 10, 10, 999]
    keys = [f"sm/{i}" for i in range(len(sizes))]
    values = [bytes([i]) * n for i, n in enumerate(sizes)]
    sent: list = []

    ex = _dist.Exchange(store=store)
    inner = ex._store

    class Spy:
        def multi_set(self, ks, vs):
            sent.append([len(v) for v in vs])
            inner.multi_set(ks, vs)
    ex._store = Spy()
    ex.set_many(keys, values)
    assert sent == [[400, 400], [400], [3000], [10, 10, 10, 10], [10], [999]], sent
    ex._store = inner
    assert ex.get_many(keys) == values


def test_a_dead_store_names_the_ranks_lost_with_it(monkeypatch):
    """The store's host gone: every wait raises StoreUnreachable naming the ranks that go with
    it: rank 0, or under torchrun (agent store) node 0's ranks."""
    port = free_port()
    server = tdist.TCPStore("127.0.0.1", port, 1, True, timeout=timedelta(seconds=30))
    ex = _dist.Exchange(store=tdist.TCPStore("127.0.0.1", port, 1, False,
                                             timeout=timedelta(seconds=5)))
    ex.set("a", b"1")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    assert _dist.store_host() == ([0], "rank 0 at 10.0.0.1:29500")
    del server
    t0 = time.monotonic()
    with pytest.raises(_dist.StoreUnreachable) as e:
        ex.wait(["never"], time.monotonic() + 20)
    # at once: not at the deadline, nor after a clone's connect retries (>= the 5 s timeout)
    assert time.monotonic() - t0 < 4
    assert e.value.ranks == [0] and "rank 0 at 10.0.0.1:29500" in str(e.value)
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    ranks, where = _dist.store_host()
    assert ranks == [0] and "agent on node 0" in where  # world size 1 here: capped
