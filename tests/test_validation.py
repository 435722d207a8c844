"""Every extra_config value and every command-line flag is checked by type and range at start-up.

A bad value is a :class:`ConfigError` naming the key (extra_config) or argparse's ``argument --flag: ...``
with exit code 2 (the CLI), never a raw ``AttributeError``, a NaN or infinite timeout accepted, a
fraction silently truncated, or ``null`` turned into the text ``"None"``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from typing import Any

import pytest

from asyncconn import config as config_module
from asyncconn.cli import argtypes
from asyncconn.cli.main import build_parser
from asyncconn.cli.main import main as cli_main
from asyncconn.config import Settings
from asyncconn.exceptions import ConfigError
from asyncconn.lookup import LookupConfig
from asyncconn.url import (
    MAX_COUNT,
    MAX_DURATION,
    MAX_SIZE,
    parse_bool,
    parse_count,
    parse_duration,
    parse_size,
)

NAN, INF = math.nan, math.inf

#: The bad values of each kind of setting: wrong types, null, NaN/infinity, out of range, fractions.
_COMMON_BAD: list[Any] = [[1], {"a": 1}, b"bytes"]
BAD: dict[str, list[Any]] = {
    "duration": [
        *(True, False, None, NAN, INF, -INF, -1, 0, 0.0, "inf", "nan", "-1s", "0s", "soon", "1e400"),
        *("9" * 400, 10 * MAX_DURATION, f"{MAX_DURATION * 2:.0f}s"),
    ],
    "duration_or_zero": [
        *(True, False, None, NAN, INF, -INF, -1, "inf", "nan", "-1s", "soon", "1e400"),
        *("9" * 400, 10 * MAX_DURATION),
    ],
    "count": [
        True,
        False,
        None,
        0,
        -1,
        1.5,
        "1.5",
        "2.0",
        NAN,
        INF,
        "many",
        "",
        1 << 40,
        str(1 << 40),
        "9" * 5000,
    ],
    "size": [True, False, None, 0, -1, 0.5, "0.5", NAN, INF, "lots", "9" * 400, "1e3", MAX_SIZE * 2, "-1MiB"],
    "size_or_zero": [True, False, None, -1, 0.5, "0.5", NAN, INF, "lots", "1e3", MAX_SIZE * 2, "-1MiB"],
    "bool": [1, 0, 1.0, None, "maybe", "", 2],
    "url": [
        None,
        5,
        True,
        "",
        "not a url",
        "redis://:pw@[::1:6379",
        "redis://h:99999/0",
        "nosuch://x",
        "memory://v?bogus=1",
        "redis://h/0?ttl=inf",
    ],
    "endpoint": [5, True, "127.0.0.1:5555", "http://x:1", "tcp://"],
    "local_url": [5, True, "not a url", "redis://127.0.0.1:6379/0", "memory://v", "file:///x?bogus=1"],
    "text": [None, 5, True, 1.5],
    "optional_text": [5, True, 1.5],
    "events_scope": [None, 5, True, "", "some", "gpu", "all,host"],
}
GOOD: dict[str, list[tuple[Any, Any]]] = {
    "duration": [("250ms", 0.25), (2, 2.0), (0.5, 0.5), ("1min", 60.0)],
    "duration_or_zero": [(0, 0.0), ("0s", 0.0), ("250ms", 0.25), (30, 30.0)],
    "count": [(3, 3), ("3", 3), (3.0, 3)],
    "size": [("1MiB", 1 << 20), (4096, 4096), ("1.5KiB", 1536), (4096.0, 4096)],
    "size_or_zero": [(0, 0), ("0", 0), ("1MiB", 1 << 20)],
    "bool": [(True, True), ("false", False), ("on", True)],
    "url": [
        ("memory://v", "memory://v"),
        ("redis://127.0.0.1:6379/0?prefix=a:", "redis://127.0.0.1:6379/0?prefix=a:"),
    ],
    "endpoint": [(None, None), ("", None), ("tcp://127.0.0.1:5555", "tcp://127.0.0.1:5555")],
    "local_url": [(None, None), ("", None), ("file:///nvme/kv?max_bytes=1GiB", "file:///nvme/kv?max_bytes=1GiB")],
    "text": [("kv:", "kv:"), ("", "")],
    "optional_text": [(None, None), ("", None), ("/etc/key", "/etc/key")],
    "events_scope": [("all", "all"), ("Host", "host"), (" store ", "store"), ("none", "none")],
}


def _kind(field: dataclasses.Field[Any]) -> str:
    """Which kind of value a Settings field takes, from its parser (a new parser must be added here)."""
    parse = field.metadata["parse"]
    kinds: dict[Callable[[Any], Any], str] = {
        config_module._positive_duration: "duration",
        parse_duration: "duration_or_zero",
        parse_count: "count",
        config_module._positive_size: "size",
        parse_size: "size_or_zero",
        parse_bool: "bool",
        config_module._url: "url",
        config_module._optional_endpoint: "endpoint",
        config_module._optional_local_url: "local_url",
        config_module._text: "text",
        config_module._optional_text: "optional_text",
        config_module._events_scope: "events_scope",
    }
    assert parse in kinds, f"Settings.{field.name}: parser {parse!r} has no bad-value table in this test"
    return kinds[parse]


FIELDS = [(f.name, _kind(f)) for f in dataclasses.fields(Settings)]
BAD_CASES = [(name, value) for name, kind in FIELDS for value in BAD[kind] + _COMMON_BAD]


def test_every_field_has_a_kind() -> None:
    assert len(FIELDS) == len(dataclasses.fields(Settings)) >= 16
    assert {kind for _, kind in FIELDS} == set(BAD)


@pytest.mark.parametrize(("key", "value"), BAD_CASES, ids=[f"{k}={v!r:.30}" for k, v in BAD_CASES])
def test_bad_extra_config_value_is_a_config_error_naming_the_key(key: str, value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        Settings.from_extra_config({key: value})
    assert repr(key) in str(info.value)
    assert info.value.__cause__ is None


@pytest.mark.parametrize(("key", "kind"), FIELDS)
def test_good_extra_config_values_are_accepted(key: str, kind: str) -> None:
    for value, expected in GOOD[kind]:
        assert getattr(Settings.from_extra_config({key: value}), key) == expected


@pytest.mark.parametrize("extra", [["backend_url"], "backend_url=x", 5, {1: "x"}, {None: 1}])
def test_extra_config_that_is_not_a_mapping_of_text_keys(extra: Any) -> None:
    with pytest.raises(ConfigError, match="extra_config"):
        Settings.from_extra_config(extra)


def test_a_typo_is_still_named() -> None:
    with pytest.raises(ConfigError, match="unknown key 'lookup_timout'"):
        Settings.from_extra_config({"lookup_timout": "1s"})


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("lookup_timeout", NAN),
        ("lookup_timeout", "inf"),
        ("lookup_max_pending", 2.5),
        ("lookup_max_pending", True),
        ("connect_timeout", -1),
        ("backend_url", 5),
        ("lookup_server", "127.0.0.1:1"),
        ("key_prefix", 7),
    ],
)
def test_lookup_config_comes_from_settings_checked_like_settings(key: str, value: Any) -> None:
    """One parser: a lookup key's bad value is refused by Settings before any LookupConfig exists."""
    with pytest.raises(ConfigError) as info:
        LookupConfig.from_settings(Settings.from_extra_config({"backend_url": "memory://", key: value}))
    assert repr(key) in str(info.value)


def test_lookup_config_from_extra_config_refuses_an_unknown_key() -> None:
    """No second parser that skips what it does not know: an unknown key is an error naming it."""
    with pytest.raises(ConfigError, match="unknown key 'lookup_timout'"):
        extra = {"backend_url": "memory://", "lookup_timout": 1}
        LookupConfig.from_settings(Settings.from_extra_config(extra))


def test_parsers_refuse_what_the_url_table_could_overflow() -> None:
    """URL parameters go through the same parsers: an overflowing figure is a ValueError, not a crash."""
    for parse in (parse_size, parse_duration, parse_count):
        with pytest.raises(ValueError):
            parse("9" * 400)
    assert parse_count(str(MAX_COUNT)) == MAX_COUNT
    assert parse_duration("0") == 0.0 and parse_size("0") == 0  # zero stays valid where a table allows it


# -- the command line -------------------------------------------------------------------------------
#: What each checked argument type is given, and the bad values it must refuse.
CLI_BAD: dict[str, list[str]] = {
    "positive_duration": ["inf", "nan", "0", "-1", "0s", "soon", "1e400", "9" * 400],
    "duration": ["inf", "nan", "-1", "soon", "9" * 400],
    "count": ["0", "-1", "1.5", "inf", "many", "9" * 40],
    "non_negative_count": ["-1", "1.5", "inf", "many"],
    "positive_size": ["0", "-1", "0.5", "lots", "9" * 400],
    "size_list": ["", "0", "1MiB,0", "1MiB,lots"],
    "count_list": ["", "0", "1,1.5", "1,x"],
    "choice_list": ["nosuch"],
}
#: How to reach each subcommand's parser with its required arguments given.
PREFIX = {
    "check": ["check", "memory://v"],
    "chaos": ["chaos"],
    "demo": ["demo"],
    "lookup-server": ["lookup-server", "--backend", "memory://v"],
    "bench backend": ["bench", "backend"],
    "bench kv": ["bench", "kv"],
    "bench lookup": ["bench", "lookup"],
    "bench transfer": ["bench", "transfer"],
    "bench align": ["bench", "align"],
    "bench engine": ["bench", "engine"],
    "bench gpu": ["bench", "gpu"],
    "bench ec-sim": ["bench", "ec-sim"],
    "bench redis": ["bench", "redis"],
    "bench mooncake": ["bench", "mooncake", "--url", "mooncake://127.0.0.1:1"],
    "bench serve": ["bench", "serve"],
}
UNTYPED_OK: set[tuple[str, str]] = set()


def _subparsers(parser: argparse.ArgumentParser, path: str = "") -> dict[str, argparse.ArgumentParser]:
    out: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                full = f"{path} {name}".strip()
                found = _subparsers(sub, full)
                out.update(found or {full: sub})
    return out


def _flags() -> list[tuple[str, str, str]]:
    """(command, flag, type name) of every option with a checked type, over every subcommand."""
    out = []
    for command, parser in _subparsers(build_parser(full=True)).items():
        for action in parser._actions:
            name = getattr(action.type, "__name__", None)
            if action.option_strings and name in CLI_BAD:
                out.append((command, action.option_strings[-1], name))
    return out


FLAGS = _flags()
CLI_CASES = [(c, f, bad) for c, f, kind in FLAGS for bad in CLI_BAD[kind]]


def test_every_number_flag_is_checked() -> None:
    """No option parses a number with bare int/float (which take inf, nan, 0 and negatives)."""
    assert len(FLAGS) >= 30 and set(PREFIX) == set(_subparsers(build_parser(full=True)))
    raw = [
        (command, action.option_strings[-1])
        for command, parser in _subparsers(build_parser(full=True)).items()
        for action in parser._actions
        if action.type in (int, float)
    ]
    assert set(raw) <= UNTYPED_OK


@pytest.mark.parametrize(
    ("command", "flag", "bad"), CLI_CASES, ids=[f"{c}{f}={b:.12}" for c, f, b in CLI_CASES]
)
def test_bad_flag_value_exits_2_naming_the_flag(
    command: str, flag: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        _parse(*PREFIX[command], f"{flag}={bad}")
    assert info.value.code == 2
    assert f"argument {flag}" in capsys.readouterr().err


@pytest.mark.parametrize("timeout", ["inf", "0", "-1", "nan"])
def test_check_timeout_is_checked(timeout: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["check", "memory://v", "--timeout", timeout]) == 2
    assert "argument --timeout" in capsys.readouterr().err


def _parse(*argv: str) -> argparse.Namespace:
    """Parse as ``asyncconn`` does: the parser built for ``argv`` alone (only its command's module loaded)."""
    return build_parser(argv).parse_args(argv)


def test_good_flag_values_parse() -> None:
    args = _parse("check", "memory://v", "--timeout", "500ms", "--size", "1KiB")
    assert (args.timeout, args.size) == (0.5, 1024)
    args = _parse("bench", "kv", "--bpv", "1,4", "--what", "bpv", "--latency", "0ms")
    assert (args.bpv, args.what, args.latency) == ([1, 4], "bpv", "0ms")
    args = _parse("-v", "bench", "backend", "--url", "memory://v", "--iterations", "0")
    assert args.iterations == 0 and args.sizes == [1 << 20, 4 << 20, 16 << 20]
    args = _parse("chaos", "--faults", "", "--seed", "0")
    assert args.faults == "" and args.seed == 0
    assert argtypes.positive_duration("2") == 2.0
