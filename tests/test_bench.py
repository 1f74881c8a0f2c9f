"""One benchmark stack: ``fastckpt bench`` and benchmarks/ share ``fastckpt.bench.common`` (sizes,
machine info, cache eviction, child runner, fio, medians) and ``fastckpt.bench.state`` (the
model + Adam state); the bench repeats and interleaves its contenders, reports medians, writes
its report next to its record, and refuses a missing target unless ``--create``. Its loads are
restarts in fresh processes, DCP runs at its default and at 4 threads, and the raw limit is
fio's (its own runtime, best layout) where fio runs.

The runs here are small (a few MiB; one with every contender at 32 MiB, one with 2 ranks) so
that the file takes well under a minute or two.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
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
                        "--contenders", "raw,fastckpt", "--raw", "fastckpt-io",
                        capsys=capsys)
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
    assert rep["orders"] == [{"rep": None, "order": ["raw", "fastckpt"]},
                             {"rep": 0, "order": ["raw", "fastckpt"]},
                             {"rep": 1, "order": ["fastckpt", "raw"]}]
    for row in rep["rows"]:
        assert row["n"] == 2 and len(row["write_s_samples"]) == 2
        assert row["write_s"] == C.median(row["write_s_samples"])
        assert row["read_s"] == C.median(row["read_s_samples"])
        assert row["warmup_write_s"] > 0
        assert row["write_bytes_per_s"] == pytest.approx(row["bytes"] / row["write_s"])
    # the warm-up round saves; loads are restarts in fresh processes, never warmed up
    rows = {r["name"]: r for r in rep["rows"]}
    assert rows["raw"]["warmup_read_s"] > 0 and rows["fastckpt"]["warmup_read_s"] is None
    assert rep["raw_source"] == "fastckpt-io" and "raw=fastckpt-io" in rep["raw_source_reason"]
    assert rows["raw"]["label"] == "raw I/O" and rep["raw_fio"] == []
    assert "not fio: asked for" in out
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
    fck = rep["rows"][1]  # (the slowest repetition's save, as the grace window)
    assert rec["bandwidth_bytes_per_s"]["save"] == fck["bytes"] / max(fck["write_s_samples"])


def test_restart_loads_dcp4_and_the_raw_source(tmp_path, monkeypatch, capsys):
    """Every contender at 32 MiB: each load in a fresh process (not this one) that builds a
    fresh optimizer and loads the saved state bit-exact; DCP at 4 threads next to its default,
    fastckpt rated against the best of them; raw I/O from fio where it runs (its own runtime,
    best of 1- and 2-file layouts), else fastckpt's I/O layer, and the report says which."""
    monkeypatch.setenv("FASTCKPT_NO_PROGRESS", "1")
    rc, out, err = call("bench", str(tmp_path), "--size", "32MiB", "--reps", "1",
                        "--no-warmup", "--png", "", capsys=capsys)
    assert rc == 0, err
    with open(tmp_path / ".fastckpt-bench" / "report.json") as f:
        rep = json.load(f)
    rows = {r["name"]: r for r in rep["rows"]}
    assert list(rows) == ["raw", "fastckpt", "torch", "dcp", "dcp4"]
    assert rows["dcp4"]["dcp_thread_count"] == 4 and rows["dcp"]["dcp_thread_count"] == 1
    assert rep["load_method"].startswith("restart: each load in fresh processes")
    loads = {x["contender"]: x for x in rep["loads"]}
    assert set(loads) == {"fastckpt", "torch", "dcp", "dcp4"}
    for c, x in loads.items():
        assert x["verified"] and x["mismatched"] == [], (c, x)
        assert x["pids"][0] != os.getpid() and len(x["seconds"]) == 1
        assert rows[c]["read_s_samples"] == x["seconds"]  # only the load is timed
        assert x["process_s"][0] > x["seconds"][0] + x["setup_s"][0]
        assert rows[c]["load_fresh_processes"] and rows[c]["load_verified"]
    assert loads["fastckpt"]["loaded_step"] == 1
    sp = rep["fastckpt_speedup"]
    assert set(sp) == {"torch", "dcp", "dcp4", "dcp_best"}
    assert sp["dcp_best"]["save"] == min(sp["dcp"]["save"], sp["dcp4"]["save"])
    assert sp["dcp_best"]["load"] == min(sp["dcp"]["load"], sp["dcp4"]["load"])
    assert "fastckpt vs DCP (4 threads): save" in out and "fastckpt vs the best DCP:" in out
    assert "loads: restarts, in 1 fresh process(es)" in out
    rec = read_bench(str(tmp_path))
    assert rec["raw_source"] == rep["raw_source"] and rec["load_method"]
    for k in ("raw_write", "raw_read", "save", "load"):  # the fields the trigger reads stay
        assert rec["bandwidth_bytes_per_s"][k] > 0 and rec["per_rank_bytes_per_s"][k] > 0
    assert rec["per_rank_bytes_per_s"]["stage"] > 0 and rec["grace"]["seconds"] > 0
    if C.fio_version() is None:
        assert rep["raw_source"] == "fastckpt-io" and "not installed" in rep["raw_source_reason"]
        return
    assert rep["raw_source"] == "fio" and rep["fio_version"] == C.fio_version()
    assert rows["raw"]["label"] == "raw I/O (fio)" and "raw I/O: fio" in out
    (turn,) = rep["raw_fio"]
    tried = {(x["rw"], x["files"], x["fallocate"]) for x in turn["layouts"]}
    assert tried == {("write", 1, "native"), ("write", 1, "none"), ("write", 2, "native"),
                     ("write", 2, "none"), ("read", 1, "native"), ("read", 2, "native")}
    for x in turn["layouts"]:
        assert x["ok"] and x["runtime_s"] < x["wall_total_s"]  # fio's runtime, no start-up
    for k in ("write", "read"):
        best = min((x for x in turn["layouts"] if x["rw"] == k),
                   key=lambda x: x["runtime_s"] / x["io_bytes"])
        assert turn[f"{k}_layout"] == best["layout"]
        assert rows["raw"][f"{k}_s"] == pytest.approx(
            best["runtime_s"] * rows["raw"]["bytes"] / best["io_bytes"])


def test_two_ranks_restart_in_a_new_group(tmp_path, monkeypatch, capsys):
    """--ranks 2: two savers, and for every load two fresh loaders in a new gloo group, each
    loading its shard (DTensors) into a fresh optimizer; the record keeps its per-rank form."""
    monkeypatch.setenv("FASTCKPT_NO_PROGRESS", "1")
    args = ("bench", str(tmp_path), "--size", "8MiB", "--ranks", "2", "--reps", "1",
            "--no-warmup", "--contenders", "fastckpt,torch", "--png", "")
    rc, out, err = call(*args, "--json", capsys=capsys)
    assert rc == 0, err
    rep = json.loads(out)
    assert rep["ranks"] == 2 and len(rep["loads"]) == 2
    for x in rep["loads"]:
        assert x["verified"] and len(x["seconds"]) == 2 and len(set(x["pids"])) == 2
    first = read_bench(str(tmp_path))
    assert first["ranks"] == 2
    assert first["per_rank_bytes_per_s"]["save"] == pytest.approx(
        first["bandwidth_bytes_per_s"]["save"] / 2)


def test_raw_fio_is_refused_where_fio_cannot_run(tmp_path, capsys):
    rc, _, err = call("bench", "memory://fb-raw", "--size", "4MiB", "--contenders", "raw",
                      "--raw", "fio", "--no-record", "--report", "", "--png", "",
                      capsys=capsys)
    assert rc == 2 and "fio measures local paths only" in err
    rc, out, err = call("bench", "memory://fb-raw", "--size", "4MiB", "--contenders", "raw",
                        "--reps", "1", "--no-warmup", "--no-record", "--report", "",
                        "--png", "", capsys=capsys)
    assert rc == 0, err
    assert "raw I/O: fastckpt's I/O layer (not fio: fio measures local paths only" in out


def test_explicit_report_outside_the_target_says_it_replaced(tmp_path, capsys):
    target = tmp_path / "t"
    target.mkdir()
    dest = tmp_path / "out.json"
    dest.write_text("an older file\n")
    rc, out, err = call("bench", str(target), "--size", "4MiB", "--reps", "1", "--no-warmup",
                        "--contenders", "raw", "--report", str(dest), "--png", "",
                        "--no-record", "--raw", "fastckpt-io", capsys=capsys)
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


def test_memory_needed_counts_the_staging_buffer_and_the_fresh_loaders():
    assert B.memory_needed(100, ("raw",)) == 110
    assert B.memory_needed(100, ("fastckpt",)) == 310  # state, staging, the loaders' state
    assert B.memory_needed(100, B.CONTENDERS) == 410  # + torch.load's copy in its loaders


def test_summarize_rates_fastckpt_against_the_best_dcp_per_phase():
    times = {"fastckpt save": [1.0], "fastckpt load": [1.0], "dcp save": [4.0],
             "dcp load": [2.0], "dcp4 save": [3.0], "dcp4 load": [2.5]}
    raw = {"target": "memory://x", "size": 100, "ranks": 1, "reps": 1, "warmup": False,
           "contenders": ["fastckpt", "dcp", "dcp4"], "started_unix": time.time(),
           "per_rank": [{"times": times, "warmup": {}, "state_bytes": 100, "orders": []}]}
    sp = B.summarize(raw)["fastckpt_speedup"]
    assert sp["dcp"] == {"save": 4.0, "load": 2.0} and sp["dcp4"] == {"save": 3.0, "load": 2.5}
    assert sp["dcp_best"] == {"save": 3.0, "load": 2.0, "save_by": "dcp4", "load_by": "dcp"}


def test_summarize_pairs_the_ratios_by_repetition_and_sizes_the_window_for_the_slowest():
    # fastckpt slow in the repetition where fio was fast: the paired ratios' median differs
    # from the ratio of the medians (before 2026-12-06 the report divided medians)
    times = {"raw write": [0.46, 0.58, 0.55], "raw read": [1.0, 1.0, 1.0],
             "fastckpt save": [0.66, 0.74, 0.59], "fastckpt load": [1.0, 1.0, 1.0],
             "dcp save": [1.0, 2.0, 1.5], "dcp load": [2.0, 2.0, 2.0],
             "dcp4 save": [2.0, 1.0, 1.2], "dcp4 load": [3.0, 3.0, 3.0]}
    raw = {"target": "memory://x", "size": 100, "ranks": 1, "reps": 3, "warmup": False,
           "contenders": ["raw", "fastckpt", "dcp", "dcp4"], "started_unix": time.time(),
           "per_rank": [{"times": times, "warmup": {}, "state_bytes": 100, "raw_bytes": 100,
                         "orders": []}]}
    rep = B.summarize(raw, state_size=100)
    row = {r["name"]: r for r in rep["rows"]}["fastckpt"]
    paired = sorted(a / b for a, b in zip(times["raw write"], times["fastckpt save"]))[1]
    assert row["write_vs_raw"] == pytest.approx(paired)  # 0.78, not 0.55 / 0.66 = 0.83
    assert row["write_vs_raw"] != pytest.approx(0.55 / 0.66)
    best = sorted(min(a, b) / f for a, b, f in zip(times["dcp save"], times["dcp4 save"],
                                                   times["fastckpt save"]))[1]
    assert rep["fastckpt_speedup"]["dcp_best"]["save"] == pytest.approx(best)
    assert rep["grace"]["save_bytes_per_s"] == pytest.approx(100 / 0.74)  # the slowest save


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
        assert "def parse_size" not in src and not re.search(r"\b_common\b", src), name
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


def test_plan_step_benchmark_runs_the_real_marking_at_the_70b_geometry(tmp_path):
    """``bench_plan_step.py`` at rank 5 of 8 (fake process group, meta tensors): every FSDP2
    box is this rank's alone; under HSDP (2 replicas x 4 shards) the rank writes some of its
    replicated boxes, not all, and not none."""
    out = tmp_path / "plan-step.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_plan_step.py"),
                        "--world", "8", "--replicas", "2", "--reps", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    doc = json.load(open(out))
    fsdp, hsdp = doc["layouts"]["fsdp"], doc["layouts"]["hsdp"]
    assert fsdp["tensors"] == 2892 and fsdp["dtensors"] == 2169
    assert fsdp["solo"] == fsdp["writes"] == 2169
    assert hsdp["solo"] == 2169 and 0 < hsdp["writes"] < 2169, hsdp
    assert all(v > 0 for v in fsdp["ms"].values()) and doc["git"]


def test_index_select_benchmark_places_the_70b_boxes_at_another_world_size(tmp_path):
    """``bench_index_select.py`` 64 -> 32 ranks: under FSDP2 the middle restarted rank reads
    the 2 indexes its rows are in, and under 8 pipeline stages the 2 of its stage's block; under
    HSDP and FSDP2 + TP (strided) it reads some, never every one (64) nor none."""
    out = tmp_path / "index-select.json"
    r = subprocess.run([sys.executable, os.path.join(REPO, "benchmarks", "bench_index_select.py"),
                        "--saved", "64", "--restarted", "32", "--reps", "1", "--json", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=REPO)
    assert r.returncode == 0, r.stderr
    doc = json.load(open(out))["layouts"]
    assert doc["fsdp"]["indexes_read"] == 2 and doc["fsdp"]["boxes"] == 2169, doc
    for name in ("hsdp", "fsdp_tp"):
        assert 0 < doc[name]["indexes_read"] < 64, doc
    assert doc["fsdp_tp"]["restarted_mesh"] == [4, 8]
    # stage 4 of 8, saved on ranks 32-39: its rank's rows in 2 of them
    assert doc["fsdp_pp"]["indexes_read"] == 2 and 32 <= doc["fsdp_pp"]["ranks"][0]
    assert doc["fsdp_pp"]["ranks"][1] < 40, doc["fsdp_pp"]
