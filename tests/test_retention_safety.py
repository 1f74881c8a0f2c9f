"""Retention and `fastckpt gc` never remove a loadable step because of a damaged or ambiguous
one (the review of 2026-12-06):

* retention counted a step whose manifest is damaged toward ``keep_last``, and removed the
  loadable step it pushed out;
* a second directory of one step number (``step-00000000005`` beside ``step-0000000005``) made
  `gc` remove the committed step with the partial one;
* `gc --keep` trusted a newest step whose shard files are missing or truncated, and removed
  the older loadable ones.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastckpt
from fastckpt.manifest import schema as fmt
from tests.clirun import call


def _steps(root: str, steps, keep_last=None) -> dict:
    st = {"w": torch.arange(100, dtype=torch.float32)}
    with fastckpt.Checkpointer(root, keep_last=keep_last) as ck:
        for s in steps:
            st["w"].add_(1.0)
            ck.save(st, step=s, block=True)
    return st


def _loads(root: str) -> int:
    got = {"w": torch.zeros(100)}
    return fastckpt.load(got, root)


def test_retention_does_not_count_a_step_whose_manifest_is_damaged(tmp_path):
    root = str(tmp_path)
    _steps(root, (1, 2, 3))
    d = os.path.join(root, fmt.step_dirname(5))  # a later run's step, its manifest torn
    os.makedirs(d)
    with open(os.path.join(d, fmt.MANIFEST), "w") as f:
        f.write('{"torn": ')
    _steps(root, (4,), keep_last=2)
    assert fastckpt.steps(root) == [3, 4]  # two loadable steps; step 3 was removed before
    assert os.path.isdir(d)  # the damaged one is neither counted nor removed
    assert _loads(root) == 4


def test_a_second_directory_of_one_step_number_is_not_a_step(tmp_path, capsys):
    root = str(tmp_path)
    _steps(root, (4, 5))
    odd = os.path.join(root, "step-00000000005")  # 11 digits: not the name of step 5
    os.makedirs(odd)
    assert fmt.parse_step_dirname("step-00000000005") is None
    assert fmt.parse_step_dirname("step-0000000005") == 5
    assert fmt.parse_step_dirname("step-12345678901") == 12345678901
    rc, out, _ = call("gc", root, "--yes", "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["removed"] == []
    assert fastckpt.steps(root) == [4, 5] and os.path.isdir(odd)
    assert _loads(root) == 5


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_gc_keep_does_not_trust_a_step_whose_shards_are_missing(tmp_path, capsys, damage):
    root = str(tmp_path)
    _steps(root, (1, 2))
    d = os.path.join(root, fmt.step_dirname(2))
    shard = next(n for n in os.listdir(d) if n.endswith(fmt.SHARD_SUFFIX))
    if damage == "missing":
        os.remove(os.path.join(d, shard))
    else:
        with open(os.path.join(d, shard), "r+b") as f:
            f.truncate(100)
    rc, out, _ = call("gc", root, "--keep", "1", "--yes", "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["removed"] == [], out
    assert os.path.isdir(os.path.join(root, fmt.step_dirname(1)))
    got = {"w": torch.zeros(100)}
    assert fastckpt.load(got, root, step=1) == 1
