"""Scenarios: :class:`Scenario` (a way to preempt the job and what must then hold), the
registry (:data:`SCENARIOS`, :func:`register`, :func:`default_scenarios`), a scenario's
outcome (:class:`ScenarioRun`) and the built-in ``one-rank``, ``staggered``, ``peer-killed``
and ``short-window`` with the checks they share (``slurm``: :mod:`fastckpt.drill.slurm`)."""

from __future__ import annotations

import random
import signal
import time
from dataclasses import asdict, dataclass, field

from .launch import Job, Launcher
from .options import EXIT_FAILED, EXIT_PREEMPTED, HARD_EXTRA_S, SIGKILL, DrillOptions

class Scenario:
    """A way to preempt the job and what must then hold. Subclass, set ``name`` and
    ``summary``, override ``act`` (and ``job``, ``judge``, ``launcher`` as needed), then
    :func:`register` it; ``fastckpt drill --scenario NAME`` runs it.

    Call sequence (the driver, per run of the scenario): ``job(opts)`` -> overrides of the job
    config; ``launcher(opts)`` -> None (the drill's) or a :class:`Launcher`; the ranks start;
    ``act(job, opts)`` once every rank trained past the checkpoint at ``save_at``: send the
    signals with ``job.signal(rank, sig)`` (the sending time is recorded), watch events with
    ``job.wait_event``; the driver waits for the exit, measures, verifies and restarts (with
    the scenario's launcher); then ``judge(run, opts)`` appends checks with
    ``run.check(name, ok, detail)``. ``window(opts)`` is the scenario's grace window.
    ``available()`` (before anything runs): None, or the reason it is skipped."""

    name = ""
    summary = ""
    #: run it by default (``fastckpt drill`` without ``--scenario``) when ``available()``
    #: says so; the scenarios of DEFAULT_SCENARIOS always run by default
    default_when_available = False

    def available(self) -> str | None:
        """None when the scenario can run here, else why not: the scenario is then reported
        as skipped (not a failure) and left out of the default list."""
        return None

    def job(self, opts: DrillOptions) -> dict:
        return {}

    def launcher(self, opts: DrillOptions) -> Launcher | None:
        return None

    def window(self, opts: DrillOptions) -> float:
        return opts.grace_s

    def act(self, job: Job, opts: DrillOptions) -> None:
        raise NotImplementedError

    def judge(self, run: "ScenarioRun", opts: DrillOptions) -> None:
        pass


SCENARIOS: dict[str, Scenario] = {}
#: the scenarios every default drill runs; :func:`default_scenarios` adds the registered
#: ones with ``default_when_available`` that are available here (``slurm``)
DEFAULT_SCENARIOS: tuple[str, ...] = ("one-rank", "staggered", "peer-killed", "short-window")


def default_scenarios() -> tuple[str, ...]:
    """The scenarios of a drill without ``--scenario``: DEFAULT_SCENARIOS, then every
    registered scenario with ``default_when_available`` whose ``available()`` is None."""
    extra = tuple(n for n, sc in SCENARIOS.items() if n not in DEFAULT_SCENARIOS
                  and sc.default_when_available and sc.available() is None)
    return DEFAULT_SCENARIOS + extra


def register(scenario: Scenario) -> Scenario:
    """Add a scenario (a later registration of the same name replaces the earlier)."""
    if not scenario.name:
        raise ValueError("a scenario needs a name")
    SCENARIOS[scenario.name] = scenario
    return scenario


@dataclass
class ScenarioRun:
    """A scenario's outcome as it is built: measurements, per-rank data and checks."""

    name: str
    summary: str
    window_s: float | None
    checks: list[dict] = field(default_factory=list)
    measured: dict = field(default_factory=dict)
    ranks: list[dict] = field(default_factory=list)
    sent: list[dict] = field(default_factory=list)
    restart: dict = field(default_factory=dict)
    verify: list[dict] = field(default_factory=list)
    error: str | None = None
    wall_s: float = 0.0
    first_signal_t: float | None = None
    skipped: str | None = None  # why the scenario did not run (not a failure)

    def check(self, name: str, ok: bool, detail: str = "") -> bool:
        self.checks.append({"check": name, "ok": bool(ok), "detail": detail})
        return bool(ok)

    @property
    def passed(self) -> bool:
        return self.error is None and bool(self.checks) and all(c["ok"] for c in self.checks)

    def rank(self, r: int) -> dict:
        return self.ranks[r]

    def to_json(self) -> dict:
        d = asdict(self)
        d["passed"] = None if self.skipped else self.passed
        return d


class OneRank(Scenario):
    name = "one-rank"
    summary = ("SIGTERM to one rank (the last) only: every rank learns of it out of band, all "
               "stop at one step, commit it, exit 143; the restart from it is bit-exact")

    def act(self, job: Job, opts: DrillOptions) -> None:
        job.signal(job.world - 1, signal.SIGTERM)

    def judge(self, run: ScenarioRun, opts: DrillOptions) -> None:
        judge_committed_stop(run, opts, signalled=[len(run.ranks) - 1])


class Staggered(Scenario):
    name = "staggered"
    summary = ("SIGTERM to every rank in a random order, 50-200 ms apart: one stop step, "
               "committed, exit 143 everywhere; the deadline counts from the first signal; "
               "restart bit-exact")

    def act(self, job: Job, opts: DrillOptions) -> None:
        rng = random.Random(opts.seed)
        order = list(range(job.world))
        rng.shuffle(order)
        for i, r in enumerate(order):
            if i:
                time.sleep(rng.uniform(0.05, 0.2))
            job.signal(r, signal.SIGTERM)

    def judge(self, run: ScenarioRun, opts: DrillOptions) -> None:
        judge_committed_stop(run, opts, signalled=None)


class PeerKilled(Scenario):
    name = "peer-killed"
    summary = ("SIGTERM to rank 0, then SIGKILL of the last rank as it starts its emergency "
               "save: the survivors exit 144 by the deadline + a few s naming it; the "
               "checkpoint committed before is intact (verify) and the restart from it is "
               "bit-exact")

    def act(self, job: Job, opts: DrillOptions) -> None:
        victim = job.world - 1
        job.signal(0, signal.SIGTERM)
        e = job.wait_event(victim, ("save_start", "decision"),
                           time.monotonic() + opts.grace_s)
        if e is not None and e["event"] == "decision" and e.get("decision") in (
                "save", "wait_then_save", "supersede"):
            e = job.wait_event(victim, ("save_start",), time.monotonic() + opts.grace_s) or e
        job.notes["killed_at"] = e["event"] if e else None
        job.signal(victim, SIGKILL)

    def judge(self, run: ScenarioRun, opts: DrillOptions) -> None:
        world = len(run.ranks)
        victim = world - 1
        survivors = [r for r in range(world) if r != victim]
        codes = [x["exit_code"] for x in run.ranks]
        kill = [s for s in run.sent if s["signal"] == "SIGKILL"]
        run.check("victim killed during the emergency save",
                  bool(kill) and kill[0]["delivered"] and codes[victim] == -SIGKILL
                  and run.measured.get("killed_at") == "save_start",
                  f"rank {victim}: SIGKILL " + (
                      "not sent" if not kill else "sent" if kill[0]["delivered"] else
                      "too late (the rank had exited)") + f" at its "
                  f"{run.measured.get('killed_at')!r} event, exit code {codes[victim]}")
        run.check("survivors exit 144", all(codes[r] == EXIT_FAILED for r in survivors),
                  f"exit codes {codes}")
        bad = [r for r in survivors if victim not in
               ((run.rank(r).get("exit_event") or {}).get("missing") or [])]
        run.check("survivors name the lost rank", not bad,
                  f"rank(s) {bad} did not name rank {victim} in their exit event" if bad
                  else f"every survivor's exit event names rank {victim}")
        limit = run.window_s + HARD_EXTRA_S + 2.0
        late = [r for r in survivors if (run.rank(r).get("gone_s") or 1e9) > limit]
        run.check("survivors gone by deadline + 5 s", not late,
                  f"process ends after the first signal: "
                  f"{[run.rank(r).get('gone_s') for r in survivors]} s (limit {limit:.1f} s)")
        judge_previous_intact(run, opts)
        judge_restart(run, opts)


class ShortWindow(Scenario):
    name = "short-window"
    summary = ("a grace window shorter than the state needs (the disk throttled so the state "
               "takes the whole window to write): decision skip, exit 143 before the deadline, "
               "nothing new on disk, the checkpoint before intact, restart from it bit-exact")

    def window(self, opts: DrillOptions) -> float:
        return opts.short_window

    def job(self, opts: DrillOptions) -> dict:
        return {"grace_s": opts.short_window, "throttle_to_window_s": opts.short_window}

    def act(self, job: Job, opts: DrillOptions) -> None:
        job.signal(job.world - 1, signal.SIGTERM)

    def judge(self, run: ScenarioRun, opts: DrillOptions) -> None:
        codes = [x["exit_code"] for x in run.ranks]
        run.check("every rank exits 143", all(c == EXIT_PREEMPTED for c in codes),
                  f"exit codes {codes}")
        decs = [(x.get("decision") or {}) for x in run.ranks]
        run.check("decision skip on every rank",
                  all(d.get("decision") == "skip" and d["est_save_s"] > d["left_s"]
                      for d in decs),
                  "; ".join(f"rank {r}: {d.get('decision')} (estimated "
                            f"{d.get('est_save_s')} s, budget {d.get('left_s')} s)"
                            for r, d in enumerate(decs)))
        started = [r for r, x in enumerate(run.ranks) if "save_start" in x["timeline"]]
        run.check("no emergency save started", not started, f"rank(s) {started} started one")
        late = [r for r, x in enumerate(run.ranks)
                if (x["timeline"].get("exit") or 1e9) >= run.window_s]
        run.check("exit before the deadline", not late,
                  f"exit events after the first signal: "
                  f"{[x['timeline'].get('exit') for x in run.ranks]} s "
                  f"(window {run.window_s} s)")
        judge_gone(run)
        newer = [s for s in run.measured.get("step_dirs", []) if s > opts.save_at]
        run.check("nothing newer on disk", not newer,
                  f"step directories {run.measured.get('step_dirs')}")
        judge_previous_intact(run, opts)
        judge_restart(run, opts)


def judge_committed_stop(run: ScenarioRun, opts: DrillOptions,
                          signalled: list[int] | None) -> None:
    """one-rank, staggered: one stop step, committed by all, exit 143, restart bit-exact."""
    codes = [x["exit_code"] for x in run.ranks]
    run.check("every rank exits 143", all(c == EXIT_PREEMPTED for c in codes),
              f"exit codes {codes}")
    stops = [(x.get("consensus") or {}).get("stop_step") for x in run.ranks]
    run.check("one stop step", len(set(stops)) == 1 and stops[0] is not None,
              f"stop steps per rank {stops}")
    order = [r for r, x in enumerate(run.ranks)
             if not (0 <= (x["timeline"].get("consensus") or -1))]
    run.check("consensus after the signal", not order,
              f"rank(s) {order} logged no consensus, or one before the first signal" if order
              else "every rank's consensus follows the first signal")
    if signalled is not None:
        got = [r for r, x in enumerate(run.ranks) if x["timeline"].get("signal")]
        run.check("only the signalled rank saw a signal", got == signalled,
                  f"signal events on rank(s) {got}")
    else:
        got = [r for r, x in enumerate(run.ranks) if x["timeline"].get("signal")]
        run.check("signals delivered", bool(got),
                  f"signal events on rank(s) {got} (a rank already exiting ignores a late one)")
    commits = [(x.get("commit") or {}).get("step") for x in run.ranks]
    run.check("every rank committed the stop step", commits == stops and None not in commits,
              f"commit events {commits}")
    late = [r for r, x in enumerate(run.ranks)
            if (x["timeline"].get("exit") or 1e9) >= run.window_s]
    exits = [x["timeline"].get("exit") for x in run.ranks]
    run.check("exit before the deadline", not late,
              f"exit events after the first signal: {exits} s (window {run.window_s} s)")
    judge_gone(run)
    # every rank's deadline is the job's first signal + the window - its teardown reserve,
    # also on a rank signalled later (or not at all): consensus time + time left, per rank
    ends = [None if not x.get("consensus") or x["consensus"].get("deadline_in_s") is None
            or x.get("teardown_s") is None else
            round(x["timeline"]["consensus"] + x["consensus"]["deadline_in_s"]
                  + x["teardown_s"], 2) for x in run.ranks]
    run.check("deadline counted from the first signal",
              all(e is not None and abs(e - run.window_s) <= 0.25 for e in ends),
              f"per rank, consensus + time left + teardown reserve = {ends} s after the first "
              f"signal (window {run.window_s} s)")
    newest = run.measured.get("newest_committed")
    v = [x for x in run.verify if x["step"] == newest]
    run.check("stop step is the newest committed and verifies",
              newest == stops[0] and bool(v) and v[0]["ok"],
              f"newest committed {newest}: " + ("verified" if v and v[0]["ok"] else
                                                str(v[0]["problems"]) if v else "not verified"))
    judge_restart(run, opts)


def judge_gone(run: ScenarioRun) -> None:
    """Every rank's process gone within the window from the first signal: the platform
    SIGKILLs what is left then (exit 137: Slurm FAILED, a Kubernetes failure), so an exit
    event in time followed by a teardown past the window is a failure (before 2026-12-06 the
    local scenarios checked the exit events only; the drill kills a rank as hung only later)."""
    gone = [x.get("gone_s") for x in run.ranks]
    run.check("every rank gone within the window",
              all(g is not None and g < run.window_s for g in gone),
              f"processes gone {gone} s after the first signal (window {run.window_s} s)")


def judge_previous_intact(run: ScenarioRun, opts: DrillOptions) -> None:
    v = [x for x in run.verify if x["step"] == opts.save_at]
    run.check("the checkpoint before the signal verifies", bool(v) and v[0]["ok"],
              f"step {opts.save_at}: " + ("verified" if v and v[0]["ok"] else
                                          str(v[0]["problems"] if v else "not found")))


def judge_restart(run: ScenarioRun, opts: DrillOptions) -> None:
    r = run.restart
    run.check("restart exits 0", r.get("exit_codes") == [0] * len(run.ranks),
              f"restart exit codes {r.get('exit_codes')}")
    want = run.measured.get("newest_committed")
    run.check("restart resumed the newest committed step", r.get("from_step") == want,
              f"resumed at {r.get('from_step')}, newest committed {want}")
    run.check("restart bit-exact", bool(r.get("bit_exact")),
              "losses and every rank's final tensors equal the reference's"
              if r.get("bit_exact") else "; ".join(r.get("mismatches", [])[:5]) or
              r.get("error", "not compared"))


for _s in (OneRank(), Staggered(), PeerKilled(), ShortWindow()):
    register(_s)

