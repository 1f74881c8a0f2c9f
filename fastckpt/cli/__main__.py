"""``python -m fastckpt.cli ...``: the same as the ``fastckpt`` command."""

from .main import main

main()
