"""What a state means when saved and loaded (issue 10, defects 3-6): values that differ per
rank stay per rank, tied tensors are written once and stay tied, loading never adds keys
(``strict``; ``fastckpt.read`` for a whole checkpoint), and ``RNGState`` resumes dropout
bit-exact."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

import fastckpt
from fastckpt.manifest import schema as fmt
from tests import distributed


def _manifest(root: str, step: int) -> dict:
    with open(os.path.join(root, fmt.step_dirname(step), fmt.MANIFEST)) as f:
        return json.load(f)


# ------------------------------------------------------------------------ 3. per-rank values

def _per_rank(rank: int, world: int, root: str):
    torch.manual_seed(100 + rank)  # ranks seeded apart: their generator states differ
    big = torch.full((400_000,), float(rank))  # 1.6 MB: a sampled fingerprint
    state = {"rng": torch.get_rng_state(), "big": big, "shared": torch.arange(6.0),
             "pos": 1000 + rank}
    fastckpt.save(state, root, step=1)
    dest = {"rng": torch.zeros_like(state["rng"]), "big": torch.zeros_like(big),
            "shared": torch.zeros(6), "pos": None}
    fastckpt.load(dest, root)
    from fastckpt.engine.reader import FastCkptReader
    import torch.distributed.checkpoint as dcp
    plain = {"rng": torch.zeros_like(state["rng"]), "pos": 0}
    dcp.load(plain, storage_reader=FastCkptReader(root))  # no rank= given: the caller's
    return (torch.equal(dest["rng"], state["rng"]), dest["big"][0].item(), dest["pos"],
            torch.equal(dest["shared"], torch.arange(6.0)),
            torch.equal(plain["rng"], state["rng"]), plain["pos"])


def test_values_that_differ_per_rank_stay_per_rank(root):
    out = distributed.run(_per_rank, 2, root)
    assert out == [(True, 0.0, 1000, True, True, 1000), (True, 1.0, 1001, True, True, 1001)]
    doc = _manifest(root, 1)
    assert doc["format_version"] == 2
    t = doc["body"]["tensors"]
    assert t["rng"]["per_rank"] and t["big"]["per_rank"] and "per_rank" not in t["shared"]
    assert sorted(c["rank"] for c in t["rng"]["chunks"]) == [0, 1]
    assert len(t["shared"]["chunks"]) == 1  # replicated: written once
    with pytest.raises(fastckpt.StateMismatchError, match="differ(ed)? between"):
        fastckpt.load({"rng": torch.zeros(5056, dtype=torch.uint8), "big": torch.zeros(400_000),
                       "shared": torch.zeros(6), "pos": 0}, root)


def _sparse_per_rank(rank: int, world: int, root: str, fingerprint: str):
    # per-rank tensors above the whole-hash size that differ in one element only
    line = torch.zeros(400_000)  # 1-D: before 2026-12-06 three elements were its fingerprint
    line[1 + 7 * rank] = 1.0
    wide = torch.zeros(600, 1000).t()  # not contiguous: sampled row by row
    wide[0, 300] = float(rank + 1)
    block = torch.zeros(1024, 1024)  # row 1: between the samples (only "full" sees it)
    block[1, 952] = float(rank + 1)
    state = {"line": line, "wide": wide, "block": block, "same": torch.ones(300_000)}
    fastckpt.save(state, root, step=1, fingerprint=fingerprint)
    dest = {k: torch.full_like(v, -1.0) for k, v in state.items()}
    fastckpt.load(dest, root)
    return {k: torch.equal(dest[k], v) for k, v in state.items()}


@pytest.mark.parametrize("fingerprint", ["sampled", "full"])
def test_sparse_per_rank_differences_stay_per_rank(root, fingerprint):
    out = distributed.run(_sparse_per_rank, 2, root, fingerprint)
    t = _manifest(root, 1)["body"]["tensors"]
    assert t["line"].get("per_rank") and t["wide"].get("per_rank")
    assert "per_rank" not in t["same"]  # replicated: written once
    assert all(o["line"] and o["wide"] and o["same"] for o in out)
    if fingerprint == "full":
        assert t["block"].get("per_rank") and all(o["block"] for o in out)
    else:  # the documented limit of the sampled fingerprint (design.md, Limits)
        assert "per_rank" not in t["block"]


def test_fingerprint_option_is_checked():
    with pytest.raises(ValueError, match="fingerprint must be"):
        fastckpt.CheckpointOptions(fingerprint="sometimes")


def _empty_shard_model(fsdp: bool):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 1))  # (1, 16): rank 1
    if fsdp:                                                                  # holds no row
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        fully_shard(m, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    return m


def _empty_shard_save(rank: int, world: int, root: str):
    m = _empty_shard_model(True)
    opt = torch.optim.Adam(m.parameters())
    for _ in range(3):
        m(torch.randn(4, 8)).sum().backward()
        opt.step()
        opt.zero_grad()
    fastckpt.save({"model": m, "optim": opt}, root, step=1)
    st = opt.state[m[1].weight]
    return st["exp_avg"].full_tensor(), st["exp_avg_sq"].full_tensor()


def _empty_shard_load(rank: int, world: int, root: str):
    m = _empty_shard_model(False)
    opt = torch.optim.Adam(m.parameters())
    fastckpt.load({"model": m, "optim": opt}, root)
    st = opt.state[m[1].weight]
    return st["exp_avg"].clone(), st["exp_avg_sq"].clone(), st["exp_avg_sq"] is st["exp_avg"]


def test_moments_of_a_parameter_with_no_rows_on_a_rank_are_not_tied(root):
    # every empty tensor's memory is at address 0: before 2026-12-06 rank 1's exp_avg and
    # exp_avg_sq of the (1, 16) weight (no row on rank 1) counted as one tied tensor, and a
    # load where rank 1 holds it whole gave exp_avg_sq exp_avg's values (NaN at the next step)
    avg, sq = distributed.run(_empty_shard_save, 2, root)[0]
    for world in (2, 1):
        for got_avg, got_sq, same in distributed.run(_empty_shard_load, world, root):
            assert torch.equal(got_avg, avg) and torch.equal(got_sq, sq) and not same


def test_a_tied_destination_of_two_saved_tensors_is_filled_whole(root, caplog):
    # the state ties a and b (one memory), the checkpoint holds them apart: before 2026-12-06
    # the readers filled the memory at once (a mix of both, or a false checksum error)
    n = (16 << 20) // 4
    fastckpt.save({"a": torch.full((n,), 1.0), "b": torch.full((n,), 2.0)}, root, step=1)
    for _ in range(4):
        t = torch.zeros(n)
        fastckpt.load({"a": t, "b": t}, root)
        assert bool((t == 2.0).all())  # "b" sorts last: it holds the data
    assert any("share memory" in r.getMessage() for r in caplog.records)
    a, b = torch.zeros(n), torch.zeros(n)  # apart in the state too: each its own
    fastckpt.load({"a": a, "b": b}, root)
    assert bool((a == 1.0).all()) and bool((b == 2.0).all())


# -------------------------------------------------------------------------- 4. tied tensors

class Tied(torch.nn.Module):
    """GPT-2's tie: the output projection is the token embedding."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        self.wte = torch.nn.Embedding(512, 64)
        self.lm_head = torch.nn.Linear(64, 512, bias=False)
        if tie:
            self.lm_head.weight = self.wte.weight


def test_tied_tensors_are_written_once_and_stay_tied(root):
    m = Tied()
    fastckpt.save({"model": m}, root, step=1)
    doc = _manifest(root, 1)
    assert list(doc["body"]["tensors"]) == ["model.wte.weight"] and doc["format_version"] == 2
    assert sum(f["size"] for f in doc["body"]["files"].values()) < 2 * 512 * 64 * 4
    m2 = Tied()
    fastckpt.load({"model": m2}, root)
    assert m2.lm_head.weight is m2.wte.weight and torch.equal(m2.wte.weight, m.wte.weight)
    u = Tied(tie=False)  # untied now: each key gets the value
    fastckpt.load({"model": u}, root)
    assert torch.equal(u.lm_head.weight, m.wte.weight) and torch.equal(u.wte.weight,
                                                                         m.wte.weight)
    # plain DCP users get both keys
    import torch.distributed.checkpoint as dcp
    from fastckpt.engine.reader import FastCkptReader
    sd = {"model.wte.weight": torch.zeros(512, 64), "model.lm_head.weight": torch.zeros(512, 64)}
    dcp.load(sd, storage_reader=FastCkptReader(root), no_dist=True)
    assert all(torch.equal(v, m.wte.weight) for v in sd.values())
    assert tools_verify_ok(root)


def tools_verify_ok(root: str) -> bool:
    from fastckpt import tools
    return tools.verify_step(root).ok


def test_a_format_1_manifest_still_loads(root):
    fastckpt.save({"w": torch.arange(4.0)}, root, step=1)
    assert _manifest(root, 1)["format_version"] == 1  # nothing of format 2 used
    dest = {"w": torch.zeros(4)}
    assert fastckpt.load(dest, root) == 1 and torch.equal(dest["w"], torch.arange(4.0))


# ------------------------------------------------------------------- 5. strict, and read()

def test_load_never_adds_keys_and_read_returns_everything(root):
    state = {"w": torch.ones(3), "cfg": {"lr": 0.1, "name": "x"}, "step": 7}
    fastckpt.save(state, root, step=7)
    dest = {"w": torch.zeros(3), "cfg": {"lr": None}}
    with pytest.raises(fastckpt.StateMismatchError, match="'cfg.name'.*not in the state"):
        fastckpt.load(dest, root)
    assert dest["cfg"] == {"lr": None} and "step" not in dest
    fastckpt.load(dest, root, strict=False)
    assert dest == {"w": dest["w"], "cfg": {"lr": 0.1}} and torch.equal(dest["w"], torch.ones(3))
    with pytest.raises(fastckpt.StateMismatchError, match="missing from the checkpoint"):
        fastckpt.load({"w": torch.zeros(3), "cfg": {"lr": 0}, "step": 0, "new": 1}, root)
    whole = fastckpt.read(root)
    assert whole["cfg"] == {"lr": 0.1, "name": "x"} and whole["step"] == 7
    assert torch.equal(whole["w"], torch.ones(3))
    m = torch.nn.Linear(3, 2)
    o = torch.optim.Adam(m.parameters())
    m(torch.ones(1, 3)).sum().backward()
    o.step()
    fastckpt.save({"model": m, "optim": o}, root, step=8)
    whole = fastckpt.read(root, step=8)
    assert set(whole["model"]) == {"weight", "bias"}
    assert set(whole["optim"]["state"]["weight"]) == {"step", "exp_avg", "exp_avg_sq"}


# ------------------------------------------------------------------------------ 6. RNGState

def _dropout_run(root: str, steps: int, resume_at: int | None) -> list[float]:
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Dropout(0.5),
                            torch.nn.Linear(64, 1))
    o = torch.optim.SGD(m.parameters(), lr=0.1)
    state = {"model": m, "optim": o, "rng": fastckpt.RNGState()}
    start = 0
    if resume_at is not None:
        torch.manual_seed(12345)  # a restarted process: its generators are elsewhere
        start = fastckpt.load(state, root)
    losses = []
    for step in range(start, steps):
        x = torch.randn(8, 16)  # the data comes from the generator too
        loss = m(x).pow(2).mean()
        o.zero_grad()
        loss.backward()
        o.step()
        losses.append(loss.item())
        if resume_at is None and step + 1 == 3:
            fastckpt.save(state, root, step=3)
    return losses


def test_rng_state_resumes_dropout_bit_exact(root):
    straight = _dropout_run(root, 6, None)
    resumed = _dropout_run(root, 6, 3)
    assert resumed == straight[3:]


_RNG_FROM_READ = """
import sys, torch, fastckpt
d = sys.argv[1]
torch.manual_seed(5)
fastckpt.save({"a": torch.ones(1000), "rng": fastckpt.RNGState(), "w": torch.ones(5000)}, d,
              step=1)
want = torch.rand(4)
torch.rand(100)
sd = fastckpt.read(d)
assert sd["rng"]["torch"].storage_offset() > 0  # a view into the read buffer
fastckpt.RNGState().load_state_dict(sd["rng"])
assert torch.equal(torch.rand(4), want)
"""


def test_rng_state_restores_from_a_whole_checkpoint_read(root):
    """``fastckpt.read`` gives tensors that share one read buffer (a storage offset):
    ``torch.set_rng_state`` crashed the process on such a tensor (SIGSEGV, torch 2.13)."""
    r = subprocess.run([sys.executable, "-c", _RNG_FROM_READ, root], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, (r.returncode, r.stderr[-2000:])
