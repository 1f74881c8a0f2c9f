"""Which DTensor boxes a rank writes without asking rank 0 (``ChunkSpec.solo``).

A box whose holders follow from its mesh (saving ranks: all of them, or a pipeline stage's)
and placements (shards and replicas) is not sent to rank 0 in a first save's plan exchange
(fastckpt/engine/plan.py): a box one rank holds is written by it, a box R replicas hold by
one of them, chosen the same way on each replica without an exchange (:func:`written`), an
empty box by nobody.
"""

from __future__ import annotations

import torch

from ..errors import UnsupportedStateError


def holders(t: torch.Tensor, world: int) -> tuple:
    """(the hash of a DTensor's mesh and placements, its replicas R, this rank's place among
    them) when the holders of its local box follow from them alone: every placement a
    ``Shard`` (or FSDP2's ``_StridedShard``) or a ``Replicate`` (not ``Partial``), over a mesh
    of saving ranks (of the ``world``) that this rank is in: all of them under FSDP, a
    pipeline stage's under PP + FSDP (torchtitan's ``dp`` sub-mesh; rank 0 refuses a tensor
    that two meshes hold, :func:`plan.make_plans`). The box is then held by this rank alone
    (R = 1) or by the R ranks with its coordinates on the other mesh dims, which elect its
    writer (:func:`elect`) without an exchange; an empty box (uneven shards: several ranks
    can hold the same one) by nobody, the non-empty boxes cover the tensor. Else (None, 0,
    0). The same for every DTensor of a mesh and placements (:func:`chunks.local_chunks` asks
    once for each)."""
    from torch.distributed.tensor.placement_types import Replicate, Shard
    try:
        from torch.distributed.tensor.placement_types import _StridedShard as Strided
    except ImportError:  # (an older torch)
        Strided = Shard
    mesh = t.device_mesh
    where = mesh.get_coordinate()
    ranks = mesh.mesh.tolist()
    if (where is None or mesh.size() > world or int(mesh.mesh.max()) >= world
            or not all(isinstance(p, (Shard, Strided, Replicate)) for p in t.placements)):
        return None, 0, 0
    import xxhash
    shape = tuple(mesh.mesh.shape)
    replicas, mine = 1, 0
    for d, p in enumerate(t.placements):
        if isinstance(p, Replicate):
            replicas, mine = replicas * shape[d], mine * shape[d] + where[d]
    # (the mesh's size after the hash: rank 0 checks every rank of the mesh holds the tensor,
    # :func:`check_held`)
    return (xxhash.xxh3_64_hexdigest(repr(
        (ranks, [repr(p) for p in t.placements])).encode()) + f":{mesh.size()}",
        replicas, mine)


def holders_in(cache: dict, key: tuple, t: torch.Tensor, world: int) -> tuple:
    """:func:`holders` of ``t``, once per ``key`` (``(id(mesh), placements)``) in ``cache``, a
    dict its caller keeps for one pass over a state."""
    got = cache.get(key)
    if got is None:
        got = cache[key] = holders(t, world)
    return got


def elect(fqn: str, offsets: tuple, replicas: int) -> int:
    """Which of a box's ``replicas`` writes it: a hash of the box, the same on every replica
    (each decides alone; balanced over many boxes, not by bytes as rank 0's plan is)."""
    import xxhash
    return xxhash.xxh3_64_intdigest(repr((fqn, tuple(offsets))).encode()) % replicas


def solo_of(s: tuple) -> str | None:
    """A spec's ``solo`` (specs from before it, or built by hand, have 8 fields)."""
    return s[8] if len(s) > 8 else None


def writes(s: tuple) -> bool:
    """Whether this rank writes a solo box by the hash election (by hand: every non-empty
    one)."""
    return bool(s[5]) and (s[9] if len(s) > 9 else True)


def written(specs: list, alike: bool) -> list:
    """The rows of the solo boxes this rank writes. A box its replicas hold: when every
    rank's table was rank 0's (``alike``: each replica group holds the same boxes), the
    replica a greedy gives it, largest boxes first to the least-loaded replica, computed the
    same on each replica (balanced by bytes: the hash alone left a replica 1.23x the mean at 8
    x 8 HSDP of the 70B state); else the hash's (:func:`elect`, each box alone)."""
    rows, groups = [], {}
    for s in specs:
        group = s[10] if len(s) > 10 else ()
        if alike and group and s[5]:
            groups.setdefault((s[8], *group), []).append(s)
        elif writes(s):
            rows.append(s)
    for (_, replicas, mine), boxes in groups.items():
        load = [0] * replicas
        for s in sorted(boxes, key=lambda s: (-s[5], s[0], tuple(s[3]))):
            pick = min(range(replicas), key=lambda k: (load[k], k))
            load[pick] += s[5]
            if pick == mine:
                rows.append(s)
    return [list(s[:7]) + [None] for s in rows]


def mesh_size(solo: str) -> int | None:
    """The number of ranks of the mesh a ``solo`` names (:func:`holders`); None for one
    built by hand without it."""
    _, _, size = str(solo).rpartition(":")
    return int(size) if size.isdigit() else None


def check_held(values: list[dict]) -> None:
    """(rank 0, ``make_plans``) Every rank of a solo tensor's mesh holds it. A rank that leaves
    a DTensor out of its state (the ranks' states have different keys) would leave its boxes
    written by nobody: before 2026-12-07 such a save committed a manifest whose tensor its
    chunks did not cover, which every load then refused as damaged. From the tables: a rank's
    is its own (``own``), rank 0's (None) or the one it names (``own_as``)."""
    n = len(values)
    of = [r if r == 0 or v.get("own") is not None else v.get("own_as") or 0
          for r, v in enumerate(values)]
    users: dict = {}
    for t in of:
        users[t] = users.get(t, 0) + 1
    held: dict = {}  # fqn -> (how many ranks hold it, its mesh)
    for t, k in users.items():
        for fqn, _, _, mesh in values[t].get("own") or ():
            held[fqn] = (held.get(fqn, (0, mesh))[0] + k, mesh)
    for fqn, (count, mesh) in held.items():
        size = mesh_size(mesh)
        if size is None or count == size:
            continue
        tables = {t: {row[0] for row in values[t].get("own") or ()} for t in users}
        meshes = {t: {row[3] for row in values[t].get("own") or ()} for t in users}
        lacking = [r for r in range(n) if mesh in meshes[of[r]] and fqn not in tables[of[r]]]
        who = (f"rank{'s' if len(lacking) > 1 else ''} "
               f"{', '.join(map(str, lacking[:8]))}{' ...' if len(lacking) > 8 else ''} "
               "leave" + ("" if len(lacking) > 1 else "s") + " it out of the state"
               if lacking else "the others leave it out of their states")
        raise UnsupportedStateError(
            f"tensor {fqn!r} is a DTensor on a device mesh of {size} ranks, but {count} of "
            f"them save it: {who}; every rank of its mesh must save it (its boxes would be "
            "written by nobody)")
