"""torch dtypes <-> the dtype names of the manifest (``manifest.schema.DTYPES``)."""

from __future__ import annotations

import torch

from ..errors import CorruptCheckpointError
from ..manifest import schema as fmt

_BY_NAME = {name: getattr(torch, name) for name in fmt.DTYPES if hasattr(torch, name)}
_NAME_OF = {dtype: name for name, dtype in _BY_NAME.items()}  # str(dtype) costs ~10 us a call


def dtype_name(dtype: torch.dtype) -> str:
    name = _NAME_OF.get(dtype)
    if name is None:
        raise ValueError(f"dtype {dtype} is not supported by the fastckpt format")
    return name


def torch_dtype(name: str, *, file: str | None = None) -> torch.dtype:
    try:
        return _BY_NAME[name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in manifest", file=file) from None


def tensor_meta(body: dict, *, file: str) -> dict[str, dict]:
    """fqn -> {"dtype": torch.dtype, "shape": tuple} for every tensor of a validated body."""
    return {fqn: {"dtype": torch_dtype(t["dtype"], file=file), "shape": tuple(t["shape"])}
            for fqn, t in body["tensors"].items()}
