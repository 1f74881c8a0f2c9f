"""``fastckpt convert``: a DCP checkpoint directory or a torch.save file into a fastckpt root.

The conversion itself is :mod:`fastckpt.convert` (it needs torch: imported when the command
runs, so the other commands stay torch-free).
"""

from __future__ import annotations

import click

from ..errors import FastCkptError, StorageError
from .base import (EXIT_OK, EXIT_PROBLEM, EXIT_STORAGE, EXIT_USAGE, CliError, _echo,
                   _emit_json, _hb, _progress, _rate, _set_json, _storage, cli)
from .base import SizeType

CONVERT_EXIT_CODES = """\b
Exit codes:
  0    converted, committed and verified
  1    SRC cannot be converted (a value fastckpt cannot store or that the safe unpickler
       refuses, damaged SRC), or a shard did not read back as written; nothing committed
  2    usage error: SRC is neither a DCP directory nor a torch.save file, or the step is
       already committed under ROOT (without --force)
  4    storage error: ROOT cannot be written, SRC cannot be read
  70   internal error (a bug)    130  interrupted (before the commit: nothing committed)"""


@cli.command(epilog=CONVERT_EXIT_CODES)
@click.argument("src")
@click.argument("root")
@click.option("--step", type=click.IntRange(min=0), default=None,
              help="The step to write (default: N when SRC is named step-N, step_N, "
                   "checkpoint-N, global_stepN or iter-N, else 0).")
@click.option("--force", is_flag=True, help="Replace the step if it is already committed "
              "under ROOT (atomically: the old one stays loadable until the new commit).")
@click.option("--batch-size", "batch", type=SizeType(), default="1GiB", show_default=True,
              help="Tensor bytes read from SRC and held in memory at once.")
@click.option("--exclude", multiple=True, metavar="GLOB",
              help="Leave out the values whose dotted key path (or a parent's) matches, e.g. "
                   "'dataloader.*' (repeatable).")
@click.option("--json", "as_json", is_flag=True, help="Print a JSON object.")
def convert(src: str, root: str, step: int | None, force: bool, batch: int,
            exclude: tuple[str, ...], as_json: bool) -> int:
    """Convert SRC, a DCP checkpoint directory or a torch.save file, into a step of ROOT.

    \b
    fastckpt convert /old/run/step-3000 /nvme/ckpt/run       DCP (all ranks' shards)
    fastckpt convert model.pt /nvme/ckpt/run --step 0        torch.save file

    Offline: one process, no GPU, no process group. Every tensor's bytes and dtype are kept
    exactly; each shard written is re-read and checked against the checksums of the bytes
    read from SRC before the step is committed (atomically). SRC is only read. Plain values
    are never unpickled with a general unpickler: DCP's pickled values and torch.save files
    go through torch.load(weights_only=True), which refuses arbitrary objects (the command
    then fails naming the key or class, and commits nothing). See
    docs/integrations/migration.md.
    """
    _set_json(as_json)
    storage = _storage(root)  # a step directory as ROOT: exit 2, naming its parent
    from .. import convert as conv  # torch
    try:
        kind = conv.detect(src)
        with _progress(transfer=True) as prog:
            task = prog.add_task(f"convert {kind}", total=None) if prog else None

            def advance(n: int) -> None:
                if prog is not None:
                    prog.update(task, advance=n)
            res = conv.convert(src, storage, step=step, force=force, batch_bytes=batch,
                               exclude=exclude, progress=advance)
    except conv.NotConvertibleError as e:
        raise CliError(str(e), EXIT_USAGE) from None
    except conv.StepExistsError as e:
        raise CliError(str(e).replace("force=True (--force)", "--force"), EXIT_USAGE) from None
    except StorageError:
        raise
    except OSError as e:  # reading SRC (ROOT is written through the storage layer)
        raise CliError(f"cannot read {src}: {e}", EXIT_STORAGE, hint="check SRC: the path, "
                       "permissions") from None
    except FastCkptError as e:
        raise CliError(f"cannot convert {src}: {e}", EXIT_PROBLEM,
                       hint="nothing was committed, ROOT is as it was (--exclude GLOB leaves "
                            "values out)") from None
    if as_json:
        _emit_json({"ok": True, **res.to_json()})
        return EXIT_OK
    what = {"dcp": "DCP checkpoint", "torch_save": "torch.save file"}[res.source_format]
    n = res.source_ranks
    ranks = "" if not n else " (1 rank's shards)" if n == 1 else f" ({n} ranks' shards)"
    how = {"option": "", "name": " (from SRC's name)", "default": " (default; --step N)"}
    _echo(f"converted {what} {res.source}{ranks}")
    _echo(f"  -> {res.root} step {res.step}{how[res.step_from]}: {res.path}"
          + ("  (replaced the committed step)" if res.replaced else ""))
    tied = f", {res.tied} tied key(s)" if res.tied else ""
    _echo(f"  {res.tensors} tensor(s) in {res.chunks} chunk(s){tied}, {_hb(res.bytes)}, "
          f"{res.files} shard file(s), in {res.seconds:.2f} s ({_rate(res.bytes, res.seconds)})")
    _echo(f"  verified: every chunk re-read from ROOT matches the checksum of the bytes read "
          f"from SRC ({_hb(res.bytes_verified)} re-read); dtypes and shapes as in SRC")
    for note in res.notes:
        _echo(f"note: {note}", err=True)
    return EXIT_OK
