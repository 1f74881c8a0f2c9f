"""Per-rank chunk indexes (format version 4). Torch-free.

A save of many ranks (``CheckpointOptions.rank_indexes``) does not send its chunk lists to the
coordinator: each rank writes them to its own index file next to its shards, durably, before it
reports, and reports only the index's name, size and checksum. The manifest then holds the
tensor table (dtype, shape), the files, the skeleton and one ``indexes`` entry per rank
(``{"file", "size", "checksum"}``: xxh3-64 of the index file's bytes); the coordinator's commit
work is O(N) small entries instead of every chunk of every rank (docs/scale.md).

An index file, ``r<rank>-<save_id>.fci``, is one line of JSON::

    {"format": "fastckpt-index", "rank": 3, "save_id": "3f2a9c1e5b7d",
     "chunks": {"<fqn>": [{"offsets", "sizes", "file", "offset", "length", "checksum"
                           (, "codec")}, ...], ...}}

A reader merges every index into the manifest's tensor table (:func:`expand`) and validates the
result exactly like a version-1 manifest (``schema.validate_body``); an index is accepted only
if its bytes hash to the manifest's checksum, so a manifest pins its indexes: a damaged,
swapped or stale index is an error naming its file and rank.

**Inline chunks** (``body["inline"]``, a version-4 field older readers ignore: they read
every index). A tensor written once (not a DTensor shard, not per rank: a replicated value
such as an optimizer's ``step``, each stored by the one rank the plan gave it to) also lists
its chunks in the manifest, copied by the coordinator from the ranks' commit results; its
writer's index still holds them (a merge checks that the two agree). The
count of such chunks depends on the model, not on the world size. A rank that loads at the
saved world size then reads the manifest and **its own index only** (:func:`read_indexes` with
``own``): its shards of every DTensor are in its index, its per-rank values too, and the
replicated values are inline. The load checks that the chunks it has cover every box it reads
and falls back to every index when they do not (another sharding). At another world size
(:func:`writers_of`) it reads the indexes of the saving ranks whose boxes, cut as torch cuts
them on this mesh scaled to the saved world size, its boxes meet, under the same check.
"""

from __future__ import annotations

import json
import math
import re
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import CorruptCheckpointError
from . import schema as fmt

if TYPE_CHECKING:
    from ..storage import Storage

INDEX_FORMAT = "fastckpt-index"
INDEX_SUFFIX = ".fci"
#: the largest index file read (one rank's chunks; the 70B state of docs/scale.md: ~0.5 MB)
MAX_INDEX_BYTES = 1 << 28
#: index files read at once (object stores: one GET each)
READ_THREADS = 8
_INDEX_RE = re.compile(r"r[0-9]{5,}-[A-Za-z0-9_-]{1,64}" + re.escape(INDEX_SUFFIX))


def index_name(rank: int, save_id: str) -> str:
    return f"r{rank:05d}-{save_id}{INDEX_SUFFIX}"


def is_index_name(name: object) -> bool:
    return isinstance(name, str) and bool(_INDEX_RE.fullmatch(name))


def encode_index(rank: int, save_id: str, files: list[dict]) -> tuple[bytes, dict]:
    """One rank's index file from its written files (``[{"file", "chunks": [{"fqn", ...}]}]``,
    as the writer returns them); the bytes and the manifest's entry for them (without the
    name)."""
    chunks: dict[str, list] = {}
    for f in files:
        for c in f["chunks"]:
            e = {"offsets": c["offsets"], "sizes": c["sizes"], "file": f["file"],
                 "offset": c["offset"], "length": c["length"], "checksum": c["checksum"]}
            if c.get("codec") is not None:
                e["codec"] = c["codec"]
            chunks.setdefault(c["fqn"], []).append(e)
    doc = {"format": INDEX_FORMAT, "rank": rank, "save_id": save_id, "chunks": chunks}
    data = (json.dumps(doc, separators=(",", ":"), allow_nan=False) + "\n").encode()
    return data, {"size": len(data), "checksum": fmt.hexdigest(xxhash.xxh3_64_intdigest(data))}


def writers_of(body: dict, boxes: dict) -> frozenset | None:
    """The saving ranks whose indexes should hold the chunks of ``boxes``: fqn -> (offsets,
    sizes, layout) of a restarted rank's box, ``layout`` its DTensor's ``(mesh shape,
    placements[, stage, blocks])`` (one placement per mesh dim: ``("S", d)`` a ``Shard(d)``,
    ``("T", d, split factor)`` a ``_StridedShard``, ``("R",)`` a ``Replicate``; a mesh of
    every rank in order, or the ``stage``-th of ``blocks`` blocks of consecutive ranks: a
    pipeline stage's) or None for a regular tensor.

    The step was saved by N ranks, the restart runs M. The guess: the saving mesh was this
    mesh with one dim scaled by N / M (each dim that scales to a whole size is tried: FSDP2's
    1-D ``Shard(0)``, the data-parallel dim of FSDP + TP or of HSDP), each box cut as torch
    cuts it (``torch.chunk``: ceil(D / k) per coordinate, nested when two mesh dims shard one
    tensor dim). The ranks whose saved boxes meet this box are read, all of a replicated
    dim's (the replica that wrote a box is elected by the whole group's boxes): ~N / M + 1
    indexes of N under FSDP2. A tensor with inline chunks needs no index; a whole regular
    tensor that is not inline, or a box no guess places, returns None: every index. The guess
    is only a guess: the caller checks that the chunks read cover every box (and reads every
    index when they do not: another mesh, another sharding)."""
    n = body["world_size"]
    inline = body.get("inline") or {}
    out: set[int] = set()
    memo: dict[tuple, frozenset | None] = {}  # (the 70B state: a few keys for 2169 tensors)
    for fqn, (offsets, sizes, layout) in boxes.items():
        t = body["tensors"].get(fqn)
        if fqn in inline or t is None or any(s == 0 for s in sizes):
            continue  # (a tensor the step does not hold: the planner's error, later)
        shape = tuple(t["shape"])
        if layout is None or len(offsets) != len(shape) or len(sizes) != len(shape):
            return None
        key = (shape, tuple(offsets), tuple(sizes), layout)
        if key not in memo:
            memo[key] = _meeting(n, shape, key[1], key[2], *layout)
        if memo[key] is None:
            return None
        out |= memo[key]
    return frozenset(out)


def _meeting(n: int, shape: tuple, offsets: tuple, sizes: tuple, mesh: tuple,
             places: tuple, stage: int = 0, blocks: int = 1) -> frozenset | None:
    """(:func:`writers_of`) The saving ranks of every guessed saving mesh whose boxes meet
    ``offsets``/``sizes``; None where no mesh dim scales to the saved ranks or a placement is
    not one of ours. ``stage`` of ``blocks``: the mesh is the ``stage``-th of ``blocks`` equal
    blocks of consecutive ranks (a pipeline stage's, pp outermost), and so was the saving
    one: of n / ``blocks`` ranks."""
    m = math.prod(mesh)
    if blocks < 1 or n % blocks or not 0 <= stage < blocks:
        return None
    n, base = n // blocks, stage * (n // blocks)
    if m < 1 or len(places) != len(mesh) or not all(
            p == ("R",) or (len(p) == 2 and p[0] == "S" and 0 <= p[1] < len(shape))
            or (len(p) == 3 and p[0] == "T" and 0 <= p[1] < len(shape) and p[2] >= 1)
            for p in places):
        return None
    scaled = [k for k in range(len(mesh)) if mesh[k] * n % m == 0]
    out: set[int] = set()
    for k in scaled:
        saved = (*mesh[:k], mesh[k] * n // m, *mesh[k + 1:])
        out |= _ranks_meeting(shape, offsets, sizes, saved, _refactored(places, mesh, saved))
    return frozenset(base + r for r in out) if scaled else None


def _refactored(places: tuple, mesh: tuple, saved: tuple) -> tuple:
    """A strided shard's split factor on the guessed ``saved`` mesh: FSDP2's is the size of
    the mesh dims after it that shard the same dim (TP's), so it scales with them; one that
    is not that product on this mesh is kept as it is."""
    out = []
    for i, p in enumerate(places):
        if p[0] == "T":
            later = [q for q in range(i + 1, len(places)) if places[q][0] in "ST"
                     and places[q][1] == p[1]]
            if p[2] == math.prod(mesh[q] for q in later):
                p = ("T", p[1], math.prod(saved[q] for q in later))
        out.append(p)
    return tuple(out)


def _ranks_meeting(shape: tuple, offsets: tuple, sizes: tuple, mesh: tuple,
                   places: tuple) -> set[int]:
    """The ranks of ``mesh`` (row-major) whose box of a tensor of ``shape`` under ``places``
    meets the box ``offsets``/``sizes``: per tensor dim, the coordinates of the mesh dims that
    shard it (in mesh order, each cutting what the ones before left, as torch does) whose
    rows meet the box's range; every coordinate of a replicated mesh dim."""
    groups: list[tuple[list[int], list]] = []  # (mesh dims, their coordinates that meet)
    for d in range(len(shape)):
        dims = [i for i, p in enumerate(places) if p[0] in "ST" and p[1] == d]
        if not dims:
            continue
        lo, hi = offsets[d], offsets[d] + sizes[d]
        hits: list = [((), [(0, shape[d])])]  # (partial coordinate, the rows it holds)
        for i in dims:
            sf = places[i][2] if places[i][0] == "T" else None
            nxt = []
            for c, spans in hits:
                js: Any = range(mesh[i])
                if len(spans) == 1:  # contiguous: only the chunks that meet, per split
                    js = sorted({j for x, y in _splits(*spans[0], sf)
                                 for j in _meets(x, y, mesh[i], lo, hi)})
                for j in js:
                    rows = _cut(spans, mesh[i], j, sf)
                    if any(x < hi and lo < y for x, y in rows):
                        nxt.append(((*c, j), rows))
            hits = nxt
        groups.append((dims, [c for c, _ in hits]))
    ranks = {0}
    sharded = {i for dims, _ in groups for i in dims}
    stride = [math.prod(mesh[i + 1:]) for i in range(len(mesh))]
    for i in range(len(mesh)):
        if i not in sharded:  # a replicated dim: every coordinate
            ranks = {r + j * stride[i] for r in ranks for j in range(mesh[i])}
    for dims, hits in groups:
        ranks = {r + sum(j * stride[i] for i, j in zip(dims, c)) for r in ranks for c in hits}
    return ranks


def _splits(a: int, b: int, sf: int | None) -> list:
    """Rows ``[a, b)`` as a ``_StridedShard`` of ``sf`` sees them: ``sf`` splits of
    ceil(L / sf) rows (a ``Shard``: one)."""
    if sf is None:
        return [(a, b)]
    step = -(-(b - a) // sf)
    return [(min(b, a + s * step), min(b, a + (s + 1) * step)) for s in range(sf)]


def _meets(x: int, y: int, k: int, lo: int, hi: int) -> range:
    """The chunks (ceil((y - x) / k) rows each) of rows ``[x, y)`` that meet ``[lo, hi)``."""
    step = -(-(y - x) // k)
    if not step:
        return range(0)
    return range(max(0, (lo - x) // step), min(k, (hi - 1 - x) // step + 1))


def _cut(spans: list, k: int, j: int, sf: int | None) -> list:
    """The rows coordinate ``j`` of ``k`` keeps of ``spans`` (the rows held so far, in local
    order): ``Shard``'s ceil(L / k) chunk, or ``_StridedShard``'s (``sf``): the L rows in
    ``sf`` splits of ceil(L / sf), chunk ``j`` of each split (torch's
    ``_StridedShard.local_shard_size_and_offset``)."""
    out: list = []
    parts = _splits(0, sum(b - a for a, b in spans), sf)
    for s0, s1 in parts:
        step = -(-(s1 - s0) // k)
        p0, p1 = s0 + min(s1 - s0, j * step), s0 + min(s1 - s0, (j + 1) * step)
        pos = 0
        for a, b in spans:  # positions [p0, p1) of the local order, as rows
            x, y = max(p0, pos), min(p1, pos + b - a)
            if x < y:
                out.append((a + x - pos, a + y - pos))
            pos += b - a
    return out


#: an index chunk's fields and their JSON types (the values are checked by validate_body)
_FIELDS = (("offsets", list), ("sizes", list), ("file", str), ("offset", int), ("length", int),
           ("checksum", str))


def _key(c: dict) -> tuple:
    return (tuple(c["offsets"]), tuple(c["sizes"]), c["file"], c["offset"], c["length"],
            c["checksum"], c["rank"], json.dumps(c.get("codec"), sort_keys=True))


def expand(body: dict, docs: list, *, file: str, step_dir: str,
           own: frozenset | None = None) -> dict:
    """The manifest body with every rank's chunks (``docs[r]``: rank r's index bytes) merged
    into its tensor table, validated as a whole; CorruptCheckpointError names the index file
    and rank that is wrong. A tensor with inline chunks (``body["inline"]``) takes them; the
    chunks its writers' indexes list must be the same ones.

    ``own={r, ...}``: only those ranks' indexes are given (``docs[r]``, the others None): the
    body holds the inline chunks and theirs, validated chunk by chunk (``chunks="partial"``):
    a tensor's other boxes are absent."""
    given = body.get("inline") or {}
    inline = set(given)
    tensors = {fqn: {**t, "chunks": []} for fqn, t in body["tensors"].items()}
    seen: dict[str, list] = {fqn: [] for fqn in inline}
    files = body["files"]
    for r, (entry, data) in enumerate(zip(body["indexes"], docs)):
        if data is None and own is not None and r not in own:
            continue
        path = f"{step_dir}/{entry['file']}"

        def bad(msg: str, key: str | None = None) -> CorruptCheckpointError:
            return CorruptCheckpointError(f"invalid chunk index of rank {r}: {msg}", file=path,
                                          key=key)
        if len(data) != entry["size"] or (
                fmt.hexdigest(xxhash.xxh3_64_intdigest(data)) != entry["checksum"]):
            raise bad(f"its {len(data)} bytes do not match the manifest's size {entry['size']} "
                      "and checksum (damaged, or not this save's index)")
        try:
            doc = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError) as e:  # (and an int json refuses: > 4300 digits)
            raise bad(f"not valid JSON ({type(e).__name__})") from None
        if (not isinstance(doc, dict) or doc.get("format") != INDEX_FORMAT
                or doc.get("rank") != r or doc.get("save_id") != body["save_id"]):
            raise bad(f"not the index of rank {r} of save {body['save_id']}")
        chunks = doc.get("chunks")
        if not isinstance(chunks, dict):
            raise bad("'chunks' is not a mapping")
        for fqn, cs in chunks.items():
            t = tensors.get(fqn)
            if t is None:
                raise bad("lists a tensor the manifest does not hold", key=str(fqn))
            if not isinstance(cs, list) or not all(isinstance(c, dict) for c in cs):
                raise bad("its chunk list is not a list of mappings", key=fqn)
            for i, c in enumerate(cs):
                wrong = [k for k, kind in _FIELDS if not isinstance(c.get(k), kind)
                         or isinstance(c.get(k), bool)]
                if wrong:
                    raise bad(f"chunk {i} of the tensor has no valid {wrong[0]!r} (JSON "
                              f"of Python type {type(c.get(wrong[0])).__name__})", key=fqn)
                if files.get(c["file"], {}).get("rank") != r:
                    raise bad(f"chunk {i} of the tensor is in file {c['file']!r}, which is not "
                              f"one of rank {r}'s files in the manifest", key=fqn)
                c["rank"] = r
            (seen[fqn] if fqn in inline else t["chunks"]).extend(cs)
    for fqn in inline:
        listed = tensors[fqn]["chunks"] = [dict(c) for c in given[fqn]]
        if own is not None:  # the indexes read hold their own ranks' writes only
            listed = [c for c in listed if c.get("rank") in own]
        try:
            agree = sorted(map(_key, seen[fqn])) == sorted(map(_key, listed))
        except (KeyError, TypeError, ValueError, RecursionError):
            agree = False
        if not agree:
            raise CorruptCheckpointError(
                "invalid manifest: the chunks it lists for this tensor are not the ones its "
                "writers' indexes list", file=file, key=fqn)
    out = {**body, "tensors": tensors}
    fmt.validate_body(out, file=file, step=body["step"],
                      chunks=True if own is None else "partial")
    return out


def read_indexes(storage: "Storage", step_dir: str, body: dict, *, file: str,
                 own: frozenset | None = None) -> dict | None:
    """Read and merge a version-4 manifest's indexes (:func:`expand`); None when the step was
    removed meanwhile (its manifest is gone: retention or gc removes the manifest first).
    ``own={r, ...}``: those ranks' indexes only (a partial body, see :func:`expand`)."""
    from ..errors import NotRegularFileError, StorageError
    from .discovery import is_missing

    def one(item: tuple[int, dict]) -> bytes | None:
        rank, entry = item
        path = f"{step_dir}/{entry['file']}"
        try:
            n = storage.size(path)
            if n is None:
                return None
            if n != entry["size"] or n > MAX_INDEX_BYTES:
                raise CorruptCheckpointError(
                    f"the chunk index of rank {rank} holds {n} bytes; the manifest says "
                    f"{entry['size']}" + (f" (more than the {MAX_INDEX_BYTES} fastckpt reads)"
                                          if n > MAX_INDEX_BYTES else ""), file=path)
            return storage.read_bytes(path)
        except NotRegularFileError as e:
            raise CorruptCheckpointError(f"the chunk index of rank {rank} is not a regular file "
                                         f"({e})", file=path) from None
        except StorageError as e:
            if is_missing(e):
                return None
            raise
    entries = body["indexes"]
    wanted = list(enumerate(entries)) if own is None else [(r, entries[r]) for r in sorted(own)]
    docs: list = [None] * len(entries)
    if len(wanted) == 1:
        docs[wanted[0][0]] = one(wanted[0])
    elif wanted:
        with ThreadPoolExecutor(max(1, min(READ_THREADS, len(wanted))),
                                thread_name_prefix="fastckpt-index") as ex:
            for (r, _), d in zip(wanted, ex.map(one, wanted)):
                docs[r] = d
    lost = [r for r, _ in wanted if docs[r] is None]
    if lost:
        if storage.size(file) is None:
            return None  # the step was removed while its indexes were read
        names = ", ".join(f"rank {r} ({entries[r]['file']})" for r in lost[:8])
        raise CorruptCheckpointError(
            f"the step's manifest names chunk indexes that are missing: {names}"
            f"{' and more' if len(lost) > 8 else ''}; the step is damaged (an older committed "
            "step still loads)", file=file)
    return expand(body, docs, file=file, step_dir=step_dir, own=own)


def check_listed(body: dict, sizes: dict, *, file: str, step_dir: str) -> None:
    """That every index a version-4 manifest names is in its step directory with the size the
    manifest pins (``sizes``: name -> bytes, one listing of the directory), reading none of
    them: what the step's tools and ``fastckpt resume`` check (their contents, by checksum,
    are the load's and ``verify``'s). CorruptCheckpointError names the first ranks wrong."""
    bad = [(r, e, sizes.get(e["file"])) for r, e in enumerate(body["indexes"])
           if sizes.get(e["file"]) != e["size"]]
    if not bad:
        return
    r, e, got = bad[0]
    what = "is missing" if got is None else f"holds {got} bytes; the manifest says {e['size']}"
    more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
    raise CorruptCheckpointError(
        f"the chunk index of rank {r} ({e['file']}) {what}{more}; the step is damaged (an "
        "older committed step still loads)", file=f"{step_dir}/{e['file']}" if got else file)


def chunk_entry(c: dict, rank: int, file: str) -> dict:
    """A manifest's chunk entry from a chunk of a rank's commit result."""
    e = {"offsets": c["offsets"], "sizes": c["sizes"], "rank": rank, "file": file,
         "offset": c["offset"], "length": c["length"], "checksum": c["checksum"]}
    if c.get("codec") is not None:
        e["codec"] = c["codec"]
    return e


def inline_chunks(tensors: dict, results: list[dict]) -> dict[str, list]:
    """(coordinator, an indexed save) The chunks the manifest lists itself (``inline``): those of
    every tensor written once (not a DTensor, not per rank) whose chunks from the ranks'
    results cover it exactly; each as the index entry plus its rank."""
    out: dict[str, list] = {}
    for r, res in enumerate(results):
        for c in res.get("inline") or ():
            m = tensors.get(c["fqn"])
            if m is None or m.get("dtensor") or m.get("per_rank"):
                continue
            out.setdefault(c["fqn"], []).append(chunk_entry(c, r, c["file"]))
    return {fqn: cs for fqn, cs in out.items()
            if sum(math.prod(c["sizes"]) for c in cs) == math.prod(tensors[fqn]["shape"])}
