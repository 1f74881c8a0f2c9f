"""Plain DCP: ``dcp.save``/``async_save``/``load`` with DCP's FileSystemWriter/Reader against
the same calls with ``fastckpt.dcp.Writer``/``Reader``. State: the benchmark Linear stack + Adam
moments (``fastckpt.bench.state``) through ``get_state_dict``, in one process."""

from __future__ import annotations

from typing import Any

from clients._common import Clock, fingerprint, nbytes, warm_imports

CONTENDERS = ("dcp", "dcp4", "fastckpt", "dcp-async", "fastckpt-async")
LOADERS = ("dcp", "fastckpt")
PAIRS = [("dcp", "fastckpt"), ("dcp4", "fastckpt"), ("dcp-async", "fastckpt-async")]
DESCRIPTIONS = {
    "dcp": "dcp.save(FileSystemWriter(path)) (sync_files=True, 1 thread) / dcp.load(FileSystemReader)",
    "dcp4": "dcp.save(FileSystemWriter(path, thread_count=4))",
    "fastckpt": "dcp.save(fastckpt.dcp.Writer(path, step=1)) / dcp.load(fastckpt.dcp.Reader(path))",
    "dcp-async": "dcp.async_save(FileSystemWriter(path)); stall = until it returns, durable = "
                 "until its future is done",
    "fastckpt-async": "dcp.async_save(fastckpt.dcp.Writer(path, step=1))",
}


def run(p: dict) -> dict[str, Any]:
    import warnings

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    import fastckpt.dcp
    from fastckpt.bench import state as S
    warnings.filterwarnings("ignore")
    warm_imports()
    geom = S.geometry(p["size_bytes"])
    c, path = p["contender"], p["path"]
    loading = p["op"] != "save"
    # a restart builds a fresh optimizer (no moments yet): get_state_dict creates them, inside
    # the load's clock (before 2026-12-06 the loader's optimizer was stepped before the clock)
    model, optim = S.model_adam(geom, seed=p["seed"] + (1 if loading else 0),
                                stepped=not loading)
    out: dict[str, Any] = {}
    if not loading:
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        out["state_bytes"] = nbytes(sd)
        writer = {"dcp": lambda: FileSystemWriter(path),
                  "dcp4": lambda: FileSystemWriter(path, thread_count=4),
                  "dcp-async": lambda: FileSystemWriter(path)}.get(
            c, lambda: fastckpt.dcp.Writer(path, step=1))()
        with Clock() as total:
            if c.endswith("-async"):
                with Clock() as stall:
                    fut = dcp.async_save(sd, storage_writer=writer)
                fut.result()
            else:
                dcp.save(sd, storage_writer=writer)
        out.update(stall_s=stall.s if c.endswith("-async") else total.s, durable_s=total.s)
    else:
        reader = FileSystemReader(path) if c == "dcp" else fastckpt.dcp.Reader(path)
        with Clock() as t:
            msd, osd = get_state_dict(model, optim)
            sd = {"model": msd, "optim": osd}
            dcp.load(sd, storage_reader=reader)
            set_state_dict(model, optim, model_state_dict=sd["model"],
                           optim_state_dict=sd["optim"])
        out["load_s"] = t.s
        msd, osd = get_state_dict(model, optim)
        sd = {"model": msd, "optim": osd}
        out["state_bytes"] = nbytes(sd)
    out["fingerprint"] = fingerprint(sd)
    return out
