"""Argument types for every ``asyncconn`` subcommand: each flag is checked by type and range when parsed.

A bad value makes argparse print ``argument --flag: <why>`` and exit 2 before anything starts, instead of
``inf`` or ``-1`` reaching a timeout (a hang, or a raw error later). The rules are those of the URL and
extra_config parsers (:mod:`asyncconn.url`): durations finite and within ten years, sizes whole bytes,
counts whole numbers.

Public: a command built on the library -- the asyncconn-tools benchmarks, demo and chaos harness are --
passes these as ``type=`` and gets the same checks and messages (``parser.add_argument("--clients",
type=argtypes.count)``). Importing this module imports nothing but :mod:`asyncconn.url`.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from asyncconn.url import parse_count, parse_duration, parse_size

__all__ = [
    "count",
    "count_list",
    "duration",
    "duration_text",
    "non_negative_count",
    "positive_duration",
    "positive_duration_text",
    "positive_size",
    "positive_size_text",
    "size_list",
    "choice_list",
]

T = TypeVar("T")


def _checked(parse: Callable[[str], T], name: str) -> Callable[[str], T]:
    def check(text: str) -> T:
        try:
            return parse(text)
        except (TypeError, ValueError, OverflowError) as exc:
            raise argparse.ArgumentTypeError(f"bad value {text[:40]!r}: {exc}") from None

    check.__name__ = name
    return check


def _positive_duration(text: str) -> float:
    seconds = parse_duration(text)
    if seconds <= 0:
        raise ValueError("must be > 0")
    return seconds


def _positive_size(text: str) -> int:
    size = parse_size(text)
    if size <= 0:
        raise ValueError("must be > 0")
    return size


def _non_negative_count(text: str) -> int:
    return 0 if text.strip() == "0" else parse_count(text)


def _listed(parse: Callable[[str], T]) -> Callable[[str], list[T]]:
    def items(text: str) -> list[T]:
        values = [parse(item.strip()) for item in text.split(",") if item.strip()]
        if not values:
            raise ValueError("expected at least one value (comma-separated)")
        return values

    return items


def _text_of(parse: Callable[[str], object]) -> Callable[[str], str]:
    """Check ``text`` with ``parse`` but keep it as given (for flags passed on inside a URL)."""

    def keep(text: str) -> str:
        parse(text)
        return text.strip()

    return keep


#: Seconds (``2``, ``2s``, ``500ms``) > 0, finite.
positive_duration = _checked(_positive_duration, "positive_duration")
#: Seconds >= 0, finite.
duration = _checked(parse_duration, "duration")
#: A duration >= 0 kept as the text given (e.g. a memory:// ``latency=`` parameter).
duration_text = _checked(_text_of(parse_duration), "duration")
#: A duration > 0 kept as the text given.
positive_duration_text = _checked(_text_of(_positive_duration), "positive_duration")
#: Bytes (``4096``, ``16MiB``) > 0.
positive_size = _checked(_positive_size, "positive_size")
#: Bytes > 0 kept as the text given.
positive_size_text = _checked(_text_of(_positive_size), "positive_size")
#: A whole number >= 1.
count = _checked(parse_count, "count")
#: A whole number >= 0.
non_negative_count = _checked(_non_negative_count, "non_negative_count")
#: Comma-separated sizes, each > 0.
size_list = _checked(_listed(_positive_size), "size_list")
#: Comma-separated whole numbers, each >= 1.
count_list = _checked(_listed(parse_count), "count_list")


def choice_list(choices: tuple[str, ...] | list[str], *, allow_empty: bool = False) -> Callable[[str], str]:
    """Comma-separated names, each one of ``choices``; kept as text."""

    def names(text: str) -> str:
        given = [item.strip() for item in text.split(",") if item.strip()]
        unknown = sorted(set(given) - set(choices))
        if unknown:
            raise ValueError(f"unknown {', '.join(unknown)} (choose from {', '.join(choices)})")
        if not given and not allow_empty:
            raise ValueError(f"choose at least one of {', '.join(choices)}")
        return ",".join(given)

    return _checked(names, "choice_list")
