"""Load: a committed step into the caller's state, in place, through DCP's load planner.

Call sequence (all ranks; see docs/design.md "Load: who does what"): find the step (the
newest valid one unless asked), check its files, plan the destinations (``state.plan_load``),
agree with every rank before the collective read, ``dcp.load`` through ``FastCkptReader``,
then put plain values and sub-states back. A step retired by a writer's retention while it is
read is loaded again from the new newest step, on every rank together.
"""

from __future__ import annotations

import logging
import math
import warnings
from typing import Any

import torch

from ..errors import (CheckpointNotFoundError, CorruptCheckpointError, FastCkptError,
                      StateMismatchError, StepRemovedError, StorageError)
from ..manifest import schema as fmt
from ..manifest.discovery import committed_steps, find_step, is_partial
from ..manifest.index import writers_of
from ..storage import Storage
from ..storage.pyio import huge_pages
from . import dist as _dist
from .chunks import empty_for, held_box, strided
from .dtypes import tensor_meta
from .reader import FastCkptReader
from .readitems import READ_STALL_S
from .state import is_dtensor, plan_load, plan_read

log = logging.getLogger("fastckpt")


def alloc_in_phase(body: dict, fqn: str, meta: dict, like: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """A tensor the load creates (e.g. the moments of a freshly built optimizer), placed at an
    address with the same remainder modulo 4096 as its saved chunk's file offset, so the
    reader can fill it with O_DIRECT without a read buffer or a copy (see
    ``FastCkptReader._direct_ok``). A view into a storage at most 4 KiB larger, advised to
    transparent huge pages from 4 MiB on (``pyio.huge_pages``). An allocation that fails (a
    crafted shape, too little memory) is a CorruptCheckpointError naming the tensor.

    ``like``: a DTensor (an FSDP2 parameter) the new tensor is laid out like: a DTensor on the
    same mesh and placements whose local shard is allocated this way, in phase with the saved
    chunk that holds exactly this rank's shard if there is one (saved at the same world size)."""
    shape, dtype = tuple(meta["shape"]), meta["dtype"]
    offsets: tuple = (0,) * len(shape)
    if like is not None:
        from torch.distributed.tensor import DTensor
        box = _box(like)
        if box is None:  # a layout we do not know
            return torch.empty_like(like)
        local = _alloc_local(body, fqn, box[1], box[0], dtype)
        return DTensor.from_local(local, like.device_mesh, like.placements, run_check=False,
                                  shape=like.shape, stride=like.stride())
    return _alloc_local(body, fqn, shape, offsets, dtype)


def _alloc_local(body: dict, fqn: str, shape: tuple, offsets: tuple,
                 dtype: torch.dtype) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    at = [c for c in body["tensors"][fqn]["chunks"] if tuple(c["offsets"]) == offsets]
    chunk = next((c for c in at if tuple(c["sizes"]) == shape), at[0] if at else None)
    if chunk is None or nbytes < fmt.ALIGN or int(chunk["offset"]) % dtype.itemsize:
        # (a chunk at an offset out of step with its elements cannot be mirrored: before
        # 2026-12-06 the view of such memory raised torch's error, naming nothing)
        return empty_for(shape, dtype, key=fqn)
    raw = empty_for(shape, dtype, pad=fmt.ALIGN, key=fqn)
    huge_pages(raw.data_ptr(), raw.numel())  # (the prefault thread faults them, 2 MiB each)
    skip = (int(chunk["offset"]) - raw.data_ptr()) % fmt.ALIGN
    return raw[skip:skip + nbytes].view(dtype).view(shape)


#: loads of the newest step retried when a writer's retention removed it meanwhile
LOAD_ATTEMPTS = 3


def load_into(storage: Storage, state: dict | None, *, step: int | None = None,
              verify: bool = True, strict: bool = True, group: "_dist.Group | None" = None,
              timeout_s: float = 120.0) -> tuple[int, dict]:
    """(all ranks) Load a committed step into ``state`` in place; (the step, ``state``).
    ``state=None``: the whole checkpoint into a new dict (``fastckpt.read``).

    ``step=None`` loads the newest committed step; if a writer removes it while it is read (its
    retention after committing a newer one), every rank learns it in the same collective and the
    load starts again on the new newest step (LOAD_ATTEMPTS in all). Each attempt overwrites
    every tensor it loads, and plain values and sub-states are put back only at the end.
    """
    group = group if group is not None else _dist.Group()
    storage = storage.per_call(READ_STALL_S)  # (a local mount that stops answering: raises)
    own = state is not None  # first each rank reads only its own chunk index (if indexed)
    attempt = fallbacks = 0
    cur = step
    damage: CorruptCheckpointError | None = None  # the newer step's, once one fell back
    while True:
        attempt += 1
        seen: dict = {}
        try:
            return _load_once(storage, state, step=cur, verify=verify, strict=strict,
                              group=group, timeout_s=timeout_s, own=own, seen=seen)
        except _ReadEveryIndex:  # every rank, together: the ranks' own-index reads disagreed
            own = False
            attempt -= 1
            continue
        except StepRemovedError as e:
            if cur is not None or attempt == LOAD_ATTEMPTS:
                _raise_after(e, damage)
            log.warning("fastckpt: %s; loading the newest step again (attempt %d of %d)", e,
                        attempt + 1, LOAD_ATTEMPTS)
        except CorruptCheckpointError as e:
            # the newest step's data is damaged (every rank raises this class alike): a
            # resume loads the newest older step (LOAD_ATTEMPTS in all), with a warning naming
            # the damage; not for a step asked for by number, a whole read, or strict=False (a
            # key of the damaged step the older one lacks would keep the damaged step's value)
            failed = seen.get("step")
            older = None if (step is not None or state is None or not strict or failed is None
                             or fallbacks == LOAD_ATTEMPTS) else _newest_below(storage, failed)
            # rank 0's choice for every rank (each rank's own listing could differ: before
            # 2026-12-06 the ranks could load different older steps)
            older = group.decide(older, _first, timeout_s=timeout_s,
                                 what="load: the older step to fall back to")
            if older is None:
                _raise_after(e, damage)
            damage = damage or e
            fallbacks += 1
            log.warning("fastckpt: step %d does not load (%s); loading step %d, the newest "
                        "older committed step", failed, e, older)
            cur, attempt = older, attempt - 1
        except Exception as e:
            _raise_after(e, damage)


def _first(values: list) -> Any:
    return values[0]


def _raise_after(e: BaseException, damage: CorruptCheckpointError | None) -> None:
    """Raise ``e``; after a fall back from a damaged step, say that the state holds part of it
    (before 2026-12-06 only a log line said the newer step was damaged)."""
    if damage is None or e is damage:
        raise e
    try:
        new = type(e)(f"{e} (after falling back from a damaged newer step: {damage}; the state "
                      "may hold part of that step's values)")
    except Exception:  # noqa: BLE001 - a class that takes other arguments: the cause says it
        raise e from damage
    raise new from damage


def _newest_below(storage: Storage, below: int) -> int | None:
    """The newest step older than ``below`` whose manifest reads back valid, or None."""
    return next((s for s in committed_steps(storage, newest_first=True, chunks=False)
                 if s < below), None)


class _ReadEveryIndex(Exception):
    """(every rank alike) The own-index load did not agree: load again reading every index."""


class IndexSelector:
    """(read_manifest's ``own``) Which saving ranks' chunk indexes this rank reads first, from
    the manifest's body without chunks: at the saved world size its own (its shards of every
    DTensor and its per-rank values are there, the replicated values inline), and when those
    do not cover its boxes, with those of the replicas elected to write its replicated DTensor
    boxes (``more``, :func:`electors`); at another
    world size (a restart on fewer or more nodes) the ranks whose boxes it meets on its mesh
    scaled to the saved world size (``index.writers_of``: ~N/M + 1 indexes of N under FSDP2),
    or every index when a box cannot be placed (a whole tensor that is not inline, a mesh of
    some ranks, a strided shard, a layout that fails). Cached per save: ``find_step`` may ask
    again."""

    def __init__(self, state: dict, rank: int, world: int, strict: bool) -> None:
        self.state, self.rank, self.world, self.strict = state, rank, world, strict
        self._seen: dict[str, frozenset | None] = {}
        #: (at the saved world size) the other ranks whose indexes to read too (``electors``)
        self.more: frozenset = frozenset()

    def __call__(self, body: dict) -> frozenset | None:
        if body["world_size"] == self.world:
            return frozenset({self.rank}) | self.more
        key = body["save_id"]
        if key not in self._seen:
            try:
                boxes = self._boxes(body)
            except Exception as e:  # noqa: BLE001 - the full read names what is wrong
                log.debug("fastckpt: rank %d: no index selection (%s)", self.rank, e)
                boxes = None
            self._seen[key] = None if boxes is None else writers_of(body, boxes)
        return self._seen[key]

    def _targets(self, body: dict) -> dict:
        """The tensors this rank loads (planned without allocating)."""
        tree = fmt.tree_for_rank(body, self.rank, self.world, file=fmt.MANIFEST,
                                 stages=self.strict)
        meta = tensor_meta(body, file=fmt.MANIFEST)
        return plan_load(self.state, tree, meta, strict=self.strict, alloc=_dry_alloc).targets

    def _boxes(self, body: dict) -> dict | None:
        """fqn -> (offsets, sizes, layout: ``index.writers_of``'s (mesh shape, placements),
        None for a regular tensor) of every tensor this rank loads; None where a DTensor's
        layout is one we do not know (a mesh of some ranks or out of order, a strided shard)."""
        targets = self._targets(body)
        boxes: dict[str, tuple] = {}
        layouts: dict = {}  # (id(mesh), placements) -> layout, or False: unknown
        cut: dict = {}  # (id(mesh), placements, global shape) -> box (torch's, ~14-40 us)
        for fqn, t in targets.items():
            if not isinstance(t, torch.Tensor):
                continue
            layout = None
            if is_dtensor(t):
                key = (id(t.device_mesh), tuple(t.placements))
                if key not in layouts:
                    layouts[key] = _layout(t.device_mesh, t.placements, self.world)
                layout, key = layouts[key], (*key, tuple(t.shape))
                box = cut[key] if key in cut else cut.setdefault(key, _box(t))
            else:
                box = _box(t)
            if box is None or layout is False:
                return None
            boxes[fqn] = (*box, layout)
        return boxes


def _layout(mesh: Any, placements: tuple, world: int) -> tuple | bool:
    """(IndexSelector) A DTensor's (mesh shape, placements, stage, blocks) as
    ``index.writers_of`` takes them: its mesh is block ``stage`` of ``blocks`` blocks of
    consecutive ranks (every rank: 0 of 1; a pipeline stage's sub-mesh, pp outermost as
    torchtitan orders it: stage of pp). False for another mesh (ranks out of order, pp not
    outermost) or a placement that is not a ``Shard``, ``_StridedShard`` or ``Replicate``."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard
    ranks = mesh.mesh.flatten().tolist()
    size, base = len(ranks), ranks[0] if ranks else 0
    if (not size or world % size or base % size or ranks != list(range(base, base + size))):
        return False
    places: list[tuple] = []
    for p in placements:
        if type(p) is Shard:
            places.append(("S", p.dim))
        elif type(p) is _StridedShard:  # FSDP2's dim under TP's shard of the same dim
            places.append(("T", p.dim, p.split_factor))
        elif type(p) is Replicate:
            places.append(("R",))
        else:
            return False
    return tuple(mesh.mesh.shape), tuple(places), base // size, world // size


def electors(targets: dict, rank: int, world: int) -> frozenset:
    """(at the saved world size) The other ranks that may have written boxes this rank loads
    into ``targets``' DTensors: a box replicated over ``Replicate`` mesh dims (HSDP, TP's
    norms) is written by one of its replicas (``solo.written``), so it is in that rank's
    index, not this one's: the replicas of each such DTensor (R - 1 ranks per mesh and
    placements; empty when the state has no such DTensor)."""
    from .solo import holders_in
    out: set[int] = set()
    meshes: dict = {}
    for t in targets.values():
        if not is_dtensor(t) or not any(p.is_replicate() for p in t.placements):
            continue
        box = _box(t)
        solo, replicas, _ = holders_in(meshes, (id(t.device_mesh), tuple(t.placements)), t,
                                       world)
        if box is None or solo is None or replicas < 2 or not math.prod(box[1]):
            continue
        mesh = t.device_mesh
        ranks = mesh.mesh
        for d, p in enumerate(t.placements):  # the other coordinates fixed: the replicas
            if not p.is_replicate():
                ranks = ranks.narrow(d, mesh.get_coordinate()[d], 1)
        out.update(int(r) for r in ranks.flatten().tolist())
    return frozenset(out) - {rank}


def _box(t: torch.Tensor) -> tuple[tuple, tuple] | None:
    """(offsets, sizes) of the box of the global tensor this rank loads into ``t``: its local
    shard of a DTensor, a whole regular tensor; None for a DTensor layout we do not know."""
    if not is_dtensor(t):
        return (0,) * t.dim(), tuple(t.shape)
    if strided(t):  # (torch's box is its first rows only: see chunks.held_box)
        box = held_box(t)
        return box if box is not None and box[1] == tuple(t.to_local().shape) else None
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    if tuple(sizes) != tuple(t.to_local().shape):
        return None
    return tuple(offsets), tuple(sizes)


def _prepare(storage: Storage, state: dict | None, step: int | None, *, verify: bool,
             strict: bool, rank: int, world: int, own: bool,
             sel: IndexSelector | None = None) -> tuple:
    """(this rank) Find the step, check its files, plan the destinations: (step, reader,
    plan, state). ``own``: of an indexed step, read the manifest and the indexes
    ``IndexSelector`` names (at the saved world size this rank's own); if the chunks they
    hold do not cover every box this rank loads (another sharding), read the step again with
    every index."""
    if own and state is not None and sel is None:
        sel = IndexSelector(state, rank, world, strict)
    sel = sel if own and state is not None else None
    found_step, d, body = find_step(storage, step, own=sel)
    partial = sel is not None and is_partial(body, sel)
    mpath = f"{d}/{fmt.MANIFEST}"
    tree = fmt.tree_for_rank(body, rank, world, file=mpath, stages=strict)
    meta = tensor_meta(body, file=mpath)
    reader = FastCkptReader(storage, body=body, step_dir=d, verify=verify, rank=rank,
                            world_size=world, partial=partial, tree=tree)
    reader.check_per_rank()
    # (plan_load makes no collective call: a rank may plan twice, or on another step than
    # its peers, before the agreement that follows)
    targets = (plan_load(state, tree, meta, strict=strict, alloc=_dry_alloc).targets
               if partial and state is not None else None)
    if targets is not None and not _covered(reader, targets):
        more = (electors(targets, rank, world) if body["world_size"] == world
                and not sel.more else frozenset())
        if more:  # the replicas that wrote its replicated boxes: their indexes, not every one
            sel.more = more
            return _prepare(storage, state, found_step, verify=verify, strict=strict,
                            rank=rank, world=world, own=True, sel=sel)
        log.info("fastckpt: step %d: the chunk indexes rank %d read first (of saving ranks %s) "
                 "do not hold every box it loads; reading every rank's index", found_step,
                 rank, sorted(sel(body) or ()))
        return _prepare(storage, state, found_step, verify=verify, strict=strict, rank=rank,
                        world=world, own=False)
    reader.check_files()  # the files really hold what the manifest says, before allocating
    alloc = lambda fqn, m, like=None: alloc_in_phase(body, fqn, m, like)  # noqa: E731
    if state is None:  # the whole checkpoint, as saved
        state, plan = plan_read(tree, meta, alloc=alloc)
    else:
        plan = plan_load(state, tree, meta, strict=strict, alloc=alloc)
    _check_own_copies(body, plan.targets, rank, mpath)
    return found_step, reader, plan, state


def _check_own_copies(body: dict, targets: dict, rank: int, mpath: str) -> None:
    """A per-rank tensor this rank loads holds this rank's whole copy. Validation checks the
    copies that are there, not that every rank's is; before 2026-12-06 a rank without one
    loaded nothing into that tensor and reported success."""
    for fqn in targets:
        t = body["tensors"].get(fqn)
        if t is None or not t.get("per_rank"):
            continue
        have = sum(math.prod(c["sizes"]) for c in t["chunks"] if c.get("rank") == rank)
        if have != math.prod(t["shape"]):
            raise CorruptCheckpointError(
                f"the tensor holds a value per rank and the checkpoint has "
                f"{'no' if not have else 'only part of'} rank {rank}'s", file=mpath, key=fqn,
                rank=rank)


def _dry_alloc(fqn: str, meta: dict, like: torch.Tensor | None = None) -> torch.Tensor:
    """plan_load's allocator for the coverage check of a partial body: nothing allocated
    (a crafted shape must not allocate before the files are checked): the DTensor the new
    tensor would be laid out like, or a tensor on the meta device."""
    if like is not None:
        return like
    return torch.empty(tuple(meta["shape"]), dtype=meta["dtype"], device="meta")


def _covered(reader: FastCkptReader, targets: dict) -> bool:
    """Whether the chunks of ``reader``'s (partial) body cover every box of ``targets`` this
    rank reads: its local shard of a DTensor, a whole regular tensor (its own copy of a
    per-rank one). The chunks of one tensor do not overlap (validated), so a box is covered
    when the volumes of its intersections with them add up to its own."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    md = reader.read_metadata().state_dict_metadata
    for fqn, t in targets.items():
        saved = md.get(fqn)
        if not isinstance(saved, TensorStorageMetadata):
            continue  # not a stored tensor: the planner's own error (or a partial load)
        box = _box(t)
        if box is None:
            return False  # a layout we do not know: read everything
        offsets, sizes = box
        want = math.prod(sizes)
        have = 0
        for c in saved.chunks:
            n = 1
            for o, s, co, cs in zip(offsets, sizes, c.offsets, c.sizes):
                n *= max(0, min(o + s, co + cs) - max(o, co))
            have += n
        if have != want:
            return False
    return True


def _load_once(storage: Storage, state: dict | None, *, step: int | None, verify: bool,
               strict: bool, group: "_dist.Group", timeout_s: float,
               own: bool = False, seen: dict | None = None) -> tuple[int, dict]:
    """One attempt; ``seen["step"]``: the step every rank that found one found."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    rank, world = group.rank, group.world_size
    err: BaseException | None = None
    plan = reader = None
    found_step = None
    try:
        found_step, reader, plan, state = _prepare(storage, state, step, verify=verify,
                                                   strict=strict, rank=rank, world=world,
                                                   own=own)
    except BaseException as e:
        err = e
    # agree before the collective read: one rank's problem must not hang the others
    # (to rank 0 alone, which answers with the summary: O(N) where a gather is O(N^2))
    agreed = group.decide(
        [found_step, None if err is None else f"{type(err).__name__}: {err}",
         isinstance(err, StepRemovedError),
         isinstance(err, (CorruptCheckpointError, CheckpointNotFoundError))],
        _agreement, timeout_s=timeout_s, what="load: the agreement before the collective read")
    steps = agreed["steps"]
    known = {s for s in steps if s is not None}
    if seen is not None and len(known) == 1:
        seen["step"] = next(iter(known))
    if own and (len(steps) > 1 or agreed["damaged"]):
        # a rank whose own index is damaged skipped the step (or failed on it) where the
        # others, which did not read that index, took it: decide again, every rank reading
        # every index, so that all skip (or all fail on) the same damaged step as they did
        # before own-index loads (any other error is raised as it is, below)
        raise _ReadEveryIndex()
    if step is None and ((len(steps) > 1 and None not in steps) or agreed["removed"]):
        # a writer committed (and retention removed) between the ranks' listings
        raise StepRemovedError(f"the newest step changed while the ranks looked for it (ranks "
                               f"found steps {sorted(map(str, steps))})", rank=rank) from err
    if err is not None:
        raise err
    bad, n_bad = agreed["bad"], agreed["n_bad"]
    if n_bad:
        more = f"; and {n_bad - len(bad)} more rank(s)" if n_bad > len(bad) else ""
        # (a damaged checkpoint everywhere it failed: the same class on every rank, so that
        # a tiered resume loads the step from the other tier on all of them alike)
        raise (CorruptCheckpointError if agreed.get("corrupt") else FastCkptError)(
            "load failed on other ranks: " + "; ".join(f"rank {r}: {m}" for r, m in bad) + more)
    assert plan is not None and reader is not None and found_step is not None
    if world == 1 and _read_whole_tensors(reader, plan.targets):
        apply_loaded(plan, found_step, rank)
        return found_step, state
    try:
        with warnings.catch_warnings():  # DCP warns whenever it runs without a process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(plan.targets, storage_reader=reader,
                     planner=DefaultLoadPlanner(allow_partial_load=not strict),
                     no_dist=not group.collective)
    except CheckpointException as e:  # a BaseException in DCP: turn it into ours
        failures = {r: (x[0] if isinstance(x, tuple) else x)  # (exception, traceback)
                    for r, x in (getattr(e, "failures", {}) or {}).items()}
        mine = failures.get(rank)
        removed = [x for x in failures.values() if isinstance(x, StepRemovedError)]
        if removed:  # every rank sees the same failures: all retry together
            raise (mine if isinstance(mine, StepRemovedError) else removed[0]) from None
        if isinstance(mine, FastCkptError):
            raise mine from None
        detail = "; ".join(f"rank {r}: {type(x).__name__}: {x}"
                           for r, x in sorted(failures.items()))
        # another rank read a damaged chunk (or its storage failed): the same class here as
        # there (a tiered resume falls back to the other tier on every rank alike)
        kind = next((k for k in (CorruptCheckpointError, StorageError)
                     if any(isinstance(x, k) for x in failures.values())), FastCkptError)
        raise kind(f"load of step {found_step} failed: {detail or e}") from None
    apply_loaded(plan, found_step, rank)
    return found_step, state


def apply_loaded(plan: Any, step: int, rank: int) -> None:
    """The plan's last part, after every tensor was read in place: each sub-state's
    ``load_state_dict`` (a module's, an optimizer's, a Stateful's) and the plain values, in
    order. A failure is a StateMismatchError naming the key and saying that the tensors hold
    the checkpoint's values already (before 2026-12-06: torch's bare error, naming nothing)."""
    for fn in plan.finish:
        try:
            fn()
        except FastCkptError:
            raise
        except Exception as e:
            key = getattr(fn, "key", None)
            raise StateMismatchError(
                f"step {step}: {key!r} did not take the loaded values ({type(e).__name__}: "
                f"{e}); every tensor of the state was read in place already and holds the "
                "checkpoint's values (a model's weights too): build the state again before "
                "retrying", rank=rank) from e


class _Resolver:
    """The two methods of a DCP ``LoadPlanner`` that ``FastCkptReader.read_data`` calls."""

    def __init__(self, targets: dict) -> None:
        self.targets = targets

    def resolve_tensor(self, req: Any) -> torch.Tensor:
        return self.targets[req.dest_index.fqn]

    def commit_tensor(self, req: Any, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, req: Any, value: Any) -> None:  # pragma: no cover - none planned
        raise AssertionError("no plain value is read through the fast path")


def _read_whole_tensors(reader: FastCkptReader, targets: dict) -> bool:
    """(one process) Read the targets without DCP's planning machinery when every one is a
    whole regular tensor stored as one whole chunk (no resharding to plan): the same reads and
    checks, a few milliseconds less per load (what a small state's load is made of). False,
    having read nothing, when a target does not qualify."""
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem
    tensors = reader.body["tensors"]
    items = []
    for fqn, t in targets.items():
        if t.numel() == 0:  # nothing to read (and several empty chunks share one offset)
            continue
        saved = tensors.get(fqn)
        chunks = [c for c in saved["chunks"] if not saved.get("per_rank")
                  or c["rank"] == reader.rank] if saved else []
        if (is_dtensor(t) or len(chunks) != 1 or any(chunks[0]["offsets"])
                or list(chunks[0]["sizes"]) != list(t.shape)):
            return False
        zeros = torch.Size([0] * t.dim())
        index = MetadataIndex(fqn, zeros)
        items.append(ReadItem(type=LoadItemType.TENSOR, dest_index=index, dest_offsets=zeros,
                              storage_index=index, storage_offsets=zeros,
                              lengths=torch.Size(t.shape)))
    reader.set_up_storage_reader(reader.read_metadata(), True)
    reader.read_data(LoadPlan(items), _Resolver(targets)).wait()
    return True


#: at most this many ranks' load errors travel in the agreement's answer
AGREE_NAMED_MAX = 8


def _agreement(statuses: list) -> dict:
    """(rank 0, ``Group.decide``) What every rank needs of the ranks' load statuses
    ``[found step, error or None, step removed, damaged or missing checkpoint]``: the
    distinct steps found, whether a step was removed under a rank, whether a rank found a
    damaged (or no) checkpoint, and the first ranks that failed with their errors."""
    bad = [[r, s[1]] for r, s in enumerate(statuses) if s[1]]
    return {"steps": list(dict.fromkeys(s[0] for s in statuses)),
            "removed": any(s[2] for s in statuses),
            "damaged": any(s[3] for s in statuses if len(s) > 3),
            "corrupt": bool(bad) and all(len(s) > 3 and s[3] for s in statuses if s[1]),
            "bad": bad[:AGREE_NAMED_MAX], "n_bad": len(bad)}
