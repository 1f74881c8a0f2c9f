"""The ``fastckpt`` command: resume, ls, verify, gc, inspect, bench, info.

Every command works on a local path or an fsspec URL, has ``--json``, shows progress on a
terminal (on stderr) and stays quiet when piped, and reports expected conditions as one line
on stderr with what to do. The work is done by :mod:`fastckpt.tools` and :mod:`fastckpt.bench`,
which are usable from Python. Exit codes (also in ``fastckpt --help`` and docs/cli.md):

    0    success (verify: no problem found)
    1    a problem was found: verify found damage, or a damaged manifest blocks the command
    2    usage error (bad option or argument, not enough memory/disk for the bench size)
    3    no committed checkpoint (resume: a fresh start, not an error; inspect/verify: nothing
         to look at; --step N not committed)
    4    storage error: the root cannot be read (or, for gc/verify records/bench, written);
         missing fsspec backend
    70   internal error (a bug: the traceback is printed)
    126  resume -- CMD: CMD is not executable      127  resume -- CMD: CMD not found
    130  interrupted (Ctrl-C)    141  stdout was closed early (``fastckpt ls ROOT | head``)
"""

from __future__ import annotations

import fnmatch
import json
import os
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from typing import Any, Iterator

import click

from . import __version__
from .errors import (CheckpointNotFoundError, CorruptCheckpointError, FastCkptError,
                     StorageError)

EXIT_OK = 0
EXIT_PROBLEM = 1
EXIT_USAGE = 2
EXIT_NO_CHECKPOINT = 3
EXIT_STORAGE = 4
EXIT_INTERNAL = 70
EXIT_NOT_EXECUTABLE = 126
EXIT_NOT_FOUND = 127
EXIT_INTERRUPTED = 130
EXIT_BROKEN_PIPE = 141  # stdout closed early (as if killed by SIGPIPE)

EXIT_CODES_HELP = """\b
Exit codes:
  0    success (verify: no problem found)
  1    problem found (verify found damage; a damaged manifest blocks the command)
  2    usage error
  3    no committed checkpoint (resume: start fresh; --step N not committed)
  4    storage error: the root cannot be read (or written: gc, bench)
  70   internal error (a bug)
  126/127  resume -- CMD: CMD not executable / not found
  130  interrupted; 141 stdout closed early (| head)"""

ENV_STEP = "FASTCKPT_RESUME_STEP"
ENV_PATH = "FASTCKPT_RESUME_PATH"
ENV_ROOT = "FASTCKPT_ROOT"

_json_mode = False  # set by a command given --json: errors are then also printed as JSON


class CliError(Exception):
    """An expected condition: one line on stderr, then exit with ``code``."""

    def __init__(self, message: str, code: int = EXIT_PROBLEM, *, hint: str | None = None,
                 data: dict | None = None) -> None:
        self.code = code
        self.hint = hint
        self.data = data or {}
        super().__init__(message)

    def line(self) -> str:
        msg = str(self).rstrip(".")
        return f"{msg}; {self.hint}" if self.hint else msg


# ------------------------------------------------------------------------------- consoles

def _out():
    from rich.console import Console
    tty = sys.stdout.isatty()
    return Console(highlight=False, soft_wrap=not tty, width=None if tty else 400)


def _err():
    from rich.console import Console
    return Console(stderr=True, highlight=False)


def _echo(text: str = "", *, err: bool = False) -> None:
    click.echo(text, err=err)


def _emit_json(obj: Any) -> None:
    click.echo(json.dumps(obj, indent=1, default=str))


def _set_json(flag: bool) -> None:
    global _json_mode
    _json_mode = bool(flag)


@contextmanager
def _progress(transfer: bool = False) -> Iterator[Any]:
    """A rich Progress on stderr when it is a terminal, else None (quiet when piped)."""
    err = _err()
    if not err.is_terminal or os.environ.get("FASTCKPT_NO_PROGRESS"):
        yield None
        return
    from rich.progress import (BarColumn, DownloadColumn, Progress, SpinnerColumn, TextColumn,
                               TimeElapsedColumn, TransferSpeedColumn)
    cols: list = [SpinnerColumn(), TextColumn("{task.description}")]
    if transfer:
        cols += [BarColumn(), DownloadColumn(binary_units=True), TransferSpeedColumn()]
    cols.append(TimeElapsedColumn())
    with Progress(*cols, console=err, transient=True) as p:
        yield p


def _table(*headers: str, title: str | None = None):
    from rich import box
    from rich.table import Table
    t = Table(*headers, box=box.SIMPLE_HEAD if sys.stdout.isatty() else None, title=title,
              show_edge=False, pad_edge=False, header_style="bold" if sys.stdout.isatty()
              else None)
    return t


def _add_row(table: Any, *cells: str) -> None:
    from rich.text import Text
    table.add_row(*(Text(str(c)) for c in cells))  # no markup: names and paths may hold "[...]"


def _print_table(table: Any) -> None:
    con = _out()
    if sys.stdout.isatty():
        con.print(table)
        return
    with con.capture() as cap:
        con.print(table)
    for line in cap.get().splitlines():
        click.echo(line.rstrip())


def _storage(root: str):
    from .tools import as_storage
    try:
        return as_storage(root)
    except ImportError as e:
        raise CliError(f"cannot open {root}: {e}", EXIT_STORAGE) from None
    except ValueError as e:
        raise CliError(f"cannot open {root}: {e}", EXIT_USAGE) from None


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _hb(n: float | None) -> str:
    from .tools import human_bytes
    return human_bytes(n)


def _rate(nbytes: float | None, secs: float | None) -> str:
    if not nbytes or not secs:
        return "-"
    return f"{_hb(nbytes / secs)}/s"


# ------------------------------------------------------------------------------ the group

def _backend_line() -> tuple[str, str | None]:
    """(backend name, why native is not used or None)."""
    from . import _native
    from .options import options_from_env
    try:
        mode = options_from_env().native
    except ValueError as e:
        return "unknown", str(e)
    try:
        name = _native.get_backend(mode).name
    except ImportError as e:
        return "none", str(e)
    if name == "native":
        return name, None
    if mode == "off":
        return name, "FASTCKPT_NATIVE=off"
    return name, f"native extension not loaded: {_native.native_error()}"


def _version_cb(ctx: click.Context, _param: Any, value: bool) -> None:
    if not value or ctx.resilient_parsing:
        return
    name, why = _backend_line()
    click.echo(f"fastckpt {__version__} (I/O backend: {name}{'; ' + why if why else ''})")
    ctx.exit(0)


@click.group(epilog=EXIT_CODES_HELP, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--version", is_flag=True, expose_value=False, is_eager=True, callback=_version_cb,
              help="Print the version and the I/O backend, then exit.")
def cli() -> None:
    """fastckpt: inspect, verify, clean up and benchmark checkpoints.

    ROOT is a checkpoint root: a local directory or an fsspec URL (s3://bucket/run,
    memory://..., file:///...). Every command accepts --json.
    """


# ----------------------------------------------------------------------------------- info

@cli.command(epilog=EXIT_CODES_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def info(as_json: bool) -> int:
    """The fastckpt version, the I/O backend in use and why, optional packages."""
    _set_json(as_json)
    import importlib.util
    import platform

    from . import _native
    name, why = _backend_line()
    opt = {}
    for mod, use in (("s3fs", "s3:// roots"), ("gcsfs", "gs:// roots"),
                     ("matplotlib", "bench PNG chart")):
        opt[mod] = {"installed": importlib.util.find_spec(mod) is not None, "for": use}
    import fsspec
    import torch
    doc = {"fastckpt_version": __version__, "python": platform.python_version(),
           "torch_version": str(torch.__version__), "fsspec_version": fsspec.__version__,
           "io_backend": name, "native_available": _native.native_available(),
           "native_error": _native.native_error(), "io_backend_note": why,
           "FASTCKPT_NATIVE": os.environ.get("FASTCKPT_NATIVE"), "optional": opt}
    if as_json:
        _emit_json(doc)
        return EXIT_OK
    _echo(f"fastckpt {__version__}")
    _echo(f"python {doc['python']}, torch {doc['torch_version']}, fsspec {doc['fsspec_version']}")
    _echo(f"I/O backend: {name}" + (f" ({why})" if why else " (C extension loaded)"))
    for mod, o in opt.items():
        _echo(f"  {mod:<11} {'yes' if o['installed'] else 'no ':<4} ({o['for']})")
    return EXIT_OK


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
def resume(root: str, cmd: tuple[str, ...], as_json: bool, do_verify: bool, quiet: bool) -> int:
    """The newest committed step under ROOT, or run CMD resuming from it.

    \b
    fastckpt resume ROOT              prints "STEP PATH"; exit 3 when there is none
    fastckpt resume ROOT -- CMD ARGS  execs CMD (same PID: signals reach it directly) with
                                      FASTCKPT_RESUME_STEP and FASTCKPT_RESUME_PATH set when
                                      a committed step exists (unset otherwise: a fresh
                                      start), and FASTCKPT_ROOT always

    The step is the one the engine's resume loads: the newest step directory with a valid
    manifest. Newer steps whose manifest is damaged are skipped, each named in a warning on
    stderr; if every manifest is damaged, nothing runs (exit 1).
    """
    _set_json(as_json and not cmd)
    from .tools import display_path, newest_committed, not_found_hint, step_data_bytes
    storage = _storage(root)
    rootd = display_path(storage, storage.root)
    found = None
    skipped: list = []
    try:
        found = newest_committed(storage, skipped=skipped)
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
        res = _run_verify(storage, found, record=True)
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
        if not quiet:
            what = (f"resuming from step {found[0]} ({env[ENV_PATH]})" if found is not None
                    else f"no committed checkpoint under {rootd}: starting fresh")
            _echo(f"fastckpt: {what}; exec {' '.join(cmd)}", err=True)
        sys.stdout.flush()
        sys.stderr.flush()
        _restore_signals()
        try:
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
    if as_json:
        _emit_json({"found": True, "root": rootd, "step": step, "path": path,
                    "save_id": body.get("save_id"), "created": body.get("created"),
                    "created_unix": body.get("created_unix"),
                    "world_size": body.get("world_size"), "bytes": step_data_bytes(body),
                    "verified": bool(do_verify), "skipped_damaged": [str(e) for e in skipped]})
    else:
        _echo(f"{step} {path}")
    return EXIT_OK


# ------------------------------------------------------------------------------------- ls

@cli.command(name="ls", epilog=EXIT_CODES_HELP)
@click.argument("root")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
@click.option("--grace", type=float, default=None, metavar="SECONDS",
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
    from .retention import INFLIGHT_GRACE_S
    from .tools import describe_steps, display_path
    storage = _storage(root)
    recs = describe_steps(storage, grace=INFLIGHT_GRACE_S if grace is None else grace)
    rootd = display_path(storage, storage.root)
    if as_json:
        _emit_json({"root": rootd, "steps": [r.to_json() for r in recs]})
        return EXIT_OK
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

def _run_verify(storage: Any, found: tuple, *, record: bool, jobs: int = 4) -> Any:
    from .tools import step_data_bytes, verify_step
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
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def verify(root: str, step: int | None, all_steps: bool, jobs: int, no_record: bool,
           as_json: bool) -> int:
    """Re-read every shard of a committed step and check it against its manifest.

    Checks each file's presence and size, every tensor chunk's checksum, that the alignment
    padding is zero and each file's whole checksum; names each bad file, tensor and byte
    offset. Exit 1 on any problem. The result is recorded for `fastckpt ls`.
    """
    _set_json(as_json)
    from .reader import find_step
    from .tools import describe_steps, display_path, not_found_hint
    storage = _storage(root)
    if step is not None and all_steps:
        raise click.UsageError("--step and --all exclude each other")
    targets: list[tuple] = []
    problems_outside: list[dict] = []
    rootd = display_path(storage, storage.root)
    try:
        if all_steps:
            recs = describe_steps(storage)
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
        raise CliError(f"no committed checkpoint under {rootd} ({not_found_hint(storage)})",
                       EXIT_NO_CHECKPOINT, hint="nothing to verify") from None
    results = []
    for s, _ in targets:
        try:
            found = find_step(storage, s)
        except CheckpointNotFoundError:
            detail = not_found_hint(storage) if s is None else "not committed or absent"
            raise CliError(f"no committed checkpoint {'' if s is None else f'at step {s} '}"
                           f"under {rootd} ({detail})", EXIT_NO_CHECKPOINT,
                           hint="see fastckpt ls") from None
        except CorruptCheckpointError as e:
            from . import format as fmt
            bad_step = s
            if bad_step is None and e.file:  # the newest step's manifest
                bad_step = fmt.parse_step_dirname(e.file.rstrip("/").split("/")[-2])
            problems_outside.append({"step": bad_step, "path": e.file, "ok": False, "problems": [
                {"kind": "manifest", "message": str(e), "file": e.file}]})
            continue
        res = _run_verify(storage, found, record=not no_record, jobs=jobs)
        results.append(res)
        if not as_json:
            _report_verify(res)
    for p in problems_outside:
        if not as_json:
            _echo(f"step {p['step']}: DAMAGED manifest: {p['problems'][0]['message']}")
    ok = all(r.ok for r in results) and not problems_outside
    if as_json:
        _emit_json({"root": rootd, "ok": ok, "steps": [r.to_json() for r in results]
                    + problems_outside})
    return EXIT_OK if ok else EXIT_PROBLEM


def _report_verify(res: Any) -> None:
    rate = _rate(res.bytes_checked, res.seconds)
    if res.ok:
        _echo(f"step {res.step}: OK: {res.files_checked} file(s), {res.chunks_checked} chunk(s), "
              f"{_hb(res.bytes_checked)} checked in {res.seconds:.2f} s ({rate})")
    else:
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
@click.option("--grace", type=float, default=None, metavar="SECONDS",
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
    from .retention import INFLIGHT_GRACE_S
    from .tools import abort_uploads, display_path, plan_gc, run_gc, stale_uploads
    storage = _storage(root)
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
    from .tools import display_path, inspect_step, not_found_hint
    storage = _storage(root)
    try:
        doc = inspect_step(storage, step)
    except CheckpointNotFoundError:
        rootd = display_path(storage, storage.root)
        what = f"at step {step} " if step is not None else ""
        raise CliError(f"no committed checkpoint {what}under {rootd} "
                       f"({not_found_hint(storage)})", EXIT_NO_CHECKPOINT,
                       hint="see fastckpt ls") from None
    if pattern:
        doc["tensors"] = [t for t in doc["tensors"] if fnmatch.fnmatchcase(t["name"], pattern)]
    if as_json:
        for t in doc["tensors"]:
            t["chunks_count"] = len(t["chunks"])
            if not chunks:  # the chunk lists of a big sharded model are long: --chunks
                del t["chunks"]
        _emit_json(doc)
        return EXIT_OK
    _echo(f"step {doc['step']}  {doc['path']}")
    _echo(f"  created {doc['created']}  save {doc['save_id']}  world size {doc['world_size']}  "
          f"fastckpt {doc['fastckpt_version']}  torch {doc['torch_version']}")
    _echo(f"  {len(doc['files'])} shard file(s), {_hb(doc['data_bytes'])}; "
          f"{len(doc['tensors'])} tensor(s)" + (f" matching {pattern!r}" if pattern else ""))
    t = _table("TENSOR", "DTYPE", "SHAPE", "SIZE", "SHARDING")
    total = 0
    for x in doc["tensors"]:
        total += x["bytes"]
        _add_row(t, x["name"], x["dtype"], _shape(x["shape"]), _hb(x["bytes"]), x["sharding"])
        if chunks:
            for c in x["chunks"]:
                box = "+".join(_shape(v) for v in (c["offsets"], c["sizes"]))
                _add_row(t, f"  chunk {box}", "", "", _hb(c["length"]),
                          f"rank {c['rank']}, {c['file']} @ {c['offset']}")
    _print_table(t)
    _echo(f"total tensor bytes: {_hb(total)}")
    if values and doc["plain_values"]:
        _echo("plain values" + (" (per rank)" if doc["plain_values_per_rank"] else "") + ":")
        flat = doc["plain_values"]
        if doc["plain_values_per_rank"]:
            flat = {f"{r}: {k}": v for r, kv in flat.items() for k, v in kv.items()}
        for k, v in flat.items():
            _echo(f"  {k} = {json.dumps(v, default=str)}")
    if doc["user_meta"]:
        _echo(f"user_meta: {json.dumps(doc['user_meta'], default=str)}")
    return EXIT_OK


# ---------------------------------------------------------------------------------- bench

def _size_type(text: str) -> int:
    from .tools import parse_size
    try:
        n = parse_size(text)
    except ValueError as e:
        raise click.BadParameter(str(e)) from None
    if n <= 0:
        raise click.BadParameter("must be positive")
    return n


class _Size(click.ParamType):
    name = "SIZE"

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            return value
        try:
            return _size_type(value)
        except click.BadParameter as e:
            self.fail(str(e.message), param, ctx)


@cli.command(epilog=EXIT_CODES_HELP)
@click.argument("target")
@click.option("--size", type=_Size(), default="1GiB", show_default=True,
              help="State size to benchmark (model + optimizer, all ranks together).")
@click.option("--ranks", type=click.IntRange(1, 1024), default=1, show_default=True,
              help="Local processes (gloo on 127.0.0.1), each saving its share.")
@click.option("--state-size", type=_Size(), default=None,
              help="The real job's state size for the grace window (default: --size).")
@click.option("--step-drain", type=float, default=30.0, show_default=True, metavar="S",
              help="Seconds to finish the running training step.")
@click.option("--barrier", type=float, default=10.0, show_default=True, metavar="S",
              help="Seconds for all ranks to reach the checkpoint.")
@click.option("--safety", type=float, default=0.25, show_default=True, metavar="FRACTION",
              help="Safety margin as a fraction of the rest (at least --safety-min).")
@click.option("--safety-min", type=float, default=30.0, show_default=True, metavar="S")
@click.option("--contenders", default=",".join(("raw", "fastckpt", "torch", "dcp")),
              show_default=True, help="Comma list of raw,fastckpt,torch,dcp.")
@click.option("--report", default="fastckpt-bench.json", show_default=True,
              help="Where to write the full JSON report ('' to skip).")
@click.option("--png", default="fastckpt-bench.png", show_default=True,
              help="Where to write the chart ('' to skip; needs matplotlib).")
@click.option("--out", default=None, help="Where to write the bandwidth record the engine "
              "reads [default: TARGET/.fastckpt-bench.json].")
@click.option("--no-record", is_flag=True, help="Do not write the engine's bandwidth record.")
@click.option("--keep-files", is_flag=True, help="Leave the benchmark's files under TARGET.")
@click.option("--force", is_flag=True, help="Run even if memory or disk looks too small.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def bench(target: str, size: int, ranks: int, state_size: int | None, step_drain: float,
          barrier: float, safety: float, safety_min: float, contenders: str, report: str,
          png: str, out: str | None, no_record: bool, keep_files: bool, force: bool,
          as_json: bool) -> int:
    """Benchmark checkpoint I/O on TARGET (a path or URL) and size the preemption window.

    Measures raw write/read bandwidth, fastckpt save/load of a synthetic model + Adam state
    of --size, and torch.save and DCP on the same bytes; prints a table with ratios, writes
    the JSON report and a PNG chart, then the grace window the job needs

    \b
      T_grace >= state/save_bandwidth + step drain + barrier + safety
      safety   = max(--safety-min, --safety x (the rest))

    with the matching Slurm --signal lead time and Kubernetes terminationGracePeriodSeconds.
    The measured bandwidths go to TARGET/.fastckpt-bench.json (or --out) for the engine.
    Needs about 2x --size of free memory and 1x of free space on TARGET.
    """
    _set_json(as_json)
    from . import bench as B
    cont = tuple(c.strip() for c in contenders.split(",") if c.strip())
    bad = set(cont) - set(B.CONTENDERS)
    if bad or not cont:
        raise click.BadParameter(f"unknown {sorted(bad)}; choose from {','.join(B.CONTENDERS)}",
                                 param_hint="--contenders")
    if safety < 0 or step_drain < 0 or barrier < 0 or safety_min < 0:
        raise click.BadParameter("must be >= 0", param_hint="--safety/--step-drain/--barrier")
    if ranks > 1 and target.startswith("memory://"):
        raise click.BadParameter("memory:// lives in one process; --ranks > 1 needs storage "
                                 "the rank processes share", param_hint="--ranks")
    need = int(size * 2.1)
    avail = B.mem_available()
    if avail is not None and need > avail and not force:
        raise CliError(f"--size {_hb(size)} needs about {_hb(need)} of free memory, "
                       f"{_hb(avail)} is available", EXIT_USAGE,
                       hint="use a smaller --size (and --state-size for the real one), "
                            "or --force")
    if B._is_local(target) and not force:
        import shutil
        probe = os.path.abspath(B._local_path(target))
        while not os.path.exists(probe) and os.path.dirname(probe) != probe:
            probe = os.path.dirname(probe)
        free = shutil.disk_usage(probe).free
        if free < size * 1.05:
            raise CliError(f"{target} has {_hb(free)} free, the benchmark needs about "
                           f"{_hb(size * 1.05)}", EXIT_USAGE, hint="use a smaller --size or "
                           "--force")
    _storage(target)  # a clear error for a missing fsspec backend
    lines: list[str] = []
    with _progress() as prog:
        task = prog.add_task("starting", total=None) if prog else None

        def emit(ev: dict) -> None:
            if prog is None:
                return
            if ev.get("event") == "start":
                prog.update(task, description=ev["phase"])
            elif ev.get("event") == "end":
                prog.console.print(f"  {ev['phase']:<20} {ev['seconds']:8.2f} s  "
                                   f"{_rate(ev.get('bytes'), ev.get('seconds')):>12}",
                                   highlight=False, markup=False)
        try:
            raw = B.run_bench(target, size, ranks=ranks, contenders=cont,
                              keep_files=keep_files, emit=emit)
        except B.BenchError as e:
            raise CliError(f"benchmark failed: {e}", EXIT_PROBLEM) from None
    rep = B.summarize(raw, state_size=state_size, step_drain_s=step_drain, barrier_s=barrier,
                      safety_fraction=safety, safety_min_s=safety_min)
    files: dict[str, str | None] = {"report": None, "png": None, "record": None}
    if png:
        files["png"] = B.write_png(rep, png)
        if files["png"] is None:
            lines.append("note: no PNG chart: matplotlib is not installed (pip install matplotlib)")
    if not no_record:
        try:
            files["record"] = B.write_record(B.engine_record(rep), target, out)
        except (StorageError, OSError) as e:
            lines.append(f"note: could not write the bandwidth record: {e}")
    rep["files"] = files
    if report:
        p = os.path.abspath(report)
        os.makedirs(os.path.dirname(p), exist_ok=True)
        with open(p, "w") as f:
            json.dump(rep, f, indent=1, default=str)
            f.write("\n")
        files["report"] = p
    if as_json:
        _emit_json(rep)
    else:
        _print_bench(rep)
        for ln in lines:
            _echo(ln, err=True)
    return EXIT_OK


def _x(v: float | None) -> str:
    return f"{v:.2f}x" if v else "-"


def _print_bench(rep: dict) -> None:
    gib = float(1 << 30)
    _echo(f"fastckpt bench: {rep['target']}  state {_hb(rep['state_bytes'])}, {rep['ranks']} "
          f"rank(s), I/O backend {rep.get('io_backend') or '-'}, page cache {rep['cache']}")
    t = _table("METHOD", "WRITE/SAVE", "GiB/s", "VS RAW", "READ/LOAD", "GiB/s", "VS RAW")
    for r in rep["rows"]:
        if r.get("skipped"):
            _add_row(t, r["label"], "skipped", "", "", "", "", r["skipped"][:60])
            continue
        _add_row(t, r["label"],
                  f"{r['write_s']:.2f} s" if r["write_s"] else "-",
                  f"{r['write_bytes_per_s'] / gib:.2f}" if r["write_bytes_per_s"] else "-",
                  _x(r["write_vs_raw"]),
                  f"{r['read_s']:.2f} s" if r["read_s"] else "-",
                  f"{r['read_bytes_per_s'] / gib:.2f}" if r["read_bytes_per_s"] else "-",
                  _x(r["read_vs_raw"]))
    _print_table(t)
    for name, sp in rep["fastckpt_speedup"].items():
        label = {"torch": "torch.save", "dcp": "DCP"}[name]
        _echo(f"fastckpt vs {label}: save {sp['save']:.2f}x, load {sp['load']:.2f}x "
              "(>1: fastckpt is faster)")
    if rep.get("fastckpt_staged_s") is not None:
        _echo(f"training blocked by a fastckpt save (staging): {rep['fastckpt_staged_s']:.2f} s")
    first = rep.get("fastckpt_first_save") or {}
    if first.get("save_s"):
        _echo(f"first fastckpt save of a process (allocates the staging buffer): "
              f"{first['save_s']:.2f} s, of which staging {first['staged_s']:.2f} s")
    g = rep.get("grace")
    if g and g["seconds"]:
        _echo("")
        _echo(f"Grace window for a {_hb(g['state_bytes'])} state (fastckpt save at "
              f"{_hb(g['save_bytes_per_s'])}/s):")
        _echo(f"  T_grace >= {g['write_s']:.2f} s write + {g['step_drain_s']:.0f} s step drain + "
              f"{g['barrier_s']:.0f} s barrier + {g['safety_s']:.0f} s safety = {g['seconds']} s")
        _echo(f"  Slurm:      #SBATCH --signal=USR1@{g['seconds']}   (B:USR1@{g['seconds']} when "
              "the batch script itself runs training; for preemption, GraceTime >= "
              f"{g['seconds']} s)")
        _echo(f"  Kubernetes: terminationGracePeriodSeconds: {g['seconds']}")
    f = rep.get("files", {})
    wrote = [v for v in (f.get("report"), f.get("png"), f.get("record")) if v]
    if wrote:
        _echo("wrote " + ", ".join(wrote))


# ------------------------------------------------------------------------------------ main

def _code_for(e: BaseException) -> int:
    if isinstance(e, CheckpointNotFoundError):
        return EXIT_NO_CHECKPOINT
    if isinstance(e, StorageError):
        return EXIT_STORAGE
    return EXIT_PROBLEM  # CorruptCheckpointError and the rest


_HINTS = {
    EXIT_NO_CHECKPOINT: "start fresh, or check ROOT",
    EXIT_STORAGE: "check ROOT: the path or URL, permissions, credentials",
    EXIT_PROBLEM: "run `fastckpt verify ROOT` for details",
}


def _fail(message: str, code: int, data: dict | None = None) -> int:
    if _json_mode:
        _emit_json({"ok": False, "error": message, "exit_code": code, **(data or {})})
    click.echo(f"fastckpt: {message}", err=True)
    return code


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the command, map outcomes to exit codes."""
    _set_json(False)
    try:
        rc = cli.main(args=argv, prog_name="fastckpt", standalone_mode=False)
    except SystemExit as e:
        # click turns EPIPE on stdout (`fastckpt ls ROOT | head`) into sys.exit(1) after
        # wrapping stdout; report it like a program killed by SIGPIPE, not as "problem found"
        from click.utils import PacifyFlushWrapper
        if e.code == 1 and isinstance(sys.stdout, PacifyFlushWrapper):
            rc = EXIT_BROKEN_PIPE
        else:
            raise
    except click.ClickException as e:
        e.show()
        rc = e.exit_code
    except (click.Abort, KeyboardInterrupt):
        click.echo("fastckpt: interrupted", err=True)
        rc = EXIT_INTERRUPTED
    except CliError as e:
        rc = _fail(e.line(), e.code, e.data)
    except (FastCkptError, ImportError) as e:
        code = EXIT_STORAGE if isinstance(e, ImportError) else _code_for(e)
        hint = _HINTS.get(code)
        rc = _fail(f"{e}; {hint}" if hint else str(e), code)
    except BrokenPipeError:
        # the reader went away (`fastckpt ls | head`): not an error of ours
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except OSError:
            pass
        rc = EXIT_BROKEN_PIPE
    except OSError as e:
        rc = _fail(f"{e}; {_HINTS[EXIT_STORAGE]}", EXIT_STORAGE)
    except Exception:  # a bug: show everything
        traceback.print_exc()
        rc = _fail("internal error (the traceback above is a bug: please report it)",
                   EXIT_INTERNAL)
    sys.exit(rc or 0)


if __name__ == "__main__":
    main()
