"""Review of fastckpt.trackers (2026-12-07): an exit hook left behind by the trigger.

The trigger gives the ``ckpt.on_exit`` hooks at most ``EXIT_HOOK_S`` and then exits without
them (a tracker service that does not answer must not hold the exit). What the tracker records
then is what its own ``atexit`` handler says. W&B's is ``teardown_atexit``: it finishes every
unfinished run with the exit code its ``sys.exit`` hook saw, so the exit must go through
``sys.exit`` (before 2026-12-07 the trigger raised ``SystemExit`` itself, W&B saw code 0, and a
preempted or failed run whose hook was left behind ended "finished", exit code 0).

The worker is tests/tracker_worker.py in a fresh interpreter (its ``atexit`` handlers run),
with ``wandb.Run.mark_preempting`` made to block (a W&B service that does not answer), so the
hook is left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from tests.test_trackers import (_cfg, _codes, _hooks_finished, _log, _Proc, _wait_ready,
                                 _wandb_runs)

pytestmark = pytest.mark.timeout(180)

_STUCK_HOOK = """
import sys, time
import wandb.sdk.wandb_run as wr
def _hung(self, *a, **k):  # the service does not answer: the exit hook is left behind
    time.sleep(600)
wr.Run.mark_preempting = _hung
from tests import tracker_worker as W
W.main()
"""


def _spawn_stuck(cfg: dict) -> _Proc:
    os.makedirs(cfg["out"], exist_ok=True)
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(cfg["out"], f"log-{cfg['tag']}-r0.txt"), "ab") as log:
        return _Proc(subprocess.Popen([sys.executable, "-c", _STUCK_HOOK, json.dumps(cfg)],
                                      cwd=repo, stdin=subprocess.DEVNULL, stdout=log,
                                      stderr=subprocess.STDOUT))


def test_wandb_hook_left_behind_still_records_the_exit_code(tmp_path):
    pytest.importorskip("wandb")
    cfg = _cfg(tmp_path, "s", "wandb")
    proc = _spawn_stuck(cfg)
    _wait_ready(cfg, [proc])
    os.kill(proc.pid, signal.SIGTERM)
    assert _codes(cfg, [proc], timeout=90) == [143], _log(cfg)
    assert not _hooks_finished(cfg["root"])  # the hook was left behind
    [run] = _wandb_runs(cfg)
    # W&B's own atexit teardown finished the run: with the process's exit code, not 0
    assert run["exit_code"] == 143, (run, _log(cfg))
