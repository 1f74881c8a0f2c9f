"""Crafting checkpoints the way an attacker would: manifests edited and re-checksummed (the
checksum detects damage, not tampering), destinations with guard bytes, and a record of the
file-system calls a process makes outside a directory.

    doc = read_doc(root, step)                 # the manifest as JSON
    doc["body"]["files"] = ...                 # any edit
    write_doc(root, step, doc)                 # checksum recomputed
    t, check = guarded(torch.float32, (1024,), phase=0)   # t sits between canaries
    check()                                    # AssertionError if a byte around t changed
    with outside_calls(root) as seen: ...      # file-system calls on paths outside root
"""

from __future__ import annotations

import contextlib
import json
import os
import sys

import torch

from fastckpt.manifest import schema as fmt

CANARY = 0xA5
GUARD = 256 << 10  # bytes of canary on each side (more than any off-by-a-lot a test crafts)


def manifest_path(root: str, step: int) -> str:
    return os.path.join(root, fmt.step_dirname(step), fmt.MANIFEST)


def read_doc(root: str, step: int) -> dict:
    with open(manifest_path(root, step), "rb") as f:
        return json.loads(f.read())


def write_doc(root: str, step: int, doc: dict) -> None:
    """Write ``doc`` as the step's manifest with its body checksum recomputed (whatever the
    body holds); a body that cannot be serialised is written as it is."""
    doc = dict(doc)
    try:
        doc["checksum"] = fmt._body_checksum(doc["body"])
    except Exception:  # noqa: BLE001 - not JSON-able: the reader must reject it anyway
        pass
    data = json.dumps(doc, indent=1).encode()
    with open(manifest_path(root, step), "wb") as f:
        f.write(data)


def write_raw(root: str, step: int, body_text: str) -> None:
    """A manifest whose body is the given canonical JSON text, with a valid checksum (for
    bodies Python's json module cannot even produce, such as 5000 nested lists)."""
    import xxhash
    digest = fmt.hexdigest(xxhash.xxh3_64_intdigest(body_text.encode()))
    text = ('{"format":"fastckpt","format_version":1,"body":' + body_text
            + ',"checksum":"' + digest + '"}')
    with open(manifest_path(root, step), "w") as f:
        f.write(text)


def guarded(dtype: torch.dtype, shape: tuple, phase: int | None = 0):
    """A contiguous tensor placed inside a larger buffer filled with canary bytes, at an address
    with ``phase`` = address mod 4096 (so the direct-read path takes it when the chunk's file
    offset has the same phase); returns (tensor, check) where ``check()`` asserts that no byte
    outside the tensor changed."""
    nbytes = int(torch.Size(shape).numel()) * dtype.itemsize
    raw = torch.full((nbytes + 2 * GUARD + 8192,), CANARY, dtype=torch.uint8)
    start = GUARD
    if phase is not None:
        start += (phase - (raw.data_ptr() + GUARD)) % 4096
    t = raw[start:start + nbytes].view(dtype).view(shape)
    t.zero_()

    def check() -> None:
        before, after = raw[:start], raw[start + nbytes:]
        bad = [i for i in (before != CANARY).nonzero().flatten().tolist()[:3]]
        bad += [start + nbytes + i for i in (after != CANARY).nonzero().flatten().tolist()[:3]]
        assert not bad, f"bytes outside the tensor were written (buffer offsets {bad})"
    return t, check


_WATCH: list = []  # (root, seen) of the active outside_calls contexts
_HOOKED = False
_EVENTS = {"open", "os.remove", "os.rename", "os.rmdir", "os.mkdir", "shutil.rmtree",
           "os.listdir", "os.scandir", "os.truncate", "os.chmod", "os.utime", "os.symlink",
           "os.link"}
_IGNORED = ("/proc/", "/dev/", "/sys/", sys.prefix, sys.base_prefix, "/usr/", "/etc/",
            "/tmp/torchelastic")


def _hook(event: str, args: tuple) -> None:
    if not _WATCH or event not in _EVENTS or not args:
        return
    for a in args[:2]:
        if isinstance(a, int) or a is None:
            continue
        try:
            p = os.fsdecode(a)
        except TypeError:
            continue
        if not os.path.isabs(p):
            continue  # relative to a directory fd: the fd itself was opened by path
        p = os.path.normpath(p)
        if event == "open" and p.endswith(".py"):
            continue  # source lines read for a traceback (linecache)
        for root, seen in _WATCH:
            if p != root and not p.startswith(root + os.sep) and not p.startswith(_IGNORED):
                seen.append((event, p))


@contextlib.contextmanager
def outside_calls(root: str):
    """Record the audited file-system calls (open, remove, rename, mkdir, rmtree, listings) this
    process makes on absolute paths outside ``root`` (and outside the interpreter's and the
    system's own directories). Native code is not audited: run such checks with the Python I/O
    backend (FASTCKPT_NATIVE=off / ``native="off"``)."""
    global _HOOKED
    if not _HOOKED:
        sys.addaudithook(_hook)
        _HOOKED = True
    seen: list = []
    entry = (os.path.normpath(os.path.abspath(root)), seen)
    _WATCH.append(entry)
    try:
        yield seen
    finally:
        _WATCH.remove(entry)
