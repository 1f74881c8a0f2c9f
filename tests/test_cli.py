"""The ``fastckpt`` command.

The main flows run through the installed console script in subprocesses. Every subprocess pays
the ``import torch`` that ``import fastckpt`` implies (seconds on a small machine), so the
fixture ``runs`` starts all of them at once, on their own copies of the checkpoint roots, and
the tests then check their results. Edge cases run in-process through ``fastckpt.cli.main``
(same code path, exit codes included) and through the ``fastckpt.tools`` functions.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import torch
import xxhash

import fastckpt
from fastckpt.manifest import schema as fmt
from fastckpt import tools
from tests.clirun import call

HERE = os.path.dirname(os.path.abspath(__file__))
FASTCKPT = (shutil.which("fastckpt", path=os.path.dirname(sys.executable))
            or shutil.which("fastckpt"))
OLD = 1_000_000_000.0  # an mtime long ago: "abandoned"

# the exec'd child: installs a SIGUSR1 handler, reports its pid and env, waits for the signal
CHILD = textwrap.dedent("""
    import json, os, signal, sys, time
    out, wait = sys.argv[1], sys.argv[2] == "wait"
    got = []
    signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
    env = {k: v for k, v in os.environ.items() if k.startswith("FASTCKPT_")}
    with open(out + ".tmp", "w") as f:
        json.dump({"pid": os.getpid(), "env": env}, f)
    os.replace(out + ".tmp", out)
    end = time.time() + 240
    while wait and not got and time.time() < end:
        time.sleep(0.02)
    sys.exit(0 if (got or not wait) else 9)
""")


# ---------------------------------------------------------------------------------- helpers

def _state(step: int) -> dict:
    torch.manual_seed(step)
    m = torch.nn.Linear(16, 8)
    opt = torch.optim.Adam(m.parameters())
    m(torch.randn(2, 16)).sum().backward()
    opt.step()
    return {"model": m, "optim": opt, "big": torch.randn(64, 1024), "step": step,
            "data": {"epoch": 3, "pos": (1, 2)}}


def _manifest(root: str, step: int) -> dict:
    """The step's validated manifest body, chunks merged in (format 4 keeps them in per-rank
    index files: FASTCKPT_RANK_INDEXES=1 runs these tests on that format)."""
    from fastckpt.manifest.discovery import read_manifest
    from fastckpt.storage import open_storage
    return read_manifest(open_storage(root), os.path.join(root, fmt.step_dirname(step)),
                         step=step)


def _age(path: str) -> None:
    """An abandoned step: its files and its directory untouched for hours."""
    for d, _, names in os.walk(path):
        for n in names:
            os.utime(os.path.join(d, n), (OLD, OLD))
        os.utime(d, (OLD, OLD))


def _snapshot(root: str) -> list:
    out = []
    for d, _, names in sorted(os.walk(root)):
        for n in sorted(names):
            p = os.path.join(d, n)
            out.append((os.path.relpath(p, root), os.path.getsize(p)))
    return out


def _make_sharded(root: str, step: int = 7) -> str:
    """A 2-rank checkpoint written by hand: tensor 'w' [8, 4] sharded on dim 0 (like FSDP)."""
    sid = "abcdef012345"
    d = os.path.join(root, fmt.step_dirname(step))
    os.makedirs(d)
    full = torch.arange(32, dtype=torch.float32).reshape(8, 4)
    files, chunks = {}, []
    for r in range(2):
        data = full[r * 4:(r + 1) * 4].contiguous().numpy().tobytes()
        name = fmt.shard_name(r, sid)
        with open(os.path.join(d, name), "wb") as f:
            f.write(data)
        h = fmt.hexdigest(xxhash.xxh3_64_intdigest(data))
        files[name] = {"rank": r, "size": len(data), "checksum": h}
        chunks.append({"offsets": [r * 4, 0], "sizes": [4, 4], "rank": r, "file": name,
                       "offset": 0, "length": len(data), "checksum": h})
    body = fmt.new_manifest_body(
        step=step, world_size=2, save_id=sid, files=files,
        tensors={"w": {"dtype": "float32", "shape": [8, 4], "dtensor": True, "chunks": chunks}},
        trees=[{"w": {"$tensor": "w"}, "pos": r} for r in range(2)])
    with open(os.path.join(d, fmt.MANIFEST), "wb") as f:
        f.write(fmt.encode_manifest(body))
    return d


# ---------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def roots(tmp_path_factory) -> dict:
    """main: 100, 200, 300 committed; 400 partial (a shard only, old); 500 being written."""
    base = tmp_path_factory.mktemp("cli")
    main = str(base / "main")
    for s in (100, 200, 300):
        fastckpt.save(_state(s), main, step=s)
    d4 = os.path.join(main, fmt.step_dirname(400))
    os.makedirs(d4)
    src = os.path.join(main, fmt.step_dirname(300))
    shard = next(n for n in os.listdir(src) if n.endswith(fmt.SHARD_SUFFIX))
    shutil.copy(os.path.join(src, shard), d4)
    _age(d4)
    d5 = os.path.join(main, fmt.step_dirname(500))
    os.makedirs(d5)
    with open(os.path.join(d5, f"{fmt.INFLIGHT_PREFIX}feedbeef0000"), "w") as f:
        json.dump({"save_id": "feedbeef0000", "created_unix": time.time()}, f)
    shutil.copy(os.path.join(src, shard), os.path.join(d5, "r00000-feedbeef0000.fck"))
    r = {"base": str(base), "main": main}
    for name in ("gc_dry", "gc_yes", "verify", "corrupt"):
        r[name] = str(base / name)
        shutil.copytree(main, r[name])
    # verify: flip one byte inside tensor 'big' of step 200
    big = _manifest(main, 200)["tensors"]["big"]["chunks"][0]
    r["flip_file"], r["flip_chunk_offset"] = big["file"], big["offset"]
    r["flip_at"] = big["offset"] + 1000
    with open(os.path.join(r["verify"], fmt.step_dirname(200), big["file"]), "r+b") as f:
        f.seek(r["flip_at"])
        b = f.read(1)
        f.seek(r["flip_at"])
        f.write(bytes([b[0] ^ 0x40]))
    # corrupt: the newest committed step's manifest is damaged
    with open(os.path.join(r["corrupt"], fmt.step_dirname(300), fmt.MANIFEST), "r+b") as f:
        f.truncate(100)
    r["empty"] = str(base / "does-not-exist")
    r["afile"] = str(base / "a-file")
    with open(r["afile"], "w") as f:
        f.write("not a directory")
    r["bench"] = str(base / "bench-target")
    return r


def _bench2(target: str, res: dict) -> None:
    from fastckpt.bench import storage as bench
    try:
        res["bench2"] = bench.summarize(bench.run_bench(target, 16 << 20, ranks=2, reps=1,
                                                        contenders=("raw", "fastckpt"),
                                                        create=True))
    except BaseException as e:  # noqa: BLE001 - reported by the test
        res["bench2"] = e


@pytest.fixture(scope="module")
def runs(roots) -> dict:
    """Every console-script run, started at once; name -> {"rc", "out", "err"} (+ "proc")."""
    if FASTCKPT is None:
        pytest.fail("the fastckpt console script is not installed: run `pip install -e .` in "
                    "the venv")
    r = roots
    base = r["base"]
    env = dict(os.environ, FASTCKPT_RESUME_STEP="999", FASTCKPT_NO_PROGRESS="1")
    cmds = {
        "resume_json": ["resume", r["main"], "--json"],
        "ls_json": ["ls", r["main"], "--json"],
        "verify_all": ["verify", r["verify"], "--all"],
        "gc_dry": ["gc", r["gc_dry"], "--keep", "1"],
        "gc_yes": ["gc", r["gc_yes"], "--keep", "1", "--yes", "--json"],
        "inspect": ["inspect", r["main"]],
        "exec_fresh": ["resume", r["empty"], "--", sys.executable, "-c", CHILD,
                       os.path.join(base, "fresh.json"), "nowait"],
        "exec": ["resume", r["main"], "--", sys.executable, "-c", CHILD,
                 os.path.join(base, "exec.json"), "wait"],
    }
    before = {"gc_dry": _snapshot(r["gc_dry"])}
    procs = {k: subprocess.Popen([FASTCKPT, *v], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=env, cwd=base)
             for k, v in cmds.items()}
    res: dict = {"before": before}
    for k, p in procs.items():
        if k == "exec":
            res[k] = {"proc": p}  # test_resume_exec talks to it
            continue
        out, err = p.communicate(timeout=240)
        res[k] = {"rc": p.returncode, "out": out, "err": err}
    yield res
    p = procs["exec"]
    if p.poll() is None:
        p.kill()
        p.wait()


@pytest.fixture(scope="module")
def bench_runs(roots) -> dict:
    """``fastckpt bench`` from the console script and, at once, a 2-rank bench from Python
    (its ranks are worker processes); its own fixture, so that the second pass of this file
    (FASTCKPT_RANK_INDEXES=1, scripts/test.sh) leaves the benches out (``-k "not bench"``)."""
    if FASTCKPT is None:
        pytest.fail("the fastckpt console script is not installed: run `pip install -e .` in "
                    "the venv")
    base = roots["base"]
    p = subprocess.Popen([FASTCKPT, "bench", roots["bench"], "--create", "--size", "32MiB",
                          "--reps", "2", "--no-warmup", "--contenders", "raw,fastckpt",
                          "--report", os.path.join(base, "rep.json"), "--png",
                          os.path.join(base, "chart.png")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd=base,
                         env=dict(os.environ, FASTCKPT_NO_PROGRESS="1"))
    res: dict = {}
    th = threading.Thread(target=_bench2, args=(roots["bench"] + "-2", res), daemon=True)
    th.start()
    out, err = p.communicate(timeout=240)
    res["bench"] = {"rc": p.returncode, "out": out, "err": err}
    th.join(timeout=240)
    return res


# ------------------------------------------------------------------------- console script

def test_resume_prints_newest_committed(runs, roots):
    r = runs["resume_json"]
    assert r["rc"] == 0, r["err"]
    doc = json.loads(r["out"])
    assert doc["found"] and doc["step"] == 300  # 400 partial and 500 in flight don't count
    assert doc["path"] == os.path.join(roots["main"], fmt.step_dirname(300))


def test_resume_no_checkpoint_exit_code(roots, capsys):
    # a root that does not exist yet: a fresh start, exit 3, one line, nothing on stdout
    rc, out, err = call("resume", roots["empty"], capsys=capsys)
    assert rc == 3 and out == ""
    assert "no committed checkpoint" in err and len(err.strip().splitlines()) == 1
    rc, out, _ = call("resume", roots["empty"], "--json", capsys=capsys)
    assert rc == 3 and json.loads(out)["found"] is False


def test_resume_exec_env_and_signal(runs, roots):
    p = runs["exec"]["proc"]
    out = os.path.join(roots["base"], "exec.json")
    end = time.monotonic() + 120
    while not os.path.exists(out):
        assert p.poll() is None, p.communicate()
        assert time.monotonic() < end, "the child never started"
        time.sleep(0.05)
    with open(out) as f:
        doc = json.load(f)
    assert doc["pid"] == p.pid  # exec'd: the PID the job script started is the child's
    assert doc["env"]["FASTCKPT_RESUME_STEP"] == "300"  # the stale 999 was replaced
    assert doc["env"]["FASTCKPT_RESUME_PATH"] == os.path.join(roots["main"],
                                                             fmt.step_dirname(300))
    assert doc["env"]["FASTCKPT_ROOT"] == roots["main"]
    os.kill(p.pid, signal.SIGUSR1)
    _, err = p.communicate(timeout=60)
    assert p.returncode == 0, err  # the child's handler ran (exit 9 if it timed out)
    assert "resuming from step 300" in err


def test_resume_exec_fresh_start(runs, roots):
    r = runs["exec_fresh"]
    assert r["rc"] == 0, r["err"]
    with open(os.path.join(roots["base"], "fresh.json")) as f:
        env = json.load(f)["env"]
    assert "FASTCKPT_RESUME_STEP" not in env and "FASTCKPT_RESUME_PATH" not in env
    assert env["FASTCKPT_ROOT"] == roots["empty"]
    assert "starting fresh" in r["err"]


def test_ls_json(runs):
    r = runs["ls_json"]
    assert r["rc"] == 0, r["err"]
    steps = {s["step"]: s for s in json.loads(r["out"])["steps"]}
    assert sorted(steps) == [100, 200, 300, 400, 500]
    assert [steps[s]["state"] for s in (100, 200, 300, 400, 500)] == [
        "committed", "committed", "committed", "partial", "writing"]
    assert steps[300]["latest"] and not steps[200]["latest"]
    assert steps[300]["world_size"] == 1 and steps[300]["size_bytes"] > 64 * 1024 * 4
    assert steps[300]["checksum"] == "unverified" and steps[400]["checksum"] is None
    assert steps[100]["created"].endswith("Z")


def test_verify_names_file_tensor_offset(runs, roots, capsys):
    r = runs["verify_all"]
    assert r["rc"] == 1, r["err"]
    bad = [ln for ln in r["out"].splitlines() if "CHECKSUM" in ln]
    assert len(bad) == 1, r["out"]
    ln = bad[0]
    assert roots["flip_file"] in ln and "'big'" in ln
    assert f"offset {roots['flip_chunk_offset']}" in ln
    assert "step 100: OK" in r["out"] and "step 300: OK" in r["out"]
    assert "Traceback" not in r["err"]
    # the results were recorded: ls shows them
    rc, out, _ = call("ls", roots["verify"], "--json", capsys=capsys)
    states = {s["step"]: s["checksum"] for s in json.loads(out)["steps"]}
    assert states[100] == "verified" and states[300] == "verified" and states[200] == "failed"
    rc, out, _ = call("ls", roots["verify"], capsys=capsys)
    assert "FAILED" in out and "verified" in out


def test_gc_dry_run_changes_nothing(runs, roots):
    r = runs["gc_dry"]
    assert r["rc"] == 0, r["err"]
    assert _snapshot(roots["gc_dry"]) == runs["before"]["gc_dry"]
    assert "dry run: would remove 3 step(s)" in r["out"]


def test_gc_yes_removes_the_right_steps(runs, roots):
    r = runs["gc_yes"]
    assert r["rc"] == 0, r["err"]
    doc = json.loads(r["out"])
    assert doc["removed"] == [100, 200, 400] and not doc["dry_run"]
    left = sorted(n for n in os.listdir(roots["gc_yes"]) if n.startswith("step-"))
    assert left == [fmt.step_dirname(300), fmt.step_dirname(500)]  # newest + in flight kept
    reasons = {a["step"]: a["reason"] for a in doc["actions"]}
    assert "newest committed" in reasons[300] and "written" in reasons[500]


def test_inspect_output(runs):
    r = runs["inspect"]
    assert r["rc"] == 0, r["err"]
    out = r["out"]
    assert "step 300" in out
    for name in ("model.weight", "optim.state.weight.exp_avg", "big"):
        assert name in out
    line = next(ln for ln in out.splitlines() if ln.startswith("big "))
    assert "float32" in line and "[64, 1024]" in line and "256.0 KiB" in line
    assert "whole (rank 0)" in line
    assert "step = 300" in out and "data.pos = [1, 2]" in out


def test_bench_writes_report_chart_and_record(bench_runs, roots):
    r = bench_runs["bench"]
    assert r["rc"] == 0, r["err"]
    assert "terminationGracePeriodSeconds:" in r["out"] and "--signal=USR1@" in r["out"]
    for label in ("raw I/O", "fastckpt"):  # (every contender: test_bench.py)
        assert label in r["out"]
    with open(os.path.join(roots["base"], "rep.json")) as f:
        rep = json.load(f)
    rows = {x["name"]: x for x in rep["rows"]}
    assert set(rows) == {"raw", "fastckpt"}
    assert all(x["write_bytes_per_s"] > 0 and x["read_bytes_per_s"] > 0 for x in rows.values())
    assert rep["reps"] == 2 and all(x["n"] == 2 for x in rows.values())  # medians of 2
    assert rep["grace"]["seconds"] >= 30 + 10 + 30
    assert f"wrote report {os.path.join(roots['base'], 'rep.json')}" in r["out"]
    if importlib.util.find_spec("matplotlib") is not None:
        with open(os.path.join(roots["base"], "chart.png"), "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    else:
        assert "no PNG chart: matplotlib is not installed" in r["err"]
    from fastckpt.bench.record import read_bench
    rec = read_bench(roots["bench"])
    assert rec is not None and rec["bandwidth_bytes_per_s"]["save"] > 0
    assert rec["per_rank_bytes_per_s"]["save"] == rec["bandwidth_bytes_per_s"]["save"]  # 1 rank
    assert rec["grace"]["seconds"] == rep["grace"]["seconds"]
    # nothing left behind but the record
    assert os.listdir(roots["bench"]) == [".fastckpt-bench.json"]


def test_bench_two_ranks(bench_runs, roots):
    rep = bench_runs["bench2"]
    if isinstance(rep, BaseException):
        raise rep
    assert rep["ranks"] == 2 and {x["name"] for x in rep["rows"]} == {"raw", "fastckpt"}
    assert all(x["write_s"] > 0 and x["read_s"] > 0 for x in rep["rows"])
    assert rep["state_bytes"] > 15 << 20 and rep["grace"]["seconds"] > 0
    assert os.listdir(roots["bench"] + "-2") == []  # the work directory was removed


# ------------------------------------------------------------------------------- in-process

def test_version_and_unreadable_root(roots, capsys):
    rc, out, _ = call("--version", capsys=capsys)
    assert rc == 0 and fastckpt.__version__ in out and "I/O backend:" in out
    rc, out, err = call("resume", roots["afile"], capsys=capsys)
    assert rc == 4 and out == "" and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_info_json(capsys):
    rc, out, _ = call("info", "--json", capsys=capsys)
    doc = json.loads(out)
    assert rc == 0 and doc["fastckpt_version"] == fastckpt.__version__
    assert doc["io_backend"] in ("native", "python")
    assert (doc["native_error"] is None) == doc["native_available"]


def test_resume_damaged_newest_manifest(roots, capsys, tmp_path):
    # one bad step does not stop a resume: the newest valid one is used, the bad one named
    rc, out, err = call("resume", roots["corrupt"], capsys=capsys)
    assert rc == 0 and out.split()[0] == "200"
    assert "damaged" in err and fmt.step_dirname(300) in err and fmt.MANIFEST in err
    # the real command says it once (before 2026-12-06: the library's log line, then the CLI's)
    r = subprocess.run([FASTCKPT, "resume", roots["corrupt"]], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.split()[0] == "200", r
    said = [ln for ln in r.stderr.splitlines() if fmt.step_dirname(300) in ln]
    assert len(said) == 1 and "damaged" in said[0], r.stderr
    rc, out, _ = call("resume", roots["corrupt"], "--json", capsys=capsys)
    doc = json.loads(out)
    assert rc == 0 and doc["step"] == 200 and fmt.step_dirname(300) in doc["skipped_damaged"][0]
    # every manifest damaged: nothing runs, exit 1 (not 3: nothing says "start fresh")
    only = str(tmp_path / "only")
    os.makedirs(os.path.join(only, fmt.step_dirname(300)))
    shutil.copy(os.path.join(roots["corrupt"], fmt.step_dirname(300), fmt.MANIFEST),
                os.path.join(only, fmt.step_dirname(300), fmt.MANIFEST))
    rc, out, err = call("resume", only, capsys=capsys)
    assert rc == 1 and "damaged" in err and out == ""
    rc, out, _ = call("resume", only, "--json", capsys=capsys)
    assert rc == 1 and json.loads(out)["exit_code"] == 1
    rc, out, _ = call("ls", roots["corrupt"], "--json", capsys=capsys)
    states = {s["step"]: s["state"] for s in json.loads(out)["steps"]}
    assert states[300] == "corrupt" and states[200] == "committed"


def test_gc_never_removes_newest_valid_or_damaged(roots, capsys, tmp_path):
    root = str(tmp_path / "r")
    shutil.copytree(roots["corrupt"], root)
    # step 100 being saved again (a job that went back): left alone
    marker = os.path.join(root, fmt.step_dirname(100), f"{fmt.INFLIGHT_PREFIX}0123456789ab")
    with open(marker, "w") as f:
        json.dump({"save_id": "0123456789ab", "created_unix": time.time()}, f)
    plan = {a.record.step: a for a in tools.plan_gc(root, 1)}
    assert not plan[100].remove and "in flight" in plan[100].reason and plan[400].remove
    os.remove(marker)
    rc, out, _ = call("gc", root, "--keep", "1", "--yes", "--json", capsys=capsys)
    assert rc == 0
    # 300's manifest is damaged: kept; 200 is the newest valid committed step: kept
    assert json.loads(out)["removed"] == [100, 400]
    assert sorted(os.listdir(root)) == ["latest"] + [fmt.step_dirname(s) for s in (200, 300, 500)]


def test_sharded_inspect_and_verify(tmp_path, capsys):
    root = str(tmp_path / "sh")
    d = _make_sharded(root)
    rc, out, _ = call("inspect", root, "--chunks", capsys=capsys)
    assert rc == 0
    line = next(ln for ln in out.splitlines() if ln.startswith("w "))
    assert "[8, 4]" in line and "sharded dim 0 in 2 chunks (ranks 0-1)" in line
    assert "rank 1, r00001-abcdef012345-000.fck @ 0" in out
    assert "per rank" in out and "rank1: pos = 1" in out
    rc, out, _ = call("inspect", root, "--json", "--filter", "w*", capsys=capsys)
    t = json.loads(out)["tensors"][0]
    assert t["chunks_count"] == 2 and t["dtensor"] and "chunks" not in t
    rc, out, _ = call("verify", root, capsys=capsys)
    assert rc == 0 and "step 7: OK: 2 file(s), 2 chunk(s)" in out
    # a missing shard and a truncated one, each named
    os.remove(os.path.join(d, "r00001-abcdef012345-000.fck"))
    with open(os.path.join(d, "r00000-abcdef012345-000.fck"), "r+b") as f:
        f.truncate(40)
    rc, out, _ = call("verify", root, "--json", capsys=capsys)
    assert rc == 1
    probs = json.loads(out)["steps"][0]["problems"]
    kinds = {(p["kind"], p["file"]) for p in probs}
    assert ("missing", "r00001-abcdef012345-000.fck") in kinds
    assert ("size", "r00000-abcdef012345-000.fck") in kinds
    assert ("truncated", "r00000-abcdef012345-000.fck") in kinds
    assert any(p["tensor"] == "w" and p["offset"] == 0 for p in probs if p["kind"] == "truncated")


def test_verify_padding_and_missing_step(roots, tmp_path, capsys):
    root = str(tmp_path / "p")
    shutil.copytree(roots["main"], root)
    body = _manifest(root, 100)
    chunks = sorted((c["offset"], c["length"], c["file"]) for t in body["tensors"].values()
                    for c in t["chunks"])
    gap = next(o + n for (o, n, _), (o2, _, _) in zip(chunks, chunks[1:]) if o2 > o + n)
    with open(os.path.join(root, fmt.step_dirname(100), chunks[0][2]), "r+b") as f:
        f.seek(gap)
        f.write(b"\x01")
    rc, out, _ = call("verify", root, "--step", "100", "--no-record", capsys=capsys)
    assert rc == 1 and "PADDING" in out and f"offset {gap}" in out
    assert not any(n.startswith(".verif") for n in os.listdir(os.path.join(
        root, fmt.step_dirname(100))))
    rc, _, err = call("verify", root, "--step", "400", capsys=capsys)
    assert rc == 3 and "step 400" in err
    rc, _, err = call("inspect", roots["empty"], capsys=capsys)
    assert rc == 3


def test_fsspec_urls(roots, capsys):
    # local:// goes through the fsspec backend (FsspecStorage), like s3://
    url = "local://" + roots["main"]
    rc, out, _ = call("ls", url, "--json", capsys=capsys)
    assert rc == 0 and [s["state"] for s in json.loads(out)["steps"]][:3] == ["committed"] * 3
    rc, out, _ = call("verify", url, "--step", "200", "--no-record", capsys=capsys)
    assert rc == 0 and "step 200: OK" in out
    # memory:// lives in this process only
    mem = "memory://clitest/run"
    for s in (1, 2, 3):
        fastckpt.save({"w": torch.arange(8.0) + s, "step": s}, mem, step=s)
    rc, out, _ = call("resume", mem, capsys=capsys)
    assert rc == 0 and out.split() == ["3", "memory:///clitest/run/step-0000000003"]
    rc, out, _ = call("verify", mem, "--all", "--json", capsys=capsys)
    assert rc == 0 and [s["ok"] for s in json.loads(out)["steps"]] == [True] * 3
    rc, out, _ = call("gc", mem, "--keep", "2", "--yes", "--json", capsys=capsys)
    assert rc == 0 and json.loads(out)["removed"] == [1]
    recs = tools.describe_steps(mem)
    assert [(r.step, r.checksum, r.latest) for r in recs] == [(2, "verified", False),
                                                               (3, "verified", True)]
    assert tools.inspect_step(mem)["plain_values"] == {"step": 3}


def test_usage_errors(capsys, roots):
    rc, _, err = call("gc", roots["main"], "--keep", "0", capsys=capsys)
    assert rc == 2
    rc, _, err = call("bench", roots["base"], "--size", "lots", capsys=capsys)
    assert rc == 2 and "not a size" in err
    rc, _, err = call("verify", roots["main"], "--step", "1", "--all", capsys=capsys)
    assert rc == 2


def test_sizes_and_grace():
    assert tools.parse_size("4GiB") == 4 << 30 == tools.parse_size("4G")
    assert tools.parse_size("4GB") == 4 * 10 ** 9 and tools.parse_size("1.5M") == 3 << 19
    assert tools.parse_size("4096") == 4096
    assert tools.human_bytes(1536) == "1.5 KiB" and tools.human_bytes(10) == "10 B"
    from fastckpt.bench.storage import grace_window
    g = grace_window(100 << 30, 1 << 30, step_drain_s=20, barrier_s=5, safety_fraction=0.25,
                     safety_min_s=30)
    assert g["write_s"] == 100 and g["safety_s"] == 31.25 and g["seconds"] == 157
    assert g["slurm_signal"] == "--signal=USR1@157"
    assert g["k8s_termination_grace_period_seconds"] == 157


def test_a_root_that_cannot_be_listed_fails_at_the_first_listing(monkeypatch, capsys, tmp_path):
    """A store that does not answer costs one bound, not two: the CLI's first look at ROOT
    (its DCP check) fails the command with exit 4 naming the root; before 2026-12-06 the
    error was swallowed there and the command listed again (ls on a silent s3:// root: 240 s
    instead of 120 s). Simulated: a local root whose listing raises, counted."""
    from fastckpt.errors import StorageError
    from fastckpt.storage.local import LocalStorage
    listings = []

    class Unlistable(LocalStorage):
        def listdir(self, path):
            listings.append(path)
            raise StorageError("listing timed out after 120 s (simulated)", file=path)

        sizes = listdir

    monkeypatch.setattr(tools, "as_storage", lambda root, **kw: Unlistable(str(root)))
    os.makedirs(tmp_path / "r")
    for cmd in ("ls", "resume", "gc"):
        listings.clear()
        rc, out, err = call(cmd, str(tmp_path / "r"), capsys=capsys)
        assert len(listings) == 1, (cmd, listings)
        assert rc == 4 and "cannot list" in err and "timed out" in err, (cmd, rc, err)
