"""fastckpt as a storage layer of ``torch.distributed.checkpoint`` (DCP).

    import torch.distributed.checkpoint as dcp
    import fastckpt.dcp

    dcp.save(state, storage_writer=fastckpt.dcp.Writer("/nvme/ckpt/run", step=100))
    dcp.async_save(state, storage_writer=fastckpt.dcp.Writer("/nvme/ckpt/run", step=200))
    dcp.save(state, checkpoint_id="/nvme/ckpt/run/step-300", storage_writer=fastckpt.dcp.Writer())
    dcp.load(state, storage_reader=fastckpt.dcp.Reader("/nvme/ckpt/run"))        # newest step
    dcp.load(state, checkpoint_id="/nvme/ckpt/run/step-300", storage_reader=fastckpt.dcp.Reader())

The result is an ordinary fastckpt checkpoint (``step-0000000100/manifest.json`` and shard
files, checksums, the atomic manifest commit): ``fastckpt.load``, ``fastckpt ls/verify``,
resharding and the engine's retention see it like any other. A ``checkpoint_id`` ending in
``step-N`` (torchtitan's layout) names the root above it and step N.

Call sequence (DCP's, see ``torch.distributed.checkpoint.StorageWriter``):

1. (all ranks) ``reset(checkpoint_id)``, ``set_up_storage_writer``: the root and the step;
2. (all ranks) ``prepare_local_plan``; (coordinator) ``prepare_global_plan``: unchanged (DCP's
   planner decides who writes what, replicated values once);
3. (all ranks) ``write_data``: (coordinator) an in-flight marker, so that ``fastckpt gc`` and
   retention leave the step alone; this rank's items into its own shard files (named with an id
   of its own), laid out as the engine lays them out: a local file system writes large
   contiguous tensors straight from their memory (the caller does not touch them until DCP
   returns; ``async_save`` hands over its own staged copy), other stores through a staging
   buffer; each chunk's xxh3-64 computed while writing; files fsynced, then their directory;
   non-tensor values are returned as JSON (never pickled: a value that is not plain data is
   refused with ``UnsupportedStateError`` naming its key);
4. (coordinator) ``finish``: the manifest, built from DCP's metadata and every rank's results
   (the skeleton nested again from the planner's key paths), published atomically: the
   commit point. The marker and the files of an earlier save of the same step are removed
   after it.

Limits: DCP's own collectives (planning, the gather of results) have no deadline of their own
beyond the process group's timeout; the writer lease of ``fastckpt.Checkpointer`` is not taken
(frameworks driving DCP keep their own single writer, and their own retention).
"""

from __future__ import annotations

import os
import re
import socket
import time
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from .engine import dist as _dist
from .engine.commit import publish_checked
from .engine.dtypes import dtype_name
from .engine.plan import ChunkSpec
from .engine.reader import FastCkptReader
from .engine.staging import gather_piece, piece_bytes, split, stage_piece
from .errors import CorruptCheckpointError, FastCkptError, UnsupportedStateError
from .manifest import schema as fmt
from .manifest.discovery import marker_doc, marker_name, read_manifest
from .manifest.values import encode_value
from .options import CheckpointOptions, options_from_env
from .storage import Storage, open_storage
from .storage.pyio import aligned_buffer

__all__ = ["Writer", "Reader", "split_checkpoint_id"]

_STEP_ID = re.compile(r"^(.*)/step-(\d+)/?$")


def split_checkpoint_id(checkpoint_id: str | os.PathLike) -> tuple[str, int | None]:
    """``ROOT/step-N`` -> (ROOT, N); anything else -> (it, None)."""
    text = str(checkpoint_id).rstrip("/")
    m = _STEP_ID.match(text)
    return (m.group(1) or "/", int(m.group(2))) if m else (text, None)


#: the options the DCP path reads (DCP plans and stages: no compression, retention, pool)
_WRITER_OPTIONS = frozenset({"native", "direct_io", "commit_timeout_s", "remote_part_bytes",
                             "remote_concurrency", "remote_max_attempts", "conditional_put"})


class Writer(StorageWriter):
    """A DCP ``StorageWriter`` that writes a fastckpt checkpoint (see the module docstring).
    One instance per ``dcp.save``/``async_save`` call at a time."""

    def __init__(self, root: str | os.PathLike | None = None, step: int | None = None, *,
                 storage_options: dict | None = None, **option_overrides: Any) -> None:
        super().__init__()
        self.options: CheckpointOptions = options_from_env(CheckpointOptions())
        unused = sorted(set(option_overrides) - _WRITER_OPTIONS)
        if unused:  # (before 2026-12-06 accepted and ignored: compression, keep_last, ...)
            raise ValueError(f"fastckpt.dcp.Writer does not use {', '.join(unused)} (it "
                             f"takes {', '.join(sorted(_WRITER_OPTIONS))}); a Checkpointer does")
        if option_overrides:
            self.options = self.options.with_changes(**option_overrides)
        self._root = None if root is None else str(root)
        self._step = step
        self._storage_options = storage_options
        self.storage: Storage | None = None
        self.is_coordinator = False
        self._rank = 0
        self._save_id = ""

    # -- DCP interface -------------------------------------------------------------------------
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            root, step = split_checkpoint_id(checkpoint_id)
            self._root = root
            if step is not None:
                self._step = step
        if self._root is None or self._step is None or self._step < 0:
            raise ValueError("fastckpt.dcp.Writer needs a root and a step: Writer(root, step=N)"
                             " or checkpoint_id='ROOT/step-N'")
        self.storage = open_storage(self._root, io_mode=self.options.native,
                                    direct_io=self.options.direct_io,
                                    storage_options=self._storage_options,
                                    remote=self.options.remote_settings())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if self.storage is None:
            self.reset()
        if kwargs.get("use_collectives") is False:
            raise UnsupportedStateError(
                "fastckpt.dcp.Writer needs use_collectives=True: one manifest holds every "
                "rank's chunks, written by the coordinator once every rank has written")
        self.is_coordinator = is_coordinator
        # the rank within the save's group (0 under no_dist, the group's own under a
        # subgroup): the manifest numbers the ranks of the save (before 2026-12-06 the global
        # rank: a subgroup's or a no_dist save on rank 1 was refused as "invalid manifest")
        self._rank = kwargs.get("rank", _dist.rank())
        self._save_id = uuid.uuid4().hex[:12]

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def storage_meta(self) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta
        return StorageMeta(checkpoint_id=self._step_dir() if self.storage else None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return split_checkpoint_id(checkpoint_id)[1] is not None

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        fut: Future[list[WriteResult]] = Future()
        try:
            fut.set_result(self._write(plan, planner))
        except BaseException as e:  # noqa: BLE001 - DCP collects it from the future
            fut.set_exception(e)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        assert self.storage is not None
        d = self._step_dir()
        tensors: dict[str, dict] = {}
        for fqn, md in metadata.state_dict_metadata.items():
            if isinstance(md, TensorStorageMetadata):
                tensors[fqn] = {"dtype": dtype_name(md.properties.dtype),
                                "shape": list(md.size), "dtensor": len(md.chunks) > 1,
                                "chunks": []}
        files: dict[str, dict] = {}
        plain: dict[str, Any] = {}
        for rank_results in results:
            for wr in rank_results:
                sd = wr.storage_data
                if "value" in sd:
                    plain[wr.index.fqn] = sd["value"]
                    continue
                for c in sd["chunks"]:
                    c = dict(c)
                    files[c["file"]] = {"rank": c["rank"], "size": c.pop("file_size")}
                    tensors[wr.index.fqn]["chunks"].append(c)
        tree = _nest(metadata.planner_data, tensors, plain)
        body = fmt.new_manifest_body(
            step=self._step, world_size=max(1, len(results)), save_id=self._save_id,
            files=files, tensors=tensors, trees=[tree], torch_version=str(torch.__version__),
            user_meta={"written_by": "torch.distributed.checkpoint (fastckpt.dcp.Writer)"})
        data = fmt.encode_manifest(body)
        fmt.decode_manifest(data, file=f"{d}/{fmt.MANIFEST}", step=self._step)  # as a reader
        st = self.storage.bounded(time.monotonic() + self.options.commit_timeout_s)
        # the files of the save this one replaces (another save of this step, running now,
        # keeps its own: before 2026-12-06 every name not in this manifest was removed, and
        # a save of the same step committing after it named missing files)
        try:
            old = read_manifest(st, d, step=self._step, chunks=False) or {}
        except CorruptCheckpointError:
            old = {}
        replaced = set(old.get("files", {})) | {i.get("file") for i in old.get("indexes", [])}
        missing = sorted(set(files) - set(st.listdir(d)))
        if missing:  # (removed by another writer meanwhile: nothing is committed)
            raise CorruptCheckpointError(
                f"step {self._step}: {len(missing)} shard file(s) of this save are gone before "
                f"the commit ({', '.join(missing[:4])}); another writer of this root?", file=d)
        publish_checked(st, self.storage, f"{d}/{fmt.MANIFEST}", data, self._save_id,
                        step=self._step)  # (a write whose answer was lost: read back)
        for n in (replaced - set(files)) | {marker_name(self._save_id)}:
            st.remove(f"{d}/{n}")

    # -- helpers -------------------------------------------------------------------------------
    def _step_dir(self) -> str:
        assert self.storage is not None and self._step is not None
        return self.storage.join(fmt.step_dirname(self._step))

    def _write(self, plan: SavePlan, planner: SavePlanner) -> list[WriteResult]:
        """(all ranks) This rank's items into its shard files; a WriteResult per item."""
        assert self.storage is not None
        rank = self._rank
        d = self._step_dir()
        st = self.storage.bounded(time.monotonic() + self.options.commit_timeout_s)
        st.makedirs(d)
        if self.is_coordinator:  # the step is being written: gc and retention leave it alone
            st.publish(f"{d}/{marker_name(self._save_id)}",
                       marker_doc(self._save_id, host=socket.gethostname(), pid=os.getpid()))
        results: list[WriteResult] = []
        specs: list[ChunkSpec] = []
        items: dict[tuple, Any] = {}
        data: dict[tuple, torch.Tensor] = {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                lookup = getattr(planner, "lookup_object", None)
                if lookup is None:
                    raise UnsupportedStateError(
                        f"{type(planner).__name__} cannot hand over plain values unpickled "
                        "(use DCP's DefaultSavePlanner)", key=fqn)
                value = lookup(item.index)
                if _holds_tensor(value):  # (fastckpt stores no pickle)
                    raise UnsupportedStateError(
                        f"a tensor inside a {type(value).__name__}, which DCP's planner did not "
                        "flatten and hands over whole, to be pickled: " + (
                            "save with flatten_state_dict=True (DefaultSavePlanner's default)"
                            if isinstance(value, (dict, list)) else
                            "DCP flattens dicts and lists only: hold the tensors in a list"),
                        key=fqn)
                results.append(WriteResult(index=item.index, size_in_bytes=0, storage_data={
                    "value": encode_value(value, (fqn,))}))
                continue
            t = planner.resolve_data(item).detach()
            chunk = item.tensor_data.chunk
            if tuple(t.shape) != tuple(chunk.sizes):
                raise UnsupportedStateError(
                    f"the planner resolved a tensor of shape {list(t.shape)} for a chunk of "
                    f"{list(chunk.sizes)}", key=fqn)
            want = item.tensor_data.properties.dtype
            if t.dtype != want:  # (a planner that casts: stored as the metadata's dtype, the
                t = t.to(want)   # value dcp.load gives; its bytes were taken for want's)
            if t.is_conj() or t.is_neg():
                t = t.resolve_conj().resolve_neg()
            if t.device.type != "cpu":
                t = t.to("cpu")
            key = (fqn, tuple(chunk.offsets))
            specs.append(ChunkSpec(fqn, dtype_name(t.dtype), tuple(item.tensor_data.size),
                                   tuple(chunk.offsets), tuple(chunk.sizes),
                                   t.numel() * t.element_size(), False))
            items[key], data[key] = item, t
        chunks_of: dict[tuple, list] = {key: [] for key in items}
        sid = uuid.uuid4().hex[:12]  # this rank's files: no name is shared with another rank
        specs.sort(key=lambda s: (s.fqn, s.offsets))
        total = sum(s.nbytes for s in specs)
        zero_copy = st.gathered_writes
        phase = {k: t.data_ptr() % fmt.ALIGN for k, t in data.items()
                 if t.is_contiguous() and t.nbytes >= fmt.SMALL_CHUNK} if zero_copy else None
        for piece in split(specs, piece_bytes(total, None), phase=phase):
            name = fmt.shard_name(rank, sid, piece.index)
            path = f"{d}/{name}"
            if zero_copy:
                g = gather_piece(piece, data, st.io)
                hashes = st.write_gathered(path, piece.size, g.segments, g.hash_ranges)
            else:
                buf = aligned_buffer(fmt.align_up(max(piece.size, 1)))
                stage_piece(piece, buf, data)
                hashes = st.write_shard(path, buf, piece.size,
                                        [(s.offset, s.spec.nbytes) for s in piece.slots],
                                        sync_dir=False)
            for slot, h in zip(piece.slots, hashes):
                chunks_of[slot.key].append({
                    "offsets": list(slot.spec.offsets), "sizes": list(slot.spec.sizes),
                    "rank": rank, "file": name, "offset": slot.offset,
                    "length": slot.spec.nbytes, "checksum": fmt.hexdigest(h),
                    "file_size": piece.size})
        st.sync_dir(d)
        for key, item in items.items():
            results.append(WriteResult(index=item.index, size_in_bytes=data[key].nbytes,
                                       storage_data={"chunks": chunks_of[key]}))
        return results


def _holds_tensor(x: Any) -> bool:
    if isinstance(x, torch.Tensor):
        return True
    if isinstance(x, (list, tuple)):
        return any(_holds_tensor(v) for v in x)
    if isinstance(x, dict):
        return any(_holds_tensor(v) for v in x.values())
    return False


class _Node(dict):
    """A container ``_nest`` built from DCP's key paths (a plain value is never one)."""


def _nest(mappings: Any, tensors: dict, plain: dict) -> Any:
    """The skeleton of the state DCP flattened: every key path of ``mappings`` (flat key ->
    the path of keys and indices it came from) holds a tensor reference or a plain value
    (already encoded); containers whose keys are 0..n-1 were lists (DCP's own unflattening
    makes the same choice: a dict keyed 0..n-1 comes back as a list), and a container with a
    key that is not a string, or starts with ``$``, is encoded as ``encode_value`` does
    (before 2026-12-06 a user's ``{"$tensor": ...}`` came back as a tensor reference)."""
    root = _Node()
    flat = {**{k: {"$tensor": k} for k in tensors}, **plain}
    for key, value in flat.items():
        path = tuple(mappings[key]) if mappings and key in mappings else (key,)
        node = root
        for p in path[:-1]:
            node = node.setdefault(p, _Node())
            if not isinstance(node, _Node):
                raise FastCkptError(f"key {key!r}: a value and a container at one key path")
        if isinstance(node.get(path[-1]), _Node):
            raise FastCkptError(f"key {key!r}: a value and a container at one key path")
        node[path[-1]] = value

    def finish(x: Any) -> Any:
        if not isinstance(x, _Node):
            return x
        out = {k: finish(v) for k, v in x.items()}
        if out and all(isinstance(k, int) for k in out) and sorted(out) == list(range(len(out))):
            return [out[i] for i in range(len(out))]
        if all(isinstance(k, str) and not k.startswith("$") for k in out):
            return out
        return {"$dict": [[encode_value(k, ()), v] for k, v in out.items()]}
    return finish(root)


class Reader(FastCkptReader):
    """A DCP ``StorageReader`` over a fastckpt checkpoint that also takes DCP's
    ``checkpoint_id``: ``ROOT`` (the newest committed step) or ``ROOT/step-N``."""

    def __init__(self, root: str | os.PathLike | Storage | None = None,
                 step: int | None = None, **kwargs: Any) -> None:
        self._lazy = (root, step, kwargs)
        if root is not None:
            super().__init__(root, step, **kwargs)

    def reset(self, checkpoint_id: Any = None) -> None:
        """DCP's call before each load: ``checkpoint_id`` or the reader's own root; a root
        without a step means the newest committed step at this load (before 2026-12-06 the
        step found when the reader was made: a reused reader loaded an older step)."""
        if checkpoint_id is not None:
            root, step = split_checkpoint_id(checkpoint_id)
            kwargs = dict(self._lazy[2])
            super().__init__(root, step if step is not None else self._lazy[1], **kwargs)
        elif self._lazy[0] is None:
            raise ValueError("fastckpt.dcp.Reader needs a root: Reader(root) or checkpoint_id")
        elif self._lazy[1] is None:
            super().__init__(self._lazy[0], None, **self._lazy[2])
        else:
            super().reset()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        root, _ = split_checkpoint_id(checkpoint_id)
        return FastCkptReader.validate_checkpoint_id(root)

