"""Review of the save plan (fastckpt/engine/plan.py, solo.py) and of step discovery
(fastckpt/manifest/discovery.py), 2026-12-07: one test per defect found, each failing on
the code before its fix.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastckpt
from fastckpt.manifest import schema as fmt
from tests.clirun import call


def _steps(root: str, steps, keep_last=None) -> None:
    st = {"w": torch.arange(100, dtype=torch.float32)}
    with fastckpt.Checkpointer(root, keep_last=keep_last) as ck:
        for s in steps:
            st["w"].add_(1.0)
            ck.save(st, step=s, block=True)


def _partial(root: str, step: int, created) -> str:
    """A partial step (a shard, no manifest) whose in-flight marker's ``created_unix`` is the
    raw JSON text ``created``."""
    d = os.path.join(root, fmt.step_dirname(step))
    os.makedirs(d)
    with open(os.path.join(d, ".inflight-aaaaaaaaaaaa"), "w") as f:
        f.write('{"save_id": "aaaaaaaaaaaa", "host": "h", "pid": 1, "created_unix": '
                f'{created}}}')
    with open(os.path.join(d, "r00000-aaaaaaaaaaaa-000.fck"), "wb") as f:
        f.write(b"x" * 4096)
    t = __import__("time").time() - 7200  # (its files are old: only the marker's time could
    for n in os.listdir(d):               # keep it)
        os.utime(os.path.join(d, n), (t, t))
    os.utime(d, (t, t))
    return d


# a crafted in-flight marker's time: an integer too large for a float raised OverflowError
# out of ``marker_time`` (it caught KeyError, TypeError, ValueError only), which stopped
# retention, `fastckpt ls` and `fastckpt gc` for the whole root; a non-finite time (NaN,
# Infinity, "1e999") made the abandoned partial step look in flight for ever
@pytest.mark.parametrize("created", ["1" + "0" * 400, "NaN", "Infinity", '"1e999"', '"nan"'])
def test_a_crafted_marker_time_neither_stops_the_tools_nor_keeps_its_step(tmp_path, capsys,
                                                                         created):
    from fastckpt.manifest.discovery import marker_time
    from fastckpt.retention import apply_retention
    from fastckpt.storage import open_storage
    root = str(tmp_path)
    _steps(root, (1, 2, 3))
    d = _partial(root, 4, created)
    storage = open_storage(root)
    assert marker_time(storage, os.path.join(d, ".inflight-aaaaaaaaaaaa")) == 0.0
    rc, out, err = call("ls", root, "--json", capsys=capsys)
    assert rc == 0 and "Traceback" not in err, err
    rc, out, err = call("gc", root, "--yes", "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["removed"] == [4], (out, err)
    assert not os.path.exists(d)
    _partial(root, 5, created)
    assert apply_retention(storage, 1) == [1, 2, 5]
    assert fastckpt.steps(root) == [3]
