"""Byte sizes for people: ``"4GiB"`` <-> ``4294967296``, the one parser and printer of sizes
(the CLI, ``fastckpt bench`` and benchmarks/ use it).

The rule: ``KiB``/``MiB``/``GiB``/``TiB`` and the single letters ``K``/``M``/``G``/``T`` (as in
fio and dd) are binary; ``KB``/``MB``/``GB``/``TB`` are decimal. Case does not matter.
"""

from __future__ import annotations

import re

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KI": 1 << 10, "KIB": 1 << 10, "KB": 10 ** 3,
          "M": 1 << 20, "MI": 1 << 20, "MIB": 1 << 20, "MB": 10 ** 6,
          "G": 1 << 30, "GI": 1 << 30, "GIB": 1 << 30, "GB": 10 ** 9,
          "T": 1 << 40, "TI": 1 << 40, "TIB": 1 << 40, "TB": 10 ** 12}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"4GiB"``, ``"4G"`` (both 2**32), ``"4GB"`` (4e9), ``"512MiB"``, ``"1.5T"``, ``"4096"``,
    ``"1e9"``."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(str(text))
    unit = m.group(2).upper() if m else None
    if not m or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 4GiB, 512MiB, 1.5T, 4GB = 4e9, 4096)")
    return int(float(m.group(1)) * _UNITS[unit])


def human_bytes(n: float | None) -> str:
    """``1536`` -> ``"1.5 KiB"``; None -> ``"-"``."""
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} PiB"  # pragma: no cover
