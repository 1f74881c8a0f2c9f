"""Fuzz-style: manifests derived from a valid one, every field mutated within and across types,
path fields with separators, lengths and offsets off by one and by a lot, checksums
recomputed (the checksum detects damage, not tampering).

For every crafted manifest, ``load`` (into destinations between canary bytes), ``verify``,
``inspect``, ``ls`` (describe), the gc plan and step discovery must: raise nothing but a
``FastCkptError`` (never crash the process, never a raw KeyError/TypeError/RecursionError),
write no byte outside a destination tensor, make no file-system call on a path outside the
root (audited with the Python I/O backend), and when a load succeeds it must have loaded the
saved bytes (the mutations never re-checksum chunks, so anything else is silent corruption).

The set is deterministic (a fixed seed picks a sample of the type mutations; every path field
and every length/offset variant is always included) and sized to run in CI in about a minute.
"""

from __future__ import annotations

import copy
import json
import os
import random
import shutil

import pytest
import torch

import fastckpt
from fastckpt.manifest import schema as fmt
from fastckpt import tools
from fastckpt.errors import FastCkptError
from fastckpt.manifest.discovery import find_step
from tests.crafted import guarded, outside_calls, read_doc, write_doc, write_raw

SEED = 20261201
#: type mutations sampled from the full cross product (about 5000); FUZZ_SAMPLE=N, or "all",
#: for a longer run
SAMPLE = os.environ.get("FUZZ_SAMPLE", "400")

ACROSS = [None, True, 0, 1, -1, 2 ** 63, -(2 ** 63), 1.5, float("nan"), "", "x", "..",
          "../x", "/etc/passwd", [], {}, [0], [[]], {"a": 1}, fmt.MANIFEST, "step-0000000001"]


def _state() -> dict:
    g = torch.Generator().manual_seed(7)
    return {
        "big": torch.randn(1 << 19, generator=g),                     # 2 MiB: direct reads
        "mat": torch.randn(3, 5, generator=g),
        "half": torch.randn(4, 4, generator=g).to(torch.bfloat16),
        "ints": torch.arange(10, dtype=torch.int64),
        "empty": torch.empty(0, 3),
        "scalar": torch.tensor(2.5),
        "plain": {"t": (1, "a", None), 3: [1.5, float("inf")], "s": "x"},
        "step": 1,
    }


def _dest(phases: dict | None = None):
    """Destinations like the state's tensors, each between canaries, placed in phase with
    their saved chunk (``phases``: fqn -> file offset mod 4096) so that the large one is read
    straight into place; and the canary checks."""
    out, checks = {}, []
    for k, v in _state().items():
        if isinstance(v, torch.Tensor):
            t, check = guarded(v.dtype, tuple(v.shape), phase=(phases or {}).get(k, 0))
            out[k] = t
            checks.append(check)
        else:
            out[k] = copy.deepcopy(v)
    return out, checks


def _paths(x, path=()):
    yield path
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _paths(v, path + (k,))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            yield from _paths(v, path + (i,))


def _get(doc, path):
    for p in path:
        doc = doc[p]
    return doc


def _mutations(body: dict) -> list:
    """(description, function body -> None) for every mutation of the set."""
    must, sampled = [], []
    for path in _paths(body):
        if not path:
            continue
        parent, key = path[:-1], path[-1]
        value = _get(body, path)
        where = "/".join(map(str, path))

        def setter(v, parent=parent, key=key):
            return lambda b: _get(b, parent).__setitem__(key, copy.deepcopy(v))
        if isinstance(value, bool) or value is None:
            pass
        elif isinstance(value, int):  # within type: off by one, by a page, by a lot
            for d in (value - 1, value + 1, 2 * value + 1, value + 4096, value + (1 << 40), -1):
                must.append((f"{where}={d}", setter(d)))
        elif isinstance(value, str):  # path-like: separators, parents, absolute
            for v in (f"../{value}", f"{value}/../../x", f"/{value}", f"a/{value}",
                      f"..\\{value}", value + "\0", value[:-1] if value else "x"):
                must.append((f"{where}={v!r}", setter(v)))
        for v in ACROSS:
            sampled.append((f"{where}={v!r}", setter(v)))
        if isinstance(_get(body, parent), dict):
            must.append((f"del {where}", lambda b, parent=parent, key=key:
                         _get(b, parent).pop(key)))
            if isinstance(key, str) and parent and parent[-1] in ("files", "tensors"):
                for nk in (f"../{key}", f"{key}/x", "", "/abs"):
                    must.append((f"rename {where} -> {nk!r}",
                                 lambda b, parent=parent, key=key, nk=nk:
                                 _get(b, parent).__setitem__(nk, _get(b, parent).pop(key))))
        if isinstance(value, dict):
            must.append((f"{where}+extra", lambda b, path=path:
                         _get(b, path).__setitem__("$tensor", "big")))
        if isinstance(value, list):
            must.append((f"{where}+item", lambda b, path=path: _get(b, path).append(7)))
            if value:
                must.append((f"{where}*2", lambda b, path=path: _get(b, path).extend(
                    copy.deepcopy(_get(b, path)))))
    rng = random.Random(SEED)
    n = len(sampled) if SAMPLE == "all" else min(int(SAMPLE), len(sampled))
    return must, rng.sample(sampled, n)


def _phases(doc: dict) -> dict:
    return {fqn: t["chunks"][0]["offset"] % 4096 for fqn, t in doc["body"]["tensors"].items()
            if t["chunks"]}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    base = tmp_path_factory.mktemp("fuzz")
    root = str(base / "a" / "root")
    fastckpt.save(_state(), root, step=1)
    return root, read_doc(root, 1)


def _run_one(root: str, phases: dict, want: dict, native: str) -> None:
    """Every operation over the crafted root; raises AssertionError on a violation."""
    def only_ours(fn):
        try:
            return fn()
        except FastCkptError:
            return None
    dest, checks = _dest(phases)
    try:
        fastckpt.load(dest, root, native=native)
        loaded = True
    except FastCkptError:
        loaded = False
    for check in checks:
        check()
    if loaded:
        for k, v in want.items():
            if isinstance(v, torch.Tensor):
                assert torch.equal(dest[k], v), f"load succeeded with wrong bytes in {k!r}"
    only_ours(lambda: find_step(tools.as_storage(root)))
    only_ours(lambda: tools.verify_step(root, 1))
    only_ours(lambda: tools.inspect_step(root, 1))
    recs = tools.describe_steps(root)
    assert [r.step for r in recs] == [1]
    tools.plan_gc(root, 1)


@pytest.mark.parametrize("native", ["off", "auto"])
def test_crafted_manifests(pristine, tmp_path, native):
    src, doc0 = pristine
    base = tmp_path / "b"
    root = str(base / "root")
    shutil.copytree(src, root)
    sentinel = base / "secret.fck"
    sentinel.write_bytes(b"\x11" * 8192)
    step_dir = os.path.join(root, fmt.step_dirname(1))
    shards = {n: open(os.path.join(step_dir, n), "rb").read() for n in doc0["body"]["files"]}
    want = _state()
    phases = _phases(doc0)
    must, sampled = _mutations(doc0["body"])
    # the Python I/O backend (every file-system call audited) takes the whole set; the native
    # one (canaries and values only) the part that must always be covered
    muts = must + sampled if native == "off" else must
    failures = []
    for what, mutate in muts:
        doc = copy.deepcopy(doc0)
        try:
            mutate(doc["body"])
        except (KeyError, IndexError, TypeError):
            continue  # the path no longer exists after an earlier edit of the same mutation
        write_doc(root, 1, doc)
        try:
            with outside_calls(root) as seen:
                _run_one(root, phases, want, native)
            assert not seen, f"file-system calls outside the root: {seen[:3]}"
        except AssertionError as e:
            failures.append(f"{what}: {e}")
        except Exception as e:  # noqa: BLE001 - a raw exception is the defect being looked for
            failures.append(f"{what}: {type(e).__name__}: {e}")
        # put the step back as saved (verify may have written a marker; gc plans only)
        for n in os.listdir(step_dir):
            if n not in shards and n != fmt.MANIFEST:
                p = os.path.join(step_dir, n)
                shutil.rmtree(p) if os.path.isdir(p) else os.remove(p)
        for n, data in shards.items():
            with open(os.path.join(step_dir, n), "rb") as f:
                assert f.read() == data, f"{what}: the shard {n} was modified"
    assert sentinel.read_bytes() == b"\x11" * 8192
    assert len(muts) > 300
    assert not failures, f"{len(failures)} of {len(muts)} crafted manifests:\n" + \
        "\n".join(failures[:20])


@pytest.mark.parametrize("text", [
    "[" * 100000 + "]" * 100000,                          # deeper than any parser
    '{"a":' * 3000 + "1" + "}" * 3000,
    '"' + "x" * (1 << 20) + '"',                          # a long string
    '{"files":{},"save_id":"a","step":1,"tensors":{},"world_size":1,"tree":'
    + "[" * 150 + "]" * 150 + "}",                        # deeper than the saved-state limit
])
def test_structure_bombs(pristine, tmp_path, text):
    src, _ = pristine
    root = str(tmp_path / "root")
    shutil.copytree(src, root)
    write_raw(root, 1, text)
    with pytest.raises(FastCkptError):
        fastckpt.load(_dest()[0], root)
    assert [r.state for r in tools.describe_steps(root)] == ["corrupt"]
    with pytest.raises(FastCkptError):
        tools.verify_step(root, 1)


def test_the_unmodified_manifest_passes_every_operation(pristine, tmp_path):
    """The harness itself: with no mutation every operation succeeds (so the set above fails
    for what the mutation did, not for what the harness does)."""
    src, doc0 = pristine
    root = str(tmp_path / "root")
    shutil.copytree(src, root)
    write_doc(root, 1, json.loads(json.dumps(doc0)))
    dest, checks = _dest(_phases(doc0))
    with outside_calls(root) as seen:
        assert fastckpt.load(dest, root, native="off") == 1
        assert tools.verify_step(root, 1).ok
        tools.inspect_step(root, 1)
    assert not seen, seen
    for check in checks:
        check()
    for k, v in _state().items():
        if isinstance(v, torch.Tensor):
            assert torch.equal(dest[k], v)


def test_a_large_manifest_is_written_as_its_canonical_body_and_still_checked(tmp_path):
    """Above fmt.INDENT_MAX the manifest is the canonical body as hashed (no indentation: the
    indenting encoder is pure Python, seconds at tens of MB); it loads like any other, and a
    changed byte of its body is refused by the checksum."""
    root = str(tmp_path / "ckpt")
    blob = "".join(chr(97 + i % 26) for i in range(fmt.INDENT_MAX + 10))
    fastckpt.save({"w": torch.arange(6.0), "blob": blob}, root, step=1)
    path = os.path.join(root, "step-0000000001", fmt.MANIFEST)
    raw = open(path, "rb").read()
    assert raw.count(b"\n") == 2 and b'"body": {' in raw  # head line, body line
    state = {"w": torch.zeros(6), "blob": ""}
    assert fastckpt.load(state, root) == 1
    assert state["blob"] == blob and torch.equal(state["w"], torch.arange(6.0))
    i = raw.index(b"abcdefgh", len(raw) // 2)
    with open(path, "wb") as f:
        f.write(raw[:i] + b"X" + raw[i + 1:])
    with pytest.raises(fastckpt.errors.CorruptCheckpointError, match="checksum"):
        fastckpt.load({"w": torch.zeros(6), "blob": ""}, root)
