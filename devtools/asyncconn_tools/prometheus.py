"""Prometheus text exposition, read the way the tests and benches need it: totals per series name, or one
series by one label's value. One parser for every server the tools scrape (vLLM's, LMCache's)."""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator, Mapping

__all__ = ["by_label", "totals"]

_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')


def _samples(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """(series name, labels, value) of every sample line; comments and unparsable values skipped."""
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        series, raw = line.rsplit(" ", 1)
        try:
            value = float(raw)
        except ValueError:
            continue
        name, _, rest = series.partition("{")
        yield name, dict(_LABEL.findall(rest)), value


def totals(text: str, keep: Callable[[str], bool] = lambda name: True) -> dict[str, float]:
    """Series name -> value summed over label sets, for the names ``keep`` takes."""
    out: dict[str, float] = {}
    for name, _, value in _samples(text):
        if keep(name):
            out[name] = out.get(name, 0.0) + value
    return out


def by_label(text: str, name: str, label: str, where: Mapping[str, str] | None = None) -> dict[str, float]:
    """Series ``name`` by the value of its ``label`` (summed over the other labels; "" where it has none),
    of the samples whose labels include ``where`` (e.g. one engine's: ``{"engine": "1"}``)."""
    out: dict[str, float] = {}
    wanted = dict(where or {}).items()
    for series, labels, value in _samples(text):
        if series == name and wanted <= labels.items():
            key = labels.get(label, "")
            out[key] = out.get(key, 0.0) + value
    return out
