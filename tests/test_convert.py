"""``fastckpt convert``: DCP checkpoint directories (one rank's, N ranks' shards) and torch.save
files into fastckpt checkpoints, offline and bit-exact; what is refused (pickled objects, values
fastckpt cannot store) commits nothing and runs nothing; SRC is never changed; loading a DCP
directory with fastckpt says to convert it. Real DCP saves, real gloo ranks, no mocks."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import warnings

import pytest
import torch
import torch.distributed.checkpoint as dcp

import fastckpt
from fastckpt import convert as conv
from fastckpt.errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedStateError
from fastckpt.manifest import schema as fmt
from fastckpt.storage import LocalStorage
from tests.clirun import call
from tests.distributed import run
from tests.models import assert_same, fsdp_mlp, full_state, mlp, train_step

# ---------------------------------------------------------------------------------- helpers


def _dcp_save(state: dict, path: str) -> None:
    with warnings.catch_warnings():  # DCP warns when it runs without a process group
        warnings.simplefilter("ignore")
        dcp.save(state, checkpoint_id=path, no_dist=True)


def _hashes(path: str) -> dict:
    """Every file under ``path`` (or the file itself): name -> sha256, size, mtime."""
    files = [path] if os.path.isfile(path) else [
        os.path.join(d, n) for d, _, names in os.walk(path) for n in names]
    out = {}
    for p in files:
        with open(p, "rb") as f:
            st = os.stat(p)
            out[os.path.relpath(p, path)] = (hashlib.sha256(f.read()).hexdigest(), st.st_size,
                                             st.st_mtime_ns)
    return out


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())


def _same(got, want, path: str = "") -> None:
    """Equal structure (dict keys and their types, list vs tuple), tensors bit for bit (dtype,
    shape, every byte: NaN payloads and -0.0 included), plain values equal."""
    assert type(got) is type(want) or (isinstance(got, dict) and isinstance(want, dict)), \
        (path, type(got), type(want))
    if isinstance(want, torch.Tensor):
        assert (got.dtype, got.shape) == (want.dtype, want.shape), path
        assert _bits(got) == _bits(want), path
    elif isinstance(want, dict):
        assert set(got) == set(want), (path, set(got) ^ set(want))
        for k in want:
            _same(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), path
        for i, (a, b) in enumerate(zip(got, want)):
            _same(a, b, f"{path}.{i}")
    else:
        assert got == want, path


def _zeroed(x):
    """The same structure with every tensor zeroed and every plain number changed."""
    if isinstance(x, torch.Tensor):
        return torch.zeros_like(x)
    if isinstance(x, dict):
        return type(x)((k, _zeroed(v)) for k, v in x.items())
    if isinstance(x, (list, tuple)):
        return type(x)(_zeroed(v) for v in x)
    return -1 if isinstance(x, (int, float)) and not isinstance(x, bool) else x


def _manifest(root: str, step: int) -> dict:
    with open(os.path.join(root, fmt.step_dirname(step), fmt.MANIFEST)) as f:
        return json.load(f)["body"]


class _Evil:
    """Unpickling it would create ``marker`` (builtins.open): the tests check it never is."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _train_state() -> dict:
    """A plain model + Adam (after a step) as state dicts, plain values, nested lists, a tuple
    holding a tensor (DCP pickles tuples whole), several dtypes, an empty and a 0-d tensor."""
    m = mlp(0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    train_step(m, opt, 0)
    return {"model": m.state_dict(), "optim": opt.state_dict(), "step": 7,
            "cfg": {"lr": 0.01, "name": "run-1", "betas": (0.9, 0.999), "none": None},
            "nested": [[1, 2, [3, "x"]], {"t": torch.arange(5, dtype=torch.int32)},
                       [torch.randn(2, 3).bfloat16(), "s"]],
            "pair": (4, torch.tensor([1.5, -0.0])),
            "flags": torch.tensor([True, False, True]), "empty": torch.zeros(0, 3),
            "count": torch.tensor(12, dtype=torch.int64)}


# ------------------------------------------------------------------------------ DCP, 1 rank

def test_dcp_single_process_nested_state_bit_exact(tmp_path):
    """A one-process DCP save of a model and Adam state dict, plain values and nested lists:
    ``fastckpt.read`` gives back the saved nested dict (the optimizer's int keys, tuples and
    lists included), ``fastckpt.load`` fills the same structure and a module, bit for bit;
    the step comes from SRC's name; SRC is byte-for-byte unchanged."""
    src, root = str(tmp_path / "dcp" / "step-7"), str(tmp_path / "ckpt")
    state = _train_state()
    _dcp_save(state, src)
    before = _hashes(src)
    res = conv.convert(src, root)
    assert (res.step, res.step_from, res.source_format, res.source_ranks) == (7, "name", "dcp", 1)
    assert res.verified and res.bytes_verified > 0 and res.seconds > 0
    tensors = set(_manifest(root, 7)["tensors"])
    assert {"optim.state.0.exp_avg", "pair.1"} <= tensors and len(tensors) == res.tensors
    assert res.bytes == sum(t.numel() * t.element_size() for t in _leaves(state))
    assert _hashes(src) == before

    _same(fastckpt.read(root), state)
    dest = _zeroed(state)
    assert fastckpt.load(dest, root) == 7
    _same(dest, state)
    m = mlp(3)
    fastckpt.load({"model": m}, root, strict=False)
    _same(m.state_dict(), state["model"])


def _leaves(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _leaves(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _leaves(v)


# ------------------------------------------------------------------------- DCP, 2 ranks FSDP2

def _dcp_save_fsdp(rank, world, src):
    from torch.distributed.checkpoint.state_dict import get_state_dict
    m = fsdp_mlp(0)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    train_step(m, opt, 0, rank, world)
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd, "step": 1}, checkpoint_id=src)
    return full_state(m, opt)


def _fastckpt_load_fsdp(rank, world, root):
    m = fsdp_mlp(5)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    state = {"model": m, "optim": opt, "step": 0}
    fastckpt.load(state, root)
    return full_state(m, opt), state["step"]


def test_dcp_fsdp2_two_ranks_converted_offline(tmp_path):
    """Two gloo ranks save an FSDP2 model + Adam with DCP; the conversion runs here, in one
    process without a process group, keeping both ranks' shards as chunks; fastckpt loads the
    result on 1 rank (plain modules) and on 2 ranks (FSDP2), bit-exact against the full
    state the ranks saved."""
    src, root = str(tmp_path / "dcp"), str(tmp_path / "ckpt")
    want = run(_dcp_save_fsdp, 2, src)[0]
    before = _hashes(src)
    res = conv.convert(src, root, step=1)
    assert res.source_ranks == 2 and res.verified and res.step_from == "option"
    body = _manifest(root, 1)
    w = body["tensors"]["model.0.weight"]  # [33, 10], sharded along dim 0: 17 + 16 rows
    assert w["dtensor"] and sorted(c["sizes"][0] for c in w["chunks"]) == [16, 17]
    assert body["world_size"] == 1 and body["user_meta"]["source_ranks"] == 2
    assert _hashes(src) == before

    m = mlp(5)
    opt = torch.optim.Adam(m.parameters(), lr=1e-2)
    state = {"model": m, "optim": opt, "step": 0}
    assert fastckpt.load(state, root) == 1 and state["step"] == 1
    assert_same(want, full_state(m, opt))
    for got, step in run(_fastckpt_load_fsdp, 2, root):
        assert step == 1
        assert_same(want, got)


def test_dcp_compressed_with_dcp_extension(tmp_path):
    """DCP's stream extensions (zstd) are undone through DCP's own extension registry."""
    pytest.importorskip("zstandard")
    from torch.distributed.checkpoint._extension import ZStandard
    src, root = str(tmp_path / "dcp"), str(tmp_path / "c")
    state = {"w": torch.randn(64, 33), "z": torch.zeros(500, dtype=torch.float16), "n": 5}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(src, _extensions=[ZStandard()]),
                 no_dist=True)
    assert conv.convert(src, root).verified
    _same(fastckpt.read(root), state)


# ------------------------------------------------------------------------------- torch.save

def test_torch_save_bit_exact_with_ties_and_dtypes(tmp_path):
    """A torch.save file (bf16, fp16, int and bool tensors, NaN/-0.0 bit patterns, a
    non-contiguous view, a tied pair, an int-keyed dict) converts bit-exact; the tie is stored
    once and read back as one tensor; the file is unchanged."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(6, 4, generator=g)
    obj = {"model": mlp(0).state_dict(), "emb": w, "head": w, "wt": w.t(),
           "bf16": torch.randn(3, 5, generator=g).bfloat16(),
           "fp16": torch.randn(7, generator=g).half(), "i64": torch.arange(-3, 9),
           "i8": torch.tensor([-128, 0, 127], dtype=torch.int8),
           "u8": torch.tensor([0, 255], dtype=torch.uint8), "mask": torch.tensor([True, False]),
           "bits": torch.tensor([float("nan"), -0.0, float("inf"), 1e-45]),
           "scalar": torch.tensor(3, dtype=torch.int16),
           "meta": {"epoch": 3, "lr": 1e-3, "tags": ["a", "b"], "shape": (2, 3), 7: "int key"},
           "step": 100}
    src, root = str(tmp_path / "model.pt"), str(tmp_path / "ckpt")
    torch.save(obj, src)
    before = _hashes(src)
    res = conv.convert(src, root, step=100)
    assert (res.source_format, res.tied, res.verified) == ("torch_save", 1, True)
    body = _manifest(root, 100)
    assert "emb" in body["tensors"] and "head" not in body["tensors"]  # written once
    assert body["tensors"]["bf16"]["dtype"] == "bfloat16"
    got = fastckpt.read(root)
    _same(got, obj)
    assert got["emb"].data_ptr() == got["head"].data_ptr()
    assert _hashes(src) == before


def test_torch_save_pickled_object_refused_nothing_run_nothing_committed(tmp_path):
    """A torch.save file holding an arbitrary pickled object: refused naming the global it
    needs, never unpickled (its reduce would create a file), nothing written under ROOT."""
    marker, src, root = str(tmp_path / "pwned"), str(tmp_path / "m.pt"), str(tmp_path / "c")
    torch.save({"w": torch.ones(3), "obj": _Evil(marker)}, src)
    with pytest.raises(UnsupportedStateError, match=r"(io|builtins)\.open.*weights_only"):
        conv.convert(src, root)
    assert not os.path.exists(marker) and not os.path.exists(root)


def test_torch_save_unstorable_value_named_by_key_path(tmp_path):
    """A value the safe unpickler accepts but fastckpt cannot store (bytes): the error names
    its key path, nothing is committed."""
    src, root = str(tmp_path / "m.pt"), str(tmp_path / "c")
    torch.save({"w": torch.ones(3), "cfg": {"blob": b"\x00\x01"}}, src)
    with pytest.raises(UnsupportedStateError, match="cfg.blob"):
        conv.convert(src, root, step=1)
    assert not os.path.exists(os.path.join(root, fmt.step_dirname(1)))


# ------------------------------------------------------------------------ DCP, refusals

def test_dcp_pickled_object_refused_nothing_run_nothing_committed(tmp_path):
    """A DCP plain value that is an arbitrary object (DCP pickles it): refused naming its key,
    never unpickled, nothing committed; a crafted .metadata that would run code is refused
    before anything runs."""
    marker, src, root = str(tmp_path / "pwned"), str(tmp_path / "dcp"), str(tmp_path / "c")
    _dcp_save({"w": torch.ones(3), "obj": _Evil(marker)}, src)
    with pytest.raises(UnsupportedStateError, match=r"key path 'obj'.*weights_only"):
        conv.convert(src, root, step=2)
    assert not os.path.exists(marker) and fastckpt.steps(root) == []
    assert not os.path.exists(os.path.join(root, fmt.step_dirname(2)))

    with open(os.path.join(src, ".metadata"), "wb") as f:
        pickle.dump(_Evil(marker), f)
    with pytest.raises(CorruptCheckpointError, match=r"refused global (io|builtins)\.open"):
        conv.convert(src, root, step=2)
    assert not os.path.exists(marker)


def test_exclude_leaves_out_values_fastckpt_cannot_store(tmp_path, capsys):
    """torchtitan's DCP steps hold each rank's dataloader state as pickled bytes: refused
    naming the key (exit 1), converted without it with --exclude; the same for torch.save."""
    src, root = str(tmp_path / "step-5"), str(tmp_path / "c")
    _dcp_save({"model": {"w": torch.ones(3)}, "train_state": {"step": 5},
               "dataloader": {"dp_rank_0": pickle.dumps({"pos": 1})}}, src)
    rc, _, err = call("convert", src, root, capsys=capsys)
    assert rc == 1 and "'dataloader.dp_rank_0'" in err and "--exclude" in err
    rc, out, err = call("convert", src, root, "--exclude", "dataloader", capsys=capsys)
    assert rc == 0, err
    _same(fastckpt.read(root), {"model": {"w": torch.ones(3)}, "train_state": {"step": 5}})
    pt = str(tmp_path / "m.pt")
    torch.save({"w": torch.ones(2), "cfg": {"blob": b"x", "lr": 0.1}, "l": [{"b": b"y"}]}, pt)
    conv.convert(pt, root, step=6, exclude=["cfg.blob", "l.*.b"])
    _same(fastckpt.read(root, step=6), {"w": torch.ones(2), "cfg": {"lr": 0.1}, "l": [{}]})


class _FlipAfterWrite(LocalStorage):
    """A disk that silently damages the first byte of every shard it writes."""

    def _flip(self, path: str) -> None:
        with open(path, "r+b") as f:
            b = f.read(1)
            f.seek(0)
            f.write(bytes([b[0] ^ 0xFF]))

    def write_gathered(self, path, nbytes, segments, hash_ranges):
        hashes = super().write_gathered(path, nbytes, segments, hash_ranges)
        self._flip(path)
        return hashes

    def write_shard(self, path, buf, nbytes, ranges, **kw):
        hashes = super().write_shard(path, buf, nbytes, ranges, **kw)
        self._flip(path)
        return hashes


def test_verification_catches_a_shard_that_does_not_read_back(tmp_path):
    """The re-read before the commit is real: a write that lands damaged fails the conversion,
    names the tensor, and leaves no step behind."""
    src, root = str(tmp_path / "m.pt"), str(tmp_path / "c")
    torch.save({"w": torch.arange(1000.0)}, src)
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch.*nothing was committed"):
        conv.convert(src, _FlipAfterWrite(root), step=3)
    assert not os.path.exists(os.path.join(root, fmt.step_dirname(3)))


# --------------------------------------------------------------------------- the DCP hint

def test_loading_a_dcp_directory_says_convert_it(tmp_path, capsys):
    """fastckpt.load / resume / inspect on a DCP directory, or on a torchtitan-style root of
    step-N DCP directories, say it is a DCP checkpoint and what to run, not "nothing"."""
    titan = tmp_path / "titan"
    src = str(titan / "step-10")
    _dcp_save({"w": torch.ones(2), "step": 10}, src)
    pat = r"is a DCP checkpoint \(torch\.distributed\.checkpoint\); run `fastckpt convert "
    with pytest.raises(CheckpointNotFoundError, match=pat + ".*step-10 ROOT`"):
        fastckpt.load({"w": torch.zeros(2)}, src)
    with pytest.raises(CheckpointNotFoundError, match=r"torchtitan.*" + pat):
        fastckpt.load({"w": torch.zeros(2)}, str(titan))
    for argv in (["resume", src], ["resume", str(titan)], ["inspect", src], ["verify", src]):
        rc, out, err = call(*argv, capsys=capsys)
        # a usage error (exit 2), never "nothing committed" (exit 3: a job script starts fresh)
        assert rc == 2 and "is a DCP checkpoint" in err and f"fastckpt convert {src} ROOT" in err, \
            (argv, err)
    rc, out, err = call("resume", src, "--json", capsys=capsys)
    assert rc == 2 and "fastckpt convert" in out + err
    assert fastckpt.latest_step(src) is None  # a plain fastckpt root: still just "none"


def test_ls_on_a_dcp_directory_says_convert_it(tmp_path, capsys):
    src = str(tmp_path / "step-10")
    _dcp_save({"w": torch.ones(2)}, src)
    rc, out, err = call("ls", src, capsys=capsys)
    assert rc == 2 and "is a DCP checkpoint" in err and "fastckpt convert" in err


# ------------------------------------------------------------------------------ the command

def test_cli_convert_json_refuses_overwrite_and_force_replaces(tmp_path, capsys):
    """`fastckpt convert`: --json reports tensors, bytes, seconds and the verification; a
    committed step is refused (exit 2, untouched) unless --force, which replaces it and
    removes the old shards; a missing SRC is a usage error; a refused value is exit 1."""
    src, root = str(tmp_path / "model.pt"), str(tmp_path / "ckpt")
    torch.save({"w": torch.arange(10.0), "step": 3}, src)
    rc, out, err = call("convert", src, root, "--json", capsys=capsys)
    doc = json.loads(out)
    assert rc == 0 and doc["ok"] and doc["verified"], err
    assert (doc["step"], doc["step_from"], doc["tensors"], doc["bytes"]) == (0, "default", 1, 40)
    assert doc["seconds"] > 0 and doc["files"] == 1
    first = _manifest(root, 0)["save_id"]

    rc, out, err = call("convert", src, root, capsys=capsys)
    assert rc == 2 and "already committed" in err and "--force" in err
    assert _manifest(root, 0)["save_id"] == first

    rc, out, err = call("convert", src, root, "--force", capsys=capsys)
    assert rc == 0 and "converted torch.save file" in out and "verified" in out, err
    body = _manifest(root, 0)
    assert body["save_id"] != first
    d = os.path.join(root, fmt.step_dirname(0))
    assert set(os.listdir(d)) == set(body["files"]) | {fmt.MANIFEST}
    _same(fastckpt.read(root), {"w": torch.arange(10.0), "step": 3})

    rc, _, err = call("convert", str(tmp_path / "missing"), root, capsys=capsys)
    assert rc == 2 and "does not exist" in err
    torch.save({"obj": _Evil(str(tmp_path / "pwned"))}, str(tmp_path / "evil.pt"))
    rc, _, err = call("convert", str(tmp_path / "evil.pt"), str(tmp_path / "c2"), capsys=capsys)
    assert rc == 1 and "nothing was committed" in err and not os.path.exists(tmp_path / "pwned")


def test_src_that_is_the_steps_directory_under_root_is_refused(tmp_path):
    # a DCP checkpoint at ROOT/step-0000000005: converting it "to ROOT step 5" wrote into SRC
    # (before 2026-12-06), which "is only read"
    root = tmp_path / "run"
    src = root / fmt.step_dirname(5)
    _dcp_save({"w": torch.ones(4)}, str(src))
    before = _hashes(str(src))
    with pytest.raises(conv.NotConvertibleError, match="SRC is step 5's directory"):
        conv.convert(str(src), str(root))
    assert _hashes(str(src)) == before
