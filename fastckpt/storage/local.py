"""Local file systems: direct I/O shard writes, fsync, atomic rename commit.

Containment (a checkpoint's contents are untrusted, see docs/design.md "Threat model"): names
joined under the root come from listings or validated manifests; symbolic links inside the root
are never followed: listings leave them out, files are opened with ``O_NOFOLLOW`` and must be
regular files (a FIFO, device or directory where a file is expected raises
``NotRegularFileError`` instead of blocking), files are created and removed relative to a
directory opened with ``O_NOFOLLOW``, and a step directory that is a link is not written
through. The root itself may be a link (the user's choice).

Deadlines: a local disk's system calls cannot be interrupted, and a mount that stops answering
(NFS, a failing device) blocks them for good. A :meth:`LocalStorage.bounded` view runs its
metadata calls (directories, listings, small files, the manifest's rename, removals) on a shared
pool of threads (storage/bounded.py) and waits for each until the view's deadline: a call that
has not returned by then is left to its thread and a StorageError names it, so a save fails by
its deadline instead of hanging; a call left to its thread renames and removes nothing after
that (bounded.py's commit point). A :meth:`LocalStorage.per_call` view (a load's) bounds
each such call by a fixed time instead. Shard writes and reads run on the engine's own I/O
threads, whose waits the writer and the reader bound the same way (engine/writer.py,
engine/readitems.py).
"""

from __future__ import annotations

import copy
import errno
import functools
import os
import shutil
import stat
import time
import uuid
from typing import Sequence

from . import bounded as _b
from . import native as _native
from ..errors import NotRegularFileError
from .base import Storage, storage_error

_O_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_O_CLOEXEC = getattr(os, "O_CLOEXEC", 0)


def _kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISLNK, "a symbolic link"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "not a regular file"


def not_regular(path: str, mode: int) -> NotRegularFileError:
    err = NotRegularFileError(f"expected a regular file, found {_kind(mode)}; fastckpt never "
                              "opens or follows anything else", file=path)
    err.errno = errno.EINVAL  # type: ignore[misc]
    return err


def _hop(view: "LocalStorage", what: str, path: str, fn, *args, **kw):
    """``fn(*args, **kw)`` under ``view``'s bound (see :func:`bounded_call`)."""
    if view.deadline is None and view.call_s is None:
        return fn(*args, **kw)
    bound = (view.call_s if view.deadline is None
             else max(view.deadline - time.monotonic(), _b.FLOOR_S))
    return _b.hop(bound, what, path, fn, *args, **kw)


def bounded_call(what: str):
    """Decorate a LocalStorage method ``(self, path, ...)``: on a bounded view (``deadline``
    set) it runs on the shared pool (storage/bounded.py) and is waited for until the
    deadline (at least ``bounded.FLOOR_S``), on a per-call view (``call_s`` set) for ``call_s`` seconds; past that,
    StorageError naming ``what`` and the path. A call made from a pool thread runs in place
    (no wait for a pool thread from a pool thread: see :meth:`LocalStorage.run`)."""
    def deco(fn):
        @functools.wraps(fn)
        def call(self, path, *args, **kw):
            return _hop(self, what, path, fn, self, path, *args, **kw)
        return call
    return deco


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalStorage(Storage):
    #: a bounded view's deadline (``time.monotonic()``), a per-call view's bound (seconds);
    #: both None: calls run in place, unbounded
    deadline: float | None = None
    call_s: float | None = None

    def __init__(self, root: str, *, io_mode: str = "auto", direct_io: bool = True) -> None:
        super().__init__(os.path.abspath(os.path.expanduser(root)))
        self.io = _native.get_backend(io_mode)
        self.direct_io = direct_io
        _b.pool()  # (its first threads start here, in the opening thread: see bounded.py)

    @property
    def is_local(self) -> bool:
        return True

    def bounded(self, deadline: float | None) -> "LocalStorage":
        """A view whose metadata calls end, or raise StorageError, by ``deadline`` (see the
        module docstring); shard writes and reads are not moved (their callers bound them)."""
        if deadline is None:
            return self
        view = copy.copy(self)
        view.deadline = deadline
        return view

    def run(self, what: str, fn, *args, path: str | None = None):
        """``fn(*args)``, a sequence of calls on this view, as one bounded call: one pool
        thread runs them all in place (a save's housekeeping: a dozen calls, one hand-off of
        about 70 us instead of one each), within the view's bound; an error past it names
        ``path`` (default: the root)."""
        return _hop(self, what, self.root if path is None else path, fn, *args)

    def per_call(self, seconds: float) -> "LocalStorage":
        """A view whose metadata calls each end, or raise StorageError, within ``seconds``
        (a load's: see the module docstring)."""
        view = copy.copy(self)
        view.call_s = float(seconds)
        return view

    def _dir_fd(self, d: str) -> int:
        """An fd of directory ``d``, not following a link unless ``d`` is the root."""
        flags = os.O_RDONLY | os.O_DIRECTORY | _O_CLOEXEC
        if os.path.normpath(d) != os.path.normpath(self.root):
            flags |= _O_NOFOLLOW
        return os.open(d, flags)

    @bounded_call("creating the directory")
    def makedirs(self, path: str) -> None:
        if os.path.islink(path) and os.path.normpath(path) != os.path.normpath(self.root):
            raise storage_error(OSError(errno.ELOOP, "is a symbolic link: fastckpt does not "
                                        "write through links inside the root"),
                                "creating the directory", path)
        if os.path.isdir(path):
            return
        try:
            os.makedirs(path, exist_ok=True)
            _fsync_dir(os.path.dirname(path.rstrip("/")) or "/")
        except OSError as e:
            raise storage_error(e, "creating the directory", path) from e

    @bounded_call("listing")
    def listdir(self, path: str) -> list[str]:
        """Names in ``path`` except symbolic links (never followed, never removed)."""
        try:
            with os.scandir(path) as it:
                return sorted(e.name for e in it if not e.is_symlink())
        except FileNotFoundError:
            return []
        except OSError as e:
            raise storage_error(e, "listing", path) from e

    @bounded_call("listing")
    def subdirs(self, path: str) -> list[str]:
        """Names of the directories in ``path``: not files (a stray file named like a step
        stopped retention and gc before 2026-12-06), not links."""
        try:
            with os.scandir(path) as it:
                return sorted(e.name for e in it if e.is_dir(follow_symlinks=False))
        except FileNotFoundError:
            return []
        except OSError as e:
            raise storage_error(e, "listing", path) from e

    @bounded_call("listing")
    def sizes(self, path: str) -> dict[str, int | None]:
        out: dict[str, int | None] = {}
        try:
            with os.scandir(path) as it:
                for e in it:
                    if not e.is_symlink():
                        try:
                            out[e.name] = e.stat(follow_symlinks=False).st_size
                        except FileNotFoundError:  # removed since the listing
                            continue
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise storage_error(e, "listing", path) from e
        return out

    @bounded_call("reading")
    def read_bytes(self, path: str) -> bytes:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise not_regular(path, stat.S_IFLNK) from None
            raise storage_error(e, "reading", path) from e
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise not_regular(path, st.st_mode)
            with os.fdopen(fd, "rb", closefd=False) as f:
                return f.read()
        except OSError as e:
            if isinstance(e, NotRegularFileError):
                raise
            raise storage_error(e, "reading", path) from e
        finally:
            os.close(fd)

    @bounded_call("stat")
    def size(self, path: str) -> int | None:
        """Size of a regular file; None when nothing is there; NotRegularFileError when
        something else is (a directory, a link, a FIFO)."""
        try:
            st = os.lstat(path)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as e:
            raise storage_error(e, "stat", path) from e
        if not stat.S_ISREG(st.st_mode):
            raise not_regular(path, st.st_mode)
        return st.st_size

    def write_shard(self, path: str, buf, nbytes: int, ranges: Sequence[tuple[int, int]], *,
                    hashes: Sequence[int] | None = None, sync_dir: bool = True) -> list[int]:
        if hashes is not None and len(hashes) != len(ranges):
            raise ValueError(f"{len(hashes)} hashes given for {len(ranges)} ranges")
        try:
            rh = self.io.write_file(path, buf, nbytes, [] if hashes is not None else ranges,
                                    direct=self.direct_io, fsync=True)
            if sync_dir:
                _fsync_dir(os.path.dirname(path))
            return list(hashes) if hashes is not None else rh
        except OSError as e:
            raise storage_error(e, "writing the shard", path) from e

    gathered_writes = True

    def write_gathered(self, path: str, nbytes: int, segments, hash_ranges) -> list[int]:
        try:
            return self.io.write_segments(path, nbytes, segments, hash_ranges,
                                          direct=self.direct_io, fsync=True)
        except OSError as e:
            raise storage_error(e, "writing the shard", path) from e

    @bounded_call("syncing the directory")
    def sync_dir(self, path: str) -> None:
        try:
            _fsync_dir(path)
        except OSError as e:
            raise storage_error(e, "syncing the directory", path) from e

    def read_into(self, path: str, offset: int, buf, nbytes: int, *,
                  hash: bool = True, direct: bool | None = None) -> int | None:
        direct = self.direct_io if direct is None else direct and self.direct_io
        try:
            return self.io.read_into(path, offset, buf, nbytes, direct=direct, hash=hash)
        except (OSError, EOFError) as e:
            raise storage_error(e, "reading", path, offset=offset) from e

    def cached(self, path: str) -> bool:
        """Three pages (first, middle, last) readable with ``RWF_NOWAIT``: they are in the page
        cache (a file just written or read is); False when the probe is not available."""
        flag = getattr(os, "RWF_NOWAIT", None)
        if flag is None:
            return False
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | _O_NOFOLLOW | _O_CLOEXEC)
        except OSError:
            return False
        try:
            size = os.fstat(fd).st_size
            buf = bytearray(1)
            for off in sorted({0, size // 2, max(0, size - 1)}):
                if size and os.preadv(fd, [buf], off, flag) != 1:
                    return False
            return True
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: cannot tell
            return False
        finally:
            os.close(fd)

    @bounded_call("publishing")
    def publish(self, path: str, data: bytes, *, durable: bool = True) -> None:
        d, name = os.path.split(path)
        tmp = f".{name}.tmp-{uuid.uuid4().hex[:8]}"
        dfd = -1
        try:
            dfd = self._dir_fd(d)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _O_CLOEXEC, 0o644,
                         dir_fd=dfd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                if durable:
                    os.fsync(fd)
            finally:
                os.close(fd)
            with _b.commit_point():  # (raises instead when its bounded caller gave up)
                os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            if durable:
                os.fsync(dfd)
        except OSError as e:
            if dfd >= 0:
                try:
                    os.unlink(tmp, dir_fd=dfd)
                except OSError:
                    pass
            raise storage_error(e, "publishing", path) from e
        finally:
            if dfd >= 0:
                os.close(dfd)

    @bounded_call("removing")
    def remove(self, path: str) -> None:
        """Remove one file (a link is removed, not followed; so is a link in place of its
        step directory: nothing outside the root is touched)."""
        _b.check_abandoned()  # (a housekeeping pass its bounded caller gave up on stops)
        d, name = os.path.split(path)
        try:
            dfd = self._dir_fd(d)
        except (FileNotFoundError, NotADirectoryError):
            return
        except OSError as e:
            if e.errno == errno.ELOOP:  # the directory is a link: nothing of ours is behind it
                return
            raise storage_error(e, "removing", path) from e
        try:
            os.unlink(name, dir_fd=dfd)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error(e, "removing", path) from e
        finally:
            os.close(dfd)

    @bounded_call("removing the directory")
    def remove_dir(self, path: str) -> None:
        """Remove a directory tree; a link in its place is removed itself, never followed
        (shutil.rmtree does not follow the links inside)."""
        _b.check_abandoned()
        try:
            if os.path.islink(path):
                os.unlink(path)
                return
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as e:
            raise storage_error(e, "removing", path) from e
