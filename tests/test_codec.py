from __future__ import annotations

import contextlib
import struct

import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncconn import codec
from asyncconn.exceptions import (
    CodecError,
    FrameCorrupt,
    FrameMismatch,
    FrameTooLarge,
    FrameTruncated,
    FrameVersionError,
    InvalidInput,
)

DTYPES = [
    torch.float32,
    torch.float16,
    torch.bfloat16,
    torch.float64,
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.int32,
    torch.int64,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    raw = torch.randint(0, 256, (int(torch.tensor(shape).prod()) * dtype.itemsize,), dtype=torch.uint8)
    if dtype == torch.bool:
        return (raw % 2).to(torch.bool).reshape(shape)
    return raw.view(dtype).reshape(shape)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().view(torch.uint8) if a.dim() else a.reshape(1).view(torch.uint8),
            b.contiguous().view(torch.uint8) if b.dim() else b.reshape(1).view(torch.uint8),
        )
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(), (0,), (7,), (3, 5), (2, 3, 4, 5)])
def test_roundtrip_every_dtype_and_shape(dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    t = _sample(dtype, shape)
    frame = codec.encode(t)
    assert len(frame) == codec.header_size(t.dim()) + t.numel() * t.element_size()
    assert _bits_equal(codec.decode(frame), t)


def test_noncontiguous_input_is_encoded_as_contiguous() -> None:
    t = torch.arange(24, dtype=torch.float32).reshape(4, 6).t()
    assert torch.equal(codec.decode(codec.encode(t)), t)


def test_decode_from_chunks_without_joining() -> None:
    t = torch.randn(1000)
    frame = codec.encode(t)
    chunks = [frame[i : i + 333] for i in range(0, len(frame), 333)]
    assert torch.equal(codec.decode(chunks), t)
    out = torch.empty(1000)
    codec.decode_into([memoryview(c) for c in chunks], out)
    assert torch.equal(out, t)


def test_decode_into_reshaped_view() -> None:
    t = torch.randn(4, 8)
    frame = codec.encode(t)
    out = torch.empty(32)
    h = codec.decode_into(frame, out)
    assert torch.equal(out.view(4, 8), t)
    assert h.payload_len == 128 and bytes(codec.tensor_bytes(out)) == t.numpy().tobytes()


def test_decode_into_mismatch_leaves_destination_untouched() -> None:
    frame = codec.encode(torch.randn(8))
    out = torch.full((8,), 7.0, dtype=torch.float16)
    with pytest.raises(FrameMismatch):
        codec.decode_into(frame, out)
    assert torch.all(out == 7)
    with pytest.raises(FrameMismatch):
        codec.decode_into(frame, torch.empty(9))


def test_every_single_truncation_is_an_error() -> None:
    frame = codec.encode(torch.randn(16))
    for cut in range(len(frame)):
        with pytest.raises(FrameTruncated):
            codec.decode(frame[:cut])


def test_every_single_bit_flip_is_detected() -> None:
    """A flipped bit anywhere -- header or payload -- is never decoded into a tensor."""
    t = torch.randn(6, dtype=torch.float16)
    frame = codec.encode(t)
    for pos in range(len(frame)):
        for bit in (0, 3, 7):
            bad = bytearray(frame)
            bad[pos] ^= 1 << bit
            with pytest.raises(CodecError):
                codec.decode(bytes(bad))


def test_dtype_swap_with_same_itemsize_is_caught() -> None:
    frame = bytearray(codec.encode(torch.randn(4, dtype=torch.float16)))
    frame[5] = 3  # float16 -> bfloat16 code: same item size, plausible tensor
    with pytest.raises(FrameCorrupt, match="checksum"):
        codec.decode(bytes(frame))


def test_wrong_version_magic_flags_and_trailing_bytes() -> None:
    frame = bytearray(codec.encode(torch.randn(2)))
    v = bytearray(frame)
    v[4] = 99
    with pytest.raises(FrameVersionError):
        codec.decode(bytes(v))
    with pytest.raises(FrameCorrupt, match="magic"):
        codec.decode(b"GIF89a" + bytes(frame[6:]))
    f = bytearray(frame)
    f[7] = 2  # bit 0 is FLAG_KEYED; the others are reserved
    with pytest.raises(FrameCorrupt, match="flags"):
        codec.decode(bytes(f))
    with pytest.raises(FrameCorrupt, match="trailing"):
        codec.decode(bytes(frame) + b"\0")


@pytest.mark.parametrize("ndim", range(codec.MAX_NDIM + 1))
def test_the_payload_starts_aligned_whatever_the_rank(ndim: int) -> None:
    """Why it matters: a direct read's kernel copy is up to ~4x slower when source and destination are
    misaligned (codec's docstring); destinations are 64-byte aligned, so payloads must be too."""
    t = _sample(torch.float16, (1,) * ndim)
    header, payload = codec.encode_parts(t)
    assert len(header) % codec.PAYLOAD_ALIGN == 0
    assert len(header) == codec.header_size(ndim) < codec.PAYLOAD_ALIGN + 8 * ndim + 24
    assert codec.parse_header(header + payload).header_len == len(header)
    assert _bits_equal(codec.decode([header, payload]), t)


def test_a_version_1_frame_and_a_nonzero_padding_are_refused() -> None:
    t = torch.randn(3, 4)  # rank 2: 40 bytes of fields, 16 of padding, 8 of checksum
    frame = codec.encode(t)
    payload = bytes(codec.tensor_bytes(t))
    fields = 16 + 8 * t.dim()
    # What version 1 wrote: no padding, and a checksum that is right for those bytes.
    v1_fields = b"ACNF" + bytes([1]) + frame[5:fields]
    v1 = v1_fields + struct.pack("<Q", xxhash.xxh3_64_intdigest(v1_fields + payload)) + payload
    with pytest.raises(FrameVersionError, match="version 1"):
        codec.decode(v1)
    padded = bytearray(frame)
    padded[fields] = 1
    with pytest.raises(FrameCorrupt, match="padding"):
        codec.decode(bytes(padded))
    with pytest.raises(FrameCorrupt, match="padding"):
        codec.parse_header(bytes(padded))


def test_oversized_declared_payload_is_refused_before_allocation() -> None:
    header = struct.pack("<4sBBBBQ", b"ACNF", codec.FORMAT_VERSION, 5, 1, 0, 1 << 50)
    header += struct.pack("<Q", 1 << 50)  # the shape
    header += bytes(codec.header_size(1) - len(header))  # padding and checksum
    with pytest.raises(FrameTooLarge):
        codec.decode(header)
    small = codec.encode(torch.zeros(1024, dtype=torch.uint8))
    with pytest.raises(FrameTooLarge):
        codec.decode(small, max_payload=100)


def test_foreign_values_are_codec_errors() -> None:
    for foreign in (b"", b"hello world", b"\x80\x04\x95" + b"\0" * 40, b"ACNF"):  # incl. a pickle prefix
        with pytest.raises(CodecError):
            codec.decode(foreign)


def test_unsupported_dtype_cannot_be_encoded() -> None:
    with pytest.raises(InvalidInput):
        codec.encode(torch.zeros(2, dtype=torch.complex64))


def test_frame_verifier_matches_decode() -> None:
    t = torch.randn(5, 7)
    frame = codec.encode(t)
    out = torch.empty(5, 7)
    for step in (1, 3, 17, 64, len(frame)):
        v = codec.FrameVerifier(out)
        for i in range(0, len(frame), step):
            v.feed(memoryview(frame)[i : i + step])
        assert v.finish().shape == (5, 7)
    bad = bytearray(frame)
    bad[-3] ^= 0x10
    v = codec.FrameVerifier(out)
    v.feed(memoryview(bytes(bad)))
    with pytest.raises(FrameCorrupt):
        v.finish()
    v = codec.FrameVerifier(out)
    v.feed(memoryview(frame)[:-1])
    with pytest.raises(FrameTruncated):
        v.finish()


@pytest.mark.parametrize("step", [1, 5, 17, 64, 100, 1 << 20])
def test_frame_verifier_takes_many_pieces_in_one_call_as_it_takes_them_one_by_one(step: int) -> None:
    """``feed_many`` (how ``file://`` hands a value read in place to its checker) accepts what ``feed``
    accepts, however the pieces cut the header, and rejects what it rejects."""
    t = torch.randn(9, 13)
    frame = codec.encode(t, key="k")
    out = torch.empty(9, 13)
    pieces = [memoryview(frame)[i : i + step] for i in range(0, len(frame), step)]
    v = codec.FrameVerifier(out, key="k")
    v.feed_many(pieces[:2])
    v.feed_many([])
    v.feed_many(pieces[2:])
    assert v.finish().shape == (9, 13)
    for damaged in (len(frame) - 5, 3):  # the payload, the header
        bad = bytearray(frame)
        bad[damaged] ^= 0x01
        v = codec.FrameVerifier(out, key="k")
        with contextlib.suppress(CodecError):  # a damaged header may already be refused while fed
            v.feed_many([memoryview(bytes(bad))[i : i + step] for i in range(0, len(bad), step)])
            v.finish()
            pytest.fail("a damaged frame was accepted")
    v = codec.FrameVerifier(out, key="k")
    v.feed_many(pieces)
    v.feed_many([memoryview(b"x")])
    with pytest.raises(FrameTruncated):  # more payload than the header promises
        v.finish()


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=256))
def test_fuzz_random_bytes_never_decode_silently(data: bytes) -> None:
    try:
        codec.decode(data)
    except CodecError:
        return
    # Random bytes decoding successfully would need a valid magic, header and 64-bit checksum.
    raise AssertionError("random bytes decoded")


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_mutated_frames_error_or_roundtrip(data: st.DataObject) -> None:
    t = torch.randn(data.draw(st.integers(0, 40)))
    frame = bytearray(codec.encode(t))
    n = data.draw(st.integers(1, 4))
    for _ in range(n):
        op = data.draw(st.sampled_from(["flip", "cut", "extend"]))
        if op == "flip" and frame:
            i = data.draw(st.integers(0, len(frame) - 1))
            frame[i] ^= data.draw(st.integers(1, 255))
        elif op == "cut":
            del frame[data.draw(st.integers(0, len(frame))) :]
        else:
            frame += data.draw(st.binary(min_size=1, max_size=8))
    try:
        out = codec.decode(bytes(frame))
    except CodecError:
        return
    assert torch.equal(out, t)  # only an untouched frame may decode


def test_a_frame_is_bound_to_its_key() -> None:
    """A valid frame moved to another key is corrupt there: a checksum alone cannot see that."""
    t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    frame = codec.encode(t, key="ec:img-a")
    assert frame[7] == codec.FLAG_KEYED
    assert torch.equal(codec.decode(frame, key="ec:img-a"), t)
    assert torch.equal(codec.decode(frame, key=b"ec:img-a"), t)  # str and bytes keys agree
    with pytest.raises(FrameCorrupt, match="another key"):
        codec.decode(frame, key="ec:img-b")
    out = torch.full((3, 4), -1.0)
    with pytest.raises(FrameCorrupt, match="another key"):
        codec.decode_into(frame, out, key="ec:img-b")
    assert torch.equal(out, torch.full((3, 4), -1.0))  # untouched on error
    with pytest.raises(FrameMismatch, match="bound to a key"):
        codec.decode(frame)
    unbound = codec.encode(t)
    with pytest.raises(FrameCorrupt, match="not bound"):
        codec.decode(unbound, key="ec:img-a")


def _verify_split(header: bytes, payload: memoryview, out: torch.Tensor, key: str) -> codec.FrameHeader:
    """A frame read in two pieces, the header and the payload already in ``out``'s memory (a direct read)."""
    verifier = codec.FrameVerifier(out, key=key)
    verifier.feed(memoryview(header))
    verifier.feed(payload)
    return verifier.finish()


def test_verifier_checks_the_key_binding() -> None:
    t = torch.randn(64)
    header, payload = codec.encode_parts(t, key="k1")
    out = torch.empty(64)
    assert _verify_split(header, payload, out, key="k1").shape == (64,)
    with pytest.raises(FrameCorrupt):
        _verify_split(header, payload, out, key="k2")
    dest = torch.empty(64)
    with pytest.raises(FrameCorrupt):
        codec.decode_into(header + payload.tobytes(), dest, key="k2")
    assert codec.decode_into(header + payload.tobytes(), dest, key="k1").payload_len == 256


def test_the_frame_verifier_is_a_verifying_sink() -> None:
    """Backends may skip their own integrity pass for it (``asyncconn.backend.sink_verifies``)."""
    from asyncconn.backend import sink_verifies

    t = torch.randn(16)
    header, payload = codec.encode_parts(t, key="k")
    verifier = codec.FrameVerifier(torch.empty(16), key="k")
    assert sink_verifies(verifier) and not sink_verifies(lambda piece: None) and not sink_verifies(None)
    verifier(memoryview(header))
    verifier(payload)
    assert verifier.finish().shape == (16,)
