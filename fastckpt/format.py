"""The on-disk format: names, the manifest schema, and its validation.

Layout under a root (a local directory or an fsspec URL prefix)::

    ROOT/
      step-0000000500/
        manifest.json                 # the commit point: the step exists iff this is valid
        r00000-3f2a9c1e5b7d.fck       # rank 0's shard of save 3f2a9c1e5b7d (raw tensor bytes)
        r00001-3f2a9c1e5b7d.fck
      latest                          # a hint only ({"step": 500}); resume never trusts it alone

A shard file is the concatenation of the rank's tensor chunks (each in row-major order); chunks
of 1 MiB or more start at a multiple of ``ALIGN`` (4096) bytes, smaller ones at a multiple of
64, with zero padding between. The staging buffer is the file's exact image, written with direct
I/O in one pass. The manifest says where everything is.
"""

from __future__ import annotations

import json
import re
import time
from typing import Any

import torch
import xxhash

from .errors import CorruptCheckpointError

FORMAT_NAME = "fastckpt"
FORMAT_VERSION = 1
HASH_NAME = "xxh3_64"
ALIGN = 4096
SMALL_ALIGN = 64
SMALL_CHUNK = 1 << 20  # chunks below this are packed at SMALL_ALIGN
MANIFEST = "manifest.json"
LATEST = "latest"
SHARD_SUFFIX = ".fck"
INFLIGHT_PREFIX = ".inflight-"
_STEP_RE = re.compile(r"^step-(\d{10,})$")

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool, torch.uint16, torch.uint32, torch.uint64,
    getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None),
) if d is not None}


def step_dirname(step: int) -> str:
    return f"step-{int(step):010d}"


def parse_step_dirname(name: str) -> int | None:
    m = _STEP_RE.match(name)
    return int(m.group(1)) if m else None


def shard_name(rank: int, save_id: str, piece: int = 0) -> str:
    return f"r{rank:05d}-{save_id}-{piece:03d}{SHARD_SUFFIX}"


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def dtype_name(dtype: torch.dtype) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype} is not supported by the fastckpt format")
    return name


def dtype_from_name(name: str, *, file: str | None = None) -> torch.dtype:
    try:
        return _DTYPES[name]
    except KeyError:
        raise CorruptCheckpointError(f"unknown dtype {name!r} in manifest", file=file) from None


def hexdigest(h: int) -> str:
    return f"{h:016x}"


def _body_checksum(body: dict) -> str:
    canon = json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hexdigest(xxhash.xxh3_64_intdigest(canon.encode()))


def encode_manifest(body: dict) -> bytes:
    """Serialise a manifest body with a checksum over its canonical JSON form."""
    doc = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "body": body,
           "checksum": _body_checksum(body)}
    return (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode()


def decode_manifest(data: bytes, *, file: str) -> dict:
    """Parse and validate a manifest; raise CorruptCheckpointError naming the file."""
    try:
        doc = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"manifest is not valid JSON ({e}); the file is damaged or "
                                     "was not written by fastckpt", file=file) from e
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError("not a fastckpt manifest", file=file)
    ver = doc.get("format_version")
    if not isinstance(ver, int) or ver > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"manifest format version {ver!r} is newer than this fastckpt reads "
            f"({FORMAT_VERSION}); upgrade fastckpt", file=file)
    body = doc.get("body")
    if not isinstance(body, dict) or doc.get("checksum") != _body_checksum(body):
        raise CorruptCheckpointError("manifest checksum mismatch: the manifest was modified or "
                                     "damaged", file=file)
    for key in ("step", "world_size", "files", "tensors", "save_id"):
        if key not in body:
            raise CorruptCheckpointError(f"manifest lacks {key!r}", file=file)
    return body


def new_manifest_body(*, step: int, world_size: int, save_id: str, files: dict,
                      tensors: dict, trees: list, user_meta: dict | None = None) -> dict:
    from . import __version__
    body: dict[str, Any] = {
        "step": int(step),
        "world_size": int(world_size),
        "save_id": save_id,
        "created_unix": time.time(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fastckpt_version": __version__,
        "torch_version": torch.__version__,
        "hash": HASH_NAME,
        "align": ALIGN,
        "files": files,
        "tensors": tensors,
        "user_meta": user_meta or {},
    }
    first = trees[0]
    if all(t == first for t in trees):
        body["tree"] = first
    else:
        body["rank_trees"] = trees
    return body


def tree_for_rank(body: dict, rank: int, world_size: int, *, file: str) -> Any:
    """The plain-value skeleton this rank loads: shared, or its own when values differ by rank."""
    if "tree" in body:
        return body["tree"]
    trees = body.get("rank_trees")
    if not isinstance(trees, list) or not trees:
        raise CorruptCheckpointError("manifest has neither 'tree' nor 'rank_trees'", file=file)
    if world_size != len(trees):
        from .errors import StateMismatchError
        raise StateMismatchError(
            f"this checkpoint holds plain values that differ between its {len(trees)} ranks (for "
            f"example a per-rank data-loader position); it can be loaded by exactly "
            f"{len(trees)} ranks, not {world_size}. Keep per-rank values under the rank's own key "
            "to load at another world size.", file=file)
    return trees[rank]


def tensor_meta(body: dict, *, file: str) -> dict[str, dict]:
    """fqn -> {"dtype": torch.dtype, "shape": tuple} for every tensor in a manifest body."""
    out = {}
    for fqn, t in body["tensors"].items():
        out[fqn] = {"dtype": dtype_from_name(t["dtype"], file=file), "shape": tuple(t["shape"])}
    return out
