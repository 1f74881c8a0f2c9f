import os
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
