"""The only module that talks to ``torch.distributed``'s process groups.

Two channels:

* collectives on the training thread (``all_gather_object``), used once per save to agree on
  the plan and by DCP's load planner;
* a key/value exchange over the process group's c10d store (``Exchange``), used by the
  background commit. It needs no collective, so a background thread can use it while the
  training thread runs its own collectives, and every wait on it has a deadline.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch.distributed as dist


def initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if initialized() else 1


def destroy() -> None:
    """Shut down the default process group (the emergency exit path)."""
    if initialized():
        dist.destroy_process_group()


def init_gloo(rank: int, world_size: int, timeout_s: float = 1800.0) -> None:
    """Start a gloo process group from MASTER_ADDR/MASTER_PORT (``fastckpt bench``'s workers)."""
    import datetime
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=timeout_s))


def barrier() -> None:
    if initialized():
        dist.barrier()


def all_gather_object(obj: Any) -> list[Any]:
    """Gather one picklable object from every rank (in-memory only; nothing touches storage)."""
    if not initialized():
        return [obj]
    out: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


class Exchange:
    """Deadline-bounded key/value exchange between ranks (thread-safe).

    Backed by the default process group's store when one is initialised, else by a dict (one
    process). Values are bytes.
    """

    def __init__(self, prefix: str = "fastckpt", store: Any = None) -> None:
        self._local: dict[str, bytes] | None = None
        self._cond = threading.Condition()
        if store is not None:
            self._store = dist.PrefixStore(prefix, store)
        elif initialized():
            from torch.distributed.distributed_c10d import _get_default_store
            self._store = dist.PrefixStore(prefix, _get_default_store())
        else:
            self._store = None
            self._local = {}

    def set(self, key: str, value: bytes) -> None:
        if self._store is None:
            with self._cond:
                self._local[key] = value  # type: ignore[index]
                self._cond.notify_all()
        else:
            self._store.set(key, value)

    def wait(self, keys: list[str], deadline: float) -> tuple[dict[str, bytes], list[str]]:
        """Wait until every key exists or the deadline passes; return (found, missing)."""
        if self._store is None:
            with self._cond:
                while True:
                    missing = [k for k in keys if k not in self._local]  # type: ignore[operator]
                    left = deadline - time.monotonic()
                    if not missing or left <= 0:
                        break
                    self._cond.wait(min(left, 0.5))
                return {k: self._local[k] for k in keys if k not in missing}, missing  # type: ignore[index]
        # Poll with short sleeps rather than one blocking ``store.wait``: the c10d client is
        # shared by every thread of the process and a blocking wait would hold it (the
        # preemption watcher must get through while a commit waits for its peers).
        delay = 0.001
        while True:
            try:
                if self._store.check(keys):
                    break
            except Exception:  # the store is gone (its host, rank 0, died): nothing will come
                return {}, list(keys)
            left = deadline - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(delay, left))
            delay = min(delay * 2, 0.02)
        missing = [k for k in keys if not self._check(k)]
        try:
            return {k: self._store.get(k) for k in keys if k not in missing}, missing
        except Exception:
            return {}, list(keys)

    def _check(self, key: str) -> bool:
        try:
            return bool(self._store.check([key]))
        except Exception:
            return False

    def delete(self, keys: list[str]) -> None:
        for k in keys:
            try:
                if self._store is None:
                    with self._cond:
                        self._local.pop(k, None)  # type: ignore[union-attr]
                else:
                    self._store.delete_key(k)
            except Exception:
                pass

    def add(self, key: str, amount: int) -> int:
        if self._store is None:
            with self._cond:
                v = int(self._local.get(key, b"0")) + amount  # type: ignore[union-attr]
                self._local[key] = str(v).encode()  # type: ignore[index]
                return v
        return int(self._store.add(key, amount))
