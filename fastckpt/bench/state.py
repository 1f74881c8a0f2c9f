"""The synthetic training state every benchmark saves, and the torch.save / DCP contenders.

One builder for ``fastckpt bench`` and the scripts in benchmarks/: a model of ``layers`` square
``nn.Linear(w, w)`` (fp32 weight + bias) and its ``torch.optim.Adam`` holding ``exp_avg`` and
``exp_avg_sq`` as after one step, so that parameters + moments are about the requested size
(:func:`geometry`). With a device ``mesh`` every parameter and moment is a DTensor sharded on
dim 0 over the ranks, like FSDP2.

torch is imported when a function runs, not when this module is imported.
"""

from __future__ import annotations

import math
from typing import Any

FP32 = 4


def geometry(size_bytes: int, *, layers: int = 16, world: int = 1) -> dict[str, Any]:
    """The width ``w`` of ``layers`` square Linear(w, w) so that params + Adam ``exp_avg`` +
    ``exp_avg_sq`` (fp32) is about ``size_bytes`` (never more, unless the smallest width
    already is). ``w`` is a multiple of ``8 * world`` (rows shard evenly over ``world`` ranks).

    ``state_bytes`` counts the tensors a checkpoint holds: params, both moments and Adam's 0-dim
    fp32 ``step`` per parameter tensor (weight + bias).
    """
    if layers < 1 or world < 1:
        raise ValueError("layers and world must be >= 1")
    unit = 8 * world
    per_layer = size_bytes / (3 * FP32) / layers
    w = int((-1 + math.sqrt(1 + 4 * per_layer)) / 2)  # w*w + w = per_layer
    w = max(unit, w // unit * unit)
    params = layers * (w * w + w)
    return {"layers": layers, "width": w, "world": world, "n_params": params,
            "param_bytes": params * FP32, "state_bytes": 3 * FP32 * params + 2 * layers * FP32}


def model_adam(geom: dict[str, Any], *, seed: int = 0, stepped: bool = True, mesh: Any = None,
               rank: int = 0) -> tuple[Any, Any]:
    """(model, optimizer) of :func:`geometry` ``geom``, filled with random values from ``seed``
    (and ``rank``: each shard differs), deterministic and incompressible.

    ``stepped``: the optimizer holds ``step`` / ``exp_avg`` / ``exp_avg_sq`` per parameter, as
    after one ``Adam.step()`` (filled directly: no gradients, no step's temporaries); otherwise
    it is freshly built (no state yet), as a restarted job builds it. ``mesh``: parameters and
    moments are DTensors sharded on dim 0 over the mesh (this rank's rows only are allocated).
    """
    import torch
    from torch import nn

    w, layers = geom["width"], geom["layers"]
    world = 1 if mesh is None else mesh.size()
    if w % world:
        raise ValueError(f"width {w} does not shard over {world} ranks: use geometry(world=)")
    rows = w // world
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    if mesh is not None:
        from torch.distributed.tensor import DTensor, Shard

        def wrap(t: Any) -> Any:
            return DTensor.from_local(t, mesh, [Shard(0)], run_check=False)
    else:
        def wrap(t: Any) -> Any:
            return t

    def rand(shape: tuple[int, ...], lo: float, hi: float) -> Any:
        return wrap(torch.empty(shape).uniform_(lo, hi, generator=g))

    bound = 1.0 / math.sqrt(w)
    model = nn.Sequential(*[nn.utils.skip_init(nn.Linear, w, w, device="meta")
                            for _ in range(layers)])
    for lin in model:
        lin.weight = nn.Parameter(rand((rows, w), -bound, bound))
        lin.bias = nn.Parameter(rand((rows,), -bound, bound))
    optim = torch.optim.Adam(model.parameters(), lr=1e-3)
    if stepped:
        for p in model.parameters():
            shape = tuple((p.to_local() if mesh is not None else p).shape)
            optim.state[p] = {"step": torch.tensor(1.0), "exp_avg": rand(shape, -1e-3, 1e-3),
                              "exp_avg_sq": rand(shape, 0.0, 1e-6)}
    return model, optim


def state_tensors(model: Any, optim: Any) -> list[tuple[str, Any]]:
    """(name, tensor) of everything a checkpoint of (model, optim) holds, in a stable order."""
    out = [(f"model.{k}", v) for k, v in model.state_dict().items()]
    names = {id(p): n for n, p in model.named_parameters()}
    for group in optim.param_groups:
        for p in group["params"]:
            for k, v in sorted(optim.state.get(p, {}).items()):
                if hasattr(v, "nbytes"):
                    out.append((f"optim.{names[id(p)]}.{k}", v))
    return out


def local_nbytes(model: Any, optim: Any) -> int:
    """Bytes of this rank's share of the state (local shards of DTensors)."""
    return sum((t.to_local() if hasattr(t, "to_local") else t).nbytes
               for _, t in state_tensors(model, optim))


def _local(x: Any) -> Any:
    """The same structure with DTensors replaced by their local shards."""
    if isinstance(x, dict):
        return {k: _local(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_local(v) for v in x]
    return x.to_local() if hasattr(x, "to_local") else x


def _copy_into(dst: Any, src: Any) -> None:
    if isinstance(dst, dict):
        for k in dst:
            _copy_into(dst[k], src[k])
    elif hasattr(dst, "copy_"):
        (dst.to_local() if hasattr(dst, "to_local") else dst).copy_(src)


def _sharded(model: Any) -> bool:
    return any(hasattr(p, "to_local") for p in model.parameters())


# ------------------------------------------------------------------- torch.save and DCP

def torch_save(model: Any, optim: Any, f: Any) -> None:
    """``torch.save({"model": model.state_dict(), "optim": optim.state_dict()}, f)`` (this
    rank's local shards when sharded); ``f`` an open binary file (the caller syncs it)."""
    import torch
    sd = {"model": model.state_dict(), "optim": optim.state_dict()}
    torch.save(_local(sd) if _sharded(model) else sd, f)


def torch_load(model: Any, optim: Any, f: Any) -> None:
    """``torch.load(f, weights_only=True)`` then ``load_state_dict`` of both (sharded: the
    loaded local shards are copied into the live ones, which is what load_state_dict does)."""
    import torch
    sd = torch.load(f, map_location="cpu", weights_only=True)
    if _sharded(model):
        _copy_into(model.state_dict(), sd["model"])
        _copy_into(optim.state_dict()["state"], sd["optim"]["state"])
    else:
        model.load_state_dict(sd["model"])
        optim.load_state_dict(sd["optim"])
    del sd


def dcp_save(model: Any, optim: Any, writer: Any, *, no_dist: bool) -> None:
    """``get_state_dict`` + ``torch.distributed.checkpoint.save(.., storage_writer=writer)``."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict
    msd, osd = get_state_dict(model, optim)
    with warnings.catch_warnings():  # "assuming the intent is to save in a single process"
        warnings.simplefilter("ignore", UserWarning)
        dcp.save({"model": msd, "optim": osd}, storage_writer=writer, no_dist=no_dist)


def dcp_load(model: Any, optim: Any, reader: Any, *, no_dist: bool) -> None:
    """``get_state_dict`` + ``dcp.load(.., storage_reader=reader)`` + ``set_state_dict``."""
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    msd, osd = get_state_dict(model, optim)
    sd = {"model": msd, "optim": osd}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, storage_reader=reader, no_dist=no_dist)
    set_state_dict(model, optim, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
