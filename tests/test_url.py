from __future__ import annotations

import pytest

from asyncconn.exceptions import ConfigError
from asyncconn.url import Param, parse_duration, parse_size, parse_url, redact, with_param


def test_parse_full_url() -> None:
    u = parse_url("redis://user:s%40cret@127.0.0.1:6380/2?prefix=a&ttl=5s")
    assert (u.scheme, u.username, u.password, u.host, u.port, u.path) == (
        "redis",
        "user",
        "s@cret",
        "127.0.0.1",
        6380,
        "/2",
    )
    assert dict(u.query) == {"prefix": "a", "ttl": "5s"}
    assert "s@cret" not in repr(u) and "s%40cret" not in str(u)


def test_multi_host_and_ipv6() -> None:
    u = parse_url("redis+cluster://10.0.0.1:7000,10.0.0.2:7001,[::1]:7002/")
    assert u.hosts == (("10.0.0.1", 7000), ("10.0.0.2", 7001), ("::1", 7002))


def test_file_url_path() -> None:
    u = parse_url("file:///var/cache/asyncconn?fsync=true")
    assert u.host in (None, "") and u.path == "/var/cache/asyncconn"


@pytest.mark.parametrize(
    "bad", ["", "no-scheme", "1redis://x", "redis://h:notaport", "redis://h:70000", "redis://h/?a=1&a=2"]
)
def test_bad_urls_raise_config_error(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_url(bad)


def test_options_coerce_and_name_bad_parameter() -> None:
    table = {"ttl": Param.duration(0.0, "t"), "chunk": Param.size(1024, "c"), "on": Param.boolean(False, "b")}
    u = parse_url("memory://?ttl=250ms&chunk=4MiB&on=yes")
    assert u.options(table) == {"ttl": 0.25, "chunk": 4 << 20, "on": True}
    assert parse_url("memory://").options(table) == {"ttl": 0.0, "chunk": 1024, "on": False}
    with pytest.raises(ConfigError, match="'chunk'"):
        parse_url("memory://?chunk=lots").options(table)
    with pytest.raises(ConfigError, match="unknown parameter 'nope'"):
        parse_url("memory://?nope=1").options(table)


def test_size_and_duration_units() -> None:
    assert parse_size("1KiB") == 1024 and parse_size("1kb") == 1000 and parse_size("512") == 512
    assert parse_duration("2") == 2.0 and parse_duration("500ms") == 0.5 and parse_duration("1min") == 60
    for bad in ("x", "-1", "1 parsec"):
        with pytest.raises(ValueError):
            parse_size(bad)


@pytest.mark.parametrize(
    ("url", "secret"),
    [
        ("redis://user:hunter2@h:1/0", "hunter2"),
        ("redis://hunter2@h:1/0", "hunter2"),
        ("rediss://:hunter2@h:1?ssl_ca_certs=/x", "hunter2"),
        ("mooncake://h:1?password=hunter2&protocol=tcp", "hunter2"),
    ],
)
def test_redact_hides_secrets(url: str, secret: str) -> None:
    out = redact(url)
    assert secret not in out and "***" in out


def test_error_messages_do_not_leak_password() -> None:
    with pytest.raises(ConfigError) as info:
        parse_url("redis://:hunter2@h:badport/0")
    assert "hunter2" not in str(info.value)


def test_with_param_replaces_a_parameter_and_keeps_the_rest_as_written() -> None:
    url = "mooncake://h:1?metadata=http://m:2/metadata&segment=1GiB&buffer=64MiB#frag"
    assert with_param(url, "segment", "0") == "mooncake://h:1?metadata=http://m:2/metadata&buffer=64MiB&segment=0#frag"
    assert with_param("file:///tmp/x", "workers", "2") == "file:///tmp/x?workers=2"
    assert parse_url(with_param("redis://h/0?prefix=segment=1", "prefix", "p")).query["prefix"] == "p"
