"""A TCP proxy on 127.0.0.1 that can fall silent: an S3 endpoint that stops answering.

``SilentProxy(target_port)`` listens on a free loopback port and forwards every connection to
``127.0.0.1:target_port`` (the moto server), byte for byte, until it is told to fall silent:

    with SilentProxy(moto_port) as proxy:
        proxy.endpoint                    # "http://127.0.0.1:PORT"
        proxy.silence()                   # from now on nothing is answered
        proxy.silence(after_bytes=n)      # the same, once n more request bytes went upstream
        proxy.resume()                    # new connections are forwarded again

Silent: connections are still accepted and what clients send is read (and dropped), but
nothing reaches the server and nothing comes back -- a black hole, not a refusal, so only a
client's timeouts can end its wait. The connections open when the silence starts stop
forwarding in both directions, mid-request or mid-response, and stay black holes; ``resume()``
closes them (like an endpoint whose connections were reset while it was away).

Each connection is pumped by one thread (``select`` over its two sockets); ``stop()`` (or
leaving the ``with`` block) closes every socket and joins every thread. Nothing here talks to
any address other than 127.0.0.1.
"""

from __future__ import annotations

import select
import socket
import threading

from tests.s3server import LOOPBACK

_POLL_S = 0.05


class _Conn:
    def __init__(self, client: socket.socket, upstream: socket.socket | None) -> None:
        self.client = client
        self.upstream = upstream  # None once dead
        self.dead = upstream is None  # a black hole: drops what it reads, forwards nothing


class SilentProxy:
    """A forwarding TCP proxy to ``127.0.0.1:target_port`` that can fall silent on demand."""

    def __init__(self, target_port: int) -> None:
        self.target = (LOOPBACK, target_port)
        self._lock = threading.Lock()
        self._silent = False
        self._after: int | None = None  # request bytes still to forward before falling silent
        self._conns: list[_Conn] = []
        self._threads: list[threading.Thread] = []
        self._stopping = threading.Event()
        self._listener: socket.socket | None = None
        #: request bytes forwarded upstream so far
        self.forwarded = 0
        self.port: int | None = None

    @property
    def endpoint(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    # -- control ------------------------------------------------------------------------------
    def silence(self, *, after_bytes: int = 0) -> None:
        """Fall silent now, or once ``after_bytes`` more request bytes were forwarded."""
        with self._lock:
            if after_bytes > 0:
                self._after = after_bytes
            else:
                self._go_silent()

    def resume(self) -> None:
        """Forward new connections again; the connections silenced are closed."""
        with self._lock:
            self._silent = False
            self._after = None

    @property
    def silent(self) -> bool:
        return self._silent

    def _go_silent(self) -> None:  # with self._lock held
        self._silent = True
        self._after = None
        for c in self._conns:
            c.dead = True

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> str:
        ls = socket.socket()
        ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        ls.bind((LOOPBACK, 0))
        ls.listen(64)
        self._listener = ls
        self.port = ls.getsockname()[1]
        self._spawn(self._accept_loop)
        return self.endpoint

    def stop(self) -> None:
        self._stopping.set()
        self._threads[0].join(timeout=10)  # the accept loop: no new connection after this
        with self._lock:
            for c in self._conns:  # wakes a pump blocked in sendall
                for sock in (c.client, c.upstream):
                    if sock is not None:
                        try:
                            sock.shutdown(socket.SHUT_RDWR)
                        except OSError:
                            pass
        for t in self._threads:
            t.join(timeout=10)
        alive = [t.name for t in self._threads if t.is_alive()]
        self._listener.close()
        if alive:
            raise RuntimeError(f"proxy threads did not stop: {alive}")

    def __enter__(self) -> "SilentProxy":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- threads ------------------------------------------------------------------------------
    def _spawn(self, fn, *args) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True,
                             name=f"s3proxy-{self.port}-{len(self._threads)}")
        self._threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        ls = self._listener
        while not self._stopping.is_set():
            if not select.select([ls], [], [], _POLL_S)[0]:
                continue
            client, _ = ls.accept()
            with self._lock:
                silent = self._silent
            upstream = None
            if not silent:
                try:
                    upstream = socket.create_connection(self.target, timeout=10)
                except OSError:  # the server is gone: so is this connection
                    client.close()
                    continue
                upstream.settimeout(None)
            conn = _Conn(client, upstream)
            with self._lock:
                self._conns.append(conn)
            self._spawn(self._pump, conn)

    def _pump(self, c: _Conn) -> None:
        try:
            while not self._stopping.is_set():
                if c.dead:
                    if c.upstream is not None:
                        c.upstream.close()  # the server never sees the rest of the request
                        c.upstream = None
                    if not self._silent:
                        return  # resumed: drop the connection the client may still pool
                socks = [c.client] + ([c.upstream] if c.upstream is not None else [])
                for s in select.select(socks, [], [], _POLL_S)[0]:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    if s is c.client:
                        self._to_server(c, data)
                    elif not c.dead:
                        c.client.sendall(data)
        except OSError:
            return
        finally:
            with self._lock:
                self._close(c)
                if c in self._conns:
                    self._conns.remove(c)

    def _to_server(self, c: _Conn, data: bytes) -> None:
        with self._lock:
            if c.dead:
                return
            falls_silent = False
            if self._after is not None:
                data = data[:self._after]
                self._after -= len(data)
                falls_silent = self._after == 0
            self.forwarded += len(data)
        c.upstream.sendall(data)
        if falls_silent:
            with self._lock:
                self._go_silent()

    @staticmethod
    def _close(c: _Conn) -> None:
        for s in (c.client, c.upstream):
            if s is not None:
                try:
                    s.close()
                except OSError:
                    pass
