"""(``fastckpt convert``) Reading a DCP checkpoint directory as untrusted input: its pickled
``.metadata`` through an allow-list unpickler that also refuses to change the objects it
allows, and its data files (plain names, opened once, no link followed, no FIFO waited for;
every item read inside its file, a stream-transformed one decoded up to its size).
"""

from __future__ import annotations

import enum
import errno
import importlib
import io
import os
import pickle
import re
from typing import Any

import torch

from .errors import CorruptCheckpointError, UnsupportedStateError

MAX_METADATA_BYTES = 1 << 30
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_GONE = object()
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9._-]*$")  # no separator, no leading dot

_META_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex",
        "StorageMeta", "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING"},
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},
    "pathlib": {"Path", "PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},
    "collections": {"OrderedDict"},
}


class _MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` is a pickle: only DCP's own metadata classes, torch.Size and dtypes
    are resolved; any other global is refused before anything runs."""

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                                torch.dtype)):
            return getattr(torch, name)
        if name in _META_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")


def _shared_objects() -> dict[str, Any]:
    """The objects of the allow-list a pickle can reach that have attributes to set (the
    Python classes, the function, the enum's members): a pickle's BUILD opcode sets the
    attributes of whatever it is applied to, these included (torch's classes, process-wide)."""
    out = {}
    for module, names in _META_CLASSES.items():
        for name in names:
            obj = getattr(importlib.import_module(module), name, None)
            if obj is not None and hasattr(obj, "__dict__"):
                out[f"{module}.{name}"] = obj
                if isinstance(obj, type) and issubclass(obj, enum.Enum):
                    out.update({f"{module}.{name}.{m.name}": m for m in obj})
    return out


def _unpickle(f: Any) -> Any:
    """:class:`_MetadataUnpickler`'s load, refused (UnpicklingError) when it changed an
    attribute of an allowed object; what it changed is put back (before 2026-12-07: a
    ``.metadata`` could set attributes of DCP's classes, of ``_get_layout``, of the enum's
    members, for the rest of the process)."""
    shared = _shared_objects()
    before = {k: dict(vars(o)) for k, o in shared.items()}
    try:
        return _MetadataUnpickler(f).load()
    finally:
        changed = [k for k, o in shared.items() if vars(o).keys() != before[k].keys()
                   or any(vars(o)[a] is not v for a, v in before[k].items())]
        for k in changed:
            obj, old = shared[k], before[k]
            if isinstance(obj, type):  # (a class's __dict__ is read-only: type's setattr)
                for a in set(vars(obj)) - set(old):
                    type.__delattr__(obj, a)
                for a, v in old.items():
                    if vars(obj).get(a, _GONE) is not v:
                        type.__setattr__(obj, a, v)
            else:
                vars(obj).clear()
                vars(obj).update(old)
        if changed:  # (raised over whatever the load raised)
            raise pickle.UnpicklingError(f"the pickle sets attributes of {changed[0]}, an "
                                         "object it may only use")


def read_metadata(src: str) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata
    path = os.path.join(src, ".metadata")
    with open_regular(path) as f:
        if os.fstat(f.fileno()).st_size > MAX_METADATA_BYTES:
            raise CorruptCheckpointError("DCP .metadata is larger than 1 GiB", file=path)
        try:
            md = _unpickle(f)
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError,
                IndexError, RecursionError) as e:
            raise CorruptCheckpointError(
                f"not a DCP metadata file fastckpt reads safely: {e} (only DCP's own metadata "
                "classes are unpickled)", file=path) from None
    if not (isinstance(md, Metadata) and isinstance(md.state_dict_metadata, dict)
            and isinstance(md.storage_data, dict)):
        raise CorruptCheckpointError("not DCP metadata", file=path)
    return md


def open_regular(path: str) -> io.BufferedReader:
    """A link is not followed, a FIFO not waited for (its size, 0, fails the bounds checks);
    one that cannot be opened is a CorruptCheckpointError naming it."""
    try:
        return open(path, "rb", opener=lambda p, fl: os.open(p, fl | _NOFOLLOW))
    except OSError as e:
        why = "a symbolic link, never followed" if e.errno == errno.ELOOP else e.strerror
        raise CorruptCheckpointError(f"cannot open the file: {why}", file=path) from None


class DcpFiles:
    """SRC's data files, each opened once; items read with torch.load(weights_only=True)."""

    def __init__(self, src: str, md: Any) -> None:
        self.src, self.md, self.open, self.sizes, self._transforms = src, md, {}, {}, None

    def info(self, index: Any, what: str) -> Any:
        si = self.md.storage_data.get(index)
        rel = getattr(si, "relative_path", None)
        if not isinstance(rel, str) or not _PLAIN_NAME.match(rel):
            raise CorruptCheckpointError(f"DCP metadata has no valid storage entry for {what}",
                                         key=index.fqn, file=f"{self.src}/.metadata")
        if rel not in self.sizes:  # (opened once: a missing file, a link are named errors)
            path = os.path.join(self.src, rel)
            f = self.open.get(path) or self.open.setdefault(path, open_regular(path))
            self.sizes[rel] = os.fstat(f.fileno()).st_size
        off, ln = si.offset, si.length
        if not (type(off) is int and type(ln) is int and 0 <= off and 0 <= ln
                and off + ln <= self.sizes[rel]):
            raise CorruptCheckpointError(f"storage entry {off}+{ln} lies outside the file",
                                         key=index.fqn, file=os.path.join(self.src, rel))
        return si

    def load(self, index: Any, si: Any, limit: int) -> Any:
        path = os.path.join(self.src, si.relative_path)
        f = self.open[path]  # (opened by info)
        f.seek(si.offset)
        stream: Any = io.BytesIO(f.read(si.length))  # held while torch.load copies it out
        if si.transform_descriptors:  # DCP's stream extensions (compression)
            stream = self._decoded(index, si, stream, limit, path)
        try:
            return torch.load(stream, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            raise UnsupportedStateError(
                f"key path {index.fqn!r}: DCP pickled this value and the safe unpickler "
                f"(torch.load weights_only=True) refuses it ({first_line(e)}); fastckpt never "
                "unpickles arbitrary objects. Nothing was committed") from None
        except (RuntimeError, EOFError, ValueError, OSError) as e:
            raise CorruptCheckpointError(f"key path {index.fqn!r}: cannot read the stored "
                                         f"value: {first_line(e)}", file=path) from None

    def _decoded(self, index: Any, si: Any, stream: Any, limit: int, path: str) -> io.BytesIO:
        """The item's bytes through its transforms, at most ``limit`` bytes decoded (the
        value's own), in pieces (a read of n bytes allocates n first); a transform that cannot
        be applied (unknown, damaged stream) is a CorruptCheckpointError naming the item
        (before 2026-12-07: torch's ValueError, zstandard's ZstdError, raw)."""
        descs = si.transform_descriptors
        if not (isinstance(descs, (list, tuple)) and all(isinstance(d, str) for d in descs)):
            raise CorruptCheckpointError(f"key path {index.fqn!r}: the stream transforms "
                                         f"{descs!r} are not a list of names", file=path,
                                         offset=si.offset)
        out = io.BytesIO()
        try:
            if self._transforms is None:
                from torch.distributed.checkpoint import FileSystemReader
                self._transforms = FileSystemReader(self.src).transforms
            raw = self._transforms.transform_load_stream(None, descs, stream)
            while out.tell() <= limit and (b := raw.read(min(64 << 20, limit + 1 - out.tell()))):
                out.write(b)
        except Exception as e:  # noqa: BLE001 - whatever the transform raises on these bytes
            raise CorruptCheckpointError(
                f"key path {index.fqn!r}: the stored value's stream transforms {list(descs)} "
                f"cannot be applied: {type(e).__name__}: {first_line(e)}", file=path,
                offset=si.offset) from None
        if out.tell() > limit:
            raise CorruptCheckpointError(
                f"key path {index.fqn!r}: the stored value decompresses to more than "
                f"{limit} bytes, the most it may hold", file=path, offset=si.offset)
        out.seek(0)
        return out

    def close(self) -> None:
        for f in self.open.values():
            f.close()


def first_line(e: BaseException) -> str:
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    hit = next((x for x in lines if "global" in x.lower()), lines[0] if lines else "")
    return hit[:300] or type(e).__name__
