"""``IOBackend.read_to``: a file region straight into raw destination memory (a restart load's
freshly allocated tensors), O_DIRECT for every page when the destination is in phase with the
file (the partial first and last pages through bounce pages), each block hashed as it lands.
Every byte lands where it belongs and no byte outside the destination is written."""

from __future__ import annotations

import os

import pytest
import torch
import xxhash

from fastckpt.storage import native as _native
from fastckpt.storage.pyio import PythonBackend

PAGE = 4096


@pytest.fixture(params=["python", "native"])
def backend(request):
    if request.param == "native":
        if not _native.native_available():
            pytest.skip("native extension not built")
        return _native.NativeBackend(block_size=64 << 10, depth=4)  # many blocks per read
    return PythonBackend(block_size=64 << 10, depth=4)


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    data = os.urandom(3 * (1 << 20) + 1234)
    path = tmp_path_factory.mktemp("rt") / "shard.bin"
    path.write_bytes(data)
    return str(path), data


def _dest(nbytes: int, phase: int, guard: int = 2 * PAGE):
    """A destination of ``nbytes`` at ``phase`` modulo 4096 with ``guard`` bytes of 0xA5 on each
    side (inside the same allocation): (raw tensor, offset of the destination in it)."""
    raw = torch.full((nbytes + 2 * guard + PAGE,), 0xA5, dtype=torch.uint8)
    skip = guard + (phase - raw.data_ptr() - guard) % PAGE
    return raw, skip


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("offset,nbytes", [
    (0, 3 << 20), (PAGE, 1 << 20), (123, 1 << 20), (PAGE - 1, 300000), (5000, 64 << 10),
    (70000, 2 * PAGE), (4000, 200), (8191, 2), (0, 1), (100, 0), ((3 << 20) + 1000, 234),
    (1, (3 << 20) + 1233),
])
def test_read_to_lands_exactly(backend, data_file, offset, nbytes, direct):
    path, data = data_file
    for phase in {offset % PAGE, (offset + 512) % PAGE}:  # in phase (O_DIRECT) and not
        raw, skip = _dest(nbytes, phase)
        addr = raw.data_ptr() + skip
        h = backend.read_to(path, offset, addr, nbytes, direct=direct)
        got = raw.numpy().tobytes()
        assert got[skip:skip + nbytes] == data[offset:offset + nbytes]
        assert h == xxhash.xxh3_64_intdigest(data[offset:offset + nbytes])
        assert set(got[:skip]) <= {0xA5} and set(got[skip + nbytes:]) <= {0xA5}, \
            "a byte outside the destination was written"
        raw2, skip2 = _dest(nbytes, phase)
        assert backend.read_to(path, offset, raw2.data_ptr() + skip2, nbytes, direct=direct,
                               hash=False) is None
        assert raw2.numpy().tobytes()[skip2:skip2 + nbytes] == data[offset:offset + nbytes]


def test_read_to_past_the_end(backend, data_file):
    path, data = data_file
    n = len(data)
    raw, skip = _dest(PAGE * 3, (n - 1000) % PAGE)
    with pytest.raises(EOFError, match="shard.bin"):
        backend.read_to(path, n - 1000, raw.data_ptr() + skip, 1001)
    # the last bytes exactly, with the file ending inside the tail page: fine
    assert backend.read_to(path, n - 1000, raw.data_ptr() + skip, 1000) == \
        xxhash.xxh3_64_intdigest(data[-1000:])


def test_read_to_refuses_what_is_not_a_regular_file(backend, tmp_path):
    os.mkfifo(tmp_path / "fifo")
    raw, skip = _dest(PAGE, 0)
    with pytest.raises(OSError):
        backend.read_to(str(tmp_path / "fifo"), 0, raw.data_ptr() + skip, 10)
    with pytest.raises(FileNotFoundError):
        backend.read_to(str(tmp_path / "missing"), 0, raw.data_ptr() + skip, 10)
    with pytest.raises(ValueError):
        backend.read_to(str(tmp_path / "missing"), -1, raw.data_ptr() + skip, 10)


def test_read_to_fresh_memory_matches_python(data_file):
    """Into memory never touched before (as a restart's optimizer moments): both backends."""
    if not _native.native_available():
        pytest.skip("native extension not built")
    path, data = data_file
    n = (3 << 20) - 777
    out = []
    for be in (_native.NativeBackend(), PythonBackend()):
        raw = torch.empty(n + PAGE, dtype=torch.uint8)
        skip = (777 - raw.data_ptr()) % PAGE
        out.append((be.read_to(path, 777, raw.data_ptr() + skip, n),
                    raw[skip:skip + n].numpy().tobytes()))
    assert out[0] == out[1] and out[0][1] == data[777:777 + n]
