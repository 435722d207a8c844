"""Argument parsing and dispatch for the ``asyncconn`` command.

Each command lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int`` (or, for a
group such as ``bench``, a ``COMMANDS`` table of its own, read the same way). The modules are listed in
:data:`COMMANDS` by path with their help line, and only the one being run is imported: ``asyncconn --help``
prints from the table, and ``check`` or ``lookup-server`` load neither vLLM nor another command's
dependencies (tests/test_cli_imports.py measures it).

``bench``, ``chaos`` and ``demo`` live in the separate ``asyncconn-tools`` package (``devtools/`` in the
repository): the library never imports it, it is named here as text. Without it those commands exit 2 with
one line saying what to install.

Exit codes: 0 ok, 1 a check failed, 2 bad usage, an unreachable/unknown store or a missing tools package.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import sys
from collections.abc import Sequence
from types import ModuleType

__all__ = ["COMMANDS", "TOOLS_INSTALL", "ToolsNotInstalled", "build_parser", "main"]

#: The package that holds the benchmarks, the demo and the chaos harness.
TOOLS_PACKAGE = "asyncconn_tools"
#: How to get it, in the one line a tools command prints when it is missing.
TOOLS_INSTALL = "pip install asyncconn-tools (in the asyncconn repository: pip install -e ./devtools)"

#: name -> (module, help), in the order ``--help`` lists them.
COMMANDS: dict[str, tuple[str, str]] = {
    "chaos": (
        "asyncconn_tools.cli.chaos",
        "both connectors under injected faults, with invariant and leak checks (asyncconn-tools)",
    ),
    "check": ("asyncconn.cli.check", "round-trip a tensor through a store and report latencies"),
    "demo": ("asyncconn_tools.cli.demo", "run the end-to-end demo on an embedded store (asyncconn-tools)"),
    "lookup-server": ("asyncconn.cli.lookup_server", "serve Mooncake-framed lookups from a store over ZMQ"),
    "bench": ("asyncconn_tools.cli.bench", "benchmarks; figures in docs/benchmarks.md (asyncconn-tools)"),
}


class ToolsNotInstalled(Exception):
    """A command of the ``asyncconn-tools`` package was asked for and the package is not installed."""

    def __init__(self, command: str) -> None:
        super().__init__(f"asyncconn {command}: needs the asyncconn-tools package: {TOOLS_INSTALL}")


def _load(path: str, command: str) -> ModuleType:
    # Only the tools package itself being absent gets the install line: a module missing inside an
    # installed package is its own error, raised as it is.
    if path.partition(".")[0] == TOOLS_PACKAGE and importlib.util.find_spec(TOOLS_PACKAGE) is None:
        raise ToolsNotInstalled(command)
    return importlib.import_module(path)


def _chosen(argv: Sequence[str]) -> int | None:
    """Index of the first word of ``argv`` that is not an option (no option above a command takes a
    value: ``-v`` counts), i.e. the command name; None if there is none (``--help``, or nothing)."""
    for index, word in enumerate(argv):
        if word == "--":
            return index + 1 if index + 1 < len(argv) else None
        if not word.startswith("-"):
            return index
    return None


def _add_commands(
    parser: argparse.ArgumentParser,
    table: dict[str, tuple[str, str]],
    argv: Sequence[str],
    *,
    full: bool,
    dest: str,
    metavar: str,
    words: str = "",
) -> None:
    sub = parser.add_subparsers(dest=dest, required=True, metavar=metavar)
    index = None if full else _chosen(argv)
    chosen = None if index is None else argv[index]
    for name, (path, help_text) in table.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if not full and name != chosen:
            continue  # listed for --help and argparse's choices; its module is never imported
        command = f"{words}{name}"
        module = _load(path, command)
        group: dict[str, tuple[str, str]] | None = getattr(module, "COMMANDS", None)
        if group is not None:
            rest = () if index is None else argv[index + 1 :]
            _add_commands(p, group, rest, full=full, dest=name, metavar="WHAT", words=f"{command} ")
        else:
            module.add_arguments(p)
            p.set_defaults(_run=module.run)


def build_parser(argv: Sequence[str] = (), *, full: bool = False) -> argparse.ArgumentParser:
    """The parser for ``argv``: every command is listed, but only the one ``argv`` names has its module
    imported and its flags added (inside a group, likewise). ``full=True`` adds every command's flags
    (what tests walking all of them need; it imports every command module, vLLM's included).

    Raises :class:`ToolsNotInstalled` when the command asked for (or, with ``full``, any command) is in
    the ``asyncconn-tools`` package and that package is not installed.
    """
    parser = argparse.ArgumentParser(
        prog="asyncconn", description=__doc__.splitlines()[0] if __doc__ else None
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="log more (-vv for debug)")
    _add_commands(parser, COMMANDS, list(argv), full=full, dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    words = list(sys.argv[1:] if argv is None else argv)
    try:
        parser = build_parser(words)
    except ToolsNotInstalled as exc:
        print(exc, file=sys.stderr)
        return 2
    try:
        args = parser.parse_args(words)
    except SystemExit as exc:  # --help (0) or a usage error (2, argparse printed which flag and why)
        return exc.code if isinstance(exc.code, int) else 2
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        code: int = args._run(args)
    except KeyboardInterrupt:
        return 130
    return code


if __name__ == "__main__":
    sys.exit(main())
