"""A real S3-compatible server (moto) on 127.0.0.1 for the tests: start, reset, stop.

``S3Server()`` runs moto's server (``moto.server.main``) in a child process bound to 127.0.0.1
only (its own interpreter, so the server does not share the GIL with the client under test,
and a crash or hang of one does not take the other down). The child dies with the process that
started it (``PR_SET_PDEATHSIG`` on Linux) and is stopped by ``stop()`` or at interpreter exit.
``S3Server(mode="thread")`` runs moto's ``ThreadedMotoServer`` in this process instead.

    with S3Server() as srv:
        srv.endpoint          # "http://127.0.0.1:PORT"
        srv.reset()           # drop every bucket (moto's reset API)

Nothing here talks to any address other than 127.0.0.1.
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import os
import socket
import subprocess
import sys
import tempfile
import time

LOOPBACK = "127.0.0.1"

#: environment for anything that talks to the test server: dummy credentials, no config files,
#: no instance-metadata lookups, no proxies for the loopback address
AWS_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "test",
    "AWS_SECRET_ACCESS_KEY": "test",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
    "AWS_CONFIG_FILE": os.devnull,
    "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
}
#: variables removed from that environment (they could redirect or re-credential requests)
AWS_UNSET_ENV = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_ROLE_ARN",
                 "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI",
                 "AWS_CONTAINER_CREDENTIALS_FULL_URI", "HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY",
                 "http_proxy", "https_proxy", "all_proxy")


def free_port() -> int:
    with socket.socket() as s:
        s.bind((LOOPBACK, 0))
        return s.getsockname()[1]


#: the child: ask the kernel for SIGTERM when the parent dies (Linux), exit if it already
#: did, then run moto's server (``python -m moto.server`` with arguments)
_CHILD = """
import os, signal, sys
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
except Exception:
    pass
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
from moto.server import main
main(sys.argv[2:])
"""


class S3Server:
    """One moto S3 server on 127.0.0.1; ``start()`` returns its endpoint URL."""

    def __init__(self, *, mode: str = "process", startup_timeout: float = 60.0) -> None:
        if mode not in ("process", "thread"):
            raise ValueError(f"mode must be 'process' or 'thread', got {mode!r}")
        self.mode = mode
        self.startup_timeout = startup_timeout
        self.port: int | None = None
        self._proc: subprocess.Popen | None = None
        self._log = None
        self._threaded = None

    @property
    def endpoint(self) -> str:
        if self.port is None:
            raise RuntimeError("the S3 server is not running; call start() first")
        return f"http://{LOOPBACK}:{self.port}"

    # -- lifecycle ---------------------------------------------------------------------------
    def start(self) -> str:
        if self.port is not None:
            return self.endpoint
        if self.mode == "thread":
            self._start_thread()
        else:
            last: Exception | None = None
            for _ in range(3):  # the free port can be taken between probing and binding
                try:
                    self._start_process()
                    break
                except _PortLost as e:
                    last = e
            else:
                raise RuntimeError(f"could not start the moto server: {last}")
        atexit.register(self.stop)
        return self.endpoint

    def _start_thread(self) -> None:
        from moto.server import ThreadedMotoServer
        srv = ThreadedMotoServer(ip_address=LOOPBACK, port=0, verbose=False)
        srv.start()
        self._threaded = srv
        self.port = srv.get_host_and_port()[1]
        self._wait_ready(time.monotonic() + self.startup_timeout)

    def _start_process(self) -> None:
        port = free_port()
        env = {k: v for k, v in os.environ.items() if k not in AWS_UNSET_ENV}
        env.update(AWS_TEST_ENV)
        self._log = tempfile.TemporaryFile()
        self._proc = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(os.getpid()), "-H", LOOPBACK, "-p", str(port)],
            stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.port = port
        try:
            self._wait_ready(time.monotonic() + self.startup_timeout)
        except BaseException:
            out = self._log_tail()
            self.stop()
            if "Address already in use" in out:
                raise _PortLost(out) from None
            raise

    def _wait_ready(self, deadline: float) -> None:
        while True:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self._proc.returncode}:\n"
                                   f"{self._log_tail()}")
            try:
                if self._request("GET", "/moto-api/", timeout=2.0) < 500:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"moto server on {self.endpoint} not ready after "
                                   f"{self.startup_timeout}s:\n{self._log_tail()}")
            time.sleep(0.1)

    def _log_tail(self, n: int = 4000) -> str:
        if self._log is None:
            return ""
        try:
            self._log.seek(0)
            return self._log.read().decode(errors="replace")[-n:]
        except (OSError, ValueError):
            return ""

    def _request(self, method: str, path: str, *, timeout: float = 10.0) -> int:
        # http.client never consults proxy variables: this goes to 127.0.0.1 and nowhere else
        conn = http.client.HTTPConnection(LOOPBACK, self.port, timeout=timeout)
        try:
            conn.request(method, path)
            resp = conn.getresponse()
            resp.read()
            return resp.status
        finally:
            conn.close()

    def reset(self) -> None:
        """Drop every bucket and object (moto's reset API)."""
        status = self._request("POST", "/moto-api/reset")
        if status >= 300:
            raise RuntimeError(f"moto reset failed with HTTP {status}")

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if self._threaded is not None:
            with contextlib.suppress(Exception):
                self._threaded.stop()
            self._threaded = None
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._log is not None:
            with contextlib.suppress(Exception):
                self._log.close()
            self._log = None
        self.port = None

    def __enter__(self) -> "S3Server":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


class _PortLost(RuntimeError):
    pass


if __name__ == "__main__":  # manual use: python tests/s3server.py
    with S3Server() as srv:
        print(srv.endpoint, flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)
