"""Fuzzing the two parsers that read bytes from outside: the tensor codec and the lookup wire protocol.

What ``tests/test_codec.py`` and ``tests/lookup/test_protocol.py`` already fuzz (random bytes and
mutated frames through ``decode``; random frames through ``parse_body``) is not repeated. Added here:
frames with a *valid* magic and version but arbitrary header fields (random bytes almost never get past
the magic, so they never reach the header parser); ``decode_into`` /
``FrameVerifier`` (fed chunk by chunk, or split as a direct read lands a frame) on mutated frames cut
into random chunks, each checked against
``decode`` (every reader must accept exactly the same frames, and an accepted frame is bit-exact);
structured protocol bodies (right frame widths, adversarial key blobs); and the running server over a
real socket fed random multipart messages, which must answer each well-enveloped one, never fail a
batch, and still answer a valid request correctly afterwards.

The contract checked everywhere: no crash, no hang, and either a correct result or one of asyncconn's own
exceptions (:class:`CodecError`, :class:`LookupProtocolError`) / an ``ERROR`` reply.

Run as a script with atheris on the path (``PYTHONPATH=<atheris site> python tests/test_fuzz.py codec
-atheris_runs=N``) for coverage-guided fuzzing of the same two targets; see docs/reliability.md.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
import struct
import sys
from collections.abc import Iterator

import pytest
import torch
import zmq
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from asyncconn import codec
from asyncconn.exceptions import CodecError, LookupProtocolError
from asyncconn.lookup import LookupServer, protocol, store_key
from asyncconn.lookup.protocol import Kind, encode_mooncake_lookup
from asyncconn.runtime import Runtime
from asyncconn.store import TensorStore
from tests.lookup.fakes import wait_until

# Thousands of generated inputs per test: the slowest part of the suite that needs no server.
pytestmark = pytest.mark.slow

_FIXED = struct.Struct("<4sBBBBQ")  # magic, version, dtype code, ndim, flags, payload length
# The suite runs a quarter of each test's full count (the whole suite must stay well under 15 minutes);
# ASYNCCONN_FUZZ_SCALE=1 (or more) runs the full counts.
SCALE = float(os.environ.get("ASYNCCONN_FUZZ_SCALE", "0.25"))


def examples(full: int) -> int:
    return max(100, int(full * SCALE))


FAST = settings(max_examples=examples(4000), deadline=None, suppress_health_check=[HealthCheck.too_slow])


# -- codec ----------------------------------------------------------------------------------------------
def _reference(data: bytes) -> torch.Tensor | None:
    try:
        return codec.decode(data)
    except CodecError:
        return None


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges)]


def _bits(t: torch.Tensor) -> bytes:
    return bytes(codec.tensor_bytes(t))


@st.composite
def header_fields(draw: st.DrawFn) -> bytes:
    """A frame whose magic and version are right and whose other header fields are anything."""
    dtype_code = draw(st.one_of(st.integers(1, 12), st.integers(0, 255)))
    ndim = draw(st.one_of(st.integers(0, 4), st.integers(0, 255)))
    flags = draw(st.one_of(st.just(0), st.integers(0, 255)))
    payload_len = draw(st.one_of(st.integers(0, 64), st.integers(0, 2**64 - 1)))
    dims = draw(st.lists(st.one_of(st.integers(0, 8), st.integers(0, 2**64 - 1)), max_size=min(ndim, 6)))
    body = _FIXED.pack(codec.MAGIC, codec.FORMAT_VERSION, dtype_code, ndim, flags, payload_len)
    body += b"".join(struct.pack("<Q", d) for d in dims)
    body += draw(st.binary(max_size=48))  # checksum and payload, mostly wrong
    return body


@FAST
@given(header_fields())
def test_fuzz_adversarial_headers_error_cleanly(frame: bytes) -> None:
    for call in (
        lambda: codec.decode(frame),
        lambda: codec.parse_header(frame),
        lambda: codec.decode(frame, max_payload=1 << 10),
    ):
        try:
            call()
        except CodecError:
            pass


@st.composite
def mutated_frames(draw: st.DrawFn) -> tuple[torch.Tensor, bytes]:
    dtype = draw(st.sampled_from([torch.float32, torch.float16, torch.uint8, torch.int64, torch.bool]))
    shape = draw(st.lists(st.integers(0, 5), max_size=3))
    t = torch.zeros(shape, dtype=torch.uint8).random_(0, 2 if dtype == torch.bool else 256).to(dtype)
    frame = bytearray(codec.encode(t))
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.sampled_from(["flip", "cut", "extend", "splice"]))
        if op == "flip" and frame:
            frame[draw(st.integers(0, len(frame) - 1))] ^= draw(st.integers(1, 255))
        elif op == "cut":
            del frame[draw(st.integers(0, len(frame))) :]
        elif op == "extend":
            frame += draw(st.binary(min_size=1, max_size=8))
        else:
            at = draw(st.integers(0, len(frame)))
            frame[at:at] = draw(st.binary(min_size=1, max_size=8))
    return t, bytes(frame)


@pytest.mark.parametrize("dtype", [torch.float32, torch.uint8])
def test_encode_of_an_empty_multidim_tensor(dtype: torch.dtype) -> None:
    """Found by this fuzzer: ``encode`` of a (0, 3)/(2, 0) numpy-dtype tensor raised a bare TypeError
    (``memoryview(ndarray).cast("B")`` refuses a shape holding a zero); fixed in ``codec._as_bytes_view``."""
    t = torch.empty(2, 0, dtype=dtype)
    assert codec.decode(codec.encode(t)).shape == (2, 0)


@FAST
@given(mutated_frames(), st.lists(st.integers(0, 10_000), max_size=6))
def test_fuzz_every_reader_agrees_with_decode(sample: tuple[torch.Tensor, bytes], cuts: list[int]) -> None:
    t, frame = sample
    ref = _reference(frame)
    event("intact" if ref is not None else "rejected")
    chunks = _split(frame, cuts)
    chunked = _reference_chunks(chunks)
    assert (ref is None) == (chunked is None)
    if ref is not None:
        assert chunked is not None and _bits(ref) == _bits(chunked) == _bits(t)  # only an intact frame
    # decode_into: the source tensor's dtype/shape as destination (what a loader passes)
    out = torch.empty_like(t)
    try:
        codec.decode_into(chunks, out)
        ok_into = True
    except CodecError:
        ok_into = False
    assert ok_into == (ref is not None)
    if ok_into:
        assert _bits(out) == _bits(t)
    # FrameVerifier fed the same pieces, as a reader landing bytes in memory would
    verifier = codec.FrameVerifier(torch.empty_like(t))
    try:
        for piece in chunks:
            verifier.feed(memoryview(piece))
        verifier.finish()
        ok_verify = True
    except CodecError:
        ok_verify = False
    assert ok_verify == (ref is not None)


def _reference_chunks(chunks: list[bytes]) -> torch.Tensor | None:
    try:
        return codec.decode(chunks)
    except CodecError:
        return None


def _verify_split(head: bytes, payload: memoryview, out: torch.Tensor) -> None:
    """The header, then the payload already in ``out``'s memory: how a direct read feeds its verifier."""
    verifier = codec.FrameVerifier(out)
    verifier.feed(memoryview(head))
    verifier.feed(payload)
    verifier.finish()


@FAST
@given(mutated_frames(), st.integers(0, 200))
def test_fuzz_verify_split_at_any_boundary(sample: tuple[torch.Tensor, bytes], at: int) -> None:
    t, frame = sample
    head_len = codec.header_size(t.dim())
    head, payload = frame[:head_len], bytearray(frame[head_len:])
    out = torch.empty_like(t)
    try:
        _verify_split(head, memoryview(payload), out)
        ok = True
    except CodecError:
        ok = False
    assert ok == (_reference(frame) is not None)
    try:  # a split at an arbitrary point is still either a clean accept of the same frame or an error
        cut = at % (len(frame) + 1)
        _verify_split(frame[:cut], memoryview(bytearray(frame[cut:])), out)
    except CodecError:
        pass


@FAST
@given(st.binary(max_size=128), st.lists(st.integers(0, 200), max_size=4))
def test_fuzz_frame_verifier_random_pieces(data: bytes, cuts: list[int]) -> None:
    for dest in (torch.empty(0), torch.empty(4), torch.empty(3, 2, dtype=torch.int64)):
        verifier = codec.FrameVerifier(dest)
        try:
            for piece in _split(data, cuts):
                verifier.feed(memoryview(piece))
            verifier.finish()
        except CodecError:
            continue
        raise AssertionError("random bytes were accepted as a frame")


# -- protocol functions -----------------------------------------------------------------------------------
def _u16(n: int) -> bytes:
    return struct.pack(">H", n)


def _u32(n: int) -> bytes:
    return struct.pack(">I", n)


@st.composite
def structured_bodies(draw: st.DrawFn) -> list[bytes]:
    """Bodies with the right tags and (mostly) the right field widths, so the deep checks are reached."""
    tag = draw(st.sampled_from([b"lookup", b"prefix", b"exists", b"reset", b"lookupX", b""]))
    enc = draw(st.sampled_from([b"x", b"x", b"t", b"t", b"?", b""]))
    mode = draw(st.sampled_from(["fixed", "honest", "lying", "random"]))
    size = draw(st.integers(1, 40)) if mode == "fixed" else draw(st.integers(0, 0xFFFF))
    if mode == "fixed":  # n keys of exactly `size` bytes (text keys: ASCII, or arbitrary bytes)
        alphabet = st.binary(min_size=size, max_size=size)
        blob = b"".join(draw(st.lists(alphabet, max_size=8)))
    elif mode in ("honest", "lying"):  # u16-length-prefixed keys; "lying" lengths may overrun
        size = 0
        keys = draw(st.lists(st.binary(max_size=12), max_size=8))
        lens = [len(k) if mode == "honest" else draw(st.integers(0, 20)) for k in keys]
        blob = b"".join(_u16(n) + k for n, k in zip(lens, keys))
    else:
        blob = draw(st.binary(max_size=200))
    size_frame = _u16(size) if draw(st.integers(0, 4)) else draw(st.binary(max_size=3))
    tokens = _u32(draw(st.integers(0, 2**32 - 1))) if draw(st.integers(0, 4)) else draw(st.binary(max_size=5))
    if tag == b"lookup":
        body = [tag, tokens, size_frame, blob]
    elif tag == b"reset":
        body = [tag]
    else:
        body = [tag, enc, size_frame, blob]
    if draw(st.integers(0, 9)) == 0:
        body = body[: draw(st.integers(0, len(body)))] + draw(st.lists(st.binary(max_size=4), max_size=2))
    return body


@settings(max_examples=examples(3000), deadline=None)
@given(structured_bodies(), st.integers(1, 64))
def test_fuzz_structured_bodies_parse_consistently_or_raise(body: list[bytes], max_keys: int) -> None:
    try:
        query = protocol.parse_body(body, max_keys=max_keys)
    except LookupProtocolError:
        event("refused")
        return
    event(f"parsed {query.kind.value}")
    assert len(query.keys) <= max_keys
    if query.kind in (Kind.PREFIX, Kind.EXISTS):
        # what was parsed re-encodes to a body that parses to the same keys
        again = protocol.parse_body(protocol.encode_query(query.kind, query.keys), max_keys=max_keys)
        assert list(again.keys) == list(query.keys)
    elif query.kind is Kind.LOOKUP:
        assert all(isinstance(k, bytes) for k in query.keys)
        assert 0 <= query.token_count < 2**32


@settings(max_examples=examples(2000), deadline=None)
@given(st.binary(max_size=24))
def test_fuzz_id_frames_and_replies(frame: bytes) -> None:
    rid = protocol.parse_id(frame)
    assert rid is None or protocol.encode_id(rid) == frame
    value = protocol.decode_u32(frame)
    assert value is None or protocol.encode_u32(value) == frame


# -- the running server over a real socket --------------------------------------------------------------
HASHES = [bytes([i]) * 32 for i in range(6)]
PRESENT = 4


@pytest.fixture(scope="module")
def rt() -> Iterator[Runtime]:
    runtime = Runtime(name="fuzz-test").start()
    try:
        yield runtime
    finally:
        runtime.close()


@pytest.fixture(scope="module")
def server(rt: Runtime) -> Iterator[LookupServer]:
    async def go() -> LookupServer:
        store = await TensorStore.open("memory://fuzz-lookup")
        await store.backend.put([(store_key("", h), b"v") for h in HASHES[:PRESENT]])
        srv = LookupServer(store, "tcp://127.0.0.1:*", max_keys=256, max_message=64 * 1024)
        await srv.start()
        return srv

    srv = rt.run(go())
    try:
        yield srv
    finally:

        async def stop() -> None:
            await srv.close()
            await srv.store.close()

        rt.run(stop())


@pytest.fixture(scope="module")
def sockets(server: LookupServer) -> Iterator[tuple[zmq.Socket[bytes], zmq.Socket[bytes]]]:
    """A raw DEALER (sends anything) and a REQ (checks the server still answers correctly)."""
    ctx = zmq.Context()
    dealer, req = ctx.socket(zmq.DEALER), ctx.socket(zmq.REQ)
    for sock in (dealer, req):
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.RCVTIMEO, 5000)  # a server that stops answering fails the test, never hangs it
        assert server.endpoint is not None
        sock.connect(server.endpoint)
    try:
        yield dealer, req
    finally:
        dealer.close(0)
        req.close(0)
        ctx.term()


def _random_message(rng: random.Random) -> list[bytes]:
    """A DEALER message: an envelope that is right, missing or wrong, then a random or structured body."""
    body: list[bytes]
    roll = rng.random()
    if roll < 0.4:
        body = [rng.randbytes(rng.randint(0, 40)) for _ in range(rng.randint(0, 5))]
    elif roll < 0.8:
        tag = rng.choice([b"lookup", b"prefix", b"exists", b"reset"])
        body = [
            tag,
            rng.choice([b"x", b"t", _u32(rng.getrandbits(32))]),
            _u16(rng.choice([0, 1, 32, 0xFFFF])),
        ]
        body.append(rng.randbytes(rng.randint(0, 300)))
        del body[rng.randint(1, 4) :]
    else:
        body = encode_mooncake_lookup(rng.randint(0, 200), rng.sample(HASHES, rng.randint(0, 6)))
    envelope = rng.choice(
        [[b""], [b"", protocol.encode_id(rng.getrandbits(64))], [], [b"x"], [b"", protocol.MAGIC + b"\x00"]]
    )
    return [*envelope, *body] or [b""]


def _still_correct(req: zmq.Socket[bytes]) -> None:
    req.send_multipart(encode_mooncake_lookup(6 * 16, HASHES))
    assert req.recv() == _u32(PRESENT * 16)


def _drain(dealer: zmq.Socket[bytes], server: LookupServer, sent: int, before: int) -> int:
    """Receive one reply per message sent (a missing one times out and fails); return the count."""
    for _ in range(sent):
        dealer.recv_multipart()
    wait_until(lambda: server.busy() == 0)
    assert server.stats.requests == before + sent  # each message read exactly once
    return sent + _extra(dealer)


def _extra(dealer: zmq.Socket[bytes]) -> int:
    extra = 0
    while dealer.poll(0):
        dealer.recv_multipart()
        extra += 1
    return extra


def test_fuzz_server_bulk_random_messages(
    server: LookupServer,
    sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    dealer, req = sockets
    rng = random.Random(8)
    caplog.set_level(logging.ERROR, logger="asyncconn")
    total = 0
    for _ in range(10):
        before = server.stats.requests
        messages = [_random_message(rng) for _ in range(2000)]
        for frames in messages:
            dealer.send_multipart(frames)
        total += len(messages)
        assert _drain(dealer, server, len(messages), before) == len(messages)  # each answered once
        _still_correct(req)
        assert _extra(dealer) == 0
    assert total == 20_000
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # no batch ever failed


@settings(
    max_examples=examples(1500),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.lists(st.lists(st.binary(max_size=48), max_size=6), min_size=1, max_size=8))
def test_fuzz_server_hypothesis_frames(
    server: LookupServer, sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes]], bodies: list[list[bytes]]
) -> None:
    dealer, req = sockets
    before = server.stats.requests
    for body in bodies:
        dealer.send_multipart([b"", *body] if body else [b""])
    assert _drain(dealer, server, len(bodies), before) == len(bodies)
    _still_correct(req)
    assert _extra(dealer) == 0


def test_fuzz_server_oversized_and_huge_counts_then_serves(
    server: LookupServer, sockets: tuple[zmq.Socket[bytes], zmq.Socket[bytes]]
) -> None:
    _, req = sockets
    for frames in (
        [b"lookup", _u32(2**32 - 1), _u16(1), b"k" * 257],  # over max_keys
        [b"exists", b"x", _u16(0), _u16(0) * 257],  # 257 empty variable-length keys
        [b"prefix", b"t", _u16(1), b"a" * 257],
        [b"prefix", b"t", _u16(0), (_u16(1) + b"\xff") * 3],  # not UTF-8
    ):
        req.send_multipart(frames)
        assert req.recv() == protocol.ERROR
    _still_correct(req)


# -- atheris entry (optional, not run by pytest) ----------------------------------------------------------
def _atheris_codec(data: bytes) -> None:
    try:
        codec.decode(data)
    except CodecError:
        pass
    try:
        codec.decode_into([data[:7], data[7:]], torch.empty(4))
    except CodecError:
        pass


def _atheris_protocol(data: bytes) -> None:
    frames = data.split(b"\xff\xfe")
    try:
        protocol.parse_body(frames, max_keys=256)
    except LookupProtocolError:
        pass


def main() -> None:  # pragma: no cover - a manual tool
    import atheris  # type: ignore[import-untyped]  # optional, never a dependency

    target = _atheris_codec if sys.argv[1:2] == ["codec"] else _atheris_protocol
    atheris.instrument_all()  # coverage feedback for the already-imported asyncconn modules
    atheris.Setup([sys.argv[0], *sys.argv[2:]], target)
    atheris.Fuzz()


if __name__ == "__main__":  # pragma: no cover
    main()
