"""``fastckpt drill``: real jobs (2 gloo ranks on CPU), real signals, real restarts.

The full default drill runs once through the CLI (with the ``slurm`` scenario when the
caller's environment reaches a Slurm cluster); the other multi-process tests run one scenario
each through :func:`fastckpt.drill.run_drill`, ``slurm`` on the cluster of
``scripts/slurm.sh`` (the ``slurm`` fixture). Nothing here asserts speed: only outcomes, the
order of events and that the measurements are plausible numbers.
"""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from fastckpt import drill as D
from tests.clirun import call
from tests.slurmcluster import slurm  # noqa: F401 - the fixture

SCENARIOS = ("one-rank", "staggered", "peer-killed", "short-window")
EXPECTED_CODES = {"one-rank": [143, 143], "staggered": [143, 143], "peer-killed": [144, -9],
                  "short-window": [143, 143], "slurm": [143, 143]}
EXPECTED_DECISION = {"one-rank": "save", "staggered": "save", "peer-killed": "save",
                     "short-window": "skip", "slurm": "save"}


def _check_plausible(s: dict, opts: dict) -> None:
    """Ordering and ranges of one scenario's measurements (no timing thresholds)."""
    name, m = s["name"], s["measured"]
    assert [x["exit_code"] for x in s["ranks"]] == EXPECTED_CODES[name], s["ranks"]
    assert m["first_signal_t"] is not None
    assert m["decision"] == EXPECTED_DECISION[name], m
    assert m["stop_step"] is not None and m["stop_step"] > opts["save_at"], m
    assert 0 <= m["propagation_ms"] <= m["consensus_ms"], m
    for x in s["ranks"]:
        tl = x["timeline"]
        c = x["consensus"]
        assert c["stop_step"] == m["stop_step"], (name, x)
        # the rank learned of the stop after the first signal and agreed after it learned
        assert 0 <= c["learned_after_s"] <= c["agreed_after_s"], (name, x)
        assert 0 <= tl["consensus"] <= tl["stop_reached"] <= tl["decision"], (name, tl)
        if x["exit_code"] == -signal.SIGKILL:
            assert tl["killed"] >= tl["save_start"] >= tl["decision"], (name, tl)
            assert "exit" not in tl, (name, tl)
            continue
        assert tl["decision"] <= tl["exit"] <= tl["gone"], (name, tl)
        assert x["exit_event"]["code"] == x["exit_code"], (name, x)
        if name != "peer-killed" and name != "short-window":
            assert tl["save_start"] <= tl["save_end"] <= tl["commit"] <= tl["exit"], (name, tl)
            assert x["commit"]["step"] == m["stop_step"]
            assert 0 < x["save_s"] < s["window_s"], (name, x)
            assert x["save_bytes"] >= opts["size_bytes"], (name, x)
            d = x["decision"]
            assert d["est_save_s"] <= d["left_s"], (name, d)
    if name == "short-window":
        for x in s["ranks"]:
            d = x["decision"]
            assert d["decision"] == "skip" and d["est_save_s"] > d["left_s"], (name, d)
            assert "save_start" not in x["timeline"]
    # the restart: from the stop step where it was committed, else from the step before (a
    # victim whose write got through before the SIGKILL landed may leave the stop committed)
    r = s["restart"]
    want = {"short-window": [opts["save_at"]], "peer-killed": [opts["save_at"], m["stop_step"]]
            }.get(name, [m["stop_step"]])
    assert r["from_step"] in want and r["from_step"] == m["newest_committed"], (name, r, m)
    assert r["exit_codes"] == [0, 0], r
    assert r["bit_exact"] is True, r
    assert r["losses_compared"] == opts["steps"] * opts["ranks"], r
    assert r["tensors_compared"] >= 2 * 3 * 3, r  # 3 Linear layers x (weight, bias) x (p, m, v)
    v = {x["step"]: x for x in s["verify"]}
    assert v[opts["save_at"]]["ok"], v
    if name in ("one-rank", "staggered", "slurm"):
        assert v[m["stop_step"]]["ok"] and v[m["stop_step"]]["bytes"] >= \
            2 * opts["size_bytes"], v
    if name == "slurm":
        _check_slurm(s)


def _check_slurm(s: dict) -> None:
    """What the slurm scenario measured of Slurm itself."""
    m, sl = s["measured"], s["measured"]["slurm"]
    assert s["window_s"] == sl["kill_wait_s"] > 0, sl  # scancel's window is KillWait
    assert all(x["signals"] == ["SIGTERM"] for x in s["ranks"]), s["ranks"]
    # the driver's scancel comes before each rank's SIGTERM (both Unix times, one host)
    assert all(x["signal_delivery_ms"] > 0 for x in s["ranks"]), s["ranks"]
    assert sl["scancel_to_signal_ms"] == max(x["signal_delivery_ms"] for x in s["ranks"])
    assert sl["scancel_t"] < m["first_signal_t"], sl
    assert sl["state"].startswith("CANCELLED by ") and sl["requeued"] is False, sl
    assert [r["State"] for r in sl["sacct"]] == [sl["state"]], sl
    assert sl["srun_task_codes"] == {"0": "143", "1": "143"}, sl
    assert [(x["code"], x["how"], x["no_exit_record"]) for x in sl["exit_records"]] == \
        [(143, "SystemExit", False)] * 2, sl
    assert sl["restart_job_id"] != sl["job_id"] and sl["restart_state"] == "COMPLETED", sl
    assert sl["queue_wait_s"] >= 0 and sl["restart_queue_wait_s"] >= 0, sl
    assert sl["submit_to_steps_s"] > 0 and sl["restart_submit_to_steps_s"] > 0, sl
    checks = {c["check"]: c["ok"] for c in s["checks"]}
    assert all(x["timeline"]["exit"] < x["gone_s"] < s["window_s"] for x in s["ranks"])
    for name in ("Slurm's SIGTERM reached every rank", "every rank gone before KillWait's SIGKILL",
                 "sacct: the job CANCELLED, not requeued",
                 "srun: every task exited with the rank's code",
                 "the supervisor did not requeue the cancelled job",
                 "the restart: a fresh sbatch of the same script, COMPLETED"):
        assert checks.get(name) is True, (name, s["checks"])


@pytest.mark.timeout(900)
def test_full_default_drill(tmp_path, capsys):
    out = tmp_path / "drill"
    code, stdout, err = call("drill", str(out), capsys=capsys)
    assert code in (0, 1), err[-3000:]
    doc = json.loads((out / "drill.json").read_text())
    png = (out / "drill.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000
    assert doc["format"] == "fastckpt-drill" and doc["version"] == 1
    assert doc["date"] and doc["fastckpt_version"] and doc["machine"]["nproc"] >= 1
    assert doc["versions"]["torch"] and "commit" in doc["git"]
    opts = doc["options"]
    assert opts["ranks"] == 2 and opts["size_bytes"] == 32 << 20 and opts["grace_s"] == 10
    assert doc["reference"]["ok"] and doc["reference"]["exit_codes"] == [0, 0]
    # slurm is in the default drill when (and only when) a cluster answers here
    names = SCENARIOS + (("slurm",) if D.slurm_unavailable() is None else ())
    assert [s["name"] for s in doc["scenarios"]] == list(names) == opts["scenarios"]
    # the matrix: one row per scenario, with its result and exit codes
    rows = {line.split()[0]: line for line in stdout.splitlines()
            if len(line.split()) > 2 and line.split()[0] in names}
    assert set(rows) == set(names), stdout
    for s in doc["scenarios"]:
        assert ("pass" if s["passed"] else "FAIL") in rows[s["name"]].split()
        assert " ".join(map(str, EXPECTED_CODES[s["name"]])) in rows[s["name"]]
        _check_plausible(s, opts)
    fails = {f"{s['name']}: {c['check']}" for s in doc["scenarios"] for c in s["checks"]
             if not c["ok"]}
    assert not fails, fails
    assert code == 0 and doc["passed"], stdout


@pytest.mark.timeout(300)
def test_a_restart_that_is_not_bit_exact_fails(tmp_path):
    """Every restart moves one parameter by one ulp after loading: the drill must say so."""
    res = D.run_drill(D.DrillOptions(out_dir=str(tmp_path / "d"), scenarios=("one-rank",),
                                     size_bytes=1 << 20, tamper="param-ulp"))
    assert not res["passed"]
    (s,) = res["scenarios"]
    assert not s["passed"]
    failed = [c["check"] for c in s["checks"] if not c["ok"]]
    assert failed == ["restart bit-exact"], s["checks"]
    r = s["restart"]
    assert r["bit_exact"] is False and r["exit_codes"] == [0, 0]
    assert any("tensor param/" in x for x in r["mismatches"]), r["mismatches"]
    assert D.matrix_rows(res)[0][1] == "FAIL" and D.matrix_rows(res)[0][-1].startswith("NO")
    assert any(line.startswith("one-rank: restart bit-exact: ") for line in D.failures(res))


class _Freeze(D.Scenario):
    """A test scenario (and the registration a later ``slurm`` scenario uses): SIGSTOP every
    rank, so the job never ends by itself."""

    name = "test-freeze"
    summary = "every rank SIGSTOPped: the drill must kill the job and report it, not hang"

    def act(self, job, opts):
        for r in range(job.world):
            job.signal(r, signal.SIGSTOP)


@pytest.mark.timeout(300)
def test_a_hung_job_is_killed_and_reported(tmp_path):
    D.register(_Freeze())
    try:
        res = D.run_drill(D.DrillOptions(out_dir=str(tmp_path / "d"),
                                         scenarios=("test-freeze",), size_bytes=1 << 20,
                                         grace_s=2.0, hang_after_s=1.0))
    finally:
        D.SCENARIOS.pop("test-freeze", None)
    (s,) = res["scenarios"]
    assert not res["passed"] and not s["passed"]
    hung = [c for c in s["checks"] if c["check"] == "no rank hung"]
    assert hung and not hung[0]["ok"] and "SIGKILLed" in hung[0]["detail"], s["checks"]
    assert [x["exit_code"] for x in s["ranks"]] == [-signal.SIGKILL] * 2
    assert all(x["hung"] for x in s["ranks"])
    # the committed checkpoint from before the freeze still restarts bit-exact
    assert s["restart"]["from_step"] == 4 and s["restart"]["bit_exact"], s["restart"]


@pytest.mark.timeout(300, func_only=True)
def test_slurm_scancel_then_a_fresh_sbatch_restarts_bit_exact(slurm, tmp_path, monkeypatch):
    """The job submitted as `fastckpt slurm` prints it, scancelled once every rank trained:
    Slurm's SIGTERM on every rank, the stop step committed within KillWait, 143 everywhere
    (the ranks' records and srun's report), sacct CANCELLED and not requeued; a fresh sbatch
    of the same script resumes from the stop step and ends bit-exact with the reference."""
    monkeypatch.setenv("SLURM_CONF", slurm.conf)
    assert D.slurm_unavailable() is None
    assert D.default_scenarios() == SCENARIOS + ("slurm",)
    out = tmp_path / "d"
    res = D.run_drill(D.DrillOptions(out_dir=str(out), scenarios=("slurm",),
                                     size_bytes=8 << 20))
    (s,) = res["scenarios"]
    fails = [c for c in s["checks"] if not c["ok"]]
    assert not fails and s["error"] is None, (fails, s["error"])
    assert res["passed"] and s["passed"] and res["skipped"] == {}
    _check_plausible(s, res["options"])
    sl = s["measured"]["slurm"]
    # accounting as the fixture reads it, independently of the drill
    first = [r for r in slurm.sacct(int(sl["job_id"])) if r["JobID"] == sl["job_id"]]
    assert [r["State"] for r in first] == ["CANCELLED by 0"], first
    again = [r for r in slurm.sacct(int(sl["restart_job_id"]))
             if r["JobID"] == sl["restart_job_id"]]
    assert [(r["State"], r["ExitCode"]) for r in again] == [("COMPLETED", "0:0")], again
    # both runs were the same script, submitted twice; nothing of the drill is left in Slurm
    script = (out / "slurm" / "job.sbatch").read_text()
    assert "exec fastckpt resume " in script and "--ntasks-per-node=2" in script
    assert "-m fastckpt.drill.worker --task " in script
    for job in (sl["job_id"], sl["restart_job_id"]):
        assert slurm.state(int(job)) in ("CANCELLED", "COMPLETED"), job
    # the matrix row and the line under it
    text = D.format_matrix(res)
    row = [ln for ln in text.splitlines() if ln.startswith("slurm ")]
    assert row and "pass" in row[0].split() and "143 143" in row[0], text
    assert f"slurm: job {sl['job_id']} (main, 2 srun tasks) queued " in text, text
    assert "sacct CANCELLED by 0, not requeued" in text, text


def _no_slurm(monkeypatch, tmp_path, how):
    if how == "no sinfo":  # nothing named sinfo on PATH (the venv's bin is no Slurm client)
        monkeypatch.setenv("PATH", str(tmp_path / "empty-bin"))
        monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))
        return "no Slurm cluster answers (sinfo: not found on PATH)"
    if shutil.which("sinfo") is None:
        pytest.skip("no sinfo on PATH")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "missing.conf"))  # sinfo retries it 60 s
    return "no Slurm cluster answers (sinfo: no answer within 5 s; error: s_p_parse_file: " \
           f"cannot stat file {tmp_path / 'missing.conf'}"


@pytest.mark.parametrize("how", ["no sinfo", "no slurm.conf"])
def test_slurm_is_skipped_without_a_cluster(tmp_path, monkeypatch, capsys, how):
    want = _no_slurm(monkeypatch, tmp_path, how)
    why = D.slurm_unavailable()
    assert why is not None and why.startswith(want), why
    assert D.default_scenarios() == SCENARIOS
    assert D.DrillOptions(out_dir=str(tmp_path / "x")).chosen == SCENARIOS
    code, out, err = call("drill", str(tmp_path / "d"), "--scenario", "slurm", capsys=capsys)
    assert code == 0, (out, err)  # skipped is not a failure
    row = [ln.split() for ln in out.splitlines() if ln.startswith("slurm ")]
    assert row == [["slurm", "skipped"] + ["-"] * 7], out
    assert f"slurm: skipped: {why}\n" in out, out
    assert "0 of 0 scenario(s) passed (1 skipped)" in out, out
    doc = json.loads((tmp_path / "d" / "drill.json").read_text())
    assert doc["passed"] is True and doc["skipped"] == {"slurm": why}
    assert doc["reference"] is None  # nothing ran
    (s,) = doc["scenarios"]
    assert s["skipped"] == why and s["passed"] is None and not s["checks"] and not s["ranks"]


@pytest.mark.timeout(300)
def test_a_skipped_scenario_beside_one_that_runs(tmp_path, monkeypatch):
    _no_slurm(monkeypatch, tmp_path, "no sinfo")
    res = D.run_drill(D.DrillOptions(out_dir=str(tmp_path / "d"), size_bytes=1 << 20,
                                     scenarios=("slurm", "one-rank")))
    assert res["passed"] and res["reference"]["ok"], D.failures(res)
    assert [(s["name"], s["passed"], bool(s["skipped"])) for s in res["scenarios"]] == \
        [("slurm", None, True), ("one-rank", True, False)]
    assert [r[:2] for r in D.matrix_rows(res)] == [["slurm", "skipped"], ["one-rank", "pass"]]
    assert D.format_matrix(res).splitlines()[-1] == \
        "slurm: skipped: no Slurm cluster answers (sinfo: not found on PATH)"


def test_srun_task_codes():
    log = ("srun: Job step aborted: Waiting up to 12 seconds for job step to finish.\n"
           "srun: error: vm: tasks 0-1,3: Exited with exit code 143\n"
           "srun: error: vm: task 2: Killed\n")
    assert D.srun_task_codes(log) == {0: "143", 1: "143", 3: "143", 2: "Killed"}
    assert D.srun_task_codes("fastckpt: srun exited 0\n") == {}


def test_compare_names_the_first_differing_loss_and_tensor():
    dg = {"sha256": "a" * 64, "dtype": "float32", "shape": [2]}
    ref = {"losses": {0: {0: 1.0, 1: 0.5, 2: 0.25}, 1: {0: 1.0, 1: 0.5, 2: 0.25}},
           "final": {0: {"param/w": dg}, 1: {"param/w": dg}}}
    restart = {"losses": {0: {1: 0.5, 2: 0.25}, 1: {1: 0.5, 2: 0.25}},
               "final": {0: {"param/w": dg}, 1: {"param/w": dg}}}
    interrupted = {0: {0: 1.0, 1: 0.5}, 1: {0: 1.0, 1: 0.5}}
    ok = D.compare(ref, interrupted, restart, 1, 3)
    assert ok["bit_exact"] and ok["losses_compared"] == 6 and ok["tensors_compared"] == 2
    off = dict(restart, losses={0: {1: 0.5, 2: 0.25 + 2 ** -40}, 1: restart["losses"][1]})
    bad = D.compare(ref, interrupted, off, 1, 3)
    assert not bad["bit_exact"] and bad["mismatches"] == [
        f"rank 0: loss at step 2 {0.25 + 2 ** -40!r} != reference 0.25"]
    other = dict(restart, final={0: {"param/w": dict(dg, sha256="b" * 64)}, 1: {}})
    bad = D.compare(ref, interrupted, other, 1, 3)
    assert "rank 0: tensor param/w differs from the reference (bbbbbbbbbbbb != aaaaaaaaaaaa)" \
        in bad["mismatches"]
    assert "rank 1: tensor param/w only in the reference" in bad["mismatches"]
    # a restart from the wrong step: the steps between are missing
    gap = D.compare(ref, {0: {0: 1.0}, 1: {0: 1.0}}, restart, 0, 3)
    assert not gap["bit_exact"]
    assert gap["mismatches"][0] == "rank 0: steps [0] missing from the interrupted run + restart"



@pytest.mark.parametrize("args,needle", [
    (["--ranks", "1"], "--ranks"),
    (["--scenario", "nope"], "unknown scenario(s) ['nope']"),
    (["--steps", "8"], "steps=8 leaves no room"),
    (["--size", "lots"], "not a size"),
    (["--launcher", "ssh"], "--launcher"),
])
def test_usage_errors(tmp_path, capsys, args, needle):
    code, out, err = call("drill", str(tmp_path / "d"), *args, capsys=capsys)
    assert code == 2, (out, err)
    assert needle in err, err
    assert not (tmp_path / "d").exists() or not os.listdir(tmp_path / "d")


def test_out_dir_of_something_else_is_refused(tmp_path, capsys):
    d = tmp_path / "mine"
    d.mkdir()
    (d / "precious.txt").write_text("x")
    code, out, err = call("drill", str(d), "--scenario", "one-rank", capsys=capsys)
    assert code == 2 and "is not empty and not an earlier drill's output" in err, err
    assert (d / "precious.txt").read_text() == "x"


def test_json_to_stdout_on_usage_error(tmp_path, capsys):
    code, out, err = call("drill", str(tmp_path / "d"), "--ranks", "1", capsys=capsys)
    assert code == 2  # click rejects it before --json is seen; the message is on stderr
    code, out, err = call("drill", str(tmp_path / "d"), "--scenario", "x", "--json", "-",
                          capsys=capsys)
    assert code == 2
    doc = json.loads(out)
    assert doc["ok"] is False and doc["exit_code"] == 2 and "unknown scenario" in doc["error"]
