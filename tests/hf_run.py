"""Tiny Hugging Face training runs for tests/test_hf.py: GPT-2 and Llama built from configs (no
downloads, dropout on), a synthetic token dataset, ``transformers.Trainer`` with
``fastckpt.hf.FastCkptCallback``, and a snapshot of what a run ended with.

``train(...)`` runs one Trainer in this process and returns its snapshot; ``fsdp_rank`` is the
per-rank function for ``tests.distributed.run`` (FSDP2 through transformers' own
``DistributedConfig``); ``python -m tests.hf_run SPEC.json OUT.pt`` runs ``train`` in a fresh
process (a restart) and writes the snapshot with ``torch.save``.
"""

from __future__ import annotations

import json
import os
import sys

import torch

#: the optimizer steps of every run; 12 samples / batch 4 = 3 steps per epoch (8: 2.7 epochs)
STEPS = 8


def config(kind: str):
    from transformers import GPT2Config, LlamaConfig
    if kind == "gpt2":  # dropout 0.1 (embeddings, attention, residual) by default
        return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=128, n_positions=32,
                          bos_token_id=0, eos_token_id=0)
    return LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, vocab_size=128,
                       max_position_embeddings=32, attention_dropout=0.1, bos_token_id=0,
                       eos_token_id=0, pad_token_id=0)


def build(kind: str, seed: int):
    from transformers import AutoModelForCausalLM
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(kind))


class Tokens(torch.utils.data.Dataset):
    """Random token sequences (the same for every run: a fixed generator)."""

    def __init__(self, n: int = 12, length: int = 16) -> None:
        g = torch.Generator().manual_seed(1234)
        self.x = torch.randint(0, 128, (n, length), generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.x[i], "labels": self.x[i]}


def _callbacks():
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        """The loss the Trainer logs at each step (logging_steps=1)."""

        def __init__(self) -> None:
            self.losses: dict[int, float] = {}

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "loss" in logs:
                self.losses[state.global_step] = logs["loss"]

    class Stop(TrainerCallback):
        """Stops training after step ``at`` (after that step's save): the job "dies" there."""

        def __init__(self, at: int | None) -> None:
            self.at = at

        def on_step_end(self, args, state, control, **kw):
            if self.at is not None and state.global_step >= self.at:
                control.should_training_stop = True
            return control

    return Record, Stop


def make_trainer(kind: str, *, root: str | None = None, seed: int = 0, every: int | None = None,
                 stop_at: int | None = None, keep_last: int | None = None,
                 pretrained: str | None = None, out_dir: str = "", **arguments):
    """(trainer, FastCkptCallback or None, Record) for a run of ``STEPS`` steps (stopped after
    ``stop_at``), checkpointing to ``root`` when given. ``pretrained``: a directory to load
    the model from with ``DistributedConfig(fsdp_size=world)`` (FSDP2, sharded by transformers
    at load time); else the model is built from its config with ``seed``."""
    import transformers
    from transformers import Trainer, TrainingArguments

    import fastckpt.hf
    transformers.logging.set_verbosity_error()
    Record, Stop = _callbacks()
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if pretrained is not None:
        from transformers import AutoModelForCausalLM
        from transformers.distributed import DistributedConfig
        model = AutoModelForCausalLM.from_pretrained(
            pretrained, distributed_config=DistributedConfig(fsdp_size=world))
    else:
        model = build(kind, seed)
    settings = dict(output_dir=out_dir or (root + "-out" if root else "/tmp/fastckpt-hf-out"),
                    max_steps=STEPS, per_device_train_batch_size=4 // world, logging_steps=1,
                    save_strategy="no", report_to=[], use_cpu=True, seed=7, disable_tqdm=True,
                    dataloader_pin_memory=False, learning_rate=1e-2, warmup_steps=2,
                    weight_decay=0.01)
    settings.update(arguments)
    rec = Record()
    callbacks = [rec, Stop(stop_at)]
    ckpt = None
    if root is not None:
        ckpt = fastckpt.hf.FastCkptCallback(root, every=every, keep_last=keep_last)
        callbacks.insert(0, ckpt)
    evaluating = settings.get("eval_strategy", "no") != "no"
    trainer = Trainer(model=model, args=TrainingArguments(**settings), train_dataset=Tokens(),
                      eval_dataset=Tokens(8) if evaluating else None, callbacks=callbacks)
    return trainer, ckpt, rec


def train(kind: str, *, resume: bool = False, **kw) -> dict:
    """One run (see ``make_trainer``), resumed through the callback when ``resume``; its
    snapshot and the loss of every step it ran."""
    trainer, ckpt, rec = make_trainer(kind, **kw)
    start = ckpt.resume(trainer) if ckpt is not None else None
    assert (start is not None) == resume, (start, resume)
    trainer.train(resume_from_checkpoint=start)
    out = snapshot(trainer)
    out["losses"] = rec.losses
    return out


def _full(t):
    from torch.distributed.tensor import DTensor
    if isinstance(t, DTensor):
        return t.full_tensor().detach().clone()
    return t.detach().clone() if isinstance(t, torch.Tensor) else t


def snapshot(trainer) -> dict:
    """What a run ended with: full parameters and optimizer state (gathered from FSDP2 shards:
    every rank calls it), the scheduler, the TrainerState, the tie of GPT-2's head."""
    model = trainer.model
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    params, optim = {}, {}
    for name, p in model.named_parameters():
        params[name] = _full(p)
        for k, v in sorted(opt.state.get(p, {}).items()):
            optim[f"{name}.{k}"] = _full(v)
    out = {"params": params, "optim": optim, "sched": trainer.lr_scheduler.state_dict(),
           "lr": [g["lr"] for g in opt.param_groups], "global_step": trainer.state.global_step,
           "epoch": trainer.state.epoch,
           "log": [{k: v for k, v in e.items() if k in ("loss", "grad_norm", "learning_rate",
                                                         "epoch", "step")}
                   for e in trainer.state.log_history if "loss" in e]}
    if hasattr(model, "transformer"):  # GPT-2: lm_head.weight is wte.weight
        head, wte = model.lm_head.weight, model.transformer.wte.weight
        out["tied"] = head is wte
        local = (lambda t: t.to_local()) if hasattr(head, "to_local") else (lambda t: t)
        out["tied_ptr"] = local(head).data_ptr() == local(wte).data_ptr()
    return out


def fsdp_rank(rank: int, world: int, kind: str, pretrained: str, root: str, phase: str) -> dict:
    """(tests.distributed.run) ``phase`` "reference+stop": an uninterrupted run, then a run
    that saves and stops; "resume": a fresh process resuming from ``root``."""
    # one thread, and accelerate must not raise it to 2 (it does when OMP_NUM_THREADS is
    # unset): two runs of the same steps then differed in the last bits of a loss (CI, once)
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    every, stop, keep = (5, 7, None) if kind == "gpt2" else (3, 7, 1)
    if phase == "resume":
        return {"resumed": train(kind, root=root, every=every, resume=True,
                                 pretrained=pretrained)}
    ref = train(kind, pretrained=pretrained, out_dir=os.path.join(root + "-out"))
    part = train(kind, root=root, every=every, stop_at=stop, keep_last=keep,
                 pretrained=pretrained)
    return {"reference": ref, "stopped": part}


if __name__ == "__main__":  # python -m tests.hf_run SPEC.json OUT.pt: a run in a fresh process
    os.environ["OMP_NUM_THREADS"] = "1"  # (see fsdp_rank)
    torch.set_num_threads(1)
    spec = json.load(open(sys.argv[1]))
    torch.save(train(**spec), sys.argv[2])


def accelerate_train(root: str, *, seed: int = 0, every: int = 5, stop_at: int | None = None,
                     resume: bool = False) -> dict:
    """A hand-written ``accelerate`` loop over GPT-2 checkpointing ``fastckpt.hf.
    accelerate_state`` every ``every`` steps; resumes from the newest step when ``resume``."""
    from accelerate import Accelerator, DataLoaderConfiguration
    from accelerate.utils import set_seed
    from transformers import get_linear_schedule_with_warmup

    import fastckpt
    import fastckpt.hf
    model = build("gpt2", seed)
    set_seed(7)  # after the model: the seedable sampler takes its seed from here
    acc = Accelerator(cpu=True, dataloader_config=DataLoaderConfiguration(
        use_seedable_sampler=True))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    sched = get_linear_schedule_with_warmup(opt, 2, STEPS)
    # its own generator: starting an epoch draws nothing from the global RNG (saved, restored)
    dl = torch.utils.data.DataLoader(Tokens(), batch_size=4, shuffle=True,
                                     generator=torch.Generator().manual_seed(3))
    model, opt, dl, sched = acc.prepare(model, opt, dl, sched)
    state = fastckpt.hf.accelerate_state(acc, model, opt, sched, step=0)
    losses: dict[int, float] = {}
    with fastckpt.Checkpointer(root) as ck:
        start = ck.resume(state)
        assert (start is not None) == resume, start
        step = state["step"]
        while step < STEPS and step != stop_at:
            epoch, done = divmod(step, len(dl))
            dl.set_epoch(epoch)
            for batch in acc.skip_first_batches(dl, done) if done else dl:
                model.train()
                loss = model(**batch).loss
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                step += 1
                losses[step] = loss.item()
                if step % every == 0:
                    state["step"] = step
                    ck.save(state, step=step)
                if step in (stop_at, STEPS):
                    break
    out = {"losses": losses, "params": {n: _full(p) for n, p in model.named_parameters()},
           "optim": {f"{i}.{k}": _full(v) for i, p in enumerate(opt.optimizer.param_groups[0]
                                                               ["params"])
                     for k, v in sorted(opt.optimizer.state.get(p, {}).items())},
           "sched": sched.state_dict(),
           "tied": model.lm_head.weight is model.transformer.wte.weight}
    return out
