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
2. (all ranks, two threads) the *signal thread* waits on the trap's wakeup fd (local, no store
   traffic). On a local signal it adds 1 to ``signalled``; the rank that brings it to 1 sets
   ``wake/<r>`` for every rank r to the signal's time and expected SIGKILL (one ``multi_set``
   per 1024 ranks), a later one only its own ``wake/<rank>``: an orchestrator signals every
   rank at once, and N ranks waking N ranks each was N^2 sets. The *store watcher* of each
   rank sits in one server-side wait for its own ``wake/<rank>`` on a dedicated store
   connection: an idle job sends the store nothing. A woken watcher marks
   the rank *pending* (its next ``on_preempt`` call takes the slow path), and reports the last
   step its training thread passed: one ``append`` to ``reports`` and one ``add`` to a counter.
   The rank that brings the counter to N reads the reports once and publishes ``T = max(passed)
   + 1`` (the first ``on_preempt`` call if no rank passed one yet), with the earliest signal
   and kill time; every rank waits for ``T`` (one wait, bounded by the deadline; at the
   deadline the reports name the ranks that did not report). No rank has passed ``T``, so every
   rank stops at ``T``. No collective runs on a training step; O(1) store commands per rank.
3. (all ranks, training thread) ``check(state, step)``: ~1 us while no stop is pending. When
   pending: wait for ``T`` (bounded), return None before ``T``; at ``T`` run the emergency path.
4. (all ranks, training thread) emergency path: report ``est`` (bytes to write, measured
   bandwidth, in-flight save) the same way (append + counter); the last reporter computes the
   decision from every report (save / wait for the in-flight save then save / supersede it /
   keep it / skip) and publishes it; save with a commit deadline inside the grace window;
   barrier ``done`` (append + counter) with a deadline; the
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
import sys
import threading
import time
from typing import Any

from ..engine import dist as _dist
from ..engine.dist import StoreUnreachable
from ..options import platform_grace
from . import budget, tiered
from .budget import teardown_reserve
from .consensus import PeerLost as _PeerLost, collect, exit_barrier, stop_step
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

POLL_S = 0.1  # how often the signal thread looks at the trap's records
#   (off the main thread; with one it waits for the fd alone: an idle rank does nothing)
WATCH_REARM_S = 86400.0  # the store watcher's wait is renewed daily (c10d logs each timeout)
HARD_EXTRA_S = 3.0  # the watchdog ends a process still alive this long after the deadline
EXIT_HOOK_S = 5.0  # at most this long for the ``on_exit`` hooks (trackers), within the deadline
#: a signal this soon after a rank's first one is the same notice delivered twice (Slurm signals
#: every process of a step, and torchrun or a supervisor passes it on too): no budget cut
SAME_NOTICE_S = 1.0

_lock = threading.Lock()
_instances = 0  # per-process count: the same on every rank if all create Checkpointers alike


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
        path = opts.event_log
        if path is None and ckpt.storage.is_local:
            path = os.path.join(ckpt.storage.root, "events")
        self.teardown_s, self.teardown_source = teardown_reserve(opts.teardown_s, self.grace_s,
                                                                 path)
        self.preempt_sigs = {int(getattr(signal, n)) for n in opts.preempt_signals}
        self.cancel_sigs = {int(getattr(signal, n)) for n in opts.cancel_signals}
        with _lock:
            _instances += 1
            self.prefix = f"preempt/{_instances}"
        self.group = ckpt.group
        self.ex = ckpt.group.exchange
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
        self._store_watcher: threading.Thread | None = None
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
        if self.opts.preempt_consensus == "store":
            self._store_watcher = threading.Thread(target=self._watch_store, daemon=True,
                                                   name="fastckpt-preempt-store")
            self._store_watcher.start()
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
        sw = self._store_watcher
        if sw is not None and sw.is_alive() and sw is not threading.current_thread():
            try:  # wake our own store watcher from its wait
                self.ex.set(f"{self.prefix}/wake/{self.rank}", b"close")
            except Exception:  # noqa: BLE001 - the store is gone: its wait ended with it
                pass
            sw.join(timeout=2.0)
        if self._watcher is not None and self._watcher is not threading.current_thread():
            self.trap.wake()
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
        """(signal thread) local signals: the deadline, and the publication of a stop."""
        while not self._closed.is_set():
            _, signals = self.trap.poll(POLL_S, self._closed)  # (a timeout: SignalTrap.poll)
            if self._closed.is_set():
                return
            for signum, t, source in signals:
                self._local_signal(signum, t, source)
            if self._local and not self._published and \
                    self.opts.preempt_consensus == "store":
                try:
                    self._publish_local()
                except Exception as e:  # noqa: BLE001 - store gone: the job is ending, or
                    log.warning("fastckpt: rank %d: could not publish the stop: %s",
                                self.rank, e)  # the training thread will see it
                    self._published = True

    def _watch_store(self) -> None:
        """(store watcher) one server-side wait for ``wake/<rank>``: a stop, or close()."""
        self.ex.warm(2)  # this wait's connection and the emergency path's
        key = f"{self.prefix}/wake/{self.rank}"
        while not self._closed.is_set():
            try:
                found, _ = self.ex.wait([key], time.monotonic() + WATCH_REARM_S)
            except StoreUnreachable:
                return  # the job is ending (rank 0 left), or the training thread will see it
            if self._closed.is_set():
                return
            if found:
                self._agree(found[key])
                return

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
        """(signal thread) Count this rank in ``signalled``; the first one wakes every rank
        (``wake/<r>``: one ``multi_set`` per 1024 ranks) with the signal's time and expected
        kill, any later one its own watcher."""
        signum, t = self._local[0]
        info = json.dumps({"signal": signame(signum) if signum > 0 else "request", "t": t,
                           "kill_at": self.kill_wall, "rank": self.rank}).encode()
        p = self.prefix
        # the first signalled rank wakes every rank; the others only their own watcher. An
        # orchestrator signals every rank at once (srun, a pod's containers, a node's ranks):
        # N signallers waking N ranks each was N^2 sets (16.8 M at 4096 ranks)
        first = self.ex.add(f"{p}/signalled", 1) == 1
        self._published = True
        if first:
            order = [self.rank] + [r for r in range(self.world) if r != self.rank]
            self.ex.set_many([f"{p}/wake/{r}" for r in order], [info] * len(order))
        else:
            self.ex.set(f"{p}/wake/{self.rank}", info)

    def _agree(self, wake: bytes) -> None:
        """(store watcher) a stop exists somewhere (``wake``: the first signal's time and kill,
        as its rank published them): report our progress, wait for T."""
        self.pending = True
        passed = self.last_seen  # after pending=True: the training thread passes nothing later
        t_learn = time.time()
        try:
            if self.deadline is None:
                first = json.loads(wake)
                self._set_deadline(first["t"], first.get("kill_at"))
            mine = {"passed": passed, "first_signal": self._local[0][1] if self._local else None,
                    "kill_at": self.kill_wall if self._local else None, "cancel": self.cancel}
            agreed = self._collect("reports", mine, self._dl(-self.opts.preempt_margin_s),
                                   "stop consensus", stop_step)
        except _PeerLost as e:
            self.failure = e
            self.event("consensus_failed", missing=e.missing, reason=str(e))
            self.agreed.set()
            return
        if agreed["first"] is not None:
            self._set_deadline(agreed["first"], agreed["kill"])
        self.cancel = self.cancel or agreed["cancel"]
        self.stop_step = agreed["T"]
        first = agreed["first"] if agreed["first"] is not None else t_learn
        self.event("consensus", stop_step=self.stop_step, reported=agreed["reported"],
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

    def _collect(self, name: str, mine: dict, deadline: float, what: str, reduce: Any,
                 min_wait: float = 0.0) -> Any:
        return collect(self.ex, f"{self.prefix}/{name}", self.rank, self.world, mine,
                       deadline, what, reduce, min_wait)

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
            return None  # (preempt_exit=False: failed once, not saved after)
        if self.failure is not None:
            self._fail(self.failure, step)
            return None
        if self.stop_step is not None and step < self.stop_step:
            return None
        return self._emergency(state, step)

    def _check_allreduce(self, state: dict, step: int) -> Any:
        local = self._local[0][1] if self._local else None
        kill = self.kill_wall if self._local else None
        # to rank 0 alone, which answers with the reduction: O(N) through the store per
        # step where an all-to-all gather is O(N^2)
        first, cancel, kill = self.group.decide(
            [local, self.cancel, kill], _reduce_flags, timeout_s=self.opts.plan_timeout_s,
            what=f"preemption check at step {step}")
        if first is None:
            return None
        self.pending = True
        self.cancel = cancel
        self._set_deadline(first, kill)
        self.stop_step = step
        self.event("consensus", stop_step=step, mode="allreduce",
                   agreed_after_s=round(time.time() - first, 4), cancel=self.cancel)
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
            record=lambda: budget.bench_record(self.ckpt.root, self.ckpt.options.compression),
            inflight=inflight, piece_bytes=piece, left_s=self._dl() - time.monotonic(),
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
            tiered.freeze(self.ckpt)  # the remote tier: only this path uploads from now on
            mine = self._estimate(state)
            done = self.ckpt.last_committed()
            mine["committed_step"] = done.step if done is not None else None
            mine.update(tiered.report(self.ckpt, mine["bytes"], self.opts.assumed_upload_mibps))
            self.event("estimate", **mine)
            decision, nums = self._collect(
                "est", mine, self._dl(-margin), "budget exchange",
                lambda reports: tiered.reduce(self.ckpt, reports,
                                              *self.decide(reports, step, margin), margin,
                                              step))
            self.event("decision", decision=decision, step=step, **nums)
            tiered.before_save(self.ckpt, nums, self.event)
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
                        raise TimeoutError(f"superseded save of step {old.step} did not stop")
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
            target = handle if handle is not None else {"wait": last, "committed": done}.get(decision)
            tiered.after_save(self.ckpt, nums, target, self._dl(-margin / 4), self.event,
                              self.rank)
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
        missing: list[int] = list(getattr(error, "missing", None) or
                                  getattr(error, "missing_ranks", None) or [])
        try:
            # a failure waits briefly (the peers that are alive are there within a second)
            end = self._dl() if ok else min(self._dl(), time.monotonic() + 1.0)
            done = self._collect("done", {"ok": ok, "cancel": self.cancel}, end, "barrier",
                                 exit_barrier, min_wait=0.0 if ok else 1.0)
            bad, self.cancel = done["bad"], done["cancel"]
            if bad and ok:
                ok = False
                error = RuntimeError(f"the emergency save failed on rank(s) {bad}")
            # rank 0 may host the store: it stays (briefly) until every rank has left
            if self.ex.add(f"{self.prefix}/left", 1) == self.world:
                self.ex.set(f"{self.prefix}/left/all", b"1")
            if self.rank == 0:
                self.ex.wait([f"{self.prefix}/left/all"], time.monotonic() + 2.0)
            self.event("barrier", ok=True, all_saved=ok, seconds=round(time.monotonic() - t0, 4))
        except Exception as e:  # _PeerLost, or a store error: its host is gone
            ok = False
            if error is None:
                error = e
            lost = getattr(e, "missing", None) or getattr(e, "ranks", None) or []
            missing = sorted(set(missing) | set(lost))
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
        if self.ckpt.inflight()[0] is not None or getattr(tiered.tier_of(self.ckpt), "busy",
                                                           False):
            clean = False  # an abandoned save or upload: closing would wait for its thread
        if code != EXIT_FAILED and self.group.collective:
            _destroy_process_group()
        self.event("exit", code=code, reason=reason, missing=missing or None,
                   deadline_in_s=round(self._dl() - time.monotonic(), 3))
        self.event.close()
        if not clean:  # threads may be stuck in the store or a collective: do not join them
            try:
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
        sys.exit(code)  # (not SystemExit: W&B's sys.exit hook gives its atexit teardown the code)


def _destroy_process_group() -> None:
    try:
        _dist.destroy()
    except Exception as e:
        log.warning("fastckpt: destroy_process_group failed: %s", e)


def _reduce_flags(flags: list) -> list:
    """(rank 0, the allreduce consensus) Every rank's ``[first signal time or None, cancel,
    kill time or None]`` reduced to one: the earliest signal (None: no rank was signalled),
    whether any rank was cancelled, the earliest kill time."""
    firsts = [f for f, _, _ in flags if f is not None]
    kills = [k for _, _, k in flags if k is not None]
    return [min(firsts) if firsts else None, any(c for _, c, _ in flags),
            min(kills) if kills else None]
