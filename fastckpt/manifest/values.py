"""The plain-value part of a saved state: JSON data with a few tags. Torch-free.

A saved state's *skeleton* is JSON: every tensor is replaced by ``{"$tensor": fqn}``, plain
values are kept as data, and what JSON cannot hold exactly is tagged: ``{"$tuple": [...]}``,
``{"$dict": [[key, value], ...]}`` (non-string keys, or string keys starting with ``$``) and
``{"$float": "nan" | "inf" | "-inf"}``. Nothing is ever pickled. ``format.validate_body`` checks
that a manifest's skeleton uses only these tags, well-formed; this module encodes and decodes.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from ..errors import StateMismatchError, UnsupportedStateError

TENSOR_TAG = "$tensor"


def fqn(path: tuple) -> str:
    """A key path as DCP names it: keys and indices joined with "."."""
    return ".".join(str(p) for p in path)


def path_str(path: tuple) -> str:
    return fqn(path) if path else "<root>"


#: the longest int a manifest holds: Python's JSON parser refuses integers of more than 4300
#: digits (``sys.set_int_max_str_digits``), so a longer one would make the checkpoint unloadable
MAX_INT_BITS = 14_000  # (4215 digits)

#: the types a load rebuilds exactly: a value of a subclass of one of them (a namedtuple,
#: torch.Size, an IntEnum, a str subclass) would load back as its base type. A float subclass
#: (numpy's float64: the optimizer's lr under a schedule computed with numpy) is a float to the
#: last bit and loads back as one: it is stored as a float, as before 2026-12-07
_EXACT = (tuple, int, float, str)


def check_exact(x: Any, path: tuple) -> None:
    """Refuse (naming the key path) a value of a strict subclass of tuple, int or str other
    than bool: it would load back as its base type. (Dicts and lists are loaded into in
    place, their types kept; a float subclass is stored as its float.)"""
    if (isinstance(x, _EXACT) and type(x) not in _EXACT and not isinstance(x, (bool, float))):
        base = next(b for b in _EXACT if isinstance(x, b)).__name__
        raise UnsupportedStateError(
            f"cannot store a {type(x).__module__}.{type(x).__qualname__} (a subclass of {base}) "
            f"at key path {path_str(path)!r}: it would load back as a plain {base}; convert it "
            f"({base}(x){'' if base in ('tuple', 'str') else ', or .item()'})")


def encode_value(x: Any, path: tuple) -> Any:
    """Encode a plain Python value as JSON data; raise UnsupportedStateError naming the path."""
    check_exact(x, path)
    if x is None or isinstance(x, bool):
        return x
    if isinstance(x, int):
        if x.bit_length() > MAX_INT_BITS:
            raise UnsupportedStateError(
                f"cannot store an int of {x.bit_length()} bits at key path {path_str(path)!r}: "
                "JSON readers refuse integers of more than 4300 digits; store it as a str")
        return x
    if isinstance(x, float):
        x = float(x)  # (a subclass, numpy's float64: its float)
        if math.isfinite(x):
            return x
        return {"$float": "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")}
    if isinstance(x, str):
        return x
    if isinstance(x, list):
        return [encode_value(v, path + (i,)) for i, v in enumerate(x)]
    if isinstance(x, tuple):
        return {"$tuple": [encode_value(v, path + (i,)) for i, v in enumerate(x)]}
    if isinstance(x, dict):
        if all(type(k) is str and not k.startswith("$") for k in x):
            return {k: encode_value(v, path + (k,)) for k, v in x.items()}
        return {"$dict": [[encode_value(k, path + ("<key>",)), encode_value(v, path + (k,))]
                          for k, v in x.items()]}
    raise UnsupportedStateError(
        f"cannot store a {type(x).__module__}.{type(x).__qualname__} at key path "
        f"{path_str(path)!r}: state may hold tensors, DTensors, modules, optimizers, objects with "
        "state_dict()/load_state_dict(), and plain int/float/str/bool/None values in dicts, lists "
        "and tuples (convert numpy values with .item() or .tolist())")


def decode_value(x: Any, tensor_for: Callable[[str], Any] | None = None) -> Any:
    """Inverse of the skeleton encoding; ``tensor_for(fqn)`` supplies tensors for references."""
    if isinstance(x, list):
        return [decode_value(v, tensor_for) for v in x]
    if isinstance(x, dict):
        if TENSOR_TAG in x:
            if tensor_for is None:
                raise StateMismatchError("unexpected tensor reference in plain data",
                                         key=x[TENSOR_TAG])
            return tensor_for(x[TENSOR_TAG])
        if "$tuple" in x:
            return tuple(decode_value(v, tensor_for) for v in x["$tuple"])
        if "$dict" in x:
            return {hashable_key(decode_value(k)): decode_value(v, tensor_for) for k, v in x["$dict"]}
        if "$float" in x:
            return float(x["$float"])
        return {k: decode_value(v, tensor_for) for k, v in x.items()}
    return x


def hashable_key(k: Any) -> Any:
    """A decoded key as a dict can hold it: lists as tuples, inside tuples too (a crafted
    manifest's ``{"$tuple": [[1]]}`` key decoded to ``([1],)``: a raw TypeError on load)."""
    return tuple(hashable_key(v) for v in k) if isinstance(k, (list, tuple)) else k


def skel_items(skel: Any) -> list[tuple[Any, Any]] | None:
    """(key, child) pairs of a skeleton dict node, decoding non-string keys; None if not a dict."""
    if not isinstance(skel, dict) or TENSOR_TAG in skel or "$tuple" in skel or "$float" in skel:
        return None
    if "$dict" in skel:
        return [(hashable_key(decode_value(k)), v) for k, v in skel["$dict"]]
    return list(skel.items())


def skel_seq(skel: Any) -> list | None:
    if isinstance(skel, list):
        return skel
    if isinstance(skel, dict) and "$tuple" in skel:
        return skel["$tuple"]
    return None
