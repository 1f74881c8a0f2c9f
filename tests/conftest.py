import os
import subprocess
import sys

import pytest

# tests import helpers as ``tests.<module>`` (the forkserver preloads them by that name)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture
def root(tmp_path):
    """A fresh checkpoint root directory."""
    d = tmp_path / "ckpt"
    return str(d)


@pytest.fixture
def tmpfs(tmp_path):
    """``tmpfs(options) -> path``: a small tmpfs mounted for the test (a full or read-only disk);
    skips when mounting is not allowed (not root). Unmounted afterwards."""
    mounted = []

    def mount(options: str) -> str:
        d = tmp_path / f"tmpfs{len(mounted)}"
        d.mkdir()
        if subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(d)],
                          capture_output=True).returncode != 0:
            pytest.skip("cannot mount a tmpfs here (needs root)")
        mounted.append(str(d))
        return str(d)
    yield mount
    for d in mounted:
        subprocess.run(["umount", "-l", d])


@pytest.fixture
def stats(monkeypatch):
    """The ``read_stats`` of every ``FastCkptReader.read_data`` call of the test, in order."""
    from fastckpt.engine import reader as R
    seen: list[dict] = []
    orig = R.FastCkptReader.read_data

    def read_data(self, plan, planner):
        try:
            return orig(self, plan, planner)
        finally:
            seen.append(dict(self.read_stats))
    monkeypatch.setattr(R.FastCkptReader, "read_data", read_data)
    return seen
