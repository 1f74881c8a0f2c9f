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

import torch

from ..errors import FastCkptError, StepRemovedError
from ..manifest import schema as fmt
from ..manifest.discovery import find_step
from ..storage import Storage
from . import dist as _dist
from .dtypes import tensor_meta
from .reader import FastCkptReader
from .state import plan_load

log = logging.getLogger("fastckpt")


def alloc_in_phase(body: dict, fqn: str, meta: dict) -> torch.Tensor:
    """A tensor the load creates (e.g. the moments of a freshly built optimizer), placed at an
    address with the same remainder modulo 4096 as its first saved chunk's file offset, so the
    reader can fill it with O_DIRECT without a read buffer or a copy (see
    ``FastCkptReader._direct_ok``). A view into a storage at most 4 KiB larger."""
    shape, dtype = tuple(meta["shape"]), meta["dtype"]
    nbytes = math.prod(shape) * dtype.itemsize
    first = next((c for c in body["tensors"][fqn]["chunks"] if not any(c["offsets"])), None)
    if first is None or nbytes < fmt.ALIGN:
        return torch.empty(shape, dtype=dtype)
    raw = torch.empty(nbytes + fmt.ALIGN, dtype=torch.uint8)
    skip = (int(first["offset"]) - raw.data_ptr()) % fmt.ALIGN
    return raw[skip:skip + nbytes].view(dtype).view(shape)


#: loads of the newest step retried when a writer's retention removed it meanwhile
LOAD_ATTEMPTS = 3


def load_into(storage: Storage, state: dict, *, step: int | None = None, verify: bool = True,
              strict: bool = True) -> int:
    """(all ranks) Load a committed step into ``state`` in place; return the step.

    ``step=None`` loads the newest committed step; if a writer removes it while it is read (its
    retention after committing a newer one), every rank learns it in the same collective and the
    load starts again on the new newest step (LOAD_ATTEMPTS in all). Each attempt overwrites
    every tensor it loads, and plain values and sub-states are put back only at the end.
    """
    for attempt in range(1, LOAD_ATTEMPTS + 1):
        try:
            return _load_once(storage, state, step=step, verify=verify, strict=strict)
        except StepRemovedError as e:
            if step is not None or attempt == LOAD_ATTEMPTS:
                raise
            log.warning("fastckpt: %s; loading the newest step again (attempt %d of %d)", e,
                        attempt + 1, LOAD_ATTEMPTS)
    raise AssertionError("unreachable")  # pragma: no cover


def _load_once(storage: Storage, state: dict, *, step: int | None, verify: bool,
               strict: bool) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    rank, world = _dist.rank(), _dist.world_size()
    err: BaseException | None = None
    plan = reader = None
    found_step = None
    try:
        found_step, d, body = find_step(storage, step)
        mpath = f"{d}/{fmt.MANIFEST}"
        tree = fmt.tree_for_rank(body, rank, world, file=mpath)
        meta = tensor_meta(body, file=mpath)
        reader = FastCkptReader(storage, body=body, step_dir=d, verify=verify, rank=rank)
        reader.check_files()  # the files really hold what the manifest says, before allocating
        plan = plan_load(state, tree, meta, strict=strict,
                         alloc=lambda fqn, m: alloc_in_phase(body, fqn, m))
    except BaseException as e:
        err = e
    # agree before the collective read: one rank's problem must not hang the others
    statuses = _dist.all_gather_object(
        (found_step, None if err is None else f"{type(err).__name__}: {err}",
         isinstance(err, StepRemovedError)))
    steps = {s for s, _, _ in statuses}
    if step is None and ((len(steps) > 1 and None not in steps)
                         or any(removed for _, _, removed in statuses)):
        # a writer committed (and retention removed) between the ranks' listings
        raise StepRemovedError(f"the newest step changed while the ranks looked for it (ranks "
                               f"found steps {sorted(map(str, steps))})", rank=rank) from err
    if err is not None:
        raise err
    bad = [(r, m) for r, (_, m, _) in enumerate(statuses) if m]
    if bad:
        raise FastCkptError("load failed on other ranks: " +
                            "; ".join(f"rank {r}: {m}" for r, m in bad))
    assert plan is not None and reader is not None and found_step is not None
    try:
        with warnings.catch_warnings():  # DCP warns whenever it runs without a process group
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(plan.targets, storage_reader=reader,
                     planner=DefaultLoadPlanner(allow_partial_load=not strict),
                     no_dist=not _dist.initialized())
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
        raise FastCkptError(f"load of step {found_step} failed: {detail or e}") from None
    for fn in plan.finish:
        fn()
    return found_step
