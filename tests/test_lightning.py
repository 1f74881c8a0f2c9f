"""fastckpt.lightning against the real Lightning 2.6 (CPU, tiny models): ModelCheckpoint's
retention on fastckpt roots, bit-exact resume on one device, under DDP (two processes, against
Lightning's own TorchCheckpointIO) and under ModelParallelStrategy (tensor parallel on two
processes), AsyncCheckpointIO, and values that cannot be stored."""

from __future__ import annotations

import copy
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import warnings

import pytest
import torch

pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

import fastckpt  # noqa: E402
import fastckpt.lightning as fl  # noqa: E402
from tests.lightning_models import Final, Tiny, loader, trainer  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
EVERY = 4  # one epoch: checkpoints at epoch ends, where Lightning resumes a DataLoader exactly

pytestmark = pytest.mark.filterwarnings("ignore")


def same(a, b) -> bool:
    """Bit-exact equality of nested states (tensors: dtype, shape and every bit)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def run(dirpath, max_steps, *, io=None, ckpt_path=None, rng=True):
    """Train Tiny from seed 0 with ModelCheckpoint(save_top_k=2, save_last=True, every 4 steps)."""
    import lightning.pytorch as pl
    pl.seed_everything(0, verbose=False)
    model, fin = Tiny(), Final()
    mc = ModelCheckpoint(dirpath=dirpath, save_top_k=2, monitor="train_loss", save_last=True,
                         every_n_train_steps=EVERY)
    callbacks = [mc, fin] + ([fl.RNGCallback()] if rng else [])
    io = fl.CheckpointIO() if io is None else io
    trainer(str(dirpath), max_steps, plugins=[io], callbacks=callbacks).fit(
        model, loader(), ckpt_path=ckpt_path)
    return {"mc": mc, "model": fin.model, "optim": fin.optim, "sched": fin.sched,
            "losses": dict(model.losses)}


def step_of(path: str) -> int:
    return int(os.path.basename(path).split("step=")[1].split(".")[0].split("-")[0])


def check_retention(r, dirpath, max_steps):
    """On disk: exactly the two best saved steps and last.ckpt, each a root of one step."""
    losses = r["losses"]
    saved = range(EVERY, max_steps + 1, EVERY)  # monitored: the loss logged before the save
    best = sorted(saved, key=lambda s: losses[s - 1].item())[:2]
    mc = r["mc"]
    assert sorted(step_of(p) for p in mc.best_k_models) == sorted(best)
    kept = {os.path.basename(p) for p in mc.best_k_models} | {"last.ckpt"}
    assert set(os.listdir(dirpath)) == kept
    for p in mc.best_k_models:
        assert fastckpt.steps(p) == [step_of(p)]
    assert fastckpt.steps(os.path.join(dirpath, "last.ckpt")) == [max_steps]
    assert mc.last_model_path == os.path.join(str(dirpath), "last.ckpt")


def check_resumed(resumed, full, start):
    assert sorted(resumed["losses"]) == list(range(start, 12))
    assert same(resumed["losses"], {s: full["losses"][s] for s in range(start, 12)})
    assert same(resumed["model"], full["model"])
    assert same(resumed["optim"], full["optim"])
    assert same(resumed["sched"], full["sched"])


@pytest.fixture(scope="module")
def full(tmp_path_factory):
    """12 steps uninterrupted; checkpoints at 4, 8 and 12."""
    d = tmp_path_factory.mktemp("full")
    return run(d, 12), d


@pytest.fixture(scope="module")
def part(tmp_path_factory):
    """The same run stopped after 8 steps."""
    d = tmp_path_factory.mktemp("part")
    return run(d, 8), d


def test_single_device_retention(full, part):
    """save_top_k=2 + save_last map onto roots: dropped top-k paths are deleted, last.ckpt keeps
    one step (the newest), and nothing else is left under dirpath."""
    check_retention(*full, 12)
    check_retention(*part, 8)


def test_single_device_resume_from_reported_paths_is_bit_exact(full, part, tmp_path):
    """Every path ModelCheckpoint reports (best_model_path among them) resumes to the exact
    weights, Adam moments, LR schedule and loss sequence of the uninterrupted run (dropout
    and shuffling included: RNGCallback)."""
    r, _ = part
    paths = sorted(r["mc"].best_k_models)
    assert r["mc"].best_model_path in paths and len(paths) == 2
    for i, p in enumerate(paths):
        check_resumed(run(tmp_path / f"r{i}", 12, ckpt_path=p), full[0], step_of(p))


def test_single_device_resume_last(full, part, tmp_path):
    """ckpt_path="last" finds last.ckpt (a directory) like a file."""
    d = tmp_path / "copy"
    shutil.copytree(part[1], d)
    check_resumed(run(d, 12, ckpt_path="last"), full[0], 8)


def test_random_generators_matter(full, part, tmp_path):
    """The control: the same resume without RNGCallback does not reproduce the run, so the
    bit-exact checks above would catch generators that are not restored."""
    resumed = run(tmp_path / "x", 12, ckpt_path=os.path.join(part[1], "last.ckpt"), rng=False)
    assert not same(resumed["losses"], {s: full[0]["losses"][s] for s in range(8, 12)})


def test_async_checkpoint_io_resume_is_bit_exact(full, tmp_path):
    """AsyncCheckpointIO(fastckpt CheckpointIO): saves in its thread, same retention, and the
    resume from last.ckpt is bit-exact."""
    d = tmp_path / "async"
    r = run(d, 8, io=AsyncCheckpointIO(fl.CheckpointIO()))
    check_retention(r, d, 8)
    check_resumed(run(d, 12, io=AsyncCheckpointIO(fl.CheckpointIO()), ckpt_path="last"),
                  full[0], 8)


# ------------------------------------------------------------------------------------ two ranks

def launch(mode: str, out) -> list[dict]:
    """tests/lightning_ddp_script.py on two CPU processes (Lightning's own launcher starts
    rank 1); killed with everything it started if it runs past 300 s."""
    env = dict(os.environ, FASTCKPT_PLAN_TIMEOUT_S="20", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([os.path.dirname(HERE), os.environ.get(
                   "PYTHONPATH", "")]))
    env.pop("LOCAL_RANK", None)
    proc = subprocess.Popen([sys.executable, os.path.join(HERE, "lightning_ddp_script.py"),
                             mode, str(out)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{mode} run did not finish within 300 s:\n{log[-4000:]}")
    assert proc.returncode == 0, log[-6000:]
    return [torch.load(out / f"result-{mode}-{r}.pt", weights_only=False) for r in (0, 1)]


def test_ddp_resume_matches_lightnings_own_and_rank0_saves_alone(tmp_path):
    """strategy="ddp", two processes: Lightning calls save_checkpoint on rank 0 only and the
    saves complete (rank-local mode); a resume from a reported path equals the same resume
    through Lightning's TorchCheckpointIO and the uninterrupted run, on each rank, bit for bit.
    The regression: a collective save called by rank 0 alone (fastckpt's default, what a
    CheckpointIO without collective=False would do) fails naming rank 1 instead of waiting."""
    results = launch("ddp", tmp_path)
    assert [r["rank"] for r in results] == [0, 1]
    assert results[0]["saves"] == 8 and results[1]["saves"] == 0  # 3 + 1 save points x 2 paths
    for r in results:
        assert same(r["fast_full"]["losses"], r["torch_full"]["losses"])
        for key in ("model", "optim", "sched", "losses"):
            assert same(r["fast_resumed"][key], r["torch_resumed"][key]), key
        assert same(r["fast_resumed"]["model"], r["fast_full"]["model"])
        assert same(r["fast_resumed"]["optim"], r["fast_full"]["optim"])
        assert r["fast_full"]["names"] == r["torch_full"]["names"]
    assert not same(results[0]["fast_full"]["losses"], results[1]["fast_full"]["losses"])
    for name in results[0]["fast_full"]["names"]:
        p = tmp_path / "fast" / name
        assert p.is_dir() and fastckpt.steps(p) == [6 if name == "last.ckpt" else step_of(name)]
    assert results[0]["collective"]["missing"] == [1], results[0]["collective"]


def test_model_parallel_strategy_resume_is_bit_exact(tmp_path):
    """fastckpt.lightning.ModelParallelStrategy on two CPU processes, tensor parallel and then
    FSDP2: every rank writes its shards through fastckpt.dcp.Writer into one fastckpt step per
    path; the resume from a reported path loads through the engine (DCP's planner) and matches
    the uninterrupted run (weights, Adam moments, schedule, losses); the checkpoint dicts
    Lightning handed over were not changed."""
    import json
    results = launch("mp", tmp_path)
    for r in results:
        assert r["changed"] == []
        for kind in ("tp", "fsdp"):
            f, z = r[f"{kind}_full"], r[f"{kind}_resumed"]
            for key in ("model", "optim", "sched"):
                assert same(z[key], f[key]), (kind, key)
            assert same(dict(z["losses"]), {s: dict(f["losses"])[s] for s in (4, 5)}), kind
    assert not same(results[0]["fsdp_full"]["losses"], results[1]["fsdp_full"]["losses"])
    assert results[0]["tp_full"]["names"] == ["epoch=0-step=2.ckpt", "epoch=0-step=4.ckpt",
                                              "epoch=1-step=6.ckpt", "last.ckpt"]
    for kind in ("tp", "fsdp"):
        last = tmp_path / kind / "last.ckpt"
        assert fastckpt.steps(last) == [6]
        body = json.loads((last / "step-0000000006" / "manifest.json").read_text())["body"]
        assert body["world_size"] == 2 and {f["rank"] for f in body["files"].values()} == {0, 1}


# --------------------------------------------------------------------------- values, mapping

class Thing:
    """An object fastckpt cannot store (it is never pickled)."""


def test_unstorable_hyperparameter_names_key_in_a_real_fit(tmp_path):
    import lightning.pytorch as pl
    pl.seed_everything(0, verbose=False)
    mc = ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=2)
    t = trainer(str(tmp_path), 4, plugins=[fl.CheckpointIO()], callbacks=[mc])
    with pytest.raises(fastckpt.UnsupportedStateError, match="hyper_parameters.extra") as e:
        t.fit(Tiny(extra=Thing()), loader())
    assert e.value.key == "hyper_parameters.extra" and "save_hyperparameters(ignore" in str(e.value)
    assert not (tmp_path / "ck").exists() or os.listdir(tmp_path / "ck") == []


def _checkpoint(step: int) -> dict:
    import lightning.pytorch as pl
    pl.seed_everything(step, verbose=False)
    m = Tiny()
    opt = torch.optim.Adam(m.parameters())
    m.net(torch.randn(2, 8)).sum().backward()
    opt.step()
    return {"global_step": step, "state_dict": m.state_dict(), "optimizer_states": [
        opt.state_dict()], "hyper_parameters": copy.copy(m.hparams), "loops": {"a": (1, 2.5)},
        "callbacks": {"X{'k': None}": {"score": torch.tensor(float("inf")),
                                       "paths": {"/d/e=1.ckpt": torch.tensor(1.0)}}}}


def test_failed_save_changes_nothing_and_keeps_the_committed_step(tmp_path):
    """A value that cannot be stored: UnsupportedStateError naming the key, the dict passed in
    untouched (same containers, same tensors, same values), the path's committed checkpoint
    still the one it was."""
    io = fl.CheckpointIO()
    path = tmp_path / "x.ckpt"
    good = _checkpoint(4)
    io.save_checkpoint(good, path)
    bad = _checkpoint(8)
    bad["hyper_parameters"]["extra"] = Thing()
    ids = {k: id(v) for k, v in bad.items()}
    snapshot = copy.deepcopy(bad)
    with pytest.raises(fastckpt.UnsupportedStateError, match="hyper_parameters.extra"):
        io.save_checkpoint(bad, path)
    assert {k: id(v) for k, v in bad.items()} == ids and type(bad["hyper_parameters"]) is type(
        snapshot["hyper_parameters"])
    extra = bad["hyper_parameters"].pop("extra")
    assert isinstance(extra, Thing)
    snapshot["hyper_parameters"].pop("extra")
    assert same(dict(bad["state_dict"]), dict(snapshot["state_dict"]))
    assert same(bad["optimizer_states"], snapshot["optimizer_states"])
    assert same(bad["callbacks"], snapshot["callbacks"]) and bad["loops"] == snapshot["loops"]
    assert fastckpt.steps(path) == [4]
    back = io.load_checkpoint(path)
    assert back["global_step"] == 4 and same(back["state_dict"], dict(good["state_dict"]))
    assert same(back["optimizer_states"], good["optimizer_states"])
    assert same(back["callbacks"], good["callbacks"]) and back["loops"] == {"a": (1, 2.5)}
    assert back["hyper_parameters"] == dict(good["hyper_parameters"])


def test_convert_is_explicit(tmp_path):
    io = fl.CheckpointIO(convert=lambda key, v: f"<{type(v).__name__} at {key}>")
    ck = _checkpoint(1)
    ck["hyper_parameters"]["extra"] = Thing()
    io.save_checkpoint(ck, tmp_path / "c.ckpt")
    assert isinstance(ck["hyper_parameters"]["extra"], Thing)
    back = io.load_checkpoint(tmp_path / "c.ckpt")
    assert back["hyper_parameters"]["extra"] == "<Thing at hyper_parameters.extra>"


def test_path_holds_one_step_and_removal(tmp_path):
    io = fl.CheckpointIO()
    p = tmp_path / "last.ckpt"
    io.save_checkpoint(_checkpoint(12), p)
    io.save_checkpoint(_checkpoint(3), p)  # a smaller step (a new run) replaces it too
    assert fastckpt.steps(p) == [3] and io.load_checkpoint(p)["global_step"] == 3
    io.save_checkpoint({"w": torch.ones(2)}, tmp_path / "plain.ckpt")  # no global_step: step 0
    assert fastckpt.steps(tmp_path / "plain.ckpt") == [0]
    io.remove_checkpoint(p)
    assert not p.exists()
    with pytest.raises(FileNotFoundError):
        io.load_checkpoint(p)
    f = tmp_path / "torch.ckpt"
    f.write_bytes(b"not ours")
    with pytest.raises(fastckpt.FastCkptError, match="is a file"):
        io.save_checkpoint(_checkpoint(1), f)
    assert f.read_bytes() == b"not ours"
    with pytest.raises(TypeError):
        io.save_checkpoint(_checkpoint(1), tmp_path / "y", storage_options={"a": 1})
    with pytest.raises(ValueError, match="keep_last"):
        fl.CheckpointIO(keep_last=2)


def test_removal_waits_for_a_save_of_the_same_path(tmp_path):
    """(AsyncCheckpointIO) a removal never runs under a save of the same path."""
    io = fl.CheckpointIO()
    p = str(tmp_path / "a.ckpt")
    io.save_checkpoint(_checkpoint(1), p)
    release, removed = threading.Event(), threading.Event()

    def saving():
        with io._in_flight(os.path.abspath(p)):
            release.wait(60)

    def removing():
        io.remove_checkpoint(p)
        removed.set()
    ts = [threading.Thread(target=saving), threading.Thread(target=removing)]
    ts[0].start()
    while not io._saving:
        time.sleep(0.001)
    ts[1].start()
    assert not removed.wait(0.5) and os.path.isdir(p)
    release.set()
    for t in ts:
        t.join(60)
    assert removed.is_set() and not os.path.exists(p)


def test_import_fastckpt_does_not_import_lightning():
    code = "import sys, fastckpt; assert 'lightning' not in sys.modules, 'imported'"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.dirname(HERE),
                   timeout=60)


def test_rng_callback_other_world_size_warns():
    cb = fl.RNGCallback()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        cb.load_state_dict({"world_size": 2, "ranks": [{}, {}]})
    assert any("2 ranks" in str(x.message) for x in w)
