"""Staging device (CUDA) tensors: pinned staging buffers and device-to-host copies on a side
stream, ordered against the training stream with events.

For every save whose state holds CUDA tensors:

1. The staging pool's buffers are page-locked once with ``cudaHostRegister`` (the same call
   ``torch.distributed.checkpoint``'s stager uses) and stay registered while the pool reuses
   them; a buffer is unregistered before it is freed. Only pinned memory lets a device-to-host
   copy run asynchronously on a copy engine at full PCIe/NVLink-C2C speed.
2. Per device, a side stream first waits for the training (current) stream, so the copies read
   the values of every kernel queued before ``save`` was called.
3. Each piece's device chunks are copied into the piece's buffer with ``non_blocking=True`` on
   the side stream (the CPU chunks of the same piece are copied by the host meanwhile); an event
   recorded after them is handed to the writer, which waits for it before it writes or hashes
   the buffer.
4. When every piece is queued, ``mode="stream"`` (default) makes the training stream wait for
   the copies **on the GPU**: ``save`` returns without waiting on the host, the caller can
   queue the next step at once, and any kernel it queues on that stream (including in-place
   updates of the saved tensors) runs after the copy. ``mode="sync"`` waits on the host until
   the copies are done: use it when the saved tensors may be written from other streams.

Loads into CUDA tensors (:class:`DeviceLoader`): the reader's buffers are pinned for the load,
each span's bytes go to their CUDA targets with ``non_blocking=True`` on the target's current
stream (after the host verified their checksums), and a buffer is read into again only after
the event recorded behind its copies; the load returns after a host wait for every copy, and
the buffers are unpinned before they are freed.

The CUDA calls are confined to :class:`CudaBackend`; everything else talks to a backend object,
so the ordering logic is tested on CPU with a simulated backend (tests/test_device_staging.py:
nothing real can run CUDA on the build machines) and measured on a GPU with
benchmarks/gpu_check.py.
"""

from __future__ import annotations

import torch

from ..errors import FastCkptError


class CudaBackend:
    """The only code that calls CUDA."""

    name = "cuda"

    @staticmethod
    def is_device(t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    @staticmethod
    def register(addr: int, nbytes: int) -> None:
        err = int(torch.cuda.cudart().cudaHostRegister(addr, nbytes, 1))  # Portable
        if err:
            raise FastCkptError(f"cudaHostRegister of a {nbytes}-byte staging buffer at "
                                f"{addr:#x} failed with cudaError {err} (locked-memory limit? "
                                "see `ulimit -l`)")

    @staticmethod
    def unregister(addr: int) -> None:
        torch.cuda.cudart().cudaHostUnregister(addr)

    @staticmethod
    def current_stream(device):
        return torch.cuda.current_stream(device)

    @staticmethod
    def new_stream(device):
        return torch.cuda.Stream(device)

    @staticmethod
    def wait_stream(stream, other) -> None:
        stream.wait_stream(other)

    @staticmethod
    def copy_async(dst: torch.Tensor, src: torch.Tensor, stream) -> None:
        """Device ``src`` -> ``dst``, its bytes in a pinned host buffer, on ``stream``."""
        with torch.cuda.stream(stream):  # a strided src is made contiguous on that stream too
            dst.copy_(src.contiguous().reshape(-1).view(torch.uint8), non_blocking=True)
        # the caching allocator must not hand src's memory to another stream before the copy
        src.record_stream(stream)

    @staticmethod
    def h2d(dst: torch.Tensor, src: torch.Tensor) -> None:
        """Pinned host ``src`` -> device ``dst``, on ``dst``'s current stream."""
        dst.copy_(src, non_blocking=True)

    @staticmethod
    def record(stream):
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    @staticmethod
    def wait_event(stream, ev) -> None:
        stream.wait_event(ev)

    @staticmethod
    def synchronize(ev) -> None:
        ev.synchronize()


_backend = None


def default_backend():
    """The CUDA backend when CUDA is available, else None (device tensors cannot exist)."""
    global _backend
    if _backend is None and torch.cuda.is_available():
        _backend = CudaBackend()
    return _backend


class Ready:
    """Events a piece's buffer waits for before the writer may read it."""

    __slots__ = ("_backend", "_events")

    def __init__(self, backend, events: list) -> None:
        self._backend = backend
        self._events = events

    def wait(self) -> None:
        for ev in self._events:
            self._backend.synchronize(ev)


class _Pinner:
    """Host buffers page-locked through the backend, by address."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self._pinned: dict[int, int] = {}  # address -> bytes registered

    def pin(self, addr: int, nbytes: int) -> None:
        if nbytes and addr not in self._pinned:
            self.backend.register(addr, nbytes)
            self._pinned[addr] = nbytes

    def unpin(self, addr: int) -> None:
        if self._pinned.pop(addr, None) is not None:
            self.backend.unregister(addr)

    @property
    def pinned_bytes(self) -> int:
        return sum(self._pinned.values())

    def close(self) -> None:
        for addr in list(self._pinned):
            self.unpin(addr)


class DeviceStager(_Pinner):
    """Pinning of staging buffers and the side-stream copies of one checkpointer (used by the
    training thread only, except :meth:`Ready.wait`, which the writer calls)."""

    def __init__(self, backend, mode: str = "stream") -> None:
        if mode not in ("stream", "sync"):
            raise ValueError(f"cuda_stage must be 'stream' or 'sync', got {mode!r}")
        super().__init__(backend)
        self.mode = mode
        self._side: dict = {}  # device -> side stream
        self._waited: set = set()  # devices whose side stream waited in this save
        self._piece_streams: set = set()  # devices with copies in the current piece
        self._last: dict = {}  # device -> the last event recorded in this save

    # -- one save -----------------------------------------------------------------------------
    def begin_save(self) -> None:
        self._waited.clear()
        self._last.clear()
        self._piece_streams.clear()

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Queue ``src`` (a device tensor) -> ``dst`` (a uint8 view of a pinned buffer)."""
        dev = src.device
        side = self._side.get(dev)
        if side is None:
            side = self._side[dev] = self.backend.new_stream(dev)
        if dev not in self._waited:  # once per save: after everything queued before save()
            self.backend.wait_stream(side, self.backend.current_stream(dev))
            self._waited.add(dev)
        self.backend.copy_async(dst, src, side)
        self._piece_streams.add(dev)

    def end_piece(self) -> Ready | None:
        """The events the writer waits for before reading this piece's buffer (None: the piece
        has no device chunks)."""
        if not self._piece_streams:
            return None
        events = []
        for dev in self._piece_streams:
            ev = self.backend.record(self._side[dev])
            self._last[dev] = ev
            events.append(ev)
        self._piece_streams.clear()
        return Ready(self.backend, events)

    def end_save(self) -> None:
        """Order the caller after this save's copies: on the GPU (``stream``) or the host."""
        for dev, ev in self._last.items():
            if self.mode == "stream":
                self.backend.wait_event(self.backend.current_stream(dev), ev)
            else:
                self.backend.synchronize(ev)
        self._last.clear()

    def abort(self) -> None:
        """After a failure while staging: wait on the host for every copy this save queued, so
        none can still write a buffer the pool hands out again."""
        for dev in self._waited:
            self.backend.synchronize(self.backend.record(self._side[dev]))
        self._last.clear()
        self._piece_streams.clear()


class DeviceLoader(_Pinner):
    """Host-to-device copies of one load out of the reader's (pinned) buffers."""

    def __init__(self, backend) -> None:
        super().__init__(backend)
        self._devices: set = set()  # every device copied to
        self._span: set = set()  # devices copied to from the current buffer
        self._ready: dict[int, Ready] = {}  # buffer address -> its copies' events

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        self.backend.h2d(dst, src)
        self._span.add(dst.device)
        self._devices.add(dst.device)

    def end_buffer(self, addr: int) -> None:
        """The copies out of the buffer at ``addr`` are queued: remember their events."""
        if self._span:
            self._ready[addr] = Ready(self.backend, [
                self.backend.record(self.backend.current_stream(d)) for d in self._span])
            self._span.clear()

    def before_reuse(self, addr: int) -> None:
        """(reader thread) Wait until nothing is still copied out of the buffer at ``addr``."""
        r = self._ready.pop(addr, None)
        if r is not None:
            r.wait()

    def finish(self) -> None:
        """Wait on the host for every copy of this load (also ones after the last recorded
        event, after a failure), then unpin the buffers."""
        try:
            for d in self._devices:
                self.backend.synchronize(self.backend.record(self.backend.current_stream(d)))
        finally:
            self._ready.clear()
            self._span.clear()
            self.close()
