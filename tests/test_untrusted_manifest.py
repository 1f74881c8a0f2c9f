"""Crafted steps that validation must refuse with a CorruptCheckpointError naming what is
wrong (so that ``load``/``resume`` fall back to the older good step), never a raw
TypeError/ValueError, a step read from outside the root, a quadratic check, or a terminal
escape sequence printed: index chunks of other JSON types, a step directory that is a link,
chunk layouts that defeat the overlap sweep, shapes past int64, skeletons whose flattened
names collide, names with a final newline or non-ASCII digits, and control characters in
what ``fastckpt inspect`` prints."""

from __future__ import annotations

import itertools
import json
import math
import os
import random

import pytest
import torch
import xxhash

import fastckpt
from fastckpt import tools
from fastckpt.errors import CorruptCheckpointError
from fastckpt.manifest import discovery
from fastckpt.manifest import index as idx
from fastckpt.manifest import schema as fmt
from fastckpt.manifest import verify as ver
from fastckpt.manifest.values import decode_value
from tests.clirun import call
from tests.crafted import read_doc, write_doc


def _two_steps(root: str, **kw) -> None:
    for s in (1, 2):
        fastckpt.save({"w": torch.arange(8.0) + s, "step": s}, root, step=s, **kw)


def _loads_step_1(root: str, caplog) -> None:
    dest = {"w": torch.zeros(8), "step": 0}
    assert fastckpt.load(dest, root) == 1
    assert dest["w"].tolist() == (torch.arange(8.0) + 1).tolist()
    assert "skipping step 2" in caplog.text


# ------------------------------------------------------------------ index chunks of other types

@pytest.mark.parametrize("field,value", [
    ("file", []), ("file", {"a": 1}), ("file", None), ("offsets", {"a": 1}), ("sizes", 3),
    ("offset", [0]), ("offset", True), ("length", "8"), ("checksum", ["0" * 16])])
def test_an_index_chunk_field_of_another_type_is_named_and_the_older_step_loads(
        tmp_path, caplog, field, value):
    root = str(tmp_path)
    _two_steps(root, rank_indexes=1)
    man = read_doc(root, 2)
    entry = man["body"]["indexes"][0]
    path = os.path.join(root, fmt.step_dirname(2), entry["file"])
    doc = json.loads(open(path, "rb").read())
    doc["chunks"]["w"][0][field] = value
    data = json.dumps(doc).encode()
    open(path, "wb").write(data)
    entry.update(size=len(data), checksum=fmt.hexdigest(xxhash.xxh3_64_intdigest(data)))
    write_doc(root, 2, man)
    with pytest.raises(CorruptCheckpointError, match="rank 0") as ei:
        fastckpt.load({"w": torch.zeros(8), "step": 0}, root, step=2)
    assert ei.value.file == path and ei.value.key == "w"
    if field == "file":
        assert "chunk 0" in str(ei.value)
    _loads_step_1(root, caplog)


# ------------------------------------------------------------- a step directory that is a link

def test_a_step_directory_that_is_a_link_is_refused(tmp_path, capsys):
    outside, root = str(tmp_path / "outside"), str(tmp_path / "root")
    fastckpt.save({"w": torch.full((4,), 42.0), "step": 5}, outside, step=5)
    fastckpt.save({"w": torch.ones(4), "step": 1}, root, step=1)
    link = os.path.join(root, fmt.step_dirname(5))
    os.symlink(os.path.join(outside, fmt.step_dirname(5)), link)
    assert fastckpt.steps(root) == [1]
    dest = {"w": torch.zeros(4), "step": 0}
    for read in (lambda: fastckpt.load(dest, root, step=5),
                 lambda: fastckpt.read(root, step=5),
                 lambda: tools.verify_step(root, 5),
                 lambda: tools.inspect_step(root, 5)):
        with pytest.raises(CorruptCheckpointError, match="symbolic link") as ei:
            read()
        assert ei.value.file == link
    assert dest["w"].tolist() == [0.0] * 4
    for cmd in (["inspect", "--step", "5"], ["verify", "--step", "5"]):
        rc, out, err = call(*cmd, root, capsys=capsys)
        assert rc != 0 and "symbolic link" in out + err and "42" not in out
    assert fastckpt.load(dest, root) == 1  # the listing leaves the link out


# ------------------------------------------------------------------------ the overlap check

def _meet(a, b) -> bool:
    return all(ao < bo + bs and bo < ao + as_ for ao, as_, bo, bs in zip(a[0], a[1], b[0], b[1]))


def _brute(boxes) -> bool:
    return any(_meet(a, b) for a, b in itertools.combinations(boxes, 2))


def _random_boxes(rng: random.Random) -> list:
    """Random boxes in a small shape (overlapping often), or a random guillotine tiling of
    it, perhaps with one box grown by one row (an overlap)."""
    nd = rng.randint(1, 4)
    shape = [rng.randint(1, 10) for _ in range(nd)]
    if rng.random() < 0.4:
        out = []
        for _ in range(rng.randint(2, 30)):
            o = [rng.randrange(n) for n in shape]
            out.append((o, [rng.randint(1, n - x) for x, n in zip(o, shape)]))
        return out
    boxes = [([0] * nd, list(shape))]
    for _ in range(rng.randint(1, 60)):
        k, d = rng.randrange(len(boxes)), rng.randrange(nd)
        o, s = boxes[k]
        if s[d] > 1:
            c = rng.randint(1, s[d] - 1)
            boxes[k] = (o, s[:d] + [c] + s[d + 1:])
            boxes.append((o[:d] + [o[d] + c] + o[d + 1:], s[:d] + [s[d] - c] + s[d + 1:]))
    if rng.random() < 0.5:
        k, d = rng.randrange(len(boxes)), rng.randrange(nd)
        o, s = boxes[k]
        if o[d]:
            boxes[k] = (o[:d] + [o[d] - 1] + o[d + 1:], s[:d] + [s[d] + 1] + s[d + 1:])
    rng.shuffle(boxes)
    return boxes


def test_the_overlap_check_agrees_with_pairwise_comparison(monkeypatch):
    rng = random.Random(20261206)
    found = 0
    for _ in range(1500):
        boxes = _random_boxes(rng)
        want = _brute(boxes)
        dims = list(range(len(boxes[0][0])))
        for got in (ver.first_overlap(boxes), ver._split(boxes, dims)):
            assert (got is not None) == want, boxes
            assert got is None or _meet(*got)
        monkeypatch.setattr(ver, "SPLIT_LEAF", 0)  # the divide and conquer all the way down
        monkeypatch.setattr(ver, "SWEEP_PAIRS", -1)  # (and first_overlap goes there at once)
        for got in (ver._split(boxes, dims), ver.first_overlap(boxes)):
            assert (got is not None) == want and (got is None or _meet(*got)), boxes
        monkeypatch.undo()
        found += want
    assert 300 < found < 1200  # both verdicts, often


class _Counted(list):
    """A chunk's offsets or sizes that count how often they are walked (a pair compared)."""
    walks = 0

    def __iter__(self):
        _Counted.walks += 1
        return super().__iter__()


def _quadrants(n: int) -> list:
    """A [2n, 2n] tensor: n rows in the top-left quadrant, n columns in the bottom-right one,
    the two others whole. Along either dim about n^2 / 2 pairs of ranges meet (the old sweep
    compared them all, seconds at n = 3000), no two boxes meet."""
    return ([([i, 0], [1, n]) for i in range(n)] + [([n, n + j], [n, 1]) for j in range(n)]
            + [([0, n], [n, n]), ([n, 0], [n, n])])


@pytest.mark.parametrize("layout", ["quadrants", "stairs", "grid3", "grid2x12"])
def test_the_overlap_check_of_crafted_layouts_is_not_quadratic(layout):
    n = 3000
    if layout == "quadrants":
        boxes = _quadrants(n)
    elif layout == "stairs":  # the columns of a square, each cut at its own row
        boxes = [([0, i], [i, 1]) for i in range(1, n)] + [([i, i], [n - i, 1])
                                                              for i in range(n)]
    elif layout == "grid3":
        boxes = [(list(c), [1, 1, 1]) for c in itertools.product(range(16), repeat=3)]
    else:
        boxes = [(list(c), [1] * 12) for c in itertools.product(range(2), repeat=12)]
    boxes = [(_Counted(o), _Counted(s)) for o, s in boxes]
    _Counted.walks = 0
    assert fmt._first_overlap(boxes) is None
    # 4 walks per pair compared: at most SWEEP_PAIRS (8) per box; the old sweep's ~n^2 / 2
    assert _Counted.walks < 50 * len(boxes)
    grown = list(boxes)  # the last box grown by one row or column into its neighbour's
    o, s = grown[-1]
    d = next(d for d in range(len(o)) if o[d])
    grown[-1] = (o[:d] + [o[d] - 1] + o[d + 1:], s[:d] + [s[d] + 1] + s[d + 1:])
    assert _meet(*fmt._first_overlap(grown))


def test_a_crafted_layout_is_checked_in_full_by_validation(tmp_path):
    root = str(tmp_path)
    fastckpt.save({"w": torch.ones(1), "step": 1}, root, step=1)
    n = 500
    doc = read_doc(root, 1)
    body = doc["body"]
    (name, info), = body["files"].items()
    info["size"] = 4 * n * n

    def chunks(boxes):
        return [{"offsets": o, "sizes": s, "rank": 0, "file": name, "offset": 0,
                 "length": 4 * math.prod(s), "checksum": "0" * 16} for o, s in boxes]
    body["tensors"]["w"] = {"dtype": "float32", "shape": [2 * n, 2 * n],
                            "chunks": chunks(_quadrants(n))}
    write_doc(root, 1, doc)
    assert tools.inspect_step(root, 1)["tensors"][0]["shape"] == [2 * n, 2 * n]
    boxes = _quadrants(n)
    boxes[n + 7] = ([n - 1, n + 7], [n, 1])  # a column moved up one row: same count, overlaps
    body["tensors"]["w"]["chunks"] = chunks(boxes)
    write_doc(root, 1, doc)
    with pytest.raises(CorruptCheckpointError, match="overlap"):
        tools.inspect_step(root, 1)


# ------------------------------------------------------------------------------ huge shapes

@pytest.mark.parametrize("shape", [[0, 2 ** 64], [0, 2 ** 63], [2 ** 62, 0], [2 ** 31, 2 ** 31]])
def test_a_shape_past_int64_is_refused_and_the_older_step_loads(tmp_path, caplog, shape):
    root = str(tmp_path)
    _two_steps(root)
    doc = read_doc(root, 2)
    doc["body"]["tensors"]["e"] = {"dtype": "float32", "shape": shape, "chunks": []}
    doc["body"]["tree"]["e"] = {"$tensor": "e"}
    write_doc(root, 2, doc)
    with pytest.raises(CorruptCheckpointError, match=r"2\*\*62") as ei:
        fastckpt.read(root, step=2)
    assert ei.value.key == "e"
    _loads_step_1(root, caplog)


# ---------------------------------------------------------------------- flattened name clashes

def test_a_skeleton_whose_flattened_names_clash_is_refused(tmp_path, caplog):
    root = str(tmp_path)
    _two_steps(root)
    doc = read_doc(root, 2)
    doc["body"]["tree"].update({"a": {"b": 1}, "a.b": 2})
    write_doc(root, 2, doc)
    with pytest.raises(CorruptCheckpointError, match="'a.b'"):
        fastckpt.read(root, step=2)
    _loads_step_1(root, caplog)


def _random_tree(rng: random.Random, depth: int = 0):
    keys = ["a", "b", "a.b", "0", "1", "0.a", "True", "nan"]
    r = rng.random()
    if depth > 3 or r < 0.3:
        return rng.choice([1, "s", None, [], [1, 2], {"$tensor": "t"}, {"$tuple": [{"a": 1}]},
                           {"$float": "nan"}])
    if r < 0.55:
        return [_random_tree(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if r < 0.75:
        return {"$dict": [[rng.choice([0, 1, True, 1.0, "a", {"$float": "nan"},
                                       {"$tuple": [0, "a"]}]), _random_tree(rng, depth + 1)]
                          for _ in range(rng.randint(1, 3))]}
    return {rng.choice(keys): _random_tree(rng, depth + 1) for _ in range(rng.randint(0, 4))}


def test_the_clash_check_agrees_with_dcp_flattening():
    """Exactly the skeletons DCP's ``flatten_state_dict`` (every load's) refuses."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    def bad(msg, key=None):
        return CorruptCheckpointError(msg, key=key)
    rng = random.Random(7)
    clashes = 0
    for _ in range(3000):
        tree = {rng.choice(["a", "b", "a.b", "0"]): _random_tree(rng) for _ in range(3)}
        fmt._validate_tree(tree, {"t": {}}, bad)
        try:
            flatten_state_dict(decode_value(tree, lambda fqn: torch.empty(0)))
            want = False
        except ValueError:
            want = True
        assert (fmt.flat_clash(tree, bad) is not None) == want, tree
        clashes += want
    assert 50 < clashes < 2950  # both verdicts, often


# ----------------------------------------------------------------------------------- names

def test_names_are_matched_whole_with_ascii_digits(tmp_path):
    arabic = "".join(chr(0x660 + int(c)) for c in "0000000007")  # step-٠٠٠٠٠٠٠٠٠٧
    assert fmt.parse_step_dirname("step-" + arabic) is None
    assert fmt.parse_step_dirname("step-0000000007\n") is None
    assert fmt.parse_step_dirname("step-0000000007") == 7
    assert not fmt.is_safe_name("r00000-ab-000.fck\n") and fmt.is_safe_name("r00000-ab-000.fck")
    assert not fmt.is_save_id("ab\n") and fmt.is_save_id("ab")
    assert not idx.is_index_name("r00000-ab.fci\n") and idx.is_index_name("r00000-ab.fci")
    assert not idx.is_index_name("r" + arabic[:5] + "-ab.fci")
    assert not discovery._is_dcp_dir([discovery.DCP_METADATA, "__0_0.distcp\n"])
    root = str(tmp_path)
    fastckpt.save({"w": torch.ones(4), "step": 1}, root, step=1)
    os.rename(os.path.join(root, fmt.step_dirname(1)), os.path.join(root, "step-" + arabic))
    assert fastckpt.steps(root) == []
    fastckpt.save({"w": torch.ones(4), "step": 1}, root, step=1)
    doc = read_doc(root, 1)
    doc["body"]["save_id"] += "\n"
    write_doc(root, 1, doc)
    with pytest.raises(CorruptCheckpointError, match="save_id"):
        fastckpt.read(root, step=1)


# ----------------------------------------------------------------- what inspect prints

def test_inspect_escapes_control_characters_of_a_manifest(tmp_path, capsys):
    root = str(tmp_path)
    esc = "\x1b]0;title\x07\x1b[2J"
    fastckpt.save({"w": torch.ones(2), "step": 1}, root, step=1)
    doc = read_doc(root, 1)
    body = doc["body"]
    body["tensors"][esc + "w"] = body["tensors"].pop("w")
    body["tree"] = {esc + "w": {"$tensor": esc + "w"}, esc + "step": 1}
    body["fastckpt_version"] = body["created"] = body["torch_version"] = esc + "1"
    write_doc(root, 1, doc)
    rc, out, err = call("inspect", root, capsys=capsys)
    assert rc == 0 and "\x1b" not in out + err and "\x07" not in out + err
    assert out.count("\\x1b]0;title\\x07\\x1b[2J") >= 5  # name, key, version, created, torch


@pytest.mark.parametrize("state", [{"a": {"b": 1}, "a.b": 2},
                                   {"a": {"b": torch.ones(2)}, "a.b": 3},
                                   {"x": [{"y": 1}], "x.0.y": "z"}])
def test_a_state_whose_flattened_names_clash_is_refused_by_save(tmp_path, state):
    """Such a save committed a step that every load then found damaged (and passed over for
    the older one): save refuses it, naming the key, before anything is written."""
    root = str(tmp_path / "r")
    with pytest.raises(fastckpt.UnsupportedStateError, match="flattened name"):
        fastckpt.save(state, root, step=1)
    assert not os.path.isdir(root) or fastckpt.steps(root) == []


def _tree_blocks_by_every_count(trees: list):
    """The block search as it was (every block count tried): the reference."""
    n = len(trees)
    keys = [json.dumps(t, sort_keys=True) for t in trees]
    for blocks in range(1, n // 2 + 1):
        size = n // blocks
        if n % blocks == 0 and all(keys[i] == keys[i - i % size] for i in range(n)):
            shapes = {json.dumps(fmt._keys_of(trees[b * size]), sort_keys=True)
                      for b in range(blocks)}
            return blocks if len(shapes) == blocks else None
    return None


def test_the_stage_block_search_agrees_with_trying_every_block_count():
    """``_tree_blocks`` (loads of pipeline stages at another world size) is O(N): a crafted
    manifest of 720720 ranks took 12 s in the search that tried every block count."""
    rng = random.Random(7)
    kinds = [{"a": 1}, {"a": 2}, {"b": 1}, {"c": [1, 2]}]
    for _ in range(3000):
        n = rng.randint(1, 24)
        if rng.random() < 0.5:  # blocks of equal skeletons, sometimes broken
            size = rng.choice([d for d in range(1, n + 1) if n % d == 0])
            trees = [kinds[(i // size) % len(kinds)] for i in range(n)]
            if rng.random() < 0.3:
                trees[rng.randrange(n)] = rng.choice(kinds)
        else:
            trees = [rng.choice(kinds) for _ in range(n)]
        assert fmt._tree_blocks(trees) == _tree_blocks_by_every_count(trees), trees
    # the crafted case: every skeleton the same but the last
    big = [{"a": 1}] * 720719 + [{"b": 1}]
    assert fmt._tree_blocks(big) is None
