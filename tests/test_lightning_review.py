"""Review of fastckpt.lightning (2026-12): each test reproduces a defect and
fails on the code it was written against."""

from __future__ import annotations

import collections
import os
import warnings

import pytest
import torch

pytest.importorskip("lightning")

import torch.distributed.checkpoint as dcp  # noqa: E402
from lightning.pytorch.plugins.io import TorchCheckpointIO  # noqa: E402

import fastckpt  # noqa: E402
import fastckpt.dcp  # noqa: E402
import fastckpt.lightning as fl  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(autouse=True)
def _quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _ck(step: int, value: float) -> dict:
    return {"global_step": step, "state_dict": {"w": torch.full((4,), value)}}


# ------------------------------------------------------------------ CheckpointIO: a linked path

def test_saving_to_a_linked_last_ckpt_does_not_overwrite_the_checkpoint_it_points_to(tmp_path):
    """save_last="link" leaves ``last.ckpt`` as a symlink to a top-k checkpoint. A later plain
    save of ``last.ckpt`` (a resumed run whose first last-save comes before any top-k save in
    that run: ModelCheckpoint's ``_last_checkpoint_saved`` is empty after a resume, so it calls
    ``_save_checkpoint(last.ckpt)``; or ``save_last=True`` in the resumed run) must replace the
    link, as Lightning's own TorchCheckpointIO does, not write into the top-k checkpoint the link
    points to (which then holds another step's weights under its best-k name)."""
    # Lightning's own IO: the link is replaced, the top-k file keeps its step
    own = tmp_path / "own"
    own.mkdir()
    tio = TorchCheckpointIO()
    tio.save_checkpoint(_ck(4, 0.0), own / "epoch=0-step=4.ckpt")
    os.symlink("epoch=0-step=4.ckpt", own / "last.ckpt")
    tio.save_checkpoint(_ck(8, 1.0), own / "last.ckpt")
    assert torch.load(own / "epoch=0-step=4.ckpt")["global_step"] == 4

    d = tmp_path / "fast"
    d.mkdir()
    io = fl.CheckpointIO()
    best = d / "epoch=0-step=4.ckpt"
    io.save_checkpoint(_ck(4, 0.0), best)
    os.symlink("epoch=0-step=4.ckpt", d / "last.ckpt")
    io.save_checkpoint(_ck(8, 1.0), d / "last.ckpt")
    assert io.load_checkpoint(d / "last.ckpt")["global_step"] == 8
    back = io.load_checkpoint(best)
    assert back["global_step"] == 4 and torch.equal(back["state_dict"]["w"], torch.zeros(4)), (
        f"the top-k checkpoint {best.name} now holds step {back['global_step']}")


# ---------------------------------------------------- ModelParallelStrategy: the 'lightning' part

def _mp_strategy(tmp_path):
    import lightning.pytorch as pl

    class M(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(4, 2)

        def configure_model(self):
            pass

    m = M()
    opt = torch.optim.SGD(m.parameters(), lr=1.0)
    s = fl.ModelParallelStrategy()
    s._lightning_module = m
    s.model = m
    s.optimizers = [opt]
    return s, m, opt


def test_model_parallel_resume_keeps_multisteplr_milestones(tmp_path):
    """Under fastckpt.lightning.ModelParallelStrategy everything outside the model and the
    optimizers (the 'lightning' part: schedulers, loops, callbacks) goes through DCP's
    flattening, which turns dict keys into strings. MultiStepLR's ``milestones`` (a Counter
    keyed by int epochs) comes back keyed by '3', '6': the resumed scheduler never decays the
    learning rate again (``last_epoch not in milestones``), silently. Lightning's own
    ModelParallelStrategy pickles this part to meta.pt and keeps the int keys."""
    s, m, opt = _mp_strategy(tmp_path)
    sched = torch.optim.lr_scheduler.MultiStepLR(opt, milestones=[3, 6], gamma=0.1)
    sched.step()
    sched.step()  # last_epoch 2: the next step reaches milestone 3
    ck = {"global_step": 2, "state_dict": m.state_dict(), "optimizer_states": [],
          "lr_schedulers": [sched.state_dict()]}
    s.save_checkpoint(ck, tmp_path / "x.ckpt")
    back = s.load_checkpoint(tmp_path / "x.ckpt")
    # resume the schedule as Lightning does (scheduler.load_state_dict), then step once
    opt2 = torch.optim.SGD(torch.nn.Linear(4, 2).parameters(), lr=1.0)
    sched2 = torch.optim.lr_scheduler.MultiStepLR(opt2, milestones=[3, 6], gamma=0.1)
    sched2.load_state_dict(back["lr_schedulers"][0])
    sched.step()
    sched2.step()
    assert sched.get_last_lr() == pytest.approx([0.1])
    assert sched2.get_last_lr() == pytest.approx(sched.get_last_lr()), (
        f"milestones after resume: {sched2.milestones!r}")


def test_model_parallel_resume_keeps_a_callbacks_empty_dict(tmp_path):
    """The same flattening drops an empty dict inside a dict (no leaf, no key path): a
    callback whose state holds ``{"seen": {}}`` gets ``{}`` back, and its
    ``load_state_dict(state["seen"])`` fails with a KeyError on resume (CheckpointIO and
    Lightning's own strategy give the key back)."""
    s, m, _ = _mp_strategy(tmp_path)
    cb = {"Counter{}": {"seen": {}, "n": 0}}
    ck = {"global_step": 1, "state_dict": m.state_dict(), "optimizer_states": [],
          "callbacks": cb}
    s.save_checkpoint(ck, tmp_path / "y.ckpt")
    back = s.load_checkpoint(tmp_path / "y.ckpt")
    assert back["callbacks"] == cb


def test_model_parallel_resume_keeps_keys_tuples_and_empty_containers(tmp_path):
    """The rest of what DCP's flattening changed in the 'lightning' part: keys of every plain
    type (int, float, None, bool, tuple; a str starting with '$'), a dict keyed 0..n-1 (came
    back as a list; refused before 2026-12-06), tuples (a tuple holding a tensor was refused),
    empty dicts, lists and tuples at any depth, NaN. All come back as they were, as through
    CheckpointIO; the dict saved is not changed."""
    s, m, _ = _mp_strategy(tmp_path)
    t = torch.arange(3.0)
    part = {"by_int": {0: "a", 1: "b"}, "by_other": {2.5: 1, None: 2, True: 3, (1, "x"): 4},
            "dollar": {"$tensor": "not a reference", "$dict": [1]},
            "tuples": (1, (t, "x"), ()), "empties": [{}, [], (), {"k": {}}],
            "nested": [{"a": {}}, {0: [t, {}]}], "nan": float("nan"), "t": t}
    ck = {"global_step": 1, "state_dict": m.state_dict(), "optimizer_states": [],
          "callbacks": part}
    before = repr(ck)
    s.save_checkpoint(ck, tmp_path / "z.ckpt")
    assert repr(ck) == before
    back = s.load_checkpoint(tmp_path / "z.ckpt")["callbacks"]
    via_io = fl.CheckpointIO()
    via_io.save_checkpoint(ck, tmp_path / "io.ckpt")
    for got in (back, via_io.load_checkpoint(tmp_path / "io.ckpt")["callbacks"]):
        assert torch.equal(got.pop("t"), t) and got.pop("nan") != got.pop("nan", 0)
        assert torch.equal(got["tuples"][1][0], t) and torch.equal(got["nested"][1][0][0], t)
        want = {k: v for k, v in part.items() if k not in ("t", "nan")}
        assert _canon(got) == _canon(want), got  # (key order aside: DCP plans tensors first)


def _canon(x):
    if isinstance(x, dict):
        return sorted((repr(k), type(k).__name__, _canon(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return (type(x).__name__, [_canon(v) for v in x])
    return repr(x)


# ---------------------------------------------------------------------------- fastckpt.dcp.Writer

def test_model_parallel_load_of_a_checkpointio_checkpoint_is_not_silently_partial(tmp_path):
    """A checkpoint written by fastckpt.lightning.CheckpointIO (single device / DDP: the
    Lightning dict saved whole, no 'lightning' key) resumed under
    fastckpt.lightning.ModelParallelStrategy (a run moved from DDP to FSDP2; Lightning's own
    ModelParallelStrategy loads a DDP checkpoint with its optimizer states and loops): the
    weights are loaded, the optimizer state is not, and the dict returned is ``{}``, with no
    error. Lightning then fails in ``_pl_migrate_checkpoint`` with ``KeyError:
    'pytorch-lightning_version'``, which names nothing of the cause."""
    import lightning.pytorch as pl
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint
    s, m, _ = _mp_strategy(tmp_path)
    opt = torch.optim.Adam(m.parameters())
    s.optimizers = [opt]
    src, _, _ = _mp_strategy(tmp_path)
    src_opt = torch.optim.Adam(src.model.parameters())
    src.model.net(torch.randn(3, 4)).sum().backward()
    src_opt.step()
    ck = {"global_step": 7, "epoch": 1, "pytorch-lightning_version": pl.__version__,
          "state_dict": src.model.state_dict(), "optimizer_states": [src_opt.state_dict()],
          "lr_schedulers": [], "loops": {"fit_loop": {"state_dict": {"x": 1}}}}
    fl.CheckpointIO().save_checkpoint(ck, tmp_path / "ddp.ckpt")
    back = s.load_checkpoint(tmp_path / "ddp.ckpt")  # loaded as Lightning's own strategy does
    assert torch.equal(m.net.weight, src.model.net.weight)  # the weights did load
    _pl_migrate_checkpoint(back, str(tmp_path / "ddp.ckpt"))  # what Lightning does next
    assert back.get("global_step") == 7 and len(opt.state) == 2, (back, len(opt.state))
    assert back["loops"] == ck["loops"] and "state_dict" not in back
    for p, q in zip(m.parameters(), src.model.parameters()):  # the Adam moments, by parameter
        for k in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][k], src_opt.state[q][k]), k
    # a run whose optimizers differ from the checkpoint's is refused, naming both counts
    s.optimizers = [opt, torch.optim.SGD(m.parameters(), lr=0.1)]
    with pytest.raises(fastckpt.FastCkptError, match="CheckpointIO.*1 optimizer.*2 optimizer"):
        s.load_checkpoint(tmp_path / "ddp.ckpt")


# --------------------------------------------------------- LightningModule.load_from_checkpoint

def test_load_from_checkpoint_of_a_reported_path(tmp_path):
    """``MyModel.load_from_checkpoint(trainer.checkpoint_callback.best_model_path)`` (the usual
    way to use a Lightning checkpoint after training) reads the path with ``torch.load``, not
    through the CheckpointIO: with fastckpt every reported path is a directory and it fails with
    ``IsADirectoryError``. Neither docs/integrations/lightning.md nor the plugin says so or
    offers a replacement."""
    import lightning.pytorch as pl
    from tests.lightning_models import Tiny
    m = Tiny()
    ck = {"global_step": 3, "state_dict": m.state_dict(), "hyper_parameters": dict(m.hparams),
          "pytorch-lightning_version": pl.__version__}
    ck["hyper_parameters"]["dropout"] = 0.25
    fl.CheckpointIO().save_checkpoint(ck, tmp_path / "e.ckpt")
    with pytest.raises(IsADirectoryError):  # Lightning's own cannot read a fastckpt path
        Tiny.load_from_checkpoint(tmp_path / "e.ckpt")
    # the replacement the plugin offers (the old plugin had none: AttributeError)
    back = fl.load_from_checkpoint(Tiny, tmp_path / "e.ckpt", lr=0.5)
    assert type(back) is Tiny and torch.equal(back.net[0].weight, m.net[0].weight)
    assert back.hparams.dropout == 0.25 and back.hparams.lr == 0.5  # saved; overridden
    assert m.hparams.lr == 0.05  # (the model it was saved from is not changed)
    with pytest.raises(fastckpt.FastCkptError, match="no Lightning checkpoint"):
        fl.load_from_checkpoint(Tiny, _plain(tmp_path))


def _plain(tmp_path):
    fl.CheckpointIO().save_checkpoint({"global_step": 1, "w": torch.ones(2)}, tmp_path / "p")
    return tmp_path / "p"


# ---------------------------------------------------------------------------- fastckpt.dcp.Reader
