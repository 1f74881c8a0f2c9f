"""``fastckpt inspect``: what a committed step's manifest says. Torch-free."""

from __future__ import annotations

import math
from typing import Any

from ..manifest import schema as fmt
from ..manifest.discovery import find_step
from ..manifest.values import TENSOR_TAG, decode_value
from ..storage import Storage
from .describe import as_storage, display_path, step_data_bytes


def _sharding(shape: list, chunks: list) -> str:
    if not chunks:
        return "empty" if math.prod(shape or [1]) == 0 else "no data"
    ranks = sorted({c.get("rank") for c in chunks if c.get("rank") is not None})
    if len(chunks) == 1 and list(chunks[0]["sizes"]) == list(shape):
        return f"whole (rank {ranks[0]})" if ranks else "whole"
    dims = sorted({dim for c in chunks for dim, (s, n) in enumerate(zip(c["sizes"], shape))
                   if s != n})
    rr = _ranges(ranks)
    what = "dim " + ",".join(map(str, dims)) if dims else "?"
    return f"sharded {what} in {len(chunks)} chunks (ranks {rr})"


def _ranges(xs: list[int]) -> str:
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(str(xs[i]) if i == j else f"{xs[i]}-{xs[j]}")
        i = j + 1
    return ",".join(out)


def _jsonable(x: Any) -> Any:
    """A decoded plain value as JSON holds it: tuples as lists, dict keys JSON cannot hold (a
    tuple) as their ``str`` (before 2026-12-07 json.dumps raised on them: inspect, exit 70)."""
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, dict):
        return {k if isinstance(k, (str, int, float, bool)) or k is None else str(k):
                _jsonable(v) for k, v in x.items()}
    return x


def _plain_values(tree: Any) -> dict[str, Any]:
    """Flattened key path -> plain value of a skeleton, tensors left out; a list or tuple of
    plain values stays one value."""
    out: dict[str, Any] = {}

    def has_tensor(x: Any) -> bool:
        if isinstance(x, dict):
            return TENSOR_TAG in x or any(has_tensor(v) for v in x.values())
        if isinstance(x, list):
            return any(has_tensor(v) for v in x)
        return False

    def key(path: str, k: Any) -> str:
        return f"{path}.{k}" if path else str(k)

    def walk(x: Any, path: str) -> None:
        if isinstance(x, dict) and TENSOR_TAG in x:
            return
        seq = x if isinstance(x, list) else x.get("$tuple") if isinstance(x, dict) else None
        if seq is not None:
            if has_tensor(seq) or any(isinstance(v, dict) and "$tuple" not in v
                                      and "$float" not in v for v in seq):
                for i, v in enumerate(seq):
                    walk(v, key(path, i))
            else:
                out[path] = _jsonable(decode_value(x))
            return
        if isinstance(x, dict) and "$float" in x:
            out[path] = decode_value(x)
            return
        if isinstance(x, dict) and "$dict" in x:
            for k, v in x["$dict"]:
                walk(v, key(path, decode_value(k)))
            return
        if isinstance(x, dict):
            for k, v in x.items():
                walk(v, key(path, k))
            return
        out[path] = x
    walk(tree, "")
    return out


def inspect_step(root: str | Storage, step: int | None = None, *,
                 found: tuple[int, str, dict] | None = None) -> dict:
    """Everything the manifest of a committed step says, in JSON-able form.

    Keys: step, path, save_id, created, created_unix, world_size, fastckpt_version,
    torch_version, files (name -> {rank, size}), data_bytes, tensors (list of {name, dtype,
    shape, numel, bytes, sharding, chunks: [{rank, file, offset, length, offsets, sizes}]}),
    plain_values (flattened key path -> value; per rank when ranks differ), user_meta.
    """
    storage = as_storage(root)
    step, d, body = found if found is not None else find_step(storage, step)
    tensors = []
    for fqn in sorted(body["tensors"]):
        t = body["tensors"][fqn]
        shape = list(t.get("shape", []))
        numel = math.prod(shape) if shape else 1
        isz = fmt.DTYPES[t["dtype"]]
        chunks = sorted(t.get("chunks", []), key=lambda c: (list(c["offsets"]), c.get("rank")))
        tensors.append({
            "name": fqn, "dtype": t.get("dtype"), "shape": shape, "numel": numel,
            "bytes": numel * isz, "dtensor": bool(t.get("dtensor")),
            "sharding": _sharding(shape, chunks),
            "chunks": [{"rank": c.get("rank"), "file": c.get("file"), "offset": c.get("offset"),
                        "length": c.get("length"), "offsets": c.get("offsets"),
                        "sizes": c.get("sizes"), "checksum": c.get("checksum"),
                        "codec": (c["codec"].get("codec") if isinstance(c.get("codec"), dict)
                                  else None)}
                       for c in chunks]})
    if "tree" in body:
        plain: Any = _plain_values(body["tree"])
    else:
        plain = {f"rank{r}": _plain_values(t) for r, t in enumerate(body.get("rank_trees", []))}
    return {
        "step": step, "path": display_path(storage, d), "save_id": body.get("save_id"),
        "created": body.get("created"), "created_unix": body.get("created_unix"),
        "world_size": body.get("world_size"), "fastckpt_version": body.get("fastckpt_version"),
        "torch_version": body.get("torch_version"),
        "files": {n: {"rank": f.get("rank"), "size": f.get("size")}
                  for n, f in sorted(body["files"].items())},
        "data_bytes": step_data_bytes(body), "tensors": tensors, "plain_values": plain,
        "plain_values_per_rank": "tree" not in body, "user_meta": body.get("user_meta", {}),
    }


