"""``fastckpt convert``, review of 2026-12-07: regression tests, each written to fail on the code
before its fix.

1. a ``--force`` conversion that failed before its commit removed the replaced step's chunk
   index files (``.fci``, format 4): the committed step it was to leave untouched then named
   missing files and no longer loaded;
2. a DCP tensor chunk whose stream transform cannot be applied (an unknown extension, a
   descriptor list that is a string, a damaged zstd stream) escaped as a raw ValueError /
   ZstdError (the CLI: exit 70, "internal error"), naming neither the key nor the file;
3. a torch.save SRC that is a FIFO: ``detect`` opened it blocking and waited for a writer,
   for good;
4. the restricted ``.metadata`` unpickler let the pickle's BUILD opcode set attributes on the
   objects it allows (a DCP class, an enum member, its very class,
   ``torch.serialization._get_layout``): torch's objects changed for the rest of the process;
5. a DCP item whose bytes are damaged (not a pickled object: zeroed, truncated) was reported
   as "DCP pickled this value and the safe unpickler refuses it" (an UnsupportedStateError
   quoting torch's "Weights only load failed ... weights_only=False will likely succeed"
   boilerplate, no file, no offset): now a CorruptCheckpointError naming the key, the file,
   the offset and what torch found; likewise a damaged legacy torch.save file ("damaged
   torch.save file", naming it; exit 1 as before).
"""

from __future__ import annotations

import os
import pickle
import threading
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fastckpt
from fastckpt import convert as conv
from fastckpt.errors import CorruptCheckpointError
from fastckpt.manifest import schema as fmt
from tests.clirun import call


def _dcp(tmp_path, state: dict | None = None) -> tuple[str, object]:
    src = str(tmp_path / "dcp")
    with warnings.catch_warnings():  # DCP warns when it runs without a process group
        warnings.simplefilter("ignore")
        dcp.save(state or {"w": torch.ones(4), "v": 3}, checkpoint_id=src, no_dist=True)
    with open(os.path.join(src, ".metadata"), "rb") as f:
        return src, pickle.load(f)  # (a test's own file)


def _write_md(src: str, md) -> None:
    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _item(md, fqn: str):
    (si,) = [si for k, si in md.storage_data.items() if k.fqn == fqn]
    return si


# ------------------------------------------ 1. a failed --force keeps the replaced step whole

def test_failed_force_convert_leaves_the_committed_steps_index_files(tmp_path):
    root = str(tmp_path / "root")
    want = torch.arange(8, dtype=torch.float32)
    fastckpt.save({"w": want.clone()}, root, step=5, rank_indexes=1)  # (format 4: an index)
    d = os.path.join(root, fmt.step_dirname(5))
    before = sorted(os.listdir(d))
    assert any(n.endswith(".fci") for n in before)
    src, md = _dcp(tmp_path, {"w": torch.ones(4)})
    si = _item(md, "w")
    with open(os.path.join(src, si.relative_path), "r+b") as f:  # a damaged chunk: the
        f.seek(si.offset)                                          # conversion fails
        f.write(bytes(min(si.length, 64)))
    with pytest.raises(fastckpt.errors.FastCkptError):
        conv.convert(src, root, step=5, force=True)
    assert sorted(os.listdir(d)) == before
    got = {"w": torch.zeros(8)}
    assert fastckpt.load(got, root, step=5) == 5
    assert torch.equal(got["w"], want)


# --------------------------------------- 2. a transform that cannot be applied: a named error

def _unknown(si, path):
    si.transform_descriptors = ["bogus/1"]


def _a_string(si, path):
    si.transform_descriptors = "stream.zstd/1"


def _damaged_zstd(si, path):
    pytest.importorskip("zstandard")
    si.transform_descriptors = ["stream.zstd/1"]  # the bytes are torch.save's, not zstd's


@pytest.mark.parametrize("edit", [_unknown, _a_string, _damaged_zstd])
def test_a_chunk_whose_transform_cannot_be_applied_is_a_named_error(tmp_path, edit, capsys):
    src, md = _dcp(tmp_path, {"w": torch.ones(4)})
    si = _item(md, "w")
    edit(si, os.path.join(src, si.relative_path))
    _write_md(src, md)
    root = str(tmp_path / "root")
    with pytest.raises(CorruptCheckpointError) as ei:
        conv.convert(src, root)
    assert "'w'" in str(ei.value) and si.relative_path in str(ei.value)
    assert not os.path.isdir(os.path.join(root, fmt.step_dirname(0)))
    code, _, err = call("convert", src, str(tmp_path / "root2"), capsys=capsys)
    assert code == 1, err
    assert "Traceback" not in err and si.relative_path in err


# --------------------------------------------------------- 3. a FIFO as SRC is not waited for

def test_a_fifo_src_is_refused_not_waited_for(tmp_path):
    fifo = str(tmp_path / "model.pt")
    os.mkfifo(fifo)
    out: list = []

    def run():
        try:
            conv.convert(fifo, str(tmp_path / "root"))
        except BaseException as e:  # noqa: BLE001 - the test looks at it
            out.append(e)
    th = threading.Thread(target=run, daemon=True)
    th.start()
    th.join(60)
    if th.is_alive():  # release the blocked open (a writer that opens and goes)
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        th.join(10)
        pytest.fail("convert waited for a writer of the FIFO SRC")
    assert out and isinstance(out[0], conv.NotConvertibleError), out
    assert "regular file" in str(out[0]) and fifo in str(out[0])


# ------------------------------------ 4. the .metadata unpickler sets no attribute of a global

_MD = b"ctorch.distributed.checkpoint.metadata\n"
_TARGETS = {
    # GLOBAL MetadataIndex; BUILD (None, {"pwned_": 1}): setattr on the class
    "class": (_MD + b"MetadataIndex\nN}X\x06\x00\x00\x00pwned_K\x01s\x86b.",
              lambda: __import__("torch.distributed.checkpoint.metadata", fromlist=["x"])
              .MetadataIndex.__dict__.get("pwned_")),
    # _MEM_FORMAT_ENCODING(0), the enum member; BUILD {"_value_": 7}: its value changed
    "enum member": (_MD + b"_MEM_FORMAT_ENCODING\nK\x00\x85R}X\x07\x00\x00\x00_value_K\x07sb.",
                    lambda: __import__("torch.distributed.checkpoint.metadata", fromlist=["x"])
                    ._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT.value == 7 or None),
    # the member's class replaced (BUILD (None, {"__class__": MetadataIndex})): an attribute
    # that is not in its __dict__
    "enum member's class": (_MD + b"_MEM_FORMAT_ENCODING\nK\x00\x85RN}X\t\x00\x00\x00"
                            b"__class__" + _MD + b"MetadataIndex\ns\x86b.",
                            lambda: __import__("torch.distributed.checkpoint.metadata",
                                               fromlist=["x"])._MEM_FORMAT_ENCODING(0).__class__
                            .__name__ != "_MEM_FORMAT_ENCODING" or None),
    # GLOBAL torch.serialization._get_layout; BUILD {"cache": {}}: torch's layout cache
    # replaced
    "function": (b"ctorch.serialization\n_get_layout\n}X\x05\x00\x00\x00cache}X\x01\x00\x00"
                 b"\x00xK\x01ssb.",
                 lambda: torch.serialization._get_layout.cache.get("x")),
}


@pytest.mark.parametrize("target", sorted(_TARGETS))
def test_metadata_that_sets_attributes_of_allowed_globals_is_refused(tmp_path, target):
    payload, changed = _TARGETS[target]
    src = tmp_path / "dcp"
    src.mkdir()
    (src / ".metadata").write_bytes(b"\x80\x02" + payload)
    import torch.distributed.checkpoint.metadata as m
    member = m._MEM_FORMAT_ENCODING.TORCH_CONTIGUOUS_FORMAT
    enum_value = member._value_
    cache = torch.serialization._get_layout.cache
    try:
        with pytest.raises(CorruptCheckpointError, match="sets attributes") as ei:
            conv.convert(str(src), str(tmp_path / "root"))
        assert ".metadata" in str(ei.value)
        assert changed() is None, "a global of torch's was changed"
    finally:  # (the code before: put them back, for the other tests of this process)
        m.MetadataIndex.__dict__.get("pwned_") and delattr(m.MetadataIndex, "pwned_")
        object.__setattr__(member, "__class__", m._MEM_FORMAT_ENCODING)
        member._value_ = enum_value
        torch.serialization._get_layout.cache = cache


# ------------------------------------- 5. a damaged item is damage, not a refused pickled object

@pytest.mark.parametrize("fqn", ["w", "v"])
def test_a_damaged_item_is_named_as_damage_with_its_file_and_offset(tmp_path, fqn):
    src, md = _dcp(tmp_path, {"w": torch.ones(4), "v": [1, 2]})
    si = _item(md, fqn)
    with open(os.path.join(src, si.relative_path), "r+b") as f:
        f.seek(si.offset)
        f.write(bytes(min(si.length, 64)))
    with pytest.raises(CorruptCheckpointError) as ei:
        conv.convert(src, str(tmp_path / "root"))
    msg = str(ei.value)
    assert f"{fqn!r}" in msg and si.relative_path in msg and ei.value.offset == si.offset, msg
    assert "weights_only` set to `False`" not in msg and "Unsupported operand" in msg, msg


def test_a_damaged_legacy_torch_save_file_is_not_called_pickled_objects(tmp_path,
                                                                        capsys):
    src = str(tmp_path / "model.pt")
    torch.save({"w": torch.ones(4)}, src, _use_new_zipfile_serialization=False)
    with open(src, "r+b") as f:  # (the head, b"\x80", kept: it is a torch.save file still)
        f.seek(2)
        f.write(bytes(38))
    with pytest.raises(CorruptCheckpointError, match="damaged torch.save file: Unsupported "
                                                     "operand 0") as ei:
        conv.convert(src, str(tmp_path / "root"))
    assert ei.value.file == src
    code, _, err = call("convert", src, str(tmp_path / "root"), capsys=capsys)
    assert code == 1 and "Unsupported operand 0" in err and "pickled objects" not in err, err
