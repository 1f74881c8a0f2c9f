"""A save never changes anything the user passed, even when it fails (issue 10, defect 1).

Every parameter, buffer, gradient and optimizer value (state tensors, step counters, param
group settings) is snapshotted to bytes before a save and compared bit-exact after it returns
or raises, for supported and unsupported states: fresh optimizers (no state yet: DCP's helper
would create it with a zero-gradient step), optimizers with state, an optimizer container
(a subclass with its own state_dict, like torchtitan's), a module whose state-dict keys a hook
renames (like torchtitan's fused QKV), and FSDP2 on 2 ranks.
"""

from __future__ import annotations

import pytest
import torch

import fastckpt
from tests import distributed


def _bytes(t: torch.Tensor) -> bytes:
    if hasattr(t, "to_local"):
        t = t.to_local()
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes() if t.numel() else b""


def snapshot(*objs) -> list:
    """Everything of these modules and optimizers that a save could change, as plain data."""
    out: list = []
    for o in objs:
        if isinstance(o, torch.nn.Module):
            for n, p in o.named_parameters():
                out.append((n, _bytes(p), None if p.grad is None else _bytes(p.grad)))
            for n, b in o.named_buffers():
                out.append((n, _bytes(b)))
        else:
            opts = getattr(o, "optimizers", [o])
            for opt in opts:
                for g in opt.param_groups:
                    out.append(sorted((k, repr(v)) for k, v in g.items() if k != "params"))
                out.append(len(opt.state))
                for p, st in opt.state.items():
                    for k, v in sorted(st.items()):
                        out.append((k, _bytes(v) if torch.is_tensor(v) else repr(v)))
    return out


def _mlp(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16),
                               torch.nn.Linear(16, 4))


def _stepped(model, opt) -> None:
    model(torch.randn(3, 8)).sum().backward()
    opt.step()


class Container(torch.optim.Optimizer):
    """An optimizer container with its own state_dict, as torchtitan's OptimizersContainer:
    one optimizer per model part, exposed as one Optimizer."""

    def __init__(self, parts: list) -> None:
        self.optimizers = [torch.optim.AdamW(p.parameters(), lr=1e-2, weight_decay=0.1)
                           for p in parts]
        params = [p for m in parts for p in m.parameters()]
        super().__init__(params, {"lr": 1e-2})

    def step(self, closure=None):
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none)

    def state_dict(self):
        return {f"opt{i}": o.state_dict() for i, o in enumerate(self.optimizers)}

    def load_state_dict(self, sd) -> None:
        for i, o in enumerate(self.optimizers):
            o.load_state_dict(sd[f"opt{i}"])


class Fused(torch.nn.Module):
    """q, k, v kept as one tensor; a state-dict hook splits it into q/k/v keys (and a load
    pre-hook joins them), like torchtitan's fused QKV."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.randn(12, 4))
        self._register_state_dict_hook(Fused._split)
        self._register_load_state_dict_pre_hook(Fused._join)

    @staticmethod
    def _split(module, sd, prefix, local_metadata):
        w = sd.pop(prefix + "qkv")
        for name, part in zip("qkv", w.chunk(3)):
            sd[prefix + name] = part
        return sd

    @staticmethod
    def _join(sd, prefix, *args):
        sd[prefix + "qkv"] = torch.cat([sd.pop(prefix + n) for n in "qkv"])

    def forward(self, x):
        return x @ self.qkv.T


def _cases():
    m = _mlp()
    yield "fresh Adam", m, torch.optim.Adam(m.parameters(), lr=1e-2), False
    m = _mlp()
    yield "fresh AdamW with decay", m, torch.optim.AdamW(m.parameters(), weight_decay=0.5), False
    m = _mlp()
    yield "fresh SGD momentum", m, torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9), False
    m = _mlp()
    o = torch.optim.Adam(m.parameters(), lr=1e-2)
    _stepped(m, o)
    yield "stepped Adam (grads kept)", m, o, False
    parts = [_mlp(1), _mlp(2)]
    model = torch.nn.ModuleList(parts)
    yield "container, fresh", model, Container(parts), False
    parts = [_mlp(1), _mlp(2)]
    model = torch.nn.ModuleList(parts)
    c = Container(parts)
    for p in parts:
        p(torch.randn(2, 8)).sum().backward()
    c.step()
    yield "container, stepped", model, c, False
    f = Fused()
    yield "hook-renamed module", f, torch.optim.Adam(f.parameters()), False
    m = _mlp()
    yield "unsupported object next to a fresh optimizer", m, torch.optim.AdamW(
        m.parameters(), weight_decay=0.5), True


@pytest.mark.parametrize("case", list(range(8)))
def test_save_changes_nothing(root, case):
    name, model, opt, fails = list(_cases())[case]
    before = snapshot(model, opt)
    state = {"model": model, "optim": opt, "step": 3}
    if fails:
        state["bad"] = object()
        with pytest.raises(fastckpt.UnsupportedStateError):
            fastckpt.save(state, root, step=1)
    else:
        fastckpt.save(state, root, step=1)
        with fastckpt.Checkpointer(root) as ck:  # and through the async path
            ck.save(state, step=2).wait()
    assert snapshot(model, opt) == before, name


def test_a_fresh_optimizer_round_trips(root):
    m = _mlp()
    o = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
    fastckpt.save({"model": m, "optim": o}, root, step=1)
    m2 = _mlp(5)
    o2 = torch.optim.AdamW(m2.parameters(), lr=1.0)
    fastckpt.load({"model": m2, "optim": o2}, root)
    assert o2.param_groups[0]["lr"] == 3e-3 and not o2.state
    assert all(torch.equal(a, b) for a, b in zip(m.parameters(), m2.parameters()))


def _fsdp_unchanged(rank: int, world: int, root: str):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    m = _mlp()
    mesh = init_device_mesh("cpu", (world,))
    for layer in m:
        fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    o = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.5)
    before = snapshot(m, o)
    fastckpt.save({"model": m, "optim": o}, root, step=1)
    return snapshot(m, o) == before and not o.state


def test_fsdp2_fresh_optimizer_save_changes_nothing(root):
    assert distributed.run(_fsdp_unchanged, 2, root) == [True, True]
