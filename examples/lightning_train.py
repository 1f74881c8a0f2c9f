"""PyTorch Lightning with fastckpt checkpoints: the one-liner, ModelCheckpoint, and resume.

    python examples/lightning_train.py --dir demo-out/lightning --steps 40          # train
    python examples/lightning_train.py --dir demo-out/lightning --steps 80 --resume  # continue

CPU by default (``--devices 2 --strategy ddp`` runs two processes). Each checkpoint path that
ModelCheckpoint names (``epoch=1-step=20.ckpt``, ``last.ckpt``) is a fastckpt root directory:
``fastckpt ls demo-out/lightning/ckpt/last.ckpt`` lists it, ``fastckpt verify`` checks it.
``--resume`` continues from ``last.ckpt``; with ``RNGCallback`` (dropout, shuffling) the losses
are those an uninterrupted run would have printed.
"""

from __future__ import annotations

import argparse

import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint

import fastckpt.lightning


class Regressor(pl.LightningModule):
    def __init__(self, lr: float = 1e-2) -> None:
        super().__init__()
        self.save_hyperparameters()  # plain values only: checkpoints are never pickled
        self.net = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.ReLU(),
                                       torch.nn.Dropout(0.1), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def data(batch_size: int = 32) -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(640, 16, generator=g)
    y = x @ torch.randn(16, 1, generator=g) + 0.1 * torch.randn(640, 1, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y),
                                       batch_size=batch_size, shuffle=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="demo-out/lightning")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10, help="checkpoint every N steps")
    ap.add_argument("--resume", action="store_true", help="continue from last.ckpt")
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--strategy", default="auto")
    args = ap.parse_args()

    pl.seed_everything(0)
    checkpoints = ModelCheckpoint(dirpath=f"{args.dir}/ckpt", monitor="train_loss",
                                  save_top_k=2, save_last=True, every_n_train_steps=args.every)
    trainer = pl.Trainer(
        default_root_dir=args.dir, max_steps=args.steps, accelerator="cpu",
        devices=args.devices, strategy=args.strategy, logger=False,
        plugins=[fastckpt.lightning.CheckpointIO()],         # <- the one line
        callbacks=[checkpoints, fastckpt.lightning.RNGCallback()])
    trainer.fit(Regressor(), data(), ckpt_path="last" if args.resume else None)
    if trainer.is_global_zero:
        print(f"best: {checkpoints.best_model_path} (train_loss {checkpoints.best_model_score})")
        print(f"last: {checkpoints.last_model_path}")
    # Lightning destroys only an NCCL process group at exit; a gloo one left up (--devices 2 on
    # CPU) can abort the interpreter's exit with SIGABRT (pytorch/pytorch#190489)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
