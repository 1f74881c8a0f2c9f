"""pytest fixtures for tests against the moto S3 server on 127.0.0.1 (see tests/s3server.py).

Import them into a test module::

    from tests.s3fixtures import s3, s3_server  # noqa: F401

``s3_server`` (session): one server for the whole run. ``s3`` (per test): a fresh bucket, the
``storage_options`` that reach it, an ``s3fs`` file system on it, AWS variables set for the
test only (monkeypatch), and a guard that fails any connection from this process to an
address other than 127.0.0.1. ``S3Env.env`` is the environment to hand to spawned ranks.
The bucket and everything in it (leftover multipart uploads included) are dropped after the
test. ``FASTCKPT_TEST_S3_SERVER=thread`` runs the server in-process instead of a child.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import uuid
from dataclasses import dataclass, field

import pytest

from tests.s3server import AWS_TEST_ENV, AWS_UNSET_ENV, LOOPBACK, S3Server


@dataclass
class S3Env:
    server: S3Server
    endpoint: str
    bucket: str
    storage_options: dict
    fs: object  # an s3fs.S3FileSystem on the server (fastckpt opens its own, with its client settings)
    env: dict = field(default_factory=dict)
    guard: "_LoopbackGuard | None" = None

    def url(self, *parts: str) -> str:
        return "/".join([f"s3://{self.bucket}", *parts])

    def path(self, *parts: str) -> str:
        """The s3fs path (no scheme) of a key in the bucket."""
        return "/".join([self.bucket, *parts])

    def keys(self, prefix: str = "") -> list[str]:
        """Every object key under ``prefix`` (relative to the bucket), fresh from the server."""
        self.fs.invalidate_cache()
        base = self.path(prefix).rstrip("/")
        try:
            found = self.fs.find(base)
        except FileNotFoundError:
            return []
        return sorted(k[len(self.bucket) + 1:] for k in found)

    def multipart_uploads(self) -> list[dict]:
        """Multipart uploads begun and neither completed nor aborted."""
        out = self.fs.call_s3("list_multipart_uploads", Bucket=self.bucket)
        return list(out.get("Uploads", []))


def storage_options_for(endpoint: str, **extra) -> dict:
    return {"key": "test", "secret": "test",
            "client_kwargs": {"endpoint_url": endpoint, "region_name": "us-east-1"}, **extra}


@pytest.fixture(scope="session")
def s3_server():
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    srv = S3Server(mode=os.environ.get("FASTCKPT_TEST_S3_SERVER", "process"))
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()


class _LoopbackGuard:
    """Refuses (and records) connections from this process to anything but 127.0.0.1."""

    def __init__(self) -> None:
        self.violations: list[str] = []

    def check(self, sock: socket.socket, address) -> None:
        if sock.family not in (socket.AF_INET, socket.AF_INET6):
            return  # AF_UNIX and friends never leave the machine
        host = address[0] if isinstance(address, tuple) else address
        try:
            ip = ipaddress.ip_address(host.split("%", 1)[0])
            ok = ip == ipaddress.ip_address(LOOPBACK) or (
                ip.version == 6 and (ip.is_loopback or ip.ipv4_mapped == ipaddress.ip_address(
                    LOOPBACK)))
        except ValueError:
            ok = False  # a host name: would need a lookup; the tests only use the literal
        if not ok:
            self.violations.append(repr(address))
            raise ConnectionRefusedError(f"test guard: connection to {address!r} refused: the "
                                         f"tests may only reach {LOOPBACK}")

    def install(self, monkeypatch=None) -> "_LoopbackGuard":
        """Patch ``socket.socket``: for the test (monkeypatch), or for good (a spawned rank)."""
        real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
        guard = self

        def connect(self, address):
            guard.check(self, address)
            return real_connect(self, address)

        def connect_ex(self, address):
            guard.check(self, address)
            return real_connect_ex(self, address)

        patch = monkeypatch.setattr if monkeypatch is not None else setattr
        patch(socket.socket, "connect", connect)
        patch(socket.socket, "connect_ex", connect_ex)
        return self


def guard_this_process() -> _LoopbackGuard:
    """Install the loopback guard in this process for good (for ranks spawned by a test)."""
    return _LoopbackGuard().install()


@pytest.fixture
def s3(s3_server, monkeypatch):
    import fsspec

    endpoint = s3_server.endpoint
    env = dict(AWS_TEST_ENV, AWS_ENDPOINT_URL=endpoint, AWS_ENDPOINT_URL_S3=endpoint)
    for k in AWS_UNSET_ENV:
        monkeypatch.delenv(k, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    guard = _LoopbackGuard()
    guard.install(monkeypatch)

    # no S3FileSystem an earlier test made (cached by fsspec per options) may answer for this
    # one: one made with no options, its endpoint from that test's environment (another
    # server, a proxy), answered a CLI's read of this test's bucket "NoSuchBucket" in CI
    import s3fs
    s3fs.S3FileSystem.clear_instance_cache()
    opts = storage_options_for(endpoint)
    fs = fsspec.filesystem("s3", **opts)
    bucket = f"fastckpt-{uuid.uuid4().hex[:16]}"
    fs.call_s3("create_bucket", Bucket=bucket)
    fs.invalidate_cache()
    try:
        yield S3Env(server=s3_server, endpoint=endpoint, bucket=bucket, storage_options=opts,
                    fs=fs, env=env, guard=guard)
    finally:
        try:
            s3_server.reset()  # drops the bucket, its objects and any unfinished uploads
        finally:
            fs.invalidate_cache()
    assert not guard.violations, f"connections outside {LOOPBACK}: {guard.violations}"
