"""Two CPU processes (gloo) under Lightning's own launcher, run by tests/test_lightning.py:

    python tests/lightning_ddp_script.py ddp OUT     # strategy="ddp"
    python tests/lightning_ddp_script.py mp OUT      # fastckpt.lightning.ModelParallelStrategy

Lightning starts rank 1 by running this script again (its subprocess launcher), so every phase
below runs on both ranks, in order. Each rank writes what it saw to OUT/result-<mode>-<rank>.pt;
the test compares.

``ddp``: train 6 steps with fastckpt's CheckpointIO (ModelCheckpoint every 2 steps: the epoch
ends, 2 batches per rank), resume from the step-4 path to 6; the same two runs with Lightning's
default TorchCheckpointIO; then, with the process group still up, rank 0 alone tries a
*collective* fastckpt save (what a CheckpointIO without collective=False would do): it must fail
naming rank 1 instead of waiting.

``mp``: tensor parallel over both ranks, then FSDP2 over both ranks: each 6 steps uninterrupted,
then resumed from the step-4 path.
"""

from __future__ import annotations

import os
import sys
import warnings

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
warnings.filterwarnings("ignore")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402

import fastckpt  # noqa: E402
import fastckpt.lightning as fl  # noqa: E402
from lightning_models import Final, Tiny, clone, loader, trainer  # noqa: E402


class Counting(fl.CheckpointIO):
    """fastckpt's CheckpointIO, counting the saves this process was asked for."""
    saves = 0

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        Counting.saves += 1
        super().save_checkpoint(checkpoint, path, storage_options)


class PerRankSeed(pl.Callback):
    """Seeds each rank differently at setup (before a resume restores the generators), so that
    ranks really hold different random states."""

    def setup(self, trainer, pl_module, stage):
        torch.manual_seed(100 + trainer.global_rank)


def fit(out, name, max_steps, io, ckpt_path=None, strategy="ddp", model=None):
    pl.seed_everything(0, verbose=False)
    model = model or Tiny()
    fin = Final()
    mc = ModelCheckpoint(dirpath=f"{out}/{name}", every_n_train_steps=2, save_top_k=-1,
                         save_last=True)
    callbacks = [mc, fin, fl.RNGCallback(), PerRankSeed()]
    t = trainer(f"{out}/{name}", max_steps, plugins=[io] if io is not None else [],
                callbacks=callbacks, devices=2, strategy=strategy)
    t.fit(model, loader(), ckpt_path=ckpt_path)
    names = sorted(os.listdir(f"{out}/{name}"))
    step4 = next((f"{out}/{name}/{n}" for n in names if n.endswith("step=4.ckpt")), None)
    return t, {"model": fin.model, "optim": fin.optim, "sched": fin.sched,
               "losses": list(model.losses), "names": names}, step4


def ddp(out):
    res = {}
    t, res["fast_full"], step4 = fit(out, "fast", 6, Counting())
    _, res["fast_resumed"], _ = fit(out, "fast_resume", 6, Counting(), ckpt_path=step4)
    _, res["torch_full"], tstep4 = fit(out, "torch", 6, TorchCheckpointIO())
    _, res["torch_resumed"], _ = fit(out, "torch_resume", 6, TorchCheckpointIO(),
                                     ckpt_path=tstep4)
    res["saves"] = Counting.saves
    res["rank"] = rank = t.global_rank
    # the regression: a collective save (collective=True) called by rank 0 alone
    if rank == 0:
        try:
            with fastckpt.Checkpointer(f"{out}/collective", plan_timeout_s=3) as ck:
                ck.save({"w": torch.ones(3)}, step=1, block=True)
            res["collective"] = None
        except fastckpt.CollectiveTimeoutError as e:
            res["collective"] = {"missing": e.missing_ranks, "message": str(e)}
    dist.barrier()
    torch.save(res, f"{out}/result-ddp-{rank}.pt")


class TP(Tiny):
    """The tiny model, tensor parallel: first layer column-wise, last row-wise (no dropout:
    DTensor's random ops follow their own generator tracker)."""

    def __init__(self):
        super().__init__(dropout=0.0)
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Linear(16, 2))

    def configure_model(self):
        from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                       parallelize_module)
        parallelize_module(self.net, self.device_mesh["tensor_parallel"],
                           {"0": ColwiseParallel(), "2": RowwiseParallel()})

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x)[:, :1], y)
        self.log("train_loss", loss)
        self.losses.append((self.global_step, loss.detach().clone()))
        return loss


class FSDP2(Tiny):
    """The tiny model, FSDP2: every linear layer and the whole net sharded over both ranks."""

    def __init__(self):
        super().__init__(dropout=0.0)

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        for layer in self.net:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.net, mesh=mesh)


class Probe(fl.ModelParallelStrategy):
    """Records whether any checkpoint dict handed to save_checkpoint changed."""
    changed: list = []

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        def shape(ck):
            return {k: (id(v), type(v), sorted(map(str, v)) if isinstance(v, dict) else None)
                    for k, v in ck.items()}
        before = shape(checkpoint)
        try:
            super().save_checkpoint(checkpoint, filepath, storage_options)
        finally:
            if shape(checkpoint) != before:
                Probe.changed.append(str(filepath))


def full(sd):
    return {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in sd.items()}


def mp(out):
    res = {}

    def run(kind, name, ckpt_path=None):
        tp = kind == "tp"
        strategy = Probe(data_parallel_size=1 if tp else 2, tensor_parallel_size=2 if tp else 1)
        model = TP() if tp else FSDP2()
        t, r, step4 = fit(out, name, 6, None, ckpt_path=ckpt_path, strategy=strategy,
                          model=model)
        r["model"] = full(model.state_dict())
        osd = t.optimizers[0].state_dict()
        r["optim"] = {k: full(v) for k, v in osd["state"].items()}
        return t, r, step4
    for kind in ("tp", "fsdp"):
        t, res[f"{kind}_full"], step4 = run(kind, kind)
        _, res[f"{kind}_resumed"], _ = run(kind, f"{kind}_resume", ckpt_path=step4)
    res["changed"] = Probe.changed
    res["rank"] = t.global_rank
    torch.save(clone(res), f"{out}/result-mp-{t.global_rank}.pt")


if __name__ == "__main__":
    mode, out = sys.argv[1], sys.argv[2]
    {"ddp": ddp, "mp": mp}[mode](out)
    # Lightning destroys only an NCCL process group at exit: a gloo one left up can abort the
    # interpreter's exit ("terminate called without an active exception", SIGABRT; seen once
    # in CI, pytorch/pytorch#190489)
    if dist.is_initialized():
        dist.destroy_process_group()
