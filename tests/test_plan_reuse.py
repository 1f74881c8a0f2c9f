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

import random

import pytest
import torch

import fastckpt
from fastckpt.engine.plan import PlanExchange, make_plan
from fastckpt.engine.state import flatten

from tests.distributed import run


def _spec(fqn, shape, offsets, sizes, dtensor, digest):
    n = 4
    for s in sizes:
        n *= s
    return (fqn, "float32", tuple(shape), tuple(offsets), tuple(sizes), n, dtensor, digest)


def _rank_specs(rank, world, layout, contents):
    """A rank's specs: DTensor shards of "w{i}" (rows split over the ranks), replicated
    regular tensors "r{j}" whose fingerprint is ``contents[(rank, j)]``."""
    specs = []
    for i, rows in enumerate(layout["dtensors"]):
        per = rows // world
        specs.append(_spec(f"w{i}", (rows, 3), (rank * per, 0), (per, 3), True, None))
    for j, n in enumerate(layout["regular"]):
        specs.append(_spec(f"r{j}", (n,), (0,), (n,), False, contents[(rank, j)]))
    for fqn, n in layout["only"].get(rank, []):
        specs.append(_spec(fqn, (n,), (0,), (n,), False, "x"))
    return specs


def _save(exchanges, specs_of, step):
    """One save's exchange on every simulated rank: the plans, and how they were made."""
    world = len(exchanges)
    first = [ex.value(f"id{step}", specs_of[r], error=None, aliases=0)
             for r, ex in enumerate(exchanges)]
    plans = [ex.resolve(first, r, step) for r, ex in enumerate(exchanges)]
    assert len({p is None for p in plans}) == 1, "the ranks decided differently"
    if plans[0] is None:
        full = [ex.full_value(f"id{step}b", specs_of[r], error=None, aliases=0)
                for r, ex in enumerate(exchanges)]
        plans = [ex.resolve(full, r, step) for r, ex in enumerate(exchanges)]
    hows = {ex.how for ex in exchanges}
    assert len(hows) == 1
    fresh = [{"save_id": "x", "specs": [list(s) for s in specs_of[r]], "error": None,
              "aliases": 0} for r in range(world)]
    for r, p in enumerate(plans):
        want = make_plan(fresh, r, step)
        assert (p.my_chunks, p.tensors, p.format_version, p.step) == (
            want.my_chunks, want.tensors, want.format_version, want.step), (r, step)
        assert p.save_id == plans[0].save_id
    return hows.pop()


@pytest.mark.parametrize("world", [1, 2, 4])
def test_first_save_exchanges_once_and_an_unchanged_layout_reuses(world):
    layout = {"dtensors": [8, 16], "regular": [5, 7], "only": {}}
    contents = {(r, j): f"c{j}" for r in range(world) for j in range(2)}
    ex = [PlanExchange() for _ in range(world)]
    specs = [_rank_specs(r, world, layout, contents) for r in range(world)]
    assert _save(ex, specs, 1) == "exchanged"
    # new content, still replicated (an optimizer's step counter): reused
    contents = {(r, j): f"d{j}" for r in range(world) for j in range(2)}
    specs = [_rank_specs(r, world, layout, contents) for r in range(world)]
    assert _save(ex, specs, 2) == "reused"
    assert _save(ex, specs, 3) == "reused"


def test_a_tensor_that_becomes_per_rank_and_a_changed_layout_re_exchange():
    world = 2
    layout = {"dtensors": [8], "regular": [5, 9], "only": {}}
    same = {(r, j): "c" for r in range(world) for j in range(2)}
    ex = [PlanExchange() for _ in range(world)]
    assert _save(ex, [_rank_specs(r, world, layout, same) for r in range(world)], 1) == "exchanged"
    differ = {**same, (1, 1): "other"}  # r1 now differs between the ranks: per rank
    assert _save(ex, [_rank_specs(r, world, layout, differ) for r in range(world)], 2) == \
        "re-exchanged"
    assert _save(ex, [_rank_specs(r, world, layout, differ) for r in range(world)], 3) == "reused"
    layout2 = dict(layout, only={1: [("extra", 3)]})  # one rank gains a tensor
    assert _save(ex, [_rank_specs(r, world, layout2, differ) for r in range(world)], 4) == \
        "re-exchanged"


def test_a_rank_that_missed_an_exchange_makes_everyone_exchange_the_lists():
    world = 3
    layout = {"dtensors": [9], "regular": [4], "only": {}}
    contents = {(r, 0): "c" for r in range(world)}
    specs = [_rank_specs(r, world, layout, contents) for r in range(world)]
    ex = [PlanExchange() for _ in range(world)]
    _save(ex, specs, 1)
    # rank 2's gather of save 2 timed out where the others' completed: its base is older
    first = [e.value("id2", specs[r], error=None, aliases=0) for r, e in enumerate(ex)]
    for r in (0, 1):
        ex[r].resolve(first, r, 2)
    assert _save(ex, specs, 3) == "re-exchanged"
    assert _save(ex, specs, 4) == "reused"


def test_random_sequences_of_saves_plan_as_a_fresh_exchange_would():
    rng = random.Random(7)
    for world in (2, 3, 4):
        ex = [PlanExchange() for _ in range(world)]
        layout = {"dtensors": [8 * world, 4 * world], "regular": [3, 6, 2], "only": {}}
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
            specs = [_rank_specs(r, world, layout, contents) for r in range(world)]
            hows.add(_save(ex, specs, step))
        assert hows == {"exchanged", "re-exchanged", "reused"}


def test_an_error_on_one_rank_is_raised_everywhere_before_any_reuse():
    world = 2
    layout = {"dtensors": [4], "regular": [2], "only": {}}
    contents = {(r, 0): "c" for r in range(world)}
    specs = [_rank_specs(r, world, layout, contents) for r in range(world)]
    ex = [PlanExchange() for _ in range(world)]
    _save(ex, specs, 1)
    first = [e.value("id2", specs[r] if r == 0 else [], error=None if r == 0 else "bad thing",
                     aliases=0) for r, e in enumerate(ex)]
    for r, e in enumerate(ex):
        with pytest.raises(fastckpt.errors.UnsupportedStateError, match="rank 1 .*bad thing"):
            e.resolve(first, r, 2)
    assert _save(ex, specs, 3) == "reused"  # the failed exchange changed nothing


# ------------------------------------------------------------------------------- real ranks

def _saves(rank, world, root):
    torch.manual_seed(0)
    w = torch.nn.Linear(6, 4)
    opt = torch.optim.Adam(w.parameters(), lr=0.1)
    state = {"model": w, "optim": opt, "pos": 100 * rank, "rng": torch.tensor([rank, 1])}
    hows, want = [], {}
    ckpt = fastckpt.Checkpointer(root)
    for step in range(1, 6):
        w(torch.ones(2, 6)).sum().backward()
        opt.step()
        state["pos"] = 100 * rank + step
        if step == 3:
            state["rng"] = torch.tensor([5, 1])  # the same on every rank: replicated now
        if step == 4:
            state["extra"] = torch.full((3,), float(step))  # a new tensor: a new layout
        ckpt.save(state, step=step, block=True)
        hows.append(ckpt._plans.how)
        want[step] = {k: (v.detach().clone() if torch.is_tensor(v) else v)
                      for k, v in flatten(state).tensors.items()}
        want[step]["pos"] = state["pos"]
    ckpt.close()
    got = {}
    for step in range(1, 6):
        d = fastckpt.Checkpointer(root).read(step=step)
        flat = flatten(d).tensors
        got[step] = {k: v for k, v in flat.items()}
        got[step]["pos"] = d["pos"]
    return hows, want, got


@pytest.mark.parametrize("world", [2, 4])
def test_real_ranks_reuse_and_every_step_loads_back(tmp_path, world):
    out = run(_saves, world, str(tmp_path / "ckpt"))
    for rank, (hows, want, got) in enumerate(out):
        # step 3: "rng" turns replicated (per rank before): the lists go again; step 4: a new
        # tensor; steps 2 and 5: nothing changed but values
        assert hows == ["exchanged", "reused", "re-exchanged", "re-exchanged", "reused"], hows
        for step in range(1, 6):
            assert got[step]["pos"] == 100 * rank + step  # this rank's own skeleton
            assert set(got[step]) == set(want[step])
            for k, v in want[step].items():
                if torch.is_tensor(v):
                    assert torch.equal(got[step][k], v), (rank, step, k)
