"""torchtitan (0.3.0) checkpoints through fastckpt: a checkpoint manager to put in the config.

    import fastckpt.torchtitan

    config = fastckpt.torchtitan.use_fastckpt(llama3_8b(), enable=True, async_mode="async")

``use_fastckpt`` takes any torchtitan ``Trainer.Config`` and swaps its ``checkpoint`` section for
``fastckpt.torchtitan.CheckpointManager.Config`` with the same settings (plus the changes
given); ``--checkpoint.*`` command-line flags still apply (examples/torchtitan_fastckpt.py).

Everything torchtitan's own manager (``torchtitan.components.checkpointer.CheckpointManager``)
does stays as it is: when to save (``interval``, the last step, the seed checkpoint), what is
saved (the flattened model, the optimizers and LR schedulers containers, the dataloader, the
train state), async modes, HF safetensors export and import, ``exclude_from_loading``,
``initial_load_path``. This subclass changes only where the bytes go and how steps are found:

- ``dcp_save``: ``dcp.save``/``dcp.async_save`` with ``fastckpt.dcp.Writer``: per-rank shard
  files with checksums, committed by the manifest (a crash mid-save leaves no step that looks
  complete, which torchtitan's ``.metadata`` check cannot tell);
- ``dcp_load``: ``dcp.load`` with ``fastckpt.dcp.Reader`` (resharding to another world size as
  DCP does; every chunk's checksum checked);
- ``_find_load_step``: the newest step with a valid manifest (not "a ``step-N`` directory with a
  ``.metadata`` file"); a folder that holds only torchtitan DCP checkpoints (written before the
  switch) resumes from the newest of those, read by DCP's own reader;
- ``_purge_stale_checkpoints``: fastckpt retention: the newest ``keep_latest_k`` committed
  steps are kept; a step still being written (an async save) is never removed;
- the dataloader: torchtitan's ``ParallelAwareDataloader.state_dict`` pickles the
  ``StatefulDataLoader`` state into bytes; fastckpt stores no pickle, so the manager saves that
  state unpickled, as plain data under the same per-rank key (``dp_rank_<r>``).

Steps live in ``<dump_folder>/<folder>/step-0000000100`` (fastckpt's names); ``fastckpt ls``,
``verify``, ``resume`` and ``gc`` work on the folder. Exports with ``last_save_in_hf`` remain
torchtitan's safetensors directories (not fastckpt checkpoints).

Limits: ``async_mode="async_with_pinned_mem"`` runs DCP's writer in another process; it
requires CUDA and was not run here (no GPU). DCP's own collectives time out with the process
group, not with fastckpt's deadlines.
"""

from __future__ import annotations

import json
import os
import pickle
import dataclasses
from dataclasses import dataclass
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType
from torchtitan.components.checkpointer import DATALOADER, MODEL
from torchtitan.components.checkpointer import CheckpointManager as _TitanManager
from torchtitan.components.checkpointer.dcp import AsyncMode

from . import dcp as fdcp
from .engine import dist as _dist
from .errors import CheckpointNotFoundError, StorageError, StorageTimeoutError
from .manifest import schema as fmt
from .manifest.discovery import committed_steps, read_manifest
from .manifest.values import decode_value, encode_value
from .retention import apply_retention
from .storage import Storage, open_storage
from .storage.bounded import CALL_S

__all__ = ["CheckpointManager", "use_fastckpt"]


class _PlainDataLoaderState:
    """The dataloader as a Stateful that stores no pickle: torchtitan's
    ``{"dp_rank_<r>": pickle.dumps(state), "world_size": n}`` becomes ``{"dp_rank_<r>":
    JSON text of the state, ...}`` (one value per rank, so its structure need not match the
    fresh loader's at load time). Loads hand the loader its own format back (pickled in memory,
    from the plain data read, never from storage). A state that is not plain data raises
    UnsupportedStateError naming its key."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        sd = dict(self.loader.state_dict())
        for k, v in sd.items():
            if isinstance(v, bytes):
                sd[k] = _PLAIN + json.dumps(encode_value(pickle.loads(v), (DATALOADER, k)))
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        out = dict(sd)
        for k, v in sd.items():
            if isinstance(v, str) and v.startswith(_PLAIN):
                out[k] = pickle.dumps(decode_value(json.loads(v[len(_PLAIN):])))
        self.loader.load_state_dict(out)


#: marks a dataloader state stored as JSON text
_PLAIN = "fastckpt-json:"


class CheckpointManager(_TitanManager):
    """torchtitan's checkpoint manager writing and reading fastckpt checkpoints (see the module
    docstring). Configure it with ``CheckpointManager.Config(...)``, the same fields as
    torchtitan's."""

    @dataclass(kw_only=True, slots=True)
    class Config(_TitanManager.Config):
        verify: bool = True
        """Check every chunk's checksum on load."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        super().__init__(config, **kwargs)
        if not self.enable:
            return
        self._verify = config.verify
        self._writing: set[int] = set()
        self._dcp_steps: dict[int, str] = {}
        loader = self.states.get(DATALOADER)
        if loader is not None:
            self.states[DATALOADER] = _PlainDataLoaderState(loader)

    # -- where the bytes go ----------------------------------------------------------------------
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        if to_hf:  # a safetensors export, torchtitan's own format
            return super().dcp_save(state_dict, checkpoint_id, async_mode,
                                    enable_garbage_collection, to_hf)
        step = fdcp.split_checkpoint_id(checkpoint_id)[1]
        writer = fdcp.Writer()
        if async_mode == AsyncMode.DISABLED:
            ret = dcp.save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id)
        else:
            kw: dict[str, Any] = {}
            if async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM:
                kw = {"async_checkpointer_type": AsyncCheckpointerType.PROCESS,
                      "async_stager": self.stager}
            ret = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=checkpoint_id,
                                 process_group=self.pg, **kw)
            if step is not None:
                self._writing.add(step)
                fut = getattr(ret, "upload_completion", ret)
                fut.add_done_callback(lambda _f, s=step: self._writing.discard(s))
        if enable_garbage_collection:
            from torchtitan.tools.utils import GarbageCollection
            GarbageCollection.collect("GC collection invoked by checkpointer.")
        return ret

    def dcp_load(self, state_dict: dict[str, Any], checkpoint_id: str, from_hf: bool,
                 from_quantized: bool) -> None:
        if from_hf or not self._is_fastckpt_step(checkpoint_id):
            # safetensors, or a DCP checkpoint written by torchtitan's own manager
            return super().dcp_load(state_dict, checkpoint_id, from_hf, from_quantized)
        dcp.load(state_dict, checkpoint_id=checkpoint_id,
                 storage_reader=fdcp.Reader(verify=self._verify))
        if MODEL in self.states:  # the model is flattened into state_dict (torchtitan's note)
            self.states[MODEL].load_state_dict(state_dict)

    # -- how steps are found and kept --------------------------------------------------------------
    def load(self, step: int = -1) -> bool:
        """torchtitan's ``load``; an explicit ``step`` (``--checkpoint.load_step``) is also one
        of torchtitan's own ``step-N`` checkpoints of a switched folder (before 2026-12-06 only
        the default resume found them), and a fastckpt step that never committed is named as
        such (it went to torchtitan's DCP reader: "no .metadata")."""
        if self.enable and step >= 0 and step not in self._dcp_steps:
            storage = self._storage(self.folder)
            d = storage.join(fmt.step_dirname(step))
            try:
                committed = read_manifest(storage, d, step=step, chunks=False) is not None
                legacy = storage.join(f"step-{step}")
                if not committed and storage.size(f"{legacy}/.metadata") is not None:
                    self._dcp_steps[step] = legacy  # torchtitan's own checkpoint
                elif not committed and fmt.step_dirname(step) in storage.subdirs(storage.root):
                    steps = list(committed_steps(storage))
                    raise CheckpointNotFoundError(
                        f"--checkpoint.load_step={step}: step {step} under {self.folder} was "
                        f"never committed (its save did not finish: no {fmt.MANIFEST}); "
                        f"committed steps: {steps or 'none'}", file=d)
            except StorageTimeoutError:
                raise  # a mount that stops answering: named, not taken for "no folder"
            except StorageError:
                pass  # (no folder: torchtitan's own load says so)
        return super().load(step)

    def _create_checkpoint_id(self, step: int, folder: str = "") -> str:
        folder = folder or self.folder
        if not folder or folder == self.folder:
            if step in self._dcp_steps:
                return self._dcp_steps[step]
        return os.path.join(folder, fmt.step_dirname(step))

    def _find_load_step(self, folder: str = "") -> int:
        storage = self._storage(folder or self.folder)
        # the newest valid one resumes; `fastckpt verify` names the damage. No folder yet lists
        # as no steps (a fresh start, as torchtitan's own manager says); a folder that cannot
        # be read raises (before 2026-12-06 any StorageError, a hung mount's or EIO, was taken
        # for "no folder" and the job started again from step 0)
        newest = next(committed_steps(storage, newest_first=True), None)
        if newest is not None:
            return newest
        # nothing committed by fastckpt: torchtitan's own DCP checkpoints, if any
        step = super()._find_load_step(folder)
        if step >= 0:
            self._dcp_steps[step] = os.path.join(folder or self.folder, f"step-{step}")
        return step

    def _purge_stale_checkpoints(self) -> None:
        if self.keep_latest_k > 0 and _dist.rank() == 0:
            storage = self._storage(self.folder)
            apply_retention(storage, self.keep_latest_k, protect=set(self._writing))
            self._purge_legacy(storage)

    def _purge_legacy(self, storage: Storage) -> None:
        """(rank 0) torchtitan's own ``step-N`` directories of a switched run, beyond the
        newest ``keep_latest_k`` steps of both kinds (fastckpt's retention knows only its own
        step names: before 2026-12-06 they were kept for good)."""
        try:
            names = storage.listdir(storage.root)
        except StorageError:
            return
        legacy = {int(n[5:]): n for n in names
                  if n.startswith("step-") and n[5:].isascii() and n[5:].isdigit()
                  and n != fmt.step_dirname(int(n[5:]))}
        if not legacy:
            return
        newest = sorted(set(legacy) | set(committed_steps(storage)))
        keep = set(newest[-self.keep_latest_k:]) | set(self._writing)
        for step, name in sorted(legacy.items()):
            if step not in keep:
                storage.remove_dir(storage.join(name))

    # -- helpers --------------------------------------------------------------------------------
    def _storage(self, folder: str) -> Storage:
        """The folder's storage, each metadata call bounded (``CALL_S``) as a load's are: a
        mount that stops answering is a ``StorageTimeoutError`` naming the file (before
        2026-12-06 the step discovery and ``load_step``'s manifest read waited without bound)."""
        return open_storage(folder).per_call(CALL_S)

    def _is_fastckpt_step(self, checkpoint_id: str) -> bool:
        """Whether ``checkpoint_id`` (``ROOT/step-N``) is a committed fastckpt step; a damaged
        manifest raises (never read as something else)."""
        root, step = fdcp.split_checkpoint_id(checkpoint_id)
        if step is None:
            return False
        storage = self._storage(root)
        return read_manifest(storage, storage.join(fmt.step_dirname(step)), step=step) is not None


def use_fastckpt(config: Any, **changes: Any) -> Any:
    """``config`` (a torchtitan ``Trainer.Config``) checkpointing through fastckpt: its
    ``checkpoint`` section becomes a ``CheckpointManager.Config`` with the same field values,
    then ``changes`` (e.g. ``enable=True, interval=500``). Returns ``config``."""
    old = config.checkpoint
    kept = {f.name: getattr(old, f.name) for f in dataclasses.fields(old)
            if f.init and f.name in {g.name for g in dataclasses.fields(CheckpointManager.Config)}}
    config.checkpoint = CheckpointManager.Config(**{**kept, **changes})
    return config
