"""Load edge cases, found by a review on 2026-12-06: a per-rank tensor without this rank's
copy, a fall back whose older step fails too, a sub-state that does not take the loaded values,
meta-device destinations, per-rank lists taken for pipeline stages, ranks falling back to
different steps, a chunk at an odd offset (each failed before its fix: silent or unnamed);
and resharding cases checked and found right (FSDP2 into a plain model, DDP, empty shards,
DTensor layout changes), kept as regression checks."""

from __future__ import annotations

import os

import pytest
import torch

import fastckpt
from tests.crafted import read_doc, write_doc
from tests.distributed import run


def _save_per_rank(rank, world, root):
    fastckpt.save({"x": torch.full((4,), float(rank)), "y": torch.arange(3.0)}, root, step=1,
                  rank_indexes=None)  # one self-contained manifest (the chunks in it)


def _load_x(rank, world, root):
    st = {"x": torch.full((4,), -1.0), "y": torch.zeros(3)}
    try:
        fastckpt.load(st, root)
    except Exception as e:  # noqa: BLE001
        return ("raised", type(e).__name__, str(e))
    return ("loaded", st["x"].tolist())


def test_a_per_rank_tensor_without_one_ranks_copy_is_refused(root):
    """A manifest (re-checksummed, as an attacker or a damaged writer would leave it) whose
    per-rank tensor lists no copy for rank 1 passes validation (schema._validate_tensor counts
    the cover of the ranks that have chunks only); rank 1's read metadata then has no chunk of
    it, DCP plans no read, and rank 1's destination is left as it was, the load reporting
    success."""
    run(_save_per_rank, 2, root)
    doc = read_doc(root, 1)
    t = doc["body"]["tensors"]["x"]
    assert t.get("per_rank") and len(t["chunks"]) == 2
    t["chunks"] = [c for c in t["chunks"] if c["rank"] == 0]  # rank 1's copy left out
    write_doc(root, 1, doc)
    out = run(_load_x, 2, root)
    assert out[1][0] == "raised", f"rank 1 loaded {out[1]}: its copy is not in the checkpoint"


def _save_fsdp(rank, world, root):
    from tests.models import fsdp_mlp, full_state, train_step
    m = fsdp_mlp(0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for s in range(2):
        train_step(m, opt, s, rank, world)
    fastckpt.save({"model": m, "optim": opt}, root, step=2)
    return full_state(m, opt)


def _load_plain(rank, world, root):
    from tests.models import full_state, mlp
    m = mlp(5)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    fastckpt.load({"model": m, "optim": opt}, root)
    return full_state(m, opt)


def test_fsdp2_state_loads_into_a_plain_model_and_fresh_optimizer(root):
    """(passes) FSDP2 at 2 ranks into a plain model and a fresh Adam at 2 and 1 ranks."""
    from tests.models import assert_same
    want = run(_save_fsdp, 2, root)[0]
    for got in run(_load_plain, 2, root) + run(_load_plain, 1, root):
        assert_same(want, got)


def test_a_resume_whose_fallback_fails_says_the_state_holds_the_damaged_step(root):
    """The newest step (2) is damaged; the resume falls back to step 1, which cannot be
    planned (it lacks "b"): by then step 2's reads have overwritten "a" (damaged bytes) and
    "b". The error raised must say so (name step 2's damage and that the state was written),
    not only that step 1 lacks "b"."""
    fastckpt.save({"a": torch.arange(1000.0)}, root, step=1)
    fastckpt.save({"a": torch.arange(1000.0) + 5000, "b": torch.ones(3)}, root, step=2)
    c = read_doc(root, 2)["body"]["tensors"]["a"]["chunks"][0]
    with open(os.path.join(root, "step-0000000002", c["file"]), "r+b") as f:
        f.seek(c["offset"] + 8)
        f.write(b"\xff\xff\xff\xff")
    st = {"a": torch.zeros(1000), "b": torch.zeros(3)}
    with pytest.raises(Exception) as ei:
        fastckpt.load(st, root)
    written = not torch.equal(st["a"], torch.zeros(1000)) or not torch.equal(st["b"],
                                                                             torch.zeros(3))
    msg = f"{type(ei.value).__name__}: {ei.value}"
    chain = [ei.value.__cause__, ei.value.__context__]
    assert not written or ("damaged" in msg or "step 2" in msg or any(
        isinstance(x, fastckpt.errors.CorruptCheckpointError) for x in chain)), (
        f"state written by the damaged step 2 (a[:3]={st['a'][:3].tolist()}, "
        f"b={st['b'].tolist()}) but the load raised only {msg!r}")


def test_a_meta_device_destination_is_refused_not_left_unloaded(root):
    """A save refuses a tensor on the meta device; a load into one (a model built under
    torch.device("meta") whose to_empty() was forgotten) must not report success having
    loaded nothing."""
    fastckpt.save({"w": torch.arange(4.0), "m": torch.nn.Linear(3, 2)}, root, step=1)
    with torch.device("meta"):
        lin = torch.nn.Linear(3, 2)
    st = {"w": torch.empty(4, device="meta"), "m": lin}
    try:
        got = fastckpt.load(st, root)
    except fastckpt.errors.FastCkptError:
        return
    pytest.fail(f"load returned step {got} but nothing was loaded: w is {st['w']!r}, "
                f"m.weight is on {lin.weight.device}")


def _save_narrow(rank, world, root):
    from tests.models import fsdp_mlp, full_state, train_step
    m = fsdp_mlp(0, width=1)  # a weight of 1 row: a rank with no rows above 1 rank
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    for s in range(2):
        train_step(m, opt, s, rank, world)
    fastckpt.save({"model": m, "optim": opt, "n": torch.tensor(7)}, root, step=2)
    return full_state(m, opt)


def _load_narrow(rank, world, roots):
    from tests.models import fsdp_mlp, full_state, train_step
    out = []
    for root in roots:
        for stepped in (False, True):
            m = fsdp_mlp(9, width=1)
            opt = torch.optim.Adam(m.parameters(), lr=1e-2)
            if stepped:  # not fresh: its moments exist (DCP's helpers load it)
                train_step(m, opt, 5, rank, world)
            st = {"model": m, "optim": opt, "n": torch.tensor(0)}
            fastckpt.load(st, root)
            out.append((full_state(m, opt), int(st["n"])))
    return out


def test_fsdp2_params_with_empty_shards_reshard_bit_exact(tmp_path):
    """(passes) FSDP2 parameters with no rows on a rank, saved at 1 and 2 ranks, loaded at
    2 and 1 into fresh and stepped optimizers."""
    from tests.models import assert_same
    roots = {n: str(tmp_path / f"s{n}") for n in (1, 2)}
    want = {n: run(_save_narrow, n, roots[n])[0] for n in roots}
    for w in (2, 1):
        for per_rank in run(_load_narrow, w, [roots[1], roots[2]]):
            for (got, v), n in zip(per_rank, (1, 1, 2, 2)):
                assert v == 7
                assert_same(want[n], got)


def _full(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def _save_dt(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    if world == 4:  # HSDP-like: replicas over the outer dim (each box written by one)
        mesh, pl = init_device_mesh("cpu", (2, 2)), [Replicate(), Shard(0)]
    else:
        mesh, pl = init_device_mesh("cpu", (world,)), [Shard(0)]
    fastckpt.save({"w": distribute_tensor(_full((5, 7)), mesh, pl),
                   "v": distribute_tensor(_full((3,), 1, torch.bfloat16), mesh, pl)},
                  root, step=1)


def _load_dt(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    out = []
    layouts = [((world,), [Shard(1)]), ((world,), [Replicate()])]
    if world == 4:
        layouts += [((2, 2), [Shard(0), Shard(1)]), ((2, 2), [Replicate(), Shard(1)]),
                    ((2, 2), [Shard(1), Shard(1)])]
    for shape, pl in layouts:
        mesh = init_device_mesh("cpu", shape)
        st = {"w": distribute_tensor(torch.zeros(5, 7), mesh, pl),
              "v": distribute_tensor(torch.zeros(3, dtype=torch.bfloat16), mesh,
                                     [Shard(0)] + [Replicate()] * (len(shape) - 1))}
        fastckpt.load(st, root)
        out.append((str(pl), torch.equal(st["w"].full_tensor(), _full((5, 7))),
                    torch.equal(st["v"].full_tensor(), _full((3,), 1, torch.bfloat16))))
    return out


@pytest.mark.parametrize("saved,loaded", [(2, 4), (4, 2)])
def test_dtensor_layout_changes_load_bit_exact(tmp_path, saved, loaded):
    """(passes) Shard(0) at 2 / HSDP-like (Replicate, Shard(0)) at 4, loaded as Shard(1),
    Replicate and 2-D layouts, uneven shapes, a bf16 tensor with an empty shard."""
    root = str(tmp_path / "ck")
    run(_save_dt, saved, root)
    for r, res in enumerate(run(_load_dt, loaded, root)):
        for pl, w_ok, v_ok in res:
            assert w_ok and v_ok, (r, pl, w_ok, v_ok)


def _save_node_lists(rank, world, root):
    # a plain value per pair of ranks (a node's), lists of another length on the other node
    fastckpt.save({"w": torch.arange(4.0), "files": list(range(1 + rank // 2))}, root, step=1)


def _load_node_lists(rank, world, root):
    st = {"w": torch.zeros(4), "files": None}
    try:
        fastckpt.load(st, root)
    except fastckpt.errors.StateMismatchError as e:
        return ("raised", str(e))
    return ("loaded", st["files"])


def _save_node_ints(rank, world, root):
    fastckpt.save({"w": torch.arange(4.0), "files": 100 + rank // 2}, root, step=1)


def test_per_rank_plain_lists_are_not_taken_for_pipeline_stages(tmp_path):
    """Plain values that differ between the saving ranks load at the saved world size only
    (tree_for_rank's error): an int per node does; a list per node whose length differs
    between the nodes is taken for pipeline stages and loads at 2 ranks as nodes 0 and 1."""
    ints, lists = str(tmp_path / "ints"), str(tmp_path / "lists")
    run(_save_node_ints, 4, ints)
    run(_save_node_lists, 4, lists)
    assert all(o[0] == "raised" for o in run(_load_node_lists, 2, ints))
    out = run(_load_node_lists, 2, lists)
    assert all(o[0] == "raised" for o in out), f"loaded at 2 of 4 saving ranks: {out}"


def _save_three(rank, world, root):
    for s in (1, 2, 3):
        fastckpt.save({"w": torch.full((256,), float(s))}, root, step=s)


def _resume_diverging(rank, world, root):
    from fastckpt.engine import load as engine_load
    if rank == 1:  # this rank's listing lacks step 2 (a stale listing of another node's view)
        engine_load._newest_below = lambda storage, below: 1
    st = {"w": torch.zeros(256)}
    try:
        got = fastckpt.load(st, root)
    except fastckpt.errors.FastCkptError as e:
        return ("raised", f"{type(e).__name__}: {e}")
    return ("loaded", got, float(st["w"][0]))


def test_the_fallback_step_is_agreed_by_every_rank(root):
    """After the newest step is found damaged, each rank picks the older step from its own
    listing; the agreement before the read checks that the ranks found the same step only
    when no step was asked for, so ranks that picked different older steps load them."""
    run(_save_three, 2, root)
    c = read_doc(root, 3)["body"]["tensors"]["w"]["chunks"][0]
    with open(os.path.join(root, "step-0000000003", c["file"]), "r+b") as f:
        f.seek(c["offset"])
        f.write(b"\xff" * 8)
    out = run(_resume_diverging, 2, root)
    loaded = [o for o in out if o[0] == "loaded"]
    assert len({o[1] for o in loaded}) <= 1, f"the ranks loaded different steps: {out}"


def test_a_chunk_at_an_odd_file_offset_reads_or_is_named(root):
    """The manifest places a chunk at a byte offset that is not a multiple of its dtype's
    size (the format does not forbid it; the file's bytes and checksum are right): a load into
    an existing tensor reads it, but a tensor the load allocates (fastckpt.read, a fresh
    optimizer's moments) is placed "in phase" with the offset, and viewing uint8 memory at an
    odd offset as float32 raises torch's RuntimeError, naming no file or tensor."""
    fastckpt.save({"w": torch.arange(2048.0)}, root, step=1)
    doc = read_doc(root, 1)
    body = doc["body"]
    c = body["tensors"]["w"]["chunks"][0]
    path = os.path.join(root, "step-0000000001", c["file"])
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(b"\0" * 3 + data)
    c["offset"] += 3
    body["files"][c["file"]]["size"] += 3
    body["files"][c["file"]].pop("checksum", None)
    write_doc(root, 1, doc)
    st = {"w": torch.zeros(2048)}
    fastckpt.load(st, root)
    assert torch.equal(st["w"], torch.arange(2048.0))
    try:
        out = fastckpt.read(root)
    except fastckpt.errors.FastCkptError:
        return
    assert torch.equal(out["w"], torch.arange(2048.0))


def _save_plain_w(rank, world, root):
    fastckpt.save({"w": _full((4, 3))}, root, step=1)


def _load_partial(rank, world, root):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial
    mesh = init_device_mesh("cpu", (world,))
    st = {"w": DTensor.from_local(torch.zeros(4, 3), mesh, [Partial()], run_check=False)}
    try:
        fastckpt.load(st, root)
    except Exception as e:  # noqa: BLE001
        return ("raised", f"{type(e).__name__}: {e}")
    return ("loaded", torch.equal(st["w"].full_tensor(), _full((4, 3))),
            st["w"].full_tensor()[0].tolist())


def test_a_partial_dtensor_destination_is_refused_or_loaded_right(root):
    """(passes) A save refuses a DTensor with a Partial placement (its locals are summands); a load
    into one must not give every rank the whole value (its logical value then world x it)."""
    run(_save_plain_w, 1, root)
    for o in run(_load_partial, 2, root):
        assert o[0] == "raised" or o[1], f"loaded a Partial DTensor wrong: {o}"


def _load_ddp(rank, world, root):
    from torch.nn.parallel import DistributedDataParallel as DDP
    from tests.models import full_state, mlp
    m = DDP(mlp(5))
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    fastckpt.load({"model": m, "optim": opt}, root)
    return full_state(m.module, opt)


def test_an_fsdp2_checkpoint_loads_into_ddp_bit_exact(root):
    """(passes) FSDP2 at 2 ranks into DDP (its "module." prefix) at 2, fresh optimizer."""
    from tests.models import assert_same
    want = run(_save_fsdp, 2, root)[0]
    for got in run(_load_ddp, 2, root):
        assert_same(want, got)


class _Tied(torch.nn.Module):
    def __init__(self, seed: int, tied: bool = True):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.emb = torch.nn.Embedding(11, 6)
        self.head = torch.nn.Linear(6, 11, bias=False)
        if tied:
            self.head.weight = self.emb.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))

    def forward(self, x):
        return self.head(self.emb(x))


def test_an_optimizer_that_does_not_load_leaves_the_model_as_it_was_or_says_so(root):
    """Saved from a tied model; loaded into the same model untied (its optimizer has a
    parameter more): the optimizer's load (a callback after the reads) fails in DCP's
    set_optimizer_state_dict with a RuntimeError, after the model's callback has already
    put the checkpoint's weights into the model: a bare torch error, naming nothing of the
    load, with the state half applied."""
    m = _Tied(0)
    o = torch.optim.Adam(m.parameters(), lr=0.1)
    m(torch.arange(5)).sum().backward()
    o.step()
    fastckpt.save({"model": m, "optim": o}, root, step=1)
    m2 = _Tied(1, tied=False)
    o2 = torch.optim.Adam(m2.parameters(), lr=0.1)
    before = m2.emb.weight.detach().clone()
    with pytest.raises(Exception) as ei:
        fastckpt.load({"model": m2, "optim": o2}, root)
    changed = not torch.equal(m2.emb.weight, before)
    assert isinstance(ei.value, fastckpt.errors.FastCkptError) or not changed, (
        f"the model was overwritten (emb.weight changed: {changed}) and the load raised "
        f"{type(ei.value).__name__}: {str(ei.value)[:160]}")


# ------------------------------------------------------------------------------------------
# Before 2026-12-06 (engine/chunks.py _box, engine/load.py _box; docs review): a DTensor's box
# was torch's __create_chunk_list__, which keeps each dim's first global index only. For a
# _StridedShard that no later mesh dim undoes ([_StridedShard(0, split_factor=2)] on a mesh of
# 2: rank 0 holds rows 0, 1, 4, 5 of 8) torch says rows 0-3: the save committed overlapping
# boxes and a load put rows in the wrong places, silently. FSDP2 + TP's composition
# ([_StridedShard(0, sf), Shard(0)] on (dp, tp)) ends in one box per rank and is kept.
# ------------------------------------------------------------------------------------------

def _strided(rank, world, root, mode):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    full = torch.arange(8.0 * 3).reshape(8, 3)
    if mode == "fsdp_tp":  # FSDP2 + TP's layout on a (dp, tp) = 2 x 2 mesh, and back
        mesh, pl = init_device_mesh("cpu", (2, 2)), [_StridedShard(0, split_factor=2), Shard(0)]
    else:
        mesh, pl = init_device_mesh("cpu", (world,)), [_StridedShard(0, split_factor=2)]
    local = full
    for m, p in enumerate(pl):  # the rows this rank holds, by torch's own definition
        local = p._split_tensor(local, mesh.size(m), with_padding=False)[0][
            mesh.get_coordinate()[m]]
    dt = DTensor.from_local(local.contiguous(), mesh, pl, run_check=False, shape=full.shape,
                            stride=full.stride())
    try:
        if mode == "load":  # a plain save of the whole tensor, loaded into the strided layout
            st = {"w": dt.__class__.from_local(torch.zeros_like(local), mesh, pl,
                                               run_check=False, shape=full.shape,
                                               stride=full.stride())}
            fastckpt.load(st, root)
            return ("loaded", torch.equal(st["w"].to_local(), local))
        fastckpt.save({"w": dt}, root, step=1)
    except Exception as e:  # noqa: BLE001
        return ("raised", type(e).__name__, str(e))
    got = {"w": torch.zeros(8, 3)}
    fastckpt.load(got, root)
    return ("saved", torch.equal(got["w"], full))


def _save_whole(rank, world, root):
    fastckpt.save({"w": torch.arange(8.0 * 3).reshape(8, 3)}, root, step=1)


@pytest.mark.parametrize("mode", ["save", "load", "fsdp_tp"])
def test_strided_shards_that_are_not_one_box_are_refused(tmp_path, mode):
    root = str(tmp_path / "ck")
    if mode == "load":
        run(_save_whole, 1, root)
    res = run(_strided, 4 if mode == "fsdp_tp" else 2, root, mode)
    if mode == "fsdp_tp":
        assert all(r == ("saved", True) for r in res), res
        return
    for r in res:
        assert r[0] == "raised" and r[1] == "UnsupportedStateError", res
        assert r[2].startswith("tensor 'w'") and "not a single box" in r[2], res
    if mode == "save":
        assert fastckpt.steps(root) == []
