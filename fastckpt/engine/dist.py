"""The only module that talks to ``torch.distributed``'s process groups.

Two channels:

* collectives on the training thread (``all_gather_object``), used once per save to agree on
  the plan and by DCP's load planner;
* a key/value exchange over the process group's c10d store (``Exchange``), used by the
  background commit. It needs no collective, so a background thread can use it while the
  training thread runs its own collectives, and every wait on it has a deadline.
"""

from __future__ import annotations

import json
import threading
import time
import zlib
from typing import Any

import torch.distributed as dist

from ..errors import CollectiveTimeoutError


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

    def __init__(self, prefix: str = "fastckpt", store: Any = None, *,
                 local: bool = False) -> None:
        self._local: dict[str, bytes] | None = None
        self._cond = threading.Condition()
        if store is not None:
            self._store = dist.PrefixStore(prefix, store)
        elif initialized() and not local:
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


#: how long rank 0 waits, at most, for the others to read a gather's values
GATHER_READ_S = 30.0


class Group:
    """The ranks one Checkpointer coordinates with (thread-safe for ``gather`` calls made in
    the same order on every rank, from one thread).

    ``collective=True``: the default process group, when one is initialised (else this process
    alone). ``collective=False``: this process alone whatever the process group (rank 0 of 1):
    for a state that is replicated and saved or loaded by one process, e.g. Lightning's DDP,
    which calls its CheckpointIO on rank 0 only.

    ``gather`` replaces ``all_gather_object`` on the engine's paths: every rank publishes a JSON
    value in the c10d store and waits for the others' until a deadline, then raises
    :class:`~fastckpt.errors.CollectiveTimeoutError` naming the ranks that did not arrive (a
    rank that never calls, a rank that died), instead of blocking for ever. ``name`` keys the
    exchanges of this group apart from other Checkpointers' (``name`` + a per-name count, the
    same on every rank when every rank creates its Checkpointers in the same order).
    """

    _counts: dict[str, int] = {}
    _counts_lock = threading.Lock()

    def __init__(self, *, collective: bool = True, name: str = "") -> None:
        self.collective = bool(collective) and initialized()
        self.rank = rank() if self.collective else 0
        self.world_size = world_size() if self.collective else 1
        key = f"{zlib.crc32(name.encode()):08x}"
        with Group._counts_lock:
            n = Group._counts.get(key, 0)
            Group._counts[key] = n + 1
        self._prefix = f"gather/{key}.{n}"
        self._seq = 0
        self._exchange: Exchange | None = None

    @property
    def exchange(self) -> "Exchange":
        """The deadline-bounded key/value exchange of this group (created on first use)."""
        if self._exchange is None:
            self._exchange = Exchange(local=not self.collective)
        return self._exchange

    def gather(self, value: Any, *, timeout_s: float, what: str) -> list[Any]:
        """Every rank's ``value`` (JSON-able), in rank order; CollectiveTimeoutError after
        ``timeout_s`` naming the ranks that did not arrive."""
        if self.world_size == 1:
            return [value]
        self._seq += 1
        base = f"{self._prefix}/{self._seq}"
        ex = self.exchange
        ex.set(f"{base}/{self.rank}", json.dumps(value).encode())
        keys = [f"{base}/{r}" for r in range(self.world_size)]
        t0 = time.monotonic()
        found, missing = ex.wait(keys, t0 + timeout_s)
        if missing:
            ranks = [r for r, k in enumerate(keys) if k in missing]
            waited = time.monotonic() - t0
            if waited < timeout_s:  # the store answered no more: its host, rank 0, went away
                why = (f"the c10d store (hosted by rank 0) became unreachable after "
                       f"{waited:.1f} s: rank 0 exited or died; rank(s) {ranks} had not "
                       "arrived")
            else:
                why = (f"rank(s) {ranks} did not arrive within {timeout_s:g} s (every rank "
                       "must call it: a rank that does not, or that died, is named here; for a "
                       "state saved by one process, use collective=False)")
            raise CollectiveTimeoutError(f"{what}: {why}", missing_ranks=ranks, rank=self.rank)
        out = [json.loads(found[k]) for k in keys]
        reads = [f"{base}/read/{r}" for r in range(1, self.world_size)]
        if self.rank:
            ex.set(reads[self.rank - 1], b"1")
        else:
            # rank 0 hosts the store: it stays until the others have read (bounded: they are
            # all waiting already, each published its value), so a rank 0 that returns and
            # exits (after raising what every rank agreed on) does not take the values along
            ex.wait(reads, time.monotonic() + min(timeout_s, GATHER_READ_S))
            ex.delete(keys + reads)
        return out
