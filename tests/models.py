"""Small deterministic models and training loops shared by the tests (importable by ranks)."""

from __future__ import annotations

import torch


def mlp(seed: int = 0, width: int = 33) -> torch.nn.Module:
    g = torch.Generator().manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(10, width), torch.nn.ReLU(),
                            torch.nn.Linear(width, width), torch.nn.ReLU(),
                            torch.nn.Linear(width, 7))
    with torch.no_grad():
        for p in m.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def fsdp_mlp(seed: int = 0, width: int = 33):
    """The same MLP under FSDP2 ``fully_shard`` on a 1-D CPU mesh over all ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    m = mlp(seed, width)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in m:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of a step (every rank sees the same; data parallel ranks slice it)."""
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(16, 10, generator=g), torch.randn(16, 7, generator=g)


def train_step(m, opt, step: int, rank: int = 0, world: int = 1) -> float:
    x, y = batch(step)
    per = x.shape[0] // world
    xs, ys = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
    loss = torch.nn.functional.mse_loss(m(xs), ys)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    out = loss.detach().clone()
    import torch.distributed as dist
    if dist.is_initialized():
        dist.all_reduce(out)
        out /= world
    return float(out)


def full_state(m, opt) -> dict:
    """Model and optimizer state as full (unsharded) CPU tensors keyed by FQN, for comparison."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(m, opt)

    def full(t):
        return t.full_tensor() if hasattr(t, "full_tensor") else t.detach().clone()
    out = {f"model.{k}": full(v) for k, v in msd.items()}
    for fqn, st in osd["state"].items():
        for k, v in st.items():
            out[f"optim.{fqn}.{k}"] = full(v) if isinstance(v, torch.Tensor) else v
    return out


def assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys()))
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k
