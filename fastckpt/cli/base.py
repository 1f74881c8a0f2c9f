"""The command group, exit codes, errors and output helpers shared by every command."""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
from contextlib import contextmanager
from typing import Any, Iterator

import click

from .. import __version__
from ..options import cli_settings

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
    """Strict JSON (RFC 8259): a float that is not finite (a saved ``best_loss=inf``) is the
    string "inf", "-inf" or "nan" (before 2026-12-07 the bare NaN/Infinity strict parsers
    refuse)."""
    click.echo(json.dumps(_finite(obj), indent=1, default=str, allow_nan=False))


def _finite(x: Any) -> Any:
    if isinstance(x, float) and not math.isfinite(x):
        return str(x)
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return x


def _set_json(flag: bool) -> None:
    global _json_mode
    _json_mode = bool(flag)


@contextmanager
def _progress(transfer: bool = False) -> Iterator[Any]:
    """A rich Progress on stderr when it is a terminal, else None (quiet when piped)."""
    err = _err()
    if not err.is_terminal or cli_settings()["no_progress"]:
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


def _storage(root: str, *, must_exist: bool = False):
    """The storage of ROOT. A step directory, or a DCP checkpoint, given as ROOT is a usage
    error (exit 2: a job script must not take it for "no checkpoint, start fresh"); ``must_exist``: a local ROOT
    that does not exist is reported (exit 3) instead of listed as empty (a mistyped path)."""
    from ..errors import StorageError
    from ..manifest.discovery import dcp_hint, looks_like_step_dir
    from ..tools import as_storage
    try:
        storage = as_storage(root)
    except ImportError as e:
        raise CliError(f"cannot open {root}: {e}", EXIT_STORAGE) from None
    except ValueError as e:
        raise CliError(f"cannot open {root}: {e}", EXIT_USAGE) from None
    parent = looks_like_step_dir(storage)
    if parent is not None:
        raise CliError(f"{root} is a step directory, not a checkpoint root", EXIT_USAGE,
                       hint=f"give its parent: {parent}")
    try:
        dcp = dcp_hint(storage, listing_errors=True)
    except StorageError as e:  # (the command would list it again: a second full bound)
        raise CliError(f"cannot list {root}: {e}", EXIT_STORAGE,
                       hint="retry when the storage answers") from None
    if dcp is not None:  # never "nothing committed, start fresh" over a run's DCP checkpoints
        raise CliError(f"{root}: {dcp}", EXIT_USAGE)
    if (must_exist and storage.is_local
            and not storage.run("stat", os.path.exists, storage.root)):
        raise CliError(f"{root} does not exist", EXIT_NO_CHECKPOINT,
                       hint="check the path (a job that has not saved yet has no root)")
    return storage


def _not_found(storage: Any, step: int | None) -> CliError:
    """The one wording of "nothing to look at" (inspect, verify): exit 3."""
    from ..tools import display_path, not_found_hint
    rootd = display_path(storage, storage.root)
    if step is None:
        return CliError(f"no committed checkpoint under {rootd} ({not_found_hint(storage)})",
                        EXIT_NO_CHECKPOINT, hint="see fastckpt ls")
    return CliError(f"step {step} has no committed checkpoint under {rootd} (not committed, "
                    "or absent)", EXIT_NO_CHECKPOINT, hint="see fastckpt ls")


class SizeType(click.ParamType):
    """A size option: ``4GiB``, ``512MB``, ``1e9`` (bytes), at least ``minimum``."""
    name = "SIZE"

    def __init__(self, minimum: int = 1) -> None:
        self.minimum = minimum

    def convert(self, value: Any, param: Any, ctx: Any) -> int:
        if isinstance(value, int):
            n = value
        else:
            from ..tools import parse_size
            try:
                n = parse_size(value)
            except ValueError as e:
                self.fail(str(e), param, ctx)
        if n < self.minimum:
            self.fail("must be positive" if self.minimum == 1 else f"must be >= {self.minimum}",
                      param, ctx)
        return n


class SecondsType(click.ParamType):
    """A duration option (``--grace``): a number of seconds >= 0 (``inf`` allowed). NaN is
    refused: every "younger than" comparison with it is False (before 2026-12-07 ``gc --grace
    nan --yes`` removed a save in flight as abandoned)."""
    name = "SECONDS"

    def convert(self, value: Any, param: Any, ctx: Any) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not x >= 0:  # (NaN too)
            self.fail(f"{value!r} is not a number of seconds >= 0", param, ctx)
        return x


def write_or_print(text: str, output: str | None) -> None:
    """A generated file (job script, manifest) to ``output``, else to stdout."""
    if output:
        with open(output, "w", encoding="utf-8") as f:
            f.write(text)
        _echo(f"wrote {output}", err=True)
    else:
        _echo(text.rstrip("\n"))


def grace_window(root: str, grace: int | None) -> tuple[int, str]:
    """The grace window a job script is built for: ``--grace``, else what ``fastckpt bench
    ROOT`` measured for the state (exit 2 with what to do when there is neither)."""
    if grace is not None:
        return grace, "--grace"
    from ..bench.record import measured_grace
    found = measured_grace(root)
    if found is None:
        raise CliError(f"no grace window: {root} has no `fastckpt bench` record", EXIT_USAGE,
                       hint=f"run `fastckpt bench {root} --size <state size>` on this storage "
                       "first, or give --grace SECONDS")
    return found


def job_name(root: str, fallback: str = "train") -> str:
    """A job name from the root's last component (lowercase letters, digits, '-')."""
    base = os.path.basename(root.rstrip("/")) or fallback
    name = re.sub(r"[^a-z0-9-]+", "-", base.lower()).strip("-")[:50].rstrip("-") or fallback
    return f"{name}-{fallback}" if not name[0].isalnum() else name


def _when(t: float | None) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t else "-"


def _hb(n: float | None) -> str:
    from ..tools import human_bytes
    return human_bytes(n)


def _rate(nbytes: float | None, secs: float | None) -> str:
    if not nbytes or not secs:
        return "-"
    return f"{_hb(nbytes / secs)}/s"


# ------------------------------------------------------------------------------ the group

def _backend_line() -> tuple[str, str | None]:
    """(backend name, why native is not used or None)."""
    from ..storage import native as _native
    from ..options import options_from_env
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
    memory://..., file:///...). The commands on a root accept --json.
    """


# ----------------------------------------------------------------------------------- info

@cli.command(epilog=EXIT_CODES_HELP)
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def info(as_json: bool) -> int:
    """The fastckpt version, the I/O backend in use and why, optional packages."""
    _set_json(as_json)
    import importlib.util
    import platform

    from ..storage import native as _native
    name, why = _backend_line()
    opt = {}
    for mod, use in (("s3fs", "s3:// roots"), ("gcsfs", "gs:// roots"),
                     ("zstandard", "compression"),
                     ("matplotlib", "bench PNG chart")):
        opt[mod] = {"installed": importlib.util.find_spec(mod) is not None, "for": use}
    import fsspec
    try:  # the version without importing torch (seconds): the tools run without it
        from importlib.metadata import version
        torch_version: str | None = version("torch")
    except Exception:  # noqa: BLE001 - not installed
        torch_version = None
    doc = {"fastckpt_version": __version__, "python": platform.python_version(),
           "torch_version": torch_version, "fsspec_version": fsspec.__version__,
           "io_backend": name, "native_available": _native.native_available(),
           "native_error": _native.native_error(), "io_backend_note": why,
           "FASTCKPT_NATIVE": cli_settings()["native"], "optional": opt}
    if as_json:
        _emit_json(doc)
        return EXIT_OK
    _echo(f"fastckpt {__version__}")
    _echo(f"python {doc['python']}, torch {doc['torch_version']}, fsspec {doc['fsspec_version']}")
    _echo(f"I/O backend: {name}" + (f" ({why})" if why else " (C extension loaded)"))
    for mod, o in opt.items():
        _echo(f"  {mod:<11} {'yes' if o['installed'] else 'no ':<4} ({o['for']})")
    return EXIT_OK


