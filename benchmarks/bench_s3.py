#!/usr/bin/env python3
"""S3 upload / download throughput: fastckpt's s3 fast path vs s3fs, boto3 and s3torchconnector,
through a model of a real object store.

The store is the moto S3 server (a child process on 127.0.0.1) behind ``tests/s3throttle.py``
(another child process) that caps **each TCP connection** at ``--rate`` bytes/s per direction
and adds ``--latency`` per request, as S3 does (~85-90 MB/s per connection): one stream is
slow, many concurrent parts or ranged GETs are fast. moto closes the connection after every
response, so every request has a connection of its own and the proxy's ``max_in_flight`` is
the number of connections a client really used. The same run repeats every contender with the
proxy **unthrottled** (no rate cap, no latency): what this server, proxy and machine can move
at all, the other bound of what a client can reach here.

Every contender moves the same bytes (``--size`` of deterministic random data, one object),
saves (uploads) then loads (downloads) it, each operation in a **fresh Python process** (a
load is a restarted job's first read), the contenders interleaved and their order rotated each
repetition, the two proxy settings alternated; medians of ``--reps``. Every download is
hashed (xxh3-128) after the timed region and must equal the payload's hash (a download that
matches proves the upload too). Each contender's library is imported, its client created and
one small request sent (untimed) before its timed operation; ``fastckpt-e2e`` times the whole
``fastckpt.save`` / ``fastckpt.load`` call, which opens its storage and client itself, as a
one-off save does. See the "Contenders" list in ``--help`` and :data:`DESCRIPTIONS` for exactly
what each one does.

Columns: ``MiB/s`` (2^20 bytes/s, median), ``x fastckpt`` (median over reps of the ratio to the
``fastckpt`` row, S3Storage at its defaults, same rep and proxy setting), ``in flight`` (the
proxy's most requests in flight: the connections really used), ``ceiling`` (in flight x the
per-connection cap), ``x attainable`` (MiB/s / min(ceiling, server), where server = the best
median any contender reached unthrottled for that operation), ``CPU s/GiB`` (the client
process's user+system CPU, all threads, around the timed operation) and ``srv+proxy CPU
s/GiB`` (moto's and the proxy's CPU during the child's life: on a 2-core machine the client,
the proxy and the server share the CPUs, and uploads here are bound by the server).

    python benchmarks/bench_s3.py                          # 256 MiB, 3 reps: ~9 min on 2 cores
    python benchmarks/bench_s3.py --quick                  # smoke run: 32 MiB, 1 rep, ~50 s
    python benchmarks/bench_s3.py --rate 85MB --latency 0.02 --size 1GiB
    python benchmarks/bench_s3.py --contenders fastckpt,boto3,s3fs --reps 5

The server: by default moto with one change, made in its child process: a ranged GET reads
only its range from the stored object. Stock moto (5.x) reads the whole object for every
ranged GET and then slices it, so N ranged GETs of an object cost the server N whole-object
reads: with 8 MiB ranges of a 256 MiB object that is 32x the bytes served, and the server, not
the client, sets every ranged-GET contender's speed (about 60 MiB/s here, against ~500 MiB/s
for one plain GET). Real stores serve a range at the cost of the range. ``--stock-moto`` runs
unpatched moto. Multipart uploads are costlier in moto than one PUT (CompleteMultipartUpload
copies the parts into a new object, ~1.5x the CPU of a PUT of the same bytes): that is left
as it is and is paid by every multipart uploader alike.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO_ROOT)  # the working tree's fastckpt (the children get it first too)
from fastckpt.bench import common as C  # noqa: E402

OPS = ("save", "load")
BUCKET = "fastckpt-bench"
REGION = "us-east-1"
KEY, SECRET = "test", "test"  # moto accepts any credentials
#: fastckpt's and boto3's defaults (the sweep leaves these out: the default row is that setting)
FASTCKPT_DEFAULT_CONCURRENCY = 32
BOTO3_DEFAULT_CONCURRENCY = 10

DESCRIPTIONS = {
    "fastckpt": "fastckpt.storage.open_storage(s3://..., remote={}) -> S3Storage at its defaults "
                "(part_bytes 8 MiB, concurrency 32): write_shard(path, buf, n, [(0, n)]) from an "
                "aligned_buffer holding the bytes (xxh3 of the range computed while the parts "
                "fly, as for the engine) / read_into(path, 0, fresh aligned_buffer, n) (ranged "
                "GETs of part_bytes, hashed after); botocore settings as fastckpt sets them",
    "fastckpt-cN": "the same S3Storage with remote={'concurrency': N}",
    "fastckpt-cN-pool": "the same S3Storage with remote={'concurrency': N} and "
                        "storage_options['config_kwargs'] = {'max_pool_connections': N} (botocore's "
                        "connection pool, 10 by default, bounds the requests in flight whatever "
                        "the concurrency; a user can set it today)",
    "fastckpt-e2e": "fastckpt.save(state, s3://.../e2e, step=1, storage_options=...) of a dict "
                    "of --tensors float32 tensors holding the bytes (blocks until the manifest "
                    "is committed: lease, shard upload, conditional-write probe, manifest) / in "
                    "a fresh process, fastckpt.load(state, url, storage_options=...) into "
                    "freshly allocated torch.empty tensors (must return step 1); defaults "
                    "(remote_concurrency 32, remote_part_bytes 8 MiB)",
    "s3fs": "s3fs.S3FileSystem(key, secret, client_kwargs={endpoint_url, region_name}) at "
            "s3fs's defaults: put_file(local tmpfs file, path) (files >= 100 MiB: multipart of "
            "50 MiB parts, max_concurrency 10 parts at once, in waves; smaller: one PUT) / "
            "get_file(path, local tmpfs file) (one GET, one stream)",
    "boto3": "boto3.client('s3', endpoint_url=...) with botocore's default Config and "
             "s3transfer's default TransferConfig() (8 MiB parts, max_concurrency 10, "
             "threads): upload_file(local tmpfs file) / download_file(to a local tmpfs file: "
             "ranged GETs of 8 MiB written by an I/O thread)",
    "boto3-cN": "the same with TransferConfig(max_concurrency=N) and "
                "Config(max_pool_connections=N) (8 MiB parts, the default)",
    "s3torch": "s3torchconnector.S3Checkpoint(region, endpoint=..., s3client_config="
               "S3ClientConfig(force_path_style=True)) (the AWS CRT's mountpoint-s3-client; "
               "defaults otherwise: throughput_target_gbps 10, part_size 8 MiB): with "
               "writer(uri) as w: w.write(bytes) / reader(uri).readinto(fresh aligned_buffer) "
               "(the default sequential reader)",
}


# ================================================================== the server (a child process)

#: run in moto's child process before the server starts: a ranged GET of an object reads only
#: the range (see the module docstring); everything else is moto's own code path
_MOTO_RANGE_PATCH = r"""
import re, threading
from moto.s3 import models as _M, responses as _R
_tl = threading.local()
_SIMPLE = re.compile(r"bytes=\d+-\d*")

class _RangeView:
    # what FakeKey.value returns inside a ranged GET: its length, and a slice read from the
    # stored object on demand (moto's _handle_range_header only takes len() and one slice)
    def __init__(self, key):
        self.key = key
    def __len__(self):
        return self.key.contentsize
    def __bool__(self):
        return self.key.contentsize > 0
    def __getitem__(self, s):
        start, stop, _ = s.indices(self.key.contentsize)
        with self.key.lock:
            self.key._value_buffer.seek(start)
            return self.key._value_buffer.read(max(0, stop - start))

_value = _M.FakeKey.value
def _lazy_value(self):
    return _RangeView(self) if getattr(_tl, "lazy", False) else _value.fget(self)
_M.FakeKey.value = property(_lazy_value, _value.fset)

_key_response = _R.S3Response.key_response
def _ranged_key_response(self, request, full_url, headers):
    _tl.lazy = (request.method == "GET"
                and bool(_SIMPLE.fullmatch(request.headers.get("range") or "")))
    try:
        out = _key_response(self, request, full_url, headers)
    finally:
        _tl.lazy = False
    if isinstance(out, tuple) and len(out) == 3 and isinstance(out[2], _RangeView):
        out = (out[0], out[1], out[2][:])  # a path that did not slice: the whole object
    return out
_R.S3Response.key_response = _ranged_key_response
"""


def _server_class():
    from tests import s3server

    class BenchS3Server(s3server.S3Server):
        """tests.s3server.S3Server (a moto child process on 127.0.0.1) with the ranged-GET
        patch applied in the child (``patched=False``: stock moto)."""

        def __init__(self, *, patched: bool) -> None:
            super().__init__(mode="process")
            self.patched = patched

        def _start_process(self) -> None:
            if not self.patched:
                return super()._start_process()
            child = s3server._CHILD.replace("from moto.server import main",
                                            _MOTO_RANGE_PATCH + "\nfrom moto.server import main")
            assert child != s3server._CHILD
            saved = s3server._CHILD
            s3server._CHILD = child  # read by the parent's _start_process, once, right now
            try:
                return super()._start_process()
            finally:
                s3server._CHILD = saved

    return BenchS3Server


def proc_cpu_s(pid: int | None) -> float | None:
    """User + system CPU seconds of a process so far (its threads included)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def aws_env() -> dict[str, str]:
    from tests.s3server import AWS_TEST_ENV, AWS_UNSET_ENV
    env = {k: v for k, v in C.child_env(REPO_ROOT).items() if k not in AWS_UNSET_ENV}
    env.update(AWS_TEST_ENV)
    return env


# ================================================================================= child side

def _read_payload(path: str, n: int):
    from fastckpt.storage.native import aligned_buffer
    buf = aligned_buffer(n)
    with open(path, "rb", buffering=0) as f:
        got = f.readinto(buf)
    if got != n:
        raise RuntimeError(f"payload file holds {got} bytes, expected {n}")
    return buf


def _hash_views(views) -> str:
    import xxhash
    h = xxhash.xxh3_128()
    for v in views:
        h.update(v)
    return h.hexdigest()


def _hash_file(path: str) -> str:
    import xxhash
    h = xxhash.xxh3_128()
    with open(path, "rb", buffering=0) as f:
        while chunk := f.read(16 << 20):
            h.update(chunk)
    return h.hexdigest()


def _fastckpt_options(p: dict) -> dict:
    opts = {"key": KEY, "secret": SECRET, "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": p["endpoint"], "region_name": REGION}}
    if p.get("pool"):
        opts["config_kwargs"] = {"max_pool_connections": p["pool"]}
    return opts


def _setup_fastckpt(p: dict):
    from fastckpt.storage import open_storage
    from fastckpt.storage.native import aligned_buffer
    n = p["bytes"]
    remote = {"concurrency": p["concurrency"]} if p.get("concurrency") else {}
    st = open_storage(f"s3://{BUCKET}/{p['prefix']}", storage_options=_fastckpt_options(p),
                      remote=remote)
    st.size(st.join("warm-up"))  # the client, its session and the event loop exist now
    path = st.join("data.bin")
    info = {"concurrency": st.concurrency, "part_bytes": st.part_bytes,
            "max_pool_connections": st.fs.config_kwargs.get("max_pool_connections")}
    if p["op"] == "save":
        buf = _read_payload(p["payload"], n)

        def run():
            st.write_shard(path, buf, n, [(0, n)])

        def after():
            return dict(info, client_stats=dict(st.stats))
    else:
        buf = aligned_buffer(n)

        def run():
            st.read_into(path, 0, buf, n)

        def after():
            return dict(info, client_stats=dict(st.stats), hash=_hash_views([buf[:n]]))
    return run, after


def _setup_e2e(p: dict):
    # imported before the timed region, as every contender's library is (s3fs and the s3
    # backend too: fastckpt imports them on first use)
    import s3fs  # noqa: F401
    import torch

    import fastckpt
    import fastckpt.storage.s3
    fastckpt.save, fastckpt.load  # noqa: B018 - the package is lazy: import the engine now
    n, k = p["bytes"], p["tensors"]
    per = n // k // 4  # float32 elements per tensor (n is a multiple of 4 k)
    url = f"s3://{BUCKET}/{p['prefix']}"
    opts = _fastckpt_options(p)
    if p["op"] == "save":
        raw = _read_payload(p["payload"], n)
        flat = torch.frombuffer(raw, dtype=torch.float32)
        state = {f"t{i:02d}": flat[i * per:(i + 1) * per].clone() for i in range(k)}
        del flat, raw

        def run():
            fastckpt.save(state, url, step=1, storage_options=opts)

        def after():
            return {"tensors": k}
    else:
        state = {f"t{i:02d}": torch.empty(per, dtype=torch.float32) for i in range(k)}
        out: dict[str, Any] = {}

        def run():
            out["step"] = fastckpt.load(state, url, storage_options=opts)

        def after():
            if out.get("step") != 1:
                raise RuntimeError(f"fastckpt.load returned step {out.get('step')!r}, want 1")
            views = [memoryview(state[f"t{i:02d}"].numpy()).cast("B") for i in range(k)]
            return {"tensors": k, "hash": _hash_views(views), "loaded_step": out["step"]}
    return run, after


def _setup_s3fs(p: dict):
    import s3fs
    fs = s3fs.S3FileSystem(key=KEY, secret=SECRET, skip_instance_cache=True,
                           client_kwargs={"endpoint_url": p["endpoint"], "region_name": REGION})
    fs.exists(f"{BUCKET}/{p['prefix']}/warm-up")  # the client and its session exist now
    rpath = f"{BUCKET}/{p['prefix']}/data.bin"
    info = {"max_concurrency": fs.max_concurrency}
    if p["op"] == "save":
        def run():
            fs.put_file(p["payload"], rpath)

        return run, lambda: info
    local = os.path.join(p["workdir"], f"dl-{uuid.uuid4().hex[:8]}.bin")

    def run():
        fs.get_file(rpath, local)

    def after():
        try:
            return dict(info, hash=_hash_file(local))
        finally:
            os.unlink(local)
    return run, after


def _setup_boto3(p: dict):
    import boto3
    from boto3.s3.transfer import TransferConfig
    from botocore.config import Config
    conc = p.get("concurrency")
    cfg = Config(max_pool_connections=conc) if conc else None
    tc = TransferConfig(max_concurrency=conc) if conc else TransferConfig()
    client = boto3.client("s3", endpoint_url=p["endpoint"], region_name=REGION,
                          aws_access_key_id=KEY, aws_secret_access_key=SECRET, config=cfg)
    client.head_bucket(Bucket=BUCKET)  # the client and its pool exist now
    key = f"{p['prefix']}/data.bin"
    info = {"max_concurrency": tc.max_concurrency, "multipart_chunksize": tc.multipart_chunksize,
            "max_pool_connections": client.meta.config.max_pool_connections}
    if p["op"] == "save":
        def run():
            client.upload_file(p["payload"], BUCKET, key, Config=tc)

        return run, lambda: info
    local = os.path.join(p["workdir"], f"dl-{uuid.uuid4().hex[:8]}.bin")

    def run():
        client.download_file(BUCKET, key, local, Config=tc)

    def after():
        try:
            return dict(info, hash=_hash_file(local))
        finally:
            os.unlink(local)
    return run, after


def _setup_s3torch(p: dict):
    from s3torchconnector import S3Checkpoint, S3ClientConfig

    from fastckpt.storage.native import aligned_buffer
    n = p["bytes"]
    cfg = S3ClientConfig(force_path_style=True)
    cp = S3Checkpoint(region=REGION, endpoint=p["endpoint"], s3client_config=cfg)
    uri = f"s3://{BUCKET}/{p['prefix']}/data.bin"
    with contextlib.suppress(Exception):  # the native client exists now (a 404 is fine)
        cp._client.head_object(BUCKET, f"{p['prefix']}/warm-up")
    info = {"throughput_target_gbps": cfg.throughput_target_gbps, "part_size": cfg.part_size}
    if p["op"] == "save":
        data = bytes(_read_payload(p["payload"], n))  # S3Writer.write copies a memoryview

        def run():
            with cp.writer(uri) as w:
                w.write(data)

        return run, lambda: info
    buf = aligned_buffer(n)
    got: dict[str, int] = {}

    def run():
        got["n"] = cp.reader(uri).readinto(buf)

    def after():
        if got.get("n") != n:
            raise RuntimeError(f"readinto returned {got.get('n')} bytes, expected {n}")
        return dict(info, hash=_hash_views([buf[:n]]))
    return run, after


SETUP = {"fastckpt": _setup_fastckpt, "fastckpt-e2e": _setup_e2e, "s3fs": _setup_s3fs,
         "boto3": _setup_boto3, "s3torch": _setup_s3torch}


def _child(p: dict[str, Any]) -> dict[str, Any]:
    import gc
    t0 = time.perf_counter()
    run, after = SETUP[p["kind"]](p)
    gc.collect()
    setup_s = time.perf_counter() - t0
    meter = C.OpMeter()
    with meter:
        run()
    res = dict(meter.result)
    res.update(after())
    res.update(bytes=p["bytes"], seconds=res["wall_s"], setup_s=setup_s)
    return res


# ================================================================================ parent side

def contender_specs(args) -> dict[str, dict[str, Any]]:
    """name -> {kind, concurrency}, in the order they are listed."""
    specs: dict[str, dict[str, Any]] = {}
    for name in args.contenders:
        if name == "fastckpt":
            specs[name] = {"kind": "fastckpt", "concurrency": None, "pool": None}
            for c in args.fastckpt_concurrency:
                if c != FASTCKPT_DEFAULT_CONCURRENCY:
                    specs[f"fastckpt-c{c}"] = {"kind": "fastckpt", "concurrency": c, "pool": None}
            for c in args.fastckpt_pool:
                specs[f"fastckpt-c{c}-pool"] = {"kind": "fastckpt", "concurrency": c, "pool": c}
        elif name == "boto3":
            specs[name] = {"kind": "boto3", "concurrency": None, "pool": None}
            for c in args.boto3_concurrency:
                if c != BOTO3_DEFAULT_CONCURRENCY:
                    specs[f"boto3-c{c}"] = {"kind": "boto3", "concurrency": c, "pool": c}
        else:
            specs[name] = {"kind": name, "concurrency": None, "pool": None}
    return specs


def description(name: str, spec: dict[str, Any]) -> str:
    if spec["concurrency"] is not None:
        pool = "-pool" if spec["kind"] == "fastckpt" and spec["pool"] else ""
        return re.sub(r"\bN\b", str(spec["concurrency"]),
                      DESCRIPTIONS[f"{spec['kind']}-cN{pool}"])
    return DESCRIPTIONS[name]


def probe_imports(kinds: list[str]) -> dict[str, str]:
    """kind -> why it cannot run (its package does not import); probed in a subprocess."""
    mods = {"fastckpt": "fastckpt.storage.s3, s3fs", "fastckpt-e2e": "torch, fastckpt, s3fs",
            "s3fs": "s3fs", "boto3": "boto3, s3transfer", "s3torch": "s3torchconnector"}
    bad = {}
    for kind in kinds:
        r = subprocess.run([sys.executable, "-c", f"import {mods[kind]}"], env=aws_env(),
                           capture_output=True, text=True, timeout=300, check=False)
        if r.returncode != 0:
            last = (r.stderr.strip().splitlines() or ["import failed"])[-1]
            bad[kind] = f"cannot import {mods[kind]}: {last}"
    return bad


def write_payload(path: str, n: int, seed: int) -> str:
    """``n`` deterministic random bytes from ``seed`` into ``path``; their xxh3-128."""
    import xxhash
    rng = random.Random(seed)
    h = xxhash.xxh3_128()
    with open(path, "wb") as f:
        left = n
        while left:
            chunk = rng.randbytes(min(left, 16 << 20))
            h.update(chunk)
            f.write(chunk)
            left -= len(chunk)
    return h.hexdigest()


class Store:
    """The moto child and the throttling proxy child in front of it; a plain boto3 client
    straight to moto for the untimed housekeeping (bucket, clean-up between samples)."""

    def __init__(self, args) -> None:
        from tests.s3throttle import ThrottleProxy
        os.environ.update({k: v for k, v in aws_env().items() if k.startswith("AWS_")
                           or k.lower() == "no_proxy"})
        self.server = _server_class()(patched=not args.stock_moto)
        self.server.start()
        self.proxy = ThrottleProxy(self.server.port, rate_bps=args.rate_bps,
                                   latency_s=args.latency)
        self.proxy.start()
        import boto3
        self.admin = boto3.client("s3", endpoint_url=self.server.endpoint, region_name=REGION,
                                  aws_access_key_id=KEY, aws_secret_access_key=SECRET)
        self.admin.create_bucket(Bucket=BUCKET)

    def set(self, rate_bps: float | None, latency_s: float) -> None:
        self.proxy.set_rate(rate_bps)
        self.proxy.set_latency(latency_s)

    def cpu(self) -> dict[str, float | None]:
        return {"server": proc_cpu_s(self.server._proc.pid if self.server._proc else None),
                "proxy": proc_cpu_s(self.proxy.pid)}

    def clear(self, prefix: str) -> None:
        """Remove every object and unfinished multipart upload under ``prefix``."""
        pages = self.admin.get_paginator("list_objects_v2").paginate(Bucket=BUCKET,
                                                                     Prefix=prefix + "/")
        for page in pages:
            keys = [{"Key": o["Key"]} for o in page.get("Contents", [])]
            if keys:
                self.admin.delete_objects(Bucket=BUCKET, Delete={"Objects": keys, "Quiet": True})
        ups = self.admin.list_multipart_uploads(Bucket=BUCKET, Prefix=prefix + "/")
        for u in ups.get("Uploads", []):
            self.admin.abort_multipart_upload(Bucket=BUCKET, Key=u["Key"], UploadId=u["UploadId"])

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.proxy.stop()
        with contextlib.suppress(Exception):
            self.server.stop()


def run_sample(store: Store, name: str, spec: dict[str, Any], op: str, cond: dict[str, Any],
               rep: int, args, payload_hash: str) -> dict[str, Any]:
    prefix = f"{cond['name']}/r{rep}/{name}"
    p = {"kind": spec["kind"], "concurrency": spec["concurrency"], "pool": spec["pool"],
         "op": op,
         "endpoint": store.proxy.endpoint, "prefix": prefix, "bytes": args.size_bytes,
         "payload": args.payload, "workdir": args.workdir, "tensors": args.tensors}
    argv = [sys.executable, os.path.abspath(__file__), "--child"]
    store.proxy.reset_stats()
    cpu0 = store.cpu()
    s = C.run_child(argv, p, timeout=args.timeout, env=aws_env())
    cpu1 = store.cpu()
    px = store.proxy.stats()
    s.update(contender=name, op=op, rep=rep, condition=cond["name"], kind=spec["kind"],
             concurrency_setting=spec["concurrency"],
             proxy={k: px.get(k) for k in ("max_in_flight", "max_open_connections",
                                           "connections", "requests", "responses",
                                           "bytes_up", "bytes_down", "resets")},
             max_in_flight=px.get("max_in_flight"),
             server_cpu_s={k: (cpu1[k] - cpu0[k]) if cpu0[k] is not None and cpu1[k] is not None
                           else None for k in cpu0})
    if s.get("ok") and op == "load":
        s["verified"] = s.get("hash") == payload_hash
        if not s["verified"]:
            s.update(ok=False, error=f"downloaded bytes differ from the payload (xxh3-128 "
                                     f"{s.get('hash')} != {payload_hash})")
    return s


def fmt_sample(s: dict[str, Any]) -> str:
    if not s.get("ok"):
        return f"FAILED: {s.get('error', '?')}"
    srv = s["server_cpu_s"]
    return (f"{s['seconds']:7.2f} s {s['bytes'] / s['seconds'] / C.MiB:8.1f} MiB/s  "
            f"in flight {s['max_in_flight']:3d}  cpu {s['cpu_s']:5.2f} s  "
            f"(server {srv['server'] or 0:.2f} s, proxy {srv['proxy'] or 0:.2f} s)")


def summarize(samples: list[dict[str, Any]], cond: dict[str, Any],
              server_best: dict[str, float | None]) -> list[dict[str, Any]]:
    """Medians of one proxy setting; ``x_baseline`` = median of per-rep ratios to fastckpt."""
    mine = [s for s in samples if s["condition"] == cond["name"]]
    rows = C.summarize(mine, baseline="fastckpt")
    for r in rows:
        ok = [s for s in mine if s["contender"] == r["contender"] and s["op"] == r["op"]
              and s.get("ok")]
        r["condition"] = cond["name"]
        r["median_max_in_flight"] = C.median(s["max_in_flight"] for s in ok)
        r["median_server_cpu_s_per_GiB"] = C.median(
            ((s["server_cpu_s"]["server"] or 0) + (s["server_cpu_s"]["proxy"] or 0))
            / (s["bytes"] / C.GiB) for s in ok)
        rate = cond["rate_bps"]
        ceiling = (r["median_max_in_flight"] * rate / C.MiB
                   if rate is not None and r["median_max_in_flight"] else None)
        r["ceiling_MiBps"] = ceiling
        server = server_best.get(r["op"])
        bound = min(x for x in (ceiling, server) if x is not None) if (
            ceiling is not None or server is not None) else None
        r["attainable_MiBps"] = bound
        r["x_attainable"] = (r["median_MiBps"] / bound
                             if bound and r["median_MiBps"] is not None else None)
    return rows


def best_of(rows: list[dict[str, Any]], kind_prefix: str, op: str) -> dict[str, Any] | None:
    cands = [r for r in rows if r["op"] == op and r["median_MiBps"]
             and (r["contender"] == kind_prefix or r["contender"].startswith(kind_prefix + "-c"))]
    return max(cands, key=lambda r: r["median_MiBps"]) if cands else None


COLUMNS = [
    ("contender", "contender", ""),
    ("op", "op", ""),
    ("n", "n", "d"),
    ("median s", "median_s", ".2f"),
    ("min-max s", lambda r: (f"{r['min_s']:.2f}-{r['max_s']:.2f}"
                             if r["min_s"] is not None else None), ""),
    ("MiB/s", "median_MiBps", ".1f"),
    ("x fastckpt", "x_baseline", ".2f"),
    ("in flight", "median_max_in_flight", ".0f"),
    ("ceiling MiB/s", "ceiling_MiBps", ".0f"),
    ("x attainable", "x_attainable", ".2f"),
    ("CPU s/GiB", "median_cpu_s_per_GiB", ".2f"),
    ("srv+proxy CPU s/GiB", "median_server_cpu_s_per_GiB", ".2f"),
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Contenders:\n" + "\n".join(f"  {k}: {v}" for k, v in DESCRIPTIONS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default=None,
                   help="bytes moved by every contender (default 256MiB; --quick: 32MiB); "
                        "KiB/MiB/GiB and K/M/G are binary, KB/MB/GB decimal; rounded down to "
                        "whole MiB")
    p.add_argument("--reps", type=int, default=None,
                   help="repetitions, medians reported (default 3; --quick: 1)")
    p.add_argument("--rate", default="16MiB",
                   help="the proxy's cap per connection and direction, bytes/s (default "
                        "16MiB; S3 gives ~85MB)")
    p.add_argument("--latency", type=float, default=0.010,
                   help="seconds each request waits in the proxy before it goes on (0.010)")
    p.add_argument("--contenders", default="fastckpt,fastckpt-e2e,s3fs,boto3,s3torch",
                   help="comma-separated subset of fastckpt,fastckpt-e2e,s3fs,boto3,s3torch "
                        "(fastckpt and boto3 bring their concurrency sweeps)")
    p.add_argument("--fastckpt-concurrency", default=None,
                   help="S3Storage concurrencies besides its default 32 (default 8,16,64; "
                        "--quick: 8; '' for none)")
    p.add_argument("--fastckpt-pool", default=None,
                   help="S3Storage concurrencies run with botocore's max_pool_connections "
                        "raised to match (default 64; --quick: none; '' for none)")
    p.add_argument("--boto3-concurrency", default=None,
                   help="TransferConfig max_concurrency values besides its default 10 "
                        "(default 16,32,64; --quick: 32; '' for none)")
    p.add_argument("--tensors", type=int, default=8,
                   help="float32 tensors the fastckpt-e2e state is split into (8)")
    p.add_argument("--no-unthrottled", dest="unthrottled", action="store_false",
                   help="skip the runs with the proxy unthrottled (then 'x attainable' uses "
                        "the per-connection ceiling only)")
    p.add_argument("--stock-moto", action="store_true",
                   help="run moto unpatched (its ranged GETs read the whole object)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 32 MiB, 1 rep, short sweeps (about a minute)")
    p.add_argument("--dir", default=None,
                   help="where the payload and downloaded files go (default: /dev/shm, a "
                        "tmpfs, if present, else the temp dir)")
    p.add_argument("--out", "--json", dest="out",
                   default=os.path.join(REPO_ROOT, "bench-out", "s3.json"),
                   help="where to write the JSON report")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=600, help="seconds allowed per child")
    args = p.parse_args(argv)
    args.size = args.size or ("32MiB" if args.quick else "256MiB")
    args.reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    if args.fastckpt_concurrency is None:
        args.fastckpt_concurrency = "8" if args.quick else "8,16,64"
    if args.boto3_concurrency is None:
        args.boto3_concurrency = "32" if args.quick else "16,32,64"
    if args.fastckpt_pool is None:
        args.fastckpt_pool = "" if args.quick else "64"
    try:
        args.fastckpt_concurrency = [int(x) for x in args.fastckpt_concurrency.split(",") if x]
        args.fastckpt_pool = [int(x) for x in args.fastckpt_pool.split(",") if x]
        args.boto3_concurrency = [int(x) for x in args.boto3_concurrency.split(",") if x]
    except ValueError as e:
        p.error(f"concurrency lists are comma-separated integers: {e}")
    if any(c < 1 for c in args.fastckpt_concurrency + args.boto3_concurrency
           + args.fastckpt_pool):
        p.error("concurrencies must be >= 1")
    args.contenders = [c.strip() for c in args.contenders.split(",") if c.strip()]
    bad = [c for c in args.contenders if c not in SETUP]
    if bad:
        p.error(f"unknown contender(s) {bad}; choose from {','.join(SETUP)}")
    if args.reps < 1:
        p.error("--reps must be >= 1")
    if args.tensors < 1:
        p.error("--tensors must be >= 1")
    try:
        size = C.parse_size(args.size)
        args.rate_bps = float(C.parse_size(args.rate))
    except ValueError as e:
        p.error(str(e))
    args.size_bytes = size // C.MiB * C.MiB
    if args.size_bytes < C.MiB or args.size_bytes % (4 * args.tensors):
        p.error(f"--size must be at least 1 MiB (and whole MiB split into {args.tensors} "
                "float32 tensors)")
    if args.rate_bps <= 0 or args.latency < 0:
        p.error("--rate must be > 0 and --latency >= 0")
    return args


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    specs = contender_specs(args)
    skipped = probe_imports(sorted({s["kind"] for s in specs.values()}))
    for kind, why in skipped.items():
        print(f"SKIP {kind}: {why}", file=sys.stderr)
    specs = {n: s for n, s in specs.items() if s["kind"] not in skipped}
    if not specs:
        print("nothing to run", file=sys.stderr)
        return 2
    if "fastckpt" not in specs:
        print("note: without the fastckpt contender there is no 'x fastckpt' column",
              file=sys.stderr)

    base = args.dir or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
    args.workdir = tempfile.mkdtemp(prefix="fastckpt-bench-s3-", dir=base)
    args.payload = os.path.join(args.workdir, "payload.bin")
    conds = [{"name": "throttled", "rate_bps": args.rate_bps, "latency_s": args.latency}]
    if args.unthrottled:
        conds.append({"name": "unthrottled", "rate_bps": None, "latency_s": 0.0})
    store = None
    samples: list[dict[str, Any]] = []
    try:
        payload_hash = write_payload(args.payload, args.size_bytes, args.seed)
        store = Store(args)
        machine = C.machine_info(args.workdir)
        print(f"payload: {C.human_bytes(args.size_bytes)} (xxh3-128 {payload_hash}) in "
              f"{args.workdir} ({machine.get('fs_type')})")
        print(f"store: moto{' (stock)' if args.stock_moto else ' (ranged GETs read the range)'}"
              f" {store.server.endpoint} behind the proxy {store.proxy.endpoint}; throttled: "
              f"{args.rate_bps / C.MiB:.1f} MiB/s per connection, {args.latency * 1e3:.0f} ms "
              f"per request")
        print(f"contenders: {', '.join(specs)}; reps: {args.reps}; settings: "
              f"{', '.join(c['name'] for c in conds)}")
        for rep, order in enumerate(C.rotations(list(specs), args.reps)):
            for cond in (conds if rep % 2 == 0 else conds[::-1]):
                store.set(cond["rate_bps"], cond["latency_s"])
                print(f"--- rep {rep + 1}/{args.reps}, {cond['name']}: {' -> '.join(order)}",
                      flush=True)
                for name in order:
                    prefix = f"{cond['name']}/r{rep}/{name}"
                    try:
                        for op in OPS:
                            if op == "load" and not samples[-1].get("ok"):
                                s = {"ok": False, "error": "skipped: the save failed",
                                     "contender": name, "op": op, "rep": rep,
                                     "condition": cond["name"], "kind": specs[name]["kind"]}
                            else:
                                s = run_sample(store, name, specs[name], op, cond, rep, args,
                                               payload_hash)
                            samples.append(s)
                            print(f"  {name:14s} {op:4s} {fmt_sample(s)}", flush=True)
                    finally:
                        store.clear(prefix)
    finally:
        if store is not None:
            store.stop()
        shutil.rmtree(args.workdir, ignore_errors=True)

    # --- medians; the server's own ceiling is the best any contender moved unthrottled
    server_best: dict[str, float | None] = {op: None for op in OPS}
    tables = {}
    if args.unthrottled:
        tables["unthrottled"] = summarize(samples, conds[1], {})
        for op in OPS:
            vals = [r["median_MiBps"] for r in tables["unthrottled"]
                    if r["op"] == op and r["median_MiBps"]]
            server_best[op] = max(vals) if vals else None
        tables["unthrottled"] = summarize(samples, conds[1], server_best)
    tables["throttled"] = summarize(samples, conds[0], server_best)
    elapsed = time.perf_counter() - t_start

    print()
    print(f"{C.human_bytes(args.size_bytes)} per contender, {args.reps} rep(s), medians; "
          f"total {elapsed:.0f} s. MiB/s = 2^20 bytes/s. 'x fastckpt': median of per-rep "
          f"ratios to fastckpt (S3Storage, defaults)")
    headline: dict[str, Any] = {}
    for cond in conds:
        rows = tables[cond["name"]]
        if cond["rate_bps"] is not None:
            print(f"\nthrottled: {cond['rate_bps'] / C.MiB:.1f} MiB/s per connection, "
                  f"{cond['latency_s'] * 1e3:.0f} ms per request; ceiling = in flight x cap; "
                  f"x attainable = MiB/s / min(ceiling, server) with server = the best "
                  f"unthrottled median (save {_f(server_best['save'])}, load "
                  f"{_f(server_best['load'])} MiB/s)")
        else:
            print("\nunthrottled (no cap, no latency): the server + proxy + this machine; "
                  "x attainable = MiB/s / the best of this table")
        print(C.format_table(rows, COLUMNS))
        for op in OPS:
            picks = {k: best_of(rows, k, op) for k in ("fastckpt", "boto3")}
            line = ", ".join(f"{k} best: {r['contender']} {r['median_MiBps']:.1f} MiB/s"
                             for k, r in picks.items() if r is not None)
            if line:
                print(f"  {op}: {line}")
            headline[f"{cond['name']}/{op}"] = {
                k: (r["contender"], r["median_MiBps"]) if r else None for k, r in picks.items()}
        for r in rows:
            if r["n_failed"]:
                print(f"  {r['contender']} {r['op']}: {r['n_failed']} failed: "
                      f"{'; '.join(r['errors'])}", file=sys.stderr)
    for kind, why in skipped.items():
        print(f"  skipped {kind}: {why}")

    report = {
        "benchmark": "s3",
        "date_utc": C.utc_now(),
        "git": C.git_commit(REPO_ROOT),
        "machine": machine,
        "versions": dict(C.base_versions(), **{
            m: C.pkg_version(m) for m in ("s3fs", "fsspec", "aiobotocore", "aiohttp", "boto3",
                                          "botocore", "s3transfer", "moto", "s3torchconnector",
                                          "s3torchconnectorclient", "xxhash")}),
        "parameters": {
            "size_requested": args.size, "bytes": args.size_bytes, "reps": args.reps,
            "quick": args.quick, "payload_xxh3_128": payload_hash, "seed": args.seed,
            "conditions": conds, "rate_bps": args.rate_bps, "latency_s": args.latency,
            "contenders": {n: dict(s, description=description(n, s)) for n, s in specs.items()},
            "skipped": skipped, "tensors": args.tensors, "timeout_s": args.timeout,
            "moto": "stock" if args.stock_moto else "ranged GETs read only the range",
            "workdir": args.workdir,
            "procedure": "every save and load in a fresh process; contenders rotated each rep, "
                         "the two proxy settings alternated; each load reads the object its "
                         "contender saved in that rep and is hashed (xxh3-128) after the timed "
                         "region; objects removed after each save/load pair",
            "columns": {
                "x_baseline": "median over reps of (contender MiB/s / fastckpt MiB/s, same rep, "
                              "op and proxy setting)",
                "median_max_in_flight": "the proxy's most requests in flight during the "
                                        "child's life (setup included): connections used",
                "ceiling_MiBps": "median_max_in_flight x the per-connection cap",
                "attainable_MiBps": "min(ceiling, server_best[op])",
                "server_best": "the best median MiB/s of any contender, proxy unthrottled",
                "cpu": "the child's getrusage self+children around the timed operation",
                "server_cpu_s": "moto's and the proxy's CPU seconds during the child's life",
            },
        },
        "server_best_MiBps": server_best,
        "headline": headline,
        "elapsed_s": elapsed,
        "medians": [r for c in conds for r in tables[c["name"]]],
        "samples": samples,
    }
    out = C.write_json(args.out, report)
    print(f"\nJSON: {out}")
    return 1 if any(not s.get("ok") for s in samples) else 0


def _f(v: float | None) -> str:
    return "-" if v is None else f"{v:.1f}"


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        sys.exit(C.child_main(sys.argv[2], sys.argv[3], _child))
    sys.exit(main(sys.argv[1:]))
