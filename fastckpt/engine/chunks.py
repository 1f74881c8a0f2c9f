"""A rank's chunks: each tensor's box of its global tensor, its bytes, its fingerprint and,
above one rank, whether the rank writes it without asking rank 0 (``ChunkSpec.solo``).

(all ranks, training thread, every save) :func:`local_chunks` is the first step of the plan
(fastckpt/engine/plan.py); its time is part of a save's stall.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import UnsupportedStateError
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
#: between ranks; larger ones by three 8 KiB samples (start, middle, end rows)
DIGEST_FULL_MAX = 1 << 20
_SAMPLE = 8 << 10


def digest(t: torch.Tensor) -> str:
    """A content fingerprint of a regular tensor, compared across the ranks that hold it: equal
    everywhere means replicated (written once), else the tensor is per rank (each writes its
    own). Whole for tensors up to DIGEST_FULL_MAX bytes (RNG states, counters, small buffers);
    sampled above that (a per-rank tensor that differs only outside the samples is taken as
    replicated: use a DTensor or a per-rank key for large per-rank data)."""
    import xxhash
    t = t.detach()
    h = xxhash.xxh3_64()
    h.update(repr((tuple(t.shape), str(t.dtype))).encode())
    if t.numel() * t.element_size() <= DIGEST_FULL_MAX:
        parts = [t]
    else:
        rows = sorted({0, t.shape[0] // 2, t.shape[0] - 1}) if t.dim() else []
        parts = [t[i] for i in rows] or [t]
    for part in parts:
        flat = part.reshape(-1)
        if part is not t:
            flat = flat[:max(1, _SAMPLE // max(1, t.element_size()))]
        b = flat.to("cpu").contiguous().view(torch.uint8) if flat.numel() else None
        if b is not None:
            h.update(_raw_view(b.data_ptr(), b.numel()))  # (no numpy needed)
    return h.hexdigest()


def local_chunks(tensors: dict[str, torch.Tensor], *, digests: bool = False, world: int = 1
                 ) -> tuple[list[ChunkSpec], dict]:
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
            dig = digest(local) if digests and not dt else None
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
        if len(chunks) != 1:
            box = None
        else:
            box = boxes[key] = (tuple(chunks[0].offsets), tuple(chunks[0].sizes))
    if box is None or box[1] != tuple(local.shape):
        raise UnsupportedStateError(
            f"DTensor placements {t.placements} give this rank a local tensor that is "
            "not a single box of the global tensor; not supported yet", key=fqn)
    return box
