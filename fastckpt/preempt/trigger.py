"""The preemption trigger: watcher, out-of-band stop consensus, emergency path and exit.

Used through ``Checkpointer.save(state, step=s, on_preempt=True)`` (see docs/preemption.md).
It drives the engine only through its narrow interface (``inflight``, ``supersede``,
``emergency_save``, ``emergency_is_zero_copy``, ``on_saved``); the signals come from
``signals.SignalTrap`` and the decision from ``budget``.

Call sequence (who makes each call):

1. (all ranks, training thread, at construction) ``Preemption.install``: the signal trap
   (``signals.SignalTrap``: handlers that only record, a wakeup fd that wakes the watcher thread
   at once even while the training thread is blocked in a C call or a collective) and the
   watcher thread.
2. (all ranks, watcher thread) on a local signal: publish ``sig/<rank>`` and bump ``n`` in the
   store. Every watcher probes ``n`` every ``POLL_S``. A watcher that sees a stop marks the rank
   *pending* (its next ``on_preempt`` call takes the slow path), reports ``step/<rank>`` = the last
   step its training thread passed, and waits for every rank's report. The stop step is
   ``T = max(reported) + 1`` (the first ``on_preempt`` call if no rank passed one yet): no rank
   has passed ``T``, so every rank stops at ``T``. No collective runs on a training step.
3. (all ranks, training thread) ``check(state, step)``: ~1 us while no stop is pending. When
   pending: wait for ``T`` (bounded), return None before ``T``; at ``T`` run the emergency path.
4. (all ranks, training thread) emergency path: publish ``est/<rank>`` (bytes to write, measured
   bandwidth, in-flight save); every rank computes the same decision from the same reports
   (save / wait for the in-flight save then save / supersede it / keep it / skip); save with a
   commit deadline inside the grace window; barrier ``done/<rank>`` with a deadline; the
   ``Checkpointer.on_exit`` hooks (trackers; bounded); destroy the process group; exit with the
   documented code. The deadline is the earliest expected SIGKILL (each signal's window:
   ``signal_grace_s``, else ``grace_s``) less the process's teardown (``teardown_reserve``). A watchdog thread ends the process at
   ``deadline + HARD_EXTRA_S`` whatever the training thread is blocked in.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from typing import Any

from ..engine import dist as _dist
from ..options import platform_grace
from . import budget
from .events import EventLog
from .signals import REQUEST_CANCEL, SignalTrap, signame

log = logging.getLogger("fastckpt.preempt")

#: graceful preemption: the emergency checkpoint is committed, or the last committed one is
#: intact because nothing fit the window. "Restart me." (128 + SIGTERM, Kubeflow retries >= 128)
EXIT_PREEMPTED = 143
#: deliberate cancellation (a ``cancel_signals`` signal or ``request_stop(cancel=True)``):
#: checkpoint saved, "do not restart" (a Kubernetes Job counts as succeeded).
EXIT_CANCELLED = 0
#: the emergency path failed: a peer died or hung, a write failed, a deadline passed. The
#: previous committed checkpoint is loadable. Higher than EXIT_PREEMPTED so Slurm's
#: "highest code across tasks" shows the failure.
EXIT_FAILED = 144

POLL_S = 0.1  # how often a watcher probes the store for a stop
HARD_EXTRA_S = 3.0  # the watchdog ends a process still alive this long after the deadline
EXIT_HOOK_S = 5.0  # at most this long for the ``on_exit`` hooks (trackers), within the deadline
#: a signal this soon after a rank's first one is the same notice delivered twice (Slurm signals
#: every process of a step, and torchrun or a supervisor passes it on too): no budget cut
SAME_NOTICE_S = 1.0
TEARDOWN_DEFAULT_S = 2.0  # teardown reserve when none was measured (at most grace / 10)

_lock = threading.Lock()
_instances = 0  # per-process count: the same on every rank if all create Checkpointers alike


class _PeerLost(Exception):
    def __init__(self, missing: list[int], what: str) -> None:
        self.missing = missing
        super().__init__(f"{what}: rank(s) {missing} did not answer")


class Preemption:
    """The preemption trigger of one Checkpointer. ``check`` is called from the training thread
    only; the watcher thread and the signal handlers share plain attributes (GIL-ordered)."""

    def __init__(self, ckpt: Any) -> None:
        global _instances
        opts = ckpt.options
        self.ckpt = ckpt
        self.opts = opts
        self.rank, self.world = ckpt.rank, ckpt.world_size
        if opts.grace_s is not None:
            self.grace_s, self.grace_source = float(opts.grace_s), "configured"
            self.platform = platform_grace()[0]
        else:
            self.platform, self.grace_s, self.grace_source = platform_grace()
        # a signal whose window differs from grace_s (Slurm: --signal=B:USR1@T gives T s +
        # KillWait, scancel's SIGTERM gives KillWait)
        self.signal_grace = {int(getattr(signal, n.upper())): float(v)
                             for n, v in (opts.signal_grace_s or {}).items()}
        self.teardown_s, self.teardown_source = teardown_reserve(
            opts.teardown_s, self.grace_s,
            os.path.join(ckpt.storage.root, "events") if ckpt.storage.is_local else None)
        self.preempt_sigs = {int(getattr(signal, n)) for n in opts.preempt_signals}
        self.cancel_sigs = {int(getattr(signal, n)) for n in opts.cancel_signals}
        with _lock:
            _instances += 1
            self.prefix = f"preempt/{_instances}"
        self.group = ckpt.group
        self.ex = ckpt.group.exchange
        path = opts.event_log
        if path is None and ckpt.storage.is_local:
            path = os.path.join(ckpt.storage.root, "events")
        self.event = EventLog(os.path.join(path, f"rank{self.rank:05d}.jsonl") if path else None,
                              self.rank)
        # shared state (training thread / watcher / handlers)
        self.pending = False  # a stop is known: check() takes the slow path
        self.last_seen: int | None = None  # last step passed to check()
        self.stop_step: int | None = None  # agreed T
        self.agreed = threading.Event()  # T (or a failure) is known
        self.failure: _PeerLost | None = None
        self.cancel = False
        self.first_signal_wall: float | None = None
        self.kill_wall: float | None = None  # when the platform's SIGKILL is expected
        self.deadline: float | None = None  # time.monotonic()
        self.exit_code: int | None = None
        self.stopped = False
        self.trap = SignalTrap(self.preempt_sigs | self.cancel_sigs)
        self._local: list[tuple[int, float]] = []  # local signals the watcher processed
        self._published = False
        self._samples: list[tuple[int, float, float]] = []  # (bytes, write_s, stage_s)
        self._closed = threading.Event()
        self._hooks_ran = False
        self._watcher: threading.Thread | None = None
        self._watchdog: threading.Timer | None = None
        ckpt.on_saved.append(self.record_save)

    # -- install / close (training thread) --------------------------------------------------
    def install(self) -> None:
        self.trap.install()
        if not self.trap.trapped:
            log.warning("fastckpt: rank %d: Checkpointer created off the main thread: no signal "
                        "trap (request_stop() and stops from other ranks still work)", self.rank)
        self._watcher = threading.Thread(target=self._watch, name="fastckpt-preempt",
                                         daemon=True)
        self._watcher.start()
        self.event("armed", signals=self.trap.trapped, grace_s=self.grace_s,
                   grace_source=self.grace_source, platform=self.platform,
                   signal_grace_s={signame(k): v for k, v in self.signal_grace.items()} or None,
                   teardown_s=self.teardown_s, teardown_source=self.teardown_source,
                   consensus=self.opts.preempt_consensus, world_size=self.world)

    def close(self, *, ignore_signals: bool = False) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._watchdog is not None and self.exit_code is None:
            self._watchdog.cancel()
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self._watcher.join(timeout=2.0)
        self.trap.close(ignore=ignore_signals)
        self.event.close()

    def request_stop(self, *, cancel: bool = False) -> None:
        """Ask for a stop from code (e.g. a cloud termination notice poller). Any thread."""
        self.trap.request(cancel)

    def record_save(self, nbytes: int, write_s: float, stage_s: float) -> None:
        """(writer thread) bandwidth sample of a finished save."""
        if nbytes > 0 and write_s > 0:
            self._samples.append((nbytes, write_s, stage_s))
            del self._samples[:-8]

    # -- watcher thread ------------------------------------------------------------------------
    def _watch(self) -> None:
        poll_next = 0.0
        while not self._closed.is_set():
            woke, signals = self.trap.poll(POLL_S, self._closed)
            if self._closed.is_set():
                return
            for signum, t, source in signals:
                self._local_signal(signum, t, source)
            if self.pending or self.opts.preempt_consensus != "store":
                continue
            now = time.monotonic()
            if not woke and now < poll_next and not self._local:
                continue
            poll_next = now + POLL_S
            try:
                if self._local and not self._published:
                    self._publish_local()
                n = self.ex.add(f"{self.prefix}/n", 0)
            except Exception:  # noqa: BLE001 - store gone: the job is ending, or the
                continue  # training thread will see it
            if n > 0:
                self._agree()

    def _local_signal(self, signum: int, t_wall: float, source: str) -> None:
        """(watcher) one signal: first ones start the stop; later ones cut the budget."""
        cancel = signum == REQUEST_CANCEL or signum in self.cancel_sigs
        name = signame(signum)
        self._local.append((signum, t_wall))
        self.event("signal", signal=name, signal_time=t_wall, source=source, cancel=cancel,
                   nth=len(self._local))
        log.warning("fastckpt: rank %d: %s received (%s)", self.rank, name,
                    "cancel" if cancel else "preempt")
        if cancel:
            self.cancel = True
        if len(self._local) == 1:
            self._set_deadline(t_wall, t_wall + self.signal_grace.get(signum, self.grace_s))
        elif self.deadline is not None and t_wall - self._local[0][1] > SAME_NOTICE_S:
            # a second signal: the orchestrator is impatient; halve what is left of the budget
            left = self.deadline - time.monotonic()
            self.deadline = time.monotonic() + max(0.0, left / 2)
            self._arm_watchdog()
            self.event("budget_cut", left_s=round(max(0.0, left / 2), 3), nth=len(self._local))

    def _set_deadline(self, first_wall: float, kill_wall: float | None = None) -> None:
        """A signal at ``first_wall`` (Unix time) whose SIGKILL comes at ``kill_wall`` (default:
        ``grace_s`` later): the deadline is the earliest kill known, less the teardown."""
        if self.first_signal_wall is None or first_wall < self.first_signal_wall:
            self.first_signal_wall = first_wall
        kill_wall = first_wall + self.grace_s if kill_wall is None else kill_wall
        if self.kill_wall is None or kill_wall < self.kill_wall:
            self.kill_wall = kill_wall
            # the process must be gone by the kill: its teardown after the exit event
            # (measured by the supervisor, or the default reserve) is not the save's
            dl = time.monotonic() + (kill_wall - self.teardown_s - time.time())
            self.deadline = dl if self.deadline is None else min(self.deadline, dl)
            self._arm_watchdog()

    def _publish_local(self) -> None:
        signum, t = self._local[0]
        self.ex.set(f"{self.prefix}/sig/{self.rank}", json.dumps(
            {"signal": signame(signum) if signum > 0 else "request", "t": t}).encode())
        self._published = True
        self.ex.add(f"{self.prefix}/n", 1)

    def _agree(self) -> None:
        """(watcher) a stop exists somewhere: report our progress, wait for everyone's, fix T."""
        self.pending = True
        passed = self.last_seen  # after pending=True: the training thread passes nothing later
        mine = {"passed": passed, "first_signal": self._local[0][1] if self._local else None,
                "kill_at": self.kill_wall if self._local else None, "cancel": self.cancel}
        t_learn = time.time()
        try:
            self.ex.set(f"{self.prefix}/step/{self.rank}", json.dumps(mine).encode())
            if self.deadline is None:
                self._set_deadline(t_learn)  # provisional, until the signal time is known
            keys = [f"{self.prefix}/step/{r}" for r in range(self.world)]
            found = self._poll(keys, self._dl(-self.opts.preempt_margin_s), "stop consensus")
        except _PeerLost as e:
            self.failure = e
            self.event("consensus_failed", missing=e.missing, reason=str(e))
            self.agreed.set()
            return
        reports = [json.loads(found[k]) for k in keys]
        steps = [r["passed"] for r in reports if r["passed"] is not None]
        firsts = [r["first_signal"] for r in reports if r["first_signal"] is not None]
        kills = [r.get("kill_at") for r in reports if r.get("kill_at") is not None]
        if firsts:
            self._set_deadline(min(firsts), min(kills) if kills else None)
        self.cancel = self.cancel or any(r["cancel"] for r in reports)
        self.stop_step = max(steps) + 1 if steps else -1
        first = min(firsts) if firsts else t_learn
        self.event("consensus", stop_step=self.stop_step, reported=[r["passed"] for r in reports],
                   learned_after_s=round(t_learn - first, 4),
                   agreed_after_s=round(time.time() - first, 4), cancel=self.cancel,
                   deadline_in_s=round(self._dl() - time.monotonic(), 3))
        log.warning("fastckpt: rank %d: stop agreed at step %s (%.3f s after the first signal)",
                    self.rank, self.stop_step, time.time() - first)
        self.agreed.set()

    # -- helpers ----------------------------------------------------------------------------
    def _dl(self, extra: float = 0.0) -> float:
        d = self.deadline if self.deadline is not None else time.monotonic() + self.grace_s
        return d + extra

    def _poll(self, keys: list[str], deadline: float, what: str,
              min_wait: float = 0.0) -> dict[str, bytes]:
        """Wait for keys without blocking the store client (other threads share it)."""
        end = max(deadline, time.monotonic() + min_wait)
        while True:
            try:
                found, missing = self.ex.wait(keys, 0.0)  # a probe: no blocking store.wait
                if not missing:
                    return found
                self.ex.add(f"{self.prefix}/alive", 0)  # raises if rank 0's store is gone
            except _PeerLost:
                raise
            except Exception as e:
                raise _PeerLost([0], f"{what}: the store on rank 0 is unreachable ({e})") from e
            if time.monotonic() >= end:
                raise _PeerLost([int(k.rsplit("/", 1)[1]) for k in missing], what)
            time.sleep(0.02)

    def _arm_watchdog(self) -> None:
        if not self.opts.preempt_exit:
            return
        if self._watchdog is not None:
            self._watchdog.cancel()
        delay = max(0.0, self._dl() - time.monotonic()) + HARD_EXTRA_S
        self._watchdog = threading.Timer(delay, self._watchdog_fire)
        self._watchdog.daemon = True
        self._watchdog.start()

    def _watchdog_fire(self) -> None:
        if self._closed.is_set() and self.exit_code is None:
            return  # closed without a stop
        if self.exit_code is not None and threading.main_thread().is_alive():
            return  # SystemExit raised and caught by the caller: its business, not a hang
        # the stop finished (exit_code set) but the interpreter's shutdown is still running
        # (joining threads, atexit): the outcome is known, so exit with it; otherwise the
        # emergency path itself is stuck: "failed"
        code = self.exit_code if self.exit_code is not None else EXIT_FAILED
        missing = self.failure.missing if self.failure else None
        what = "the shutdown" if self.exit_code is not None else "the emergency path"
        if self.exit_code is None:  # the trackers are told, briefly: the process is past due
            self._run_exit_hooks(code, f"watchdog: {what} still running after the deadline",
                                 limit_s=1.0)
        self.event("exit", code=code, reason=f"watchdog: {what} still running "
                   f"{HARD_EXTRA_S:.0f} s after the grace deadline", missing=missing)
        self.event.close()
        log.error("fastckpt: rank %d: grace deadline passed; exiting %d", self.rank, code)
        os._exit(code)

    # -- training thread -----------------------------------------------------------------------
    def check(self, state: dict, step: int) -> Any:
        """``save(state, step=step, on_preempt=True)``: None, or the emergency path at T."""
        self.last_seen = step
        if not self.pending:
            if self.opts.preempt_consensus == "store" or self.stopped:
                return None
            return self._check_allreduce(state, step)
        if self.stopped:
            return None
        left = self._dl() - time.monotonic()
        if not self.agreed.wait(max(0.0, left)):
            self._fail(_PeerLost([], "no stop consensus before the deadline"), step)
        if self.failure is not None:
            self._fail(self.failure, step)
        if self.stop_step is not None and step < self.stop_step:
            return None
        return self._emergency(state, step)

    def _check_allreduce(self, state: dict, step: int) -> Any:
        local = self._local[0][1] if self._local else None
        kill = self.kill_wall if self._local else None
        flags = self.group.gather([local, self.cancel, kill], timeout_s=self.opts.plan_timeout_s,
                                  what=f"preemption check at step {step}")
        firsts = [f for f, _, _ in flags if f is not None]
        if not firsts:
            return None
        self.pending = True
        self.cancel = any(c for _, c, _ in flags)
        kills = [k for _, _, k in flags if k is not None]
        self._set_deadline(min(firsts), min(kills) if kills else None)
        self.stop_step = step
        self.event("consensus", stop_step=step, mode="allreduce",
                   agreed_after_s=round(time.time() - min(firsts), 4), cancel=self.cancel)
        self.agreed.set()
        return self._emergency(state, step)

    def _estimate(self, state: dict) -> dict:
        """This rank's report for the budget (see budget.estimate)."""
        def state_bytes() -> int:
            from ..engine.state import flatten
            try:
                return sum(t.numel() * t.element_size() for t in flatten(state).tensors.values())
            except Exception:  # noqa: BLE001 - an estimate, not a save
                return 0
        inflight, piece = self.ckpt.inflight()
        return budget.estimate(
            samples=list(self._samples), state_bytes=state_bytes,
            assumed_write_bps=self.opts.assumed_write_mibps * (1 << 20),
            record=lambda: budget.bench_record(self.ckpt.root), inflight=inflight,
            piece_bytes=piece, left_s=self._dl() - time.monotonic(),
            zero_copy=self.ckpt.emergency_is_zero_copy())

    decide = staticmethod(budget.decide)

    def _emergency(self, state: dict, step: int) -> Any:
        """(training thread, all ranks at T) decide, save, barrier, exit."""
        self.stopped = True
        margin = self.opts.preempt_margin_s
        self.event("stop_reached", step=step, deadline_in_s=round(self._dl() - time.monotonic(), 3))
        handle = None
        error: BaseException | None = None
        try:
            mine = self._estimate(state)
            self.event("estimate", **mine)
            k = f"{self.prefix}/est/"
            self.ex.set(k + str(self.rank), json.dumps(mine).encode())
            found = self._poll([k + str(r) for r in range(self.world)], self._dl(-margin),
                               "budget exchange")
            reports = [json.loads(found[k + str(r)]) for r in range(self.world)]
            decision, nums = self.decide(reports, step, margin)
            self.event("decision", decision=decision, step=step, **nums)
            log.warning("fastckpt: rank %d: preemption decision at step %d: %s (left %.2f s, "
                        "estimated save %.2f s for %d bytes, in-flight step %s needs %.2f s)",
                        self.rank, step, decision, nums["left_s"], nums["est_save_s"],
                        nums["bytes"], nums["inflight_step"], nums["inflight_left_s"])
            last, _ = self.ckpt.inflight()
            if decision == "supersede":
                t0 = time.monotonic()
                old = self.ckpt.supersede()
                if old is not None:
                    old.exception(max(0.0, self._dl(-margin) - time.monotonic()))
                    if not old.done():
                        raise TimeoutError(f"superseded save of step {old.step} did not stop "
                                           "before the deadline")
                    old.take_failure()  # its failure ("superseded") is this path's doing
                    self.event("superseded", step=old.step, committed=old.committed,
                               seconds=round(time.monotonic() - t0, 3))
            if decision in ("wait", "wait_then_save") and last is not None:
                t0 = time.monotonic()
                last.exception(max(0.0, self._dl(-margin) - time.monotonic()))
                if not last.done():
                    raise TimeoutError(f"in-flight save of step {last.step} did not finish "
                                       "before the deadline")
                exc = last.take_failure()
                self.event("inflight_done", step=last.step, ok=exc is None,
                           seconds=round(time.monotonic() - t0, 3),
                           error=None if exc is None else str(exc))
                if exc is not None and decision == "wait":
                    raise exc  # it was to be the checkpoint; with wait_then_save, save anyway
            if decision in ("save", "wait_then_save", "supersede"):
                t0 = time.monotonic()
                self.event("save_start", step=step, est_bytes=mine["bytes"])
                # the process exits after this save, so the state is not touched again: written
                # straight from the tensors (no staging copy, no staging memory) where it can be
                handle = self.ckpt.emergency_save(state, step, self._dl(-margin / 2),
                                                  user_meta={"preempted": True})
                if handle.earlier_failure is not None:  # it did not stop this save
                    self.event("earlier_save_failed", step=handle.earlier_failure[0],
                               error=str(handle.earlier_failure[1]))
                handle.wait(max(0.01, self._dl(-margin / 4) - time.monotonic()))
                secs = time.monotonic() - t0
                self.event("save_end", step=step, bytes=handle.bytes_written,
                           seconds=round(secs, 4), timings={
                               k: round(v, 4) for k, v in handle.timings.items()})
                self.event("commit", step=step, path=handle.path)
        except _PeerLost as e:
            error = e
        except BaseException as e:  # noqa: BLE001 - a failed emergency save: exit "failed"
            error = e
        self._finish(step, error, handle)
        return handle

    def _finish(self, step: int, error: BaseException | None, handle: Any) -> None:
        ok = error is None
        if error is not None:
            self.event("save_failed", step=step, error=f"{type(error).__name__}: {error}")
        t0 = time.monotonic()
        k = f"{self.prefix}/done/"
        missing: list[int] = list(getattr(error, "missing", None) or
                                  getattr(error, "missing_ranks", None) or [])
        try:
            self.ex.set(k + str(self.rank), json.dumps({"ok": ok}).encode())
            # a failure waits briefly (the peers that are alive are there within a second)
            end = self._dl() if ok else min(self._dl(), time.monotonic() + 1.0)
            found = self._poll([k + str(r) for r in range(self.world)], end, "barrier",
                               min_wait=0.0 if ok else 1.0)
            bad = [r for r in range(self.world) if not json.loads(found[k + str(r)])["ok"]]
            if bad and ok:
                ok = False
                error = RuntimeError(f"the emergency save failed on rank(s) {bad}")
            self.ex.add(f"{self.prefix}/left", 1)
            if self.rank == 0:  # the store lives here: let every rank leave first
                end = time.monotonic() + 2.0
                while self.ex.add(f"{self.prefix}/left", 0) < self.world and \
                        time.monotonic() < end:
                    time.sleep(0.01)
            self.event("barrier", ok=True, all_saved=ok, seconds=round(time.monotonic() - t0, 4))
        except Exception as e:  # _PeerLost, or a store error: rank 0 (its host) is gone
            ok = False
            if error is None:
                error = e
            missing = sorted(set(missing) | set(getattr(e, "missing", [0])))
            self.event("barrier", ok=False, missing=missing,
                       seconds=round(time.monotonic() - t0, 4))
        if ok:
            code = EXIT_CANCELLED if self.cancel else EXIT_PREEMPTED
            reason = "cancelled" if self.cancel else "preempted"
        else:
            code = EXIT_FAILED
            reason = f"{type(error).__name__}: {error}"
            if missing:
                reason += f"; missing rank(s) {missing}"
            log.error("fastckpt: rank %d: emergency path failed: %s", self.rank, reason)
        self.exit_code = code
        self._exit(code, reason, missing, clean=ok)

    def _fail(self, error: _PeerLost, step: int) -> None:
        self.stopped = True
        self._finish(step, error, None)

    def _run_exit_hooks(self, code: int, reason: str, limit_s: float | None = None) -> None:
        """``Checkpointer.on_exit`` hooks (trackers): each gets a dict with the exit code, the
        reason, the stop step, whether it is a cancellation, and this rank. They run in a
        thread given at most EXIT_HOOK_S and never past the deadline; one that is still
        running then is left behind (logged), the exit goes on."""
        hooks = list(getattr(self.ckpt, "on_exit", ()))
        if not hooks or self._hooks_ran:
            return
        self._hooks_ran = True
        info = {"code": code, "reason": reason, "step": self.stop_step, "cancel": self.cancel,
                "rank": self.rank, "world_size": self.world}

        def run() -> None:
            for h in hooks:
                try:
                    h(dict(info))
                except Exception as e:  # noqa: BLE001 - a tracker must not change the exit
                    log.warning("fastckpt: rank %d: exit hook %r failed: %s", self.rank, h, e)
        t0 = time.monotonic()
        th = threading.Thread(target=run, name="fastckpt-exit-hooks", daemon=True)
        th.start()
        th.join(limit_s if limit_s is not None else
                max(0.2, min(EXIT_HOOK_S, self._dl() - time.monotonic())))
        self.event("exit_hooks", n=len(hooks), seconds=round(time.monotonic() - t0, 4),
                   finished=not th.is_alive())
        if th.is_alive():
            log.warning("fastckpt: rank %d: exit hooks still running after %.1f s: left behind",
                        self.rank, time.monotonic() - t0)

    def _exit(self, code: int, reason: str, missing: list[int], clean: bool) -> None:
        self._run_exit_hooks(code, reason)
        if not self.opts.preempt_exit:
            self.event("exit", code=code, reason=reason, missing=missing or None, exiting=False)
            return
        if self.ckpt.inflight()[0] is not None:
            clean = False  # an abandoned in-flight save: closing would wait for its writer
        if code != EXIT_FAILED and self.group.collective:
            _destroy_process_group()
        self.event("exit", code=code, reason=reason, missing=missing or None,
                   deadline_in_s=round(self._dl() - time.monotonic(), 3))
        self.event.close()
        if not clean:  # threads may be stuck in the store or a collective: do not join them
            try:
                import sys
                sys.stdout.flush()
                sys.stderr.flush()
            except Exception:
                pass
            os._exit(code)
        # from here the process only tears down (seconds, with torch): late signals are ignored
        # so that the orchestrator sees this exit code, not death by its second SIGTERM
        self.close(ignore_signals=True)
        try:
            self.ckpt.close()
        except Exception as e:
            log.warning("fastckpt: close after the emergency checkpoint: %s", e)
        raise SystemExit(code)


def teardown_reserve(configured: float | None, grace_s: float,
                     events_dir: str | None) -> tuple[float, str]:
    """(seconds kept out of the grace window for the process's teardown, how it is known)."""
    if configured is not None:
        return float(configured), "configured"
    measured = []
    if events_dir:
        try:
            with open(os.path.join(events_dir, "supervisor.jsonl"), encoding="utf-8") as f:
                for line in f:
                    try:
                        v = json.loads(line).get("teardown_s")
                    except (ValueError, AttributeError):
                        continue
                    if isinstance(v, (int, float)) and 0 <= v < 3600:
                        measured.append(float(v))
        except OSError:
            pass
    if measured:
        worst = max(measured[-5:])
        # a measurement can not take the whole window: at most half of it
        return round(min(worst * 1.25 + 0.25, grace_s / 2), 3), (
            f"measured by the supervisor (worst of the last {len(measured[-5:])}: {worst:.2f} s)")
    return round(min(TEARDOWN_DEFAULT_S, grace_s / 10), 3), "default (not measured)"


def _destroy_process_group() -> None:
    try:
        _dist.destroy()
    except Exception as e:
        log.warning("fastckpt: destroy_process_group failed: %s", e)
