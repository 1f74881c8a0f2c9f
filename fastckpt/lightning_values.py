"""The values of a Lightning checkpoint (fastckpt.lightning's helpers): what the integration
stores (plain data and tensors, never pickled), the copy it saves, and the tagged form its
``lightning`` part takes through ``torch.distributed.checkpoint`` under ModelParallelStrategy.
"""

from __future__ import annotations

import base64
from typing import Any, Callable

import torch

from .errors import UnsupportedStateError
from .manifest.values import encode_value, path_str

__all__ = ["plain_copy", "map_tensors", "lists", "to_json", "from_json", "to_dcp",
           "DCP_ENCODING"]

def _describe(x: Any) -> str:
    return f"{type(x).__module__}.{type(x).__qualname__}"

_SCALARS = (type(None), bool, int, float, str)

def plain_copy(x: Any, convert: Callable[[str, Any], Any] | None = None,
               path: tuple = ()) -> Any:
    """A copy of the containers of ``x`` (tensors shared, not copied) holding only what fastckpt
    stores as it is: tensors, ``None``/bool/int/float/str, lists, tuples and dicts (dict
    subclasses such as ``OrderedDict`` and Lightning's ``AttributeDict`` become dicts). Anything
    else (an arbitrary object, a module, an optimizer, a numpy scalar) goes through
    ``convert(key, value)`` or raises ``UnsupportedStateError`` naming the key. ``x`` is not
    changed."""
    if isinstance(x, torch.Tensor) or type(x) in _SCALARS:
        return x
    if isinstance(x, dict):
        return {k: plain_copy(v, convert, path + (k,)) for k, v in x.items()}
    if type(x) in (list, tuple):
        return type(x)(plain_copy(v, convert, path + (i,)) for i, v in enumerate(x))
    key = path_str(path)
    if convert is not None:
        y = convert(key, x)
        if y is not x:
            return plain_copy(y, None, path)
    hint = ("exclude it from the hyperparameters (self.save_hyperparameters(ignore=[...])) or "
            if path[:1] in (("hyper_parameters",), ("datamodule_hyper_parameters",)) else "")
    err = UnsupportedStateError(
        f"key {key!r}: cannot store a {_describe(x)} in a fastckpt checkpoint (values are never "
        "pickled; tensors and plain int/float/str/bool/None in dicts, lists and tuples are): "
        f"{hint}pass fastckpt.lightning.CheckpointIO(convert=...) to turn it into plain data")
    err.key = key
    raise err

def _walk(x: Any, leaf: Callable[[Any], Any], seq: type | None = None) -> Any:
    """``x``'s dicts, lists and tuples rebuilt around ``leaf(v)`` of every other value ``v``;
    each list or tuple becomes a ``seq`` (None: its own type)."""
    if isinstance(x, dict):
        return {k: _walk(v, leaf, seq) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return (seq or type(x))(_walk(v, leaf, seq) for v in x)
    return leaf(x)

def map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    return _walk(x, lambda v: fn(v) if isinstance(v, torch.Tensor) else v)

def lists(x: Any) -> Any:
    return _walk(x, lambda v: v, list)

def _tensor_json(x: Any) -> Any:
    if not isinstance(x, torch.Tensor):
        return x
    t = x.detach().cpu().contiguous()
    return {"$b64": base64.b64encode(t.view(torch.uint8).numpy().tobytes()).decode(),
            "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape)}

def to_json(x: Any) -> Any:
    return _walk(x, _tensor_json, list)

def from_json(x: Any) -> Any:
    if isinstance(x, dict):
        if "$b64" in x:
            raw = bytearray(base64.b64decode(x["$b64"]))
            t = (torch.frombuffer(raw, dtype=torch.uint8) if raw
                 else torch.empty(0, dtype=torch.uint8))
            return t.view(getattr(torch, x["dtype"])).reshape(x["shape"]).clone()
        return {k: from_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [from_json(v) for v in x]
    return x

#: the value of a ModelParallelStrategy checkpoint's ``lightning_encoding``: its ``lightning``
#: part was saved as ``to_dcp`` gives it (``manifest.values.decode_value`` gives it back);
#: absent before 2026-12-06 (the part went through DCP's flattening as it was)
DCP_ENCODING = "tagged/1"

def to_dcp(x: Any, path: tuple = ()) -> Any:
    """``x`` (plain data and tensors, as ``plain_copy`` gives it) in a form DCP's flattening
    gives back as it was: tensors stay tensors (DCP plans and writes them), and a container
    the flattening would change is tagged as ``manifest.values.encode_value`` tags it: a dict
    with a key that is not a string or starts with ``$`` (DCP ``str()``s every key) or an
    empty one (DCP drops it) is ``{"$dict": [[key, value], ...]}``, a tuple (DCP hands it over
    whole, to be pickled when it holds a tensor) is ``{"$tuple": [...]}``. Keys are encoded by
    ``encode_value`` (plain values only: anything else raises naming the key). ``decode_value``
    is the inverse, tensors passing through it."""
    if isinstance(x, dict):
        if x and all(isinstance(k, str) and not k.startswith("$") for k in x):
            return {k: to_dcp(v, path + (k,)) for k, v in x.items()}
        return {"$dict": [[encode_value(k, path + ("<key>",)), to_dcp(v, path + (k,))]
                          for k, v in x.items()]}
    if isinstance(x, tuple):
        return {"$tuple": [to_dcp(v, path + (i,)) for i, v in enumerate(x)]}
    if isinstance(x, list):
        return [to_dcp(v, path + (i,)) for i, v in enumerate(x)]
    return x  # a tensor or a plain value (the Writer encodes it)
