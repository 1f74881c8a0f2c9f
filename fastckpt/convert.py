"""Converting a DCP checkpoint directory or a ``torch.save`` file into a fastckpt checkpoint,
offline: one process, no process group (``fastckpt convert SRC ROOT``; see
docs/integrations/migration.md). The result is an ordinary committed fastckpt step.

``convert``: (1) what SRC is, the step (a committed one is refused unless ``force``); (2) every
tensor chunk with a loader (DCP: each saved chunk, so N ranks' shards keep their layout) and
the skeleton (DCP's nested again from its ``planner_data``); (3) the in-flight marker, the
chunks in batches of ``batch_bytes`` read from SRC and written through ``fastckpt.dcp.Writer``
(checksums of the bytes read, fsync); (4) the manifest, validated as a reader does; every
shard re-read against those checksums; the manifest published (the commit point); the replaced
save's shards, the marker, the ``latest`` hint. A failure before the commit removes the rest.

SRC is only read, and nothing from it goes through a general unpickler: DCP's ``.metadata``
is unpickled with an allow-list of DCP's metadata classes, DCP plain values and torch.save
files with ``torch.load(weights_only=True)``; what those refuse is refused, naming it.
"""

from __future__ import annotations

import fnmatch
import math
import os
import pickle
import re
import socket
import stat
import time
import uuid
from collections import namedtuple
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

import torch

from .convert_dcp import (MAX_METADATA_BYTES, DcpFiles, first_line, read_metadata,
                          refused_object)
from .dcp import Writer, _nest
from .engine.chunks import batches, write_chunks
from .engine.commit import publish_checked
from .engine.dtypes import dtype_name
from .engine.state import flatten
from .errors import CorruptCheckpointError, FastCkptError, UnsupportedStateError
from .manifest import schema as fmt
from .manifest.discovery import list_steps, marker_doc, marker_name, read_manifest
from .manifest.index import INDEX_SUFFIX
from .manifest.values import TENSOR_TAG, encode_value
from .manifest.values import fqn as _fqn
from .manifest.verify import check_layout, verify_file
from .storage import Storage, open_storage

__all__ = ["convert", "detect", "step_from_name", "ConvertResult", "NotConvertibleError",
           "StepExistsError", "DEFAULT_BATCH_BYTES"]

#: tensor bytes read from SRC and held at once (a larger chunk is held alone)
DEFAULT_BATCH_BYTES = 1 << 30
VERIFY_BLOCK = 16 << 20
_NONBLOCK = getattr(os, "O_NONBLOCK", 0)
_STEP_NAME = re.compile(r"^(?:step|global_step|checkpoint|iter)[-_]?(\d+)$")

ProgressFn = Callable[[int], None]
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # not DTensors, not tensor subclasses


class NotConvertibleError(FastCkptError, ValueError):
    """SRC is neither a DCP checkpoint directory nor a torch.save file (or is missing)."""


class StepExistsError(FastCkptError, FileExistsError):
    """The step is already committed under ROOT (``force=True`` replaces it)."""


@dataclass
class ConvertResult:
    """What ``convert`` did. ``verified``: every chunk written was re-read from ROOT and
    matched the checksum of the bytes read from SRC (computed as they were written)."""
    source: str
    source_format: str  # "dcp" | "torch_save"
    root: str
    step: int
    step_from: str  # "option" | "name" (SRC's name) | "default"
    path: str
    save_id: str
    source_ranks: int | None = None  # DCP: the ranks whose shard files SRC holds
    tensors: int = 0  # tensors stored
    tied: int = 0  # keys that share a stored tensor (torch.save ties)
    chunks: int = 0
    bytes: int = 0  # tensor bytes
    files: int = 0
    replaced: bool = False  # a committed save of the step was replaced (force)
    verified: bool = False
    bytes_verified: int = 0
    seconds: float = 0.0
    notes: list = field(default_factory=list)

    def to_json(self) -> dict:
        return asdict(self)


class _Chunk(namedtuple("_Chunk", "fqn dtype shape offsets sizes load")):
    """One chunk to write: ``load()`` reads it from SRC."""
    nbytes = property(lambda c: math.prod(c.sizes) * c.dtype.itemsize)


#: what to write: chunks, the skeleton, {fqn: (dtype, shape)}, tied keys, DCP's ranks
_Source = namedtuple("_Source", "chunks tree tensors aliases ranks", defaults=(0, None))


# ------------------------------------------------------------------------------- detection

def _local(src: str | os.PathLike) -> str:
    s = os.fspath(src)
    if "://" in s and not s.startswith("file://"):
        raise NotConvertibleError(f"SRC must be a local path, not {s!r} (copy it here first)")
    return s.removeprefix("file://")


def detect(src: str | os.PathLike) -> str:
    """"dcp" or "torch_save"; NotConvertibleError saying what SRC is instead."""
    path = _local(src)
    if os.path.isdir(path):
        names = os.listdir(path)
        if ".metadata" in names:
            return "dcp"
        if fmt.MANIFEST in names or any(fmt.parse_step_dirname(n) is not None for n in names):
            raise NotConvertibleError(f"{path} is a fastckpt checkpoint already")
        titan = sorted((int(m.group(1)), n) for n in names if (m := _STEP_NAME.match(n))
                       and os.path.isfile(os.path.join(path, n, ".metadata")))
        if titan:
            raise NotConvertibleError(
                f"{path} holds {len(titan)} DCP checkpoint(s) in step directories; convert one "
                f"at a time, e.g. the newest: fastckpt convert {os.path.join(path, titan[-1][1])}"
                " ROOT")
        raise NotConvertibleError(f"{path} is a directory without a DCP .metadata file")
    if not os.path.exists(path):
        raise NotConvertibleError(f"{path} does not exist")
    # opened without waiting (a FIFO: for a writer, for good, before 2026-12-07)
    with open(path, "rb", opener=lambda p, fl: os.open(p, fl | _NONBLOCK)) as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise NotConvertibleError(f"{path} is not a regular file (a FIFO, a device?): "
                                      "neither a DCP checkpoint directory nor a torch.save file")
        head = f.read(4)
    if head == b"PK\x03\x04" or head[:1] == b"\x80":  # torch.save's zip, or its legacy pickle
        return "torch_save"
    raise NotConvertibleError(f"{path} is neither a DCP checkpoint directory nor a torch.save "
                              "file (other formats: load them yourself, fastckpt.save the dict)")


def step_from_name(src: str | os.PathLike) -> int | None:
    """N when SRC's last path component (without extension) is step-N, step_N, global_stepN,
    checkpoint-N or iter-N (torchtitan, Lightning, HF Trainer, Megatron names), else None."""
    name = os.path.basename(_local(src).rstrip("/"))
    m = _STEP_NAME.match(name) or _STEP_NAME.match(name.split(".", 1)[0])
    return int(m.group(1)) if m else None


# ------------------------------------------------------------------------------ DCP source

def _excluded(key: str, exclude: tuple) -> bool:
    """Whether a dotted key path or one of its prefixes matches a glob of ``exclude``."""
    parts = key.split(".")
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), p) for p in exclude
               for i in range(1, len(parts) + 1))


def _dcp_source(src: str, files: DcpFiles, exclude: tuple) -> _Source:
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, MetadataIndex,
                                                       TensorStorageMetadata)
    md = files.md
    mappings = md.planner_data if isinstance(md.planner_data, dict) else {}
    for key, p in mappings.items():
        if (not isinstance(p, (tuple, list)) or not p or len(p) > fmt.MAX_NESTING
                or not all(type(x) in (str, int) for x in p)):
            raise CorruptCheckpointError(f"DCP planner_data has an invalid key path {p!r}",
                                         key=str(key), file=f"{src}/.metadata")
    chunks, tensors, plain, extra = [], {}, {}, {}  # extra: tensors inside plain values
    for fqn, m in md.state_dict_metadata.items():
        if _excluded(fqn, exclude):
            continue
        if isinstance(m, TensorStorageMetadata):
            dtype = m.properties.dtype
            _check_dtype(dtype, fqn)
            shape = tuple(int(n) for n in m.size)
            tensors[fqn] = (dtype, shape)
            for c in m.chunks:
                offsets, sizes = tuple(int(n) for n in c.offsets), tuple(int(n) for n in c.sizes)
                if not math.prod(sizes) and len(m.chunks) > 1:  # an empty rank's shard
                    continue
                index = MetadataIndex(fqn, torch.Size(offsets))
                si = files.info(index, f"chunk {list(offsets)}")
                nbytes = math.prod(sizes) * dtype.itemsize
                if not si.transform_descriptors and nbytes > si.length:  # bounds allocations
                    raise CorruptCheckpointError(
                        f"chunk {list(offsets)}+{list(sizes)} needs {nbytes} bytes, its "
                        f"storage holds {si.length}", key=fqn, file=f"{src}/{si.relative_path}")
                chunks.append(_Chunk(fqn, dtype, shape, offsets, sizes,
                                     lambda i=index, si=si, d=dtype, s=sizes: _chunk_tensor(
                                         files, i, si, d, s)))
        elif isinstance(m, BytesStorageMetadata):
            index = MetadataIndex(fqn)
            value = files.load(index, files.info(index, "a plain value"), MAX_METADATA_BYTES)
            plain[fqn] = _encode_plain(value, tuple(mappings.get(fqn, (fqn,))), extra)
        else:
            raise CorruptCheckpointError(f"unknown DCP entry type {type(m).__name__}", key=fqn,
                                         file=f"{src}/.metadata")
    at: dict = {}  # key path -> the keys there: one each, none inside another's value
    for k in (*tensors, *plain):
        at.setdefault(tuple(mappings.get(k, (k,))), []).append(k)
    for p, ks in at.items():
        clash = ks[1:] or [at[p[:i]][0] for i in range(1, len(p)) if p[:i] in at]
        if clash:
            raise CorruptCheckpointError(
                f"DCP planner_data puts {clash[0]!r} at or above {ks[0]!r}'s key path {list(p)}:"
                " one of them would never be loaded", key=ks[0], file=f"{src}/.metadata")
    tree = _restore_optimizer_layout(_nest(mappings, tensors, plain))
    for fqn, t in extra.items():  # tensors inside values DCP pickled whole (a tuple's)
        if fqn in tensors:
            raise UnsupportedStateError("two tensors map to this key path", key=fqn)
        tensors[fqn] = (t.dtype, tuple(t.shape))
        chunks.append(_Chunk(fqn, t.dtype, tuple(t.shape), (0,) * t.dim(), tuple(t.shape),
                             lambda t=t: t))
    ranks = {m.group(1) for si in md.storage_data.values()
             if (m := re.match(r"^__(\d+)_", str(getattr(si, "relative_path", ""))))}
    return _Source(chunks, tree, tensors, ranks=len(ranks) or None)


def _chunk_tensor(files: DcpFiles, index: Any, si: Any, dtype: torch.dtype,
                  sizes: tuple) -> torch.Tensor:
    t = files.load(index, si, math.prod(sizes) * dtype.itemsize + (1 << 20))  # + framing
    if (type(t) is not torch.Tensor or t.layout != torch.strided
            or (t.dtype, tuple(t.shape)) != (dtype, sizes)):
        raise CorruptCheckpointError(
            f"chunk {list(index.offset)}: the metadata says a {dtype} tensor of shape "
            f"{list(sizes)}, the file holds {getattr(t, 'dtype', type(t).__name__)} "
            f"{list(getattr(t, 'shape', []))}", key=index.fqn,
            file=f"{files.src}/{si.relative_path}")
    return t


def _check_dtype(dtype: Any, fqn: str) -> None:
    try:
        dtype_name(dtype)
    except (ValueError, TypeError):
        raise UnsupportedStateError(f"dtype {dtype} is not supported by the fastckpt format",
                                    key=fqn) from None


def _encode_plain(x: Any, path: tuple, extra: dict) -> Any:
    """A value DCP pickled whole (a tuple, a list of plain values), encoded as the skeleton
    encodes values; tensors inside become references to tensors stored under their key path."""
    if isinstance(x, torch.Tensor):
        fqn = _fqn(path)
        if type(x) not in _PLAIN_TENSORS or x.layout != torch.strided:
            raise UnsupportedStateError(f"cannot store a {type(x).__name__} with layout "
                                        f"{x.layout}", key=fqn)
        _check_dtype(x.dtype, fqn)
        extra[fqn] = x
        return {TENSOR_TAG: fqn}
    if isinstance(x, dict):
        if all(isinstance(k, str) and not k.startswith("$") for k in x):
            return {k: _encode_plain(v, path + (k,), extra) for k, v in x.items()}
        return {"$dict": [[encode_value(k, path + ("<key>",)),
                           _encode_plain(v, path + (k,), extra)] for k, v in x.items()]}
    if isinstance(x, (list, tuple)):
        seq = [_encode_plain(v, path + (i,), extra) for i, v in enumerate(x)]
        return seq if isinstance(x, list) else {"$tuple": seq}
    return encode_value(x, path)


def _restore_optimizer_layout(node: Any) -> Any:
    """Undo what DCP's flattening does to a torch optimizer's ``state_dict()``: a dict whose
    ``param_groups`` all hold ``params`` lists gets back the ``state`` DCP dropped when empty,
    and the int keys of ``state`` it turned into strings (when every param id is an int)."""
    if isinstance(node, list):
        return [_restore_optimizer_layout(v) for v in node]
    if not isinstance(node, dict) or any(k.startswith("$") for k in node):
        return node
    out = {k: _restore_optimizer_layout(v) for k, v in node.items()}
    groups = out.get("param_groups")
    if not (isinstance(groups, list) and groups and all(
            isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
        return out
    state = out.setdefault("state", {})
    ids = {p for g in groups for p in g["params"]}
    if (isinstance(state, dict) and state and all(type(p) is int for p in ids)
            and all(k.isdigit() and int(k) in ids for k in state)):
        out["state"] = {"$dict": [[int(k), v] for k, v in state.items()]}
    return out


# ------------------------------------------------------------------------ torch.save source

def _prune(x: Any, path: tuple, exclude: tuple) -> Any:
    if isinstance(x, list):
        return [_prune(v, path + (i,), exclude) for i, v in enumerate(x)]
    if not isinstance(x, dict):
        return x
    return {k: _prune(v, path + (k,), exclude) for k, v in x.items()
            if not _excluded(_fqn(path + (k,)), exclude)}


def _torch_save_source(src: str, exclude: tuple) -> _Source:
    try:
        try:
            obj = torch.load(src, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            obj = torch.load(src, map_location="cpu", weights_only=True)  # legacy format
    except pickle.UnpicklingError as e:
        if not refused_object(e):  # damaged bytes (before 2026-12-07: "pickled objects")
            raise CorruptCheckpointError(f"damaged torch.save file: {first_line(e)}",
                                         file=src) from None
        raise UnsupportedStateError(
            f"{src} holds pickled objects that are not plain data ({first_line(e)}),"
            " which torch.load(weights_only=True) refuses; fastckpt never unpickles arbitrary "
            "objects. Nothing was written: load it in code you trust and fastckpt.save the "
            "tensors and plain values") from None
    except (RuntimeError, EOFError, OSError, ValueError) as e:
        raise NotConvertibleError(f"{src} is not a readable torch.save file: {e}") from None
    if not isinstance(obj, dict):
        raise UnsupportedStateError(f"{src} holds a {type(obj).__qualname__}, not a dict: a "
                                    "fastckpt checkpoint is a dict (save {'model': obj})")
    flat = flatten(_prune(obj, (), exclude) if exclude else obj)  # errors name the key path
    chunks, tensors = [], {}
    for fqn, t in flat.tensors.items():
        _check_dtype(t.dtype, fqn)
        if type(t) not in _PLAIN_TENSORS:
            raise UnsupportedStateError(f"cannot store a {type(t).__name__}", key=fqn)
        tensors[fqn] = (t.dtype, tuple(t.shape))
        chunks.append(_Chunk(fqn, t.dtype, tuple(t.shape), (0,) * t.dim(), tuple(t.shape),
                             lambda t=t: t))
    return _Source(chunks, flat.skeleton, tensors, aliases=len(flat.aliases))


# ------------------------------------------------------------------------------- the write

def _cleanup(storage: Storage, d: str, keep: set, marker: str, existed: bool) -> None:
    """Remove the shard files not in ``keep`` and this run's marker from the step directory
    (all of it if this run created it)."""
    if not existed:
        return storage.remove_dir(d)
    for n in storage.listdir(d):
        if n not in keep and n.endswith((fmt.SHARD_SUFFIX, INDEX_SUFFIX)):
            storage.remove(f"{d}/{n}")
    storage.remove(marker)


def convert(src: str | os.PathLike, root: str | os.PathLike | Storage, *,
            step: int | None = None, force: bool = False,
            batch_bytes: int = DEFAULT_BATCH_BYTES, progress: ProgressFn | None = None,
            exclude: tuple | list = (), storage_options: dict | None = None) -> ConvertResult:
    """Convert the DCP directory or torch.save file ``src`` into step ``step`` (default: the
    number in SRC's name, ``step-N`` ..., else 0) of the fastckpt root ``root``, verified
    before the commit. A committed step raises StepExistsError unless ``force`` (replaced
    atomically). ``batch_bytes``: tensor bytes held at once (a larger chunk alone);
    ``progress(nbytes)`` as they are written. ``exclude``: globs of dotted key paths left out
    (with everything under them). NotConvertibleError (SRC is neither),
    UnsupportedStateError (a value fastckpt cannot store or the safe unpickler refuses, named)
    and CorruptCheckpointError (a damaged SRC, a shard not read back as written) commit nothing.
    """
    t0 = time.perf_counter()
    src_path = os.path.abspath(_local(src))
    kind = detect(src_path)
    step_from = "option"
    if step is None:
        step = step_from_name(src_path)
        step_from = "default" if step is None else "name"
        step = step or 0
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be a non-negative int, got {step!r}")
    storage = root if isinstance(root, Storage) else open_storage(
        os.fspath(root), storage_options=storage_options)
    r, s = os.path.realpath(storage.root), os.path.realpath(src_path)
    if storage.is_local and (r == s or r.startswith(s.rstrip("/") + "/")):
        raise NotConvertibleError(f"ROOT {storage.root} is SRC or inside it: give another "
                                  "directory (SRC is never written)")
    d = storage.join(fmt.step_dirname(step))
    if storage.is_local and (os.path.realpath(d) == s or s.startswith(
            os.path.realpath(d).rstrip("/") + "/")):  # (before 2026-12-06: written into SRC)
        raise NotConvertibleError(f"SRC is step {step}'s directory under ROOT {storage.root} "
                                  "(or inside it): give another ROOT (SRC is never written)")
    try:
        old = read_manifest(storage, d, step=step, chunks=False)
    except CorruptCheckpointError as e:
        if not force:
            raise StepExistsError(f"step {step} under {storage.root} has a damaged manifest "
                                  f"({e}); force=True (--force) replaces it") from None
        old = {"files": {}}
    if old is not None and not force:
        raise StepExistsError(f"step {step} is already committed under {storage.root} (save "
                              f"{old.get('save_id')}); force=True (--force) replaces it, or "
                              "choose another step")
    exclude = (exclude,) if isinstance(exclude, str) else tuple(exclude)
    files = DcpFiles(src_path, read_metadata(src_path)) if kind == "dcp" else None
    try:  # everything is read and checked but the tensors before anything is written
        try:
            source = (_dcp_source(src_path, files, exclude) if files is not None
                      else _torch_save_source(src_path, exclude))
        except (AttributeError, TypeError, KeyError, IndexError, ValueError, OverflowError,
                RecursionError) as e:  # crafted metadata
            if isinstance(e, FastCkptError):
                raise
            raise CorruptCheckpointError(f"malformed {kind} checkpoint: {e!r}",
                                         file=src_path) from None
        disp = getattr(storage, "display", lambda p: p)
        res = ConvertResult(source=src_path, source_format=kind, root=disp(storage.root),
                            step=step, step_from=step_from, path=disp(d),
                            save_id=uuid.uuid4().hex[:12], source_ranks=source.ranks,
                            replaced=old is not None)
        # the replaced save's files, its chunk indexes too: a failure leaves them (before
        # 2026-12-07 its indexes were removed, the step it was to leave named missing files)
        keep = set(old["files"]) | {i.get("file") for i in old.get("indexes", [])} if old \
            else set()
        _write_and_commit(storage, d, source, keep, batch_bytes, progress, res)
    finally:
        if files is not None:
            files.close()
    res.seconds = time.perf_counter() - t0
    return res


def _write_and_commit(storage: Storage, d: str, source: _Source, keep: set, batch_bytes: int,
                      progress: ProgressFn | None, res: ConvertResult) -> None:
    existed = bool(storage.listdir(d)) or (storage.is_local and os.path.isdir(d))
    marker = f"{d}/{marker_name(res.save_id)}"
    tensors = {fqn: {"dtype": dtype_name(dt), "shape": list(shape), "dtensor": False,
                     "chunks": []} for fqn, (dt, shape) in source.tensors.items()}
    written: dict[str, dict] = {}
    try:
        storage.makedirs(d)
        storage.publish(marker, marker_doc(res.save_id, host=socket.gethostname(),
                                           pid=os.getpid()))
        writer = Writer(step=res.step)
        writer.storage = storage
        writer.set_up_storage_writer(False)  # the shards only: the marker, the commit are ours
        for batch in batches(sorted(source.chunks, key=lambda c: (c.fqn, c.offsets)),
                              max(1, batch_bytes)):
            for fqn, ch in write_chunks(writer, batch):
                ch = dict(ch)
                written[ch["file"]] = {"rank": 0, "size": ch.pop("file_size")}
                tensors[fqn]["chunks"].append(ch)
            if progress is not None:
                progress(sum(c.nbytes for c in batch))
        for t in tensors.values():
            t["dtensor"] = len(t["chunks"]) > 1
        body = fmt.new_manifest_body(
            step=res.step, world_size=1, save_id=res.save_id, files=written, tensors=tensors,
            trees=[source.tree], torch_version=str(torch.__version__),
            user_meta={"converted_by": "fastckpt convert", "source": res.source,
                       "source_format": res.source_format, "source_ranks": res.source_ranks})
        data = fmt.encode_manifest(body, 2 if source.aliases else 1)
        mpath = f"{d}/{fmt.MANIFEST}"
        _verify(storage, d, fmt.decode_manifest(data, file=mpath, step=res.step), res)
        # the commit point; a write whose answer was lost is read back (publish_checked)
        publish_checked(storage, storage, mpath, data, res.save_id, step=res.step)
    except BaseException as e:
        if getattr(e, "outcome_unknown", False):  # the manifest may land: its files stay
            raise
        try:
            _cleanup(storage, d, keep, marker, existed)
        except Exception:  # noqa: BLE001 - the error that stopped the conversion matters
            pass
        raise
    try:  # committed: the replaced save's shards, the marker, the hint (what fails, gc does)
        _cleanup(storage, d, set(written), marker, True)
        if all(s <= res.step for s, _ in list_steps(storage)):
            storage.publish(storage.join(fmt.LATEST), f'{{"step": {res.step}}}'.encode(),
                            durable=False)
    except Exception as e:  # noqa: BLE001
        res.notes.append(f"committed, but cleaning up failed: {e} (fastckpt gc finishes it)")
    res.tensors, res.tied = len(source.tensors), source.aliases
    res.chunks = sum(len(t["chunks"]) for t in tensors.values())
    res.bytes = sum(c.nbytes for c in source.chunks)
    res.files = len(written)


def _verify(storage: Storage, d: str, body: dict, res: ConvertResult) -> None:
    """Re-read every shard written: each chunk's xxh3-64 (computed from the bytes read from
    SRC as they were written) and the zero padding; CorruptCheckpointError before the commit."""
    problems, by_file = check_layout(body)
    for name, info in sorted(body["files"].items()):
        probs, nread, _, _ = verify_file(storage, d, name, info, by_file.get(name, []),
                                         VERIFY_BLOCK, None)
        problems += probs
        res.bytes_verified += nread
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise CorruptCheckpointError("the shards written do not read back as written: "
                                     f"{problems[0]}{more}; nothing was committed")
    res.verified = True
