"""The on-disk format: names, the manifest schema, and its validation. Torch-free.

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
import math
import re
import time
from typing import Any

import xxhash

from ..errors import CorruptCheckpointError, StateMismatchError

FORMAT_NAME = "fastckpt"
#: the newest version this code reads and writes. 1: the original format. 2 adds what a
#: format-1 reader would load wrongly: tied tensors (two skeleton keys referencing one stored
#: tensor) and per-rank tensors (``"per_rank": true``, one copy per saving rank). 3 adds
#: compressed chunks (a ``"codec"`` description, ``length`` the stored bytes). 4 moves the
#: chunk lists into per-rank index files (``"indexes"``, see fastckpt/manifest/index.py); the
#: manifest keeps the tensor table, the files and the skeleton; since 2026-12-05 it may also
#: hold ``"inline"``: the chunks of its written-once tensors (neither DTensor shards nor per
#: rank), the same entries their writers' indexes hold, so a rank loading at the saved world
#: size reads the manifest and its own index only (fastckpt/manifest/index.py); a reader that
#: does not know the key reads every index, as before. A manifest is written with the lowest
#: version that holds what it uses, readable by older fastckpt.
FORMAT_VERSION = 4
HASH_NAME = "xxh3_64"
ALIGN = 4096
SMALL_ALIGN = 64
SMALL_CHUNK = 1 << 20  # chunks below this are packed at SMALL_ALIGN
MANIFEST = "manifest.json"
LATEST = "latest"
SHARD_SUFFIX = ".fck"
INFLIGHT_PREFIX = ".inflight-"
#: in a local root with a remote tier (``Checkpointer(local, remote=url)``): {"remote": url}
TIERS = ".tiers.json"
#: names are checked with ``fullmatch`` and ``[0-9]``: ``$`` also matches before a final "\n",
#: ``\d`` also matches other scripts' digits (Arabic-Indic ones are no step number)
_STEP_RE = re.compile(r"step-([0-9]{10,})")

#: dtype name (as torch prints it, without "torch.") -> bytes per element
DTYPES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex64": 8,
          "complex128": 16, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
          "uint16": 2, "uint32": 4, "uint64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}


def step_dirname(step: int) -> str:
    return f"step-{int(step):010d}"


def parse_step_dirname(name: str) -> int | None:
    """The step of a step directory's name, None if it is not one: only the name
    :func:`step_dirname` gives (``step-00000000005`` is not step 5: two directories of one step
    once made `fastckpt gc` remove the committed one with the other)."""
    m = _STEP_RE.fullmatch(name)
    return int(m.group(1)) if m and name == step_dirname(int(m.group(1))) else None


def shard_name(rank: int, save_id: str, piece: int = 0) -> str:
    return f"r{rank:05d}-{save_id}-{piece:03d}{SHARD_SUFFIX}"


def align_up(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def itemsize(name: str, *, file: str | None = None) -> int:
    """Bytes per element of a dtype named in a manifest; CorruptCheckpointError if unknown."""
    try:
        return DTYPES[name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"unknown dtype {name!r} in manifest", file=file) from None


def hexdigest(h: int) -> str:
    return f"{h:016x}"


def _canonical(body: dict) -> str:
    return json.dumps(body, sort_keys=True, separators=(",", ":"), allow_nan=False)


def _body_checksum(body: dict) -> str:
    return hexdigest(xxhash.xxh3_64_intdigest(_canonical(body).encode()))


#: manifests whose body is larger than this (canonical JSON) are written without indentation
INDENT_MAX = 1 << 20


def encode_manifest(body: dict, version: int = 1) -> bytes:
    """Serialise a manifest body with a checksum over its canonical JSON form; ``version``: the
    lowest format version that holds it (see FORMAT_VERSION).

    A small manifest is indented (for people who read it); a large one is the canonical body
    itself, written as it was hashed: json's indenting encoder is pure Python (6.7 s of a
    7.1 s commit at 32 ranks of a 70B state, docs/scale.md), its compact one is C."""
    canon = _canonical(body)
    checksum = hexdigest(xxhash.xxh3_64_intdigest(canon.encode()))
    if len(canon) <= INDENT_MAX:
        doc = {"format": FORMAT_NAME, "format_version": version, "body": body,
               "checksum": checksum}
        return (json.dumps(doc, indent=1, allow_nan=False) + "\n").encode()
    head = json.dumps({"format": FORMAT_NAME, "format_version": version, "checksum": checksum})
    return (head[:-1] + ',\n"body": ' + canon + "}\n").encode()


#: the largest manifest read (a 100k-tensor state writes a few tens of MiB)
MAX_MANIFEST_BYTES = 1 << 30
#: the deepest nesting of a saved state's plain-value skeleton (and of ``user_meta``). DCP's
#: ``read_metadata``/``flatten_state_dict`` recurse per level and fail near 490; real states
#: (torchtitan, Lightning, HF) nest fewer than 10 levels.
MAX_NESTING = 100
#: the most dimensions a saved tensor may have (torch allows 64)
MAX_NDIM = 64
#: a bound on each dimension and on the element count of a saved tensor (torch's are int64)
MAX_DIM = 1 << 62
#: shard file names: what ``shard_name`` writes (no separator, no leading dot, so never ``..``)
_FILE_RE = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,200}" + re.escape(SHARD_SUFFIX))
#: save ids: what the engine proposes (uuid hex); they are joined into shard and marker names
_SAVE_ID_RE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_HEX16_RE = re.compile(r"[0-9a-f]{16}")
_PLAIN_TAGS = ("$tensor", "$tuple", "$dict", "$float")


def is_safe_name(name: object) -> bool:
    """Whether a name taken from a manifest may be joined into a path under the step directory:
    a shard name (letters, digits, ``._-``, no separator, no leading dot, so no ``..``)."""
    return isinstance(name, str) and bool(_FILE_RE.fullmatch(name))


def is_save_id(sid: object) -> bool:
    return isinstance(sid, str) and bool(_SAVE_ID_RE.fullmatch(sid))


def decode_manifest(data: bytes, *, file: str, step: int | None = None) -> dict:
    """Parse and validate a manifest; raise CorruptCheckpointError naming the file.

    A manifest is untrusted input (checkpoints are downloaded, shared and copied; its checksum
    detects damage, not tampering): beyond the checksum, :func:`validate_body` checks every
    field a reader uses, so that no later step can index out of bounds, follow a path out of
    the step directory, or allocate more than the shard files hold. ``step``: the step its
    directory names, which the body must match.
    """
    try:
        doc = json.loads(data.decode("utf-8"))
    except ValueError as e:  # (JSONDecodeError, UnicodeDecodeError; an int of more than
        # 4300 digits, which json refuses with a plain ValueError)
        raise CorruptCheckpointError(f"manifest is not valid JSON ({e}); the file is damaged or "
                                     "was not written by fastckpt", file=file) from e
    except RecursionError:
        raise CorruptCheckpointError("manifest nests deeper than a JSON parser allows; it was "
                                     "not written by fastckpt", file=file) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError("not a fastckpt manifest (no \"format\": \"fastckpt\")",
                                     file=file)
    ver = doc.get("format_version")
    if not _is_int(ver) or ver < 1:
        raise CorruptCheckpointError(f"manifest has no valid format_version ({ver!r}); it is "
                                     "damaged or was not written by fastckpt", file=file)
    if ver > FORMAT_VERSION:
        raise CorruptCheckpointError(
            f"manifest format version {ver} is newer than this fastckpt reads "
            f"({FORMAT_VERSION}); upgrade fastckpt", file=file)
    body = doc.get("body")
    if not isinstance(body, dict):
        raise CorruptCheckpointError("manifest has no body", file=file)
    try:
        ok = doc.get("checksum") == _body_checksum(body)
    except (RecursionError, ValueError, TypeError):
        ok = False
    if not ok:
        raise CorruptCheckpointError("manifest checksum mismatch: the manifest was modified or "
                                     "damaged", file=file)
    # a version-4 manifest's chunks are in its per-rank indexes: checked once they are merged
    # in (fastckpt.manifest.index.expand), which runs this again with the chunks
    validate_body(body, file=file, step=step, chunks=not (ver >= 4 and "indexes" in body))
    return body


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def too_deep(x: object, limit: int = MAX_NESTING) -> list | None:
    """The JSON path (keys and indices) of the first container in ``x`` nested deeper than
    ``limit``; None when there is none. Iterative: safe on any depth."""
    stack: list = [(x, 1)]
    while stack:  # the common case, without building paths
        v, d = stack.pop()
        if isinstance(v, dict):
            stack.extend((c, d + 1) for c in v.values())
        elif isinstance(v, list):
            stack.extend((c, d + 1) for c in v)
        else:
            continue
        if d > limit:
            break
    else:
        return None
    stack = [(x, 1, [])]
    while stack:
        v, d, path = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                return path
            items = v.items() if isinstance(v, dict) else enumerate(v)
            stack.extend((c, d + 1, path + [k]) for k, c in items)
    return None  # pragma: no cover


def validate_body(body: dict, *, file: str, step: int | None = None,
                  chunks: bool | str = True) -> None:
    """Check every field of a manifest body a reader relies on; raise CorruptCheckpointError
    naming the file, the tensor and the field.

    After this: ``step``, ``world_size`` are ints; ``save_id`` and every file name are safe
    names (:func:`is_safe_name`); each file's rank is in range and size >= 0; each tensor has a
    known dtype and a shape of ints; its chunks lie inside the shape, do not overlap, cover it
    exactly, and each lies inside its (listed) file with ``length = numel x itemsize``; the
    plain-value trees are well-formed and nest at most MAX_NESTING levels, and every tensor they
    reference exists. A tensor's bytes therefore fit its shape, and all tensors together fit
    the files (so nothing larger than the files is allocated before they are checked).

    ``chunks=False``: a version-4 manifest before its per-rank indexes are merged in (its
    tensors have no chunk lists yet); its ``indexes`` are checked (one per rank, safe names,
    sizes, checksums), the chunks later, with the merged body. Its ``inline`` chunks, if any,
    are checked in full here (each tensor's cover it exactly; not a per-rank tensor).
    ``chunks="partial"``: one rank's part of such a body (the inline chunks and its own
    index's): each chunk is checked and no two overlap, but a tensor need not be covered (the
    load checks that the boxes it reads are, fastckpt/engine/load.py).
    """
    def bad(msg: str, key: str | None = None) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"invalid manifest: {msg}", file=file, key=key)

    for key in ("step", "world_size", "files", "tensors", "save_id"):
        if key not in body:
            raise bad(f"lacks {key!r}")
    if not _is_int(body["step"]) or body["step"] < 0:
        raise bad(f"step {body['step']!r} is not a non-negative int")
    if step is not None and body["step"] != step:
        raise bad(f"it is in the directory of step {step} but says step {body['step']}")
    world = body["world_size"]
    if not _is_int(world) or not 1 <= world <= 1 << 24:
        raise bad(f"world_size {world!r} is not a positive int")
    if not is_save_id(body["save_id"]):
        raise bad(f"save_id {body['save_id']!r} is not a plain id (letters, digits, _ and -)")
    t = body.get("created_unix", 0)  # (the tools print it: a crafted one crashed `ls`)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < 1e11:
        raise bad(f"created_unix {t!r} is not a time (seconds since 1970)")
    files = body["files"]
    if not isinstance(files, dict):
        raise bad("'files' is not a mapping")
    for name, info in files.items():
        if not is_safe_name(name):
            raise bad(f"file name {name!r} is not a shard name (a path, or not *.fck)")
        if not isinstance(info, dict) or not _is_int(info.get("size")) or info["size"] < 0:
            raise bad(f"file {name!r} has no valid size")
        if not _is_int(info.get("rank")) or not 0 <= info["rank"] < world:
            raise bad(f"file {name!r} has rank {info.get('rank')!r}, not in [0, {world})")
        if "checksum" in info and not (isinstance(info["checksum"], str)
                                       and _HEX16_RE.fullmatch(info["checksum"])):
            raise bad(f"file {name!r} has an invalid checksum")
    if "indexes" in body:
        _validate_indexes(body["indexes"], world, bad)
    tensors = body["tensors"]
    if not isinstance(tensors, dict):
        raise bad("'tensors' is not a mapping")
    for fqn, t in tensors.items():
        _validate_tensor(fqn, t, files, world, bad, with_chunks=chunks)
    if "inline" in body:
        inline = body["inline"]
        if "indexes" not in body or not isinstance(inline, dict):
            raise bad("'inline' is not a mapping of a manifest with per-rank indexes")
        for fqn, cs in inline.items():
            t = tensors.get(fqn)
            if not isinstance(t, dict):
                raise bad("lists inline chunks of a tensor it does not hold", key=str(fqn))
            if t.get("per_rank"):
                raise bad("lists inline chunks of a per-rank tensor", key=fqn)
            _validate_tensor(fqn, {**t, "chunks": cs}, files, world, bad)
    if "tree" in body:
        trees = [body["tree"]]
    else:
        trees = body.get("rank_trees")
        if not isinstance(trees, list) or len(trees) != world:
            raise bad("has neither 'tree' nor one 'rank_trees' entry per rank")
    for tree in trees:
        _validate_tree(tree, tensors, bad)
        clash = flat_clash(tree, bad)
        if clash is not None:
            raise bad(f"two values of the saved state have the flattened name {clash!r} (as "
                      "{'a': {'b': ...}} and 'a.b' do), which no load can tell apart")
    meta = body.get("user_meta", {})
    if not isinstance(meta, dict) or too_deep(meta) is not None:
        raise bad(f"user_meta is not a mapping nested at most {MAX_NESTING} levels")


def _validate_indexes(indexes: object, world: int, bad) -> None:
    """A version-4 manifest's ``indexes``: one entry per rank, in rank order."""
    from .index import is_index_name
    if not isinstance(indexes, list) or len(indexes) != world:
        raise bad(f"'indexes' is not a list of one entry per rank ({world})")
    for r, e in enumerate(indexes):
        if (not isinstance(e, dict) or not is_index_name(e.get("file"))
                or not _is_int(e.get("size")) or e["size"] < 0
                or not isinstance(e.get("checksum"), str)
                or not _HEX16_RE.fullmatch(e["checksum"])):
            raise bad(f"the index entry of rank {r} is not a valid index file name, size and "
                      "checksum")


def _validate_tensor(fqn: object, t: object, files: dict, world: int, bad,
                     with_chunks: bool | str = True) -> None:
    if not isinstance(fqn, str) or not isinstance(t, dict):
        raise bad("a tensor entry is not a mapping", key=str(fqn))
    isz = DTYPES.get(t.get("dtype")) if isinstance(t.get("dtype"), str) else None
    if isz is None:
        raise bad(f"unknown dtype {t.get('dtype')!r}", key=fqn)
    shape = t.get("shape")
    if (not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(_is_int(n) and 0 <= n < MAX_DIM for n in shape)):
        raise bad(f"shape {shape!r} is not a list of non-negative ints below 2**62", key=fqn)
    if math.prod(shape) >= MAX_DIM:  # (torch's sizes are int64; a zero dim hides none)
        raise bad(f"shape {shape} holds 2**62 elements or more", key=fqn)
    if not with_chunks:
        if "chunks" in t:
            raise bad("a tensor of a manifest with per-rank indexes lists chunks", key=fqn)
        return
    cover = with_chunks is True
    chunks = t.get("chunks")
    if not isinstance(chunks, list):
        raise bad("'chunks' is not a list", key=fqn)
    boxes = []
    for c in chunks:
        if not isinstance(c, dict):
            raise bad("a chunk is not a mapping", key=fqn)
        offs, sizes = c.get("offsets"), c.get("sizes")
        if (not isinstance(offs, list) or not isinstance(sizes, list)
                or len(offs) != len(shape) or len(sizes) != len(shape)
                or not all(_is_int(v) for v in offs + sizes)):
            raise bad(f"chunk offsets {offs!r} / sizes {sizes!r} do not match the shape "
                      f"{shape}", key=fqn)
        if any(o < 0 or s < 0 or o + s > n for o, s, n in zip(offs, sizes, shape)):
            raise bad(f"chunk {offs}+{sizes} lies outside the shape {shape}", key=fqn)
        numel = math.prod(sizes)
        name = c.get("file")
        if not isinstance(name, str) or name not in files:
            raise bad(f"chunk {offs} is in file {name!r}, which the manifest does not list",
                      key=fqn)
        off, length = c.get("offset"), c.get("length")
        if not _is_int(off) or off < 0:
            raise bad(f"chunk {offs} has byte offset {off!r}", key=fqn)
        if not _is_int(length) or length < 0:
            raise bad(f"chunk {offs}+{sizes} has length {length!r}", key=fqn)
        if "codec" in c:  # compressed: ``length`` stored bytes decode to numel x isz
            from ..storage.codec import CodecError, validate_desc
            try:
                validate_desc(c["codec"], numel * isz, length)
            except CodecError as e:
                raise bad(f"chunk {offs}: {e}", key=fqn) from None
        elif length != numel * isz:
            raise bad(f"chunk {offs}+{sizes} has length {length!r}; {numel} x {isz} bytes is "
                      f"{numel * isz}", key=fqn)
        if off + length > files[name]["size"]:
            raise bad(f"chunk {offs} ends at byte {off + length} of {name}, past its recorded "
                      f"size {files[name]['size']}", key=fqn)
        if not _is_int(c.get("rank")) or not 0 <= c["rank"] < world:
            raise bad(f"chunk {offs} has rank {c.get('rank')!r}", key=fqn)
        if not isinstance(c.get("checksum"), str) or not _HEX16_RE.fullmatch(c["checksum"]):
            raise bad(f"chunk {offs} has an invalid checksum {c.get('checksum')!r}", key=fqn)
        if numel:
            boxes.append((offs, sizes))
    want = math.prod(shape)
    per_rank = t.get("per_rank", False)
    if per_rank is not False and per_rank is not True:
        raise bad(f"per_rank is {per_rank!r}", key=fqn)
    # a per-rank tensor holds one full copy per saving rank: each rank's chunks cover it
    groups: dict = {}
    for c, box in zip([c for c in chunks if math.prod(c["sizes"])], boxes):
        groups.setdefault(c["rank"] if per_rank else None, []).append(box)
    counts = {r: sum(math.prod(b[1]) for b in bs) for r, bs in groups.items()} or {None: 0}
    for r, n in counts.items() if cover else ():
        if n != want:
            of = f" of rank {r}" if per_rank else ""
            raise bad(f"the chunks{of} hold {n} of the tensor's {want} elements", key=fqn)
    for bs in groups.values():
        overlap = _first_overlap(bs)
        if overlap is not None:
            (a, sa), (b, sb) = overlap
            raise bad(f"chunks {a}+{sa} and {b}+{sb} overlap", key=fqn)


def _first_overlap(boxes: list) -> tuple | None:
    """Two boxes that share an element, or None (fastckpt/manifest/verify.py: bounded for any
    layout a manifest may hold)."""
    from .verify import first_overlap
    return first_overlap(boxes)


def _validate_tree(tree: object, tensors: dict, bad) -> None:
    """A plain-value skeleton (see fastckpt._tree): JSON values, tagged tuples, non-string
    keys, non-finite floats and tensor references; iterative, depth-limited."""
    stack = [(tree, 1, False)]
    while stack:
        x, depth, is_key = stack.pop()
        if isinstance(x, list):
            if depth > MAX_NESTING:
                raise bad(f"the saved state nests deeper than {MAX_NESTING} levels")
            stack.extend((v, depth + 1, is_key) for v in x)
            continue
        if not isinstance(x, dict):
            continue  # str, int, float, bool, None
        if depth > MAX_NESTING:
            raise bad(f"the saved state nests deeper than {MAX_NESTING} levels")
        tags = [k for k in x if k.startswith("$")]
        if not tags:
            if is_key:
                raise bad("a dict key encodes a mapping")
            stack.extend((v, depth + 1, False) for v in x.values())
            continue
        tag = tags[0]
        if len(x) != 1 or tag not in _PLAIN_TAGS:
            raise bad(f"malformed tagged value {sorted(x)[:4]}")
        v = x[tag]
        if tag == "$tensor":
            if is_key or not isinstance(v, str) or v not in tensors:
                raise bad(f"reference to a tensor {v!r} the manifest does not hold")
        elif tag == "$float":
            if v not in ("nan", "inf", "-inf"):
                raise bad(f"malformed float {v!r}")
        elif tag == "$tuple":
            if not isinstance(v, list):
                raise bad("malformed tuple")
            stack.extend((c, depth + 1, is_key) for c in v)
        else:  # $dict: [[key, value], ...]
            if is_key or not isinstance(v, list) or not all(
                    isinstance(p, list) and len(p) == 2 for p in v):
                raise bad("malformed mapping with non-string keys")
            for k, val in v:
                stack.append((k, depth + 1, True))
                stack.append((val, depth + 1, False))


def flat_clash(tree: object, bad) -> str | None:
    """A name DCP's ``flatten_state_dict`` (every load's, engine/reader.py) gives two values
    of a checked skeleton, else None: it names a value by its key path, keys as ``str(key)``
    (a mapping's keys decoded as a load decodes them), a list's indices when the list holds a
    tensor or a mapping (at any depth, through lists), and joins them with "."."""
    from .values import TENSOR_TAG, skel_items
    memo: dict[int, bool] = {}

    def walked(x: object) -> bool:  # torch's ``not _is_terminal``; depth <= MAX_NESTING
        if isinstance(x, dict):
            return TENSOR_TAG in x or skel_items(x) is not None
        if id(x) not in memo:
            memo[id(x)] = isinstance(x, list) and any(walked(v) for v in x)
        return memo[id(x)]
    seen: set[str] = set()
    stack: list = [((), tree)]
    while stack:
        path, x = stack.pop()
        items = skel_items(x)
        if items is not None:
            try:
                stack.extend((path + (str(k),), v) for k, v in dict(items).items())
            except TypeError:  # a key a load cannot decode ((1, [2]): no dict holds it)
                raise bad("a key of the saved state is not hashable") from None
        elif isinstance(x, list) and walked(x):
            stack.extend((path + (str(i),), v) for i, v in enumerate(x))
        elif ".".join(path) in seen:
            return ".".join(path)
        else:
            seen.add(".".join(path))
    return None


def new_manifest_body(*, step: int, world_size: int, save_id: str, files: dict,
                      tensors: dict, trees: list, user_meta: dict | None = None,
                      torch_version: str = "") -> dict:
    from .. import __version__
    body: dict[str, Any] = {
        "step": int(step),
        "world_size": int(world_size),
        "save_id": save_id,
        "created_unix": time.time(),
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "fastckpt_version": __version__,
        "torch_version": torch_version,
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


def tree_for_rank(body: dict, rank: int, world_size: int, *, file: str,
                  stages: bool = False) -> Any:
    """The plain-value skeleton this rank loads: shared, or its own when values differ by rank.

    ``stages`` (a strict load): at another world size, skeletons that differ only between
    blocks of consecutive ranks, each block of 2 or more sharing one and holding other keys
    than the others (pipeline stages, pp outermost as torchtitan orders its mesh: each
    stage's modules), give rank r its block's,
    the world in as many blocks: a stage restarted on more or fewer data-parallel ranks. A
    rank given another stage's skeleton by a mesh ordered otherwise finds keys it does not
    hold: the strict load's error names them."""
    if "tree" in body:
        return body["tree"]
    trees = body.get("rank_trees")
    if not isinstance(trees, list) or not trees:
        raise CorruptCheckpointError("manifest has neither 'tree' nor 'rank_trees'", file=file)
    if world_size != len(trees) and stages:
        blocks = _tree_blocks(trees)
        if blocks and world_size % blocks == 0:
            return trees[rank // (world_size // blocks) * (len(trees) // blocks)]
    if world_size != len(trees):
        raise StateMismatchError(
            f"this checkpoint holds plain values that differ between its {len(trees)} ranks (for "
            f"example a per-rank data-loader position); it can be loaded by exactly "
            f"{len(trees)} ranks, not {world_size}. Keep per-rank values under the rank's own key "
            "to load at another world size.", file=file)
    return trees[rank]


def _tree_blocks(trees: list) -> int | None:
    """The fewest blocks of consecutive ranks, of 2 ranks or more, within each of which every
    skeleton is the same, and whose skeletons hold different keys (stages hold different
    modules); None when there are none: values per rank (a data position equal on some ranks
    by chance holds the same keys as the others' and is never mapped)."""
    n = len(trees)
    keys = [json.dumps(t, sort_keys=True) for t in trees]  # (once each: thousands of ranks)
    # blocks of `size` ranks hold one skeleton each when `size` divides n and every place
    # where the skeleton changes: the largest such size (the fewest blocks) is their gcd.
    # O(n) (trying every block count was O(n * divisors(n)): 12 s for a crafted manifest of
    # 720720 ranks)
    size = n
    for i in range(1, n):
        if keys[i] != keys[i - 1]:
            size = math.gcd(size, i)
            if size < 2:
                return None
    if size < 2:
        return None
    blocks = n // size
    shapes = {json.dumps(_keys_of(trees[b * size]), sort_keys=True) for b in range(blocks)}
    return blocks if len(shapes) == blocks else None


def _keys_of(tree: Any) -> Any:
    """A skeleton's structure: its dicts' keys (in lists too), the values dropped; plain values
    in lists are values too (per-rank lists of different lengths once passed for stages)."""
    if isinstance(tree, dict):
        return {k: _keys_of(v) for k, v in tree.items()}
    if isinstance(tree, list):
        return [_keys_of(v) for v in tree if isinstance(v, dict)]
    return None


def check_user_meta(meta: dict | None) -> dict:
    """A copy of ``user_meta`` once it is known to be JSON a manifest can hold (else the
    checkpoint could be committed and then refused on load)."""
    if meta is None:
        return {}
    if not isinstance(meta, dict):
        raise TypeError(f"user_meta must be a dict, got {type(meta).__qualname__}")
    try:
        data = json.dumps(meta, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise ValueError(f"user_meta must be plain JSON (str keys, finite numbers): {e}") from None
    if too_deep(meta) is not None:
        raise ValueError(f"user_meta nests deeper than {MAX_NESTING} levels")
    return json.loads(data)
