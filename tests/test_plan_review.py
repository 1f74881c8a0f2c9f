"""Review of the save plan (fastckpt/engine/plan.py, solo.py) and of step discovery
(fastckpt/manifest/discovery.py), 2026-12-07: one test per defect found, each failing on
the code before its fix.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastckpt
from fastckpt.manifest import schema as fmt
from tests.clirun import call
from tests.test_retention_safety import _steps


def _partial(root: str, step: int, created) -> str:
    """A partial step (a shard, no manifest) whose in-flight marker's ``created_unix`` is the
    raw JSON text ``created``."""
    d = os.path.join(root, fmt.step_dirname(step))
    os.makedirs(d)
    with open(os.path.join(d, ".inflight-aaaaaaaaaaaa"), "w") as f:
        f.write('{"save_id": "aaaaaaaaaaaa", "host": "h", "pid": 1, "created_unix": '
                f'{created}}}')
    with open(os.path.join(d, "r00000-aaaaaaaaaaaa-000.fck"), "wb") as f:
        f.write(b"x" * 4096)
    t = __import__("time").time() - 7200  # (its files are old: only the marker's time could
    for n in os.listdir(d):               # keep it)
        os.utime(os.path.join(d, n), (t, t))
    os.utime(d, (t, t))
    return d


# a crafted in-flight marker's time: an integer too large for a float raised OverflowError
# out of ``marker_time`` (it caught KeyError, TypeError, ValueError only), which stopped
# retention, `fastckpt ls` and `fastckpt gc` for the whole root; a non-finite time (NaN,
# Infinity, "1e999") made the abandoned partial step look in flight for ever
@pytest.mark.parametrize("created", ["1" + "0" * 400, "NaN", "Infinity", '"1e999"', '"nan"'])
def test_a_crafted_marker_time_neither_stops_the_tools_nor_keeps_its_step(tmp_path, capsys,
                                                                         created):
    from fastckpt.manifest.discovery import marker_time
    from fastckpt.retention import apply_retention
    from fastckpt.storage import open_storage
    root = str(tmp_path)
    _steps(root, (1, 2, 3))
    d = _partial(root, 4, created)
    storage = open_storage(root)
    assert marker_time(storage, os.path.join(d, ".inflight-aaaaaaaaaaaa")) == 0.0
    rc, out, err = call("ls", root, "--json", capsys=capsys)
    assert rc == 0 and "Traceback" not in err, err
    rc, out, err = call("gc", root, "--yes", "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["removed"] == [4], (out, err)
    assert not os.path.exists(d)
    _partial(root, 5, created)
    assert apply_retention(storage, 1) == [1, 2, 5]
    assert fastckpt.steps(root) == [3]


# --------------------------------------------------------------------- the plan, real ranks

def _missing_shard_save(rank, world, root, lacking):
    """Every rank shards "w" and "v" over the world mesh, but rank ``lacking`` leaves "w" out
    of its state (a user's state whose keys differ between ranks). Its rows of "w" are then
    written by nobody: the save must fail on every rank, naming the tensor, rather than commit
    a step that no load can read."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    state = {"v": distribute_tensor(torch.arange(8.0), mesh, [Shard(0)])}
    w = distribute_tensor(torch.arange(16.0).reshape(8, 2), mesh, [Shard(0)])
    if rank != lacking:
        state["w"] = w
    try:
        fastckpt.save(state, root, step=1)
        saved = None
    except fastckpt.errors.FastCkptError as e:
        saved = f"{type(e).__name__}: {e}"
    torch.distributed.barrier()
    steps = fastckpt.steps(root) if rank == 0 else None
    return saved, steps


@pytest.mark.parametrize("lacking", [0, 1])
def test_a_sharded_tensor_one_rank_leaves_out_fails_the_save_naming_it(tmp_path, lacking):
    from tests.distributed import run
    root = str(tmp_path / "ckpt")
    out = run(_missing_shard_save, 2, root, lacking)
    for r, (saved, _) in enumerate(out):
        assert saved is not None and "'w'" in saved and f"rank {lacking}" in saved, (r, saved)
    assert out[0][1] == [], out[0][1]  # nothing committed


# ----------------------------------------------------------------------------- discovery

@pytest.mark.parametrize("step", ["5", 5.0, 5.5, True])
def test_a_step_that_is_not_an_int_is_refused_not_called_damaged(tmp_path, step):
    """``load(step=...)`` with what ``save`` refuses: a str or a float made the committed
    step's valid manifest "invalid" (CorruptCheckpointError: "it is in the directory of step 5
    but says step 5"), ``True`` loaded step 1."""
    import numpy as np
    root = str(tmp_path)
    _steps(root, (1, 5))
    got = {"w": torch.zeros(100)}
    with pytest.raises(ValueError, match="step must be a non-negative int"):
        fastckpt.load(got, root, step=step)
    assert fastckpt.load(got, root, step=np.int64(5)) == 5  # (an integer type: taken)
    assert torch.equal(got["w"], torch.arange(100, dtype=torch.float32) + 2)


def test_the_holders_of_a_solo_tensor_are_counted_through_shared_tables():
    """(rank 0, ``make_plans``) Tables sent as None (rank 0's) or named (``own_as``) count for
    every rank that stands behind them: two pipeline stages of two ranks pass; a stage rank
    whose table lacks one of its stage's tensors is named."""
    from fastckpt.engine.plan import make_plans

    def value(own, own_as=None):
        return {"save_id": "s", "own": own, "own_as": own_as, "own_bytes": 0, "specs": [],
                "error": None, "aliases": 0}
    s0 = [["a", "float32", [4], "m0:2"]]
    s1 = [["b", "float32", [4], "m1:2"], ["c", "float32", [2], "m1:2"]]
    rows, plan = make_plans([value(s0), value(None), value(s1), value(None, 2)], 1)
    assert sorted(plan.tensors) == ["a", "b", "c"]
    with pytest.raises(fastckpt.UnsupportedStateError, match=r"'c'.*2 ranks.*rank 3 leaves"):
        make_plans([value(s0), value(None), value(s1), value(s1[:1])], 1)
    with pytest.raises(fastckpt.UnsupportedStateError, match=r"'a'.*2 ranks, but 1 of them"):
        make_plans([value(s0), value([]), value(s1), value(None, 2)], 1)
