"""A Hugging Face Trainer run that checkpoints with fastckpt and resumes exactly (CPU, no
downloads: a tiny GPT-2 built from its config, trained on random tokens).

    python examples/hf_train.py --root /tmp/hf-demo/ckpt --stop-after 7   # "dies" after step 7
    python examples/hf_train.py --root /tmp/hf-demo/ckpt                  # resumes step 5, ends
    python examples/hf_train.py --root /tmp/hf-demo/other       # uninterrupted: the same losses

    # FSDP2 on two CPU processes (gloo), the model sharded by transformers at load time:
    torchrun --nproc-per-node 2 examples/hf_train.py --root /tmp/hf-demo/fsdp --fsdp2

The fastckpt part is two lines (marked below): the callback in ``callbacks=[...]`` and
``resume_from_checkpoint=ckpt.resume(trainer)``. Every rank prints the loss of each step it
ran; compare them between a stopped-and-resumed run and an uninterrupted one.
"""

from __future__ import annotations

import argparse
import os

import torch
from transformers import (AutoModelForCausalLM, GPT2Config, Trainer, TrainerCallback,
                          TrainingArguments)

import fastckpt.hf


class Tokens(torch.utils.data.Dataset):
    """Random token sequences, the same in every run."""

    def __init__(self, n: int = 48, length: int = 32) -> None:
        self.x = torch.randint(0, 256, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


class StopAfter(TrainerCallback):
    """Ends the run after a step, as a preempted job would (for the demo)."""

    def __init__(self, step: int | None) -> None:
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if self.step is not None and state.global_step >= self.step:
            control.should_training_stop = True


class PrintLoss(TrainerCallback):
    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            print(f"rank {args.process_index} step {state.global_step} loss {logs['loss']!r}",
                  flush=True)


def model_for(args: argparse.Namespace, world: int) -> torch.nn.Module:
    config = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64,
                        bos_token_id=0, eos_token_id=0)  # dropout 0.1: the RNG state matters
    torch.manual_seed(0)
    if not args.fsdp2:
        return AutoModelForCausalLM.from_config(config)
    # FSDP2 by transformers itself: from_pretrained(..., distributed_config=...) shards the
    # model at load time; it needs a local directory to load from (written once here)
    from transformers.distributed import DistributedConfig
    base = args.root.rstrip("/") + "-base"
    if int(os.environ.get("RANK", "0")) == 0 and not os.path.isdir(base):
        AutoModelForCausalLM.from_config(config).save_pretrained(base)
    torch.distributed.barrier()
    return AutoModelForCausalLM.from_pretrained(
        base, distributed_config=DistributedConfig(fsdp_size=world))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", required=True, help="fastckpt checkpoint root (path or URL)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=5, help="save every N optimizer steps")
    ap.add_argument("--keep-last", type=int, default=2)
    ap.add_argument("--stop-after", type=int, default=None, help="end the run after this step")
    ap.add_argument("--fsdp2", action="store_true", help="under torchrun: FSDP2 over the ranks")
    args = ap.parse_args()

    torch.set_num_threads(1)  # the same arithmetic in every run (comparable losses)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    targs = TrainingArguments(
        output_dir=args.root.rstrip("/") + "-out", max_steps=args.steps,
        per_device_train_batch_size=8 // world, learning_rate=3e-3, warmup_steps=2,
        logging_steps=1, report_to=[], use_cpu=True, seed=7, disable_tqdm=True,
        dataloader_pin_memory=False,
        save_strategy="no")  # the Trainer writes no checkpoint-N directories: fastckpt does
    model = model_for(args, world)

    ckpt = fastckpt.hf.FastCkptCallback(args.root, every=args.every,  # <- fastckpt
                                        keep_last=args.keep_last)
    trainer = Trainer(model=model, args=targs, train_dataset=Tokens(),
                      callbacks=[ckpt, StopAfter(args.stop_after), PrintLoss()])
    start = ckpt.resume(trainer)  # <- fastckpt: None on a fresh root
    if targs.process_index == 0:
        print(f"resuming step {ckpt.resume_step}" if start else "starting fresh", flush=True)
    trainer.train(resume_from_checkpoint=start)
    if targs.process_index == 0:
        print(f"committed steps under {args.root}: {fastckpt.steps(args.root)}")


if __name__ == "__main__":
    main()
