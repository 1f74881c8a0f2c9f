"""Hugging Face transformers 5.23 ``Trainer``: its own checkpoints (``checkpoint-N`` with
``model.safetensors``, ``optimizer.pt``, ``scheduler.pt``, ``rng_state.pth``; no fsync: the
benchmark fsyncs them for "durable") against ``fastckpt.hf.FastCkptCallback`` (async:
stall = until the Trainer's save call returns, durable = + the commit). Saves are timed at the
call the Trainer makes at a save point (``Trainer._save_checkpoint``), twice in a row: the
second (steady state: fastckpt's staging buffers exist) is "stall"/"durable", the first is kept
in the JSON. A load is timed from the call ``trainer.train(resume_from_checkpoint=...)`` to the moment
the first training step would begin (``on_step_begin``; the run is stopped there): reading,
restoring model, optimizer, scheduler, RNG and trainer state, plus the Trainer's own set-up
(the same for both). State: a
GPT-2 built from its config (n_embd 768, 12 heads, vocab 8192, as many layers as fit the size)
and AdamW after two real steps."""

from __future__ import annotations

import os
import time
from typing import Any

from clients._common import Clock, fingerprint, fsync_tree, nbytes, warm_imports

CONTENDERS = ("hf", "fastckpt")
LOADERS = ("hf", "fastckpt")
PAIRS = [("hf", "fastckpt")]
DESCRIPTIONS = {
    "hf": "Trainer default: checkpoint-N/ (safetensors model, torch.save optimizer/scheduler/"
          "rng) + fsync by the benchmark / train(resume_from_checkpoint=checkpoint-N)",
    "fastckpt": "Trainer(callbacks=[FastCkptCallback(root)]) / train(resume_from_checkpoint="
                "ckpt.resume(trainer))",
}
EMBD, VOCAB = 768, 8192


def run(p: dict) -> dict[str, Any]:
    import logging
    import warnings

    import torch
    from transformers import (GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback,
                              TrainingArguments)
    from transformers.utils import logging as hf_logging

    import fastckpt.hf
    warnings.filterwarnings("ignore")
    warm_imports()
    hf_logging.set_verbosity_error()
    logging.getLogger("fastckpt").setLevel(logging.WARNING)
    loading = p["op"] != "save"
    per_layer = 12 * EMBD * EMBD
    layers = max(1, int((p["size_bytes"] / 12 - VOCAB * EMBD) // per_layer))
    torch.manual_seed(p["seed"] + (1 if loading else 0))
    model = GPT2LMHeadModel(GPT2Config(n_layer=layers, n_embd=EMBD, n_head=12,
                                       vocab_size=VOCAB, n_positions=128))
    x = torch.randint(0, VOCAB, (4, 32), generator=torch.Generator().manual_seed(0))

    class Tokens(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(x)

        def __getitem__(self, i: int) -> dict:
            return {"input_ids": x[i], "labels": x[i]}

    c = p["contender"]
    out_dir = os.path.join(p["path"], "hf")
    root = os.path.join(p["path"], "fastckpt")
    callbacks = [fastckpt.hf.FastCkptCallback(root)] if c == "fastckpt" else []
    args = TrainingArguments(output_dir=out_dir, max_steps=3 if loading else 2,
                             per_device_train_batch_size=1, save_strategy="no", report_to=[],
                             use_cpu=True, logging_strategy="no", disable_tqdm=True,
                             dataloader_num_workers=0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=callbacks)
    out: dict[str, Any] = {}
    if not loading:
        trainer.train(resume_from_checkpoint=callbacks[0].resume(trainer) if callbacks else None)
        if callbacks:
            callbacks[0].checkpointer  # open, as during training (not a save's cost)
        for step in (1, 2):  # two saves of the state after step 2 (the first labelled 1): the
            trainer.state.global_step = step  # second is the steady state, the one loaded
            with Clock() as total:
                with Clock() as stall:
                    trainer._save_checkpoint(trainer.model, trial=None)
                if callbacks:
                    callbacks[0].checkpointer.wait()
                else:
                    fsync_tree(os.path.join(out_dir, f"checkpoint-{step}"))
            out.update({f"save{step}_stall_s": stall.s, f"save{step}_durable_s": total.s})
        out.update(stall_s=out["save2_stall_s"], durable_s=out["save2_durable_s"])
        if callbacks:
            callbacks[0].checkpointer.close()
    else:
        class Loaded(Exception):
            pass

        class StopAtFirstStep(TrainerCallback):
            """The restored state, the moment the first step would begin (all loading done)."""

            def on_step_begin(self, *a: Any, **k: Any) -> None:
                out["load_s"] = time.perf_counter() - t0
                out["full"] = {"model": trainer.model.state_dict(),
                               "optim": trainer.optimizer.state_dict(),
                               "sched": trainer.lr_scheduler.state_dict()}
                raise Loaded
        trainer.add_callback(StopAtFirstStep())
        t0 = time.perf_counter()
        try:
            if callbacks:
                trainer.train(resume_from_checkpoint=callbacks[0].resume(trainer))
            else:
                trainer.train(resume_from_checkpoint=os.path.join(out_dir, "checkpoint-2"))
        except Loaded:
            pass
        assert trainer.state.global_step == 2, trainer.state.global_step
        full = out.pop("full")
        out.update(state_bytes=nbytes(full), fingerprint=fingerprint(full))
        return out
    full = {"model": trainer.model.state_dict(), "optim": trainer.optimizer.state_dict(),
            "sched": trainer.lr_scheduler.state_dict()}
    out.update(state_bytes=nbytes(full), fingerprint=fingerprint(full))
    return out
