"""torchtitan 0.3.0 checkpointing through ``fastckpt.torchtitan.CheckpointManager``: a 2-rank
FSDP2 run stopped after a save resumes bit-exact against the uninterrupted run (see
tests/titan_run.py for what is torchtitan's own and what the test builds)."""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastckpt
from fastckpt.manifest import schema as fmt
from fastckpt.tools.verify import verify_step
from tests.clirun import call
from tests.distributed import run
from tests.models import assert_same

pytest.importorskip("torchtitan")
from tests.titan_run import train  # noqa: E402

STEPS = 6


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("titan_full"))
    return run(train, 2, folder, STEPS, None, "fastckpt", timeout=300)


def _check_resumed(first, second, uninterrupted, stopped_at):
    for rank in range(2):
        assert second[rank]["loaded"] == stopped_at
        assert sorted(second[rank]["losses"]) == list(range(stopped_at + 1, STEPS + 1))
        for s, loss in second[rank]["losses"].items():
            assert loss == uninterrupted[rank]["losses"][s], s
        for s, loss in first[rank]["losses"].items():
            assert loss == uninterrupted[rank]["losses"][s], s
        assert_same(uninterrupted[rank]["state"], second[rank]["state"])
        # each rank's dataloader went on from its own position
        assert second[rank]["loader"] == uninterrupted[rank]["loader"]


@pytest.mark.parametrize("async_mode", ["disabled", "async"])
def test_stop_and_resume_bit_exact(tmp_path, uninterrupted, async_mode):
    folder = str(tmp_path)
    first = run(train, 2, folder, STEPS, 4, "fastckpt", async_mode, timeout=300)
    root = os.path.join(folder, "checkpoint")
    assert fastckpt.steps(root) == [2, 4]  # interval 2, keep_latest_k 2
    assert verify_step(root, 4, record=False).ok
    path = os.path.join(root, "step-0000000004", "manifest.json")
    body = fmt.decode_manifest(open(path, "rb").read(), file=path)
    # the dataloader's per-rank state is plain data (torchtitan pickles it; fastckpt does not)
    plain = json.dumps(body["tree"])
    assert "dp_rank_0" in plain and "dp_rank_1" in plain and "fastckpt-json:" in plain
    assert "wq.weight" in plain  # the fused QKV saved under torchtitan's canonical names
    second = run(train, 2, folder, STEPS, None, "fastckpt", async_mode, timeout=300)
    _check_resumed(first, second, uninterrupted, 4)
    # the last step's save is torchtitan's _save_last_step, which purges nothing (as its own)
    assert fastckpt.steps(root) == [2, 4, 6]


def test_resumes_from_torchtitans_own_checkpoints(tmp_path, uninterrupted, capsys):
    """A run that switches managers mid-way: torchtitan's own DCP checkpoints resume, and the
    next saves are fastckpt's; the command-line tools read the mixed folder."""
    folder = str(tmp_path)
    first = run(train, 2, folder, STEPS, 4, "torchtitan", timeout=300)
    root = os.path.join(folder, "checkpoint")
    assert os.path.isfile(os.path.join(root, "step-4", ".metadata"))
    second = run(train, 2, folder, STEPS, None, "fastckpt", timeout=300)
    _check_resumed(first, second, uninterrupted, 4)
    assert fastckpt.latest_step(root) == 6
    rc, out, err = call("resume", root, "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["step"] == 6, (out, err)


def test_keep_latest_k_counts_torchtitans_own_steps_of_a_switched_run(tmp_path):
    """The purge after a save keeps the newest ``keep_latest_k`` steps of both kinds, and
    removes torchtitan's own older ``step-N`` directories (before 2026-12-06 they stayed for
    good: retention knew only fastckpt's step names)."""
    from types import SimpleNamespace

    from fastckpt.storage import open_storage
    from fastckpt.torchtitan import CheckpointManager
    root = tmp_path / "checkpoint"
    for n in (2, 4):
        (root / f"step-{n}").mkdir(parents=True)
        (root / f"step-{n}" / ".metadata").write_bytes(b"dcp")
    fastckpt.save({"w": torch.ones(3)}, str(root), step=6)
    manager = SimpleNamespace(keep_latest_k=2, _writing=set())
    purge = CheckpointManager._purge_legacy
    purge(manager, open_storage(str(root)))
    assert sorted(os.listdir(root)) == ["latest", "step-0000000006", "step-4"]
    manager._writing = {4}  # (an upload of it in flight: kept)
    fastckpt.save({"w": torch.ones(3)}, str(root), step=8)
    purge(manager, open_storage(str(root)))
    assert sorted(os.listdir(root)) == ["latest", "step-0000000006", "step-0000000008", "step-4"]
    manager._writing = set()
    purge(manager, open_storage(str(root)))
    assert sorted(os.listdir(root)) == ["latest", "step-0000000006", "step-0000000008"]


def test_a_crash_mid_save_leaves_the_previous_step(tmp_path, uninterrupted):
    """A step directory without a manifest (what a save killed mid-write leaves) is not
    resumed from; torchtitan's own manager would take any step-N with a .metadata file."""
    folder = str(tmp_path)
    run(train, 2, folder, STEPS, 4, "fastckpt", timeout=300)
    root = os.path.join(folder, "checkpoint")
    os.remove(os.path.join(root, "step-0000000004", "manifest.json"))
    second = run(train, 2, folder, STEPS, None, "fastckpt", timeout=300)
    assert second[0]["loaded"] == 2
    for rank in range(2):
        for s, loss in second[rank]["losses"].items():
            assert loss == uninterrupted[rank]["losses"][s], s
        assert_same(uninterrupted[rank]["state"], second[rank]["state"])


def test_saving_changes_nothing(tmp_path, uninterrupted):
    """The checkpointed run and a run without checkpoints are the same run, bit for bit."""
    bare = run(train, 2, str(tmp_path), STEPS, None, "none", timeout=300)
    assert not os.path.exists(os.path.join(str(tmp_path), "checkpoint"))
    for rank in range(2):
        assert bare[rank]["losses"] == uninterrupted[rank]["losses"]
        assert_same(bare[rank]["state"], uninterrupted[rank]["state"])


def test_the_documented_config_through_torchtitans_cli():
    """examples/torchtitan_fastckpt.py, parsed by torchtitan's own ConfigManager (what
    ``python -m torchtitan.train --module ... --config ...`` runs) with a --checkpoint flag."""
    import sys

    from torchtitan.config import ConfigManager

    from fastckpt.torchtitan import CheckpointManager
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "examples"))
    try:
        cfg = ConfigManager().parse_args(["--module", "torchtitan_fastckpt", "--config",
                                          "llama3_debugmodel_fastckpt",
                                          "--checkpoint.interval", "7"])
    finally:
        sys.path.pop(0)
    ck = cfg.checkpoint
    assert type(ck) is CheckpointManager.Config and ck._owner is CheckpointManager
    assert (ck.enable, ck.interval, ck.keep_latest_k, ck.async_mode) == (True, 7, 3, "async")
    # the settings of torchtitan's own config are kept
    assert ck.last_save_model_only is False and ck.folder == "checkpoint"
