"""Tests of fastckpt.storage.codec: bit-exact round trips for every width and odd size, on the C
and the pure-Python grouping kernels (same bytes), on threads; damaged frames and crafted
descriptions raise CodecError naming the frame and its offset, without allocating what a
crafted header declares."""

from __future__ import annotations

import array
import random
import struct
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

zstandard = pytest.importorskip("zstandard")

from fastckpt.errors import CorruptCheckpointError  # noqa: E402
from fastckpt.manifest.schema import DTYPES  # noqa: E402
from fastckpt.storage import codec as C  # noqa: E402
from fastckpt.storage import native as _native  # noqa: E402

KiB, MiB = 1 << 10, 1 << 20
BLOCK = C.MIN_BLOCK  # small blocks: many blocks in little data


@pytest.fixture(params=["require", "off"])
def native(request):
    if request.param == "require" and _native.byte_regroup_kernels() is None:
        pytest.skip(f"native grouping kernels not built: {_native.native_error()}")
    return request.param


def weights(n: int, dtype: torch.dtype, seed: int = 0) -> bytes:
    """n elements like a layer's weights (normal, std 0.02), as raw bytes."""
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point or dtype.is_complex:
        t = (torch.randn(n, generator=g, dtype=torch.float64) * 0.02).to(dtype)
    elif dtype == torch.bool:
        t = torch.rand(n, generator=g) < 0.3
    else:
        t = torch.randint(0, 1000, (n,), generator=g).to(dtype)
    return t.view(torch.uint8).numpy().tobytes() if n else b""


def roundtrip(raw, width, native="auto", **kw):
    enc = C.encode(raw, width=width, native=native, **kw)
    stored = enc.tobytes()
    assert len(stored) == enc.nbytes == sum(enc.desc["frames"])
    C.validate_desc(enc.desc, len(memoryview(raw).cast("B")), len(stored))
    out = bytearray(len(memoryview(raw).cast("B")))
    C.decode_into(stored, enc.desc, out, native=native, threads=kw.get("threads", 1))
    assert bytes(out) == bytes(memoryview(raw).cast("B"))
    return enc, stored


# --------------------------------------------------------------------------------------------
# dtypes and kernels
# --------------------------------------------------------------------------------------------


def test_group_width_covers_every_manifest_dtype():
    for name, size in DTYPES.items():
        w = C.group_width(name)
        assert w in C.GROUP_WIDTHS and size % w == 0, name
    assert [C.group_width(n) for n in ("bfloat16", "float16", "float32", "float64")] == [2, 2, 4, 8]
    assert [C.group_width(n) for n in ("int64", "uint8", "bool", "float8_e4m3fn")] == [1] * 4
    assert C.group_width("complex64") == 4
    with pytest.raises(ValueError, match="unknown dtype"):
        C.group_width("float128")


@pytest.mark.parametrize("width", [1, 2, 4, 8])
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4096, 100_003])
def test_c_and_python_kernels_give_the_same_bytes(width, n):
    ks = _native.byte_regroup_kernels()
    if ks is None:
        pytest.skip(f"native grouping kernels not built: {_native.native_error()}")
    src = random.Random(n * 10 + width).randbytes(n)
    c_out, py_out = bytearray(n), bytearray(n)
    ks[0](src, c_out, width)
    C._py_group(src, py_out, width)
    assert c_out == py_out
    m = n // width
    if m:  # plane k holds byte k of every element; the tail stays last
        assert c_out[:m] == src[0:m * width:width] and c_out[m * width:] == src[m * width:]
    for ungroup in (ks[1], C._py_ungroup):
        back = bytearray(n)
        ungroup(bytes(c_out), back, width)
        assert back == src
    back = memoryview(bytearray(n + 5))  # not a bytearray, longer than needed
    C._py_ungroup(c_out, back, width)
    assert back[:n] == src


def test_c_kernels_check_their_arguments():
    ks = _native.byte_regroup_kernels()
    if ks is None:
        pytest.skip(f"native grouping kernels not built: {_native.native_error()}")
    buf = bytearray(64)
    with pytest.raises(ValueError, match="shorter"):
        ks[0](bytes(64), bytearray(63), 2)
    with pytest.raises(ValueError, match="overlap"):
        ks[0](memoryview(buf)[:32], memoryview(buf)[16:48], 2)
    with pytest.raises(ValueError, match="width"):
        ks[1](bytes(8), bytearray(8), 0)
    with pytest.raises(BufferError):
        ks[0](bytes(8), bytes(8), 2)  # read-only destination


def test_native_require_without_the_kernels(monkeypatch):
    monkeypatch.setattr(_native, "byte_regroup_kernels", lambda: None)
    with pytest.raises(ImportError, match="rebuild"):
        C.encode(b"\0" * 64, width=2, native="require")
    roundtrip(weights(1000, torch.bfloat16), 2, native="auto")  # falls back to Python
    with pytest.raises(ValueError, match="native must be"):
        C.encode(b"", width=1, native="on")


# --------------------------------------------------------------------------------------------
# round trips
# --------------------------------------------------------------------------------------------

DTS = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.complex64, torch.int64,
       torch.int32, torch.uint8, torch.bool]


@pytest.mark.parametrize("dtype", DTS, ids=str)
@pytest.mark.parametrize("nbytes", [0, "one", BLOCK, BLOCK + 8, 5 * BLOCK + 24], ids=str)
def test_roundtrip_bit_exact(dtype, nbytes, native):
    isz = torch.empty(0, dtype=dtype).element_size()
    n = 1 if nbytes == "one" else nbytes // isz
    raw = weights(n, dtype)
    width = C.group_width(str(dtype).removeprefix("torch."))
    enc, _ = roundtrip(raw, width, native=native, block=BLOCK)
    nblocks = -(-len(raw) // BLOCK)
    assert len(enc.desc["frames"]) == nblocks * width
    assert enc.desc["group"] == width and enc.desc["block"] == BLOCK


@pytest.mark.parametrize("width", [2, 4, 8])
@pytest.mark.parametrize("n", [1, 3, BLOCK + 3, 3 * BLOCK - 1])
def test_sizes_not_a_multiple_of_the_width(width, n, native):
    """Odd sizes (not from a tensor, but any bytes must survive): the tail rides in the last
    frame."""
    raw = random.Random(n).randbytes(n)
    roundtrip(raw, width, native=native, block=BLOCK)


@pytest.mark.parametrize("threads", [2, 3])
def test_threads_give_the_same_frames(threads, native):
    raw = weights(5 * BLOCK // 2 + 7, torch.bfloat16)
    one = C.encode(raw, width=2, block=BLOCK, native=native)
    many, _ = roundtrip(raw, 2, native=native, block=BLOCK, threads=threads)
    assert many.frames == one.frames and many.desc == one.desc
    with ThreadPoolExecutor(2) as ex:  # a caller's long-lived pool
        again = C.encode(raw, width=2, block=BLOCK, executor=ex, native=native)
        assert again.frames == one.frames
        out = bytearray(len(raw))
        C.decode_into(again.tobytes(), again.desc, out, executor=ex, threads=2, native=native)
        assert out == raw


def test_concurrent_callers():
    """Per-thread contexts and scratch: callers on several threads do not disturb each other."""
    datas = [weights(3 * BLOCK // 4, dt, seed=i) for i, dt in
             enumerate([torch.bfloat16, torch.float32, torch.int64, torch.float64] * 2)]
    widths = [2, 4, 1, 8] * 2
    errors = []

    def work(i):
        try:
            for _ in range(3):
                roundtrip(datas[i], widths[i], block=BLOCK)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)
    ts = [threading.Thread(target=work, args=(i,)) for i in range(len(datas))]
    [t.start() for t in ts]
    [t.join() for t in ts]
    assert not errors, errors


def test_grouped_and_ungrouped_both_decode_and_grouping_pays():
    raw = weights(MiB // 2, torch.bfloat16)  # 1 MiB, planes of 512 KiB: probes and raw frames
    flat, _ = roundtrip(raw, 1)
    grouped, stored = roundtrip(raw, 2)
    assert grouped.ratio > 1.3 > flat.ratio > 1.05
    # the mantissa plane went out raw (no compressor run), the exponent plane compressed
    lo, hi = grouped.desc["frames"]
    assert len(raw) // 2 < lo < len(raw) // 2 + 128 and hi < 0.5 * len(raw) // 2
    # every frame is a standard zstd frame: the stream decodes to the grouped bytes
    plain = zstandard.ZstdDecompressor().stream_reader(stored, read_across_frames=True).read()
    expect = bytearray(len(raw))
    C._py_group(raw, expect, 2)
    assert plain == expect


def test_any_buffer_in_and_out(native):
    t = torch.randn(3, 5000, dtype=torch.float32)
    src = memoryview(t.numpy())  # 2-D, format 'f'
    enc = C.encode(src, width=4, block=BLOCK, native=native)
    assert enc.raw_nbytes == t.numel() * 4
    dst = torch.empty_like(t)
    C.decode_into(memoryview(enc.tobytes()), enc.desc, memoryview(dst.numpy()), native=native)
    assert torch.equal(dst, t)
    a = array.array("d", [0.5, -1.25, 3.0])
    roundtrip(a, 8, native=native)
    with pytest.raises(ValueError, match="writable"):
        C.decode_into(enc.tobytes(), enc.desc, bytes(enc.raw_nbytes))
    with pytest.raises(ValueError, match="contiguous"):
        C.encode(memoryview(t.numpy()[:, ::2]), width=4)


def test_checksum_option():
    raw = weights(MiB // 2, torch.bfloat16)
    enc, stored = roundtrip(raw, 2, checksum=True)
    assert enc.desc["checksum"] is True
    assert all(zstandard.get_frame_parameters(f).has_checksum for f in enc.frames)
    # a flipped byte in the raw mantissa plane: only the content checksum can see it here
    bad = bytearray(stored)
    bad[1000] ^= 0x10
    with pytest.raises(C.CodecError, match="frame 0 of 2 at stored byte 0"):
        C.decode_into(bad, enc.desc, bytearray(len(raw)))
    # a description that does not match the frames' checksum flags
    with pytest.raises(C.CodecError, match="checksum"):
        C.decode_into(stored, dict(enc.desc, checksum=False), bytearray(len(raw)))


def test_iter_encode_and_partial_decode(native):
    raw = weights(7 * BLOCK // 4 + 3, torch.float32)
    frames = list(C.iter_encode(raw, width=4, block=BLOCK, native=native))
    desc = C.make_desc([len(f) for f in frames], width=4, block=BLOCK)
    assert desc == C.encode(raw, width=4, block=BLOCK).desc
    stored = b"".join(frames)
    spans = C.frame_spans(desc, len(raw))
    assert [s[3] for s in spans] == list(range(0, len(raw), BLOCK))
    for b, (first, spos, slen, roff, rlen) in enumerate(spans):
        assert first == 4 * b
        out = bytearray(rlen)
        C.decode_block_into(stored[spos:spos + slen], desc, len(raw), b, out,
                            stored_offset=spos, native=native)
        assert out == raw[roff:roff + rlen]


def test_encode_arguments_are_checked():
    for kw, msg in [({"width": 3}, "width"), ({"width": 2, "level": 99}, "level"),
                    ({"width": 2, "block": 1000}, "block"), ({"width": 2, "block": 1 << 40}, "block"),
                    ({"width": 2, "threads": 0}, "threads")]:
        with pytest.raises(ValueError, match=msg):
            C.encode(b"\0" * 16, **kw)


# --------------------------------------------------------------------------------------------
# damaged input
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chunk():
    """A 3-block bf16 chunk: (raw, desc, stored)."""
    raw = weights(3 * BLOCK // 2 - 5, torch.bfloat16)
    enc = C.encode(raw, width=2, block=BLOCK)
    return raw, enc.desc, enc.tobytes()


def offsets(desc):
    out, pos = [], 0
    for f in desc["frames"]:
        out.append(pos)
        pos += f
    return out


def decode(stored, desc, n, **kw):
    C.decode_into(stored, desc, bytearray(n), **kw)


def test_error_is_a_corrupt_checkpoint_error_naming_frame_and_offsets(chunk):
    raw, desc, stored = chunk
    bad = bytearray(stored)
    i = 3
    off = offsets(desc)[i]
    bad[off] ^= 0xFF  # the magic number of frame 3
    with pytest.raises(C.CodecError) as ei:
        decode(bad, desc, len(raw), file="r00000-x-000.fck", key="w", offset=8192)
    e = ei.value
    assert isinstance(e, CorruptCheckpointError) and isinstance(e, ValueError)
    assert (e.frame, e.frame_offset, e.offset) == (i, off, 8192 + off)
    msg = str(e)
    assert f"frame {i} of 6 at stored byte {off}" in msg and "r00000-x-000.fck" in msg
    assert f"offset {8192 + off}" in msg and "'w'" in msg


def test_flipped_byte_in_a_compressed_frame(chunk):
    raw, desc, stored = chunk
    i = 1  # block 0's exponent plane, Huffman-coded
    off = offsets(desc)[i]
    hdr = zstandard.frame_header_size(stored[off:])
    bad = bytearray(stored)
    bad[off + hdr + 2] ^= 0xFF  # the first block header's size bits
    with pytest.raises(C.CodecError, match=f"frame {i} of 6 at stored byte {off}.*does not decode"):
        decode(bad, desc, len(raw))


def test_truncated_frame(chunk):
    raw, desc, stored = chunk
    i = 3
    off = offsets(desc)[i]
    frames = list(desc["frames"])
    frames[i] -= 7
    cut = stored[:off + frames[i]] + stored[off + desc["frames"][i]:]
    with pytest.raises(C.CodecError, match=f"frame {i} of 6 at stored byte {off}"):
        decode(cut, dict(desc, frames=frames), len(raw))
    # the stored chunk itself cut short: the description no longer adds up
    with pytest.raises(C.CodecError, match="frames sum to"):
        decode(stored[:-1], desc, len(raw))


def test_frames_that_do_not_sum_to_the_stored_size(chunk):
    raw, desc, stored = chunk
    frames = list(desc["frames"])
    frames[0] += 1
    with pytest.raises(C.CodecError, match=f"frames sum to {len(stored) + 1}"):
        decode(stored, dict(desc, frames=frames), len(raw))
    # one frame's length moved to its neighbour: sums match, frame boundaries do not
    frames = list(desc["frames"])
    frames[0] += 16
    frames[1] -= 16
    with pytest.raises(C.CodecError, match="frame [01] of 6"):
        decode(stored, dict(desc, frames=frames), len(raw))


def splice(stored, desc, i, frame):
    """``stored`` with frame i replaced by ``frame``, and the matching description."""
    off = offsets(desc)[i]
    frames = list(desc["frames"])
    new = stored[:off] + frame + stored[off + frames[i]:]
    frames[i] = len(frame)
    return new, dict(desc, frames=frames)


def test_frame_of_another_size(chunk):
    raw, desc, stored = chunk
    n = BLOCK // 2  # plane size of a full bf16 block
    for size in (n - 1, n + 1):
        frame = zstandard.ZstdCompressor().compress(bytes(size))
        bad, bdesc = splice(stored, desc, 2, frame)
        with pytest.raises(C.CodecError, match=f"frame 2 of 6.*declares {size} raw bytes, its "
                                               f"place holds {n}"):
            decode(bad, bdesc, len(raw))
    # a header that declares the right size over blocks holding one byte less / more
    for size in (n - 1, n + 1):
        body = C._raw_frame(memoryview(bytes(size)), False)
        frame = body[:5] + struct.pack("<Q", n) + body[13:]
        bad, bdesc = splice(stored, desc, 2, frame)
        with pytest.raises(C.CodecError, match="frame 2 of 6.*does not decode"):
            decode(bad, bdesc, len(raw))
    # a frame without a content size
    frame = zstandard.ZstdCompressor(write_content_size=False).compress(bytes(n))
    bad, bdesc = splice(stored, desc, 2, frame)
    with pytest.raises(C.CodecError, match="declares unknown raw bytes"):
        decode(bad, bdesc, len(raw))
    # bytes after the frame's end inside its declared length
    bad, bdesc = splice(stored, desc, 2, C._raw_frame(memoryview(bytes(n)), False) + b"\0")
    with pytest.raises(C.CodecError, match="frame 2 of 6.*does not decode"):
        decode(bad, bdesc, len(raw))


def test_absurd_declared_size_is_not_allocated(chunk):
    raw, desc, stored = chunk
    import tracemalloc
    frame = struct.pack("<IBQ", 0xFD2FB528, 0xE0, 1 << 50) + b"\x01\x00\x00"
    bad, bdesc = splice(stored, desc, 0, frame)
    tracemalloc.start()
    try:
        with pytest.raises(C.CodecError, match=f"frame 0 of 6.*declares {1 << 50} raw bytes"):
            decode(bad, bdesc, len(raw))
        assert tracemalloc.get_traced_memory()[1] < 16 * MiB
    finally:
        tracemalloc.stop()
    # a description declaring huge blocks or a destination of absurd size: refused up front
    with pytest.raises(C.CodecError, match="block"):
        C.validate_desc(dict(desc, block=1 << 40), len(raw), len(stored))
    with pytest.raises(C.CodecError, match="frames for"):
        C.validate_desc(desc, 1 << 50, len(stored))


def test_unknown_codec(chunk):
    raw, desc, stored = chunk
    with pytest.raises(C.CodecError, match="unknown codec 'lz4'"):
        decode(stored, dict(desc, codec="lz4"), len(raw))


def test_destination_of_the_wrong_size(chunk):
    raw, desc, stored = chunk
    with pytest.raises(C.CodecError, match="frames for"):
        decode(stored, desc, len(raw) + BLOCK)
    with pytest.raises(C.CodecError):
        decode(stored, desc, len(raw) - 1)


def test_errors_on_threads_are_the_first_bad_frame(chunk):
    raw, desc, stored = chunk
    bad = bytearray(stored)
    for i in (2, 4):
        bad[offsets(desc)[i]] ^= 0xFF
    with pytest.raises(C.CodecError, match="frame 2 of 6"):
        decode(bad, desc, len(raw), threads=3)


# --------------------------------------------------------------------------------------------
# description validation
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("change, msg", [
    (lambda d: [], "not an object"),
    (lambda d: dict(d, extra=1), "unknown field"),
    (lambda d: {k: v for k, v in d.items() if k != "codec"}, "unknown codec None"),
    (lambda d: dict(d, group=3), "group 3"),
    (lambda d: dict(d, group=True), "group True"),
    (lambda d: dict(d, group="2"), "group '2'"),
    (lambda d: dict(d, block=BLOCK + 1), "block"),
    (lambda d: dict(d, block=1024), "block"),
    (lambda d: dict(d, block=float(BLOCK)), "block"),
    (lambda d: dict(d, frames="12,13"), "not a list"),
    (lambda d: dict(d, frames=d["frames"][:-1]), "5 frames"),
    (lambda d: dict(d, frames=d["frames"] + [9]), "7 frames"),
    (lambda d: dict(d, frames=[-1] + d["frames"][1:]), "frame 0 .*length -1"),
    (lambda d: dict(d, frames=[True] + d["frames"][1:]), "frame 0 .*length True"),
    (lambda d: dict(d, frames=d["frames"][:2] + [1 << 40] + d["frames"][3:]), "frame 2 .*impossible"),
    (lambda d: dict(d, frames=d["frames"][:5] + [3.5]), "frame 5"),
    (lambda d: dict(d, checksum="yes"), "checksum"),
    (lambda d: dict(d, level=100), "level"),
])
def test_validate_desc_rejects_crafted_descriptions(chunk, change, msg):
    raw, desc, stored = chunk
    C.validate_desc(desc, len(raw), len(stored))
    with pytest.raises(C.CodecError, match=msg):
        C.validate_desc(change(dict(desc)), len(raw), len(stored), file="f.fck")


def test_validate_desc_sizes_and_empty_chunk():
    d = C.make_desc([], width=2)
    assert C.validate_desc(d, 0, 0) is d
    for raw, stored in [(-1, 0), (0, -1), (True, 0), (0, 1.0)]:
        with pytest.raises(C.CodecError, match="sizes"):
            C.validate_desc(d, raw, stored)
    with pytest.raises(C.CodecError, match="frames sum to 0"):
        C.validate_desc(d, 0, 5)


# --------------------------------------------------------------------------------------------
# compression="auto"
# --------------------------------------------------------------------------------------------


def test_measure_and_decision(native):
    raw = weights(3 * MiB // 2, torch.bfloat16)  # 3 MiB
    m = C.measure(raw, 2, native=native, max_sample=MiB)
    assert m["sample_nbytes"] == MiB and m["ratio"] > 1.3
    assert m["bytes_per_s"] > 0 and m["decode_bytes_per_s"] > 0
    noise = C.measure(random.Random(0).randbytes(MiB), 1, native=native)
    assert 0.99 < noise["ratio"] < 1.01
    assert C.should_compress(m, write_bytes_per_s=m["bytes_per_s"] / 4)
    assert not C.should_compress(m, write_bytes_per_s=m["bytes_per_s"] * 4)
    assert C.should_compress(m, write_bytes_per_s=m["bytes_per_s"] * 1.5, threads=2)
    assert not C.should_compress(noise, write_bytes_per_s=1.0)
    assert C.measure(b"", 2)["ratio"] == 1.0
