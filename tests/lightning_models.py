"""The tiny Lightning model, data and recorder that tests/test_lightning.py and
tests/lightning_ddp_script.py train (CPU, a few milliseconds per step)."""

from __future__ import annotations

import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback

#: 32 samples in batches of 8: 4 steps per epoch on one process (2 per rank on two)
N, BATCH = 32, 8


def dataset() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(N, 8, generator=g)
    return torch.utils.data.TensorDataset(x, x[:, :1] * 2 - x[:, 1:2] + 0.1 * torch.randn(
        N, 1, generator=g))


def loader() -> torch.utils.data.DataLoader:
    # shuffled: the sampler draws its seed from torch's generator at every epoch
    return torch.utils.data.DataLoader(dataset(), batch_size=BATCH, shuffle=True)


class Tiny(pl.LightningModule):
    """Linear-ReLU-Dropout-Linear, Adam and a step LR schedule: dropout and shuffling make
    the random generators part of what a resume must restore."""

    def __init__(self, lr: float = 0.05, dropout: float = 0.3, extra: object = None) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(),
                                       torch.nn.Dropout(dropout), torch.nn.Linear(16, 1))
        self.losses: list[tuple[int, torch.Tensor]] = []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=False)
        self.losses.append((self.global_step, loss.detach().clone()))
        return loss

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=self.hparams.lr)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class Final(Callback):
    """Keeps copies of the model, optimizer and scheduler states when training ends."""

    def on_train_end(self, trainer, pl_module):
        self.model = {k: v.detach().clone() for k, v in pl_module.state_dict().items()}
        self.optim = clone(trainer.optimizers[0].state_dict())
        self.sched = clone(trainer.lr_scheduler_configs[0].scheduler.state_dict())


def clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(clone(v) for v in x)
    return x


def trainer(root: str, max_steps: int, *, plugins=(), callbacks=(), **kw) -> pl.Trainer:
    return pl.Trainer(default_root_dir=root, max_steps=max_steps, accelerator="cpu",
                      logger=False, enable_progress_bar=False, enable_model_summary=False,
                      plugins=list(plugins), callbacks=list(callbacks), **kw)
