"""The drill's driver: :class:`Drill` runs the reference, then per scenario a job, its
signals, the measurements from the ranks' event logs, ``verify`` and the restart; the
bit-exact comparison (:func:`compare`); :func:`run_drill`, the result as one dict."""

from __future__ import annotations

import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from typing import Any, Callable

from ..tools.sizes import human_bytes
from .launch import LAUNCHERS, Job, Launcher, _read_jsonl
from .options import (DRILL_FORMAT, DRILL_VERSION, HARD_EXTRA_S, MARKER, DrillError,
                      DrillOptions)
from .scenarios import SCENARIOS, Scenario, ScenarioRun

class Drill:
    """Runs the jobs of one drill (see :mod:`fastckpt.drill`'s call sequence)."""

    def __init__(self, opts: DrillOptions, log: Callable[[str], None] | None = None) -> None:
        self.opts = opts
        self.log = log or (lambda s: None)
        self._launcher: Launcher | None = None
        self.live: list[Job] = []

    @property
    def launcher(self) -> Launcher:
        if self._launcher is None:
            self._launcher = LAUNCHERS[self.opts.launcher]()
        return self._launcher

    def job_config(self, where: str, tag: str, **extra: Any) -> dict:
        o = self.opts
        d = os.path.join(o.out_dir, where)
        os.makedirs(d, exist_ok=True)
        job = {"root": os.path.join(d, "ckpt"), "out": d, "tag": tag, "total": o.steps,
               "step_s": o.step_s, "grace_s": o.grace_s, "pad_bytes": o.size_bytes,
               "save_at": [o.save_at], "backend": o.backend}
        job.update(extra)
        return job

    def start(self, job: dict, launcher: Launcher | None = None) -> Job:
        path = os.path.join(job["out"], f"job-{job['tag']}.json")
        with open(path, "w") as f:
            json.dump(job, f, indent=1)
        env = {"PYTHONUNBUFFERED": "1"}
        j = Job(job, (launcher or self.launcher).start(path, self.opts.ranks, env))
        self.live.append(j)
        return j

    def run_to_end(self, job: dict, launcher: Launcher | None = None
                   ) -> tuple[Job, list[int | None]]:
        j = self.start(job, launcher)
        codes = j.wait(time.monotonic() + self.opts.job_timeout_s)
        return j, codes

    def outputs(self, j: Job) -> dict:
        """Per-step losses and final digests of every rank of a finished job."""
        out: dict[str, Any] = {"losses": {}, "final": {}, "resumed": {}}
        for r in range(j.world):
            out["losses"][r] = {x["step"]: x["loss"] for x in _read_jsonl(j.path("steps", r))}
            try:
                with open(j.path("final", r, "json")) as f:
                    out["final"][r] = json.load(f)["tensors"]
            except (FileNotFoundError, ValueError):
                out["final"][r] = None
            try:
                with open(j.path("resumed", r, "json")) as f:
                    out["resumed"][r] = json.load(f).get("start")
            except (FileNotFoundError, ValueError):
                out["resumed"][r] = "unknown"
        return out

    # -- the reference ---------------------------------------------------------------------
    def reference(self) -> dict:
        t0 = time.monotonic()
        self.log(f"reference: {self.opts.steps} steps uninterrupted")
        job = self.job_config("reference", "ref")
        _clear(job["out"])
        j, codes = self.run_to_end(job)
        ref = self.outputs(j)
        ok = codes == [0] * j.world and all(ref["final"].values()) and all(
            sorted(v) == list(range(self.opts.steps)) for v in ref["losses"].values())
        err = None if ok else (f"the reference run failed: exit codes {codes}, hung ranks "
                               f"{j.hung}; log {j.path('log', 0, 'txt')}: {j.log_tail(0)!r}")
        return {"ok": ok, "error": err, "exit_codes": codes,
                "wall_s": round(time.monotonic() - t0, 2), "data": ref}

    # -- one scenario ----------------------------------------------------------------------
    def scenario(self, sc: Scenario, ref: dict) -> ScenarioRun:
        o = self.opts
        t0 = time.monotonic()
        run = ScenarioRun(name=sc.name, summary=sc.summary, window_s=sc.window(o))
        self.log(f"{sc.name}: {sc.summary}")
        job = self.job_config(sc.name, "run", **sc.job(o))
        _clear(job["out"])
        launcher = None
        try:
            launcher = sc.launcher(o)
            j = self.start(job, launcher)
            try:
                j.wait_steps(o.save_at + o.signal_after - 1, time.monotonic() + o.job_timeout_s)
                sc.act(j, o)
            finally:
                run.sent = list(j.sent)
            last_sent = max((s["t"] for s in j.sent), default=time.time())
            budget = run.window_s + HARD_EXTRA_S + o.hang_after_s - (time.time() - last_sent)
            codes = j.wait(time.monotonic() + max(budget, 1.0))
            run.measured.update(j.notes)
            self._measure(run, j, codes)
            if j.hung:
                run.check("no rank hung", False,
                          f"rank(s) {j.hung} still running "
                          f"{run.window_s + HARD_EXTRA_S + o.hang_after_s:g} s after the last "
                          "signal: SIGKILLed")
            self._verify(run, job["root"])
            self._restart(run, job, ref, launcher)
            sc.judge(run, o)
        except DrillError as e:
            more = launcher.diagnose() if launcher is not None else ""
            run.error = str(e) + (f"; {more}" if more else "")
            run.check("the job ran", False, run.error)
        finally:  # a failed scenario leaves nothing running into the next one
            for x in self.live:
                x.kill_all()
            self.live = []
            if launcher is not None:
                launcher.release()
        run.wall_s = round(time.monotonic() - t0, 2)
        self.log(f"{sc.name}: {'pass' if run.passed else 'FAIL'} ({run.wall_s:.1f} s)")
        return run

    def _measure(self, run: ScenarioRun, j: Job, codes: list[int | None]) -> None:
        evs = [j.events(r) for r in range(j.world)]
        sig_ts = [e["signal_time"] for es in evs for e in es if e.get("event") == "signal"]
        sent = [s["t"] for s in j.sent if s["signal"] != "SIGKILL"]
        t0 = min(sig_ts) if sig_ts else (min(sent) if sent else None)
        run.first_signal_t = t0

        def rel(t: float | None) -> float | None:
            return None if t is None or t0 is None else round(t - t0, 4)

        def last(es: list[dict], name: str) -> dict | None:
            xs = [e for e in es if e.get("event") == name]
            return xs[-1] if xs else None

        for r in range(j.world):
            es = evs[r]
            tl: dict[str, Any] = {"signal": [rel(e["signal_time"]) for e in es
                                             if e.get("event") == "signal"]}
            for name in ("consensus", "stop_reached", "decision", "save_start", "save_end",
                         "commit", "barrier", "exit"):
                e = last(es, name)
                if e is not None:
                    tl[name] = rel(e["t"])
            kills = [s for s in j.sent if s["rank"] == r and s["signal"] == "SIGKILL"]
            if kills:
                tl["killed"] = rel(kills[0]["t"])
            proc = j.procs[r]
            tl["gone"] = rel(proc.ended_t)
            cons = last(es, "consensus")
            armed = last(es, "armed") or {}
            sigs = [s for s in j.sent if s["rank"] == r and s["signal"] != "SIGKILL"]
            sig_ev = [e for e in es if e.get("event") == "signal"]
            delivery = (round((sig_ev[0]["signal_time"] - sigs[0]["t"]) * 1e3, 2)
                        if sigs and sig_ev else None)
            save_end = last(es, "save_end")
            ex = last(es, "exit")
            run.ranks.append({
                "rank": r, "pid": proc.pid, "exit_code": codes[r],
                "signals": [e.get("signal") for e in sig_ev],
                "hung": r in j.hung, "timeline": tl, "gone_s": tl["gone"],
                "grace_s": armed.get("grace_s"), "teardown_s": armed.get("teardown_s"),
                "consensus": None if cons is None else {
                    k: cons.get(k) for k in ("stop_step", "reported", "learned_after_s",
                                             "agreed_after_s", "deadline_in_s")},
                "decision": _pick(last(es, "decision"), ("decision", "left_s", "est_save_s",
                                                         "bytes", "inflight_step")),
                "estimate": _pick(last(es, "estimate"), ("bytes", "write_mibps", "est_s",
                                                         "source")),
                "save_s": save_end.get("seconds") if save_end else None,
                "save_bytes": save_end.get("bytes") if save_end else None,
                "commit": _pick(last(es, "commit"), ("step",)),
                "barrier": _pick(last(es, "barrier"), ("ok", "seconds", "missing")),
                "exit_event": _pick(ex, ("code", "reason", "missing", "deadline_in_s")),
                "signal_delivery_ms": delivery,
                "log": j.path("log", r, "txt"),
            })
        cs = [x["consensus"] for x in run.ranks if x["consensus"]]
        m = run.measured
        m["first_signal_t"] = t0
        m["propagation_ms"] = (round(max(c["learned_after_s"] for c in cs) * 1e3, 1)
                               if cs else None)
        m["consensus_ms"] = (round(max(x["timeline"]["consensus"] for x in run.ranks
                                       if x["consensus"]) * 1e3, 1) if cs else None)
        m["stop_step"] = cs[0]["stop_step"] if cs else None
        saves = [x["save_s"] for x in run.ranks if x["save_s"] is not None]
        m["save_s"] = max(saves) if saves else None
        commits = [x["timeline"].get("commit") for x in run.ranks
                   if x["timeline"].get("commit") is not None]
        m["signal_to_commit_s"] = max(commits) if len(commits) == j.world else None
        gone = [x["gone_s"] for x in run.ranks if x["gone_s"] is not None]
        m["signal_to_exit_s"] = max(gone) if gone else None
        decs = sorted({(x["decision"] or {}).get("decision") or "-" for x in run.ranks})
        m["decision"] = "/".join(decs)
        m["exit_codes"] = codes
        m["window_s"] = run.window_s

    def _verify(self, run: ScenarioRun, root: str) -> None:
        from ..tools import describe_steps, verify_step
        recs = describe_steps(root)
        run.measured["step_dirs"] = [r.step for r in recs]
        committed = [r.step for r in recs if r.committed]
        run.measured["committed_steps"] = committed
        run.measured["newest_committed"] = committed[-1] if committed else None
        for step in sorted({self.opts.save_at, *committed[-1:]} & set(committed)):
            try:
                v = verify_step(root, step, record=False)
            except Exception as e:  # noqa: BLE001 - a damaged manifest: this check fails
                run.verify.append({"step": step, "ok": False, "files": 0, "bytes": 0,
                                   "problems": [f"{type(e).__name__}: {e}"]})
                continue
            run.verify.append({"step": step, "ok": v.ok, "files": v.files_checked,
                               "bytes": v.bytes_checked,
                               "problems": [str(p) for p in v.problems][:5]})
        missing = {self.opts.save_at} - set(committed)
        for step in missing:
            run.verify.append({"step": step, "ok": False, "files": 0, "bytes": 0,
                               "problems": [f"step {step} is not committed under {root}"]})

    def _restart(self, run: ScenarioRun, job: dict, ref: dict,
                 launcher: Launcher | None = None) -> None:
        o = self.opts
        rjob = dict(job, tag="restart", grace_s=o.grace_s)
        for k in ("throttle_to_window_s", "throttle_mibps"):
            rjob.pop(k, None)
        if o.tamper:
            rjob["tamper"] = o.tamper
        t0 = time.monotonic()
        j, codes = self.run_to_end(rjob, launcher)
        got = self.outputs(j)
        res: dict[str, Any] = {"exit_codes": codes, "hung": j.hung,
                               "wall_s": round(time.monotonic() - t0, 2)}
        starts = set(got["resumed"].values())
        res["from_step"] = starts.pop() if len(starts) == 1 else sorted(map(str, starts))
        run.restart = res
        if codes != [0] * j.world:
            res["bit_exact"] = False
            res["error"] = (f"the restart exited {codes}; log {j.path('log', 0, 'txt')}: "
                            f"{j.log_tail(0)!r}")
            return
        interrupted = {r: {x["step"]: x["loss"]
                           for x in _read_jsonl(os.path.join(job["out"], f"steps-run-r{r}.jsonl"))}
                       for r in range(j.world)}
        start = res["from_step"] if isinstance(res["from_step"], int) else 0
        res.update(compare(ref, interrupted, got, start, o.steps))


def compare(ref: dict, interrupted: dict, restart: dict, start: int, steps: int) -> dict:
    """Bit-exact comparison of (the interrupted run's steps before ``start`` + the restart's)
    with the reference: every rank's per-step loss (exact float equality) and the SHA-256 of
    every local tensor at the end. Returns ``bit_exact``, ``mismatches`` (first 20, each
    naming the rank and the step or tensor), ``losses_compared``, ``tensors_compared``."""
    mism: list[str] = []
    nl = nt = 0
    for r, want in sorted(ref["losses"].items()):
        got = {s: v for s, v in interrupted.get(r, {}).items() if s < start}
        got.update(restart["losses"].get(r, {}))
        if sorted(got) != list(range(steps)):
            lost = sorted(set(range(steps)) - set(got))
            mism.append(f"rank {r}: steps {lost[:5]}{'...' if len(lost) > 5 else ''} "
                        "missing from the interrupted run + restart")
        for s in range(steps):
            if s in got and s in want:
                nl += 1
                if got[s] != want[s]:
                    mism.append(f"rank {r}: loss at step {s} {got[s]!r} != reference "
                                f"{want[s]!r}")
    for r, want in sorted(ref["final"].items()):
        got = restart["final"].get(r)
        if got is None:
            mism.append(f"rank {r}: the restart wrote no final tensors")
            continue
        for name in sorted(set(want) | set(got)):
            nt += 1
            if name not in got or name not in want:
                mism.append(f"rank {r}: tensor {name} only in the "
                            f"{'reference' if name in want else 'restart'}")
            elif got[name] != want[name]:
                mism.append(f"rank {r}: tensor {name} differs from the reference "
                            f"({got[name]['sha256'][:12]} != {want[name]['sha256'][:12]})")
    return {"bit_exact": not mism, "mismatches": mism[:20], "losses_compared": nl,
            "tensors_compared": nt}


def _pick(e: dict | None, keys: tuple[str, ...]) -> dict | None:
    return None if e is None else {k: e.get(k) for k in keys if k in e}


def _clear(d: str) -> None:
    """Empty a job directory of the drill (only the drill's own subdirectories reach here)."""
    for name in os.listdir(d):
        p = os.path.join(d, name)
        if os.path.isdir(p) and not os.path.islink(p):
            shutil.rmtree(p)
        else:
            os.remove(p)


def prepare_out_dir(out_dir: str) -> None:
    """Create ``out_dir``, or reuse it if empty or an earlier drill's (marked by MARKER);
    ValueError for a directory holding anything else (the drill deletes what it finds in
    its own subdirectories)."""
    if os.path.exists(out_dir):
        if not os.path.isdir(out_dir):
            raise ValueError(f"{out_dir} exists and is not a directory")
        if os.listdir(out_dir) and not os.path.exists(os.path.join(out_dir, MARKER)):
            raise ValueError(f"{out_dir} is not empty and not an earlier drill's output "
                             f"(no {MARKER}): give a new or empty directory")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, MARKER), "w") as f:
        f.write("fastckpt drill output: `fastckpt drill` clears its subdirectories on reuse\n")


def _git_head() -> dict:
    """fastckpt's commit when imported from a git checkout, read from .git (no git run)."""
    from ..bench.common import source_checkout
    top = source_checkout()
    if top is None:
        return {"commit": None, "note": "fastckpt is not imported from a git checkout"}
    g = os.path.join(top, ".git")
    try:
        if os.path.isfile(g):  # a worktree: "gitdir: PATH"
            with open(g) as f:
                g = os.path.join(top, f.read().split(":", 1)[1].strip())
        with open(os.path.join(g, "HEAD")) as f:
            head = f.read().strip()
        if not head.startswith("ref:"):
            return {"commit": head, "ref": None, "checkout": top}
        ref = head.split(":", 1)[1].strip()
        p = os.path.join(g, ref)
        if os.path.exists(p):
            with open(p) as f:
                return {"commit": f.read().strip(), "ref": ref, "checkout": top}
        with open(os.path.join(g, "packed-refs")) as f:
            for line in f:
                parts = line.split()
                if len(parts) == 2 and parts[1] == ref:
                    return {"commit": parts[0], "ref": ref, "checkout": top}
        return {"commit": None, "ref": ref, "checkout": top, "note": "no commit yet"}
    except (OSError, IndexError) as e:
        return {"commit": None, "checkout": top, "note": f"cannot read {g}: {e}"}


def run_drill(opts: DrillOptions, log: Callable[[str], None] | None = None) -> dict:
    """Run the drill; the result (see :mod:`fastckpt.drill`). Never leaves a rank running."""
    from .. import __version__
    from ..bench.common import machine_info, pkg_version, utc_now
    prepare_out_dir(opts.out_dir)
    t0 = time.monotonic()
    drill = Drill(opts, log)
    result: dict[str, Any] = {
        "format": DRILL_FORMAT, "version": DRILL_VERSION, "date": utc_now(),
        "fastckpt_version": __version__, "git": _git_head(),
        "versions": {"python": sys.version.split()[0], "torch": pkg_version("torch")},
        "machine": machine_info(opts.out_dir),
        "options": {**asdict(opts), "scenarios": list(opts.chosen),
                    "size": human_bytes(opts.size_bytes),
                    "short_window_s": opts.short_window},
    }
    runs: list[ScenarioRun] = []
    plan = [(name, SCENARIOS[name], SCENARIOS[name].available()) for name in opts.chosen]
    result["reference"] = None
    try:
        ref = drill.reference() if any(why is None for _, _, why in plan) else None
        if ref is not None:
            result["reference"] = {k: v for k, v in ref.items() if k != "data"}
        for name, sc, why in plan:
            if why is not None:
                drill.log(f"{name}: skipped: {why}")
                runs.append(ScenarioRun(name=name, summary=sc.summary, window_s=None,
                                        skipped=why))
                continue
            assert ref is not None
            if not ref["ok"]:
                run = ScenarioRun(name=name, summary=sc.summary, window_s=sc.window(opts))
                run.error = ref["error"]
                run.check("the reference ran", False, ref["error"])
                runs.append(run)
                continue
            runs.append(drill.scenario(sc, ref["data"]))
    finally:
        for j in drill.live:  # whatever happened (Ctrl-C included): nothing keeps running
            j.kill_all()
    result["scenarios"] = [r.to_json() for r in runs]
    ran = [r for r in runs if not r.skipped]
    # a skipped scenario is not a failure: the drill passed when every scenario it ran passed
    result["passed"] = bool(runs) and all(r.passed for r in ran)
    result["skipped"] = {r.name: r.skipped for r in runs if r.skipped}
    result["wall_s"] = round(time.monotonic() - t0, 2)
    return result

