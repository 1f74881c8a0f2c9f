"""A throttling, fault-injecting HTTP proxy in front of the moto server: a model of a real store.

Real object stores cap each TCP connection (S3: about 50-90 MB/s) and cost a round trip per
request, so one stream is slow and many concurrent part uploads or ranged GETs are fast; they
also throttle (503 SlowDown), fail (500), refuse (403) and die mid-transfer. moto on loopback
does none of that. ``ThrottleProxy(moto_port)`` forwards each connection from a free loopback
port to ``127.0.0.1:moto_port`` and plays such a store:

    with ThrottleProxy(srv.port, rate_bps=50e6, latency_s=0.02) as proxy:
        proxy.endpoint                     # "http://127.0.0.1:PORT": give it to boto3 / s3fs
        proxy.inject(503, count=3, method="PUT", query_contains="partNumber")  # 3 x SlowDown
        proxy.set_rate(5e6)                # the store slows down, open connections too
        proxy.kill(); proxy.restart()      # every connection reset at once; then back, same port
        proxy.stats()["max_in_flight"]     # the concurrency the client really used

- **Bandwidth**, per TCP connection and direction: a token bucket of ``rate_bps`` bytes/s
  (burst 128 KiB) spent in pieces of 20 ms of the rate (4-64 KiB), so a new rate reaches open
  connections at their next piece. 128 KiB socket buffers and at most ~400 KiB held by the
  proxy per direction: no buffer hides the cap, and N connections get N times one's rate.
- **Latency**: each request waits ``latency_s`` before its head goes upstream. Both directions
  are parsed as HTTP/1.1 (head to CRLFCRLF, then a ``Content-Length`` or chunked body, none,
  or to EOF), so keep-alive connections carry many requests and ``Expect: 100-continue``
  works (``100 Continue`` passes down like any response). moto (werkzeug) closes after every
  response, so through moto each request has a connection of its own.
- **Faults**: ``inject`` rules answer the next ``count`` matching requests from the proxy
  (moto never sees them) with an S3 XML error and ``Connection: close``, then drop whatever
  body the client still sends until it closes. ``kill()`` resets every connection (RST:
  SO_LINGER 0) and stops listening, ``restart()`` listens on the same port again;
  ``silence()`` accepts and reads but never answers, until ``resume()``.
- **Counters**, ``stats()``: requests forwarded per method, final responses per status,
  injected errors, bytes up / down, connections opened, open (now, at most) and requests in
  flight (now, at most). A request is in flight from the arrival of its head until the last
  byte of its response was handed to the client's socket, the proxy answered it, or its
  connection closed.

The proxy is a child process (the client under test does not share its GIL): one asyncio loop,
two coroutines per connection. It dies with its parent (``PR_SET_PDEATHSIG``, and at the end of
its stdin). Control channel: the child's stdin and stdout, a JSON line per call and per reply
(``{"op": "set", "rate": 1e6}`` -> ``{"ok": true, "result": null}``): no second port, nothing
mixed into the HTTP traffic; calls from several threads are serialized. Nothing here talks to
any address other than 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import json
import os
import select
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import uuid

from tests.s3server import LOOPBACK

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SOCK_BUF = 128 * 1024  # SO_RCVBUF / SO_SNDBUF of every proxy socket (Linux doubles it)
_BUF_MAX = 256 * 1024  # bytes queued for a socket before the writer waits (drain)
_HEAD_MAX = 64 * 1024  # the longest head; a reader holds at most twice this, then stops reading
_BURST = 128 * 1024
_DRAIN_S = 2.0  # after an injected error: read and drop at most this long, then close

#: the S3 error code, message and reason phrase of each status ``inject`` knows
ERRORS = {
    503: ("SlowDown", "Please reduce your request rate.", "Slow Down"),
    500: ("InternalError", "We encountered an internal error. Please try again.",
          "Internal Server Error"),
    403: ("AccessDenied", "Access Denied", "Forbidden"),
    404: ("NoSuchBucket", "The specified bucket does not exist", "Not Found"),
}

#: the child: SIGTERM when the parent dies (Linux), exit if it already did, then serve
_CHILD = """
import os, signal, sys
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
sys.path.insert(0, sys.argv[2])
import asyncio
from tests.s3throttle import _main
asyncio.run(_main(sys.argv[3]))
"""


class ThrottleProxy:
    """A per-connection throttling, fault-injecting proxy to ``127.0.0.1:target_port``."""

    def __init__(self, target_port: int, *, rate_bps: float | None = None,
                 latency_s: float = 0.0, burst_bytes: int = _BURST,
                 startup_timeout: float = 30.0, call_timeout: float = 10.0) -> None:
        _check(rate_bps, latency_s)
        self._config = {"target_port": target_port, "rate_bps": rate_bps,
                        "latency_s": latency_s, "burst_bytes": int(burst_bytes)}
        self.startup_timeout, self.call_timeout = startup_timeout, call_timeout
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._log = self._rbuf = None  # the child's stderr, and control bytes not yet read
        self._lock = threading.Lock()

    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise RuntimeError("the throttle proxy is not running; call start() first")
        return f"http://{LOOPBACK}:{self.port}"

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    # -- the model, at runtime ----------------------------------------------------------------
    def set_rate(self, rate_bps: float | None) -> None:
        """Bytes/s per connection and direction (None: unlimited), open connections included."""
        _check(rate_bps, 0.0)
        self._call("set", rate=rate_bps)

    def set_latency(self, latency_s: float) -> None:
        """Seconds each request waits before it goes upstream, from the next request on."""
        _check(None, latency_s)
        self._call("set", latency=latency_s)

    def inject(self, status: int = 503, *, code: str | None = None, message: str | None = None,
               count: int | None = 1, method: str | None = None,
               path_contains: str | None = None, query_contains: str | None = None) -> None:
        """Answer the next ``count`` matching requests (None: every one) with an S3 error.

        A request matches when its method is ``method`` and its path and query string contain
        ``path_contains`` and ``query_contains`` (each None: any). Rules are tried in the order
        they were added; the first that matches answers.
        """
        if code is None and status not in ERRORS:
            raise ValueError(f"no standard S3 error code for HTTP {status}: pass code=")
        if count is not None and count < 1:
            raise ValueError(f"count must be >= 1 or None (every request), got {count}")
        std = ERRORS.get(status, (code, code, "Error"))
        self._call("inject", rule={
            "status": int(status), "code": code or std[0], "message": message or std[1],
            "reason": std[2], "count": count, "method": method and method.upper(),
            "path_contains": path_contains, "query_contains": query_contains})

    def clear_faults(self) -> None:
        self._call("clear_faults")

    def kill(self) -> None:
        """Reset every open connection (RST) and stop listening: the store died."""
        self._call("kill")

    def restart(self) -> None:
        """Listen again, on the same port."""
        self._call("restart")

    def silence(self) -> None:
        """Accept and read, never answer, open connections included: a black hole."""
        self._call("silence")

    def resume(self) -> None:
        """Forward new connections again; the silenced ones are reset."""
        self._call("resume")

    def stats(self) -> dict:
        """The counters (see the module's docstring), fresh from the proxy."""
        out = self._call("stats")
        out["responses"] = {int(k): v for k, v in out["responses"].items()}
        return out

    def reset_stats(self) -> None:
        """Zero the counters; the maxima start again from what is open / in flight now."""
        self._call("reset_stats")

    # -- lifecycle ----------------------------------------------------------------------------
    def start(self) -> str:
        if self._proc is not None:
            return self.endpoint
        self._log = tempfile.TemporaryFile()
        self._rbuf = b""
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(os.getpid()), _ROOT, json.dumps(self._config)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, bufsize=0)
        try:
            self.port = self._reply(time.monotonic() + self.startup_timeout)["port"]
        except BaseException:
            self.stop()
            raise
        atexit.register(self.stop)
        return self.endpoint

    def stop(self) -> None:
        """End the child (its stdin closed, then SIGTERM, then SIGKILL) and reap it."""
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        proc, self._proc, self.port = self._proc, None, None
        if proc is not None:
            with contextlib.suppress(OSError):
                proc.stdin.close()  # the child exits at the end of its control stream
            for end in (None, proc.terminate, proc.kill):
                if end is not None:
                    end()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=3)
                    break
            proc.stdout.close()
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> "ThrottleProxy":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # -- control channel ----------------------------------------------------------------------
    def _call(self, op: str, **args):
        with self._lock:
            if self._proc is None:
                raise RuntimeError("the throttle proxy is not running; call start() first")
            try:
                self._proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
            except OSError as e:
                raise RuntimeError(f"the throttle proxy is gone: {e}\n{self._tail()}") from e
            reply = self._reply(time.monotonic() + self.call_timeout)
        if not reply["ok"]:
            raise RuntimeError(f"throttle proxy: {op} failed: {reply['error']}")
        return reply["result"]

    def _reply(self, deadline: float) -> dict:
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._rbuf:  # a deadline, so a hung child cannot hang the tests
            left = deadline - time.monotonic()
            if left <= 0:  # hung: killed, so that no late answer is taken for another call's
                self._proc.kill()
                raise RuntimeError(f"the throttle proxy did not answer\n{self._tail()}")
            if select.select([fd], [], [], min(left, 0.5))[0]:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    raise RuntimeError(f"the throttle proxy exited with {self._proc.wait()}:\n"
                                       f"{self._tail()}")
                self._rbuf += chunk
        line, _, self._rbuf = self._rbuf.partition(b"\n")
        return json.loads(line)

    def _tail(self, n: int = 4000) -> str:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            self._log.seek(0)
            return self._log.read().decode(errors="replace")[-n:]
        return ""


def _check(rate_bps, latency_s) -> None:
    if rate_bps is not None and not rate_bps > 0:
        raise ValueError(f"rate_bps must be > 0 bytes/s or None (unlimited), got {rate_bps}")
    if not latency_s >= 0:
        raise ValueError(f"latency_s must be >= 0 seconds, got {latency_s}")


# ================================================================================ the child ==

async def _main(config: str) -> None:
    ctl_out = os.dup(1)
    os.dup2(2, 1)  # a stray print() goes to the log, never into the control stream
    proxy = _Proxy(json.loads(config))
    await proxy.listen(0)
    reader = asyncio.StreamReader()
    await asyncio.get_running_loop().connect_read_pipe(
        lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    os.write(ctl_out, (json.dumps({"port": proxy.port}) + "\n").encode())
    while line := await reader.readline():  # empty: stop() closed the pipe, or the parent died
        try:
            reply = {"ok": True, "result": await proxy.control(json.loads(line))}
        except Exception as e:
            reply = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        os.write(ctl_out, (json.dumps(reply) + "\n").encode())  # a short line: never blocks long
    proxy.kill()


class _Proxy:
    """The child's state: the listener, the model, the rules, the counters, the connections."""

    def __init__(self, config: dict) -> None:
        self.target_port = config["target_port"]
        self.rate, self.latency = config["rate_bps"], config["latency_s"]
        self.burst = config["burst_bytes"]
        self.port, self.server = 0, None  # the listener: None while killed
        self.faults: list[dict] = []
        self.conns: set[_Conn] = set()
        self.silent, self.in_flight = False, 0
        self.reset_stats()

    def reset_stats(self) -> None:
        self.stats = {"requests": {}, "responses": {}, "injected": 0, "injected_codes": {},
                      "bytes_up": 0, "bytes_down": 0, "connections": 0, "resets": 0,
                      "max_open_connections": len(self.conns), "max_in_flight": self.in_flight}

    async def listen(self, port: int) -> None:
        ls = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            _small_buffers(ls)  # before listen(): accepted sockets inherit them
            ls.bind((LOOPBACK, port))
            self.server = await asyncio.start_server(
                lambda r, w: _Conn(self, r, w).run(), sock=ls, limit=_HEAD_MAX, backlog=1024)
        except BaseException:
            ls.close()
            raise
        self.port = ls.getsockname()[1]

    def kill(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        for c in list(self.conns):
            c.close(reset=True)

    async def control(self, msg: dict):
        op = msg["op"]
        if op == "set":
            self.rate = msg.get("rate", self.rate)
            self.latency = msg.get("latency", self.latency)
        elif op == "inject":
            self.faults.append(msg["rule"])
        elif op == "clear_faults":
            self.faults.clear()
        elif op == "stats":
            return dict(self.stats, open_connections=len(self.conns), in_flight=self.in_flight)
        elif op == "reset_stats":
            self.reset_stats()
        elif op == "kill":
            self.kill()
            await asyncio.sleep(0.01)  # the sockets close (RST) on the loop's next turns
        elif op == "restart":
            if self.server is None:
                await self.listen(self.port)
        elif op in ("silence", "resume"):
            self.silent = op == "silence"
            for c in list(self.conns):
                if self.silent:
                    c.go_dead()
                elif c.dead:
                    c.close(reset=True)
        else:
            raise ValueError(f"unknown op {op!r}")
        return None

    def match(self, method: str, target: str) -> dict | None:
        path, _, query = target.partition("?")
        for rule in self.faults:
            if ((rule["method"] and rule["method"] != method)
                    or (rule["path_contains"] and rule["path_contains"] not in path)
                    or (rule["query_contains"] and rule["query_contains"] not in query)):
                continue
            if rule["count"] is not None:
                rule["count"] -= 1
                if rule["count"] <= 0:
                    self.faults.remove(rule)
            return rule
        return None

    def count(self, key: str, sub) -> None:
        d = self.stats[key]
        d[str(sub)] = d.get(str(sub), 0) + 1

    def bump(self, key: str, now: int) -> None:
        self.stats[key] = max(self.stats[key], now)


def _small_buffers(sock) -> None:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _SOCK_BUF)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _SOCK_BUF)


class _Bucket:
    """A token bucket: ``take(n)`` spends n bytes and says how long to wait before the next."""

    __slots__ = ("proxy", "tokens", "last")

    def __init__(self, proxy: _Proxy) -> None:
        self.proxy, self.tokens, self.last = proxy, float(proxy.burst), time.monotonic()

    def take(self, n: int) -> float:
        rate, now, cap = self.proxy.rate, time.monotonic(), float(self.proxy.burst)
        self.tokens = cap if rate is None else min(cap, self.tokens + (now - self.last) * rate)
        self.tokens, self.last = self.tokens - n, now
        return -self.tokens / rate if rate is not None and self.tokens < 0 else 0.0


def _parse_head(head: bytes) -> tuple[list[str], dict]:
    first, *lines = head.decode("latin-1").split("\r\n")
    pairs = (line.partition(":") for line in lines)
    return first.split(" ", 2), {k.strip().lower(): v.strip() for k, sep, v in pairs if sep}


class _Conn:
    """One client connection and its upstream one: a coroutine per direction.

    ``up`` reads each request head, waits the latency, answers it (a fault) or forwards it and
    its body; ``down`` forwards each response the same way and ends the request's flight.
    Either ending (a close, an error, an answer) ends the connection.
    """

    def __init__(self, proxy: _Proxy, reader, writer) -> None:
        self.p, self.cr, self.cw = proxy, reader, writer
        self.sr = self.sw = None  # the upstream reader / writer, once connected
        self.closed, self.dead = False, proxy.silent  # dead: a black hole, reads, never answers
        self.up_bucket, self.dn_bucket = _Bucket(proxy), _Bucket(proxy)
        self.methods: collections.deque[str] = collections.deque()  # awaiting their response
        self.open_requests = 0
        self.relay = self.down_task = None  # the tasks forward() and down(), once started

    async def run(self) -> None:
        self.p.conns.add(self)
        self.p.stats["connections"] += 1
        self.p.bump("max_open_connections", len(self.p.conns))
        _small_buffers(self.cw.get_extra_info("socket"))
        self.cw.transport.set_write_buffer_limits(high=_BUF_MAX)
        try:
            if not self.dead:
                self.relay = asyncio.ensure_future(self.forward())
                with contextlib.suppress(asyncio.CancelledError):  # closed, or silenced
                    await self.relay
            while self.dead and not self.closed and await self.cr.read(1 << 16):
                pass
        except (OSError, EOFError, ValueError, asyncio.LimitOverrunError):
            pass  # this connection ends, nothing else
        finally:
            self.close()

    async def forward(self) -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        _small_buffers(sock)
        try:
            await asyncio.get_running_loop().sock_connect(sock, (LOOPBACK, self.p.target_port))
        except OSError:
            sock.close()  # the server is gone: so is this connection
            raise
        self.sr, self.sw = await asyncio.open_connection(sock=sock, limit=_HEAD_MAX)
        self.sw.transport.set_write_buffer_limits(high=_BUF_MAX)
        up = asyncio.ensure_future(self.up())
        self.down_task = down = asyncio.ensure_future(self.down())
        try:
            await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (up, down):
                t.cancel()
        for t in (up, down):  # a direction's error ends the connection, quietly
            if t.done() and not t.cancelled() and t.exception() is not None:
                raise EOFError from t.exception()

    async def up(self) -> None:
        while True:
            try:
                head = await self.cr.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError:
                return  # the client closed
            self.open_requests += 1
            self.p.in_flight += 1
            self.p.bump("max_in_flight", self.p.in_flight)
            if self.p.latency > 0:
                await asyncio.sleep(self.p.latency)  # a round trip before the head goes
            (method, target, *_), headers = _parse_head(head[:-4])
            rule = self.p.match(method, target)
            if rule is not None:
                return await self.answer(rule)
            self.p.count("requests", method)
            self.methods.append(method)
            await self.message(self.cr, head, headers, True, to_eof=False)

    async def down(self) -> None:
        while True:
            try:
                head = await self.sr.readuntil(b"\r\n\r\n")
            except asyncio.IncompleteReadError as e:  # the server closed
                if e.partial:
                    await self.send(e.partial, False)
                return
            (_, status, *_), headers = _parse_head(head[:-4])
            status = int(status)
            if 100 <= status < 200 and status != 101:  # interim (100 Continue): more follows
                await self.send(head, False)
                continue
            method = self.methods.popleft() if self.methods else "GET"
            self.p.count("responses", status)
            if method == "HEAD" or status in (204, 304):
                await self.send(head, False)
            else:  # no length: the body ends with the connection (and so does a 101 tunnel)
                await self.message(self.sr, head, headers, False,
                                   to_eof=status == 101 or "content-length" not in headers)
            self.request_done()

    async def message(self, reader, head: bytes, headers: dict, up: bool, *,
                      to_eof: bool) -> None:
        """Send a message's head, then read and send its body: chunked, by length, or to EOF."""
        await self.send(head, up)
        if "chunked" in headers.get("transfer-encoding", "").lower():
            while True:
                line = await reader.readuntil(b"\n")
                await self.send(line, up)
                size = int(line.split(b";")[0], 16)
                if size == 0:
                    break
                await self.copy(reader, size + 2, up)  # the chunk and its CRLF
            while line.strip():  # trailer lines, up to an empty one
                line = await reader.readuntil(b"\n")
                await self.send(line, up)
        elif not to_eof:
            await self.copy(reader, int(headers.get("content-length") or 0), up)
        else:
            await self.copy(reader, None, up)

    async def copy(self, reader, n: int | None, up: bool) -> None:
        """Forward n bytes (None: up to EOF) in pieces of 20 ms of the rate, 4-64 KiB."""
        while n is None or n > 0:
            rate = self.p.rate
            piece = 1 << 18 if rate is None else int(min(65536, max(4096, rate * 0.02)))
            data = await reader.read(piece if n is None else min(n, piece))
            if not data:
                if n is None:
                    return
                raise EOFError("the connection closed mid-message")
            if n is not None:
                n -= len(data)
            await self.send(data, up)

    async def send(self, data: bytes, up: bool) -> None:
        writer, bucket = (self.sw, self.up_bucket) if up else (self.cw, self.dn_bucket)
        wait = bucket.take(len(data))
        if wait > 0:
            await asyncio.sleep(wait)  # paid before it goes: a response ends when it is written
        writer.write(data)
        self.p.stats["bytes_up" if up else "bytes_down"] += len(data)
        await writer.drain()  # the other side reads slowly: so does this side

    async def answer(self, rule: dict) -> None:
        """Answer the request just read with an S3 error and close; moto never sees it."""
        self.down_task.cancel()
        self.sw.transport.abort()
        rid = uuid.uuid4().hex[:16].upper()
        body = ('<?xml version="1.0" encoding="UTF-8"?>'
                f'<Error><Code>{rule["code"]}</Code><Message>{rule["message"]}</Message>'
                f'<RequestId>{rid}</RequestId></Error>').encode()
        head = (f"HTTP/1.1 {rule['status']} {rule['reason']}\r\n"
                f"Content-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
                f"x-amz-request-id: {rid}\r\nConnection: close\r\n\r\n").encode()
        self.p.stats["injected"] += 1
        self.p.count("injected_codes", rule["code"])
        await self.send(head + body, False)
        self.request_done()
        self.cw.write_eof()
        # the client may still send the body: read and drop it until it closes (closing on
        # unread bytes would reset the connection, and the client could lose the answer)
        end = time.monotonic() + _DRAIN_S
        with contextlib.suppress(asyncio.TimeoutError):
            while await asyncio.wait_for(self.cr.read(1 << 16), end - time.monotonic()):
                pass

    def request_done(self) -> None:
        if self.open_requests > 0:
            self.open_requests -= 1
            self.p.in_flight -= 1

    def go_dead(self) -> None:
        """Silenced: drop the upstream side; run() reads and drops from now on."""
        self.dead = True
        if self.relay is not None:
            self.relay.cancel()
        if self.sw is not None:
            self.sw.transport.abort()

    def close(self, *, reset: bool = False) -> None:
        if self.closed:
            return
        self.closed = True
        self.p.conns.discard(self)
        self.p.in_flight -= self.open_requests
        self.open_requests = 0
        if self.relay is not None:
            self.relay.cancel()  # no coroutine writes to these transports any more
        if self.sw is not None:
            self.sw.transport.abort()
        if reset:  # SO_LINGER 0: the close sends RST; to the client the server died
            self.p.stats["resets"] += 1
            with contextlib.suppress(OSError):
                self.cw.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.cw.transport.abort()
        else:
            self.cw.close()  # what was written still goes out first
