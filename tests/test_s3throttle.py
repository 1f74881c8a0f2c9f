"""tests/s3throttle.py: the throttling, fault-injecting proxy in front of moto models a real store.

These check the proxy's model (per-connection caps, latency per request, injected errors, a
store that dies, the counters), not fastckpt's speed: the bounds are loose on purpose. One
moto server per module, a fresh proxy (a child process) per test. Every connection from this
process goes to 127.0.0.1 (the loopback guard of tests/s3fixtures.py).

``FASTCKPT_THROTTLE_BENCH=1 pytest tests/test_s3throttle.py -k bench -s`` measures the proxy.
"""

from __future__ import annotations

import http.client
import http.server
import io
import os
import socket
import struct
import subprocess
import sys
import threading
import time
import uuid

import pytest

boto3 = pytest.importorskip("boto3")
pytest.importorskip("moto.server")
from botocore.config import Config  # noqa: E402
from botocore.exceptions import (  # noqa: E402
    ClientError, ConnectionError as BotoConnectionError, HTTPClientError)

from tests.s3fixtures import _LoopbackGuard, storage_options_for  # noqa: E402
from tests.s3server import (  # noqa: E402
    AWS_TEST_ENV, AWS_UNSET_ENV, LOOPBACK, S3Server, free_port)
from tests.s3throttle import ThrottleProxy  # noqa: E402

MiB = 1 << 20
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def server():
    with S3Server() as srv:
        yield srv


@pytest.fixture(autouse=True)
def aws_env(monkeypatch):
    for k in AWS_UNSET_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in AWS_TEST_ENV.items():
        monkeypatch.setenv(k, v)
    guard = _LoopbackGuard().install(monkeypatch)
    yield
    assert not guard.violations, f"connections outside {LOOPBACK}: {guard.violations}"


@pytest.fixture
def proxy(server):
    with ThrottleProxy(server.port) as p:
        yield p


@pytest.fixture
def bucket(server):
    """A fresh bucket, made on moto directly; dropped (with all the others) afterwards."""
    name = f"throttle-{uuid.uuid4().hex[:12]}"
    client(server.endpoint).create_bucket(Bucket=name)
    yield name
    server.reset()


def client(endpoint: str, **config):
    """A boto3 S3 client that never retries (each error is seen as it is)."""
    config = {"retries": {"total_max_attempts": 1}, "max_pool_connections": 16,
              "connect_timeout": 5, "read_timeout": 30, **config}
    return boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1",
                        config=Config(**config))


def timed(fn, *args, **kw) -> float:
    t = time.monotonic()
    fn(*args, **kw)
    return time.monotonic() - t


def in_threads(fns) -> tuple[list, float]:
    """Run each fn in a thread, started together: (results or exceptions, wall time)."""
    out = [None] * len(fns)
    barrier = threading.Barrier(len(fns) + 1)

    def run(i, fn):
        barrier.wait()
        try:
            out[i] = fn()
        except Exception as e:  # noqa: BLE001 -- handed to the test
            out[i] = e
    threads = [threading.Thread(target=run, args=(i, fn)) for i, fn in enumerate(fns)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.monotonic()
    for t in threads:
        t.join(timeout=60)
    return out, time.monotonic() - t0


def error_code(exc: ClientError) -> tuple[str, int]:
    return exc.response["Error"]["Code"], exc.response["ResponseMetadata"]["HTTPStatusCode"]


# ---------------------------------------------------------------------------------- round trips

def test_objects_round_trip_byte_exact(proxy, bucket):
    c = client(proxy.endpoint)
    small = os.urandom(1000)
    c.put_object(Bucket=bucket, Key="small", Body=small)
    assert c.get_object(Bucket=bucket, Key="small")["Body"].read() == small
    # a file-like body: botocore sends "Expect: 100-continue" and waits for moto's answer
    big = os.urandom(3 * MiB)
    c.put_object(Bucket=bucket, Key="big", Body=io.BytesIO(big))
    got = c.get_object(Bucket=bucket, Key="big", Range="bytes=1000-2000999")["Body"].read()
    assert got == big[1000:2001000]
    parts = [os.urandom(5 * MiB) for _ in range(3)]
    up = c.create_multipart_upload(Bucket=bucket, Key="multi")["UploadId"]
    etags = [c.upload_part(Bucket=bucket, Key="multi", UploadId=up, PartNumber=i + 1,
                           Body=io.BytesIO(p))["ETag"] for i, p in enumerate(parts)]
    c.complete_multipart_upload(Bucket=bucket, Key="multi", UploadId=up, MultipartUpload={
        "Parts": [{"PartNumber": i + 1, "ETag": e} for i, e in enumerate(etags)]})
    assert c.get_object(Bucket=bucket, Key="multi")["Body"].read() == b"".join(parts)
    assert c.head_object(Bucket=bucket, Key="multi")["ContentLength"] == 15 * MiB
    st = proxy.stats()
    assert st["requests"] == {"PUT": 5, "GET": 3, "POST": 2, "HEAD": 1}
    assert st["responses"] == {200: 10, 206: 1} and st["injected"] == 0
    assert st["bytes_up"] > 18 * MiB and st["bytes_down"] > 15 * MiB + 2_000_000
    assert st["in_flight"] == 0


def test_s3fs_round_trip(proxy, bucket):
    import s3fs  # aiobotocore over aiohttp: another client, no 100-continue
    fs = s3fs.S3FileSystem(**storage_options_for(proxy.endpoint), skip_instance_cache=True)
    data = os.urandom(2 * MiB + 7)
    fs.pipe_file(f"{bucket}/obj", data)
    assert fs.cat_file(f"{bucket}/obj") == data
    assert fs.cat_file(f"{bucket}/obj", start=MiB, end=MiB + 100) == data[MiB:MiB + 100]
    assert proxy.stats()["requests"]["GET"] >= 2


class _KeepAliveHandler(http.server.BaseHTTPRequestHandler):
    """An HTTP/1.1 server that keeps connections open (moto does not), chunked both ways."""

    protocol_version = "HTTP/1.1"

    def do_HEAD(self):
        self.send_response(200)
        self.send_header("Content-Length", "1000")  # and no body: the proxy must know
        self.end_headers()

    def do_GET(self):
        self.send_response(200)
        if self.path == "/chunked":
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for part in (b"ab", b"cde", b""):
                self.wfile.write(b"%x\r\n%s\r\n" % (len(part), part))
        else:
            self.send_header("Content-Length", "1000")
            self.end_headers()
            self.wfile.write(b"x" * 1000)

    def do_PUT(self):
        data = b""
        if self.headers.get("Transfer-Encoding") == "chunked":
            while size := int(self.rfile.readline().split(b";")[0], 16):
                data += self.rfile.read(size + 2)[:-2]
            while self.rfile.readline().strip():  # trailers, to the empty line
                pass
        else:
            data = self.rfile.read(int(self.headers["Content-Length"]))
        body = data[::-1]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_keep_alive_connection_carries_many_requests_each_with_latency():
    srv = http.server.ThreadingHTTPServer((LOOPBACK, 0), _KeepAliveHandler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        with ThrottleProxy(srv.server_address[1], latency_s=0.1) as p:
            conn = http.client.HTTPConnection(LOOPBACK, p.port, timeout=10)
            t0 = time.monotonic()
            got = []
            for method, path, body in [("GET", "/plain", None), ("HEAD", "/plain", None),
                                       ("PUT", "/up", iter([b"hello ", b"world"])),  # chunked
                                       ("PUT", "/up", b"abc"), ("GET", "/chunked", None)]:
                conn.request(method, path, body=body)
                resp = conn.getresponse()
                got.append((resp.status, resp.read()))
            elapsed = time.monotonic() - t0
            conn.close()
            st = p.stats()
    finally:
        srv.shutdown()
        srv.server_close()
    assert got == [(200, b"x" * 1000), (200, b""), (200, b"dlrow olleh"), (200, b"cba"),
                   (200, b"abcde")]
    assert elapsed >= 5 * 0.1
    assert st["connections"] == 1 and st["max_open_connections"] == 1
    assert st["requests"] == {"GET": 2, "HEAD": 1, "PUT": 2} and st["responses"] == {200: 5}
    assert st["max_in_flight"] == 1 and st["in_flight"] == 0


# ------------------------------------------------------------------------- bandwidth and latency

@pytest.mark.parametrize("direction", ["put", "get"])
def test_one_connection_is_capped(proxy, bucket, direction):
    c = client(proxy.endpoint)
    data = os.urandom(2 * MiB)
    c.put_object(Bucket=bucket, Key="k", Body=data)
    proxy.set_rate(MiB)
    if direction == "put":
        took = timed(c.put_object, Bucket=bucket, Key="k2", Body=data)
    else:
        took = timed(lambda: c.get_object(Bucket=bucket, Key="k")["Body"].read())
    assert 1.6 <= took < 8, took  # 2 MiB at 1 MiB/s, less the 128 KiB burst


def test_each_connection_gets_its_own_cap(proxy, bucket):
    c = client(proxy.endpoint)
    c.put_object(Bucket=bucket, Key="k", Body=os.urandom(2 * MiB))
    proxy.set_rate(MiB)
    proxy.reset_stats()

    def get():
        return timed(lambda: c.get_object(Bucket=bucket, Key="k")["Body"].read())
    each, wall = in_threads([get, get])
    assert all(isinstance(t, float) and t >= 1.6 for t in each), each  # each one still capped
    assert 4 / wall > 1.5, wall  # together about twice one connection's 1 MiB/s
    assert proxy.stats()["max_open_connections"] == 2


def test_new_rate_reaches_an_open_connection(proxy, bucket):
    c = client(proxy.endpoint)
    c.put_object(Bucket=bucket, Key="k", Body=os.urandom(4 * MiB))
    proxy.set_rate(512 * 1024)  # 8 s for 4 MiB at this rate
    threading.Timer(0.5, proxy.set_rate, args=(None,)).start()
    took = timed(lambda: c.get_object(Bucket=bucket, Key="k")["Body"].read())
    assert 0.5 <= took < 3, took


def test_latency_is_per_request(proxy, bucket):
    c = client(proxy.endpoint)
    c.put_object(Bucket=bucket, Key="k", Body=b"x")
    proxy.set_latency(0.1)
    assert timed(lambda: [c.head_object(Bucket=bucket, Key="k") for _ in range(5)]) >= 0.5
    # in parallel the waits overlap: each request is one round trip, not one after another
    proxy.set_latency(0.4)
    proxy.reset_stats()
    _, wall = in_threads([lambda: c.head_object(Bucket=bucket, Key="k")] * 4)
    assert 0.4 <= wall < 4 * 0.4, wall
    st = proxy.stats()
    assert st["max_in_flight"] == 4 and st["max_open_connections"] == 4
    assert st["requests"] == {"HEAD": 4} and st["in_flight"] == 0


# ------------------------------------------------------------------------------- injected faults

def test_slowdown_is_injected_count_times(proxy, bucket):
    c = client(proxy.endpoint)
    proxy.inject(503, count=2, method="PUT")
    for body in (io.BytesIO(b"a" * MiB), b"b"):  # with "Expect: 100-continue", and without
        with pytest.raises(ClientError) as ei:
            c.put_object(Bucket=bucket, Key="k", Body=body)
        assert error_code(ei.value) == ("SlowDown", 503)
        assert ei.value.response["Error"]["Message"] == "Please reduce your request rate."
        with pytest.raises(ClientError, match="NoSuchKey"):  # a GET does not match
            c.get_object(Bucket=bucket, Key="k")
    c.put_object(Bucket=bucket, Key="k", Body=b"c")  # the third PUT passes
    assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"c"
    st = proxy.stats()
    assert st["injected"] == 2 and st["injected_codes"] == {"SlowDown": 2}
    assert st["requests"]["PUT"] == 1  # moto never saw the two answered by the proxy
    assert st["bytes_up"] < MiB  # the 100-continue body was never sent


@pytest.mark.parametrize("status,code", [(403, "AccessDenied"), (500, "InternalError"),
                                         (404, "NoSuchBucket")])
def test_errors_until_cleared(proxy, bucket, status, code):
    c = client(proxy.endpoint)
    c.put_object(Bucket=bucket, Key="secret", Body=b"s")
    proxy.inject(status, count=None, path_contains="secret")
    for _ in range(3):
        with pytest.raises(ClientError) as ei:
            c.get_object(Bucket=bucket, Key="secret")
        assert error_code(ei.value) == (code, status)
    c.put_object(Bucket=bucket, Key="open", Body=b"o")  # another path passes
    proxy.clear_faults()
    assert c.get_object(Bucket=bucket, Key="secret")["Body"].read() == b"s"


def test_slowdown_on_part_uploads_only(proxy, bucket):
    c = client(proxy.endpoint)
    proxy.inject(503, count=1, method="PUT", query_contains="partNumber")
    up = c.create_multipart_upload(Bucket=bucket, Key="m")["UploadId"]
    part = os.urandom(5 * MiB)
    with pytest.raises(ClientError) as ei:
        c.upload_part(Bucket=bucket, Key="m", UploadId=up, PartNumber=1, Body=part)
    assert error_code(ei.value) == ("SlowDown", 503)
    etag = c.upload_part(Bucket=bucket, Key="m", UploadId=up, PartNumber=1, Body=part)["ETag"]
    c.complete_multipart_upload(Bucket=bucket, Key="m", UploadId=up, MultipartUpload={
        "Parts": [{"PartNumber": 1, "ETag": etag}]})
    assert c.get_object(Bucket=bucket, Key="m")["Body"].read() == part


# ------------------------------------------------------------------------- death and black holes

def test_kill_mid_upload_then_restart(proxy, bucket):
    c = client(proxy.endpoint)
    proxy.set_rate(MiB)
    threading.Timer(0.7, proxy.kill).start()
    t0 = time.monotonic()
    with pytest.raises((HTTPClientError, BotoConnectionError)):  # reset, mid-body
        c.put_object(Bucket=bucket, Key="k", Body=os.urandom(4 * MiB))
    assert time.monotonic() - t0 < 3
    assert proxy.stats()["resets"] >= 1
    with pytest.raises(BotoConnectionError):  # nobody listens: refused
        c.head_bucket(Bucket=bucket)
    endpoint = proxy.endpoint
    proxy.restart()
    proxy.set_rate(None)
    assert proxy.endpoint == endpoint
    c.put_object(Bucket=bucket, Key="k", Body=b"after")
    assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"after"


def test_silence_then_resume(proxy, bucket):
    c = client(proxy.endpoint, read_timeout=0.5)
    proxy.silence()
    with pytest.raises(HTTPClientError, match="Read timeout"):
        c.put_object(Bucket=bucket, Key="k", Body=b"lost")
    proxy.resume()
    c.put_object(Bucket=bucket, Key="k", Body=b"kept")
    assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"kept"
    assert proxy.stats()["requests"] == {"PUT": 1, "GET": 1}


def test_a_vanishing_client_or_server_ends_only_its_connection(proxy, bucket):
    c = client(proxy.endpoint)
    proxy.set_latency(0.2)
    s = socket.create_connection((LOOPBACK, proxy.port))
    s.sendall(b"PUT /%s/k HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n\r\nabc" % bucket.encode())
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()  # reset, mid-body
    c.put_object(Bucket=bucket, Key="k", Body=b"whole")
    assert c.get_object(Bucket=bucket, Key="k")["Body"].read() == b"whole"
    assert proxy.stats()["in_flight"] == 0
    with ThrottleProxy(free_port()) as nowhere:  # nothing listens upstream
        with pytest.raises((HTTPClientError, BotoConnectionError)):
            client(nowhere.endpoint).head_bucket(Bucket=bucket)
        assert nowhere.stats()["connections"] == 1 and nowhere.stats()["open_connections"] == 0


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"  # a zombie: dead
    except FileNotFoundError:
        return True


def test_stop_mid_transfer_leaves_no_process(server, bucket):
    p = ThrottleProxy(server.port, rate_bps=MiB)
    c = client(p.start())
    pid, took = p.pid, []
    stopper = threading.Timer(0.5, lambda: took.append(timed(p.stop)))
    stopper.start()
    with pytest.raises((HTTPClientError, BotoConnectionError)):  # 8 s of upload, cut short
        c.put_object(Bucket=bucket, Key="k", Body=os.urandom(8 * MiB))
    stopper.join(timeout=10)
    assert took and took[0] < 5
    assert _gone(pid) and not os.path.exists(f"/proc/{pid}")  # reaped, too
    p.stop()  # twice: a no-op
    with pytest.raises(RuntimeError, match="not running"):
        p.stats()


def test_proxy_dies_with_its_parent(server):
    code = (f"import sys, time; sys.path.insert(0, {ROOT!r})\n"
            "from tests.s3throttle import ThrottleProxy\n"
            f"p = ThrottleProxy({server.port}); p.start(); print(p.pid, flush=True)\n"
            "time.sleep(60)\n")
    parent = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert not _gone(child)
    finally:
        parent.kill()
        parent.wait()
    deadline = time.monotonic() + 5
    while not _gone(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _gone(child)


# ----------------------------------------------------------------------------------- benchmark

#: a bare HTTP/1.1 upstream far faster than moto: ``GET /N`` answers N bytes, ``PUT`` swallows
#: its body; so the benchmark measures the proxy, not the server
_BLASTER = r"""
import socket, sys, threading
ls = socket.create_server(("127.0.0.1", 0), backlog=64)
print(ls.getsockname()[1], flush=True)
blob = memoryview(bytes(1 << 20))
def serve(c):
    buf, rest = bytearray(1 << 20), b""
    while True:
        while b"\r\n\r\n" not in rest:
            d = c.recv(65536)
            if not d:
                return
            rest += d
        head, _, rest = rest.partition(b"\r\n\r\n")
        if head.startswith(b"PUT"):
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0]) - len(rest)
            while n > 0:
                n -= c.recv_into(buf, min(n, len(buf)))
            rest, n = b"", 0
        else:
            n = int(head.split(b" ")[1][1:])
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % n)
        while n > 0:
            n -= c.send(blob[:min(n, len(blob))])
while True:
    threading.Thread(target=serve, args=(ls.accept()[0],), daemon=True).start()
"""


def _fetch(port: int, n: int, put: bool) -> None:
    with socket.create_connection((LOOPBACK, port)) as s:
        buf = memoryview(bytearray(1 << 20))
        if put:
            s.sendall(b"PUT /x HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % n)
            for i in range(0, n, len(buf)):
                s.sendall(buf[:min(len(buf), n - i)])
            n = 0
        else:
            s.sendall(b"GET /%d HTTP/1.1\r\nHost: x\r\n\r\n" % n)
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(4096)
        n -= len(head.partition(b"\r\n\r\n")[2])
        while n > 0:
            n -= s.recv_into(buf)


@pytest.mark.skipif(not os.environ.get("FASTCKPT_THROTTLE_BENCH"),
                    reason="a benchmark: FASTCKPT_THROTTLE_BENCH=1 runs it")
def test_bench(server):
    blaster = subprocess.Popen([sys.executable, "-c", _BLASTER], stdout=subprocess.PIPE)
    try:
        port = int(blaster.stdout.readline())
        for rate in (None, 20e6):
            with ThrottleProxy(port, rate_bps=rate) as p:
                for put in (False, True):
                    for conns in (1, 4, 8):
                        n = (1 << 30 if rate is None else 1 << 25) // conns
                        _, wall = in_threads([lambda: _fetch(p.port, n, put)] * conns)
                        print(f"\nproxy only, rate {rate}, {'PUT' if put else 'GET'}, "
                              f"{conns} conns: {n * conns / wall / 1e6:.0f} MB/s", end="")
    finally:
        blaster.kill()
        blaster.wait()
    # through moto: ranged GETs of one object, the way a parallel reader does
    name, size = f"bench-{uuid.uuid4().hex[:8]}", 64 * MiB
    client(server.endpoint).create_bucket(Bucket=name)
    client(server.endpoint).put_object(Bucket=name, Key="k", Body=os.urandom(size))
    for rate in (None, 20e6):
        with ThrottleProxy(server.port, rate_bps=rate) as p:
            c = client(p.endpoint)
            for conns in (1, 2, 4, 8):
                step = size // conns
                _, wall = in_threads([lambda i=i: c.get_object(
                    Bucket=name, Key="k", Range=f"bytes={i * step}-{(i + 1) * step - 1}")[
                        "Body"].read() for i in range(conns)])
                print(f"\nmoto via proxy, rate {rate}, {conns} ranged GETs: "
                      f"{size / wall / 1e6:.0f} MB/s", end="")
