"""The ``fastckpt`` command (see docs/cli.md): ``main`` is the console script."""

from .main import cli, main

__all__ = ["cli", "main"]
