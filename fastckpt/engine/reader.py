"""Reading checkpoints: a DCP ``StorageReader`` over one committed step.

Resharding is DCP's: :class:`FastCkptReader` presents a fastckpt manifest to
``torch.distributed.checkpoint.load`` as DCP ``Metadata`` (every tensor's global shape and the
chunks the saving ranks wrote), DCP's load planner intersects them with the chunks the loading
ranks hold (DTensor/FSDP2 placements of any mesh, or whole tensors), and ``read_data`` serves
each read item from the shard files. Every chunk read is checked against its xxh3-64 checksum
before any byte of it is used. No pickle is ever read from storage.

The same reader is public (``fastckpt.FastCkptReader``), so DCP users can load a fastckpt
checkpoint with ``dcp.load(state_dict, storage_reader=FastCkptReader(root))``.
"""

from __future__ import annotations

import io
import queue
import threading
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, TensorProperties,
    TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..errors import (CorruptCheckpointError, NotRegularFileError, StateMismatchError,
                      StepRemovedError, StorageError)
from ..manifest import schema as fmt
from ..manifest.discovery import find_step, is_missing, read_manifest
from ..manifest.values import decode_value
from ..storage import Storage, open_storage
from ..storage.base import storage_error
from ..storage.local import LocalStorage
from ..storage.native import get_backend
from ..storage.pyio import _address, _raw_view, aligned_buffer, populate
from . import chunks as _chunks
from .readitems import READ_STALL_S, Busy, _Direct, _Span, next_ready, stall_s
from . import compress as _compress
from . import device as _device
from . import dist as _dist
from .dtypes import torch_dtype


# ---------------------------------------------------------------------------------- DCP reader

class FastCkptReader(StorageReader):
    """A DCP ``StorageReader`` over one committed fastckpt step.

    ``FastCkptReader(root_or_storage, step=None)``: ``step=None`` picks the newest committed
    step. Thread-safety: one instance per ``dcp.load`` call.
    """

    def __init__(self, root: str | Storage, step: int | None = None, *, verify: bool = True,
                 rank: int | None = None, world_size: int | None = None,
                 body: dict | None = None, step_dir: str | None = None,
                 storage_options: dict | None = None, partial: bool = False,
                 tree: Any = None) -> None:
        super().__init__()
        #: the skeleton the load chose for this rank (``schema.tree_for_rank``: a pipeline
        #: stage's at another world size); None: the manifest's, this rank's when per rank
        self._tree = tree
        #: ``body`` holds one rank's part of an indexed step (the inline chunks and its own
        #: index's, fastckpt/manifest/index.py): only the files its chunks name are checked
        self.partial = partial
        self.storage = (root if isinstance(root, Storage) else open_storage(
            str(root), storage_options=storage_options)).per_call(READ_STALL_S)
        if body is None:
            step, step_dir, body = find_step(self.storage, step)
        assert step_dir is not None
        self.step = int(body["step"])
        self.step_dir = step_dir
        self.body = body
        self.verify = verify
        # values saved per rank are served to the rank that loads them: by default the
        # caller's rank in the default process group
        self.rank = _dist.rank() if rank is None else rank
        self.world_size = _dist.world_size() if world_size is None else world_size
        self._checked_files: set[str] = set()
        self._direct: bool | None = None  # decided at the first read (see _read_direct_io)
        #: what the last read_data read: chunks straight into their destination, span bytes
        self.read_stats: dict[str, int] = {}

    # -- DCP interface -------------------------------------------------------------------------
    def reset(self, checkpoint_id: Any = None) -> None:
        self._checked_files = set()

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Any) -> bool:
        try:
            find_step(open_storage(str(checkpoint_id)))
            return True
        except Exception:
            return False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The manifest as DCP metadata: every tensor's chunks (a per-rank tensor: this rank's
        copy only; a tied key: the chunks of the tensor it shares), and the plain values."""
        mpath = f"{self.step_dir}/{fmt.MANIFEST}"
        sd_meta: dict[str, Any] = {}
        storage_data: dict[MetadataIndex, Any] = {}
        plain, aliases, mappings = self._plain_values_and_aliases()
        for fqn, t in self.body["tensors"].items():
            dtype = torch_dtype(t["dtype"], file=mpath)
            mine = t["chunks"]
            if t.get("per_rank"):
                self._check_same_world(f"tensor {fqn!r} holds a value per rank", mpath)
                mine = [c for c in mine if c["rank"] == self.rank]
            for name in [fqn] + aliases.get(fqn, []):
                chunks = []
                for c in mine:
                    chunks.append(ChunkStorageMetadata(offsets=torch.Size(c["offsets"]),
                                                       sizes=torch.Size(c["sizes"])))
                    storage_data[MetadataIndex(name, torch.Size(c["offsets"]))] = (fqn, c)
                sd_meta[name] = TensorStorageMetadata(
                    properties=TensorProperties(dtype=dtype), size=torch.Size(t["shape"]),
                    chunks=chunks)
        for fqn, value in plain.items():
            sd_meta[fqn] = BytesStorageMetadata()
            storage_data[MetadataIndex(fqn)] = ("$bytes", value)
        return Metadata(state_dict_metadata=sd_meta, storage_data=storage_data,
                        planner_data=mappings)  # (DCP's load-everything planner nests by it)

    def check_per_rank(self) -> None:
        """StateMismatchError when this checkpoint holds values per rank (tensors or plain
        values that differed between the saving ranks) and the world size differs."""
        mpath = f"{self.step_dir}/{fmt.MANIFEST}"
        for fqn, t in self.body["tensors"].items():
            if t.get("per_rank"):
                self._check_same_world(f"tensor {fqn!r} holds a value per rank", mpath)

    def _check_same_world(self, what: str, mpath: str) -> None:
        saved = self.body["world_size"]
        if self.world_size != saved:
            raise StateMismatchError(
                f"{what} (values that differed between the {saved} saving ranks, such as an RNG "
                f"state or a data position): it loads at world size {saved} only, not "
                f"{self.world_size}; keep such values under a per-rank key to load elsewhere",
                file=mpath, rank=self.rank)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self._storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        # group read items by saved chunk: each chunk is read once and verified before use
        by_chunk: dict[tuple[str, int], list] = {}
        for req in plan.items:
            entry = self._storage_data[req.storage_index]
            if req.type == LoadItemType.BYTE_IO:
                buf = io.BytesIO()
                torch.save(entry[1], buf)  # produced here from JSON data, never from storage
                buf.seek(0)
                planner.load_bytes(req, buf)
                continue
            fqn, c = entry
            item = (req, fqn, c, planner.resolve_tensor(req).detach())
            if not _chunks.queue_read(by_chunk, item, self.body, self.step_dir, self.rank):
                planner.commit_tensor(req, item[3])  # an empty chunk: nothing to read
        # chunks that fill a host destination (see _direct_ok) are read straight into it (no
        # read buffer, no copy); the rest, and device (CUDA) destinations, in spans
        backend = _device.default_backend()
        direct = [_Direct(f, off, reqs) for (f, off), reqs in by_chunk.items()
                  if self._direct_ok(reqs) and not (backend is not None and any(
                      backend.is_device(r[3]) for r in reqs))]
        for d in direct:
            del by_chunk[(d.file, d.start)]
        spans = _spans(by_chunk)
        self.read_stats = {"direct_chunks": len(direct),
                           "direct_bytes": sum(d.length for d in direct),
                           "span_bytes": sum(sp.length for sp in spans),
                           "direct_io": int(self._read_direct_io())}
        # device targets: pinned read buffers, non-blocking copies (see engine/device.py)
        loader = None
        if backend is not None and any(backend.is_device(t) for reqs in by_chunk.values()
                                       for _, _, _, t in reqs):
            loader = _device.DeviceLoader(backend)
        for item, buf, h in self._prefetch(direct + spans, loader):
            if isinstance(item, _Direct):
                req, fqn, c, target = item.reqs[0]
                if self.verify:
                    self._check_hash(h, fqn, c)
                planner.commit_tensor(req, target)
                continue
            span = item
            for key in span.chunks:
                reqs = by_chunk[key]
                _, fqn, c, _ = reqs[0]
                if "codec" in c and self._whole_into(reqs, fqn, c):
                    # a compressed chunk that fills its one destination: decoded into it
                    req, _, _, target = reqs[0]
                    self._chunk_view(buf, span, fqn, c, into=target)
                    planner.commit_tensor(req, target)
                    continue
                saved = self._chunk_view(buf, span, fqn, c)
                for req, _, _, target in reqs:
                    src = saved
                    for dim, (o, n) in enumerate(zip(req.storage_offsets, req.lengths)):
                        src = src.narrow(dim, o, n)
                    if target.shape != src.shape:
                        raise CorruptCheckpointError(
                            f"read item shape {list(src.shape)} does not fit target "
                            f"{list(target.shape)}", key=fqn, rank=self.rank)
                    if loader is not None and backend.is_device(target):
                        loader.copy(target, src)  # the buffer waits for it before reuse
                    elif (target.device.type == "cpu" and target.dtype == src.dtype
                            and target.is_contiguous() and src.is_contiguous()
                            and not target.is_conj() and not target.is_neg()):
                        # one thread, GIL released (torch's copy_ leaves its OpenMP threads
                        # spinning after every call, which cost more CPU than the copy here)
                        self._io.copy(target.data_ptr(), src.data_ptr(),
                                      src.numel() * src.element_size())
                    else:
                        target.copy_(src)
                    planner.commit_tensor(req, target)
            if loader is not None:
                loader.end_buffer(_address(buf))
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    # -- helpers -------------------------------------------------------------------------------
    def _direct_ok(self, reqs: list) -> bool:
        """Whether a saved chunk can be read straight into its one destination: a whole,
        contiguous CPU tensor of the same dtype and size. Around the page cache (O_DIRECT) the
        chunk must also be at least DIRECT_MIN bytes and the tensor's address have the same
        remainder modulo 4096 as the chunk's file offset (so all of it is read with O_DIRECT
        without a read buffer: its whole pages straight into place; the partial first and last
        ones, on a local file system with the native backend, into bounce pages in the same
        requests, else with buffered reads): zero-copy saves place
        chunks in phase with the saving process's tensors, which the loading process's tensors
        usually share, and tensors a load allocates are placed in phase. Through the page cache
        any such destination is read into directly (one copy, from the cache)."""
        if len(reqs) != 1:
            return False
        _, fqn, c, t = reqs[0]
        n = int(c["length"])
        if "codec" in c:  # compressed: read in a span and decoded
            return False
        if not (n > 0 and t.numel() * t.element_size() == n
                and self._whole_into(reqs, fqn, c)):
            return False
        if not self._read_direct_io():
            return True
        return n >= DIRECT_MIN and (t.data_ptr() - int(c["offset"])) % fmt.ALIGN == 0

    def _read_direct(self, d: "_Direct") -> int | None:
        """(reader thread) Read a chunk into its destination; its hash (None: not verifying)."""
        _, _, c, t = d.reqs[0]
        path = self._check_file(d.file)
        addr, off, n = t.data_ptr(), d.start, d.length
        storage = self.storage
        if type(storage) is LocalStorage and hasattr(storage.io, "read_to"):
            # one call: O_DIRECT for every page of the chunk (the partial first and last ones
            # through bounce pages in the same requests, no synchronous small reads between the
            # large ones), each block hashed as it lands while the next ones are read
            direct = self._read_direct_io() and storage.direct_io
            try:
                return storage.io.read_to(path, off, addr, n, direct=direct, hash=self.verify)
            except (OSError, EOFError) as e:
                raise storage_error(e, "reading", path, offset=off) from e
        if not self._read_direct_io():  # through the page cache: one read, straight in
            self.storage.read_into(path, off, _raw_view(addr, n), n, hash=False, direct=False)
        else:  # the page-aligned body with O_DIRECT, the partial first and last pages buffered
            lo, hi = fmt.align_up(off), (off + n) // fmt.ALIGN * fmt.ALIGN
            assert lo <= hi, "direct reads are for chunks of at least a page (DIRECT_MIN)"
            for a, z, direct in ((lo, hi, True), (off, lo, False), (hi, off + n, False)):
                if z > a:
                    self.storage.read_into(path, a, _raw_view(addr + a - off, z - a), z - a,
                                           hash=False, direct=direct)
        return self._io.hash(_raw_view(addr, n), n) if self.verify else None

    def _prefetch(self, items: list, loader: Any = None):
        """Yield (item, buffer, hash) as reads finish, while READ_STREAMS threads read the next
        items in file order: a span into a reusable buffer (hash None: its chunks are checked
        one by one), a direct chunk into its destination (buffer None, hash of the bytes read,
        computed by the reader thread).

        READ_STREAMS + 2 buffers of the largest span are allocated once per ``read_data`` and
        reused, so first-touch page faults and the extra memory stay bounded however large the
        checkpoint is. Items are yielded in the order their reads finish (each read item says
        where its bytes go, so order does not matter); two reads in flight keep the device queue
        full across item boundaries.
        """
        if not items:
            return
        # spans first: in a restart most of them are small (biases, steps, the bytes between
        # large tensors), and read while the device queue is still empty each costs a fraction
        # of a millisecond instead of a wait behind the large reads in flight
        items = sorted(items, key=lambda it: (isinstance(it, _Direct), it.file, it.start))
        spans = [it for it in items if isinstance(it, _Span)]
        # object stores fetch more spans at once (each span's ranged GETs share one limit)
        nthreads = min(max(READ_STREAMS, self.storage.read_streams), len(items))
        free: queue.Queue = queue.Queue()
        try:
            for _ in range(min(nthreads + 2, len(spans))):
                b = aligned_buffer(fmt.align_up(max(sp.length for sp in spans)))
                free.put(b)
                if loader is not None:  # device targets: copied out of pinned memory
                    loader.pin(_address(b), len(b))
        except BaseException:
            if loader is not None:
                loader.finish()  # unpin the ones pinned so far
            raise
        ready: queue.Queue = queue.Queue()
        busy, bound = Busy(), stall_s(items)  # (a read that never returns: readitems.py)
        stop = threading.Event()
        abandon = threading.Event()  # the prefault thread's: a failed or abandoned load
        todo = iter(items)
        todo_lock = threading.Lock()

        def reader() -> None:
            while not stop.is_set():
                with todo_lock:
                    it = next(todo, None)
                if it is None:
                    return
                buf = None
                if isinstance(it, _Span):
                    buf = free.get()
                    if buf is None or stop.is_set():
                        return
                busy.start(it)
                try:
                    h = None
                    if buf is None:
                        h = self._read_direct(it)
                    else:
                        if loader is not None:  # device copies out of this buffer still queued
                            loader.before_reuse(_address(buf))
                        path = self._check_file(it.file)
                        # no hash of the whole span: each chunk is checked on its own
                        self.storage.read_into(path, it.start, buf, it.length, hash=False,
                                               direct=self._read_direct_io())
                    ready.put((it, buf, h, None))
                except BaseException as e:  # noqa: BLE001 - handed to the consumer
                    ready.put((it, buf, None, e))
                    return
                finally:
                    busy.end()
        threads = [threading.Thread(target=reader, name=f"fastckpt-reader-{i}", daemon=True)
                   for i in range(nthreads)]
        directs = [it for it in items if isinstance(it, _Direct)]
        if directs:  # their destinations' first-touch faults, ahead of the reads (see _populate)
            threads.append(threading.Thread(target=_populate, args=(directs, abandon),
                                            name="fastckpt-prefault", daemon=True))
        for t in threads:
            t.start()
        try:
            for _ in items:
                it, buf, h, err = next_ready(ready, busy, bound, self.step_dir, self.rank)
                if err is not None:
                    if isinstance(err, (CorruptCheckpointError, StepRemovedError)):
                        raise err
                    if is_missing(err):
                        self._raise_if_removed()
                    raise CorruptCheckpointError(
                        f"cannot read {it.length} bytes: {err}", file=f"{self.step_dir}/{it.file}",
                        offset=it.start, rank=self.rank) from err
                yield it, buf, h
                if buf is not None:
                    free.put(buf)
        except BaseException:
            abandon.set()
            raise
        finally:
            stop.set()
            for _ in threads:
                free.put(None)  # unblock readers waiting for a buffer
            for t in threads:  # (a read stuck in a hung mount keeps its thread: bounded)
                t.join(0.0 if busy.stalled else bound)
            if loader is not None:  # every copy done before the buffers are unpinned, freed
                loader.finish()

    def _chunk_view(self, buf: memoryview, span: "_Span", fqn: str, c: dict,
                    into: torch.Tensor | None = None) -> torch.Tensor:
        """The saved chunk as a tensor over ``buf``, after checking its checksum (of the
        stored bytes). A compressed chunk is decoded into ``into`` (a contiguous CPU tensor of
        its dtype and size), else into a new tensor: its frames are checked as they decode, so
        a damaged frame is an error even with ``verify=False``."""
        path = f"{self.step_dir}/{c['file']}"
        n = int(c["length"])
        dtype = torch_dtype(self.body["tensors"][fqn]["dtype"], file=path)
        if n == 0 and "codec" not in c:
            return _chunks.empty_for(c["sizes"], dtype, key=fqn, file=path, rank=self.rank)
        rel = int(c["offset"]) - span.start
        if self.verify:
            self._check_hash(self._io.hash(buf[rel:rel + n], n), fqn, c)
        if "codec" in c:
            from ..storage import codec
            out = into if into is not None else _chunks.empty_for(c["sizes"], dtype, key=fqn,
                                                                  file=path, rank=self.rank)
            if out.numel():
                codec.decode_into(buf[rel:rel + n], c["codec"],
                                  _raw_view(out.data_ptr(), out.numel() * out.element_size()),
                                  threads=_compress.DECODE_THREADS,
                                  executor=_compress.decoders(), native=_native_mode(self._io),
                                  file=path, key=fqn, rank=self.rank, offset=int(c["offset"]))
            return out
        raw = torch.frombuffer(buf, dtype=torch.uint8, count=n, offset=rel)
        return raw.view(dtype).reshape(c["sizes"])

    def _whole_into(self, reqs: list, fqn: str, c: dict) -> bool:
        """One read item that takes the whole chunk into a contiguous CPU tensor of its dtype
        and size (a compressed chunk is then decoded straight into it)."""
        if len(reqs) != 1:
            return False
        req, _, _, t = reqs[0]
        return (t.device.type == "cpu" and t.is_contiguous() and not t.is_conj()
                and not t.is_neg() and list(t.shape) == list(c["sizes"])
                and not any(req.storage_offsets) and list(req.lengths) == list(c["sizes"])
                and t.dtype == torch_dtype(self.body["tensors"][fqn]["dtype"],
                                           file=f"{self.step_dir}/{fmt.MANIFEST}"))

    def _check_hash(self, h: int, fqn: str, c: dict) -> None:
        """Raise CorruptCheckpointError unless ``h`` is chunk ``c``'s recorded checksum."""
        if fmt.hexdigest(h) != c["checksum"]:
            raise CorruptCheckpointError(
                f"checksum mismatch in {int(c['length'])} bytes (expected {c['checksum']}, read "
                f"{fmt.hexdigest(h)}): the shard is damaged", file=f"{self.step_dir}/{c['file']}",
                key=fqn, offset=int(c["offset"]), rank=self.rank)

    def _read_direct_io(self) -> bool:
        """Whether to read around the page cache (O_DIRECT): not for a small checkpoint
        (SMALL_LOAD bytes: its reads are too short to gain, and a warm cache is faster), nor one
        whose files are in the page cache already (just written, or read before); yes
        otherwise (a restart reading GBs cold: no double copy, no cache pollution)."""
        if self._direct is None:
            files = self._files()
            total = sum(self.body["files"][n]["size"] for n in files)
            self._direct = total > SMALL_LOAD and not all(
                self.storage.cached(f"{self.step_dir}/{n}") for n in files)
        return self._direct

    def _files(self) -> list[str]:
        """The shard files this reader may read: every file of the step, or of a partial body
        (one rank's own index and the inline chunks) the files its chunks name."""
        if self.partial:
            return sorted({c["file"] for t in self.body["tensors"].values()
                           for c in t["chunks"]})
        return sorted(self.body["files"])

    @property
    def _io(self):
        io_backend = getattr(self.storage, "io", None)
        return io_backend if io_backend is not None else get_backend("auto")

    def check_files(self) -> None:
        """Check every shard file the manifest lists (present, a regular file, of the recorded
        size) before anything is allocated or read: the validated manifest's tensors fit its
        files, so after this they fit what is really there."""
        for name in self._files():
            self._check_file(name)

    def _check_file(self, name: str) -> str:
        path = f"{self.step_dir}/{name}"
        if name not in self._checked_files:
            info = self.body["files"].get(name)
            if info is None:
                raise CorruptCheckpointError("manifest references a file it does not list",
                                             file=path, rank=self.rank)
            try:
                size = self.storage.size(path)
            except NotRegularFileError as e:
                raise CorruptCheckpointError(f"the shard is not a regular file ({e})",
                                             file=path, rank=self.rank) from None
            if size is None:
                self._raise_if_removed()
                raise CorruptCheckpointError("shard file is missing", file=path, rank=self.rank)
            if size != info["size"]:
                raise CorruptCheckpointError(
                    f"shard file is {size} bytes, the manifest says {info['size']} "
                    f"({'truncated' if size < info['size'] else 'extended'})",
                    file=path, rank=self.rank, offset=min(size, info["size"]))
            self._checked_files.add(name)
        return path

    def _raise_if_removed(self) -> None:
        """StepRemovedError if this step's manifest is gone or belongs to another save now
        (retention or gc removed the step while it was read)."""
        try:
            now = read_manifest(self.storage, self.step_dir, chunks=False)
        except (CorruptCheckpointError, StorageError):
            return
        if now is None or now.get("save_id") != self.body["save_id"]:
            raise StepRemovedError(f"step {self.step} was removed while it was being read "
                                   "(a newer step was committed and retention or gc removed "
                                   "this one)", file=self.step_dir, rank=self.rank)

    def _plain_values_and_aliases(self) -> tuple[dict, dict[str, list[str]], dict]:
        """Plain (non-tensor) leaves under DCP's flattened names, for ``dcp.load`` users (this
        rank's when they differ by rank), and stored tensor -> the other keys tied to it."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict
        tree = self._tree if self._tree is not None else self.body.get("tree")
        if tree is None:  # per-rank values: this rank's
            self._check_same_world("the state holds plain values per rank",
                                   f"{self.step_dir}/{fmt.MANIFEST}")
            tree = self.body["rank_trees"][self.rank]
        refs: dict[int, str] = {}

        def marker(fqn: str) -> torch.Tensor:
            t = torch.empty(0)
            refs[id(t)] = fqn
            return t
        flat, mappings = flatten_state_dict(decode_value(tree, marker))
        plain = {k: v for k, v in flat.items() if id(v) not in refs}
        aliases: dict[str, list[str]] = {}
        for k, v in flat.items():
            if id(v) in refs and refs[id(v)] != k:
                aliases.setdefault(refs[id(v)], []).append(k)
        return plain, aliases, mappings


def _native_mode(io_backend: Any) -> str:
    return "auto" if getattr(io_backend, "name", "") == "native" else "off"


# ------------------------------------------------------------------------------------- spans

#: the most bytes read in one request; READ_STREAMS + 2 buffers of this size bound the load's
#: extra memory
SPAN_MAX = 64 << 20
#: the largest gap between two needed chunks that one span reads through
SPAN_GAP_MAX = 1 << 20
#: spans read at once (each with the I/O backend's own requests in flight)
READ_STREAMS = 2
#: the prefault thread's step (bytes per madvise call; it checks for the end between them)
PREFAULT_SLICE = 8 << 20
#: chunks from this size up are read straight into their destination when it allows
DIRECT_MIN = 1 << 20
#: checkpoints up to this size are read through the page cache (see _read_direct_io)
SMALL_LOAD = 64 << 20


def _populate(directs: list[_Direct], stop: threading.Event) -> None:
    """(a thread of its own) Fault in the direct reads' destinations, in the order they are
    read, ahead of the readers. A restarted job's fresh tensors (a new optimizer's moments) have
    no pages yet; an O_DIRECT read takes each page's fault inside the read call, on the reader
    thread, before its request reaches the device, so faults and I/O took turns. Here they
    overlap: the device reads while this thread faults the next destinations (measured:
    docs/benchmarks.md, restart load). Pages are only populated, never written; a reader that
    gets to a page first faults it itself. Pages already present (a stepped state, or read
    before this thread got to them) cost a page-table walk; a failed load stops it."""
    for d in directs:
        addr, n = d.reqs[0][3].data_ptr(), d.length
        for a in range(0, n, PREFAULT_SLICE):
            if stop.is_set() or not populate(addr + a, min(PREFAULT_SLICE, n - a)):
                return


def _spans(by_chunk: dict[tuple[str, int], list]) -> list[_Span]:
    """Group the needed chunks into spans: file order, page-aligned starts, at most SPAN_MAX
    bytes unless a single chunk is larger. Gaps of up to SPAN_GAP_MAX between needed chunks are
    read too when the span stays within the limit (cheaper than another request); larger ones
    (chunks read directly into their destination, or not needed by this rank) start a new
    span."""
    spans: list[_Span] = []
    for key in sorted(by_chunk):
        file, off = key
        c = by_chunk[key][0][2]
        end = off + int(c["length"])
        cur = spans[-1] if spans else None
        if (cur is not None and cur.file == file and end - cur.start <= SPAN_MAX
                and off - cur.end <= SPAN_GAP_MAX):
            cur.end = max(cur.end, end)
            cur.chunks.append(key)
        else:
            start = off - off % fmt.ALIGN
            spans.append(_Span(file, start, end, [key]))
    return spans
