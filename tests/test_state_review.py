"""Review of the state walk and the plain-value encoding (engine/state.py, manifest/values.py):
values that came back as another type, values a manifest cannot hold, crafted manifests with
numbers the JSON parser refuses, and destinations no load can fill."""

from __future__ import annotations

import collections
import enum
import os

import numpy as np
import pytest
import torch

import fastckpt
from fastckpt.errors import CorruptCheckpointError, StateMismatchError, UnsupportedStateError
from tests.crafted import read_doc, write_raw

Point = collections.namedtuple("Point", "x y")


class Mode(enum.IntEnum):
    TRAIN = 1


class Ratio(float):
    pass


class Name(str):
    pass


# ------------------------------------------- values that would load back as their base type

@pytest.mark.parametrize("value", [
    Point(1, 2), Point(torch.ones(2), 3), torch.Size([2, 3]), Mode.TRAIN,
    Name("adam"), np.str_("x"), [1, {"k": (Point(1, 2),)}]],
    ids=["namedtuple", "namedtuple-of-tensor", "torch.Size", "IntEnum",
         "str-subclass", "np.str_", "nested"])
def test_a_value_that_would_load_back_as_another_type_is_refused_naming_its_key(root, value):
    """Before: saved as the base type (a namedtuple as a tuple, an IntEnum as an int): every
    load replaced the user's value by one of another type (``state["cfg"].x`` then raised
    AttributeError)."""
    state = {"w": torch.zeros(2), "cfg": {"v": value}}
    with pytest.raises(UnsupportedStateError, match="cfg.v"):
        fastckpt.save(state, root, step=1)
    assert not os.path.exists(root) or fastckpt.steps(root) == []


@pytest.mark.parametrize("key", [Mode.TRAIN, Name("adam"), Point(1, 2)],
                         ids=["IntEnum", "str-subclass", "namedtuple"])
@pytest.mark.parametrize("where", ["state", "plain"])
def test_a_subclass_key_is_refused_too(root, key, where):
    """A key that would load back as its base type (fastckpt.read, a Stateful's sub-state)."""
    inner = {key: 1} if where == "plain" else {key: torch.ones(1)}
    with pytest.raises(UnsupportedStateError, match="cfg"):
        fastckpt.save({"cfg": inner}, root, step=1)


def test_a_float_subclass_is_stored_as_its_float(root):
    """numpy's float64 (an optimizer's lr under a schedule computed with numpy) is a float to
    the last bit: it is stored and loads back as a float, as it did before the subclass
    refusal (refusing it failed such a job's every save)."""
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=np.float64(0.1) * np.cos(np.float64(0.5)))
    assert type(opt.param_groups[0]["lr"]) is np.float64
    fastckpt.save({"model": model, "optim": opt, "v": {"r": Ratio(0.5), 1.5: np.float64(2.5)}},
                  root, step=1)
    opt2 = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=1.0)
    dest = {"model": torch.nn.Linear(2, 2), "optim": opt2, "v": None}
    fastckpt.load(dest, root)
    assert opt2.param_groups[0]["lr"] == float(opt.param_groups[0]["lr"])
    assert dest["v"] == {"r": 0.5, 1.5: 2.5} and type(dest["v"]["r"]) is float


def test_exact_types_still_round_trip(root):
    value = {"t": (1, (2.5, "s")), 3: -0.0, (1, 2): [True, None, 10 ** 40], "f": float("inf")}
    fastckpt.save({"v": value, "w": torch.ones(2)}, root, step=1)
    dest = {"v": None, "w": torch.zeros(2)}
    fastckpt.load(dest, root)
    assert dest["v"] == value and type(dest["v"]["t"][1]) is tuple
    assert str(dest["v"][3]) == "-0.0"


# --------------------------------------------------------------------- integers JSON refuses

def test_an_int_too_long_for_json_is_refused_naming_its_key(root):
    """Before: a raw ValueError from the JSON encoder ("Exceeds the limit (4300 digits)"),
    naming no key."""
    with pytest.raises(UnsupportedStateError, match="big"):
        fastckpt.save({"w": torch.ones(2), "big": 10 ** 5000}, root, step=1)


def test_a_crafted_manifest_with_a_huge_int_is_damaged_and_the_older_step_loads(root, caplog):
    """Before: json.loads raised a raw ValueError (int digit limit) that stopped the load
    instead of skipping the step."""
    for s in (1, 2):
        fastckpt.save({"w": torch.arange(4.0) + s, "n": s}, root, step=s)
    doc = read_doc(root, 2)
    import json
    body = json.dumps(doc["body"], sort_keys=True, separators=(",", ":"))
    body = body.replace('"n":2', '"n":' + "7" * 5000)
    assert "7" * 5000 in body
    write_raw(root, 2, body)
    dest = {"w": torch.zeros(4), "n": 0}
    assert fastckpt.load(dest, root) == 1
    assert dest["n"] == 1 and dest["w"].tolist() == [1.0, 2.0, 3.0, 4.0]
    with pytest.raises(CorruptCheckpointError):
        fastckpt.load({"w": torch.zeros(4), "n": 0}, root, step=2)


# ------------------------------------------------------------ destinations no load can fill

def test_a_self_overlapping_destination_is_refused_naming_its_key(root):
    """Before: a raw RuntimeError from the reader's copy_ ("more than one element of the
    written-to tensor refers to a single memory location"), naming no key."""
    src = torch.arange(12.0).reshape(3, 4)
    fastckpt.save({"t": src}, root, step=1)
    dest = {"t": torch.zeros(3, 1).expand(3, 4)}
    with pytest.raises(StateMismatchError, match="'t'"):
        fastckpt.load(dest, root)
    # an expanded tensor saves (by value) and loads into a plain one
    fastckpt.save({"t": torch.arange(3.0).reshape(3, 1).expand(3, 4)}, root, step=2)
    dest = {"t": torch.zeros(3, 4)}
    fastckpt.load(dest, root, step=2)
    assert dest["t"].tolist() == [[0.0] * 4, [1.0] * 4, [2.0] * 4]


def test_a_crafted_rank_index_with_a_huge_int_is_damaged_and_the_older_step_loads(root, caplog):
    """The same number in a version-4 manifest's per-rank chunk index. Before: a raw
    ValueError."""
    import json

    import xxhash

    from fastckpt.manifest import schema as fmt
    from tests.crafted import write_doc
    for s in (1, 2):
        fastckpt.save({"w": torch.arange(4.0) + s, "n": s}, root, step=s, rank_indexes=1)
    man = read_doc(root, 2)
    entry = man["body"]["indexes"][0]
    path = os.path.join(root, fmt.step_dirname(2), entry["file"])
    text = open(path, "rb").read().decode()
    doc = json.loads(text)
    doc["chunks"]["w"][0]["offset"] = 12345
    data = json.dumps(doc).replace("12345", "9" * 5000).encode()
    open(path, "wb").write(data)
    entry.update(size=len(data), checksum=fmt.hexdigest(xxhash.xxh3_64_intdigest(data)))
    write_doc(root, 2, man)
    with pytest.raises(CorruptCheckpointError, match="rank 0"):
        fastckpt.load({"w": torch.zeros(4), "n": 0}, root, step=2)
    dest = {"w": torch.zeros(4), "n": 0}
    assert fastckpt.load(dest, root) == 1
    assert dest["n"] == 1


# ------------------------------------------------------------------------------------ options

@pytest.mark.parametrize("kw", [
    {"commit_timeout_s": float("inf")}, {"commit_timeout_s": 1e300},
    {"lease_ttl_s": float("inf")}, {"keep_last": True}, {"remote_keep_last": True}],
    ids=["commit-inf", "commit-1e300", "lease-inf", "keep_last-True", "remote_keep_last-True"])
def test_an_option_no_save_could_use_is_refused_at_construction(root, kw):
    """Before: accepted; every save then failed (a StorageError "writing to the checkpoint
    root failed: timestamp out of range for platform time_t", a raw ValueError from the
    lease), or keep_last=True kept one step and deleted the others."""
    name = next(iter(kw))
    with pytest.raises(ValueError, match=name):
        fastckpt.CheckpointOptions(**kw)
    with pytest.raises(ValueError, match=name):
        fastckpt.Checkpointer(root, **kw)


def test_long_timeouts_within_the_bound_still_work(root):
    with fastckpt.Checkpointer(root, commit_timeout_s=1e9, lease_ttl_s=1e9, keep_last=1) as ck:
        for s in (1, 2):
            ck.save({"w": torch.ones(3) * s}, step=s, block=True)
    assert fastckpt.steps(root) == [2]


def test_a_crafted_key_holding_a_list_in_a_tuple_does_not_stop_the_load(root):
    """A manifest (checksummed) whose mapping key is a tuple holding a list: a key no save
    writes. Before: ``load`` and ``read`` raised a raw TypeError (unhashable type: 'list');
    a list key decodes as a tuple, and so does one inside a tuple now."""
    from tests.crafted import write_doc
    for s in (1, 2):
        fastckpt.save({"w": torch.arange(4.0) + s, "n": s}, root, step=s)
    doc = read_doc(root, 2)
    doc["body"]["tree"]["n"] = {"$tuple": [{"$dict": [[{"$tuple": [[1, [2]]]}, 3]]}]}
    write_doc(root, 2, doc)
    dest = {"w": torch.zeros(4), "n": 0}
    assert fastckpt.load(dest, root) == 2
    assert dest["n"] == ({((1, (2,)),): 3},)
    assert fastckpt.read(root)["n"] == ({((1, (2,)),): 3},)


# ------------------------------------------------------------------------------- public API

def test_user_meta_with_on_preempt_is_refused_not_dropped(root):
    """Before: ``save(..., on_preempt=True, user_meta=...)`` returned None and the emergency
    checkpoint's user_meta was {"preempted": True}: the caller's was dropped silently."""
    state = {"w": torch.ones(2)}
    with pytest.raises(ValueError, match="user_meta"):
        fastckpt.save(state, root, step=1, on_preempt=True, user_meta={"epoch": 3})
    with fastckpt.Checkpointer(root) as ck:
        with pytest.raises(ValueError, match="user_meta"):
            ck.save(state, step=1, on_preempt=True, user_meta={"epoch": 3})
        assert ck.save(state, step=1, on_preempt=True) is None  # (no stop: nothing saved)


def test_one_signal_name_as_a_string_is_that_signal():
    """``preempt_signals="SIGTERM"`` was iterated letter by letter ("unknown signal 'S'"): a
    single name is taken as a tuple of it, for both signal options."""
    from fastckpt.options import CheckpointOptions
    o = CheckpointOptions(preempt_signals="SIGUSR1", cancel_signals="SIGTERM")
    assert o.preempt_signals == ("SIGUSR1",) and o.cancel_signals == ("SIGTERM",)
    with pytest.raises(ValueError, match="unknown signal 'SIGNOPE'"):
        CheckpointOptions(preempt_signals="SIGNOPE")
