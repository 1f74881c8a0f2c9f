"""Retention and `fastckpt gc` never remove a loadable step because of a damaged or ambiguous
one (the review of 2026-12-06):

* retention counted a step whose manifest is damaged toward ``keep_last``, and removed the
  loadable step it pushed out;
* a second directory of one step number (``step-00000000005`` beside ``step-0000000005``) made
  `gc` remove the committed step with the partial one;
* `gc --keep` trusted a newest step whose shard files are missing or truncated, and removed
  the older loadable ones.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

import fastckpt
from fastckpt.manifest import schema as fmt
from tests.clirun import call


def _steps(root: str, steps, keep_last=None) -> dict:
    st = {"w": torch.arange(100, dtype=torch.float32)}
    with fastckpt.Checkpointer(root, keep_last=keep_last) as ck:
        for s in steps:
            st["w"].add_(1.0)
            ck.save(st, step=s, block=True)
    return st


def _loads(root: str) -> int:
    got = {"w": torch.zeros(100)}
    return fastckpt.load(got, root)


def test_retention_does_not_count_a_step_whose_manifest_is_damaged(tmp_path):
    root = str(tmp_path)
    _steps(root, (1, 2, 3))
    d = os.path.join(root, fmt.step_dirname(5))  # a later run's step, its manifest torn
    os.makedirs(d)
    with open(os.path.join(d, fmt.MANIFEST), "w") as f:
        f.write('{"torn": ')
    _steps(root, (4,), keep_last=2)
    assert fastckpt.steps(root) == [3, 4]  # two loadable steps; step 3 was removed before
    assert os.path.isdir(d)  # the damaged one is neither counted nor removed
    assert _loads(root) == 4


def test_a_second_directory_of_one_step_number_is_not_a_step(tmp_path, capsys):
    root = str(tmp_path)
    _steps(root, (4, 5))
    odd = os.path.join(root, "step-00000000005")  # 11 digits: not the name of step 5
    os.makedirs(odd)
    assert fmt.parse_step_dirname("step-00000000005") is None
    assert fmt.parse_step_dirname("step-0000000005") == 5
    assert fmt.parse_step_dirname("step-12345678901") == 12345678901
    rc, out, _ = call("gc", root, "--yes", "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["removed"] == []
    assert fastckpt.steps(root) == [4, 5] and os.path.isdir(odd)
    assert _loads(root) == 5


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_gc_keep_does_not_trust_a_step_whose_shards_are_missing(tmp_path, capsys, damage):
    root = str(tmp_path)
    _steps(root, (1, 2))
    d = os.path.join(root, fmt.step_dirname(2))
    shard = next(n for n in os.listdir(d) if n.endswith(fmt.SHARD_SUFFIX))
    if damage == "missing":
        os.remove(os.path.join(d, shard))
    else:
        with open(os.path.join(d, shard), "r+b") as f:
            f.truncate(100)
    rc, out, _ = call("gc", root, "--keep", "1", "--yes", "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["removed"] == [], out
    assert os.path.isdir(os.path.join(root, fmt.step_dirname(1)))
    got = {"w": torch.zeros(100)}
    assert fastckpt.load(got, root, step=1) == 1


def test_gc_keep_does_not_count_a_step_verify_recorded_as_damaged(tmp_path, capsys):
    # before 2026-12-06 `gc --keep 1` kept the newest step that `verify` had recorded as
    # FAILED and removed every loadable one
    root = str(tmp_path)
    _steps(root, (1, 2, 3))
    d = os.path.join(root, fmt.step_dirname(3))
    shard = os.path.join(d, next(n for n in os.listdir(d) if n.endswith(fmt.SHARD_SUFFIX)))
    with open(shard, "r+b") as f:  # a byte of the data
        f.seek(os.path.getsize(shard) // 2)
        b = f.read(1)
        f.seek(os.path.getsize(shard) // 2)
        f.write(bytes([b[0] ^ 0xFF]))
    rc, _, _ = call("verify", root, "--all", capsys=capsys)
    assert rc == 1
    rc, out, _ = call("gc", root, "--keep", "1", "--yes", "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["removed"] == [1], out
    assert fastckpt.steps(root) == [2, 3]
    got = {"w": torch.zeros(100)}
    assert fastckpt.load(got, root, step=2) == 2


@pytest.mark.parametrize("when", ['"yesterday"', "[1]", "1e300", "-1e18"])
def test_a_crafted_creation_time_is_a_damaged_manifest_not_a_crash(tmp_path, capsys, when):
    root = str(tmp_path)
    _steps(root, (1, 2))
    p = os.path.join(root, fmt.step_dirname(2), fmt.MANIFEST)
    with open(p) as f:
        doc = json.load(f)
    doc["body"]["created_unix"] = json.loads(when)
    with open(p, "wb") as f:
        f.write(fmt.encode_manifest(doc["body"]))  # (its checksum recomputed: well-formed)
    for args in (("ls", root), ("ls", root, "--json")):
        rc, out, err = call(*args, capsys=capsys)
        assert rc == 0 and "created_unix" in out + err and "Traceback" not in out + err, err
    assert _loads(root) == 1  # the damaged step is skipped


def test_gc_grace_applies_to_in_flight_markers(tmp_path, capsys):
    # an abandoned partial step whose marker and files are 10 minutes old: `--grace 60`
    # removes it (before 2026-12-06 the marker's grace was always the engine's 3600 s)
    import time
    root = str(tmp_path)
    _steps(root, (1,))
    d = os.path.join(root, fmt.step_dirname(2))
    os.makedirs(d)
    t = time.time() - 600
    with open(os.path.join(d, ".inflight-aaaaaaaaaaaa"), "w") as f:
        json.dump({"save_id": "aaaaaaaaaaaa", "created_unix": t, "host": "h", "pid": 1}, f)
    with open(os.path.join(d, "r00000-aaaaaaaaaaaa-000.fck"), "wb") as f:
        f.write(b"x" * 4096)
    for n in os.listdir(d):
        os.utime(os.path.join(d, n), (t, t))
    os.utime(d, (t, t))
    rc, out, _ = call("gc", root, "--yes", "--json", capsys=capsys)  # (default: 3600 s)
    assert rc == 0 and json.loads(out)["removed"] == [] and os.path.isdir(d)
    rc, out, _ = call("gc", root, "--grace", "60", "--yes", "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["removed"] == [2] and not os.path.exists(d)
    assert fastckpt.steps(root) == [1]


def _flip_data(root: str, step: int, fqn: str = "w", rank: int | None = None) -> None:
    with open(os.path.join(root, fmt.step_dirname(step), fmt.MANIFEST)) as f:
        body = json.load(f)["body"]
    c = next(c for c in body["tensors"][fqn]["chunks"] if rank is None or c["rank"] == rank)
    p = os.path.join(root, fmt.step_dirname(step), c["file"])
    with open(p, "r+b") as f:
        f.seek(c["offset"] + 8)
        b = f.read(1)
        f.seek(c["offset"] + 8)
        f.write(bytes([b[0] ^ 0xFF]))


def test_a_resume_falls_back_to_the_newest_step_that_loads(tmp_path, caplog):
    # the newest step's data is damaged: before 2026-12-06 every restart failed on it (a
    # requeued job looped) while the step before it loaded
    root = str(tmp_path)
    _steps(root, (1, 2, 3))
    _flip_data(root, 3)
    _flip_data(root, 2)
    got = {"w": torch.zeros(100)}
    with fastckpt.Checkpointer(root) as ck:
        assert ck.resume(got) == 1
    assert torch.equal(got["w"], torch.arange(100, dtype=torch.float32) + 1)
    assert sum("does not load" in r.getMessage() for r in caplog.records) == 2
    with pytest.raises(fastckpt.CorruptCheckpointError, match="checksum mismatch"):
        fastckpt.load({"w": torch.zeros(100)}, root, step=3)  # asked for by number: no
    with pytest.raises(fastckpt.CorruptCheckpointError):  # strict=False: no fallback
        fastckpt.load({"w": torch.zeros(100)}, root, strict=False)


def _two_rank_state(rank: int, step: int) -> dict:
    return {"w": torch.full((1000,), float(step)), "mine": torch.full((1000,), step + 10.0 * rank)}


def _two_rank_save(rank: int, world: int, root: str):
    with fastckpt.Checkpointer(root) as ck:
        for s in (1, 2):
            ck.save(_two_rank_state(rank, s), step=s, block=True)


def _two_rank_resume(rank: int, world: int, root: str):
    got = {k: torch.zeros(1000) for k in ("w", "mine")}
    with fastckpt.Checkpointer(root) as ck:
        step = ck.resume(got)
    return step, all(torch.equal(got[k], v) for k, v in _two_rank_state(rank, step).items())


def test_a_resume_falls_back_on_every_rank_when_one_ranks_data_is_damaged(tmp_path):
    from tests import distributed
    root = str(tmp_path)
    distributed.run(_two_rank_save, 2, root)
    _flip_data(root, 2, "mine", rank=1)  # only rank 1 reads it
    assert distributed.run(_two_rank_resume, 2, root) == [(1, True), (1, True)]


def test_a_stray_file_named_like_a_step_neither_stops_retention_nor_gc(tmp_path, capsys):
    """A regular file named ``step-0000000000`` in the root (a stray download, a ``touch``)
    is no step: retention keeps working around it and ``fastckpt gc --yes`` ends with exit 0,
    leaving it alone (before 2026-12-06 every commit's retention failed on it, ENOTDIR, so no
    step was ever removed, and gc stopped at it with exit 4)."""
    import torch

    import fastckpt
    from tests.clirun import call
    root = tmp_path / "ck"
    root.mkdir()
    (root / "step-0000000000").write_text("not a directory")
    with fastckpt.Checkpointer(str(root), keep_last=2) as ck:
        for s in range(1, 7):
            ck.save({"w": torch.full((1024,), float(s))}, step=s, block=True)
    assert fastckpt.steps(str(root)) == [5, 6]
    rc, out, err = call("gc", str(root), "--keep", "1", "--yes", capsys=capsys)
    assert rc == 0, (out, err)
    assert fastckpt.steps(str(root)) == [6]
    assert (root / "step-0000000000").read_text() == "not a directory"


def test_a_step_that_gc_removes_while_it_is_saved_again_is_never_committed(tmp_path):
    """A job saving an older step again while ``fastckpt gc`` removes that step: gc's
    re-check passed, then its removal took the manifest and the new save's shards written so
    far. The save must fail (nothing committed) instead of publishing a manifest that names
    removed files, a step every restart would fail on (the window a review found on
    2026-12-06; the coordinator now checks its files are there just before the manifest).
    The removal is done for real, at the point gc's would land: after the shards are written,
    before the commit."""
    import shutil

    import torch

    import fastckpt
    from fastckpt.errors import SaveFailedError
    from fastckpt.manifest import schema as fmt
    from fastckpt.storage.local import LocalStorage

    class GcMidSave(LocalStorage):
        victim = None

        def sync_dir(self, path):
            if self.victim and path.rstrip("/").endswith(self.victim):
                os.remove(os.path.join(path, fmt.MANIFEST))  # gc: the manifest first,
                for n in os.listdir(path):  # then the tree as listed (rmtree)
                    if n.endswith(fmt.SHARD_SUFFIX):
                        os.remove(os.path.join(path, n))
                self.victim = None
            return super().sync_dir(path)
    root = str(tmp_path / "ck")
    st = GcMidSave(root)
    with fastckpt.Checkpointer(st) as ck:
        for s in (1, 2, 3, 4):
            ck.save({"w": torch.full((4096,), float(s))}, step=s, block=True)
        st.victim = fmt.step_dirname(3)
        with pytest.raises(SaveFailedError, match="gone or changed just before its commit"):
            ck.save({"w": torch.full((4096,), 30.0)}, step=3, block=True)
    assert fastckpt.steps(root) == [1, 2, 4]
    got = {"w": torch.zeros(4096)}
    assert fastckpt.load(got, root) == 4 and torch.equal(got["w"], torch.full((4096,), 4.0))
    shutil.rmtree(root)


@pytest.mark.parametrize("age", ["over", "running"])
def test_gc_removes_what_a_dead_save_of_a_committed_step_left(tmp_path, capsys, age):
    """A save of a committed step again that was killed (or a ``dcp.save`` attempt that failed)
    leaves its shard, its index and its in-flight marker in the committed step, named by no
    manifest. Before 2026-12-06 gc and retention left them for good (every killed re-save
    kept a copy of the rank's state); now they are leftovers once the save is over (its
    marker older than the grace), and a save of the step running now keeps them."""
    import time
    root = str(tmp_path)
    st = _steps(root, [1])
    d = os.path.join(root, fmt.step_dirname(1))
    dead = "deadbeef0001"
    began = time.time() - (7200 if age == "over" else 10)
    debris = [fmt.shard_name(0, dead, 0), fmt.shard_name(1, dead, 2), f"r00000-{dead}.fci",
              f"{fmt.INFLIGHT_PREFIX}{dead}"]
    for n in debris[:3]:
        with open(os.path.join(d, n), "wb") as f:
            f.write(b"\0" * 4096)
    with open(os.path.join(d, debris[3]), "w") as f:
        json.dump({"save_id": dead, "created_unix": began, "host": "h", "pid": 1}, f)
    rc, out, _ = call("gc", root, "--yes", "--json", capsys=capsys)
    assert rc == 0, out
    left = set(os.listdir(d))
    if age == "over":
        assert not left & set(debris), sorted(left)
    else:
        assert set(debris) <= left, sorted(left)
    got = {"w": torch.zeros(100)}
    assert fastckpt.load(got, root) == 1 and torch.equal(got["w"], st["w"])
