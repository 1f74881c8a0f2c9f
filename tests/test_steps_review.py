"""The step commands (fastckpt/cli/steps.py), review of 2026-12-07: regression tests, each
written to fail on the code before its fix.

1. ``fastckpt verify`` of a clean step printed "step N: 0 PROBLEM(S) in ..." after its "OK"
   line (a for-else: the problems' header ran whenever the notes' loop ended);
2. ``fastckpt gc --grace nan --yes`` removed a save in flight (its in-flight marker 0 s old):
   every "younger than --grace" comparison is False with NaN; ``ls --grace nan`` showed it as
   an abandoned "partial" step. A --grace that is not a number >= 0 is now a usage error
   (exit 2), as a negative one;
3. ``fastckpt inspect`` (text and --json) of a valid step whose plain value is a list or
   tuple holding a dict with a tuple key (``[({(1, 2): 3},)]``) ended in a traceback, exit 70
   ("keys must be str ..."): the value was handed to json.dumps as decoded;
4. ``fastckpt resume ROOT --verify`` of a step only the remote tier holds wrote its
   ``.verified-<save_id>`` record into the remote tier, whose URL comes from the root's
   ``.tiers.json`` (untrusted): the tools only read there (``verify`` records nothing there).
"""

from __future__ import annotations

import os

import pytest
import torch

import fastckpt
from fastckpt.manifest.discovery import marker_doc, marker_name
from tests.clirun import call
from tests.s3fixtures import s3, s3_server  # noqa: F401


def test_verify_of_a_clean_step_reports_no_problems(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    fastckpt.save({"w": torch.arange(10.0), "step": 3}, root, step=3)
    code, out, err = call("verify", root, capsys=capsys)
    assert code == 0, (out, err)
    assert "step 3: OK" in out
    assert "PROBLEM" not in out + err, out


def test_verify_of_a_damaged_step_still_lists_its_problems(tmp_path, capsys):
    root = str(tmp_path / "ckpt")
    fastckpt.save({"w": torch.arange(10.0), "step": 3}, root, step=3)
    d = os.path.join(root, "step-0000000003")
    (shard,) = [n for n in os.listdir(d) if n.endswith(".fck")]
    with open(os.path.join(d, shard), "r+b") as f:
        f.write(b"\xff" * 8)
    code, out, err = call("verify", root, capsys=capsys)
    assert code == 1, (out, err)
    assert "step 3: 1 PROBLEM(S)" in out and "OK" not in out, out


def _save_in_flight(root: str) -> str:
    """Steps 1 and 2 committed, step 3 being written now (its marker and a shard, 0 s old)."""
    for s in (1, 2):
        fastckpt.save({"w": torch.ones(4) * s}, root, step=s)
    d = os.path.join(root, "step-0000000003")
    os.makedirs(d)
    with open(os.path.join(d, marker_name("abcdef123456")), "wb") as f:
        f.write(marker_doc("abcdef123456", host="h", pid=os.getpid()))
    with open(os.path.join(d, "r00000-abcdef123456-000.fck"), "wb") as f:
        f.write(bytes(10))
    return d


@pytest.mark.parametrize("grace", ["nan", "-1"])
@pytest.mark.parametrize("cmd", [["gc", "--yes"], ["ls"]])
def test_a_grace_that_is_not_a_number_of_seconds_is_a_usage_error(tmp_path, capsys, grace,
                                                                   cmd):
    root = str(tmp_path / "ckpt")
    d = _save_in_flight(root)
    code, out, err = call(cmd[0], root, "--grace", grace, *cmd[1:], capsys=capsys)
    assert code == 2, (out, err)
    assert "--grace" in err
    assert os.path.isdir(d) and len(os.listdir(d)) == 2  # the save in flight is untouched
    code, out, err = call("gc", root, "--yes", capsys=capsys)  # the default grace: kept
    assert code == 0 and os.path.isdir(d), (out, err)


@pytest.mark.parametrize("as_json", [False, True])
def test_inspect_shows_plain_values_whose_dicts_have_tuple_keys(tmp_path, capsys, as_json):
    root = str(tmp_path / "ckpt")
    fastckpt.save({"w": torch.ones(2), "x": [({(1, 2): 3},)], "y": ({4: "a"},)}, root, step=1)
    code, out, err = call("inspect", root, *(["--json"] if as_json else []), capsys=capsys)
    assert code == 0, (out, err)
    if as_json:
        import json
        doc = json.loads(out)
        assert doc["plain_values"]["x"] == [[{"(1, 2)": 3}]]
    else:
        assert 'x = [[{"(1, 2)": 3}]]' in out, out


def test_resume_verify_of_a_remote_tier_step_writes_nothing_there(tmp_path, s3, capsys):
    import json
    import shutil
    local, url = str(tmp_path / "cli"), s3.url("cli")
    opts = dict(s3.storage_options, skip_instance_cache=True)
    with fastckpt.Checkpointer(local, remote=url, storage_options=opts) as ck:
        ck.save({"w": torch.arange(64.0), "step": 1}, step=1, block=True).wait_remote(timeout=60)
    shutil.rmtree(os.path.join(local, "step-0000000001"))  # only the remote tier has it
    code, out, err = call("resume", local, "--verify", "--json", capsys=capsys)
    doc = json.loads(out)
    assert code == 0 and doc["tier"] == "remote" and doc["step"] == 1, (out, err)
    assert doc["verified"] is True
    assert not [k for k in s3.keys("cli") if ".verified-" in k]  # nothing written there


def test_json_output_is_strict_json_with_values_that_are_not_finite(tmp_path, capsys):
    """``inspect --json`` of a state holding ``best_loss=inf`` and a NaN printed bare
    ``Infinity``/``NaN``, which strict JSON parsers (jq --strict, Go, JavaScript) refuse:
    they are the strings "inf" and "nan" now."""
    import json
    root = str(tmp_path / "ckpt")
    fastckpt.save({"w": torch.ones(2), "best_loss": float("inf"), "seen": [float("nan")]},
                  root, step=1)
    code, out, err = call("inspect", root, "--json", capsys=capsys)
    assert code == 0, (out, err)

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")
    doc = json.loads(out, parse_constant=refuse)
    assert doc["plain_values"]["best_loss"] == "inf" and doc["plain_values"]["seen"] == ["nan"]
