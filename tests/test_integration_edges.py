"""Framework integrations at their edges (fastckpt/hf.py, fastckpt/torchtitan.py): the HF
callback's retention when the best step was never saved, torchtitan's explicit load_step of
its own checkpoints in a switched folder, and of a fastckpt step that never committed.

Found by a review on 2026-12-06; each test failed on the code before its fix.
"""

from __future__ import annotations

import os
import shutil
import warnings

import pytest
import torch

import fastckpt
from tests.distributed import run


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ------------------------------------------------------------------------------------------
# Before 2026-12-06 (fastckpt/hf.py, FastCkptCallback._save_checkpoint): retention protects
# TrainerState.best_global_step even when that step was never saved (eval_steps not aligned with
# save_steps). The Trainer's own rotation keeps the best checkpoint that EXISTS
# (best_model_checkpoint is only moved to checkpoint-<best_global_step> when that directory
# exists); fastckpt instead protects a step that has no checkpoint and deletes the saved best.
# ------------------------------------------------------------------------------------------

def _metric_callback():
    from transformers import TrainerCallback

    class Metric(TrainerCallback):
        """eval_loss by step, set before the Trainer picks its best: step 3 (saved) is the best
        saved step; step 4 (not a save step) is better still; every other step is worse."""

        def on_evaluate(self, args, state, control, metrics=None, **kw):
            metrics["eval_loss"] = {3: 1.0, 4: 0.5}.get(state.global_step, 10.0)
    return Metric


def test_hf_retention_keeps_the_best_saved_step_when_the_best_step_was_not_saved(tmp_path):
    pytest.importorskip("transformers")
    from tests import hf_run
    torch.set_num_threads(1)
    args = dict(max_steps=8, eval_strategy="steps", eval_steps=1, save_strategy="steps",
                save_steps=3, save_total_limit=2, metric_for_best_model="eval_loss",
                greater_is_better=False)
    # the Trainer's own checkpoints: what a user of save_total_limit expects to be kept
    own = str(tmp_path / "own")
    trainer, _, _ = hf_run.make_trainer("gpt2", root=None, out_dir=own, **args)
    trainer.add_callback(_metric_callback()())
    trainer.train()
    assert trainer.state.best_global_step == 4  # (never saved: save_steps=3)
    kept_by_trainer = sorted(int(n.split("-")[1]) for n in os.listdir(own)
                             if n.startswith("checkpoint-"))
    assert kept_by_trainer == [3, 8]  # its best saved checkpoint (3) and the newest

    root = str(tmp_path / "ckpt")
    trainer, ckpt, _ = hf_run.make_trainer("gpt2", root=root, **args)
    trainer.add_callback(_metric_callback()())
    trainer.train(resume_from_checkpoint=ckpt.resume(trainer))
    # before 2026-12-06 fastckpt kept [6, 8]: the saved best (step 3) was deleted by
    # retention, which protected step 4 (never saved). Now the saved best stays, besides the
    # newest save_total_limit steps (one step more than the Trainer keeps: huggingface.md)
    assert fastckpt.steps(root) == [3, 6, 8]
    assert set(kept_by_trainer) <= set(fastckpt.steps(root))
    # the best saved step is saved with each step, and a resume goes on protecting it
    assert fastckpt.read(root, step=8)["best_saved_step"] == 3
    args["max_steps"] = 14  # saves at 9 and 12, evaluations worse than step 4's
    trainer, ckpt, _ = hf_run.make_trainer("gpt2", root=root, **args)
    trainer.add_callback(_metric_callback()())
    trainer.train(resume_from_checkpoint=ckpt.resume(trainer))
    assert fastckpt.steps(root) == [3, 12, 14]


# ------------------------------------------------------------------------------------------
# Before 2026-12-06 (fastckpt/torchtitan.py, CheckpointManager._create_checkpoint_id): in a
# folder switched from torchtitan's own manager, --checkpoint.load_step=N of one of torchtitan's
# own step-N checkpoints fails with FileNotFoundError ("not found at .../step-000000000N"),
# while the default resume (load_step=-1) reads those same checkpoints and torchtitan's own
# manager loads step N. _create_checkpoint_id only maps steps that _find_load_step discovered.
# ------------------------------------------------------------------------------------------

def titan_small_run(rank, world, folder, manager, steps, load_step=-1):
    """A tiny torchtitan run (embedding + linear, AdamW, LR schedule, the per-rank stateful
    dataloader of tests/titan_run.py) checkpointing every 2 steps through ``manager``."""
    from torchtitan.components.checkpointer import CheckpointManager as TitanManager
    from torchtitan.components.dataloader import ParallelAwareDataloader
    from torchtitan.components.optimizer import LRSchedulersContainer, default_adamw

    from fastckpt.torchtitan import CheckpointManager as FastManager
    from tests.titan_run import TokenStream, TrainState
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Embedding(2048, 8), torch.nn.Linear(8, 2048))
    opt_cfg = default_adamw(lr=8e-3)
    opt_cfg.implementation = "for-loop"
    optimizers = opt_cfg.build(model_parts=[m])
    lrs = LRSchedulersContainer.Config(warmup_steps=2, decay_ratio=0.8, decay_type="linear",
                                       min_lr_factor=0.0).build(optimizers=optimizers,
                                                                training_steps=10)
    loader = ParallelAwareDataloader(TokenStream(rank), dp_rank=rank, dp_world_size=world,
                                     batch_size=2)
    state = TrainState()
    cls = FastManager if manager == "fastckpt" else TitanManager
    ckpt = cls.Config(enable=True, folder="checkpoint", interval=2, keep_latest_k=0,
                      last_save_model_only=False, load_step=load_step).build(
        dataloader=loader, model_parts=[m], optimizers=optimizers, lr_schedulers=lrs,
        states={"train_state": state}, sd_adapter=None, base_folder=folder)
    ckpt.load(step=load_step)
    loaded = state.step
    it = iter(loader)
    while state.step < steps:
        state.step += 1
        inputs, labels = next(it)
        optimizers.zero_grad()
        loss = torch.nn.functional.cross_entropy(m(inputs["input"]).flatten(0, 1),
                                                 labels.flatten())
        loss.backward()
        optimizers.step()
        lrs.step()
        ckpt.save(state.step, last_step=False)
    ckpt.maybe_wait_for_saving()
    ckpt.close()
    return {"loaded": loaded, "loader": loader.dataset.index}


def test_torchtitan_load_step_finds_torchtitans_own_checkpoint_in_a_switched_folder(tmp_path):
    pytest.importorskip("torchtitan")
    folder = str(tmp_path)
    run(titan_small_run, 1, folder, "torchtitan", 6, timeout=120)  # step-2, step-4, step-6
    assert {"step-2", "step-4", "step-6"} <= set(os.listdir(os.path.join(folder, "checkpoint")))
    # torchtitan's own manager, on a copy of the folder: load_step=4 loads step-4
    copy = str(tmp_path / "copy")
    shutil.copytree(folder, copy, ignore=shutil.ignore_patterns("copy"))
    ref = run(titan_small_run, 1, copy, "torchtitan", 6, 4, timeout=120)
    assert ref[0]["loaded"] == 4
    # fastckpt's manager, same folder, load_step=4: FileNotFoundError at step-0000000004
    got = run(titan_small_run, 1, folder, "fastckpt", 6, 4, timeout=120)
    assert got[0]["loaded"] == 4


# ------------------------------------------------------------------------------------------
# Before 2026-12-06 (fastckpt/torchtitan.py, CheckpointManager.dcp_load/_is_fastckpt_step, low):
# --checkpoint.load_step=N of a fastckpt step whose save never committed (step-000000000N
# without manifest.json, a crash mid-save) is handed to torchtitan's own DCP reader, which fails
# with "No such file or directory: .../step-0000000004/.metadata": the error does not say the
# step was never committed (fastckpt's own names are never DCP FileSystemWriter dirs).
# ------------------------------------------------------------------------------------------

def test_torchtitan_load_step_of_an_uncommitted_step_says_it_never_committed(tmp_path):
    pytest.importorskip("torchtitan")
    folder = str(tmp_path)
    run(titan_small_run, 1, folder, "fastckpt", 4, timeout=120)
    step4 = os.path.join(folder, "checkpoint", "step-0000000004")
    os.remove(os.path.join(step4, "manifest.json"))  # the save of step 4 died before its commit
    with pytest.raises(AssertionError) as e:
        run(titan_small_run, 1, folder, "fastckpt", 4, 4, timeout=120)
    msg = str(e.value)
    assert ".metadata" not in msg, msg[-600:]  # read by torchtitan's DCP reader instead
    assert "commit" in msg or "manifest" in msg, msg[-600:]


# ------------------------------------------------------------------------------------------
# Before 2026-12-06 (fastckpt/torchtitan.py, CheckpointManager._find_load_step and load): the
# resume's step discovery took any StorageError for "no folder yet" and returned -1 (a job whose
# checkpoint folder gave EIO started again from step 0, its saves beside the committed steps),
# and the discovery and load_step's manifest read ran unbounded on a mount that stops answering.
# ------------------------------------------------------------------------------------------

def _titan_manager(folder):
    """fastckpt's torchtitan manager with only what its step discovery reads (no model: the
    methods under test read the folder and nothing else)."""
    pytest.importorskip("torchtitan")
    from fastckpt.torchtitan import CheckpointManager

    class Bare(CheckpointManager):
        def __del__(self):  # (torchtitan's closes its stager, which this one never built)
            pass
    mgr = object.__new__(Bare)
    mgr.folder, mgr.enable, mgr._dcp_steps = folder, True, {}
    return mgr


def _in_thread(fn, seconds):
    """fn() on a thread: ("raised", error) / ("returned", value), or ("hung", None) when it
    has not ended within ``seconds``."""
    import threading
    out = []

    def body():
        try:
            out.append(("returned", fn()))
        except BaseException as e:  # noqa: BLE001 - the outcome is what is checked
            out.append(("raised", e))
    t = threading.Thread(target=body, daemon=True)
    t.start()
    t.join(seconds)
    return out[0] if out else ("hung", None)


@pytest.mark.parametrize("call", ["discovery", "load_step"])
def test_torchtitan_step_discovery_on_a_hung_mount_is_bounded(tmp_path, monkeypatch, call):
    import fastckpt.torchtitan as ft
    from fastckpt.errors import StorageTimeoutError
    from tests.test_hung_storage import Hung
    root = str(tmp_path / "checkpoint")
    fastckpt.save({"w": torch.ones(4)}, root, step=2)
    st = Hung(root, hang=("manifest",))
    monkeypatch.setattr(ft, "open_storage", lambda folder, **kw: st)
    monkeypatch.setattr(ft, "CALL_S", 1.0)  # (120 s)
    mgr = _titan_manager(root)
    try:
        fn = mgr._find_load_step if call == "discovery" else (lambda: mgr.load(step=2))
        how, got = _in_thread(fn, 10)
    finally:
        st.answers()
    assert st.entered.is_set(), "the simulated hang was not reached"
    assert how == "raised" and isinstance(got, StorageTimeoutError), (how, got)
    assert got.file.endswith("manifest.json") and "did not return" in str(got), got


def test_torchtitan_step_discovery_on_an_unreadable_folder_is_not_a_fresh_start(tmp_path,
                                                                                 monkeypatch):
    import errno

    import fastckpt.torchtitan as ft
    from fastckpt.errors import StorageError
    from fastckpt.storage.base import storage_error
    from fastckpt.storage.local import LocalStorage
    root = str(tmp_path / "checkpoint")
    fastckpt.save({"w": torch.ones(4)}, root, step=2)

    class Eio(LocalStorage):
        def subdirs(self, path):
            raise storage_error(OSError(errno.EIO, "Input/output error"), "listing", path)
    monkeypatch.setattr(ft, "open_storage", lambda folder, **kw: Eio(folder))
    with pytest.raises(StorageError, match="listing") as e:
        _titan_manager(root)._find_load_step()
    assert e.value.file == root
    # (and a folder not created yet is a fresh start, as in torchtitan's own manager)
    monkeypatch.setattr(ft, "open_storage", lambda folder, **kw: LocalStorage(folder))
    assert _titan_manager(str(tmp_path / "none"))._find_load_step() == -1
    assert _titan_manager(root)._find_load_step() == 2
