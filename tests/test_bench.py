"""One benchmark stack: ``fastckpt bench`` and benchmarks/ share ``fastckpt.bench.common`` (sizes,
machine info, cache eviction, child runner, fio, medians) and ``fastckpt.bench.state`` (the
model + Adam state); the bench repeats and interleaves its contenders, reports medians, writes
its report next to its record, and refuses a missing target unless ``--create``.

The runs here are in-process and small (a few MiB, no DCP) so that the file takes seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from fastckpt.bench import common as C
from fastckpt.bench import state as S
from fastckpt.bench import storage as B
from fastckpt.bench.record import read_bench
from fastckpt.tools import sizes
from tests.clirun import call

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(n for n in os.listdir(os.path.join(REPO, "benchmarks")) if n.endswith(".py"))


def _script(name: str):
    spec = importlib.util.spec_from_file_location(f"_bench_script_{name[:-3]}",
                                                  os.path.join(REPO, "benchmarks", name))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# ------------------------------------------------------------------------------- the target

def test_missing_target_is_refused_and_not_created(tmp_path, capsys):
    missing = str(tmp_path / "no" / "such")
    rc, out, err = call("bench", missing, "--size", "4MiB", capsys=capsys)
    assert rc == 2 and out == ""
    assert "does not exist" in err and "--create" in err
    assert not os.path.exists(tmp_path / "no")
    with pytest.raises(FileNotFoundError):
        B.run_bench(missing, 4 << 20, contenders=("raw",))
    assert not os.path.exists(tmp_path / "no")
    afile = tmp_path / "a-file"
    afile.write_text("x")
    rc, _, err = call("bench", str(afile), "--size", "4MiB", capsys=capsys)
    assert rc == 4 and "not a directory" in err


def test_report_next_to_the_record_reps_interleaved(tmp_path, monkeypatch, capsys):
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    monkeypatch.setenv("FASTCKPT_NO_PROGRESS", "1")
    target = str(tmp_path / "new-target")
    rc, out, err = call("bench", target, "--create", "--size", "8MiB", "--reps", "2",
                        "--contenders", "raw,fastckpt,torch", capsys=capsys)
    assert rc == 0, err
    assert os.listdir(cwd) == []  # nothing in the current directory
    report, png = B.report_paths(target)
    assert report == os.path.join(target, ".fastckpt-bench", "report.json")
    assert f"wrote report {report}" in out and f"record {target}/.fastckpt-bench.json" in out
    assert "medians of 2 repetitions" in out
    with open(report) as f:
        rep = json.load(f)
    assert rep["files"]["report"] == report and rep["files"]["record"] is not None
    if importlib.util.find_spec("matplotlib") is not None:
        assert rep["files"]["png"] == png and f"chart {png}" in out
        with open(png, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert sorted(os.listdir(target)) == [".fastckpt-bench", ".fastckpt-bench.json"]
    # repeated, interleaved (order rotated), after one warm-up round of every contender
    assert rep["reps"] == 2 and rep["warmup"] is True
    assert rep["orders"] == [{"rep": None, "order": ["raw", "fastckpt", "torch"]},
                             {"rep": 0, "order": ["raw", "fastckpt", "torch"]},
                             {"rep": 1, "order": ["fastckpt", "torch", "raw"]}]
    for row in rep["rows"]:
        assert row["n"] == 2 and len(row["write_s_samples"]) == 2
        assert row["write_s"] == C.median(row["write_s_samples"])
        assert row["read_s"] == C.median(row["read_s_samples"])
        assert row["warmup_write_s"] > 0 and row["warmup_read_s"] > 0
        assert row["write_bytes_per_s"] == pytest.approx(row["bytes"] / row["write_s"])
    assert rep["fastckpt_first_save"]["save_s"] == rep["rows"][1]["warmup_write_s"]
    assert rep["fastckpt_staged_s"] == C.median(rep["fastckpt_staged_s_samples"])
    geom = S.geometry(8 << 20)
    assert rep["state_bytes"] == geom["state_bytes"] and rep["geometry"] == geom
    # provenance, from the shared library
    assert rep["machine"]["host"] and rep["machine"]["nproc"] == os.cpu_count()
    assert "commit" in rep["git"] and rep["versions"]["fastckpt"] == rep["fastckpt_version"]
    # the record the engine reads is unchanged in form and agrees with the report
    rec = read_bench(target)
    assert rec is not None and rec["version"] == 1
    assert rec["bandwidth_bytes_per_s"]["save"] == rep["rows"][1]["write_bytes_per_s"]


def test_explicit_report_outside_the_target_says_it_replaced(tmp_path, capsys):
    target = tmp_path / "t"
    target.mkdir()
    dest = tmp_path / "out.json"
    dest.write_text("an older file\n")
    rc, out, err = call("bench", str(target), "--size", "4MiB", "--reps", "1", "--no-warmup",
                        "--contenders", "raw", "--report", str(dest), "--png", "",
                        "--no-record", capsys=capsys)
    assert rc == 0, err
    assert f"replaced the existing file {dest}" in err
    assert f"wrote report {dest}" in out and "no warm-up" in out
    rep = json.loads(dest.read_text())
    assert rep["reps"] == 1 and rep["orders"] == [{"rep": 0, "order": ["raw"]}]
    assert os.listdir(target) == []  # no record, no report, no work directory


def test_summarize_takes_the_slowest_rank_then_the_median():
    per_rank = [{"times": {"raw write": [1.0, 4.0, 2.0], "raw read": [1.0, 1.0, 1.0]},
                 "warmup": {}, "raw_bytes": 100, "orders": [], "evicted": True},
                {"times": {"raw write": [2.0, 1.0, 3.0], "raw read": [0.5, 2.0, 0.5]},
                 "warmup": {}, "evicted": True}]
    raw = {"target": "memory://x", "size": 100, "ranks": 2, "contenders": ["raw"], "reps": 3,
           "warmup": False, "started_unix": time.time(), "per_rank": per_rank}
    rep = B.summarize(raw)
    row = rep["rows"][0]
    assert row["write_s_samples"] == [2.0, 4.0, 3.0] and row["write_s"] == 3.0
    assert row["read_s_samples"] == [1.0, 2.0, 1.0] and row["read_s"] == 1.0
    assert row["write_bytes_per_s"] == 100 / 3.0 and rep["grace"] is None


def test_memory_needed_counts_the_staging_buffer_and_a_turn():
    assert B.memory_needed(100, ("raw",)) == 110
    assert B.memory_needed(100, ("fastckpt",)) == 210
    assert B.memory_needed(100, B.CONTENDERS) == 310


# ------------------------------------------------------------------------------- one library

def test_one_size_rule_everywhere():
    assert sizes.parse_size("4GB") == 4 * 10 ** 9
    assert sizes.parse_size("4G") == sizes.parse_size("4GiB") == 4 << 30
    assert sizes.parse_size("16M") == 16 << 20 and sizes.parse_size("1e9") == 10 ** 9
    assert C.parse_size is sizes.parse_size and C.human_bytes is sizes.human_bytes
    from fastckpt import tools
    assert tools.parse_size is sizes.parse_size
    assert not os.path.exists(os.path.join(REPO, "benchmarks", "_common.py"))
    for name in SCRIPTS:
        with open(os.path.join(REPO, "benchmarks", name)) as f:
            src = f.read()
        assert "def parse_size" not in src and "_common" not in src, name
        assert "from fastckpt.bench import common as C" in src, name
        mod = _script(name)
        assert mod.C is C and mod.C.parse_size is sizes.parse_size, name
    assert _script("bench_saveload.py").S is S and _script("bench_async.py").S is S


@pytest.mark.parametrize("name", SCRIPTS)
def test_benchmark_scripts_start(name):
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", name), "--help"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("usage:")


def test_geometry_shards_evenly_and_stays_under_the_size():
    for size, world in ((16 << 20, 1), (32 << 20, 2), (1 << 30, 8)):
        g = S.geometry(size, world=world)
        assert g["width"] % (8 * world) == 0
        assert 0.9 * size < g["state_bytes"] <= size
    m, o = S.model_adam(S.geometry(1 << 20, layers=2), seed=3)
    names = [n for n, _ in S.state_tensors(m, o)]
    assert names[:2] == ["model.0.weight", "model.0.bias"]
    assert "optim.0.weight.exp_avg_sq" in names and "optim.1.bias.step" in names
    assert S.local_nbytes(m, o) == S.geometry(1 << 20, layers=2)["state_bytes"]
    m2, o2 = S.model_adam(S.geometry(1 << 20, layers=2), seed=3)
    assert all(a.equal(b) for (_, a), (_, b) in zip(S.state_tensors(m, o),
                                                     S.state_tensors(m2, o2)))
    _, fresh = S.model_adam(S.geometry(1 << 20, layers=2), stepped=False)
    assert not fresh.state


def test_rotations_interleave():
    assert C.rotations(["a", "b", "c"], 4) == [["a", "b", "c"], ["b", "c", "a"],
                                               ["c", "a", "b"], ["a", "b", "c"]]


def test_run_children_reports_each_and_stops_the_rest(tmp_path):
    ok = ("import json, sys; p = json.load(open(sys.argv[1])); "
          "json.dump({'ok': True, 'x': p['x']}, open(sys.argv[2], 'w'))")
    fail = "import sys; print('boom'); sys.exit(3)"
    hang = "import time; time.sleep(60)"
    lines: list = []
    t0 = time.monotonic()
    res = C.run_children([[sys.executable, "-c", ok], [sys.executable, "-c", fail],
                          [sys.executable, "-c", hang]], {"x": 7}, timeout=50,
                         on_line=lambda i, ln: lines.append((i, ln.strip())),
                         fail_grace_s=0.5)
    assert time.monotonic() - t0 < 30
    assert res[0]["ok"] and res[0]["x"] == 7 and res[0]["child_total"]["returncode"] == 0
    assert not res[1]["ok"] and "exit code 3" in res[1]["error"] and "boom" in res[1]["error"]
    assert not res[2]["ok"] and res[2]["child_total"]["returncode"] != 0
    assert (1, "boom") in lines
    one = C.run_child([sys.executable, "-c", ok], {"x": 1}, timeout=50)
    assert one["ok"] and one["x"] == 1


def test_the_cli_and_the_bench_library_start_without_torch(tmp_path):
    env = dict(os.environ, FASTCKPT_NO_PROGRESS="1")
    for args in (["-m", "fastckpt.cli", "ls", str(tmp_path / "x")],
                 ["-m", "fastckpt.cli", "bench", str(tmp_path / "missing")],
                 ["-c", "import fastckpt.bench.common, fastckpt.bench.storage, "
                        "fastckpt.bench.state, fastckpt.cli.benchcmd"]):
        r = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True,
                           text=True, timeout=120, env=env)
        imported = [ln.rsplit("|", 1)[-1].strip() for ln in r.stderr.splitlines()
                    if ln.startswith("import time:")]
        assert imported, r.stderr[-2000:]
        assert not [m for m in imported if m == "torch" or m.startswith("torch.")], args


@pytest.mark.skipif(C.fio_version() is None, reason="fio is not installed")
def test_fio_layouts_report_the_slowest_job_and_every_byte(tmp_path):
    """fio's figure is its own runtime (not the wall clock with its start-up); two jobs at once
    report the group: every byte, and the slowest job's runtime (fio's job_runtime would sum
    the jobs', overstating the time)."""
    size = 32 << 20
    one = C.run_fio(str(tmp_path / "a.dat"), "write", size, bs="1M", iodepth=4, direct=False)
    two = C.run_fio(str(tmp_path / "b.dat"), "write", size, bs="1M", iodepth=4, direct=False,
                    numjobs=2, fallocate="none")
    assert one["ok"] and two["ok"], (one, two)
    assert one["io_bytes"] == two["io_bytes"] == size
    assert sorted(os.listdir(tmp_path)) == ["a.dat", "b.dat.0", "b.dat.1"]
    assert all(os.path.getsize(tmp_path / f"b.dat.{i}") == size // 2 for i in (0, 1))
    assert 0 < two["runtime_s"] <= two["job_runtime_s"]
    assert one["runtime_s"] < one["wall_total_s"]  # its start-up is not counted
