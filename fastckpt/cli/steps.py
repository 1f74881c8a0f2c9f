"""The commands on a root's steps: resume, ls, verify, gc, inspect. Torch-free."""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import sys
from typing import Any

import click

from ..errors import CheckpointNotFoundError, CorruptCheckpointError
from ..options import torch_env_from_slurm
from .base import (ENV_PATH, ENV_ROOT, ENV_STEP, EXIT_CODES_HELP, EXIT_NO_CHECKPOINT,
                   EXIT_NOT_EXECUTABLE, EXIT_NOT_FOUND, EXIT_OK, EXIT_PROBLEM, EXIT_STORAGE,
                   EXIT_USAGE, CliError, SecondsType,
                   _add_row, _echo, _emit_json, _hb, _not_found, _print_table, _progress, _rate,
                   _set_json, _storage, _table, _when, cli)

# --------------------------------------------------------------------------------- resume

def _restore_signals() -> None:
    """Undo what Python changed, so the exec'd program starts with default dispositions."""
    for name in ("SIGPIPE", "SIGXFSZ", "SIGXFZ"):
        sig = getattr(signal, name, None)
        if sig is not None:
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass


@cli.command(epilog=EXIT_CODES_HELP)
@click.argument("root")
@click.argument("cmd", nargs=-1, type=click.UNPROCESSED)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object (not with CMD).")
@click.option("--verify", "do_verify", is_flag=True,
              help="Re-read and check the step's shards first; exit 1 if damaged.")
@click.option("-q", "--quiet", is_flag=True, help="CMD form: no note on stderr before exec.")
@click.option("--supervise", is_flag=True,
              help="CMD form: run CMD as a child instead of exec; pass stop signals on and exit "
                   "with the stop code the ranks logged (143/0/144), else CMD's own.")
@click.option("--signal-as", type=click.Choice(["SIGTERM", "SIGUSR1", "SIGINT"]), default=None,
              help="With --supervise: send SIGTERM/USR1/USR2/HUP on to CMD as this signal "
                   "(default: SIGTERM when CMD is torchrun, else the same signal).")
@click.option("--requeue", is_flag=True,
              help="With --supervise in a Slurm batch script: when the ranks exit 143 "
                   "(preempted, checkpoint committed), requeue the job (scontrol requeue, "
                   "StartTime=now); a cancelled job is not requeued.")
def resume(root: str, cmd: tuple[str, ...], as_json: bool, do_verify: bool, quiet: bool,
           supervise: bool, signal_as: str | None, requeue: bool) -> int:
    """The newest committed step under ROOT, or run CMD resuming from it.

    \b
    fastckpt resume ROOT              prints "STEP PATH"; exit 3 when there is none
    fastckpt resume ROOT -- CMD ARGS  execs CMD (same PID: signals reach it directly) with
                                      FASTCKPT_RESUME_STEP and FASTCKPT_RESUME_PATH set when
                                      a committed step exists (unset otherwise: a fresh
                                      start), and FASTCKPT_ROOT always
    fastckpt resume ROOT --supervise -- torchrun ...
                                      the same environment, CMD run as a child: stop signals
                                      passed on (as SIGTERM to torchrun), and the exit code
                                      is the ranks' stop code (143 preempted) when they
                                      logged one, else CMD's

    The step is the one the engine's resume loads: the newest step directory with a valid
    manifest. Newer steps whose manifest is damaged are skipped, each named in a warning on
    stderr; if every manifest is damaged, nothing runs (exit 1). A local ROOT with a remote
    tier (Checkpointer(ROOT, remote=URL)) gives the newest step of either tier, the local one
    when both have it, the remote one when every local manifest is damaged; PATH is then a
    step of ROOT or of URL ("tier" in --json).
    """
    _set_json(as_json and not cmd)
    if requeue and not supervise:
        raise CliError("--requeue needs --supervise (the supervisor requeues after CMD exits)",
                       EXIT_USAGE)
    if signal_as and not supervise:
        raise CliError("--signal-as needs --supervise (the supervisor passes the signals on; "
                       "without it CMD is exec'd and gets them as sent)", EXIT_USAGE)
    if supervise and not cmd:
        raise CliError("--supervise needs CMD (fastckpt resume ROOT --supervise -- CMD ...)",
                       EXIT_USAGE)
    if supervise:
        from .supervise import catch_early
        catch_early()  # (a stop during the start below is passed on once CMD runs)
    from ..manifest.discovery import read_small_json
    from ..tools import (VERIFIED_PREFIX, display_path, not_found_hint,
                         step_data_bytes)
    storage = _storage(root)
    rootd = display_path(storage, storage.root)
    found, own = None, storage  # (own: ROOT; a remote tier it names is read, never written)
    skipped: list = []
    tier = "local" if storage.is_local else "remote"
    try:
        found, storage, tier = _newest_of_tiers(storage, skipped)
    except CheckpointNotFoundError:
        if not cmd:
            why = not_found_hint(storage)
            if as_json:
                _emit_json({"found": False, "root": rootd, "step": None, "path": None,
                            "detail": why})
                return EXIT_NO_CHECKPOINT
            raise CliError(f"no committed checkpoint under {rootd} ({why})", EXIT_NO_CHECKPOINT,
                           hint="start fresh") from None
    except CorruptCheckpointError as e:
        raise CliError(f"every committed step is damaged: {e}", EXIT_PROBLEM,
                       hint="fastckpt ls shows the steps and why") from None
    for e in skipped:
        _echo(f"fastckpt: warning: skipped a newer step whose manifest is damaged: {e}",
              err=True)
    if found is not None and do_verify:
        res = _run_verify(storage, found, record=storage is own)  # (before 2026-12-07: always)
        if not res.ok:
            raise CliError(f"step {found[0]} is damaged: {res.problems[0]}"
                           + (f" (and {len(res.problems) - 1} more problem(s))"
                              if len(res.problems) > 1 else ""), EXIT_PROBLEM,
                           hint=f"run: fastckpt verify {root} --step {found[0]}")
    if cmd:
        env = dict(os.environ)
        env.pop(ENV_STEP, None)
        env.pop(ENV_PATH, None)
        env[ENV_ROOT] = rootd
        if found is not None:
            env[ENV_STEP] = str(found[0])
            env[ENV_PATH] = display_path(storage, found[1])
        from .supervise import is_torchrun, torchrun_env
        env.update(torchrun_env(cmd, env))  # (torchrun waits the ranks' window, not 30 s)
        mapped = {} if is_torchrun(cmd) else torch_env_from_slurm(env)
        env.update(mapped)  # a rank srun started: torch.distributed's variables from Slurm's
        if mapped and not quiet:
            _echo("fastckpt: from Slurm: " + " ".join(f"{k}={v}" for k, v in mapped.items()),
                  err=True)
        if not quiet:
            what = (f"resuming from step {found[0]} ({env[ENV_PATH]})" if found is not None
                    else f"no committed checkpoint under {rootd}: starting fresh")
            how = "run" if supervise else "exec"
            _echo(f"fastckpt: {what}; {how} {' '.join(cmd)}", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        _restore_signals()
        try:
            if supervise:
                from . import supervise as sup
                events = sup.events_dir(root)
                if events is None:  # a remote ROOT: the ranks log here, where it is read
                    events = sup.local_events(root)
                    env.update(sup.event_log_env(events))
                return sup.run(cmd, env, events=events, signal_as=signal_as,
                               echo=lambda m: _echo(m, err=True), requeue=requeue)
            os.execvpe(cmd[0], list(cmd), env)
        except FileNotFoundError:
            raise CliError(f"command not found: {cmd[0]}", EXIT_NOT_FOUND,
                           hint="check PATH or give the full path") from None
        except PermissionError:
            raise CliError(f"command not executable: {cmd[0]}", EXIT_NOT_EXECUTABLE) from None
        except OSError as e:
            raise CliError(f"cannot run {cmd[0]}: {e.strerror or e}", EXIT_NOT_EXECUTABLE) from None
    step, d, body = found  # type: ignore[misc]
    path = display_path(storage, d)
    # checked: by --verify now, or by a `fastckpt verify` of this very save (its record)
    verified, verified_unix = bool(do_verify), None
    if not verified:
        rec = read_small_json(storage, f"{d}/{VERIFIED_PREFIX}{body['save_id']}") or {}
        if rec.get("ok") is True and rec.get("save_id") == body["save_id"]:
            verified, verified_unix = True, rec.get("verified_unix")
    if as_json:
        _emit_json({"found": True, "root": rootd, "step": step, "path": path, "tier": tier,
                    "save_id": body.get("save_id"), "created": body.get("created"),
                    "created_unix": body.get("created_unix"),
                    "world_size": body.get("world_size"), "bytes": step_data_bytes(body),
                    "verified": verified, "verified_unix": verified_unix,
                    "skipped_damaged": [str(e) for e in skipped]})
    else:
        _echo(f"{step} {path}")
    return EXIT_OK


def _newest_of_tiers(storage: Any, skipped: list) -> tuple[tuple, Any, str]:
    """(step, dir, body), storage and tier of the newest committed step of a root and of the
    remote tier it names, the local one on a tie (what a tiered resume loads); every local
    manifest damaged: "no local step" if the remote tier has one (before 2026-12-06: exit 1)."""
    from ..tools import newest_committed, remote_tier
    local = damaged = None
    try:
        local = newest_committed(storage, skipped=skipped)
    except CheckpointNotFoundError:
        pass
    except CorruptCheckpointError as e:  # (raised below unless the remote tier has a step,
        damaged = e                      # as the engine's resume loads it)
    tier = "local" if storage.is_local else "remote"
    remote = remote_tier(storage)
    if remote is not None:
        try:
            other = newest_committed(remote[1])
        except (CheckpointNotFoundError, CorruptCheckpointError):
            other = None
        except Exception as e:  # noqa: BLE001 - an unreachable remote: the newest is unknown
            # (not "the local tier alone": a job restarted from an older local step, or from
            # scratch, would overwrite the remote tier's newer steps)
            raise CliError(f"the remote tier {remote[0]} could not be read ({e}): the newest "
                           "step is unknown", EXIT_STORAGE,
                           hint="retry when the store answers") from None
        if other is not None and (local is None or other[0] > local[0]):
            skipped.extend([damaged] if damaged is not None else [])  # (warned of)
            return other, remote[1], "remote"
    if damaged is not None:
        raise damaged
    if local is None:
        raise CheckpointNotFoundError("no committed checkpoint")
    return local, storage, tier


# ------------------------------------------------------------------------------------- ls

@cli.command(name="ls", epilog=EXIT_CODES_HELP)
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option("--grace", type=SecondsType(), default=None,
              help="A partial step with activity this recent is shown as 'writing' "
                   "(default: the engine's in-flight grace, 3600).")
def ls_cmd(root: str, as_json: bool, grace: float | None) -> int:
    """One row per step: step, state, time, size, world size, checksum status.

    \b
    state:    committed | partial (abandoned save) | writing (a save may be running)
              | corrupt (the manifest fails validation)
    checksum: verified | FAILED (what the last `fastckpt verify` of this save found)
              | unverified; '-' when not committed
    """
    _set_json(as_json)
    from ..retention import INFLIGHT_GRACE_S
    from ..tools import describe_steps, display_path
    from ..tools import remote_tier
    storage = _storage(root, must_exist=True)
    recs = describe_steps(storage, grace=INFLIGHT_GRACE_S if grace is None else grace,
                          indexes="listed")
    rootd = display_path(storage, storage.root)
    remote = remote_tier(storage)
    rrecs, rerr = [], None
    if remote is not None:
        try:
            rrecs = describe_steps(remote[1], grace=INFLIGHT_GRACE_S if grace is None else grace,
                                   indexes="listed")
        except Exception as e:  # noqa: BLE001 - shown, the local tier is still listed
            rerr = f"{type(e).__name__}: {e}"
    if as_json:
        doc: dict = {"root": rootd, "steps": [r.to_json() for r in recs]}
        if remote is not None:
            doc["remote"] = {"root": remote[0], "steps": [r.to_json() for r in rrecs],
                             "error": rerr}
        _emit_json(doc)
        return EXIT_OK
    if remote is not None:
        _print_steps(rrecs, f"remote tier {remote[0]}")
        if rerr:
            _echo(f"warning: the remote tier {remote[0]} could not be listed: {rerr}", err=True)
        _echo(f"local tier {rootd}:")
    if not recs:
        _echo(f"no step directories under {rootd}", err=True)
        return EXIT_OK
    t = _table("STEP", "STATE", "CREATED", "SIZE", "RANKS", "CHECKSUM", "NOTE")
    for r in recs:
        chk = {"verified": "verified", "failed": "FAILED", "unverified": "unverified"}.get(
            r.checksum or "", "-")
        note = "latest" if r.latest else (r.error or "")
        if r.state == "writing":
            note = "in-flight marker" if r.inflight_since else "recently modified"
        _add_row(t, str(r.step), r.state, _when(r.created_unix), _hb(r.size_bytes),
                  str(r.world_size) if r.world_size else "-", chk, note)
    _print_table(t)
    newest = recs[-1]
    committed = [r for r in recs if r.committed]
    corrupt_after = [r for r in recs if r.state == "corrupt"
                     and (not committed or r.step > committed[-1].step)]
    if corrupt_after:
        then = (f"resume skips it and loads step {committed[-1].step}" if committed
                else "there is no valid step to resume from")
        _echo(f"warning: step {corrupt_after[-1].step}'s manifest is damaged; {then}", err=True)
    elif not committed and newest:
        _echo("no committed step: a resume starts fresh", err=True)
    return EXIT_OK


# --------------------------------------------------------------------------------- verify

def _print_steps(recs: list, title: str) -> None:
    """A tier's steps, compactly (the remote tier of a local root)."""
    _echo(f"{title}:")
    if not recs:
        _echo("  no step directories")
        return
    t = _table("STEP", "STATE", "CREATED", "SIZE", "RANKS", "CHECKSUM", "NOTE")
    for r in recs:
        chk = {"verified": "verified", "failed": "FAILED", "unverified": "unverified"}.get(
            r.checksum or "", "-")
        _add_row(t, str(r.step), r.state, _when(r.created_unix), _hb(r.size_bytes),
                  str(r.world_size) if r.world_size else "-", chk,
                  "latest" if r.latest else (r.error or ""))
    _print_table(t)


def _run_verify(storage: Any, found: tuple, *, record: bool, jobs: int = 4) -> Any:
    from ..tools import step_data_bytes, verify_step
    total = step_data_bytes(found[2])
    with _progress(transfer=True) as prog:
        task = prog.add_task(f"verify step {found[0]}", total=total) if prog else None

        def advance(n: int) -> None:
            if prog is not None:
                prog.update(task, advance=n)
        return verify_step(storage, found=found, progress=advance, record=record, jobs=jobs)


@cli.command(epilog=EXIT_CODES_HELP)
@click.argument("root")
@click.option("--step", type=int, default=None, help="The step to verify (default: the newest "
              "committed, the one a resume loads).")
@click.option("--all", "all_steps", is_flag=True, help="Verify every committed step.")
@click.option("--jobs", type=click.IntRange(1, 64), default=4, show_default=True,
              help="Files checked in parallel.")
@click.option("--no-record", is_flag=True, help="Do not record the result in the step "
              "directory (.verified-<save_id> / .verify-failed-<save_id>).")
@click.option("--tier", type=click.Choice(["local", "remote", "all"]), default="all",
              show_default=True, help="With a remote tier (Checkpointer(ROOT, remote=URL)): "
              "which tier's steps to verify.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def verify(root: str, step: int | None, all_steps: bool, jobs: int, no_record: bool,
           tier: str, as_json: bool) -> int:
    """Re-read every shard of a committed step and check it against its manifest.

    Checks each file's presence and size, every tensor chunk's checksum, that the alignment
    padding is zero and, for manifests that record one (older formats), each file's whole
    checksum; compressed frames are decoded; names each bad file, tensor and byte
    offset. Exit 1 on any problem. The result is recorded for `fastckpt ls`. A local ROOT
    with a remote tier: each tier's step (--tier to pick one).
    """
    _set_json(as_json)
    from ..tools import display_path, remote_tier
    storage = _storage(root)
    if step is not None and all_steps:
        raise click.UsageError("--step and --all exclude each other")
    tiers = [("local" if storage.is_local else None, storage)]
    remote = remote_tier(storage) if tier in ("remote", "all") else None
    if tier == "remote" and remote is None:
        raise CliError(f"{root} names no remote tier", EXIT_USAGE)
    if tier == "remote":
        tiers = []
    if remote is not None:
        tiers.append(("remote", remote[1]))
    results: list = []
    problems_outside: list[dict] = []
    for name, st in tiers:
        try:
            r, p = _verify_tier(st, step, all_steps, jobs, no_record, as_json,
                                name if len(tiers) > 1 or name == "remote" else None)
        except CliError:
            if name == "remote" and len(tiers) > 1 and step is not None:
                continue  # the step is committed in one tier only
            raise
        results += r
        problems_outside += p
    ok = all(r.ok for r in results) and not problems_outside
    if as_json:
        rootd = display_path(storage, storage.root)
        _emit_json({"root": rootd, "ok": ok, "steps": [
            dict(r.to_json(), **({"tier": getattr(r, "tier")} if getattr(r, "tier", None)
                                 else {})) for r in results] + problems_outside})
    return EXIT_OK if ok else EXIT_PROBLEM


def _verify_tier(storage: Any, step: int | None, all_steps: bool, jobs: int, no_record: bool,
                 as_json: bool, tier: str | None) -> tuple[list, list]:
    """Verify the requested steps of one root (a tier): (results, manifest problems)."""
    from ..manifest.discovery import find_step
    from ..tools import describe_steps, display_path
    targets: list[tuple] = []
    problems_outside: list[dict] = []
    rootd = display_path(storage, storage.root)
    try:
        if all_steps:  # (each step's indexes are read by its verification)
            recs = describe_steps(storage, indexes="listed")
            for r in recs:
                if r.state == "corrupt":
                    problems_outside.append({"step": r.step, "path": r.path, "ok": False,
                                             "problems": [{"kind": "manifest",
                                                           "message": r.error}]})
                elif r.committed:
                    targets.append((r.step, None))
            if not targets and not problems_outside:
                raise CheckpointNotFoundError(f"no committed checkpoint under {rootd}")
        else:
            targets.append((step, None))
    except CheckpointNotFoundError:
        raise _not_found(storage, None) from None
    results = []
    for s, _ in targets:
        try:
            found = find_step(storage, s)
        except CheckpointNotFoundError:
            raise _not_found(storage, s) from None
        except CorruptCheckpointError as e:
            from ..manifest import schema as fmt
            bad_step = s
            if bad_step is None and e.file:  # the newest step's manifest
                bad_step = fmt.parse_step_dirname(e.file.rstrip("/").split("/")[-2])
            problems_outside.append({"step": bad_step, "path": e.file, "ok": False, "problems": [
                {"kind": "manifest", "message": str(e), "file": e.file}]})
            continue
        # the remote tier a root names is read, never written (its URL came from the root)
        res = _run_verify(storage, found, record=not no_record and tier != "remote", jobs=jobs)
        res.tier = tier
        results.append(res)
        if not as_json:
            if tier:
                _echo(f"{tier} tier ({rootd}):")
            _report_verify(res)
    for p in problems_outside:
        if tier:
            p["tier"] = tier
        if not as_json:
            _echo(f"step {p['step']}: DAMAGED manifest: {p['problems'][0]['message']}")
    return results, problems_outside


def _report_verify(res: Any) -> None:
    rate = _rate(res.bytes_checked, res.seconds)
    if res.ok:
        frames = f" ({res.frames_checked} zstd frames decoded)" if res.frames_checked else ""
        _echo(f"step {res.step}: OK: {res.files_checked} file(s), {res.chunks_checked} chunk(s)"
              f"{frames}, {_hb(res.bytes_checked)} checked in {res.seconds:.2f} s ({rate})")
    for note in res.notes:
        _echo(f"note: {note}", err=True)
    if not res.ok:  # (before 2026-12-07 a for-else: "0 PROBLEM(S)" after every OK)
        _echo(f"step {res.step}: {len(res.problems)} PROBLEM(S) in {res.path}")
        for p in res.problems:
            _echo(f"  {p.kind.upper()}: {p}")
    if res.record_error:
        _echo(f"note: could not record the result: {res.record_error}", err=True)


# ------------------------------------------------------------------------------------- gc

@cli.command(epilog=EXIT_CODES_HELP)
@click.argument("root")
@click.option("--keep", type=click.IntRange(min=1), default=None, metavar="N",
              help="Keep the newest N committed steps (default: remove no committed step).")
@click.option("--yes", is_flag=True, help="Remove for real (default: dry run).")
@click.option("--grace", type=SecondsType(), default=None,
              help="A partial step with an in-flight marker or a file younger than this is "
                   "left alone (default 3600, the engine's).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def gc(root: str, keep: int | None, yes: bool, grace: float | None, as_json: bool) -> int:
    """Remove abandoned partial steps and committed steps older than the newest N.

    A dry run unless --yes. Never removes the newest committed step, a step that may be
    being written (recent in-flight marker or file), or a step with a damaged manifest.
    Removal deletes the manifest first: an interrupted gc leaves partial steps, never a
    committed step with shards missing. Also removes the leftovers of committed steps (the
    marker of a save that committed, temporary files) and, on object stores, aborts the
    unfinished multipart uploads under ROOT older than --grace.
    """
    _set_json(as_json)
    from ..retention import INFLIGHT_GRACE_S
    from ..tools import abort_uploads, display_path, plan_gc, run_gc, stale_uploads
    storage = _storage(root, must_exist=True)
    g = INFLIGHT_GRACE_S if grace is None else grace
    actions = plan_gc(storage, keep, grace=g)
    uploads = stale_uploads(storage, grace=g)
    aborted = abort_uploads(storage, uploads) if yes else []
    doomed = [a for a in actions if a.remove]
    rootd = display_path(storage, storage.root)
    if yes and (doomed or any(a.leftovers for a in actions)):
        with _progress() as prog:
            task = prog.add_task("removing", total=len(doomed)) if prog else None

            def advance(a: Any) -> None:
                if prog is not None:
                    prog.update(task, advance=1, description=f"removed step {a.record.step}")
            run_gc(storage, actions, grace=g, progress=advance)
    freed = sum(a.record.size_bytes for a in actions if a.done)
    planned = sum(a.record.size_bytes for a in doomed)
    if as_json:
        _emit_json({"root": rootd, "dry_run": not yes, "keep": keep,
                    "actions": [a.to_json() for a in actions],
                    "removed": [a.record.step for a in actions if a.done],
                    "would_remove": [] if yes else [a.record.step for a in doomed],
                    "bytes": freed if yes else planned,
                    "uploads": uploads, "uploads_aborted": aborted})
        return EXIT_OK
    if uploads:
        what = "aborted" if yes else "would abort (--yes)"
        _echo(f"{what} {len(uploads)} unfinished multipart upload(s) older than {g:.0f} s: "
              + ", ".join(u["url"] for u in uploads[:5]) + (" ..." if len(uploads) > 5 else ""))
    if not actions:
        _echo(f"no step directories under {rootd}", err=True)
        return EXIT_OK
    t = _table("STEP", "STATE", "SIZE", "ACTION", "REASON")
    for a in actions:
        act = ("removed" if a.done else "skipped" if a.skipped else
               "remove" if a.remove else "keep")
        why = a.skipped or a.reason
        if a.leftovers:
            n = len(a.leftovers_removed) if yes else len(a.leftovers)
            why += f"; {n} leftover file(s) {'removed' if yes else 'to remove'}"
        _add_row(t, str(a.record.step), a.record.state, _hb(a.record.size_bytes), act, why)
    _print_table(t)
    if not yes:
        if doomed:
            _echo(f"dry run: would remove {len(doomed)} step(s), {_hb(planned)}; "
                  "re-run with --yes to remove them")
        else:
            _echo("nothing to remove")
    else:
        n = sum(1 for a in actions if a.done)
        _echo(f"removed {n} step(s), {_hb(freed)}")
    return EXIT_OK


# -------------------------------------------------------------------------------- inspect

def _shape(s: list) -> str:
    return "[" + ", ".join(map(str, s)) + "]"


@cli.command(epilog=EXIT_CODES_HELP)
@click.argument("root")
@click.option("--step", type=int, default=None, help="Default: the newest committed step.")
@click.option("--chunks", is_flag=True, help="Also list every chunk (rank, file, offset).")
@click.option("--filter", "pattern", default=None, metavar="GLOB",
              help="Only tensors whose name matches (e.g. 'model.*').")
@click.option("--values/--no-values", default=True, show_default=True,
              help="Show the plain (non-tensor) values.")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def inspect(root: str, step: int | None, chunks: bool, pattern: str | None, values: bool,
            as_json: bool) -> int:
    """The tensors of a committed step: dtypes, shapes, sharding and sizes."""
    _set_json(as_json)
    from ..tools import inspect_step
    storage = _storage(root)
    try:
        doc = inspect_step(storage, step)
    except CheckpointNotFoundError:
        raise _not_found(storage, step) from None
    if pattern:  # tensors and plain values alike, by key path
        doc["tensors"] = [t for t in doc["tensors"] if fnmatch.fnmatchcase(t["name"], pattern)]
        if doc["plain_values_per_rank"]:
            doc["plain_values"] = {r: {k: v for k, v in kv.items()
                                       if fnmatch.fnmatchcase(k, pattern)}
                                   for r, kv in doc["plain_values"].items()}
        else:
            doc["plain_values"] = {k: v for k, v in doc["plain_values"].items()
                                   if fnmatch.fnmatchcase(k, pattern)}
    if as_json:
        for t in doc["tensors"]:
            t["chunks_count"] = len(t["chunks"])
            if not chunks:  # the chunk lists of a big sharded model are long: --chunks
                del t["chunks"]
        _emit_json(doc)
        return EXIT_OK
    _echo(f"step {doc['step']}  {doc['path']}")
    _echo(f"  created {_shown(doc['created'])}  save {doc['save_id']}  world size "
          f"{doc['world_size']}  fastckpt {_shown(doc['fastckpt_version'])}  torch "
          f"{_shown(doc['torch_version'])}")
    _echo(f"  {len(doc['files'])} shard file(s), {_hb(doc['data_bytes'])}; "
          f"{len(doc['tensors'])} tensor(s)" + (f" matching {pattern!r}" if pattern else ""))
    t = _table("TENSOR", "DTYPE", "SHAPE", "SIZE", "SHARDING")
    total = 0
    for x in doc["tensors"]:
        total += x["bytes"]
        _add_row(t, _shown(x["name"]), x["dtype"], _shape(x["shape"]), _hb(x["bytes"]),
                 _shown(x["sharding"]))
        if chunks:
            for c in x["chunks"]:
                box = "+".join(_shape(v) for v in (c["offsets"], c["sizes"]))
                _add_row(t, f"  chunk {box}", "", "", _hb(c["length"]),
                          f"rank {c['rank']}, {c['file']} @ {c['offset']}"
                          + (f" ({c['codec']})" if c.get("codec") else ""))
    _print_table(t)
    _echo(f"total tensor bytes: {_hb(total)}")
    if values and doc["plain_values"]:
        _echo("plain values" + (" (per rank)" if doc["plain_values_per_rank"] else "") + ":")
        flat = doc["plain_values"]
        if doc["plain_values_per_rank"]:
            flat = {f"{r}: {k}": v for r, kv in flat.items() for k, v in kv.items()}
        for k, v in flat.items():
            _echo(f"  {_shown(k)} = {json.dumps(v, default=str)}")
    if doc["user_meta"]:
        _echo(f"user_meta: {json.dumps(doc['user_meta'], default=str)}")
    return EXIT_OK


def _shown(x: object) -> str:
    """A string of a manifest (untrusted) as printed: its non-printable characters escaped
    (``\\x1b``), so that no terminal escape sequence a crafted manifest holds reaches the
    terminal; ``json.dumps`` escapes the plain values and ``user_meta`` already."""
    s = str(x)
    return s if s.isprintable() else "".join(c if c.isprintable() else repr(c)[1:-1] for c in s)
