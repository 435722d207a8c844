"""Wire format units: key packing round trips, and arbitrary bytes never crash the parser."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from asyncconn.exceptions import LookupProtocolError
from asyncconn.lookup import protocol
from asyncconn.lookup.protocol import Kind


@given(st.lists(st.binary(min_size=0, max_size=40), max_size=20))
def test_bytes_keys_round_trip(keys: list[bytes]) -> None:
    enc, size, blob = protocol.pack_keys(keys)
    assert protocol.unpack_keys(enc, int.from_bytes(size, "big"), blob, 1000) == keys


@given(st.lists(st.text(max_size=20), max_size=20))
def test_text_keys_round_trip(keys: list[str]) -> None:
    query = protocol.parse_body(protocol.encode_query(Kind.EXISTS, keys))
    assert query.kind is Kind.EXISTS and list(query.keys) == keys


def test_mixed_or_oversized_keys_are_refused() -> None:
    with pytest.raises(LookupProtocolError):
        protocol.pack_keys([b"a", "b"])
    with pytest.raises(LookupProtocolError):
        protocol.pack_keys([b"x" * 70000, b"y"])


def test_store_key_function() -> None:
    assert protocol.store_key("kv:", b"\x00\xff") == "kv:00ff"
    assert protocol.store_key("ec:", "abc") == "ec:abc"


def test_id_frames_are_not_tags() -> None:
    frame = protocol.encode_id(2**64 - 1)
    assert protocol.parse_id(frame) == 2**64 - 1
    assert protocol.parse_id(b"lookup") is None
    assert protocol.parse_id(frame[:-1]) is None


def test_mooncake_encoding_parses_back() -> None:
    q = protocol.parse_body(protocol.encode_mooncake_lookup(40, [b"a" * 8, b"b" * 8]))
    assert (q.kind, list(q.keys), q.token_count) == (Kind.LOOKUP, [b"a" * 8, b"b" * 8], 40)


@given(st.lists(st.binary(max_size=64), max_size=6))
def test_arbitrary_frames_parse_or_raise_protocol_error(frames: list[bytes]) -> None:
    for body in (frames, [b"lookup", *frames], [b"exists", *frames], [b"prefix", b"x", *frames]):
        try:
            protocol.parse_body(body, max_keys=100)
        except LookupProtocolError:
            pass
