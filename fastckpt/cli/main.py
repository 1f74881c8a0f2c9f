"""The ``fastckpt`` command: resume, ls, verify, gc, inspect, bench, info, convert.

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

import os
import sys
import traceback

import click

from ..errors import (CheckpointNotFoundError, FastCkptError, StorageError,
                      StorageTimeoutError)
from . import base
from . import benchcmd, convert, drill, k8s, slurm, steps  # noqa: F401 - the commands register themselves
from .base import (EXIT_BROKEN_PIPE, EXIT_INTERNAL, EXIT_INTERRUPTED, EXIT_NO_CHECKPOINT,
                   EXIT_PROBLEM, EXIT_STORAGE, CliError, _emit_json, cli)

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
    if base._json_mode:
        _emit_json({"ok": False, "error": message, "exit_code": code, **(data or {})})
    click.echo(f"fastckpt: {message}", err=True)
    return code


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: run the command, map outcomes to exit codes."""
    base._set_json(False)
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
        args = sys.argv[1:] if argv is None else argv
        if "--json" in args and "--" not in args[:args.index("--json")]:
            # (a usage error comes before the command sets JSON mode: said in JSON too)
            _emit_json({"ok": False, "error": e.format_message(), "exit_code": e.exit_code})
        e.show()
        rc = e.exit_code
    except (click.Abort, KeyboardInterrupt):
        click.echo("fastckpt: interrupted", err=True)
        rc = EXIT_INTERRUPTED
    except CliError as e:
        rc = _fail(e.line(), e.code, e.data)
    except (FastCkptError, ImportError) as e:
        code = EXIT_STORAGE if isinstance(e, ImportError) else _code_for(e)
        hint = (_HINTS.get(code) if not isinstance(e, StorageTimeoutError) else
                "retry when the storage answers (no step was judged damaged)")
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
