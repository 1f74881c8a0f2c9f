"""Test-only fault injection: ``FASTCKPT_TEST_FAULT=<point>[@<rank>]`` SIGKILLs the process there.

Read at each call (not at import) so tests can set it per subprocess. Points:
``after_stage``, ``mid_shard_write``, ``after_shard_write``, ``before_manifest``,
``manifest_tmp_written``, ``after_manifest``, ``during_retention``. Never set it in production.
"""

from __future__ import annotations

import os
import signal


def armed(name: str, rank: int) -> bool:
    spec = os.environ.get("FASTCKPT_TEST_FAULT")
    if not spec:
        return False
    point, _, r = spec.partition("@")
    return point == name and (not r or int(r) == rank)


def point(name: str, rank: int) -> None:
    if armed(name, rank):
        os.kill(os.getpid(), signal.SIGKILL)
