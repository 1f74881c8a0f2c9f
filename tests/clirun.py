"""Running the ``fastckpt`` command in-process from a test (the console script's entry point)."""

from __future__ import annotations

import pytest

from fastckpt import cli


def call(*args: str, capsys) -> tuple[int, str, str]:
    """(exit code, stdout, stderr) of ``fastckpt ARGS...``."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as ei:
        cli.main(list(args))
    out, err = capsys.readouterr()
    return ei.value.code or 0, out, err
