"""fastckpt.hf against the real transformers (5.23) and accelerate (1.15), on CPU.

Every bit-exact test compares a run that was stopped and resumed with an uninterrupted run of
the same job: the loss the Trainer logs at every step, the final parameters, every optimizer
moment, the LR scheduler and the TrainerState must be equal, not close. Models are tiny GPT-2
(tied head) and Llama configs with dropout on (so the restored RNG states matter), built from
configs (nothing is downloaded). The resumed half runs in a fresh process.
"""

from __future__ import annotations

import copy
import dataclasses
import glob
import json
import os
import random
import subprocess
import sys

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import fastckpt  # noqa: E402
from tests import hf_run  # noqa: E402
from tests.distributed import run  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: (save every, stop after, keep_last) per model: GPT-2 resumes step 5, in the middle of its
#: second epoch (the Trainer skips consumed batches, then restores the RNG); Llama keeps only
#: its newest step (6) and resumes at an epoch boundary
PLAN = {"gpt2": (5, 7, None), "llama": (3, 7, 1)}


@pytest.fixture(autouse=True)
def one_thread():
    """The same arithmetic in every process of a comparison (the fresh processes and the
    ranks run one intra-op thread: a different thread count can change float sums)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _in_fresh_process(tmp_path, **spec) -> dict:
    """``hf_run.train(**spec)`` in a new interpreter (the restart of a stopped job)."""
    spec_file, out = tmp_path / "spec.json", tmp_path / "resumed.pt"
    spec_file.write_text(json.dumps(spec))
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    r = subprocess.run([sys.executable, "-m", "tests.hf_run", str(spec_file), str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-4000:]
    return torch.load(out, weights_only=False)


def _assert_same_run(ref: dict, got: dict) -> None:
    """Bit-exact: parameters, optimizer state, scheduler, learning rates, TrainerState."""
    assert ref["params"].keys() == got["params"].keys()
    bad = [k for k in ref["params"] if not torch.equal(ref["params"][k], got["params"][k])]
    assert not bad, f"parameters differ: {bad}"
    assert ref["optim"].keys() == got["optim"].keys() and ref["optim"]
    bad = [k for k in ref["optim"]
           if not torch.equal(torch.as_tensor(ref["optim"][k]), torch.as_tensor(got["optim"][k]))]
    assert not bad, f"optimizer state differs: {bad}"
    assert ref["sched"] == got["sched"]
    assert ref["lr"] == got["lr"]
    assert (ref["global_step"], ref["epoch"]) == (got["global_step"], got["epoch"])
    assert ref["log"] == got["log"]  # every step's loss, grad norm, lr, epoch, as logged


def _manifest(root: str) -> dict:
    """The newest committed step's manifest body."""
    path = sorted(glob.glob(os.path.join(root, "step-*", "manifest.json")))[-1]
    return json.load(open(path))["body"]


def _check_tie_stored_once(root: str) -> None:
    body = _manifest(root)
    assert "model.transformer.wte.weight" in body["tensors"]
    assert "model.lm_head.weight" not in body["tensors"]  # written once, under wte
    assert body["tree"]["model"]["lm_head.weight"] == {"$tensor": "model.transformer.wte.weight"}


def test_import_fastckpt_does_not_import_transformers():
    code = ("import sys, fastckpt; fastckpt.Checkpointer; fastckpt.RNGState; "
            "assert 'transformers' not in sys.modules and 'accelerate' not in sys.modules, "
            "[m for m in sys.modules if m.startswith(('transformers', 'accelerate'))]")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_trainer_resume_in_fresh_process_is_bit_exact(kind, tmp_path):
    """One process: stopped after step 7 with its last checkpoint at step 5 (GPT-2) or 6 (Llama),
    restarted in a new interpreter with a differently initialised model, resumed through
    ``ckpt.resume(trainer)``: every logged loss and the final state equal the uninterrupted
    run's; GPT-2's head is still tied to its embedding, stored once in the checkpoint."""
    every, stop, keep = PLAN[kind]
    root = str(tmp_path / "ckpt")
    ref = hf_run.train(kind, out_dir=str(tmp_path / "ref"))
    assert sorted(ref["losses"]) == list(range(1, hf_run.STEPS + 1))
    part = hf_run.train(kind, root=root, every=every, stop_at=stop, keep_last=keep)
    # the saves perturb nothing
    assert part["losses"] == {s: ref["losses"][s] for s in range(1, stop + 1)}
    saved = fastckpt.steps(root)
    assert saved == ([5] if kind == "gpt2" else [6])  # keep_last=1 removed step 3
    assert not glob.glob(str(tmp_path / "ckpt-out" / "checkpoint-*"))  # no Trainer checkpoint

    got = _in_fresh_process(tmp_path, kind=kind, root=root, seed=99, every=every, resume=True)
    start = saved[-1]
    assert got["losses"] == {s: ref["losses"][s] for s in range(start + 1, hf_run.STEPS + 1)}
    _assert_same_run(ref, got)
    if kind == "gpt2":
        assert got["tied"] and got["tied_ptr"] and ref["tied"]
        _check_tie_stored_once(root)


def test_a_save_at_an_epochs_last_step_follows_the_epochs_evaluation(tmp_path):
    """3 steps an epoch, an evaluation at each epoch's end (it draws random numbers and adds to
    the TrainerState), ``every=3``: the save of step 6 comes after epoch 2's evaluation, as the
    Trainer's own epoch save does, so the resume goes on bit-exact. Before 2026-12-06 it was
    taken at the step's end, before the evaluation: steps 7-8 differed."""
    root = str(tmp_path / "ckpt")
    ref = hf_run.train("gpt2", out_dir=str(tmp_path / "ref"), eval_strategy="epoch")
    hf_run.train("gpt2", root=root, every=3, stop_at=6, eval_strategy="epoch")
    assert fastckpt.steps(root) == [3, 6]
    got = hf_run.train("gpt2", root=root, every=3, seed=99, resume=True,
                       eval_strategy="epoch")
    assert got["losses"] == {s: ref["losses"][s] for s in (7, 8)}
    _assert_same_run(ref, got)


def _oldest_is_best():
    from transformers import TrainerCallback

    class OldestIsBest(TrainerCallback):
        """Reports each evaluation's loss as the step number, before the Trainer picks its
        best: the best is step 3 whatever the numbers (which vary with the CPU: with the real
        losses of this run the best was step 3 on one machine, step 15 on another)."""

        def on_evaluate(self, args, state, control, metrics=None, **kw):
            metrics["eval_loss"] = float(state.global_step)
    return OldestIsBest


def test_save_total_limit_keeps_the_best_step_as_the_trainers_rotation_does(tmp_path):
    """``metric_for_best_model`` with ``save_total_limit=2``: the Trainer's rotation keeps its
    best checkpoint besides the newest ones; retention keeps the best step too (before
    2026-12-06 only the newest two stayed: the best weights were removed)."""
    root = str(tmp_path / "ckpt")
    trainer, ckpt, _ = hf_run.make_trainer(
        "gpt2", root=root, max_steps=15, eval_strategy="epoch", save_strategy="epoch",
        save_total_limit=2, metric_for_best_model="eval_loss", greater_is_better=False,
        learning_rate=1.0, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0)
    trainer.add_callback(_oldest_is_best()())
    trainer.train(resume_from_checkpoint=ckpt.resume(trainer))
    assert trainer.state.best_global_step == 3  # (not among the newest two)
    assert fastckpt.steps(root) == [3, 12, 15]


def _fsdp_base(tmp_path, kind: str) -> str:
    d = str(tmp_path / f"base-{kind}")
    hf_run.build(kind, 0).save_pretrained(d)  # every rank loads the same start, sharded
    return d


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_trainer_fsdp2_two_ranks_resume_is_bit_exact(kind, tmp_path):
    """Two gloo ranks, the model sharded with FSDP2 by transformers itself
    (``from_pretrained(..., distributed_config=DistributedConfig(fsdp_size=2))``, a setup whose
    own Trainer checkpoints are refused): saved on both ranks (DTensor shards per rank), the
    job stopped, two fresh processes resume: bit-exact against an uninterrupted 2-rank run."""
    base, root = _fsdp_base(tmp_path, kind), str(tmp_path / "ckpt")
    first = run(hf_run.fsdp_rank, 2, kind, base, root, "reference+stop", timeout=300)
    ref, part = first[0]["reference"], first[0]["stopped"]
    every, stop, _ = PLAN[kind]
    assert part["losses"] == {s: ref["losses"][s] for s in range(1, stop + 1)}
    start = fastckpt.latest_step(root)
    assert start == (5 if kind == "gpt2" else 6)
    body = _manifest(root)
    assert body["world_size"] == 2 and "tree" in body  # one set of plain values for any world
    sharded = [k for k, t in body["tensors"].items() if k.startswith("model.")
               and len({c["rank"] for c in t["chunks"]}) == 2]
    assert sharded, "no parameter was saved as per-rank shards"
    assert not body["tensors"]["rng.torch"].get("per_rank")  # the ranks' generators agree

    second = run(hf_run.fsdp_rank, 2, kind, base, root, "resume", timeout=300)
    for r in range(2):
        got = second[r]["resumed"]
        assert got["losses"] == {s: ref["losses"][s] for s in range(start + 1, hf_run.STEPS + 1)}
        _assert_same_run(first[r]["reference"], got)
    if kind == "gpt2":
        assert second[0]["resumed"]["tied"] and second[0]["resumed"]["tied_ptr"]
        _check_tie_stored_once(root)
        # the same checkpoint in one process, no FSDP: resharded into plain tensors, tie
        # restored, the schedule continues exactly; dropout draws masks for 4 samples at once
        # instead of 2 per rank, so the losses are close, not equal
        one = _in_fresh_process(tmp_path, kind=kind, root=root, seed=99, every=every,
                                resume=True)
        assert sorted(one["losses"]) == list(range(start + 1, hf_run.STEPS + 1))
        assert one["losses"][start + 1] == pytest.approx(ref["losses"][start + 1], rel=1e-2)
        assert (one["sched"], one["lr"], one["global_step"]) == (
            ref["sched"], ref["lr"], ref["global_step"])
        assert one["tied"] and one["tied_ptr"]


def test_trainer_save_strategy_decides_and_save_total_limit_retains(tmp_path):
    """Without ``every`` the Trainer's own save_strategy decides when (steps 3, 6 and the last,
    8); fastckpt writes instead of the Trainer (no checkpoint-N directory) and keeps
    ``save_total_limit`` steps; the saved TrainerState is the Trainer's at that step."""
    root = str(tmp_path / "ckpt")
    trainer, ckpt, _ = hf_run.make_trainer("gpt2", root=root, save_strategy="steps",
                                           save_steps=3, save_total_limit=2)
    assert ckpt.resume(trainer) is None
    trainer.train(resume_from_checkpoint=None)
    assert fastckpt.steps(root) == [6, 8]
    assert not glob.glob(str(tmp_path / "ckpt-out" / "checkpoint-*"))
    saved = json.loads(fastckpt.read(root)["trainer_state"])
    mine = dataclasses.asdict(trainer.state)
    for key in ("global_step", "epoch", "max_steps"):
        assert saved[key] == mine[key], key
    # the history as it stood at step 8 (the Trainer appends its summary after the last save)
    assert saved["log_history"] == mine["log_history"][:-1] and len(saved["log_history"]) == 8
    assert _manifest(root)["user_meta"]["written_by"] == "fastckpt.hf.FastCkptCallback"


def _everything(trainer) -> dict:
    """A deep copy of what a save could touch."""
    opt = trainer.optimizer.optimizer
    return {"params": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
            "grads": {n: None if p.grad is None else p.grad.clone()
                      for n, p in trainer.model.named_parameters()},
            "optim": copy.deepcopy(opt.state_dict()),
            "sched": type(trainer.lr_scheduler).state_dict(trainer.lr_scheduler),
            "trainer_state": copy.deepcopy(dataclasses.asdict(trainer.state)),
            "flos": trainer.current_flos, "control": copy.deepcopy(vars(trainer.control)),
            "torch_rng": torch.get_rng_state(), "py_rng": random.getstate()}


def _assert_unchanged(before: dict, after: dict) -> None:
    for n, p in before["params"].items():
        assert torch.equal(p, after["params"][n]), n
    assert before["grads"].keys() == after["grads"].keys()
    for n, g in before["grads"].items():
        assert (g is None) == (after["grads"][n] is None) and (g is None or torch.equal(
            g, after["grads"][n])), n
    a, b = before["optim"], after["optim"]
    assert a["param_groups"] == b["param_groups"] and a["state"].keys() == b["state"].keys()
    for i, s in a["state"].items():
        for k, v in s.items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(b["state"][i][k])), (i, k)
    for key in ("sched", "trainer_state", "flos", "control", "py_rng"):
        assert before[key] == after[key], key
    assert torch.equal(before["torch_rng"], after["torch_rng"])


def test_a_save_changes_nothing_even_when_it_fails(tmp_path):
    """The Trainer's save (replaced by fastckpt's) leaves the model, gradients, optimizer,
    scheduler, TrainerState, flop counter, control and RNGs exactly as they were; so does a
    save that fails (a scheduler state fastckpt refuses), which writes no step."""
    root = str(tmp_path / "ckpt")
    trainer, ckpt, _ = hf_run.make_trainer("gpt2", root=root, stop_at=3)
    assert ckpt.resume(trainer) is None
    trainer.train(resume_from_checkpoint=None)
    assert fastckpt.steps(root) == []
    trainer.current_flos = 12345.0  # flops since the Trainer last stored them
    before = _everything(trainer)
    trainer._save_checkpoint(trainer.model, None)
    ckpt.checkpointer.wait()
    assert fastckpt.steps(root) == [3]
    _assert_unchanged(before, _everything(trainer))
    saved = json.loads(fastckpt.read(root)["trainer_state"])
    assert saved["total_flos"] == trainer.state.total_flos + trainer.current_flos > 0

    trainer.state.global_step = 4  # a later step whose save fails
    sched, cls = trainer.lr_scheduler, type(trainer.lr_scheduler)
    before = _everything(trainer)

    class Refused(cls):
        def state_dict(self):  # not plain data: refused (never pickled), before any write
            return {"lr_lambdas": [object()]}
    sched.__class__ = Refused
    with pytest.raises(fastckpt.UnsupportedStateError, match="lr_scheduler"):
        trainer._save_checkpoint(trainer.model, None)
    sched.__class__ = cls
    _assert_unchanged(before, _everything(trainer))
    ckpt.checkpointer.close()
    assert fastckpt.steps(root) == [3]


def test_misuse_is_refused_before_training(tmp_path):
    root = str(tmp_path / "ckpt")
    trainer, _, rec = hf_run.make_trainer("gpt2", root=root)
    with pytest.raises(RuntimeError, match="resume_from_checkpoint=ckpt.resume"):
        trainer.train()  # never bound: would save nothing and resume nothing
    assert rec.losses == {}

    hf_run.train("gpt2", root=root, every=2, stop_at=2)
    trainer, ckpt, rec = hf_run.make_trainer("gpt2", root=root)
    assert ckpt.resume(trainer) is not None
    with pytest.raises(RuntimeError, match="was not given its directory"):
        trainer.train()  # resume prepared, but the Trainer would start from step 0
    assert rec.losses == {}

    trainer, ckpt, _ = hf_run.make_trainer("gpt2", root=root)
    trainer.args.load_best_model_at_end = True  # (it would need an eval set to construct)
    with pytest.raises(ValueError, match="load_best_model_at_end"):
        ckpt.resume(trainer)


def test_accelerate_loop_resume_is_bit_exact(tmp_path):
    """A hand-written accelerate loop saving ``fastckpt.hf.accelerate_state`` (unwrapped model,
    the torch optimizer inside accelerate's wrapper, scheduler, RNG, step) resumes bit-exact
    mid-epoch in a new model/optimizer/Accelerator, GPT-2's tie intact."""
    ref = hf_run.accelerate_train(str(tmp_path / "ref"))
    root = str(tmp_path / "ckpt")
    part = hf_run.accelerate_train(root, stop_at=7)
    assert part["losses"] == {s: ref["losses"][s] for s in range(1, 8)}
    assert fastckpt.steps(root) == [5]
    got = hf_run.accelerate_train(root, seed=99, resume=True)
    assert got["losses"] == {s: ref["losses"][s] for s in range(6, hf_run.STEPS + 1)}
    for k in ref["params"]:
        assert torch.equal(ref["params"][k], got["params"][k]), k
    assert ref["optim"].keys() == got["optim"].keys() and ref["optim"]
    for k in ref["optim"]:
        assert torch.equal(torch.as_tensor(ref["optim"][k]), torch.as_tensor(got["optim"][k])), k
    assert ref["sched"] == got["sched"] and got["tied"]


def test_moving_from_trainer_checkpoints(tmp_path):
    """A run that has the Trainer's own checkpoint-N directories moves to fastckpt: bound by
    ``ckpt.resume(trainer)`` (None: the fastckpt root is empty), ``train`` resumes the Trainer's
    directory through the Trainer's own loaders, and the next saves are fastckpt's."""
    out = str(tmp_path / "hf")
    ref = hf_run.train("gpt2", out_dir=out, save_strategy="steps", save_steps=4)
    assert os.path.isdir(os.path.join(out, "checkpoint-4"))
    root = str(tmp_path / "ckpt")
    trainer, ckpt, rec = hf_run.make_trainer("gpt2", root=root, seed=99, every=2,
                                             out_dir=str(tmp_path / "after"))
    assert ckpt.resume(trainer) is None
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-4"))
    assert rec.losses == {s: ref["losses"][s] for s in range(5, hf_run.STEPS + 1)}
    assert fastckpt.steps(root) == [6, 8]
    assert not glob.glob(str(tmp_path / "after" / "checkpoint-*"))
