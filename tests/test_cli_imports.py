"""What the ``asyncconn`` command imports: only the command being run.

``asyncconn --help`` prints from the command table, and ``check`` needs neither torch, vLLM nor the tools
(the command used to import every command, torch and vLLM's engine tools: seconds for a help text).
``bench``, ``chaos`` and ``demo`` are the ``asyncconn-tools`` package's; without it they exit 2 with one
line naming what to install.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from asyncconn.cli.main import COMMANDS, TOOLS_INSTALL, ToolsNotInstalled, build_parser, main

#: Runs ``asyncconn`` (its ``main``, as the console script does) and prints what was imported, last line.
_PROBE = (
    "import json, sys\n"
    "from asyncconn.cli import main\n"
    "code = main(sys.argv[1:])\n"
    "print('\\n' + json.dumps({'code': code, 'modules': sorted(sys.modules)}))\n"
)


def _run(*argv: str) -> tuple[int, set[str], str]:
    r = subprocess.run(
        [sys.executable, "-c", _PROBE, *argv], capture_output=True, text=True, timeout=120, check=False
    )
    *out, last = r.stdout.rstrip("\n").split("\n")
    report = json.loads(last)
    return report["code"], set(report["modules"]), "\n".join(out) + r.stderr


def _tops(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


@pytest.mark.parametrize("argv", [("--help",), ("check", "--help")])
def test_help_imports_neither_torch_nor_vllm_nor_the_tools(argv: tuple[str, ...]) -> None:
    code, modules, out = _run(*argv)
    assert code == 0, out
    assert not {"torch", "vllm", "transformers", "asyncconn_tools"} & _tops(modules), sorted(_tops(modules))
    if argv == ("--help",):
        assert all(name in out for name in COMMANDS)  # every command listed, from the table


def test_check_round_trips_a_store_without_torch_or_vllm(tmp_path: Path) -> None:
    """``asyncconn check`` itself (not only its help): the round trip goes to the backend as bytes."""
    code, modules, out = _run("check", f"file://{tmp_path / 'store'}")
    assert code == 0 and ": ok connect=" in out, out
    assert not {"torch", "vllm", "transformers", "asyncconn_tools"} & _tops(modules), sorted(_tops(modules))


def test_lookup_server_help_imports_neither_vllm_nor_the_tools() -> None:
    """(It imports the store, and with it torch: the server reads tensors' frames.)"""
    code, modules, out = _run("lookup-server", "--help")
    assert code == 0 and "--backend" in out, out
    assert not {"vllm", "transformers", "asyncconn_tools"} & _tops(modules)


def test_bench_help_imports_only_the_bench_table() -> None:
    code, modules, out = _run("bench", "--help")
    assert code == 0, out
    assert "asyncconn_tools.cli.bench" in modules
    assert not any(m.startswith("asyncconn_tools.bench") for m in modules)
    assert not {"torch", "vllm"} & _tops(modules)
    assert "backend" in out and "serve" in out


@pytest.mark.slow  # imports torch: a second or two
def test_check_on_a_file_store_imports_no_vllm(tmp_path: Path) -> None:
    code, modules, out = _run("check", f"file://{tmp_path}")
    assert code == 0 and ": ok " in out, out
    assert not {"vllm", "asyncconn_tools", "transformers"} & _tops(modules)


@pytest.fixture
def no_tools(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """As if asyncconn-tools were not installed: ``import asyncconn_tools`` raises ModuleNotFoundError."""
    for name in [n for n in sys.modules if n == "asyncconn_tools" or n.startswith("asyncconn_tools.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "asyncconn_tools", None)
    yield


@pytest.mark.parametrize(
    "argv",
    [
        ("demo",),
        ("demo", "--help"),
        ("bench", "backend"),
        ("bench", "--help"),
        ("-v", "chaos", "--seed", "1"),
    ],
)
def test_tools_commands_without_the_tools_exit_2_with_one_line(
    no_tools: None, argv: tuple[str, ...], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == ""
    command = next(a for a in argv if not a.startswith("-"))  # the command asked for, not its arguments
    assert err == f"asyncconn {command}: needs the asyncconn-tools package: {TOOLS_INSTALL}\n"
    assert "pip install asyncconn-tools" in err and "pip install -e ./devtools" in err


def test_the_library_commands_work_without_the_tools(
    no_tools: None, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--help"]) == 0
    assert "demo" in capsys.readouterr().out  # still listed: running it says what to install
    assert main(["check", "--help"]) == 0
    assert main(["check", f"file://{tmp_path}"]) == 0
    assert ": ok " in capsys.readouterr().out
    with pytest.raises(ToolsNotInstalled):  # the full parser (tests walking every flag) needs the tools
        build_parser(full=True)


def test_a_missing_dependency_inside_the_tools_is_not_reported_as_missing_tools(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Only asyncconn_tools itself missing gets the install line; anything else is the real error."""
    monkeypatch.delitem(sys.modules, "asyncconn_tools.cli.demo", raising=False)
    monkeypatch.setitem(sys.modules, "asyncconn_tools.demo.report", None)
    with pytest.raises(ModuleNotFoundError, match=r"asyncconn_tools\.demo\.report"):
        main(["demo", "--help"])


def test_only_the_chosen_command_is_built() -> None:
    parser = build_parser(["-v", "bench", "kv", "--what", "bpv"])
    args = parser.parse_args(["-v", "bench", "kv", "--what", "bpv"])
    assert (args.command, args.bench, args.what) == ("bench", "kv", "bpv")
    with pytest.raises(SystemExit):  # check was listed, not built: its URL argument is unknown here
        parser.parse_args(["check", "memory://x"])
