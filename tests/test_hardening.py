"""Checkpoints are untrusted input, roots are shared: one regression test per defect of the
adversarial pass (issue 9), each written to fail on the engine before the fix.

Crafted manifests are re-checksummed (tests/crafted.py): the checksum detects damage, not
tampering. The fuzz-style set over every manifest field is tests/test_fuzz_manifest.py.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import fastckpt
from fastckpt import tools
from fastckpt.manifest import schema as fmt
from fastckpt.engine.load import load_into
from fastckpt.errors import CorruptCheckpointError, UnsupportedStateError, WriterLockedError
from fastckpt.manifest.discovery import find_step
from fastckpt.storage import LocalStorage
from tests import distributed
from tests.crafted import guarded, outside_calls, read_doc, write_doc, write_raw
from tests.clirun import call

BIG = 1 << 19  # float32 elements: 2 MiB, read straight into its destination when in phase
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _state(step: int = 1) -> dict:
    g = torch.Generator().manual_seed(step)
    return {"big": torch.randn(BIG, generator=g), "small": torch.randn(3, 5, generator=g),
            "step": step}


def _chunk(doc: dict, fqn: str) -> dict:
    return doc["body"]["tensors"][fqn]["chunks"][0]


BACKENDS = pytest.mark.parametrize("native", ["auto", "off"])


# ------------------------------------------------------------------------- 1. out-of-bounds write

@BACKENDS
@pytest.mark.parametrize("extra", [1, 64 << 10])
def test_chunk_longer_than_its_tensor_is_refused_before_any_read(root, native, extra):
    fastckpt.save(_state(), root, step=1, zero_copy=False)  # chunks at 4096-aligned offsets
    doc = read_doc(root, 1)
    c = _chunk(doc, "big")
    c["length"] += extra
    name = c["file"]
    path = os.path.join(root, fmt.step_dirname(1), name)
    with open(path, "ab") as f:  # the file really holds the extra bytes
        f.write(b"\x7f" * extra)
    doc["body"]["files"][name]["size"] = os.path.getsize(path)
    write_doc(root, 1, doc)
    t, check = guarded(torch.float32, (BIG,), phase=c["offset"] % 4096)
    dest = {"big": t, "small": torch.zeros(3, 5), "step": 0}
    with pytest.raises(CorruptCheckpointError, match="length") as ei:
        fastckpt.load(dest, root, native=native)
    check()
    assert ei.value.key == "big" and "manifest.json" in str(ei.value)


# --------------------------------------------------------------- 2-3. names that leave the root

def test_verify_never_writes_or_deletes_outside_the_root(tmp_path, capsys):
    root = str(tmp_path / "a" / "root")
    fastckpt.save(_state(), root, step=1)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    doc = read_doc(root, 1)
    sid = "q/../../../victim.txt"
    doc["body"]["save_id"] = sid
    write_doc(root, 1, doc)
    d = os.path.join(root, fmt.step_dirname(1))
    os.makedirs(os.path.join(d, ".verified-q"))
    os.makedirs(os.path.join(d, ".verify-failed-q"))
    with outside_calls(root) as seen:
        rc, out, err = call("verify", root, "--step", "1", capsys=capsys)
    assert victim.read_text() == "precious"
    assert rc == 1 and "save_id" in out + err and "manifest.json" in out + err
    assert not [s for s in seen if "victim" in s[1]], seen


@BACKENDS
def test_file_names_outside_the_step_are_never_read(tmp_path, native, capsys):
    root = str(tmp_path / "a" / "root")
    fastckpt.save(_state(), root, step=1, zero_copy=False)
    doc = read_doc(root, 1)
    c = _chunk(doc, "small")
    secret = tmp_path / "secret.fck"
    data = torch.full((3, 5), 42.0).numpy().tobytes()
    secret.write_bytes(b"\0" * c["offset"] + data)
    name = "../../../secret.fck"
    old = c["file"]
    for t in doc["body"]["tensors"].values():
        for ch in t["chunks"]:
            if ch["file"] == old:
                ch["file"] = name
    import xxhash
    c["checksum"] = fmt.hexdigest(xxhash.xxh3_64_intdigest(data))
    doc["body"]["files"][name] = {"rank": 0, "size": secret.stat().st_size}
    write_doc(root, 1, doc)
    dest = {"big": torch.zeros(BIG), "small": torch.zeros(3, 5), "step": 0}
    with outside_calls(root) as seen:
        with pytest.raises(CorruptCheckpointError, match="file name") as ei:
            fastckpt.load(dest, root, native="off")
        rc, out, err = call("verify", root, "--json", capsys=capsys)
    assert "secret" in str(ei.value) and not torch.equal(dest["small"], torch.full((3, 5), 42.0))
    assert rc == 1 and "secret" in out + err
    assert not [s for s in seen if "secret" in s[1]], seen


def test_gc_does_not_follow_a_symlinked_step(tmp_path, capsys):
    other = str(tmp_path / "other")
    fastckpt.save(_state(5), other, step=5)
    root = str(tmp_path / "root")
    for s in (1, 2):
        fastckpt.save(_state(s), root, step=s)
    link = os.path.join(root, fmt.step_dirname(0))
    os.symlink(os.path.join(other, fmt.step_dirname(5)), link)
    before = sorted(os.listdir(os.path.join(other, fmt.step_dirname(5))))
    rc, out, _ = call("gc", root, "--keep", "1", "--yes", "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["removed"] == [1]
    assert sorted(os.listdir(os.path.join(other, fmt.step_dirname(5)))) == before
    assert fastckpt.load(_state(0), other) == 5
    # nothing reads through the link either: it is not a step of this root
    assert [r.step for r in tools.describe_steps(root)] == [2]
    # and a save never writes through a link in place of its step directory
    os.symlink(os.path.join(other, fmt.step_dirname(5)), os.path.join(root, fmt.step_dirname(7)))
    with pytest.raises(fastckpt.FastCkptError, match="symbolic link"):
        fastckpt.save(_state(7), root, step=7)
    assert sorted(os.listdir(os.path.join(other, fmt.step_dirname(5)))) == before


# ------------------------------------------------------------------- 5. conjugate / negative views

@pytest.mark.parametrize("how", ["one-shot", "capped", "async"])
def test_conjugate_and_negative_views_round_trip(root, how):
    z = torch.randn(300, 1000, dtype=torch.complex64)  # 2.3 MiB: the zero-copy body path
    r = torch.randn(600, 1000)
    state = {"conj": z.conj(), "neg": torch._neg_view(r), "small": torch.randn(8).conj()}
    want = {k: v.resolve_conj().resolve_neg().clone() for k, v in state.items()}
    if how == "one-shot":
        fastckpt.save(state, root, step=1)
    elif how == "capped":
        fastckpt.save(state, root, step=1, zero_copy=False, staging_cap_bytes=1 << 20)
    else:
        with fastckpt.Checkpointer(root) as ck:
            ck.save(state, step=1).wait()
    assert state["conj"].is_conj() and state["neg"].is_neg()  # the user's views as they were
    dest = {k: torch.zeros_like(v) for k, v in want.items()}
    fastckpt.load(dest, root)
    for k in want:
        assert torch.equal(dest[k], want[k]), k
    assert tools.verify_step(root).ok
    # and a destination that is itself such a view is filled through it
    dz, dr = torch.zeros(300, 1000, dtype=torch.complex64), torch.zeros(600, 1000)
    fastckpt.load({"conj": dz.conj(), "neg": torch._neg_view(dr), "small": torch.zeros(8)},
                  root)
    assert torch.equal(dz.conj(), want["conj"]) and torch.equal(torch._neg_view(dr), want["neg"])


# ----------------------------------------------------------------------- 6. two writers, one root

def test_second_writer_is_refused_naming_the_holder(root):
    with fastckpt.Checkpointer(root, keep_last=1) as a:
        a.save(_state(1), step=1).wait()
        with fastckpt.Checkpointer(root, keep_last=1) as b:
            with pytest.raises(WriterLockedError, match=f"pid {os.getpid()}") as ei:
                b.save(_state(2), step=2)
            assert ei.value.holder["pid"] == os.getpid()
            assert b.load(_state(0)) == 1  # readers need no lease
        a.save(_state(3), step=3).wait()
    assert [r.step for r in tools.describe_steps(root)] == [3]
    assert not os.path.exists(os.path.join(root, ".writer.json"))  # released on close
    with fastckpt.Checkpointer(root) as c:  # free again
        c.save(_state(4), step=4).wait()


_HOLDER = """
import sys, time, torch, fastckpt
ck = fastckpt.Checkpointer(sys.argv[1])
ck.save({"w": torch.ones(10)}, step=1).wait()
print("holding", flush=True)
time.sleep(600)
"""


def test_lease_of_a_killed_holder_is_taken_over_at_once(root, caplog):
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, root], stdout=subprocess.PIPE,
                         text=True, cwd=REPO)
    try:
        assert p.stdout.readline().strip() == "holding"
        with pytest.raises(WriterLockedError):
            fastckpt.save(_state(2), root, step=2)
        p.send_signal(signal.SIGKILL)
        p.wait()
    finally:
        p.kill()
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        fastckpt.save(_state(2), root, step=2)
    assert time.monotonic() - t0 < 10  # not the lease's TTL: the lock says the holder is dead
    assert any("taking over the writer lease" in r.getMessage() for r in caplog.records)


def _renew_forever(path: str, stop: threading.Event, host: str) -> None:
    while not stop.is_set():
        with open(path + ".tmp", "w") as f:
            json.dump({"owner": "x", "host": host, "pid": 1, "job": None,
                       "renewed_unix": time.time(), "ttl_s": 3.0}, f)
        os.replace(path + ".tmp", path)
        stop.wait(0.3)


def test_lease_of_another_host(root):
    os.makedirs(root)
    path = os.path.join(root, ".writer.json")
    # alive (renewed): refused within the TTL, naming the host
    stop = threading.Event()
    th = threading.Thread(target=_renew_forever, args=(path, stop, "elsewhere"), daemon=True)
    th.start()
    try:
        t0 = time.monotonic()
        with pytest.raises(WriterLockedError, match="host elsewhere"):
            fastckpt.save(_state(1), root, step=1, lease_ttl_s=3.0)
        assert time.monotonic() - t0 < 10
    finally:
        stop.set()
        th.join()
    # dead (no longer renewed): taken over once it expired
    fastckpt.save(_state(1), root, step=1, lease_ttl_s=3.0)
    assert fastckpt.load(_state(0), root) == 1


def _two_ranks_locked(rank: int, world: int, root: str):
    try:
        fastckpt.save(_state(2), root, step=2, commit_timeout_s=20)
    except WriterLockedError as e:
        return f"locked: {e}"
    return "saved"


def test_lease_refusal_reaches_every_rank(root):
    stop = threading.Event()
    os.makedirs(root)
    th = threading.Thread(target=_renew_forever, args=(os.path.join(root, ".writer.json"),
                                                       stop, "elsewhere"), daemon=True)
    th.start()
    try:
        out = distributed.run(_two_ranks_locked, 2, root, timeout=120,
                              env={"FASTCKPT_COMMIT_TIMEOUT_S": "20"})
    finally:
        stop.set()
        th.join()
    assert all(o.startswith("locked") for o in out), out
    assert "rank 0" in out[1] and "elsewhere" in out[1]


# ------------------------------------------------------ 7. readers never told "start fresh"

class _Racing(LocalStorage):
    """A local root where a writer acts at a chosen moment of a reader's scan."""

    def __init__(self, root: str, on_size=None, on_read=None) -> None:
        super().__init__(root)
        self.on_size, self.on_read = on_size, on_read

    def size(self, path):
        n = super().size(path)
        if self.on_size is not None and self.on_size(path, n):
            self.on_size = None
        return n

    def read_bytes(self, path):
        if self.on_read is not None and self.on_read(path):
            self.on_read = None
        return super().read_bytes(path)


def _commit_and_retire(root: str, new: int, old: int) -> None:
    fastckpt.save(_state(new), root, step=new)
    shutil.rmtree(os.path.join(root, fmt.step_dirname(old)))  # retention (keep_last=1)


def test_discovery_racing_a_commit_and_retention(root):
    fastckpt.save(_state(1), root, step=1)
    os.makedirs(os.path.join(root, fmt.step_dirname(2)))  # step 2's save has begun

    def writer(path, n):  # right after the reader saw step 2 without a manifest
        if n is None and fmt.step_dirname(2) in path:
            _commit_and_retire(root, 2, 1)
            return True
    s, _, body = find_step(_Racing(root, on_size=writer))
    assert s == 2 and body["step"] == 2


def test_manifest_removed_between_stat_and_read(root):
    fastckpt.save(_state(1), root, step=1)
    os.makedirs(os.path.join(root, fmt.step_dirname(2)))

    def writer(path):  # step 1's manifest was found; it goes before it is read
        if fmt.step_dirname(1) in path:
            _commit_and_retire(root, 2, 1)
            return True
    assert find_step(_Racing(root, on_read=writer))[0] == 2


def test_load_retries_when_its_step_is_removed(root, caplog):
    fastckpt.save(_state(1), root, step=1, zero_copy=False)

    def writer(path, n):  # the load checks step 1's shards: it is retired meanwhile
        if path.endswith(fmt.SHARD_SUFFIX) and fmt.step_dirname(1) in path:
            _commit_and_retire(root, 2, 1)
            return True
    dest = _state(0)
    with caplog.at_level(logging.WARNING, logger="fastckpt"):
        assert load_into(_Racing(root, on_size=writer), dest)[0] == 2
    assert torch.equal(dest["big"], _state(2)["big"]) and dest["step"] == 2
    assert any("removed while it was being read" in r.getMessage() for r in caplog.records)


_WRITER = """
import sys, time, torch, fastckpt
with fastckpt.Checkpointer(sys.argv[1], keep_last=1, commit_timeout_s=30) as ck:
    for step in range(1, 100000):
        ck.save({"w": torch.full((64,), float(step)), "step": step}, step=step).wait()
        if step == 1:
            print("first", flush=True)
        time.sleep(0.05)  # about 15 commits (and retirements) a second
"""


def test_polling_a_busy_writer_never_says_none(root):
    """Real concurrency: a keep_last=1 writer commits and retires as fast as it can while this
    process resolves the newest step and loads it, again and again."""
    p = subprocess.Popen([sys.executable, "-c", _WRITER, root], stdout=subprocess.PIPE, text=True,
                         cwd=REPO)
    try:
        assert p.stdout.readline().strip() == "first"
        storage = LocalStorage(root)
        end = time.monotonic() + 6
        polls = loads = 0
        while time.monotonic() < end:
            s, _, body = find_step(storage)  # raises CheckpointNotFoundError on a false "none"
            assert body["step"] == s
            polls += 1
            if polls % 20 == 0:
                dest = {"w": torch.zeros(64), "step": 0}
                got = load_into(storage, dest)[0]
                assert dest["step"] == got and torch.equal(dest["w"], torch.full((64,), got))
                loads += 1
    finally:
        p.kill()
        p.wait()
    assert polls > 100 and loads > 5


# --------------------------------------------------------------------- 8. gc racing a save

def test_gc_keeps_a_step_directory_a_save_just_created(root, capsys):
    fastckpt.save(_state(1), root, step=1)
    os.makedirs(os.path.join(root, fmt.step_dirname(2)))  # makedirs done, marker not yet
    plan = {a.record.step: a for a in tools.plan_gc(root, 1)}
    assert not plan[2].remove and plan[2].record.state == "writing"
    rc, out, _ = call("gc", root, "--keep", "1", "--yes", "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["removed"] == []
    assert os.path.isdir(os.path.join(root, fmt.step_dirname(2)))


# ------------------------------------------------------------------------ 10. non-regular files

_LOAD = """
import sys, torch, fastckpt
try:
    fastckpt.load({"e": torch.empty(0), "step": 0}, sys.argv[1], native=sys.argv[2])
except fastckpt.FastCkptError as e:
    print("ERR", e)
"""


@BACKENDS
@pytest.mark.parametrize("which", ["shard", "manifest"])
def test_a_fifo_in_place_of_a_file_never_blocks(root, native, which):
    for s in (1, 2):  # a state whose shard holds no byte: the FIFO's size (0) agrees with it
        fastckpt.save({"e": torch.empty(0), "step": s}, root, step=s)
    d = os.path.join(root, fmt.step_dirname(2))
    doc = read_doc(root, 2)
    target = os.path.join(d, fmt.MANIFEST if which == "manifest" else _chunk(doc, "e")["file"])
    assert os.path.getsize(target) > 0 or which == "shard"
    os.remove(target)
    os.mkfifo(target)
    r = subprocess.run([sys.executable, "-c", _LOAD, root, native], capture_output=True,
                       text=True, timeout=60, cwd=REPO)
    assert r.returncode == 0, r.stderr
    if which == "manifest":  # the step is skipped, the older one loads
        assert "ERR" not in r.stdout and fmt.step_dirname(2) in r.stderr
    else:
        assert "ERR" in r.stdout and "regular file" in r.stdout and "FIFO" in r.stdout
    for cmd in (["ls", root], ["verify", root, "--all"], ["gc", root, "--keep", "1"],
                ["inspect", root], ["resume", root]):
        r = subprocess.run([sys.executable, "-m", "fastckpt.cli", *cmd], capture_output=True,
                           text=True, timeout=60, cwd=REPO)
        assert r.returncode in (0, 1) and "Traceback" not in r.stderr, (cmd, r.stderr)


# ------------------------------------------------------------------ 11. chunks that do not cover

def test_chunks_that_leave_part_of_a_tensor_unwritten(root):
    fastckpt.save(_state(), root, step=1)
    doc = read_doc(root, 1)
    c = _chunk(doc, "small")
    c["sizes"] = [2, 5]  # rows 0-1 only: row 2 would keep its stale values
    c["length"] = 2 * 5 * 4
    write_doc(root, 1, doc)
    with pytest.raises(CorruptCheckpointError, match="10 of the tensor's 15") as ei:
        fastckpt.load(_state(0), root)
    assert ei.value.key == "small"
    with pytest.raises(CorruptCheckpointError, match="10 of the tensor's 15"):
        tools.verify_step(root, 1, record=False)


# ------------------------------------------------------------------ 12. crafted structure

def _root_with_bad_step_3(tmp_path, make_bad) -> str:
    root = str(tmp_path / "r")
    for s in (1, 2, 3):
        fastckpt.save(_state(s), root, step=s)
    make_bad(root)
    return root


def _deep(root):
    d = 5000
    write_raw(root, 3, '{"files":{},"save_id":"a","step":3,"tensors":{},"tree":'
              + "[" * d + "]" * d + ',"world_size":1}')


def _wrong_types(root):
    doc = read_doc(root, 3)
    doc["body"]["files"] = ["not", "a", "mapping"]
    write_doc(root, 3, doc)


def _manifest_dir(root):
    p = os.path.join(root, fmt.step_dirname(3), fmt.MANIFEST)
    os.remove(p)
    os.makedirs(os.path.join(p, "x"))


def _no_version(root):
    doc = read_doc(root, 3)
    del doc["format_version"]
    write_doc(root, 3, doc)


def _bad_dtype(root):
    doc = read_doc(root, 3)
    doc["body"]["tensors"]["small"]["dtype"] = "float128"
    write_doc(root, 3, doc)


@pytest.mark.parametrize("make_bad,says", [
    (_deep, "nest"), (_wrong_types, "'files'"), (_manifest_dir, "regular file"),
    (_no_version, "format_version"), (_bad_dtype, "float128")])
def test_one_bad_step_never_stops_the_tools(tmp_path, capsys, make_bad, says):
    root = _root_with_bad_step_3(tmp_path, make_bad)
    rc, out, err = call("ls", root, "--json", capsys=capsys)
    assert rc == 0, err
    states = {s["step"]: (s["state"], s["error"]) for s in json.loads(out)["steps"]}
    assert states[1][0] == states[2][0] == "committed" and states[3][0] == "corrupt"
    assert says in states[3][1] and fmt.step_dirname(3) in states[3][1]
    assert "newer" not in states[3][1]
    rc, out, err = call("resume", root, capsys=capsys)
    assert rc == 0 and out.split()[0] == "2" and fmt.step_dirname(3) in err
    rc, out, err = call("verify", root, "--step", "3", capsys=capsys)
    assert rc == 1 and fmt.step_dirname(3) in out + err and "Traceback" not in err
    rc, out, err = call("inspect", root, "--step", "3", capsys=capsys)
    assert rc == 1 and fmt.step_dirname(3) in out + err
    rc, out, err = call("gc", root, "--keep", "1", "--yes", "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["removed"] == [1]
    assert fastckpt.load(_state(0), root) == 2


def test_huge_declared_tensor_is_not_allocated(root, monkeypatch):
    fastckpt.save({"w": torch.ones(4), "step": 1}, root, step=1)
    doc = read_doc(root, 1)
    body = doc["body"]
    n = 3 << 30  # 12 GiB of float32
    c = body["tensors"]["w"]["chunks"][0]
    body["tensors"]["w"]["shape"] = [n]
    c["sizes"], c["length"] = [n], 4 * n
    body["files"][c["file"]]["size"] = c["offset"] + 4 * n
    write_doc(root, 1, doc)
    from fastckpt.engine import load as engine_load
    sizes = []
    real = engine_load.alloc_in_phase
    monkeypatch.setattr(engine_load, "alloc_in_phase",
                        lambda body, fqn, meta, like=None: sizes.append(meta["shape"])
                        or real(body, fqn, meta, like))
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        fastckpt.load({}, root, strict=False)  # the checkpoint decides what is allocated
    assert sizes == []


# ------------------------------------------------------------------ 13. states too deep to load

def test_state_too_deep_to_load_is_refused_at_save(root):
    x: dict = {"leaf": torch.ones(2)}
    for _ in range(493):
        x = {"n": x}
    with pytest.raises(UnsupportedStateError, match="nests deeper"):
        fastckpt.save({"deep": x}, root, step=1)
    assert not os.path.exists(os.path.join(root, fmt.step_dirname(1)))
    with pytest.raises(ValueError, match="user_meta"):
        meta: dict = {}
        for _ in range(200):
            meta = {"m": meta}
        fastckpt.save({"w": torch.ones(2)}, root, step=2, user_meta=meta)
    # the deepest state that is accepted loads back
    y: dict = {"leaf": torch.arange(3.0)}
    for _ in range(fmt.MAX_NESTING - 3):
        y = {"n": y}
    fastckpt.save({"deep": y}, root, step=3)
    z: dict = {"leaf": torch.zeros(3)}
    for _ in range(fmt.MAX_NESTING - 3):
        z = {"n": z}
    fastckpt.load({"deep": z}, root)
    while "leaf" not in z:
        z = z["n"]
    assert torch.equal(z["leaf"], torch.arange(3.0))


# ------------------------------------------------- 14. housekeeping that fails after the commit

def test_failed_latest_write_does_not_skip_cleanup(root, capsys):
    with fastckpt.Checkpointer(root, keep_last=1) as ck:
        ck.save(_state(1), step=1).wait()
        os.remove(os.path.join(root, fmt.LATEST))
        os.makedirs(os.path.join(root, fmt.LATEST, "x"))  # the hint cannot be written
        ck.save(_state(2), step=2).wait()
    d2 = os.path.join(root, fmt.step_dirname(2))
    assert not [n for n in os.listdir(d2) if n.startswith(fmt.INFLIGHT_PREFIX)]
    assert sorted(n for n in os.listdir(root) if n.startswith("step-")) == [fmt.step_dirname(2)]
    # markers left in a committed step (a crash right after the commit): gc finishes the job
    sid = read_doc(root, 2)["body"]["save_id"]
    marker = os.path.join(d2, f"{fmt.INFLIGHT_PREFIX}{sid}")
    with open(marker, "w") as f:
        json.dump({"save_id": sid, "created_unix": time.time()}, f)
    rc, out, _ = call("gc", root, "--keep", "1", "--yes", "--json", capsys=capsys)
    assert rc == 0 and not os.path.exists(marker)
    assert fastckpt.load(_state(0), root) == 2


# ------------------------------------------- issue 11: housekeeping outside the commit deadline

def _slow_retention(rank: int, world: int, root: str):
    from fastckpt.storage.local import LocalStorage as L

    class Slow(L):
        def remove_dir(self, path):
            time.sleep(5)  # an object store removing many old steps
            return super().remove_dir(path)

    with fastckpt.Checkpointer(root, keep_last=1, commit_timeout_s=2) as ck:
        ck.storage = Slow(ck.storage.root)
        ck.save({"w": torch.full((8,), 1.0)}, step=1).wait()
        h = ck.save({"w": torch.full((8,), 2.0)}, step=2)
        try:
            h.wait()
            return "committed"
        except fastckpt.FastCkptError as e:
            return f"{type(e).__name__}: {e}"


def test_slow_retention_does_not_fail_a_committed_save(root):
    out = distributed.run(_slow_retention, 2, root, timeout=120)
    assert out == ["committed", "committed"], out
    assert fastckpt.load({"w": torch.zeros(8)}, root) == 2
