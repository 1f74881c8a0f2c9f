"""A torchtitan (0.3.0) training loop on CPU for the integration tests, run on real gloo ranks.

torchtitan's Trainer picks CUDA and its language models use FlexAttention (no CPU backward),
so this builds what the Trainer builds, from torchtitan's own pieces, and drives them the way
``Trainer.train`` does: the llama3 debug model (2 of its 6 layers, attention swapped for
torchtitan's causal ``ScaledDotProductAttention``), FSDP2 ``fully_shard`` per block and at the
root as torchtitan's ``apply_fsdp`` does, torchtitan's ``OptimizersContainer`` (AdamW) and
``LRSchedulersContainer``, its ``ParallelAwareDataloader`` over a per-rank stateful dataset, and
a checkpoint manager built from its ``Config`` with the trainer's arguments. Then
``checkpointer.load()``, and per step: train, ``checkpointer.save(step, last_step=...)``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import IterableDataset

SEQ = 32
VOCAB = 2048


class TokenStream(IterableDataset):
    """Endless token sequences, different per rank, with its position as state."""

    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.index = 0

    def __iter__(self):
        while True:
            g = torch.Generator().manual_seed(10_000 * self.rank + self.index)
            toks = torch.randint(0, VOCAB, (SEQ + 1,), generator=g)
            self.index += 1
            yield {"input": toks[:-1]}, toks[1:]

    def state_dict(self) -> dict:
        return {"index": self.index, "tokens_seen": [self.index * SEQ, (self.rank, "r")]}

    def load_state_dict(self, sd: dict) -> None:
        self.index = sd["index"]


class TrainState:
    """What torchtitan's Trainer saves as ``train_state``."""

    def __init__(self) -> None:
        self.step = 0
        self.ntokens_seen = 0

    def state_dict(self) -> dict:
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, sd: dict) -> None:
        self.step, self.ntokens_seen = sd["step"], sd["ntokens_seen"]


def _model(world: int) -> torch.nn.Module:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import model_registry
    cfg = model_registry("debugmodel").model
    cfg.layers = cfg.layers[:2]
    for layer in cfg.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    torch.manual_seed(0)
    with torch.device("meta"):
        m = cfg.build()
    m.to_empty(device="cpu")
    with torch.no_grad():
        m.init_states()
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in m.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def full_state(m: torch.nn.Module, optimizers: Any, lr_schedulers: Any) -> dict:
    def full(t: Any) -> Any:
        return t.full_tensor() if hasattr(t, "full_tensor") else (
            t.detach().clone() if isinstance(t, torch.Tensor) else t)
    out = {f"model.{k}": full(v) for k, v in m.state_dict().items()}
    out.update({f"optim.{k}": full(v) for k, v in optimizers.state_dict().items()})
    out["lr"] = [s.get_last_lr() for s in lr_schedulers]
    return out


def train(rank: int, world: int, folder: str, steps: int, stop_after: int | None,
          manager: str, async_mode: str = "disabled", keep: int = 2) -> dict:
    """Train to ``steps`` (or stop after ``stop_after`` steps of this process, as a preempted
    job does) with checkpointing through ``manager`` ("fastckpt", "torchtitan", or "none") into
    ``folder``; return the losses of the steps run here and the final full state."""
    import torch.distributed as dist
    from torchtitan.components.checkpointer import CheckpointManager as TitanManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from fastckpt.torchtitan import CheckpointManager as FastManager
    m = _model(world)
    opt_cfg = default_adamw(lr=8e-3)
    opt_cfg.implementation = "for-loop"
    optimizers = opt_cfg.build(model_parts=[m])
    lr_schedulers = LRSchedulersContainer.Config(
        warmup_steps=2, decay_ratio=0.8, decay_type="linear", min_lr_factor=0.0).build(
        optimizers=optimizers, training_steps=steps)
    loader = ParallelAwareDataloader(TokenStream(rank), dp_rank=rank, dp_world_size=world,
                                     batch_size=2)
    state = TrainState()
    cls = FastManager if manager == "fastckpt" else TitanManager
    ckpt = cls.Config(enable=manager != "none", folder="checkpoint", interval=2, keep_latest_k=keep,
                      async_mode=async_mode, last_save_model_only=False).build(
        dataloader=loader, model_parts=[m], optimizers=optimizers,
        lr_schedulers=lr_schedulers, states={"train_state": state}, sd_adapter=None,
        base_folder=folder)
    ckpt.load(step=-1)
    loaded = state.step
    losses = {}
    it = iter(loader)
    while state.step < steps and (stop_after is None or state.step - loaded < stop_after):
        state.step += 1
        inputs, labels = next(it)
        optimizers.zero_grad()
        logits = m(inputs["input"])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(),
                                                 labels.flatten())
        loss.backward()
        optimizers.step()
        lr_schedulers.step()
        state.ntokens_seen += labels.numel()
        out = loss.detach().clone()
        dist.all_reduce(out)
        losses[state.step] = float(out) / world
        ckpt.save(state.step, last_step=state.step == steps)
    ckpt.maybe_wait_for_saving()
    ckpt.close()
    return {"loaded": loaded, "losses": losses, "state": full_state(m, optimizers, lr_schedulers),
            "loader": loader.dataset.index}
