"""Review of fastckpt.dcp (2026-12-06): a failed dcp.save retried, a tensor in a container
DCP hands over whole, a reused Reader; each test failed on the code it was written against."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fastckpt
import fastckpt.dcp

pytestmark = pytest.mark.filterwarnings("ignore")


def test_a_failed_dcp_save_retried_leaves_no_unreferenced_shards(tmp_path, monkeypatch):
    """A dcp.save whose commit fails (here: the manifest write raises), retried with the same
    Writer and step, commits; the failed attempt's shard files (and its in-flight marker) stay
    in the committed step, named by no manifest, forever: nothing removes them (a replacing
    save removes only what the old *manifest* named; retention and gc remove markers and temp
    files only). Every retry after a failure leaks a full copy of the coordinator's shards.
    DCP's FileSystemWriter writes the same file names again on a retry (no leak)."""
    import fastckpt.dcp as fdcp
    root = str(tmp_path / "run")
    state = {"w": torch.arange(1 << 16, dtype=torch.float32)}
    w = fastckpt.dcp.Writer(root, step=3)
    real = fdcp.publish_checked
    calls = []

    def failing(*a, **k):
        calls.append(1)
        if len(calls) == 1:
            raise OSError(28, "No space left on device (injected)")
        return real(*a, **k)
    monkeypatch.setattr(fdcp, "publish_checked", failing)
    with pytest.raises(BaseException, match="injected"):  # (DCP's CheckpointException)
        dcp.save(state, storage_writer=w)
    dcp.save(state, storage_writer=w)  # the retry
    assert fastckpt.steps(root) == [3]
    import subprocess
    import sys
    subprocess.run([sys.executable, "-m", "fastckpt.cli", "gc", root, "--keep", "1", "--yes",
                    "--grace", "0"], check=True, capture_output=True, timeout=120)
    step_dir = tmp_path / "run" / "step-0000000003"
    import json
    body = json.loads((step_dir / "manifest.json").read_text())["body"]
    extra = sorted(set(os.listdir(step_dir)) - set(body["files"]) - {"manifest.json"})
    assert extra == [], f"left in the committed step: {extra}"


def test_a_tensor_in_a_dict_under_flatten_state_dict_false_is_explained(tmp_path):
    """With ``DefaultSavePlanner(flatten_state_dict=False)`` DCP hands a nested dict holding a
    tensor over whole (BYTE_IO). The refusal says "a tensor inside a dict ...: use a list or a
    dict", advice that contradicts itself and does not name the cause (the planner's
    ``flatten_state_dict=False``; DCP's default flattens)."""
    from torch.distributed.checkpoint import DefaultSavePlanner
    with pytest.raises(BaseException, match="tensor inside") as e:  # (CheckpointException)
        dcp.save({"model": {"w": torch.ones(2)}},
                 storage_writer=fastckpt.dcp.Writer(str(tmp_path / "r"), step=1),
                 planner=DefaultSavePlanner(flatten_state_dict=False))
    msg = str(e.value)
    assert "model" in msg
    assert "flatten_state_dict" in msg, msg


def test_a_reused_reader_of_a_root_loads_the_newest_step_when_reset(tmp_path):
    """``Reader(ROOT)`` takes the newest committed step when it is made, and keeps it for the
    loads that follow (DCP calls ``reset`` only with a ``checkpoint_id``: every rank then loads
    the step it found, as ``FileSystemReader`` keeps its path). ``reset()`` or a
    ``checkpoint_id`` of ROOT take the newest step again; before 2026-12-06 ``reset()`` kept
    the old one (a reader reused after it silently loaded an older step)."""
    root = str(tmp_path / "run")
    dcp.save({"w": torch.ones(4)}, storage_writer=fastckpt.dcp.Writer(root, step=5))
    reader = fastckpt.dcp.Reader(root)
    dcp.save({"w": torch.full((4,), 2.0)}, storage_writer=fastckpt.dcp.Writer(root, step=6))
    state = {"w": torch.zeros(4)}
    dcp.load(state, storage_reader=reader)
    assert torch.equal(state["w"], torch.ones(4)), "the step the reader was made with"
    reader.reset()
    dcp.load(state, storage_reader=reader)
    assert torch.equal(state["w"], torch.full((4,), 2.0)), f"loaded {state['w']} (step 5)"
    dcp.save({"w": torch.full((4,), 3.0)}, storage_writer=fastckpt.dcp.Writer(root, step=7))
    dcp.load(state, storage_reader=reader, checkpoint_id=root)
    assert torch.equal(state["w"], torch.full((4,), 3.0))
