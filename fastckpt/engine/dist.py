"""The only module that talks to ``torch.distributed``'s process groups.

Two channels:

* collectives (``all_gather_object``, ``barrier``): only ``fastckpt bench``'s own runs use
  them (DCP's load planner runs its own);
* a key/value exchange over the process group's c10d store (``Exchange``, ``Group``), used by
  the save's plan exchange (``Group.decide``: every rank to rank 0 alone), the load's and the
  root claim's agreements, the trigger and the background commit. It needs no collective, so
  a background thread can use it while the training thread runs its own collectives, and
  every wait on it has a deadline.
"""

from __future__ import annotations

import datetime
import json
import threading
import time
import zlib
from typing import Any

import torch.distributed as dist

from ..errors import CollectiveTimeoutError, FastCkptError


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


class StoreUnreachable(Exception):
    """The c10d store does not answer: its host is gone (see :func:`store_host`). ``ranks``:
    the ranks lost with it."""

    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


#: keys per ``multi_get`` (two store commands each) when many values are read at once
MULTI_GET_BATCH = 1024
#: bytes per ``multi_set`` command: the TCPStore server's CPU per command grows faster than
#: the command's size (the cause inside the server not established; measured on a 2-vCPU VM,
#: 20 MB of 300 KB values: 0.06 s as single sets or 300 KB commands, 0.13 s in 1 MB
#: commands, 0.44 s in 3 MB, 2.3 s as one 19 MB command); a value above it is sent alone
MULTI_SET_BYTES = 256 * 1024


def local_ranks(environ: Any = None) -> int:
    """The ranks on this node (torchrun's LOCAL_WORLD_SIZE, Slurm's SLURM_NTASKS_PER_NODE),
    1 when neither says (or says something that is not a number). The one reader of both: the
    trigger shares a bench record's disk rate among them, the encoder pool its cores."""
    import os
    env = os.environ if environ is None else environ
    for k in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        try:
            return max(1, int(env.get(k, "")))
        except ValueError:
            continue
    return 1


def store_host() -> tuple[list[int], str]:
    """The ranks lost together with the process group's c10d store, and where it lives.

    torchrun (``TORCHELASTIC_USE_AGENT_STORE``): in the agent of node 0, whose workers are
    ranks ``0 .. LOCAL_WORLD_SIZE - 1`` (torchelastic gives node 0 the first ranks; nodes are
    assumed alike). Otherwise (``init_process_group`` with ``env://`` or ``tcp://``): in rank 0.
    """
    import os
    addr = f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}"
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true":
        try:
            n = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
        except ValueError:
            n = 1
        ranks = list(range(min(n, world_size())))
        return ranks, f"torchrun's agent on node 0 at {addr}, with rank(s) {ranks}"
    return [0], f"rank 0 at {addr}"


class Exchange:
    """Deadline-bounded key/value exchange between ranks (thread-safe).

    Backed by the default process group's store when one is initialised, else by a dict (one
    process). Values are bytes.

    Waiting costs the store nothing: ``wait`` is one server-side c10d ``wait`` for all its keys
    on a **dedicated connection** (a blocked wait holds its connection; the other threads keep
    using the shared one), taken from a small pool of clones of the store client, and the
    values are then read with ``multi_get`` in batches. No key is probed in a loop: a wait for
    N keys is a handful of commands whatever N, and an idle waiter sends nothing.
    """

    def __init__(self, prefix: str = "fastckpt", store: Any = None, *,
                 local: bool = False) -> None:
        self._local: dict[str, bytes] | None = None
        self._cond = threading.Condition()
        self._idle: list[Any] = []  # dedicated connections not in use (for ``wait``)
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
            self._call(self._store.set, key, value)

    def get(self, key: str) -> bytes:
        """The value of a key known to exist (after a ``wait`` that found it)."""
        if self._store is None:
            with self._cond:
                return self._local[key]  # type: ignore[index]
        return self._call(self._store.get, key)

    def append(self, key: str, value: bytes) -> None:
        """Append to a key's value (created if absent): one command, no reply to wait for."""
        if self._store is None:
            with self._cond:
                self._local[key] = self._local.get(key, b"") + value  # type: ignore[index,union-attr]
                self._cond.notify_all()
        else:
            self._call(self._store.append, key, value)

    def add(self, key: str, amount: int) -> int:
        if self._store is None:
            with self._cond:
                v = int(self._local.get(key, b"0")) + amount  # type: ignore[union-attr]
                self._local[key] = str(v).encode()  # type: ignore[index]
                self._cond.notify_all()
                return v
        return int(self._call(self._store.add, key, amount))

    def warm(self, n: int = 1) -> None:
        """Have ``n`` idle dedicated connections ahead of need (a stop should not start with
        connects). Best effort."""
        if self._store is None:
            return
        with self._cond:
            n -= len(self._idle)
        try:
            conns = [self._store.clone() for _ in range(max(0, n))]
        except Exception:  # noqa: BLE001 - opened on demand instead
            return
        with self._cond:
            self._idle.extend(conns)

    def wait(self, keys: list[str], deadline: float) -> tuple[dict[str, bytes], list[str]]:
        """Wait until every key exists or the deadline (``time.monotonic()``) passes; return
        (found, missing). Raises :class:`StoreUnreachable` when the store does not answer."""
        if self._store is None:
            with self._cond:
                while True:
                    missing = [k for k in keys if k not in self._local]  # type: ignore[operator]
                    left = deadline - time.monotonic()
                    if not missing or left <= 0:
                        break
                    self._cond.wait(left)
                return {k: self._local[k] for k in keys if k not in missing}, missing  # type: ignore[index]
        ok, values = False, None
        while not ok:
            left = deadline - time.monotonic()
            if left <= 0:
                break
            with self._cond:
                conn = self._idle.pop() if self._idle else None
            if conn is None:
                # a command on the shared connection first: the keys may be there already (no
                # connection to open), and a dead store fails it at once, where a clone would
                # retry its connect for the store's whole timeout
                if self._call(self._store.check, keys):
                    ok = True
                    break
                conn = self._call(self._store.clone)
            try:
                if len(keys) <= MULTI_GET_BATCH:
                    # a multi_get waits on the server for its keys (up to the connection's
                    # timeout) and then reads them: one command less than a wait and a read
                    # (5 commands per rank in a stop consensus, not 7)
                    conn.set_timeout(datetime.timedelta(seconds=left))
                    values = conn.multi_get(keys)
                else:
                    conn.wait(keys, datetime.timedelta(seconds=left))
                ok = True
            except Exception:  # noqa: BLE001 - timed out, or the connection broke
                conn = None  # the next wait takes a fresh connection
                ok = self._call(self._store.check, keys)  # raises if the store is gone
                if not ok and deadline - time.monotonic() > 0.05:
                    time.sleep(0.01)  # a broken connection, not the deadline: wait again
            finally:
                if conn is not None:
                    with self._cond:
                        self._idle.append(conn)
        if values is not None:
            return dict(zip(keys, values)), []
        # the keys are there, or the deadline passed: which are missing (one check each, once)
        if ok or self._call(self._store.check, keys):
            return dict(zip(keys, self.get_many(keys))), []
        missing = [k for k in keys if not self._call(self._store.check, [k])]
        found = [k for k in keys if k not in missing]
        return dict(zip(found, self.get_many(found))), missing

    def set_many(self, keys: list[str], values: list[bytes]) -> None:
        """Set many keys, in commands of at most MULTI_GET_BATCH keys and, unless one
        value is larger, MULTI_SET_BYTES bytes."""
        if self._store is None:
            with self._cond:
                self._local.update(zip(keys, values))  # type: ignore[union-attr]
                self._cond.notify_all()
            return
        start, size = 0, 0
        for i, v in enumerate(values):
            if i > start and (size + len(v) > MULTI_SET_BYTES
                              or i - start == MULTI_GET_BATCH):
                self._call(self._store.multi_set, keys[start:i], values[start:i])
                start, size = i, 0
            size += len(v)
        if start < len(keys):
            self._call(self._store.multi_set, keys[start:], values[start:])

    def get_many(self, keys: list[str]) -> list[bytes]:
        """The values of keys known to exist, in batches of MULTI_GET_BATCH."""
        if self._store is None:
            with self._cond:
                return [self._local[k] for k in keys]  # type: ignore[index]
        out: list[bytes] = []
        for i in range(0, len(keys), MULTI_GET_BATCH):
            out += self._call(self._store.multi_get, keys[i:i + MULTI_GET_BATCH])
        return out

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

    @staticmethod
    def _call(fn: Any, *args: Any) -> Any:
        try:
            return fn(*args)
        except Exception as e:  # noqa: BLE001 - a store error: its host is gone (or hangs)
            ranks, where = store_host()
            raise StoreUnreachable(f"the c10d store ({where}) is unreachable "
                                   f"({type(e).__name__}: {str(e)[:200]})", ranks) from e


#: how long rank 0 waits, at most, for the others to read a gather's values
GATHER_READ_S = 30.0
#: up to this many ranks, a rank that gets no answer in ``Group.decide`` also names the ranks
#: whose values are missing (one store command per rank: not done at scale)
DECIDE_NAME_MAX = 64


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
    same on every rank when every rank creates its collective Checkpointers in the same order;
    a rank-local one, ``collective=False`` such as ``fastckpt.steps``, does not count).
    """

    _counts: dict[str, int] = {}
    _counts_lock = threading.Lock()

    def __init__(self, *, collective: bool = True, name: str = "") -> None:
        self.collective = bool(collective) and initialized()
        self.rank = rank() if self.collective else 0
        self.world_size = world_size() if self.collective else 1
        key = f"{zlib.crc32(name.encode()):08x}"
        if not self.collective:  # (no exchange: a rank-0-only call must not shift the count)
            self._prefix = f"gather/{key}.local"
        else:
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

    def _base(self, key: str | None) -> str:
        """The store keys' prefix of one exchange: ``key`` when the caller names it (every
        rank names it alike, e.g. from the step it saves: an exchange that failed on some
        ranks only then puts no later exchange out of step), else the next of a count every
        rank keeps alike as long as every rank makes every call."""
        if key is not None:
            return f"{self._prefix}/{key}"
        self._seq += 1
        return f"{self._prefix}/{self._seq}"

    def gather(self, value: Any, *, timeout_s: float, what: str,
               key: str | None = None) -> list[Any]:
        """Every rank's ``value`` (JSON-able), in rank order; CollectiveTimeoutError after
        ``timeout_s`` naming the ranks that did not arrive. ``key``: see :meth:`_base`."""
        if self.world_size == 1:
            return [value]
        base = self._base(key)
        ex = self.exchange
        keys = [f"{base}/{r}" for r in range(self.world_size)]
        t0 = time.monotonic()
        try:
            ex.set(keys[self.rank], json.dumps(value).encode())
            found, missing = ex.wait(keys, t0 + timeout_s)
        except StoreUnreachable as e:
            raise CollectiveTimeoutError(f"{what}: {e} after {time.monotonic() - t0:.1f} s; "
                                         f"rank(s) {e.ranks} are lost with it",
                                         missing_ranks=e.ranks, rank=self.rank) from e
        if missing:
            ranks = [r for r, k in enumerate(keys) if k in missing]
            raise CollectiveTimeoutError(
                f"{what}: rank(s) {ranks} did not arrive within {timeout_s:g} s (every rank "
                "must call it: a rank that does not, or that died, is named here; for a state "
                "saved by one process, use collective=False)", missing_ranks=ranks,
                rank=self.rank)
        out = [json.loads(found[k]) for k in keys]
        # the values stay until every rank has read them: rank 0 (the store's host unless
        # torchrun's agent hosts it) must not return and exit with them. The last reader
        # (a counter: one command per rank) sets ``done``, which rank 0 waits for (bounded:
        # the others are all reading already, each published its value) before deleting.
        try:
            if ex.add(f"{base}/read", 1) == self.world_size:
                ex.set(f"{base}/done", b"1")
            if self.rank == 0:
                ex.wait([f"{base}/done"], time.monotonic() + min(timeout_s, GATHER_READ_S))
                ex.delete(keys + [f"{base}/read", f"{base}/done"])
        except StoreUnreachable:
            pass  # every value was read here; the store's own host is gone with the keys
        return out

    def decide(self, value: Any, fn: Any, *, timeout_s: float, what: str,
               each: bool = False, key: str | None = None) -> Any:
        """Every rank's ``value`` (JSON-able) to rank 0 only; rank 0 computes ``fn(values)``
        (values in rank order; the answer JSON-able) and every rank returns that answer.
        O(N) values through the store where ``gather`` moves O(N^2). ``each``: ``fn`` returns
        ``(common, parts)``, one part per rank, and rank r returns ``(common, parts[r])``
        (rank 0 publishes each part under its own key before the common answer; each rank
        reads and deletes its own). Rank 0 answers a little
        before the others stop waiting (``min(1 s, timeout_s / 10)`` early), so a rank that
        does not arrive is named on every rank (CollectiveTimeoutError); a rank whose answer
        does not come names rank 0 and any rank whose value is not there either. An error
        raised by ``fn`` on rank 0 is raised on every rank. ``key``: see :meth:`_base`."""
        if self.world_size == 1:
            out = fn([value])
            return (out[0], out[1][0]) if each else out
        base = self._base(key)
        ex = self.exchange
        answer = f"{base}/answer"
        t0 = time.monotonic()
        try:
            if self.rank == 0:
                keys = [f"{base}/{r}" for r in range(self.world_size)]
                return self._answer(ex, base, keys, value, fn, t0, timeout_s, what, each)
            # (no list of every rank's key here: O(1) work per rank)
            ex.set(f"{base}/{self.rank}", json.dumps(value).encode())
            found, missing = ex.wait([answer], t0 + timeout_s)
            if missing:
                ranks = [0]
                if self.world_size <= DECIDE_NAME_MAX:  # one check per key: not at scale
                    keys = [f"{base}/{r}" for r in range(1, self.world_size)]
                    _, absent = ex.wait(keys, time.monotonic())
                    ranks += [int(k.rsplit("/", 1)[1]) for k in absent]
                raise CollectiveTimeoutError(
                    f"{what}: no answer from rank 0 within {timeout_s:g} s (rank(s) {ranks} "
                    "did not arrive or died)", missing_ranks=ranks, rank=self.rank)
            got = json.loads(found[answer])
            if each and "ok" in got:  # (published before the answer: it is there)
                part = f"{answer}/{self.rank}"
                got["ok"] = (got["ok"], json.loads(ex.get(part)))
                ex.delete([part])
            if ex.add(f"{base}/read", 1) == self.world_size - 1:
                ex.set(f"{base}/done", b"1")
        except StoreUnreachable as e:
            raise CollectiveTimeoutError(f"{what}: {e} after {time.monotonic() - t0:.1f} s; "
                                         f"rank(s) {e.ranks} are lost with it",
                                         missing_ranks=e.ranks, rank=self.rank) from e
        if "missing" in got:
            raise CollectiveTimeoutError(
                f"{what}: rank(s) {got['missing']} did not arrive within {timeout_s:g} s "
                "(named by rank 0)", missing_ranks=got["missing"], rank=self.rank)
        if "error" in got:
            raise FastCkptError(f"{what}: rank 0 failed: {got['error']}")
        return got["ok"]

    def _answer(self, ex: "Exchange", base: str, keys: list, value: Any, fn: Any, t0: float,
                timeout_s: float, what: str, each: bool) -> Any:
        """(rank 0, in ``decide``) Wait for the values, answer, clean up."""
        answer = f"{base}/answer"
        found, missing = ex.wait(keys[1:], t0 + timeout_s - min(1.0, timeout_s / 10))
        if missing:
            ranks = [r for r, k in enumerate(keys) if k in missing]
            ex.set(answer, json.dumps({"missing": ranks}).encode())
            ex.delete(list(found))
            raise CollectiveTimeoutError(
                f"{what}: rank(s) {ranks} did not arrive within {timeout_s:g} s (every rank "
                "must call it: a rank that does not, or that died, is named here; for a state "
                "saved by one process, use collective=False)", missing_ranks=ranks,
                rank=self.rank)
        try:
            out = fn([value] + [json.loads(found[k]) for k in keys[1:]])
            if each:
                common, parts = out
                if len(parts) != self.world_size:
                    raise ValueError(f"{len(parts)} parts for {self.world_size} ranks")
                ex.set_many([f"{answer}/{r}" for r in range(1, self.world_size)],
                            [json.dumps(p).encode() for p in parts[1:]])
                out = (common, parts[0])
                reply = {"ok": common}
            else:
                reply = {"ok": out}
        except StoreUnreachable:
            raise
        except Exception as e:
            reply, out = {"error": f"{type(e).__name__}: {e}"}, e
        # the answer first, then the values go: a rank whose answer never comes finds the
        # values still there and names rank 0 alone
        ex.set(answer, json.dumps(reply).encode())
        ex.delete(keys[1:])
        # the answer stays until every rank has read it (as in gather)
        try:
            ex.wait([f"{base}/done"], time.monotonic() + min(timeout_s, GATHER_READ_S))
            ex.delete([answer, f"{base}/read", f"{base}/done"])
        except StoreUnreachable:
            pass
        if isinstance(out, Exception):
            raise out
        return out

