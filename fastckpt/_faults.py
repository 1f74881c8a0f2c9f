"""Test-only fault injection: ``FASTCKPT_TEST_FAULT=<point>[@<rank>]`` SIGKILLs the process there.

Read at each call (not at import) so tests can set it per subprocess. Points:
``after_stage``, ``mid_shard_write``, ``after_shard_write``, ``before_manifest``,
``manifest_tmp_written``, ``after_manifest``, ``during_retention``. Never set it in production.

``FASTCKPT_TEST_THROTTLE_MIBPS=<MiB/s>`` makes each shard write take at least bytes / rate
(a slow disk, for the preemption tests' budget decisions).
"""

from __future__ import annotations

import os
import signal
import time


def armed(name: str, rank: int) -> bool:
    spec = os.environ.get("FASTCKPT_TEST_FAULT")
    if not spec:
        return False
    point, _, r = spec.partition("@")
    return point == name and (not r or int(r) == rank)


def point(name: str, rank: int) -> None:
    if armed(name, rank):
        os.kill(os.getpid(), signal.SIGKILL)


def throttle(nbytes: int, started: float, cancel=None) -> None:
    """Sleep until a write of ``nbytes`` begun at ``started`` (perf_counter) took bytes/rate;
    a set ``cancel`` event (a superseded save) ends the sleep early."""
    rate = os.environ.get("FASTCKPT_TEST_THROTTLE_MIBPS")
    if rate and nbytes:
        end = started + nbytes / (float(rate) * (1 << 20))
        while (left := end - time.perf_counter()) > 0:
            if cancel is not None and cancel.wait(min(left, 0.05)):
                return
            if cancel is None:
                time.sleep(left)
