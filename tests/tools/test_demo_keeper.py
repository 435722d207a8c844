"""The demo's store keeper: which URLs it changes, and how."""

from __future__ import annotations

from asyncconn_tools.demo.keeper import _without_segment, kept_store


def test_a_mooncake_url_loses_its_segment_and_keeps_every_other_parameter() -> None:
    url = "mooncake://h:1?metadata=http://m:2/metadata&segment=1GiB&buffer=64MiB&prefix=a/"
    assert _without_segment(url) == "mooncake://h:1?metadata=http://m:2/metadata&buffer=64MiB&prefix=a/&segment=0"
    assert _without_segment("mooncake://h:1") == "mooncake://h:1?segment=0"


def test_stores_that_keep_values_by_themselves_are_used_as_given() -> None:
    for url in ("file:///tmp/x", "redis://127.0.0.1:1/0?prefix=segment=1", "memory://demo"):
        with kept_store(url) as used:
            assert used == url
