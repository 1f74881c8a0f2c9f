"""A rank's chunks: each tensor's box of its global tensor, its bytes, its fingerprint and,
above one rank, whether the rank writes it without asking rank 0 (``ChunkSpec.solo``).

(all ranks, training thread, every save) :func:`local_chunks` is the first step of the plan
(fastckpt/engine/plan.py); its time is part of a save's stall.

(load) :func:`queue_read` groups the read items of one saved chunk (each chunk is read once)
and refuses two different chunks at one file offset; :func:`empty_for` allocates a tensor the
manifest sized, a failure a fastckpt error.

(``fastckpt convert``) :func:`batches` and :func:`write_chunks`: chunks read from a source
checkpoint, written as shard files through ``fastckpt.dcp.Writer``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from ..errors import CorruptCheckpointError, UnsupportedStateError
from ..storage.pyio import _raw_view
from .dtypes import dtype_name
from .solo import elect, holders_in
from .state import is_dtensor


@dataclass(frozen=True)
class ChunkSpec:
    """One chunk a rank holds: a box of a (global) tensor."""
    fqn: str
    dtype: str
    shape: tuple  # global shape
    offsets: tuple
    sizes: tuple
    nbytes: int
    dtensor: bool
    digest: str | None = None  # regular tensors, more than one rank: see digest()
    #: a DTensor box whose holders follow from its mesh (saving ranks) and placements
    #: (shards and replicas, the tensor not empty): their hash; not sent to rank 0 (make_plans)
    solo: str | None = None
    #: (solo) this rank writes it: not empty, and elected among its replicas by a hash
    #: (:func:`solo.elect`, when the ranks' tables differ; else :func:`solo.written`)
    writes: bool = True
    #: (solo, replicated) (its replicas R, this rank's place among them)
    replicas: tuple = ()


#: regular (non-DTensor) tensors up to this size are hashed whole to find those that differ
#: between ranks; larger ones by WINDOWS windows of WINDOW bytes spread evenly over their
#: elements, plus the last WINDOW bytes (``fingerprint="full"``: every one whole)
DIGEST_FULL_MAX = 1 << 20
WINDOWS = 32
WINDOW = 1 << 10


def _windows(t: torch.Tensor, k: int) -> list:
    """Views of ``t`` (or a copy of at most 1 MiB of it): ``k`` runs of WINDOW bytes at evenly
    spaced places of its elements in order, and its last run. One strided view for a tensor
    that flattens without a copy (contiguous or 1-D); else 8 evenly spaced rows (gathered
    into one tensor when they are small, else each sampled on its own)."""
    if t.dim() == 0:
        return [t.reshape(1)]
    if t.dim() == 1 or t.is_contiguous():
        flat = t.reshape(-1)  # (a view for both)
        n, w = flat.numel(), max(1, WINDOW // max(1, t.element_size()))
        if n <= (k + 1) * w:
            return [flat]
        step, s0 = (n - w) // (k - 1), flat.stride(0)
        runs = flat.as_strided((k, w), (step * s0, s0), flat.storage_offset())
        return [runs, flat[n - w:]]
    rows, m = t.shape[0], min(8, k)
    picks = sorted({round(i * (rows - 1) / (m - 1)) for i in range(m)}) if rows > 1 else [0]
    if t.numel() // max(1, rows) * len(picks) * t.element_size() <= DIGEST_FULL_MAX:
        # the picked rows gathered into one small tensor (one copy), sampled as a whole
        return _windows(t.index_select(0, torch.tensor(picks, device=t.device)), k)
    return [v for r in picks for v in _windows(t[r], max(2, k // len(picks)))]


def digest(t: torch.Tensor, full: bool = False) -> str:
    """A content fingerprint of a regular tensor, compared across the ranks that hold it: equal
    everywhere means replicated (written once), else the tensor is per rank (each writes its
    own). Whole for tensors up to DIGEST_FULL_MAX bytes (RNG states, counters, small buffers)
    and with ``full``; above that sampled (:func:`_windows`: 33 KiB of it), so a per-rank tensor
    that differs only between the samples is taken as replicated: use a DTensor or a per-rank
    key for large per-rank data, or ``CheckpointOptions(fingerprint="full")``."""
    import xxhash
    t = t.detach()
    h = xxhash.xxh3_64()
    h.update(repr((tuple(t.shape), str(t.dtype))).encode())
    if not t.numel():
        return h.hexdigest()
    parts = [t] if full or t.numel() * t.element_size() <= DIGEST_FULL_MAX else \
        _windows(t, WINDOWS)
    for part in parts:
        b = part.to("cpu").contiguous().reshape(-1).view(torch.uint8)
        h.update(_raw_view(b.data_ptr(), b.numel()))  # (no numpy needed)
    return h.hexdigest()


def local_chunks(tensors: dict[str, torch.Tensor], *, digests: bool = False, world: int = 1,
                 full: bool = False) -> tuple[list[ChunkSpec], dict]:
    """This rank's chunks and, per (fqn, offsets), the local tensor holding the data; with
    ``digests`` (more than one rank) each regular tensor's spec carries :func:`digest`; with
    ``world`` (the ranks saving) a DTensor box only this rank holds is marked ``solo``.

    Runs on the training thread in every save (part of the async stall): a DTensor's box is
    torch's own computation (``__create_chunk_list__``, 14-40 us measured) once per mesh,
    placements and global shape, and its holders (:func:`solo.holders`) once per mesh and
    placements; the 70B state's 2169 DTensors have 6 (placements, shape) keys."""
    specs, data = [], {}
    meshes: dict = {}  # (id(mesh), placements) -> holders
    boxes: dict = {}  # (id(mesh), placements, global shape) -> (offsets, sizes)
    with torch.no_grad():  # (to_local is then the local tensor itself, no autograd node)
        for fqn, t in tensors.items():
            dtype = dtype_name(t.dtype)
            dt = is_dtensor(t)
            solo, elected, group = None, True, ()
            if dt:
                local = t.to_local()
                key = (id(t.device_mesh), tuple(t.placements))
                offsets, sizes = _box(t, local, (*key, tuple(t.shape)), boxes, fqn)
                shape = tuple(t.shape)
            else:
                local = t.detach()
                offsets, sizes, shape = (0,) * t.dim(), tuple(t.shape), tuple(t.shape)
            if local.is_conj() or local.is_neg():
                # a lazily conjugated or negated view: its memory holds the unconjugated
                # values, which a write from memory (zero-copy, the capped pool's C copy)
                # would store as they lie. Materialise it (a new tensor: the user's stays)
                local = local.resolve_conj().resolve_neg()
            nbytes = local.numel() * local.element_size()
            dig = digest(local, full) if digests and not dt else None
            if world > 1 and dt and t.numel():
                solo, replicas, place = holders_in(meshes, key, t, world)
                elected = bool(nbytes) and (replicas == 1
                                            or elect(fqn, offsets, replicas) == place)
                group = (replicas, place) if replicas > 1 else ()
            specs.append(ChunkSpec(fqn, dtype, shape, offsets, sizes, nbytes, dt, dig,
                                   solo, elected, group))
            data[(fqn, offsets)] = local
    return specs, data


def _box(t, local: torch.Tensor, key: tuple, boxes: dict, fqn: str) -> tuple:
    """A DTensor's local box (offsets, sizes), from torch, computed once per ``key`` in one
    :func:`local_chunks`: it depends on the global shape, the mesh (this rank's coordinate)
    and the placements alone. A local tensor of a subclass with its own chunk list is asked
    each time."""
    box = boxes.get(key)
    if box is None or hasattr(local, "__create_chunk_list__"):
        if any(p.is_partial() for p in t.placements):
            raise UnsupportedStateError(
                f"DTensor placements {t.placements} hold a pending reduction (Partial): each "
                "rank's local tensor is a summand, not a box of the tensor; reduce it first "
                "(.redistribute(..., [Replicate()]) or .full_tensor())", key=fqn)
        chunks = t.__create_chunk_list__()
        if len(chunks) != 1 or (strided(t) and held_box(t) is None):
            box = None
        else:
            box = boxes[key] = (tuple(chunks[0].offsets), tuple(chunks[0].sizes))
    if box is None or box[1] != tuple(local.shape):
        raise UnsupportedStateError(
            f"DTensor placements {t.placements} give this rank a local tensor that is "
            "not a single box of the global tensor; not supported yet", key=fqn)
    return box


def strided(t) -> bool:
    """Whether a DTensor has a ``_StridedShard`` placement (FSDP2 + TP's)."""
    return any(type(p).__name__ == "_StridedShard" for p in t.placements)


def held_box(t) -> tuple | None:
    """(offsets, sizes) of the global rows a DTensor's local tensor holds, composed placement
    by placement as torch does (``_get_shard_size_and_offsets``: the exact global indexes
    along each sharded dim, strided ones included); None when they are not one box.

    torch's box (``__create_chunk_list__``, ``compute_local_shape_and_global_offset``) keeps
    only each dim's first index: right for FSDP2 + TP's ``[_StridedShard(0, sf), Shard(0)]``,
    whose rows end contiguous, but a ``_StridedShard`` that is not undone by a later mesh dim
    (``[_StridedShard(0, split_factor=2)]`` on a mesh of 4: rows 1 and 5 of 8 on rank 1) is
    reported as rows 1-2. Before 2026-12-06 such a tensor was saved under that box (boxes of
    two ranks overlapping, rows in the wrong places) and loaded into one the same way."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor._utils import _get_shard_size_and_offsets
    from torch.distributed.tensor.placement_types import _StridedShard
    mesh, coord = t.device_mesh, t.device_mesh.get_coordinate()
    if coord is None:
        return None
    sizes, rows = list(t.shape), [None] * t.dim()
    for m, p in enumerate(t.placements):
        if isinstance(p, (Shard, _StridedShard)):
            n, at = _get_shard_size_and_offsets(sizes[p.dim], mesh.size(m), coord[m], p,
                                                rows[p.dim], t.shape[p.dim], False)
            sizes[p.dim], rows[p.dim] = n, at if n else torch.arange(0)
    offsets = []
    for d, r in enumerate(rows):
        first = int(r[0]) if r is not None and len(r) else 0
        if r is not None and len(r) and not torch.equal(
                r, torch.arange(first, first + len(r), dtype=r.dtype)):
            return None
        offsets.append(first)
    return tuple(offsets), tuple(sizes)


# ------------------------------------------------------------------------------------- load

def queue_read(by_chunk: dict, item: tuple, body: dict, step_dir: str, rank: int) -> bool:
    """(FastCkptReader.read_data) Add a read item ``(req, fqn, chunk entry, destination)`` to
    ``by_chunk`` under its chunk's (file, offset): the items of one chunk share one read (a
    tensor's tied keys, the boxes of several destinations that meet one saved chunk). False
    for an empty chunk (nothing to read: the caller commits it at once).

    Only the same chunk is shared (an equal entry, the same dtype): a crafted manifest whose
    chunks of two tensors start at one offset would give the second the first one's bytes,
    dtype and checksum, so it is refused (CorruptCheckpointError naming both, file and
    offset). Chunks that overlap otherwise are each read and checked on their own (``fastckpt
    verify`` reports the overlap)."""
    _, fqn, c, target = item
    if not int(c["length"]) and not target.numel():
        return False
    key = (c["file"], int(c["offset"]))
    reqs = by_chunk.setdefault(key, [])
    if reqs:
        first, a = reqs[0][1], reqs[0][2]
        tensors = body["tensors"]
        if a is not c and (a != c or tensors[first]["dtype"] != tensors[fqn]["dtype"]):
            raise CorruptCheckpointError(
                f"chunk {c['offsets']}+{c['sizes']} of tensor {fqn!r} starts where chunk "
                f"{a['offsets']}+{a['sizes']} of tensor {first!r} does: two chunks cannot "
                "share bytes", file=f"{step_dir}/{key[0]}", key=fqn, offset=key[1], rank=rank)
    reqs.append(item)
    return True


def empty_for(shape: Any, dtype: torch.dtype, *, pad: int = 0, **where: Any) -> torch.Tensor:
    """``torch.empty(shape, dtype)`` of a tensor whose size a checkpoint's manifest declares
    (``pad``: instead its bytes and ``pad`` more, as uint8, to place it in phase): an allocation
    that fails (too large for this machine's memory, a shape torch refuses) raises
    CorruptCheckpointError naming the tensor (``where``: key=, file=, rank=) and the bytes
    asked for, not the allocator's RuntimeError."""
    n = math.prod(shape) * dtype.itemsize
    try:
        if pad:
            return torch.empty(n + pad, dtype=torch.uint8)
        return torch.empty(shape, dtype=dtype)
    except (RuntimeError, MemoryError, OverflowError, TypeError, ValueError) as e:
        detail = (str(e).splitlines() or [""])[0][:200]  # (torch's messages hold a C++ trace)
        raise CorruptCheckpointError(
            f"cannot allocate the {n} bytes (shape {list(shape)}, {dtype}) the manifest "
            f"declares: {type(e).__name__}: {detail} (a crafted or damaged manifest, or too "
            "little memory)", **where) from e


# ---------------------------------------------------------------------------------- convert

def write_chunks(writer: Any, batch: list) -> list:
    """(convert) Read ``batch``'s chunks (``fqn dtype shape offsets sizes load``: ``load()``
    reads one from the source) and write them as shard files through ``writer`` (a
    ``fastckpt.dcp.Writer``); the written chunks, as (fqn, chunk entry)."""
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex,
                                                       TensorProperties)
    from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                      WriteItemType)
    data, items = {}, []
    for c in batch:
        data[(c.fqn, c.offsets)] = c.load()
        offsets = torch.Size(c.offsets)
        items.append(WriteItem(
            index=MetadataIndex(c.fqn, offsets), type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, torch.Size(c.sizes)),
                                        properties=TensorProperties(dtype=c.dtype),
                                        size=torch.Size(c.shape))))
    planner = SimpleNamespace(  # what fastckpt.dcp.Writer asks of a DCP save planner
        resolve_data=lambda item: data[(item.index.fqn, tuple(item.tensor_data.chunk.offsets))])
    results = writer.write_data(SavePlan(items), planner).wait()
    return [(wr.index.fqn, ch) for wr in results for ch in wr.storage_data["chunks"]]


def batches(chunks: list, limit: int):
    """(convert) ``chunks`` in batches of at most ``limit`` bytes (``nbytes``; a larger chunk
    alone)."""
    batch, size = [], 0
    for c in chunks:
        if batch and size + c.nbytes > limit:
            yield batch
            batch, size = [], 0
        batch.append(c)
        size += c.nbytes
    if batch:
        yield batch
