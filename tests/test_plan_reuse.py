"""The plan exchange reuses the previous save's plan when no rank's chunk layout changed, and
exchanges the chunk lists again when one did (fastckpt/engine/plan.py, ``PlanExchange``).

The unit tests drive N ``PlanExchange`` objects (one per simulated rank) through random
sequences of saves and check every plan against a fresh ``make_plan`` of the full chunk lists:
reusing must never give a rank a different plan than computing it would. The distributed tests
run real gloo ranks: repeated saves reuse, a changed layout or a tensor that becomes per rank
re-exchanges, and every checkpoint loads back bit-exact, skeletons (plain values per rank)
included, now that they travel with the commit results instead of the plan exchange.
"""

from __future__ import annotations

import json
import math
import random

import pytest
import torch

import fastckpt
from fastckpt.engine.plan import PlanExchange, make_plan
from fastckpt.engine.state import flatten

from tests.distributed import run


def _spec(fqn, shape, offsets, sizes, dtensor, digest, solo=None):
    n = 4
    for s in sizes:
        n *= s
    return (fqn, "float32", tuple(shape), tuple(offsets), tuple(sizes), n, dtensor, digest,
            solo)


def _rank_specs(rank, world, layout, contents):
    """A rank's specs: DTensor shards of "w{i}" (rows split over the ranks; with
    ``layout["solo"]`` marked as held by this rank alone, as ``local_chunks`` marks FSDP2's
    shards: not sent to rank 0), replicated regular tensors "r{j}" whose fingerprint is
    ``contents[(rank, j)]``. With ``layout["stages"]`` (pipeline stages of consecutive ranks)
    "w{i}" and "r{j}" (j > 0) belong to stage i (j) modulo the stages, sharded over its ranks
    on its own mesh; "r0" is every rank's."""
    specs = []
    stages = layout.get("stages", 1)
    size = world // stages
    stage, place = rank // size, rank % size
    solo = f"mesh{stage}" if layout.get("solo") else None
    for i, rows in enumerate(layout["dtensors"]):
        if i % stages != stage:
            continue
        per = rows // size
        specs.append(_spec(f"w{i}", (rows, 3), (place * per, 0), (per, 3), True, None,
                           solo if per else None))
    for j, n in enumerate(layout["regular"]):
        if j and j % stages != stage:
            continue
        specs.append(_spec(f"r{j}", (n,), (0,), (n,), False, contents[(rank, j)]))
    for fqn, n in layout["only"].get(rank, []):
        specs.append(_spec(fqn, (n,), (0,), (n,), False, "x"))
    return specs


def _json(x):
    return json.loads(json.dumps(x))  # what crosses the store


def _full_values() -> list:
    """(in a rank) Every value this process's ``PlanExchange.full_value`` returns from now
    on, as rank 0 receives it."""
    sent: list = []
    real = PlanExchange.full_value

    def spy(self, *a, **kw):
        out = real(self, *a, **kw)
        sent.append(_json(out))
        return out
    PlanExchange.full_value = spy
    return sent


class _Ranks:
    """N simulated ranks' PlanExchanges and what an oracle expects of them: ``sticky``, the
    tensors that stay per rank until the next full exchange."""

    def __init__(self, world):
        self.ex = [PlanExchange() for _ in range(world)]
        self.sticky: set = set()
        self.sent: list = []  # every full exchange's values, as rank 0 got them

    def save(self, specs_of, step, *, skip=()):
        """One save on every simulated rank (``skip``: ranks whose verdict never came); the
        way the plan was made. Every plan is checked against a fresh make_plan."""
        ex, world = self.ex, len(self.ex)
        values = _json([e.value(f"id{step}", specs_of[r], error=None, aliases=0)
                        for r, e in enumerate(ex)])
        verdict = _json(ex[0].decide(values))
        plans = [e.apply(verdict, step) if r not in skip else "skipped"
                 for r, e in enumerate(ex)]
        if skip:
            return None
        if plans[0] is None:
            full = _json([e.full_value(f"id{step}b", specs_of[r], rank=r, error=None,
                                       aliases=0) for r, e in enumerate(ex)])
            self.sent.append(full)
            common, parts = _json(ex[0].assign(full, step))  # rank 0 alone plans
            plans = [e.take((common, parts[r]), r, step) for r, e in enumerate(ex)]
        hows = {e.how for e in ex}
        assert len(hows) == 1, hows
        how = hows.pop()
        truth = {fqn for fqn, m in make_plan(self._fresh(specs_of, set()), 0, step)
                 .tensors.items() if m.get("per_rank")}
        if how == "reused":
            assert truth <= self.sticky, "a tensor whose copies differ would be written once"
        else:
            self.sticky = truth
        fresh = self._fresh(specs_of, self.sticky)
        for r, p in enumerate(plans):
            want = make_plan(fresh, r, step)
            assert (p.my_chunks, p.format_version, p.step, p.world_size) == (
                want.my_chunks, want.format_version, want.step, want.world_size), (r, step)
            # (the tensor table is the coordinator's: it writes the manifest)
            assert p.tensors == (want.tensors if r == 0 else {}), (r, step)
            assert p.save_id == plans[0].save_id
        return how

    @staticmethod
    def _fresh(specs_of, sticky):
        """Everyone's full lists, the ``sticky`` tensors' fingerprints made rank-unique."""
        out = []
        for r, specs in enumerate(specs_of):
            rows = [list(s[:8]) for s in specs]  # (the oracle: every chunk to rank 0)
            for row in rows:
                if row[0] in sticky:
                    row[7] = f"{row[7]}-rank{r}"
            out.append({"save_id": "x", "specs": rows, "error": None, "aliases": 0})
        return _json(out)


@pytest.mark.parametrize("world", [1, 2, 4])
def test_first_save_exchanges_once_and_an_unchanged_layout_reuses(world):
    layout = {"dtensors": [8, 16], "regular": [5, 7], "only": {}}
    contents = {(r, j): f"c{j}" for r in range(world) for j in range(2)}
    ranks = _Ranks(world)
    specs = [_rank_specs(r, world, layout, contents) for r in range(world)]
    assert ranks.save(specs, 1) == "exchanged"
    # new content, still replicated (an optimizer's step counter): reused
    contents = {(r, j): f"d{j}" for r in range(world) for j in range(2)}
    specs = [_rank_specs(r, world, layout, contents) for r in range(world)]
    assert ranks.save(specs, 2) == "reused"
    assert ranks.save(specs, 3) == "reused"
    if world > 1:  # one compact hash per rank, not a fingerprint per tensor
        value = ranks.ex[1].value("id4", specs[1], error=None, aliases=0)
        assert "rep" in value and "digests" not in value and "specs" not in value


def test_a_tensor_that_becomes_per_rank_and_a_changed_layout_re_exchange():
    world = 2
    layout = {"dtensors": [8], "regular": [5, 9], "only": {}}
    same = {(r, j): "c" for r in range(world) for j in range(2)}
    ranks = _Ranks(world)
    assert ranks.save([_rank_specs(r, world, layout, same) for r in range(world)], 1) == \
        "exchanged"
    differ = {**same, (1, 1): "other"}  # r1 now differs between the ranks: per rank
    assert ranks.save([_rank_specs(r, world, layout, differ) for r in range(world)], 2) == \
        "re-exchanged"
    assert ranks.sticky == {"r1"}
    assert ranks.save([_rank_specs(r, world, layout, differ) for r in range(world)], 3) == \
        "reused"
    # equal again: it stays per rank (each rank writes its own copy) until the next exchange
    assert ranks.save([_rank_specs(r, world, layout, same) for r in range(world)], 4) == "reused"
    layout2 = dict(layout, only={1: [("extra", 3)]})  # one rank gains a tensor
    assert ranks.save([_rank_specs(r, world, layout2, same) for r in range(world)], 5) == \
        "re-exchanged"
    assert ranks.sticky == set()


def test_ranks_holding_different_shared_tensors_send_every_fingerprint():
    """Replicated tensors held by overlapping sets of ranks: one hash per rank cannot compare
    them, so the values carry each fingerprint, and a copy that differs is still caught."""
    world = 3
    held = {0: ["a", "b"], 1: ["b", "c"], 2: ["a", "c"]}

    def specs(contents):
        return [[_spec(k, (2,), (0,), (2,), False, contents.get((r, k), "same"))
                 for k in held[r]] for r in range(world)]
    ranks = _Ranks(world)
    assert ranks.save(specs({}), 1) == "exchanged"
    value = ranks.ex[0].value("id", specs({})[0], error=None, aliases=0)
    assert "digests" in value and "rep" not in value
    assert ranks.save(specs({}), 2) == "reused"
    assert ranks.save(specs({(2, "c"): "moved"}), 3) == "re-exchanged"
    assert ranks.sticky == {"c"}


def test_a_rank_that_missed_an_exchange_makes_everyone_exchange_the_lists():
    world = 3
    layout = {"dtensors": [9], "regular": [4], "only": {}}
    contents = {(r, 0): "c" for r in range(world)}
    specs = [_rank_specs(r, world, layout, contents) for r in range(world)]
    ranks = _Ranks(world)
    ranks.save(specs, 1)
    ranks.save(specs, 2, skip={2})  # rank 2's wait for the verdict timed out
    assert ranks.save(specs, 3) == "re-exchanged"
    assert ranks.save(specs, 4) == "reused"


@pytest.mark.parametrize("mode", ["lists", "solo", "stages"])
def test_random_sequences_of_saves_plan_as_a_fresh_exchange_would(mode):
    """With ``solo``, the DTensor shards stay on their ranks and a rank whose table or list is
    rank 0's sends None for it; with ``stages`` (pipeline stages, each with its own mesh)
    too, and a stage's ranks whose table or list is another's name the first rank holding it
    (``own_as``, ``specs_as``): the plans must still be the oracle's, chunk for chunk."""
    rng = random.Random(7)
    solo, stages = mode != "lists", 2 if mode == "stages" else 1
    differ: list = []
    named: list = []
    for world in ((4, 6, 8) if stages > 1 else (2, 3, 4, 7)):
        ranks = _Ranks(world)
        layout = {"dtensors": [8 * world, 4 * world], "regular": [3, 6, 2], "only": {},
                  "solo": solo, "stages": stages}
        contents = {(r, j): "c" for r in range(world) for j in range(3)}
        hows = set()
        for step in range(1, 40):
            what = rng.random()
            if what < 0.3:  # new content, replicated
                tag = f"s{step}"
                contents = {k: tag for k in contents}
            elif what < 0.45:  # one rank's copy differs (or all agree again)
                r, j = rng.randrange(world), rng.randrange(3)
                contents[(r, j)] = rng.choice(["c", f"u{step}"])
            elif what < 0.55:  # a rank gains or drops a tensor of its own
                r = rng.randrange(world)
                layout["only"][r] = [] if layout["only"].get(r) else [(f"o{step}", 2)]
            elif what < 0.6:  # a tensor grows
                layout["regular"][rng.randrange(3)] += 1
            elif what < 0.65:  # a new DTensor (every rank's table changes)
                layout["dtensors"].append(world * rng.randint(1, 4))
            specs = [_rank_specs(r, world, layout, contents) for r in range(world)]
            hows.add(ranks.save(specs, step))
        assert hows == {"exchanged", "re-exchanged", "reused"}
        lists = [v["specs"] is None for full in ranks.sent for v in full[1:]]
        tables = [v["own"] is None for full in ranks.sent for v in full[1:]]
        # (a rank sends its list only where it differs from rank 0's: with the DTensor shards
        # out of the lists, both kinds were seen; with them in, every list differs)
        assert (any(lists) and not all(lists)) if solo else not any(lists), lists
        if stages == 1:
            assert all(tables), tables  # (the same mesh on every rank, or no table at all)
        differ += [bool(v.get("differ")) for full in ranks.sent for v in full[1:]]
        named += [(v.get("own_as"), v.get("specs_as")) for full in ranks.sent for v in full]
    # a list that is rank 0's but for a fingerprint (a copy that differs) sends that alone
    assert any(differ) == solo
    # another stage's table and list were named, not sent, by all but one of its ranks
    assert any(a is not None for a, _ in named) == any(b is not None for _, b in named) == (
        stages > 1)


def test_a_stage_rank_whose_copy_differs_names_the_list_and_sends_its_fingerprints():
    """Pipeline stages, a process's first save: rank 3's copy of its stage's "r1" differs
    from rank 2's (a per-rank RNG state): it names rank 2's list and sends its fingerprints
    alone (``digests_as``); "r1" is then per rank, each stage rank writes its own; a later
    save with every copy equal again reuses (it stays per rank until the next exchange)."""
    world = 4
    layout = {"dtensors": [8, 12, 4], "regular": [3, 6, 2], "only": {}, "solo": True,
              "stages": 2}
    contents = {(r, j): "c" for r in range(world) for j in range(3)}
    contents[(3, 1)] = "rank3"
    ranks = _Ranks(world)
    assert ranks.save([_rank_specs(r, world, layout, contents) for r in range(world)], 1) == \
        "exchanged"
    (full,) = ranks.sent
    assert full[3].get("specs_as") == 2 and full[3].get("digests_as") is not None, full[3]
    assert full[2]["specs"] is not None and full[1]["specs"] is None
    assert ranks.sticky == {"r1"}
    contents[(3, 1)] = "c"
    assert ranks.save([_rank_specs(r, world, layout, contents) for r in range(world)], 2) == \
        "reused"


def test_an_error_on_one_rank_is_raised_everywhere_before_any_reuse():
    world = 2
    layout = {"dtensors": [4], "regular": [2], "only": {}}
    contents = {(r, 0): "c" for r in range(world)}
    specs = [_rank_specs(r, world, layout, contents) for r in range(world)]
    ranks = _Ranks(world)
    ranks.save(specs, 1)
    values = _json([e.value("id2", specs[r] if r == 0 else [], error=None if r == 0 else
                            "bad thing", aliases=0) for r, e in enumerate(ranks.ex)])
    verdict = _json(ranks.ex[0].decide(values))
    for e in ranks.ex:
        with pytest.raises(fastckpt.errors.UnsupportedStateError, match="rank 1 .*bad thing"):
            e.apply(verdict, 2)
    assert ranks.save(specs, 3) == "reused"  # the failed exchange changed nothing


# ------------------------------------------------------------------------------- real ranks

def _saves(rank, world, root):
    torch.manual_seed(0)
    w = torch.nn.Linear(6, 4)
    opt = torch.optim.Adam(w.parameters(), lr=0.1)
    state = {"model": w, "optim": opt, "pos": 100 * rank, "rng": torch.tensor([rank, 1]),
             "shared": torch.ones(3)}
    hows, want = [], {}
    ckpt = fastckpt.Checkpointer(root)
    for step in range(1, 6):
        w(torch.ones(2, 6)).sum().backward()
        opt.step()
        state["pos"] = 100 * rank + step
        if step == 3:
            state["shared"] = torch.full((3,), float(rank))  # differs between ranks now
        if step == 4:
            state["extra"] = torch.full((3,), float(step))  # a new tensor: a new layout
        ckpt.save(state, step=step, block=True)
        hows.append(ckpt._plans.how)
        want[step] = {k: v.detach().clone() for k, v in flatten(state).tensors.items()}
        want[step]["pos"] = state["pos"]
    ckpt.close()
    got = {}
    for step in range(1, 6):
        d = fastckpt.Checkpointer(root).read(step=step)
        got[step] = dict(flatten(d).tensors)
        got[step]["pos"] = d["pos"]
    return hows, want, got


@pytest.mark.parametrize("world", [2, 4])
def test_real_ranks_reuse_and_every_step_loads_back(tmp_path, world):
    out = run(_saves, world, str(tmp_path / "ckpt"))
    for rank, (hows, want, got) in enumerate(out):
        # step 3: "shared" turns per rank: the lists go again; step 4: a new tensor; steps 2
        # and 5: nothing changed but values ("rng" is per rank throughout)
        assert hows == ["exchanged", "reused", "re-exchanged", "re-exchanged", "reused"], hows
        for step in range(1, 6):
            assert got[step]["pos"] == 100 * rank + step  # this rank's own skeleton
            assert set(got[step]) == set(want[step])
            for k, v in want[step].items():
                if torch.is_tensor(v):
                    assert torch.equal(got[step][k], v), (rank, step, k)


def test_the_coordinators_plan_writes_each_chunk_once_by_a_holder_and_balances():
    """make_plans (rank 0 alone plans every rank): a chunk one rank holds is that rank's; a
    replicated chunk several hold is written by exactly one of them, the least loaded; a
    per-rank tensor by every holder; rank 0's own value (tuples, not through JSON) agrees
    with the others' (lists); a disagreement names the rank."""
    from fastckpt.engine.plan import make_plans
    rng = random.Random(7)
    for trial in range(30):
        world = rng.choice([2, 3, 4, 7])
        layout = {"dtensors": [world * rng.randint(1, 9) for _ in range(rng.randint(0, 3))],
                  "regular": [rng.randint(1, 500) for _ in range(rng.randint(1, 12))],
                  "only": {}}
        per = {j for j in range(len(layout["regular"])) if rng.random() < 0.2}
        contents = {(r, j): (f"p{r}" if j in per else "same")
                    for r in range(world) for j in range(len(layout["regular"]))}
        specs = [_rank_specs(r, world, layout, contents) for r in range(world)]
        values = [{"save_id": "s", "specs": specs[0], "error": None, "aliases": 0}]
        values += _json([{"save_id": "s", "specs": specs[r], "error": None, "aliases": 0}
                         for r in range(1, world)])
        rows, plan = make_plans(values, 3)
        assert plan.world_size == world and plan.step == 3
        written: dict = {}
        for r in range(world):
            assert all(row[7] is None for row in rows[r])
            for row in rows[r]:
                written.setdefault((row[0], tuple(row[3])), []).append(r)
        for j, n in enumerate(layout["regular"]):
            who = written[(f"r{j}", (0,))]
            assert who == (list(range(world)) if j in per else who[:1]), (trial, j, who)
            assert plan.tensors[f"r{j}"].get("per_rank", False) == (j in per)
        for i, rows_n in enumerate(layout["dtensors"]):
            step_rows = rows_n // world
            for r in range(world):
                assert written[(f"w{i}", (r * step_rows, 0))] == [r]
        load = [sum(row[5] for row in rows[r]) for r in range(world)]
        biggest = max([n * 4 for n in layout["regular"]], default=0)
        assert max(load) - min(load) <= biggest + sum(
            n * 4 for j, n in enumerate(layout["regular"]) if j in per), (trial, load)
    bad = _json([{"save_id": "s", "specs": [_spec("x", (4,), (0,), (4,), False, "a")],
                  "error": None, "aliases": 0},
                 {"save_id": "s", "specs": [_spec("x", (5,), (0,), (5,), False, "a")],
                  "error": None, "aliases": 0}])
    with pytest.raises(fastckpt.UnsupportedStateError, match=r"'x'.*rank 1"):
        make_plans(bad, 1)


def _agreements(rank, world, root):
    """The first save's claim of the root and the load's agreement, both through rank 0 alone
    (``Group.decide``) now: a held lease fails on rank 0 and is named on the others; a rank
    whose state does not fit the checkpoint fails with its own error, the others name it."""
    import torch.distributed as tdist
    from fastckpt.errors import FastCkptError, WriterLockedError
    from fastckpt.lease import WriterLease
    from fastckpt.storage import open_storage
    held = None
    if rank == 0:
        held = WriterLease(open_storage(root), ttl_s=60, renew_s=15).acquire()
    tdist.barrier()
    out = {}
    ck = fastckpt.Checkpointer(root)
    try:
        ck.save({"w": torch.arange(4.0)}, step=1, block=True)
        out["locked"] = None
    except WriterLockedError as e:
        out["locked"] = str(e)
    ck.close()
    if held is not None:
        held.release()
    tdist.barrier()
    ck = fastckpt.Checkpointer(root)
    ck.save({"w": torch.arange(4.0)}, step=2, block=True)
    state = {"w": torch.zeros(5 if rank == 1 else 4)}
    try:
        ck.load(state)
        out["load"] = None
    except FastCkptError as e:
        out["load"] = f"{type(e).__name__}: {e}"
    ck.close()
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_claiming_the_root_and_the_load_agreement_name_the_failing_rank(tmp_path, world):
    out = run(_agreements, world, str(tmp_path / "ckpt"))
    assert "rank 0 cannot save" not in out[0]["locked"]  # its own error on rank 0
    for r in range(1, world):
        assert out[r]["locked"].startswith("rank 0 cannot save: "), out[r]
    assert "rank 1" not in out[1]["load"] and "w" in out[1]["load"], out[1]
    for r in (0, *range(2, world)):
        assert "load failed on other ranks: rank 1: " in out[r]["load"], out[r]


def test_a_tensor_sharded_two_ways_is_refused_naming_the_ranks():
    """A tensor's solo shards must all come from one mesh and placements, and no rank may hold
    a non-empty box of it in its list too: else two ranks could write the same rows."""
    from fastckpt.engine.plan import make_plans

    def value(own, specs):
        return {"save_id": "s", "own": own, "own_bytes": 0, "specs": specs, "error": None,
                "aliases": 0}
    table = [["w", "float32", [4, 3], "meshA"]]
    two_meshes = _json([value(table, []), value([["w", "float32", [4, 3], "meshB"]], [])])
    with pytest.raises(fastckpt.UnsupportedStateError, match=r"'w'.*rank 1.*rank 0"):
        make_plans(two_meshes, 1)
    boxed = _json([value(table, []), value([], [_spec("w", (4, 3), (0, 0), (2, 3), True,
                                                      None)[:8]])])
    with pytest.raises(fastckpt.UnsupportedStateError, match=r"'w': rank 1 holds a box"):
        make_plans(boxed, 1)
    # an empty box (several ranks can hold the same one) is no conflict
    empty = _json([value(table, []), value([], [_spec("w", (4, 3), (4, 0), (0, 3), True,
                                                      None)[:8]])])
    rows, plan = make_plans(empty, 1)
    assert plan.tensors["w"]["shape"] == [4, 3] and rows[1][0][4] == [0, 3]


def _solo_save(rank, world, root):
    """FSDP2 shards on the world mesh stay on their ranks (``solo``); a box replicated over a
    mesh dimension (its replicas elect the writer), an empty box and a 2-D sharded box are
    told apart; a rank whose other chunks are rank 0's (the ``step`` counters) sends rank 0 no
    list at all. Then it loads back, the empty box that nobody wrote and the empty tensor
    too; every box of "rep" is in the checkpoint once."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from fastckpt.engine.plan import local_chunks
    from tests.models import fsdp_mlp, full_state, train_step
    sent = _full_values()
    m = fsdp_mlp(0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for s in range(2):
        train_step(m, opt, s, rank, world)
    flat, grid = init_device_mesh("cpu", (world,)), init_device_mesh("cpu", (2, world // 2))
    extra = {"tiny": distribute_tensor(torch.arange(3.0), flat, [Shard(0)]),
             "none": distribute_tensor(torch.zeros(0, 2), flat, [Shard(0)]),
             "rep": distribute_tensor(torch.arange(8.0).reshape(4, 2), grid,
                                      [Replicate(), Shard(0)]),
             "grid": distribute_tensor(torch.arange(16.0).reshape(4, 4), grid,
                                       [Shard(0), Shard(1)])}
    specs, _ = local_chunks(extra, world=world)
    solo = {s.fqn: (s.solo is not None, s.writes) for s in specs}
    specs, _ = local_chunks(dict(m.state_dict()), world=world)
    model_solo = all(s.solo for s in specs)
    fastckpt.save({"model": m, "optim": opt, "extra": extra}, root, step=1)
    want = full_state(m, opt)
    m2 = fsdp_mlp(5)
    opt2 = torch.optim.Adam(m2.parameters(), lr=1e-2)
    back = {k: torch.distributed.tensor.zeros(v.shape, device_mesh=v.device_mesh,
                                              placements=v.placements)
            for k, v in extra.items()}
    train_step(m2, opt2, 0, rank, world)  # (the optimizer's state exists to load into)
    fastckpt.load({"model": m2, "optim": opt2, "extra": back}, root)
    same = all(torch.equal(back[k].full_tensor(), v.full_tensor()) for k, v in extra.items())
    return solo, model_solo, sent, want, full_state(m2, opt2), same


@pytest.mark.parametrize("indexed", [False, True])
def test_real_fsdp2_shards_stay_on_their_ranks_and_load_back(tmp_path, indexed):
    """(``indexed``: per-rank chunk indexes, each rank loading from its own: rank 3's has no
    chunk of "tiny", whose box on rank 3 is empty)"""
    from tests.models import assert_same
    import glob
    env = {"FASTCKPT_RANK_INDEXES": "1" if indexed else "none"}
    out = run(_solo_save, 4, str(tmp_path / "ckpt"), env=env)
    assert len(glob.glob(str(tmp_path / "ckpt" / "*" / "*.fci"))) == (4 if indexed else 0)
    for r, (solo, model_solo, sent, want, got, same) in enumerate(out):
        # rank 3's "tiny" box is empty (3 rows on 4 ranks): solo, written by nobody; a tensor
        # with no element ("none") is never solo (someone must write its empty chunk); "rep"
        # is replicated over the grid's first dim: ranks 0 and 2 hold one box, 1 and 3 the
        # other, and one of each pair writes it
        assert {k: v[0] for k, v in solo.items()} == {
            "tiny": True, "none": False, "rep": True, "grid": True}, (r, solo)
        assert solo["tiny"][1] == (r < 3) and solo["grid"][1], (r, solo)
        assert model_solo and same, r
        assert_same(want, got)
        (value,) = sent  # one full exchange: the first save
        assert value["own_bytes"] > 0
        if r == 0:
            assert value["own"] and value["specs"]
        else:
            assert value["own"] is None, r  # every rank's table is rank 0's
            # (the boxes are all solo: what is left, the optimizer's step counters, is alike)
            assert value["specs"] is None, (r, value["specs"])
    writers = [out[r][0]["rep"][1] for r in range(4)]
    assert writers[0] != writers[2] and writers[1] != writers[3], writers
    from fastckpt.manifest.discovery import read_manifest
    from fastckpt.manifest.schema import step_dirname
    from fastckpt.storage import open_storage
    root = str(tmp_path / "ckpt")
    body = read_manifest(open_storage(root), f"{root}/{step_dirname(1)}", step=1)
    boxes = {fqn: sorted(tuple(c["offsets"]) for c in t["chunks"])
             for fqn, t in body["tensors"].items() if fqn.startswith("extra.")}
    assert boxes == {"extra.tiny": [(0,), (1,), (2,)], "extra.none": [(0, 0)],
                     "extra.rep": [(0, 0), (2, 0)],
                     "extra.grid": [(0, 0), (0, 2), (2, 0), (2, 2)]}, boxes


@pytest.mark.parametrize("alike", [True, False])
def test_replicas_write_each_box_once_and_balance_by_bytes_when_their_tables_agree(alike):
    """``solo.written`` on each of R replicas of a group of boxes: every box is written by
    exactly one replica, by the greedy (balanced by bytes) when every rank's table was rank
    0's, else by the hash alone (``solo.elect``: each box decided alone, whatever the others
    hold)."""
    from fastckpt.engine.solo import elect, written
    rng = random.Random(3)
    boxes = [(f"t{i}", (8 * i, 0), rng.choice([4, 64, 4096, 1 << 20])) for i in range(60)]
    for replicas in (2, 3, 8):
        got = []
        for place in range(replicas):
            specs = [(fqn, "float32", (999, 4), offs, (8, 4), nb, True, None, "mesh",
                      elect(fqn, offs, replicas) == place, (replicas, place))
                     for fqn, offs, nb in boxes]
            got.append(written(specs, alike))
        keys = sorted((r[0], tuple(r[3])) for rows in got for r in rows)
        assert keys == sorted((fqn, offs) for fqn, offs, _ in boxes), replicas
        load = [sum(r[5] for r in rows) for rows in got]
        if alike:  # (largest first to the least loaded: within the largest box of the mean)
            assert max(load) - min(load) <= 1 << 20, (replicas, load)


def _boxes(rank, world, root):
    """``local_chunks`` computes a DTensor's box once per mesh, placements and global shape:
    each box must still be torch's own, whatever the meshes (one of them with the ranks in
    reverse order), placements and shapes the state mixes; a ``Partial`` DTensor is refused
    naming it, and the last committed step survives."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

    from fastckpt.engine.plan import local_chunks
    from fastckpt.errors import UnsupportedStateError
    flat, grid = init_device_mesh("cpu", (world,)), init_device_mesh("cpu", (2, world // 2))
    rev = DeviceMesh("cpu", list(range(world))[::-1])
    full = torch.arange(40.0).reshape(10, 4)
    layouts = {"a": (flat, [Shard(0)]), "a2": (flat, [Shard(1)]), "r": (rev, [Shard(0)]),
               "b": (grid, [Shard(0), Shard(1)]), "c": (grid, [Replicate(), Shard(0)]),
               "d": (grid, [Shard(0), Shard(0)]), "a_again": (flat, [Shard(0)])}
    state = {k: distribute_tensor(full, m, p) for k, (m, p) in layouts.items()}
    state["small"] = distribute_tensor(torch.arange(3.0), flat, [Shard(0)])  # rank 3: empty
    state["small2"] = distribute_tensor(torch.arange(3.0) + 1, rev, [Shard(0)])
    specs, data = local_chunks(state, world=world)
    got = {s.fqn: (s.offsets, s.sizes) for s in specs}
    want = {k: (tuple(c.offsets), tuple(c.sizes))
            for k, t in state.items() for c in t.__create_chunk_list__()}
    same_memory = all(data[(k, got[k][0])].data_ptr() == t.to_local().data_ptr()
                      for k, t in state.items())
    fastckpt.save({"w": state}, root, step=1)
    bad = dict(state, p=DTensor.from_local(torch.ones(2), flat, [Partial()]))
    try:
        local_chunks(bad, world=world)
        refused = None
    except UnsupportedStateError as e:
        refused = (e.key, str(e))
    try:
        fastckpt.save({"w": bad}, root, step=2)
        saved = None
    except UnsupportedStateError as e:
        saved = str(e)
    back = {k: torch.distributed.tensor.zeros(v.shape, device_mesh=v.device_mesh,
                                              placements=v.placements)
            for k, v in state.items()}
    fastckpt.load({"w": back}, root)
    loaded = all(torch.equal(back[k].to_local(), v.to_local()) for k, v in state.items())
    return got, want, same_memory, refused, saved, fastckpt.latest_step(root), loaded


def test_dtensor_boxes_computed_once_per_layout_are_torchs_and_partial_is_refused(tmp_path):
    out = run(_boxes, 4, str(tmp_path / "ckpt"), env={"FASTCKPT_RANK_INDEXES": "none"})
    for r, (got, want, same_memory, refused, saved, latest, loaded) in enumerate(out):
        assert got == want and same_memory, (r, got, want)
        assert refused[0] == "p" and "Partial" in refused[1], (r, refused)
        assert saved is not None and "'w.p'" in saved and "Partial" in saved, (r, saved)
        assert latest == 1 and loaded, r
    # the reversed mesh gives other boxes than the flat one: a cache keyed without the mesh
    # would have given "r" the flat mesh's
    assert out[0][0]["r"] != out[0][0]["a"] and out[0][0]["small2"] != out[0][0]["small"]


def _pp_save(rank, world, root, clash):
    """Pipeline stages under FSDP2 (torchtitan's layout: a (pp, dp) mesh, each stage's layers
    sharded over its ``dp`` sub-mesh, the full model's names kept): every box is solo, a
    stage's first rank sends its table once for the stage (its other ranks name it), a box
    replicated over the stage's ranks is written once; the load is bit-exact. With ``clash``
    both stages hold a tensor of the same name on their own meshes: refused, naming ranks, and
    the step before survives."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Replicate, distribute_tensor

    from fastckpt.engine.plan import local_chunks
    from tests.models import mlp
    sent = _full_values()
    grid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    dp, stage = grid["dp"], grid.get_local_rank("pp")

    def build(seed):
        full = mlp(seed)
        m = torch.nn.ModuleDict({k: full[int(k)] for k in (("0", "2") if stage == 0 else ("4",))})
        for layer in m.values():
            fully_shard(layer, mesh=dp)
        opt = torch.optim.Adam(m.parameters(), lr=1e-2)
        x = torch.randn(4, 10 if stage == 0 else 33, generator=torch.Generator().manual_seed(7))
        for layer in m.values():
            x = torch.relu(layer(x))
        x.sum().backward()
        opt.step()
        return m, opt
    m, opt = build(0)
    extra = {f"rep{stage}": distribute_tensor(torch.arange(8.0) + stage, dp, [Replicate()])}
    if clash:
        extra["clash"] = distribute_tensor(torch.arange(4.0), dp, [Replicate()])
    specs, _ = local_chunks({**m.state_dict(), **extra}, world=world)
    all_solo = all(s.solo for s in specs)
    mine = torch.full((3,), float(rank))  # (per rank, as an RNG state: each its own)
    fastckpt.save({"model": m, "optim": opt, "extra": extra, "mine": mine}, root, step=1)
    m2, opt2 = build(5)
    back = {k: torch.zeros_like(v) for k, v in extra.items()}
    mine2 = torch.zeros(3)
    fastckpt.load({"model": m2, "optim": opt2, "extra": back, "mine": mine2}, root)
    from tests.models import full_state
    same = all(torch.equal(back[k].to_local(), v.to_local()) for k, v in extra.items())
    same = same and torch.equal(mine2, mine)
    got = full_state(m2, opt2)
    return all_solo, sent, full_state(m, opt), got, same


def test_pipeline_stages_keep_their_boxes_and_send_one_table_per_stage(tmp_path):
    from tests.models import assert_same
    for indexed in (False, True):
        root = str(tmp_path / f"ckpt{int(indexed)}")
        out = run(_pp_save, 4, root, False,
                  env={"FASTCKPT_RANK_INDEXES": "1" if indexed else "none"})
        for r, (all_solo, sent, want, got, same) in enumerate(out):
            assert all_solo and same, r
            assert_same(want, got)
            (value,) = sent  # one full exchange
            # rank 1's table and list are rank 0's but for its own "mine" (``differ``); rank 2
            # sends its stage's (the step counters of its layers); rank 3 names rank 2's,
            # with its fingerprints ("mine" differs)
            assert (value["own"] is not None) == (value["specs"] is not None) == (
                r in (0, 2)), (r, value)
            assert value.get("own_as") == value.get("specs_as") == (2 if r == 3 else None), \
                (r, value)
            assert bool(value.get("differ")) == (r == 1), (r, value)
            assert (value.get("digests_as") is not None) == (r == 3), (r, value)
        from fastckpt.manifest.discovery import read_manifest
        from fastckpt.manifest.schema import step_dirname
        from fastckpt.storage import open_storage
        body = read_manifest(open_storage(root), f"{root}/{step_dirname(1)}", step=1)
        assert body["tensors"]["mine"].get("per_rank"), body["tensors"]["mine"]
        for fqn, t in body["tensors"].items():
            if fqn == "mine":
                continue  # (per rank: each rank's own copy)
            n = 1
            for d in t["shape"]:
                n *= d
            held = sum(math.prod(c["sizes"]) for c in t["chunks"])
            assert held == n, (fqn, held, n)  # every element once: the election too
        assert "extra.rep0" in body["tensors"] and "extra.rep1" in body["tensors"]


def test_a_tensor_on_two_stages_meshes_is_refused_naming_ranks(tmp_path):
    with pytest.raises(AssertionError) as e:
        run(_pp_save, 4, str(tmp_path / "ckpt"), True, env={"FASTCKPT_RANK_INDEXES": "none"})
    assert "'extra.clash'" in str(e.value) and "another device mesh" in str(e.value)
    assert "rank 2" in str(e.value) and "rank 0" in str(e.value)
    assert fastckpt.steps(str(tmp_path / "ckpt")) == []  # refused before any commit
