"""fastckpt as PyTorch Lightning's checkpoint storage (Lightning 2.6, the ``lightning`` package).

    import fastckpt.lightning
    from lightning.pytorch.callbacks import ModelCheckpoint

    trainer = Trainer(plugins=[fastckpt.lightning.CheckpointIO()],
                      callbacks=[ModelCheckpoint(dirpath="ckpt", save_top_k=2, monitor="loss",
                                                 save_last=True, every_n_train_steps=100),
                                 fastckpt.lightning.RNGCallback()])
    trainer.fit(model, ckpt_path="last")       # or a path ModelCheckpoint reported

**Path mapping.** Every path Lightning names (``ckpt/epoch=0-step=100.ckpt``, ``ckpt/last.ckpt``,
``trainer.save_checkpoint(path)``) is a fastckpt root *directory* that holds one committed step:
the checkpoint's ``global_step`` (0 when the dict has none). Saving a path again commits the new
step, then removes the others (a crash in between leaves both; a load takes the one committed
last). ``remove_checkpoint(path)`` (ModelCheckpoint dropping a top-k entry) deletes the root,
manifests first. So ``save_top_k``/``save_last`` keep exactly the roots ModelCheckpoint keeps, and
``ckpt_path="last"`` finds ``last.ckpt`` as it finds a file. One root per path, not one root for
the directory: ModelCheckpoint saves its top-k path and ``last.ckpt`` at the same global step,
with different contents; two paths never share a step.

Call sequence (who calls what; Lightning decides):

1. (rank 0 under DDP; the one process on a single device)
   ``CheckpointIO.save_checkpoint(checkpoint, path)``: ``checkpoint`` is checked and its
   containers copied (never changed, even on failure: a value fastckpt cannot store raises
   ``UnsupportedStateError`` naming its key before anything is written), then saved alone
   (``collective=False``: DDP saves on rank 0 only; a collective save would wait, until
   ``plan_timeout_s``, for ranks that never come) and blocking (written straight from the
   tensors on a local disk).
2. (rank 0) ``remove_checkpoint(path)``: waits for a save of that path still running in another
   thread (AsyncCheckpointIO), bounded by ``commit_timeout_s``, then deletes the root.
3. (every rank) ``load_checkpoint(path)``: the path's step, as a new dict of CPU tensors and
   plain values (nothing is unpickled).

``ModelParallelStrategy`` (FSDP2/tensor parallel): every rank calls ``save_checkpoint``; the
sharded state goes through ``torch.distributed.checkpoint.save`` with ``fastckpt.dcp.Writer``
(DCP plans, fastckpt writes and commits), and loads collectively through the engine (resharding
through DCP's planner). ``RNGCallback`` puts every rank's random generators in the checkpoint.
``load_from_checkpoint(Model, path)`` replaces ``Model.load_from_checkpoint(path)`` (which
reads the path with ``torch.load``). See docs/integrations/lightning.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
import warnings
from typing import Any, Callable, Iterator

import torch
from lightning.fabric.plugins import CheckpointIO as _CheckpointIOBase
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy as _ModelParallelStrategy

from . import retention
from .checkpointer import ONE_SHOT_STAGING_CAP, one_shot
from .engine import dist as _dist
from .engine.dtypes import tensor_meta
from .errors import (CheckpointNotFoundError, FastCkptError, StateMismatchError,
                     UnsupportedStateError)
from .manifest import schema as fmt
from .manifest.discovery import list_steps, read_manifest
from .lightning_values import (DCP_ENCODING, from_json, lists, map_tensors, plain_copy, to_dcp,
                               to_json)
from .manifest.values import decode_value, skel_items, skel_seq
from .options import CheckpointOptions, options_from_env
from .rng import RNGState
from .storage import Storage, open_storage

__all__ = ["CheckpointIO", "RNGCallback", "ModelParallelStrategy", "load_from_checkpoint"]

log = logging.getLogger("fastckpt")

#: options the integration decides itself (see the module docstring)
_FIXED = {"keep_last": "a path holds one step; ModelCheckpoint's save_top_k decides what is kept",
          "collective": "Lightning calls the CheckpointIO on rank 0 only under DDP",
          "grace_s": "preemption is not handled through Lightning's CheckpointIO",
          "preempt": "preemption is not handled through Lightning's CheckpointIO"}


class CheckpointIO(_CheckpointIOBase):
    """Lightning's ``CheckpointIO`` on fastckpt: ``Trainer(plugins=[CheckpointIO()])``.

    ``options``: fastckpt options (``commit_timeout_s``, ``native``, ``direct_io``, ``verify``,
    ``zero_copy``, ``staging_cap_bytes``, ...; see :class:`fastckpt.CheckpointOptions`),
    validated here. ``storage_options``: passed to fsspec for remote paths (``s3://...``).
    ``convert(key, value)``: called for each value fastckpt cannot store (key: its dotted key
    path), returns plain data to save instead (returning ``value`` itself declines); None
    (default): such a value is an ``UnsupportedStateError`` naming the key.

    Thread-safe: saves, loads and removals may come from the training thread and from
    ``AsyncCheckpointIO``'s worker; saves of one path run one at a time, and a load or removal
    of a path waits for a save of it in progress (each wait at most ``commit_timeout_s``).
    """

    def __init__(self, *, convert: Callable[[str, Any], Any] | None = None,
                 storage_options: dict | None = None, **options: Any) -> None:
        super().__init__()
        for name, why in _FIXED.items():
            if name in options:
                raise ValueError(f"fastckpt.lightning.CheckpointIO sets {name!r} itself ({why})")
        # the options a save will use (FASTCKPT_* first, then these): a bad one fails here
        self.options = options_from_env(CheckpointOptions()).with_changes(**options)
        self._overrides = dict(options)
        self.convert = convert
        self.storage_options = storage_options
        self._cond = threading.Condition()
        self._saving: dict[str, int] = {}  # roots with a save in progress

    # -- Lightning's interface ------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Any | None = None) -> None:
        """Save ``checkpoint`` as the one step of the root ``path`` (blocking, committed when it
        returns). ``checkpoint`` is never changed."""
        if storage_options is not None:
            raise TypeError("fastckpt.lightning.CheckpointIO takes no per-call storage_options; "
                            "pass CheckpointIO(storage_options=...) (fsspec) or fastckpt "
                            "options to the constructor")
        root = _root(path)
        step = _step_of(checkpoint)
        state = plain_copy(checkpoint, self.convert)  # raises before anything is written
        with self._in_flight(root):
            _replace_link(root)
            _refuse_file(root)
            opts = {"staging_cap_bytes": ONE_SHOT_STAGING_CAP, **self._overrides}
            with one_shot(root, collective=False, storage_options=self.storage_options,
                              **opts) as ck:
                ck.save(state, step=step, block=True,
                        user_meta={"lightning": {"global_step": step, "version": str(
                            checkpoint.get("pytorch-lightning_version", ""))}})
                retire_others(ck.storage, step)  # after the commit: never fails the save

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint saved at ``path`` as a new dict (tensors on the CPU, or moved to
        ``map_location`` when it is a device). ``weights_only`` is accepted and has no effect:
        nothing is ever unpickled."""
        root = _root(path)
        if map_location is not None and not isinstance(map_location, (str, torch.device)):
            raise TypeError("fastckpt.lightning.CheckpointIO.load_checkpoint: map_location may be "
                            f"a device or None (got {type(map_location).__name__}); tensors are "
                            "loaded on the CPU")
        self._wait_idle(root)
        _refuse_file(root)
        storage = self._open(root)
        step = current_step(storage)
        with one_shot(storage, collective=False, **self._overrides) as ck:
            out = ck.read(step=step)
        if map_location is not None:
            out = map_tensors(out, lambda t: t.to(map_location))
        return out

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint at ``path``: its steps (manifest first, so a crash leaves no
        committed step with files missing), then the directory. A link is removed, never
        followed; a regular file there (a checkpoint Lightning's own IO wrote) is removed."""
        root = _root(path)
        self._wait_idle(root)
        if "://" not in root and (os.path.islink(root) or os.path.isfile(root)):
            os.remove(root)
            return
        storage = self._open(root)
        for _, d in list_steps(storage):
            retention.remove_step(storage, d)
        storage.remove_dir(storage.root)

    # -- helpers --------------------------------------------------------------------------------
    def _open(self, root: str) -> Storage:
        return open_storage(root, io_mode=self.options.native, direct_io=self.options.direct_io,
                            storage_options=self.storage_options,
                            remote=self.options.remote_settings())

    @contextlib.contextmanager
    def _in_flight(self, root: str) -> Iterator[None]:
        """A save of ``root`` runs inside: after any other save of it (one writer per root)."""
        with self._cond:
            self._wait_idle_locked(root)
            self._saving[root] = 1
        try:
            yield
        finally:
            with self._cond:
                del self._saving[root]
                self._cond.notify_all()

    def _wait_idle(self, root: str) -> None:
        with self._cond:
            self._wait_idle_locked(root)

    def _wait_idle_locked(self, root: str) -> None:
        deadline = time.monotonic() + self.options.commit_timeout_s
        while root in self._saving:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"a save of {root} is still running after "
                                   f"{self.options.commit_timeout_s:g} s (commit_timeout_s)")
            self._cond.wait(left)


def load_from_checkpoint(cls: type, path: Any, map_location: Any | None = None,
                         strict: bool | None = None, *, checkpoint_io: CheckpointIO | None = None,
                         **kwargs: Any) -> Any:
    """``cls.load_from_checkpoint(path, ...)`` for a path fastckpt saved (Lightning's own reads
    the path with ``torch.load`` and fails on a fastckpt directory): a new ``cls`` (a
    LightningModule or LightningDataModule class) built from the checkpoint's hyperparameters
    (``kwargs`` override them) with its weights loaded, as Lightning builds it
    (``lightning.pytorch.core.saving._load_state``). ``map_location``: None or a device;
    ``checkpoint_io``: the CheckpointIO that reads it (default ``CheckpointIO()``)."""
    import lightning.pytorch as pl
    from lightning.pytorch.core.saving import _load_state
    from lightning.pytorch.utilities.migration.utils import _pl_migrate_checkpoint
    io = checkpoint_io if checkpoint_io is not None else CheckpointIO()
    checkpoint = io.load_checkpoint(path, map_location=map_location)
    if "pytorch-lightning_version" not in checkpoint or "state_dict" not in checkpoint:
        raise FastCkptError(f"{_root(path)} holds no Lightning checkpoint (no "
                            "'pytorch-lightning_version' or 'state_dict' key)", file=_root(path))
    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=_root(path))
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return _load_state(cls, checkpoint, **kwargs)
    if not issubclass(cls, pl.LightningModule):
        raise TypeError(f"load_from_checkpoint builds a LightningModule or LightningDataModule, "
                        f"not a {cls.__qualname__}")
    model = _load_state(cls, checkpoint, strict=strict, **kwargs)
    return model if map_location is None else model.to(map_location)


# ------------------------------------------------------------------------------ path and values

def _root(path: Any) -> str:
    text = os.fspath(path) if not isinstance(path, str) else path
    if "://" in text:
        return text.rstrip("/")
    return os.path.abspath(text)


def _step_of(checkpoint: dict) -> int:
    """The step a checkpoint is saved as: Lightning's ``global_step``, else 0 (a plain state
    dict, e.g. the weights ``ddp_spawn`` hands back to the main process)."""
    if not isinstance(checkpoint, dict):
        raise UnsupportedStateError(f"a Lightning checkpoint is a dict, got "
                                    f"{type(checkpoint).__qualname__}")
    step = checkpoint.get("global_step", 0)
    if isinstance(step, torch.Tensor) and step.numel() == 1:
        step = int(step.item())
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"checkpoint['global_step'] must be a non-negative int, got {step!r}")
    return step


def _replace_link(root: str) -> None:
    """A local path that is a symbolic link (``save_last="link"`` makes ``last.ckpt`` one, to a
    top-k checkpoint) is removed, not followed: the save goes into a new directory there, as
    Lightning's own IO replaces the link with a file (before 2026-12-06 the save went into the
    link's target, whose step retention then removed)."""
    if "://" not in root and os.path.islink(root):
        os.unlink(root)


def _refuse_file(root: str) -> None:
    if "://" not in root and os.path.isfile(root):
        raise FastCkptError(
            f"{root} is a file (a checkpoint written by Lightning's own CheckpointIO?); "
            "fastckpt keeps each checkpoint path as a directory: load that file with "
            "Lightning's TorchCheckpointIO, or save under another name", file=root)


# --------------------------------------------------------------------------- one step per root

def current_step(storage: Storage) -> int:
    """The step a path holds: its committed step, or, when a crash left several, the one
    committed last (the manifest's ``created_unix``). CheckpointNotFoundError when none."""
    found = []
    for s, d in list_steps(storage):
        body = read_manifest(storage, d, step=s)
        if body is not None:
            found.append((float(body.get("created_unix", 0.0)), s))
    if not found:
        raise CheckpointNotFoundError(f"no fastckpt checkpoint at {storage.root}",
                                      file=storage.root)
    return max(found)[1]


def retire_others(storage: Storage, step: int) -> list[int]:
    """After ``step`` was committed: remove every other step of the root (manifest first). A
    failure is logged, not raised (the save is committed; the next save of the path finishes
    it; a load meanwhile takes the step committed last)."""
    removed = []
    try:
        for info in retention.scan(storage):
            if info.step != step:
                retention.remove_step(storage, info.path)
                removed.append(info.step)
    except (FastCkptError, OSError) as e:
        log.warning("fastckpt.lightning: could not remove the earlier steps of %s: %s",
                    storage.root, e)
    return removed


# ------------------------------------------------------------------------------ random generators

class RNGCallback(Callback):
    """Saves every rank's random generators (Python, NumPy, torch CPU and CUDA:
    :class:`fastckpt.RNGState`) in the checkpoint and gives each rank its own back on resume,
    so that dropout and data shuffling continue bit-exact. Works with any CheckpointIO.

    Its ``state_dict`` runs on every rank when Lightning dumps a checkpoint (``save_checkpoint``
    is called on every rank) and gathers the ranks' states through the c10d store, waiting at
    most ``timeout_s`` (``CollectiveTimeoutError`` naming the ranks that did not come). Resumed
    with another number of ranks, the generators are left as they are, with a warning. Not
    thread-safe (the generators are process-wide): Lightning calls it from the training thread.
    """

    def __init__(self, *, timeout_s: float = 120.0) -> None:
        self.timeout_s = float(timeout_s)
        self._group: _dist.Group | None = None

    def _ranks(self) -> _dist.Group:
        # created when first needed (the process group is up), in the same order on every rank
        if self._group is None or self._group.world_size != _dist.world_size():
            self._group = _dist.Group(collective=True, name="fastckpt.lightning.RNGCallback")
        return self._group

    def state_dict(self) -> dict[str, Any]:
        # lists, not tuples (RNGState takes either back): DCP does not look inside tuples
        mine = lists(RNGState().state_dict())
        group = self._ranks()
        if group.world_size == 1:
            return {"world_size": 1, "ranks": [mine]}
        # every rank holds the same value (saved once); through rank 0: O(N) store commands
        ranks = group.decide(to_json(mine), _every, timeout_s=self.timeout_s,
                             what="RNGCallback: every rank's random generators")
        return {"world_size": len(ranks), "ranks": [from_json(r) for r in ranks]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        group = self._ranks()
        ranks = state_dict.get("ranks", [])
        if len(ranks) != group.world_size:
            warnings.warn(f"fastckpt.lightning.RNGCallback: the checkpoint holds the random "
                          f"generators of {len(ranks)} ranks, this run has {group.world_size}: "
                          "they are not restored (training continues, not bit-exact)",
                          stacklevel=2)
            return
        # fresh tensors: a loaded one may be a view at an offset into a larger buffer (the
        # engine places tensors for direct reads), and torch.set_rng_state crashes on those
        RNGState().load_state_dict(map_tensors(ranks[group.rank], torch.clone))


# ------------------------------------------------------------------------- ModelParallelStrategy

class ModelParallelStrategy(_ModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` (FSDP2, tensor parallelism) whose sharded
    checkpoints are fastckpt checkpoints, at the same paths, with the same mapping as
    :class:`CheckpointIO`: ``Trainer(strategy=fastckpt.lightning.ModelParallelStrategy(...))``.

    Save (every rank): the checkpoint is split, without changing it, into the sharded model
    state, ``optimizer_<i>`` and ``lightning`` (everything else, checked as by CheckpointIO);
    the ranks agree (within ``plan_timeout_s``) that every rank's part can be stored, then
    ``torch.distributed.checkpoint.save(..., storage_writer=fastckpt.dcp.Writer(path, step))``;
    rank 0 then removes the path's other steps. Load (every rank): one collective engine load
    of the model, the optimizers and the rest (DCP's planner reshards). Only
    ``save_distributed_checkpoint=True`` (the default) is supported. ``checkpoint_io``: the
    CheckpointIO whose options, ``convert`` and removals it uses (default ``CheckpointIO()``).
    Not thread-safe, as Lightning's strategies: the trainer calls it from the training thread.
    """

    def __init__(self, *args: Any, checkpoint_io: CheckpointIO | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if not self._save_distributed_checkpoint:
            raise ValueError("fastckpt.lightning.ModelParallelStrategy saves sharded checkpoints "
                             "only (save_distributed_checkpoint=True)")
        self.checkpoint_io = checkpoint_io if checkpoint_io is not None else CheckpointIO()
        self._agree: _dist.Group | None = None

    def _fio(self) -> CheckpointIO:
        io = self.checkpoint_io
        while not isinstance(io, CheckpointIO) and getattr(io, "checkpoint_io", None) is not None:
            io = io.checkpoint_io  # a wrapping CheckpointIO
        return io if isinstance(io, CheckpointIO) else CheckpointIO()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any | None = None) -> None:
        import torch.distributed.checkpoint as dcp

        from .dcp import _WRITER_OPTIONS, Writer
        if storage_options is not None:
            raise TypeError("fastckpt.lightning.ModelParallelStrategy takes no storage_options")
        fio = self._fio()
        root = _root(self.broadcast(str(filepath)))
        error = None
        state: dict[str, Any] = {}
        try:
            step = _step_of(checkpoint)
            if self.global_rank == 0:
                _replace_link(root)  # (the others see it after the agreement)
            if not os.path.islink(root):  # (rank 0 replaces it: not a file whatever it names)
                _refuse_file(root)
            state = {"state_dict": checkpoint["state_dict"]}
            for i, osd in enumerate(checkpoint.get("optimizer_states", [])):
                state[f"optimizer_{i}"] = osd
            rest = {k: v for k, v in checkpoint.items()
                    if k not in ("state_dict", "optimizer_states")}
            # tagged: DCP's flattening would str() its keys and drop its empty containers
            state["lightning"] = to_dcp(plain_copy(rest, fio.convert, ()))
            state["lightning_encoding"] = DCP_ENCODING
        except (FastCkptError, OSError, TypeError, ValueError, KeyError) as e:
            error = e
        self._agree_or_raise(error, fio, f"save of {root}")
        # (the DCP path plans and stages itself: only the Writer's options go along)
        kept = {k: v for k, v in fio._overrides.items() if k in _WRITER_OPTIONS}
        dcp.save(state, storage_writer=Writer(root, step=step, storage_options=fio.storage_options,
                                              **kept))
        if self.global_rank == 0:
            retire_others(fio._open(root), step)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        fio = self._fio()
        root = _root(self.broadcast(str(checkpoint_path)))
        assert self.lightning_module is not None and self.model is not None
        error = None
        state: dict[str, Any] = {}
        rest: dict[str, Any] = {}
        try:
            _refuse_file(root)
            storage = fio._open(root)
            step = current_step(storage)
            d = storage.join(fmt.step_dirname(step))
            body = read_manifest(storage, d, step=step)
            if body is None:  # removed since it was listed
                raise CheckpointNotFoundError(f"no fastckpt checkpoint at {root}", file=root)
            mpath = f"{d}/{fmt.MANIFEST}"
            saved = dict(skel_items(fmt.tree_for_rank(body, self.global_rank, self.world_size,
                                                      file=mpath)) or [])
            meta = tensor_meta(body, file=mpath)

            def alloc(fqn: str) -> torch.Tensor:
                return torch.empty(meta[fqn]["shape"], dtype=meta[fqn]["dtype"])
            strict = self.lightning_module.strict_loading
            _check_model_keys(self.model, saved.get("state_dict"), strict, mpath)
            whole = "lightning" not in saved  # written by CheckpointIO: the Lightning dict
            if whole:
                rest = {k: decode_value(v, alloc) for k, v in saved.items() if k != "state_dict"}
                names = _whole_optimizers(saved, self.optimizers, self.model, mpath)
                state = {"state_dict": self.model, **rest}
            else:
                encoding = decode_value(saved.get("lightning_encoding"))
                if encoding not in (None, DCP_ENCODING):
                    raise FastCkptError(f"the 'lightning' part is encoded as {encoding!r}, which "
                                        "this fastckpt does not know (a newer version wrote it)",
                                        file=mpath)
                rest = decode_value(saved["lightning"], alloc)
                state = {"state_dict": self.model, "lightning": rest}
                for i, optim in enumerate(self.optimizers):
                    if f"optimizer_{i}" in saved:
                        state[f"optimizer_{i}"] = optim
        except (FastCkptError, OSError, TypeError, ValueError, KeyError) as e:
            error = e
        self._agree_or_raise(error, fio, f"load of {root}")
        with one_shot(storage, collective=True, **fio._overrides) as ck:
            ck.load(state, step=step, strict=False)  # the model's keys were checked above
        if whole:  # the optimizer states as Lightning's own strategy loads a full checkpoint
            from torch.distributed.checkpoint.state_dict import (StateDictOptions,
                                                                 set_optimizer_state_dict)
            for optim, osd, ids in zip(self.optimizers, rest.pop("optimizer_states", []), names):
                set_optimizer_state_dict(self.model, optim, _by_name(osd, ids), options=(
                    StateDictOptions(full_state_dict=True, strict=strict)))
            return rest
        # (decoded once the tensors are in: the tags of to_dcp, on the part as it was saved)
        return decode_value(rest) if encoding == DCP_ENCODING else rest

    def _agree_or_raise(self, error: BaseException | None, fio: CheckpointIO, what: str) -> None:
        """Every rank learns whether every rank can go on (bounded by plan_timeout_s), so that
        one rank's refusal never leaves the others waiting in DCP's collectives."""
        if self._agree is None:
            self._agree = _dist.Group(collective=True, name="fastckpt.lightning.mp")
        mine = None if error is None else f"{type(error).__name__}: {error}"
        bad = self._agree.decide(mine, _failed, timeout_s=fio.options.plan_timeout_s,
                                 what=what)
        if error is not None:
            raise error
        if bad:
            raise FastCkptError(f"{what} failed on other ranks: " +
                                "; ".join(m if r is None else f"rank {r}: {m}" for r, m in bad))


def _every(values: list) -> list:
    """(rank 0, ``Group.decide``) every rank's value, in rank order."""
    return values


def _failed(statuses: list) -> list:
    """(rank 0, ``Group.decide``) ``[rank, error]`` of the first 8 ranks that failed, and
    ``[None, "and N more rank(s)"]`` after them when there were more."""
    bad = [[r, m] for r, m in enumerate(statuses) if m]
    return bad[:8] + ([[None, f"and {len(bad) - 8} more rank(s)"]] if len(bad) > 8 else [])


def _whole_optimizers(saved: dict, optimizers: list, model: torch.nn.Module,
                      file: str) -> list[dict]:
    """For a checkpoint CheckpointIO wrote (each optimizer's state as torch's ``state_dict``,
    parameters by index): each optimizer's ``{saved index: parameter FQN}``, matched by
    position in the param groups as ``Optimizer.load_state_dict`` matches them. Raises
    StateMismatchError when the groups differ from this run's optimizers'."""
    from .engine.state import _param_fqns
    saved_osds = skel_seq(saved.get("optimizer_states"))
    if not optimizers:
        return []
    if saved_osds is None or len(saved_osds) != len(optimizers):
        n = "no" if saved_osds is None else len(saved_osds)
        raise StateMismatchError(
            f"this checkpoint (written by fastckpt.lightning.CheckpointIO) holds {n} optimizer "
            f"state(s), this run has {len(optimizers)} optimizer(s)", file=file)
    fqns = _param_fqns(model)
    out = []
    for i, (optim, skel) in enumerate(zip(optimizers, saved_osds)):
        groups = decode_value(dict(skel_items(skel) or []).get("param_groups"))
        sizes = ([len(g["params"]) for g in groups] if isinstance(groups, list) and all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups) else None)
        want = [len(g["params"]) for g in optim.param_groups]
        if sizes != want:
            raise StateMismatchError(
                f"optimizer {i}: the checkpoint's param groups hold {sizes} parameters, this "
                f"run's {want}", file=file)
        if any(id(p) not in fqns for h in optim.param_groups for p in h["params"]):
            raise StateMismatchError(f"optimizer {i} holds a parameter that is not the model's",
                                     file=file)
        out.append({k: fqns[id(p)] for g, h in zip(groups, optim.param_groups)
                    for k, p in zip(g["params"], h["params"])})
    return out


def _by_name(osd: dict, ids: dict) -> dict:
    """``osd`` (torch's layout: parameters by index) keyed by parameter FQN (DCP's layout)."""
    return {"state": {ids.get(k, k): v for k, v in osd.get("state", {}).items()},
            "param_groups": [{**g, "params": [ids.get(k, k) for k in g["params"]]}
                             for g in osd.get("param_groups", [])]}


def _check_model_keys(model: torch.nn.Module, saved: Any, strict: bool, file: str) -> None:
    """With ``strict``: the model's state-dict keys are the checkpoint's."""
    if not strict:
        return
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    have = set(get_model_state_dict(model))
    want = {k for k, _ in (skel_items(saved) or [])}
    if have != want:
        raise StateMismatchError(
            f"model keys differ from the checkpoint's: missing from the checkpoint "
            f"{sorted(have - want)[:5]}, not in the model {sorted(want - have)[:5]} (set "
            "LightningModule.strict_loading = False to load the common keys)", file=file)
