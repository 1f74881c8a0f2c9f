"""Checkpoints are untrusted input (docs/design.md, "Threat model"): regression tests for the
defects of a later adversarial pass, each written to fail on the engine before its fix.

1. two tensors whose chunks start at one (file, offset): the reader read the chunk once and
   served the second tensor the first one's bytes (silently, under its own dtype);
2. compressed chunks whose frames are too short for the raw size they claim (an allocation of
   the manifest's size from a tiny shard), and allocations that fail;
3. ``fastckpt convert`` of a DCP item whose stream transform (zstd) decodes past its size;
4. ``fastckpt convert``'s raw errors: missing and linked files, sizes that are not ints,
   planner_data that puts one value inside another.
"""

from __future__ import annotations

import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp
import xxhash

import fastckpt
from fastckpt import convert as conv
from fastckpt.errors import CorruptCheckpointError
from fastckpt.manifest import schema as fmt
from fastckpt.storage import codec
from tests.crafted import read_doc, write_doc


def _chunk(doc: dict, fqn: str) -> dict:
    return doc["body"]["tensors"][fqn]["chunks"][0]


def _hex(data: bytes) -> str:
    return fmt.hexdigest(xxhash.xxh3_64_intdigest(data))


def _shard(root: str, c: dict) -> str:
    return os.path.join(root, fmt.step_dirname(1), c["file"])


# ------------------------------------------------- 1. chunks of two tensors at one file offset

def _shared_start(root: str, other: str) -> dict:
    """``other``'s chunk moved to where tensor a's starts, its checksum that of the bytes
    there (a crafted manifest: the checksum detects damage, not tampering)."""
    a = torch.arange(4, dtype=torch.float32) + 0.5
    fastckpt.save({"a": a, "b": torch.zeros(4, dtype=torch.int32), "c": torch.zeros(8),
                   "step": 1}, root, step=1)
    doc = read_doc(root, 1)
    ca, co = _chunk(doc, "a"), _chunk(doc, other)
    with open(_shard(root, ca), "rb") as f:
        f.seek(ca["offset"])
        data = f.read(co["length"])
    co.update(file=ca["file"], offset=ca["offset"], checksum=_hex(data))
    write_doc(root, 1, doc)
    return ca


@pytest.mark.parametrize("other", ["b", "c"])  # int32[4] on a's 16 bytes; float32[8] on 32
def test_two_tensors_whose_chunks_start_at_one_offset_are_refused(root, other):
    ca = _shared_start(root, other)
    dest = {"a": torch.zeros(4), "b": torch.full((4,), 7, dtype=torch.int32),
            "c": torch.full((8,), 7.0), "step": 0}
    with pytest.raises(CorruptCheckpointError, match="cannot share bytes") as ei:
        fastckpt.load(dest, root)
    msg = str(ei.value)
    assert "'a'" in msg and repr(other) in msg and ca["file"] in msg
    assert ei.value.offset == ca["offset"] and ei.value.key == other
    assert torch.equal(dest["b"], torch.full((4,), 7, dtype=torch.int32))  # not a's bytes
    with pytest.raises(CorruptCheckpointError, match="cannot share bytes"):
        fastckpt.read(root)


def test_one_tensor_of_a_shared_start_alone_loads_its_own_bytes(root):
    """Loading only the second tensor reads its own chunk entry: its bytes, as its dtype,
    checked against its own checksum."""
    ca = _shared_start(root, "b")
    with open(_shard(root, ca), "rb") as f:
        f.seek(ca["offset"])
        want = torch.frombuffer(bytearray(f.read(16)), dtype=torch.int32)
    dest = {"b": torch.zeros(4, dtype=torch.int32)}
    fastckpt.load(dest, root, strict=False)
    assert torch.equal(dest["b"], want)


def test_tied_keys_and_empty_tensors_still_share_what_they_share(root):
    """What is shared legitimately: a tied tensor's keys (one chunk, read once), empty chunks
    (several at one offset, nothing to read)."""
    w = torch.randn(6, 5)
    state = {"w": w, "tied": w, "e1": torch.zeros(0), "e2": torch.zeros(0, 3, dtype=torch.int64),
             "e3": torch.zeros(2, 0), "x": torch.arange(3.0)}
    fastckpt.save(state, root, step=1)
    got = fastckpt.read(root)
    assert got["tied"] is got["w"] and torch.equal(got["w"], w)
    assert got["e2"].shape == (0, 3) and got["e3"].shape == (2, 0)
    dest = {"w": torch.zeros(6, 5), "tied": torch.zeros(6, 5), "e1": torch.zeros(0),
            "e2": torch.zeros(0, 3, dtype=torch.int64), "e3": torch.zeros(2, 0),
            "x": torch.zeros(3)}
    fastckpt.load(dest, root)
    assert torch.equal(dest["tied"], w) and torch.equal(dest["x"], torch.arange(3.0))


# --------------------------------------------------------- 2. compressed chunks, allocations

def _compressed(root: str, t: torch.Tensor) -> tuple[dict, dict]:
    pytest.importorskip("zstandard")
    fastckpt.save({"w": t, "step": 1}, root, step=1, compression="zstd")
    doc = read_doc(root, 1)
    c = _chunk(doc, "w")
    assert "codec" in c
    return doc, c


def _claim(root: str, doc: dict, c: dict, n: int, block: int, frames: list,
           stored: bytes) -> None:
    """Tensor w (uint8) claims n raw bytes in ``frames`` over ``stored``."""
    with open(_shard(root, c), "wb") as f:
        f.write(stored)
    b = doc["body"]
    b["tensors"]["w"]["shape"] = [n]
    c.update(offsets=[0], sizes=[n], offset=0, length=len(stored), checksum=_hex(stored))
    c["codec"] = {"codec": "zstd", "group": 1, "block": block, "frames": frames,
                  "checksum": False, "level": 1}
    b["files"][c["file"]]["size"] = len(stored)
    write_doc(root, 1, doc)


def test_compressed_frames_too_short_for_their_raw_size_are_refused(root):
    """9-byte frames (the shortest zstd frame) each claiming a 4 MiB block: 1 TiB from a 2 MiB
    shard. A zstd block holds at most 128 KiB and takes 4 bytes or more, so such a frame is
    refused before anything is allocated."""
    doc, c = _compressed(root, torch.zeros(1 << 16, dtype=torch.uint8))
    n, block = 1 << 40, codec.DEFAULT_BLOCK
    frames = [codec.MIN_FRAME] * (n // block)
    _claim(root, doc, c, n, block, frames, bytes(sum(frames)))
    with pytest.raises(CorruptCheckpointError, match="frame 0 .*impossible for 4194304") as ei:
        fastckpt.read(root)
    assert ei.value.key == "w"


def test_compressed_block_larger_than_any_writer_wrote_is_refused(root):
    doc, c = _compressed(root, torch.zeros(1 << 16, dtype=torch.uint8))
    n = block = 64 << 20
    frame = __import__("zstandard").ZstdCompressor(level=3).compress(bytes(n))
    _claim(root, doc, c, n, block, [len(frame)], frame)
    with pytest.raises(CorruptCheckpointError, match="block"):
        fastckpt.read(root)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.bfloat16, torch.float32, torch.float64])
def test_highly_compressible_chunks_still_load(root, dtype):
    """The shortest frames zstd writes (zeros: RLE blocks) pass the bound, at any level, in
    blocks, in planes and in the short tail."""
    n = (5 << 20) // dtype.itemsize + 3
    t = torch.zeros(n, dtype=dtype)
    t[-1] = 1
    fastckpt.save({"w": t}, root, step=1, compression="zstd")
    assert "codec" in _chunk(read_doc(root, 1), "w")
    assert torch.equal(fastckpt.read(root)["w"], t)
    raw = bytes(4 << 20) + b"\x01" * 7
    for level in (codec.MIN_LEVEL, 1, 3, 19):
        for width in codec.GROUP_WIDTHS:
            enc = codec.encode(raw, width=width, level=level)
            codec.validate_desc(enc.desc, len(raw), enc.nbytes)


def _failing_empty(monkeypatch, numel: int) -> None:
    """torch.empty of ``numel`` elements or more fails as the allocator does when memory runs
    out."""
    real = torch.empty

    def empty(*size, **kw):
        shape = size[0] if len(size) == 1 and not isinstance(size[0], int) else size
        if isinstance(shape, (tuple, list, torch.Size)) and \
                torch.Size(shape).numel() >= numel:
            raise RuntimeError("[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: "
                               "can't allocate memory: you tried to allocate 1099511627776 bytes")
        return real(*size, **kw)
    monkeypatch.setattr(torch, "empty", empty)


def test_a_failed_allocation_of_a_fresh_tensor_names_the_tensor(root, monkeypatch):
    fastckpt.save({"w": torch.ones(1 << 16), "step": 1}, root, step=1)
    _failing_empty(monkeypatch, 1 << 16)
    with pytest.raises(CorruptCheckpointError, match="cannot allocate .*DefaultCPUAllocator") \
            as ei:
        fastckpt.read(root)
    assert ei.value.key == "w" and "262144 bytes" in str(ei.value)


def test_a_failed_allocation_of_a_decode_buffer_names_the_tensor(root, monkeypatch):
    """A compressed chunk whose destination does not take it whole (here a strided view) is
    decoded into a temporary tensor first."""
    t = torch.arange(1 << 16, dtype=torch.float32)
    doc, c = _compressed(root, t)
    dest = {"w": torch.zeros(2 << 16)[::2], "step": 0}
    _failing_empty(monkeypatch, 1 << 16)
    with pytest.raises(CorruptCheckpointError, match="cannot allocate") as ei:
        fastckpt.load(dest, root)
    assert ei.value.key == "w" and c["file"] in str(ei.value)
    monkeypatch.undo()
    fastckpt.load(dest, root)
    assert torch.equal(dest["w"], t)


# ----------------------------------------------------------------------- 3-4. fastckpt convert

def _dcp(tmp_path, state: dict | None = None) -> tuple[str, str, object]:
    src, root = str(tmp_path / "dcp"), str(tmp_path / "root")
    with warnings.catch_warnings():  # DCP warns when it runs without a process group
        warnings.simplefilter("ignore")
        dcp.save(state or {"w": torch.ones(4), "v": 3}, checkpoint_id=src, no_dist=True)
    with open(os.path.join(src, ".metadata"), "rb") as f:
        return src, root, pickle.load(f)  # (a test's own file)


def _write_md(src: str, md) -> None:
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _nothing_committed(root: str) -> None:
    assert not os.path.isdir(root) or not any(
        fmt.parse_step_dirname(n) is not None for n in os.listdir(root))


def test_convert_reads_a_transformed_item_only_up_to_its_size(tmp_path):
    """A DCP item with the "stream.zstd/1" transform that decodes to 256 MiB (8 KiB stored)
    for a 16-byte tensor: refused once past the tensor's size and torch.save's framing."""
    zstandard = pytest.importorskip("zstandard")
    src, root, md = _dcp(tmp_path, {"w": torch.ones(4)})
    (_, si), = md.storage_data.items()
    path = os.path.join(src, si.relative_path)
    with open(path, "wb") as out:
        w = zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False)
        for _ in range(4):
            w.write(bytes(64 << 20))
        w.flush(zstandard.FLUSH_FRAME)
    si.offset, si.length, si.transform_descriptors = 0, os.path.getsize(path), ["stream.zstd/1"]
    _write_md(src, md)
    with pytest.raises(CorruptCheckpointError, match="decompresses to more than") as ei:
        conv.convert(src, root)
    assert si.relative_path in str(ei.value) and "'w'" in str(ei.value)
    _nothing_committed(root)


def _link_data(src: str, md, tmp_path) -> None:
    (_, si), = [(k, v) for k, v in md.storage_data.items() if k.fqn == "w"]
    p = os.path.join(src, si.relative_path)
    real = str(tmp_path / "real.distcp")
    os.rename(p, real)
    os.symlink(real, p)


def _link_md(src: str, md, tmp_path) -> None:
    real = str(tmp_path / "real.metadata")
    os.rename(os.path.join(src, ".metadata"), real)
    os.symlink(real, os.path.join(src, ".metadata"))


def _remove_data(src: str, md, tmp_path) -> None:
    for si in md.storage_data.values():
        if os.path.exists(os.path.join(src, si.relative_path)):
            os.remove(os.path.join(src, si.relative_path))


@pytest.mark.parametrize("damage, what", [(_remove_data, "No such file"),
                                          (_link_data, "symbolic link"),
                                          (_link_md, "symbolic link")])
def test_convert_missing_or_linked_files_are_named_errors(tmp_path, damage, what):
    src, root, md = _dcp(tmp_path)
    damage(src, md, tmp_path)
    with pytest.raises(CorruptCheckpointError, match=what) as ei:
        conv.convert(src, root)
    assert src in str(ei.value)
    _nothing_committed(root)


def _size(v):
    return lambda md: setattr(md.state_dict_metadata["w"], "size", v)


def _sizes(v):
    return lambda md: setattr(md.state_dict_metadata["w"].chunks[0], "sizes", v)


@pytest.mark.parametrize("edit", [_size([float("inf")]), _size([float("nan")]), _sizes("ab"),
                                  _sizes([float("inf")])], ids=["inf", "nan", "str", "chunk-inf"])
def test_convert_metadata_sizes_that_are_not_ints_are_refused(tmp_path, edit):
    src, root, md = _dcp(tmp_path)
    edit(md)
    _write_md(src, md)
    with pytest.raises(CorruptCheckpointError, match="malformed dcp checkpoint"):
        conv.convert(src, root)
    _nothing_committed(root)


@pytest.mark.parametrize("paths", [{"w": ("x", "y"), "v": ("x",)},
                                   {"w": ("x",), "v": ("x", "y")},
                                   {"w": ("x",), "v": ("x",)}])
def test_convert_planner_data_with_a_value_inside_another_is_refused(tmp_path, paths):
    """w at x.y and v at x: the skeleton holds one of them, the other is stored but could never
    be loaded (before: converted 'successfully', w lost)."""
    src, root, md = _dcp(tmp_path)
    md.planner_data = paths
    _write_md(src, md)
    with pytest.raises(CorruptCheckpointError, match="planner_data puts") as ei:
        conv.convert(src, root)
    assert "'w'" in str(ei.value) and "'v'" in str(ei.value)
    _nothing_committed(root)
