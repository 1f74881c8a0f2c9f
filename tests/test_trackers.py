"""fastckpt.trackers with real processes and real signals (tests/tracker_worker.py).

W&B runs offline (WANDB_MODE=offline, WANDB_DIR in tmp_path); each test reads the run's own
transaction log (``offline-run-*/run-<id>.wandb``, leveldb-log framed ``wandb.proto`` records,
checksums checked) for the exit record's code, the preempting record, the tags and the history
steps. MLflow writes to a file store in tmp_path (MLFLOW_ALLOW_FILE_STORE=true: MLflow 3 keeps
it behind that switch) and each test reads the run back with ``MlflowClient``.

The preempt-then-resume tests start the worker as a fresh interpreter (``spawn``), so the exit
goes through the interpreter's shutdown and the trackers' own ``atexit`` handlers (MLflow's
would end the run FINISHED); the others fork from the tests' forkserver (``launch``).
"""

from __future__ import annotations

import glob
import json
import os
import signal
import struct
import sys
import time
import zlib

import pytest

from tests import tracker_worker as W

pytestmark = pytest.mark.timeout(180)


# ------------------------------------------------------------------------------------ processes

class _Proc:
    """A worker started by ``spawn`` (Popen) or ``launch`` (multiprocessing), seen alike."""

    def __init__(self, p) -> None:
        self.p = p
        self.pid = p.pid

    def code(self):
        return self.p.poll() if hasattr(self.p, "poll") else self.p.exitcode

    def wait(self, timeout: float) -> int:
        end = time.monotonic() + timeout
        while self.code() is None and time.monotonic() < end:
            time.sleep(0.05)
        if self.code() is None:
            self.p.kill()
            raise AssertionError(f"worker {self.pid} still running after {timeout} s")
        return self.code()


def _start(cfg: dict, world: int = 1, fresh_interpreter: bool = False) -> list[_Proc]:
    if fresh_interpreter:
        assert world == 1
        return [_Proc(W.spawn(cfg))]
    return [_Proc(p) for p in W.launch(world, cfg)]


def _log(cfg: dict, rank: int = 0) -> str:
    try:
        with open(os.path.join(cfg["out"], f"log-{cfg['tag']}-r{rank}.txt"),
                  errors="replace") as f:
            return f.read()[-4000:]
    except OSError:
        return "(no log)"


def _wait_ready(cfg: dict, procs: list[_Proc], timeout: float = 90.0) -> None:
    paths = [os.path.join(cfg["out"], f"ready-{cfg['tag']}-r{r}") for r in range(len(procs))]
    end = time.monotonic() + timeout
    while not all(os.path.exists(p) for p in paths):
        for r, p in enumerate(procs):
            assert p.code() is None, f"rank {r} exited {p.code()} early:\n{_log(cfg, r)}"
        assert time.monotonic() < end, f"ranks not training after {timeout} s:\n{_log(cfg)}"
        time.sleep(0.05)


def _codes(cfg: dict, procs: list[_Proc], timeout: float = 60.0) -> list[int]:
    return [p.wait(timeout) for p in procs]


def _read(cfg: dict, what: str, rank: int = 0) -> dict:
    with open(os.path.join(cfg["out"], f"{what}-{cfg['tag']}-r{rank}.json")) as f:
        return json.load(f)


def _events(root: str, rank: int = 0) -> list[dict]:
    with open(os.path.join(root, "events", f"rank{rank:05d}.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _hooks_finished(root: str, rank: int = 0) -> bool:
    evs = [e for e in _events(root, rank) if e["event"] == "exit_hooks"]
    assert len(evs) == 1, evs
    return evs[0]["finished"]


def _steps(root: str) -> list[int]:
    import fastckpt
    return fastckpt.steps(root)


def _cfg(tmp_path, tag: str, tracker: str, **kw) -> dict:
    cfg = {"root": str(tmp_path / "ckpt"), "out": str(tmp_path / "out"), "tag": tag,
           "tracker": tracker, "step_s": 0.02, "grace_s": 20.0}
    if tracker == "wandb":
        cfg["env"] = {"WANDB_MODE": "offline", "WANDB_DIR": str(tmp_path / "wandb"),
                      "WANDB_CONFIG_DIR": str(tmp_path / "wandb-config"),
                      "WANDB_CACHE_DIR": str(tmp_path / "wandb-cache"),
                      "WANDB_DATA_DIR": str(tmp_path / "wandb-data"), "WANDB_SILENT": "true"}
        os.makedirs(cfg["env"]["WANDB_DIR"], exist_ok=True)
    else:
        cfg["tracking_uri"] = "file://" + str(tmp_path / "mlruns")
        cfg["env"] = {"MLFLOW_ALLOW_FILE_STORE": "true"}
    cfg.update(kw)
    return cfg


# ------------------------------------------------------------------------ W&B's offline records

_BLOCK, _HEADER = 32768, 7  # leveldb log framing of the .wandb transaction log


def _wandb_records(path: str) -> list:
    """Every record of a ``.wandb`` transaction log, parsed with ``wandb.proto``."""
    from wandb.proto import wandb_internal_pb2 as pb
    with open(path, "rb") as f:
        data = f.read()
    assert data[:4] == b":W&B", f"{path}: not a W&B transaction log"
    pos, pending, out = _HEADER, b"", []
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # the block's zero-filled tail
            pos += left
            continue
        crc, n, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if kind == 0 and n == 0:
            break
        chunk = data[pos + _HEADER:pos + _HEADER + n]
        assert zlib.crc32(bytes([kind]) + chunk) & 0xFFFFFFFF == crc, f"{path}: bad record at {pos}"
        pos += _HEADER + n
        if kind == 1:  # full
            out.append(chunk)
        elif kind == 2:  # first
            pending = chunk
        elif kind == 3:  # middle
            pending += chunk
        elif kind == 4:  # last
            out.append(pending + chunk)
    records = []
    for raw in out:
        r = pb.Record()
        r.ParseFromString(raw)
        records.append(r)
    return records


def _wandb_run(path: str) -> dict:
    """What a run's offline log says: its id, tags, history steps, preempting, exit code."""
    info: dict = {"run_id": None, "tags": [], "steps": [], "preempting": False,
                  "exit_code": None, "summary": {}}
    for r in _wandb_records(path):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            info["run_id"] = r.run.run_id
            info["tags"] = list(r.run.tags)
        elif kind == "history":
            info["steps"].append(r.history.step.num)
        elif kind == "preempting":
            info["preempting"] = True
        elif kind == "exit":
            info["exit_code"] = r.exit.exit_code
        elif kind == "summary":
            for u in r.summary.update:
                info["summary"][u.key or "/".join(u.nested_key)] = json.loads(u.value_json)
    return info


def _wandb_runs(cfg: dict) -> list[dict]:
    """The offline runs under the test's WANDB_DIR, oldest first."""
    paths = sorted(glob.glob(os.path.join(cfg["env"]["WANDB_DIR"], "wandb", "offline-run-*",
                                          "run-*.wandb")))
    return [_wandb_run(p) for p in paths]


# ----------------------------------------------------------------------------------------- MLflow

def _mlflow(cfg: dict, monkeypatch):
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow import MlflowClient
    return MlflowClient(tracking_uri=cfg["tracking_uri"])


def _mlflow_runs(client) -> list:
    exp = client.get_experiment_by_name("fastckpt-test")
    return client.search_runs([exp.experiment_id]) if exp is not None else []


# ------------------------------------------------------------------------------------------ W&B

def test_wandb_preempted_then_resumed_continues_the_same_run(tmp_path):
    pytest.importorskip("wandb")
    cfg = _cfg(tmp_path, "a", "wandb")
    procs = _start(cfg, fresh_interpreter=True)
    _wait_ready(cfg, procs)
    os.kill(procs[0].pid, signal.SIGTERM)
    assert _codes(cfg, procs) == [143], _log(cfg)
    assert _hooks_finished(cfg["root"])
    [stop] = _steps(cfg["root"])
    [first] = _wandb_runs(cfg)
    rid = _read(cfg, "started")["run_id"]
    assert first["run_id"] == rid
    assert first["preempting"] and first["exit_code"] == 143, first
    assert first["summary"]["fastckpt/exit"] == "preempted"
    assert first["summary"]["fastckpt/stop_step"] == stop
    assert first["steps"] == list(range(stop)), first["steps"]

    cfg2 = dict(cfg, tag="b", steps=3)
    procs = _start(cfg2, fresh_interpreter=True)
    assert _codes(cfg2, procs) == [0], _log(cfg2)
    assert _read(cfg2, "resumed") == {"step": stop, "run_id": rid}  # from the checkpoint
    runs = _wandb_runs(cfg)
    assert len(runs) == 2
    second = runs[1]
    assert second["run_id"] == rid  # the resumed process logged into the same run
    assert second["steps"] == [stop, stop + 1, stop + 2]
    assert not second["preempting"] and second["exit_code"] == 0, second
    assert second["summary"]["fastckpt/exit"] == "finished"


def test_wandb_cancel_signal_finishes_with_a_cancelled_tag(tmp_path):
    pytest.importorskip("wandb")
    cfg = _cfg(tmp_path, "c", "wandb", cancel_signals=["SIGINT"])
    procs = _start(cfg)
    _wait_ready(cfg, procs)
    os.kill(procs[0].pid, signal.SIGINT)
    assert _codes(cfg, procs) == [0], _log(cfg)
    assert not os.path.exists(os.path.join(cfg["out"], "done-c-r0.json"))  # stopped, not done
    assert _hooks_finished(cfg["root"])
    [stop] = _steps(cfg["root"])
    [run] = _wandb_runs(cfg)
    assert run["exit_code"] == 0 and not run["preempting"], run
    assert "cancelled" in run["tags"], run["tags"]
    assert run["summary"]["fastckpt/exit"] == "cancelled"
    assert run["summary"]["fastckpt/stop_step"] == stop


def test_wandb_failed_emergency_save_finishes_with_exit_code_144(tmp_path):
    pytest.importorskip("wandb")
    cfg = _cfg(tmp_path, "f", "wandb", fail="manifest")
    procs = _start(cfg)
    _wait_ready(cfg, procs)
    os.kill(procs[0].pid, signal.SIGTERM)
    assert _codes(cfg, procs) == [144], _log(cfg)
    assert _steps(cfg["root"]) == []  # nothing could be committed
    assert _hooks_finished(cfg["root"])
    [run] = _wandb_runs(cfg)
    assert run["exit_code"] == 144 and not run["preempting"], run
    assert "cancelled" not in run["tags"]
    assert run["summary"]["fastckpt/exit"] == "failed"


# --------------------------------------------------------------------------------------- MLflow

def test_mlflow_preempted_then_resumed_continues_the_same_run(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    cfg = _cfg(tmp_path, "a", "mlflow")
    procs = _start(cfg, fresh_interpreter=True)
    _wait_ready(cfg, procs)
    os.kill(procs[0].pid, signal.SIGTERM)
    assert _codes(cfg, procs) == [143], _log(cfg)
    assert _hooks_finished(cfg["root"])
    [stop] = _steps(cfg["root"])
    client = _mlflow(cfg, monkeypatch)
    rid = _read(cfg, "started")["run_id"]
    run = client.get_run(rid)
    # KILLED after the interpreter's exit: MLflow's atexit handler did not make it FINISHED
    assert run.info.status == "KILLED", run.info.status
    assert run.data.tags["fastckpt.exit"] == "preempted"
    assert run.data.tags["fastckpt.exit_code"] == "143"
    assert run.data.tags["fastckpt.stop_step"] == str(stop)

    cfg2 = dict(cfg, tag="b", steps=3)
    procs = _start(cfg2, fresh_interpreter=True)
    assert _codes(cfg2, procs) == [0], _log(cfg2)
    assert _read(cfg2, "resumed") == {"step": stop, "run_id": rid}
    assert _read(cfg2, "started") == {"run_id": rid}
    assert [r.info.run_id for r in _mlflow_runs(client)] == [rid]  # no second run
    run = client.get_run(rid)
    assert run.info.status == "FINISHED"
    assert run.data.tags["fastckpt.exit"] == "finished"
    steps = sorted(m.step for m in client.get_metric_history(rid, "loss"))
    assert steps == list(range(stop + 3)), steps  # both processes, no gap, no repeat


def test_mlflow_cancel_signal_finishes_with_a_cancelled_tag(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    cfg = _cfg(tmp_path, "c", "mlflow", cancel_signals=["SIGINT"])
    procs = _start(cfg)
    _wait_ready(cfg, procs)
    os.kill(procs[0].pid, signal.SIGINT)
    assert _codes(cfg, procs) == [0], _log(cfg)
    assert not os.path.exists(os.path.join(cfg["out"], "done-c-r0.json"))
    assert _hooks_finished(cfg["root"])
    [stop] = _steps(cfg["root"])
    client = _mlflow(cfg, monkeypatch)
    run = client.get_run(_read(cfg, "started")["run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["fastckpt.exit"] == "cancelled"
    assert run.data.tags["fastckpt.stop_step"] == str(stop)


def test_mlflow_failed_emergency_save_ends_failed(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    cfg = _cfg(tmp_path, "f", "mlflow", fail="manifest")
    procs = _start(cfg)
    _wait_ready(cfg, procs)
    os.kill(procs[0].pid, signal.SIGTERM)
    assert _codes(cfg, procs) == [144], _log(cfg)
    assert _steps(cfg["root"]) == []
    assert _hooks_finished(cfg["root"])
    client = _mlflow(cfg, monkeypatch)
    run = client.get_run(_read(cfg, "started")["run_id"])
    assert run.info.status == "FAILED"
    assert run.data.tags["fastckpt.exit"] == "failed"
    assert run.data.tags["fastckpt.exit_code"] == "144"
    assert "No space left on device" in run.data.tags["fastckpt.reason"]


def test_two_ranks_one_run_and_every_rank_saves_its_id(tmp_path, monkeypatch):
    """SIGTERM to rank 1 only: both ranks exit 143, rank 0's run is KILLED; a restart on 2
    ranks gets the run id back on *both* ranks from their own saved state, and continues it."""
    pytest.importorskip("mlflow")
    cfg = _cfg(tmp_path, "a", "mlflow")
    procs = _start(cfg, world=2)
    _wait_ready(cfg, procs)
    os.kill(procs[1].pid, signal.SIGTERM)
    assert _codes(cfg, procs) == [143, 143], _log(cfg, 0) + _log(cfg, 1)
    rid = _read(cfg, "started", 0)["run_id"]
    assert _read(cfg, "started", 1) == {"run_id": rid}  # shared by start(), not made on rank 1
    assert _hooks_finished(cfg["root"], 0) and _hooks_finished(cfg["root"], 1)
    client = _mlflow(cfg, monkeypatch)
    assert [r.info.run_id for r in _mlflow_runs(client)] == [rid]  # only rank 0 made a run
    assert client.get_run(rid).info.status == "KILLED"
    [stop] = _steps(cfg["root"])

    cfg2 = dict(cfg, tag="b", steps=3)
    procs = _start(cfg2, world=2)
    assert _codes(cfg2, procs) == [0, 0], _log(cfg2, 0) + _log(cfg2, 1)
    for r in (0, 1):  # each rank's own checkpointed state held the id
        assert _read(cfg2, "resumed", r) == {"step": stop, "run_id": rid}
    assert [r.info.run_id for r in _mlflow_runs(client)] == [rid]
    assert client.get_run(rid).info.status == "FINISHED"
    steps = sorted(m.step for m in client.get_metric_history(rid, "loss"))
    assert steps == list(range(stop + 3)), steps  # logged by rank 0 only: no step twice


# ------------------------------------------------------------------------- without the packages

def test_import_without_the_packages_and_a_clear_error(tmp_path, monkeypatch):
    import fastckpt
    for name in ("wandb", "mlflow", "fastckpt.trackers"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    monkeypatch.setitem(sys.modules, "mlflow", None)
    import importlib
    trackers = importlib.import_module("fastckpt.trackers")
    with fastckpt.Checkpointer(str(tmp_path / "ckpt")) as ck:
        for cls, extra in ((trackers.WandbRun, "wandb"), (trackers.MlflowRun, "mlflow")):
            t = cls()
            with pytest.raises(ImportError, match=rf"pip install 'fastckpt\[{extra}\]'"):
                t.start(ck)
            assert t.run_id is None and ck.on_exit == []  # nothing registered
    monkeypatch.delitem(sys.modules, "fastckpt.trackers")


def test_run_id_is_checkpointed_and_guarded(tmp_path):
    """The id round-trips through a real save and load as plain state; loading another run's
    id into a started tracker, or a W&B id into an MLflow tracker, is refused."""
    import fastckpt
    from fastckpt import trackers
    saved = trackers.MlflowRun()
    saved.run_id = "0123abcd"
    with fastckpt.Checkpointer(str(tmp_path / "ckpt")) as ck:
        ck.save({"tracker": saved, "step": 7}, step=7, block=True)
        assert saved.run_id == "0123abcd"
        fresh = trackers.MlflowRun()
        state = {"tracker": fresh, "step": 0}
        assert ck.resume(state) == 7
        assert fresh.run_id == "0123abcd" and state["tracker"] is fresh
        assert fastckpt.read(str(tmp_path / "ckpt"))["tracker"] == {
            "run_id": "0123abcd", "tracker": "mlflow"}
        with pytest.raises(trackers.TrackerError, match="is a 'mlflow' run, not a 'wandb' run"):
            ck.load({"tracker": trackers.WandbRun(), "step": 0})
    started = trackers.MlflowRun()
    started.run_id, started.rank = "other", 0
    with pytest.raises(trackers.TrackerError, match="call ckpt.resume"):
        started.load_state_dict({"run_id": "0123abcd", "tracker": "mlflow"})
    started.load_state_dict({"run_id": None, "tracker": "mlflow"})  # saved before a start
    assert started.run_id == "other"



def test_an_exception_in_the_with_block_ends_the_run_failed(tmp_path, monkeypatch):
    """In-process, no signal: ``with tracker.start(ckpt):`` left by an exception ends the run
    FAILED (exit code 1) and pops it from MLflow's active runs; a later finish() keeps that."""
    mlflow = pytest.importorskip("mlflow")
    import fastckpt
    from fastckpt import trackers
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)  # restored after the test
    uri = "file://" + str(tmp_path / "mlruns")
    t = trackers.MlflowRun(experiment="fastckpt-test", tracking_uri=uri)
    try:
        with fastckpt.Checkpointer(str(tmp_path / "ckpt")) as ck:
            with pytest.raises(RuntimeError, match="boom"):
                with t.start(ck):
                    t.log({"loss": 1.0}, step=0)
                    raise RuntimeError("boom")
            assert mlflow.active_run() is None
            t.finish()
    finally:
        if mlflow.active_run() is not None:
            mlflow.end_run()
        mlflow.set_tracking_uri(None)
    run = mlflow.MlflowClient(tracking_uri=uri).get_run(t.run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["fastckpt.exit"] == "failed"
    assert run.data.tags["fastckpt.exit_code"] == "1"
    assert t.outcome == "failed"
