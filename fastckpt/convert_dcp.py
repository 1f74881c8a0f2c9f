"""(``fastckpt convert``) Reading a DCP checkpoint directory as untrusted input: its pickled
``.metadata`` through an allow-list unpickler that also refuses to change the objects it
allows, and its data files (plain names, opened once, no link followed, no FIFO waited for;
every item read inside its file, a stream-transformed one decoded up to its size).
"""

from __future__ import annotations

import errno
import io
import os
import pickle
import re
import struct
from typing import Any

import torch

from .errors import CorruptCheckpointError, UnsupportedStateError

MAX_METADATA_BYTES = 1 << 30
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
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


class _MetadataUnpickler(pickle._Unpickler):  # (Python's: its BUILD can be checked)
    """DCP's ``.metadata`` is a pickle: only DCP's own metadata classes, torch.Size and dtypes
    are resolved; any other global is refused before anything runs. BUILD (set the attributes
    of the object on the stack) applies to a new instance of DCP's metadata classes only: on
    anything else the pickle can reach (those classes themselves, the enum's members,
    ``_get_layout``) it would change torch's objects for the rest of the process (before
    2026-12-07 it did: C's unpickler, whose BUILD cannot be checked)."""
    dispatch = dict(pickle._Unpickler.dispatch)

    def __init__(self, f: Any) -> None:
        super().__init__(f)
        from torch.distributed.checkpoint import filesystem, metadata as m
        self.buildable = frozenset({
            m.Metadata, m.BytesStorageMetadata, m.ChunkStorageMetadata, m.MetadataIndex,
            m.StorageMeta, m.TensorProperties, m.TensorStorageMetadata, filesystem._StorageInfo})

    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                                torch.dtype)):
            return getattr(torch, name)
        if name in _META_CLASSES.get(module, ()):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refused global {module}.{name}")

    def load_build(self) -> None:
        inst = self.stack[-2] if len(self.stack) > 1 else None
        if type(inst) not in self.buildable:
            what = (f"{getattr(inst, '__module__', '?')}.{inst.__qualname__}"
                    if hasattr(inst, "__qualname__") else f"a {type(inst).__qualname__}")
            raise pickle.UnpicklingError(f"the pickle sets attributes of {what}, an object it "
                                         "may only use")
        pickle._Unpickler.load_build(self)
    dispatch[pickle.BUILD[0]] = load_build


def read_metadata(src: str) -> Any:
    from torch.distributed.checkpoint.metadata import Metadata
    path = os.path.join(src, ".metadata")
    with open_regular(path) as f:
        if os.fstat(f.fileno()).st_size > MAX_METADATA_BYTES:
            raise CorruptCheckpointError("DCP .metadata is larger than 1 GiB", file=path)
        try:
            md = _MetadataUnpickler(f).load()
        except (pickle.UnpicklingError, EOFError, AttributeError, TypeError, ValueError,
                IndexError, KeyError, struct.error, RecursionError) as e:
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
            if refused_object(e):
                raise UnsupportedStateError(
                    f"key path {index.fqn!r}: DCP pickled this value and the safe unpickler "
                    f"(torch.load weights_only=True) refuses it ({first_line(e)}); fastckpt "
                    "never unpickles arbitrary objects. Nothing was committed") from None
            err: Exception = e  # (damaged bytes: before 2026-12-07 reported as a refused object)
        except (RuntimeError, EOFError, ValueError, OSError) as e:
            err = e
        raise CorruptCheckpointError(f"key path {index.fqn!r}: cannot read the stored value: "
                                     f"{first_line(err)}", file=path, offset=si.offset)

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


#: the lines of torch's weights-only error that say nothing of this file
_TORCH_BOILERPLATE = ("Weights only load failed", "Please file an issue", "Check the documentation")


def first_line(e: BaseException) -> str:
    """The line of an unpickling error that says what is wrong (the refused global, else the
    first that is not torch's boilerplate)."""
    lines = [x.strip() for x in str(e).splitlines() if x.strip()]
    hit = next((x for x in lines if "global" in x.lower()), None) or next(
        (x for x in lines if not x.startswith(_TORCH_BOILERPLATE)), lines[0] if lines else "")
    return hit[:300] or type(e).__name__


def refused_object(e: pickle.UnpicklingError) -> bool:
    """Whether torch.load(weights_only=True) refused a pickled object (every object that is not
    plain data is named by a GLOBAL, which it refuses), not damaged bytes ("Unsupported
    operand", a truncated stream)."""
    return "global" in str(e).lower()
