"""What a new user hit on a fresh clone (issue 11's rough edges): mistyped roots, a step
directory given as the root, "verified" after a clean verify, an unsupported state, inspect's
filter and one wording for a missing step."""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastckpt
from fastckpt.manifest import schema as fmt
from tests.clirun import call


@pytest.fixture
def saved(tmp_path):
    root = str(tmp_path / "run")
    for s in (1, 2):
        fastckpt.save({"model": {"w": torch.ones(4) * s}, "opt": {"lr": 0.1}, "step": s}, root,
                      step=s)
    return root


@pytest.mark.parametrize("cmd", [["ls"], ["gc", "--keep", "1"]])
def test_a_mistyped_root_is_not_an_empty_one(tmp_path, capsys, cmd):
    missing = str(tmp_path / "no-such-run")
    rc, out, err = call(cmd[0], missing, *cmd[1:], capsys=capsys)
    assert rc == 3 and "does not exist" in err and out == ""
    os.makedirs(missing)  # an existing empty root is simply empty
    rc, out, err = call(cmd[0], missing, *cmd[1:], capsys=capsys)
    assert rc == 0


def test_load_from_a_missing_root_says_so(tmp_path):
    with pytest.raises(fastckpt.CheckpointNotFoundError, match="does not exist"):
        fastckpt.load({"w": torch.zeros(4)}, str(tmp_path / "nothing-here"))


@pytest.mark.parametrize("cmd", [["ls"], ["gc", "--keep", "1"], ["resume"], ["verify"],
                                 ["inspect"]])
def test_a_step_directory_given_as_root(saved, capsys, cmd):
    step_dir = os.path.join(saved, fmt.step_dirname(2))
    rc, out, err = call(cmd[0], step_dir, *cmd[1:], capsys=capsys)
    # a usage error, not "no checkpoint, start fresh" (exit 3) that would restart a job at 0
    assert rc == 2 and "step directory" in err and saved in err


def test_load_of_a_step_directory_names_the_parent(saved):
    with pytest.raises(fastckpt.CheckpointNotFoundError, match="give its parent"):
        fastckpt.load({}, os.path.join(saved, fmt.step_dirname(2)), strict=False)


def test_resume_json_says_verified_after_a_clean_verify(saved, capsys):
    rc, out, _ = call("resume", saved, "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["verified"] is False
    assert call("verify", saved, capsys=capsys)[0] == 0
    rc, out, _ = call("resume", saved, "--json", capsys=capsys)
    doc = json.loads(out)
    assert doc["verified"] is True and doc["verified_unix"] > 0
    # a record of another save of the step vouches for nothing
    d = os.path.join(saved, fmt.step_dirname(2))
    rec = next(n for n in os.listdir(d) if n.startswith(".verified-"))
    os.rename(os.path.join(d, rec), os.path.join(d, ".verified-0123456789ab"))
    rc, out, _ = call("resume", saved, "--json", capsys=capsys)
    assert json.loads(out)["verified"] is False


def test_an_unsupported_state_leaves_no_root(tmp_path):
    root = str(tmp_path / "never")
    with pytest.raises(fastckpt.UnsupportedStateError):
        fastckpt.save({"w": torch.ones(2), "bad": object()}, root, step=1)
    assert not os.path.exists(root)


def test_inspect_filter_applies_to_plain_values(saved, capsys):
    rc, out, _ = call("inspect", saved, "--filter", "model.*", "--json", capsys=capsys)
    doc = json.loads(out)
    assert [t["name"] for t in doc["tensors"]] == ["model.w"] and doc["plain_values"] == {}
    rc, out, _ = call("inspect", saved, "--filter", "opt.*", capsys=capsys)
    assert "opt.lr = 0.1" in out and "step =" not in out


def test_inspect_and_verify_word_a_missing_step_alike(saved, capsys):
    rc1, _, err1 = call("inspect", saved, "--step", "7", capsys=capsys)
    rc2, _, err2 = call("verify", saved, "--step", "7", capsys=capsys)
    assert rc1 == rc2 == 3 and err1 == err2 and "step 7 has no committed checkpoint" in err1


def _verify_through(root, wrap):
    from fastckpt.storage.local import LocalStorage
    from fastckpt.testing.faults import FaultyStorage
    from fastckpt.tools.verify import verify_step

    class Hooked(FaultyStorage):
        def read_into(self, path, *a, **kw):
            wrap(self.inner, path)
            return super().read_into(path, *a, **kw)
    return verify_step(Hooked(LocalStorage(root)), record=True)


def test_verify_of_a_step_that_cannot_be_read_is_a_storage_error_not_damage(tmp_path):
    # before 2026-12-06 an unreadable shard (EACCES, EIO, a store timeout) was reported as
    # damage and recorded: `ls` showed FAILED, `resume --verify` refused a sound step
    root = str(tmp_path)
    fastckpt.save({"w": torch.ones(1000)}, root, step=1)

    def fail(inner, path):
        raise fastckpt.StorageError(f"{path}: permission denied (injected)")
    with pytest.raises(fastckpt.StorageError, match="could not be read, nothing found damaged"):
        _verify_through(root, fail)
    d = os.path.join(root, fmt.step_dirname(1))
    assert not [n for n in os.listdir(d) if n.startswith(".verify")]  # nothing recorded


def test_verify_of_a_step_removed_meanwhile_says_so(tmp_path, capsys):
    # the writer retired the step while it was verified: gone, not damaged (before
    # 2026-12-06: "MISSING ... shard file is missing", exit 1)
    from fastckpt.retention import remove_step
    root = str(tmp_path)
    fastckpt.save({"w": torch.ones(1000)}, root, step=1)

    def retire(inner, path):
        remove_step(inner, inner.join(fmt.step_dirname(1)))
    with pytest.raises(fastckpt.StepRemovedError, match="removed or saved again"):
        _verify_through(root, retire)


def test_a_usage_error_with_json_prints_json(tmp_path, capsys):
    # docs/cli.md: every failure with --json prints {"ok": false, ...} (usage errors did not)
    rc, out, _ = call("gc", str(tmp_path), "--keep", "0", "--json", capsys=capsys)
    assert rc == 2 and json.loads(out) == {
        "ok": False, "error": "Invalid value for '--keep': 0 is not in the range x>=1.",
        "exit_code": 2}
