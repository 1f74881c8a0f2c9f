"""PyTorch Lightning 2.6: ``trainer.save_checkpoint`` / ``trainer.fit(ckpt_path=...)`` with
Lightning's default ``TorchCheckpointIO`` (torch.save, no fsync: the benchmark fsyncs its file
for "durable") against ``fastckpt.lightning.CheckpointIO``, and both wrapped in Lightning's
``AsyncCheckpointIO`` (stall = ``save_checkpoint`` returns; durable = + the plugin's
``teardown``, which waits for the thread). State: the benchmark Linear stack in a
LightningModule, Adam after one real ``fit`` step. A load is timed from Lightning's
``resume_start`` (reading the checkpoint) to ``resume_end`` (model, optimizer and loops
restored), inside ``trainer.fit(ckpt_path=...)`` in a fresh process."""

from __future__ import annotations

import os
from typing import Any

from clients._common import Clock, fingerprint, fsync_tree, nbytes, warm_imports

CONTENDERS = ("lightning", "fastckpt", "lightning-async", "fastckpt-async")
LOADERS = ("lightning", "fastckpt")
PAIRS = [("lightning", "fastckpt"), ("lightning-async", "fastckpt-async")]
DESCRIPTIONS = {
    "lightning": "Trainer() default TorchCheckpointIO: torch.save(dict, path) + fsync by the "
                 "benchmark / torch.load(weights_only) + restore",
    "fastckpt": "Trainer(plugins=[fastckpt.lightning.CheckpointIO()])",
    "lightning-async": "Trainer(plugins=[AsyncCheckpointIO(TorchCheckpointIO())])",
    "fastckpt-async": "Trainer(plugins=[AsyncCheckpointIO(fastckpt.lightning.CheckpointIO())])",
}


def run(p: dict) -> dict[str, Any]:
    import logging
    import warnings

    import torch
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    import fastckpt.lightning
    from fastckpt.bench import state as S
    warnings.filterwarnings("ignore")
    warm_imports()
    logging.getLogger("lightning").setLevel(logging.ERROR)
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    geom = S.geometry(p["size_bytes"])
    loading = p["op"] != "save"
    net = S.model_adam(geom, seed=p["seed"] + (1 if loading else 0), stepped=False)[0]

    class Module(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch: Any, i: int) -> Any:
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self) -> Any:
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    c = p["contender"]
    io = fastckpt.lightning.CheckpointIO() if c.startswith("fastckpt") else TorchCheckpointIO()
    if c.endswith("-async"):
        io = AsyncCheckpointIO(io)
    g = torch.Generator().manual_seed(p["seed"])
    data = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(torch.randn(1, geom["width"], generator=g)),
        batch_size=1)
    trainer = Trainer(max_steps=1, accelerator="cpu", devices=1, logger=False,
                      enable_checkpointing=False, enable_progress_bar=False,
                      enable_model_summary=False, plugins=[io])
    lm = Module()
    path = os.path.join(p["path"], "model.ckpt")
    out: dict[str, Any] = {}
    if not loading:
        trainer.fit(lm, data)
        os.makedirs(p["path"], exist_ok=True)
        with Clock() as total:
            with Clock() as stall:
                trainer.save_checkpoint(path)
            if c.endswith("-async"):
                io.teardown()
            if not c.startswith("fastckpt"):
                fsync_tree(p["path"])  # torch.save does not fsync
        out.update(stall_s=stall.s, durable_s=total.s)
    else:
        conn = trainer._checkpoint_connector
        marks: dict[str, float] = {}
        start, end = conn.resume_start, conn.resume_end

        def timed_start(*a: Any, **k: Any) -> Any:
            marks["t0"] = Clock().__enter__().t0
            return start(*a, **k)

        def timed_end(*a: Any, **k: Any) -> Any:
            r = end(*a, **k)
            marks["t1"] = Clock().__enter__().t0
            return r
        conn.resume_start, conn.resume_end = timed_start, timed_end
        trainer.fit(lm, data, ckpt_path=path)
        out["load_s"] = marks["t1"] - marks["t0"]
        assert trainer.global_step == 1, trainer.global_step
    full = {"model": lm.state_dict(), "optim": trainer.optimizers[0].state_dict()}
    out.update(state_bytes=nbytes(full), fingerprint=fingerprint(full))
    return out
