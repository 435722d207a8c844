"""The layout shows the architecture, and this keeps it so.

Dependencies run one way: core <- backends, core <- vLLM adapters <- simulator <- tools <- cli. The core
(runtime, codec, backend contract, URL, config, store, lookup, transfer) never imports vLLM, a backend, the
adapters or the tooling; the adapters vLLM loads never import the simulator or the tooling, so an engine
that loads ``asyncconn.vllm`` loads nothing it does not run. Imports inside functions count too.
"""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# layer -> the layers (and third-party top-level names) it must never import
FORBIDDEN: dict[str, set[str]] = {
    "core": {"vllm-adapters", "sim", "tools", "cli", "backends", "vllm"},
    "backends": {"vllm-adapters", "sim", "tools", "cli", "vllm"},
    "vllm-adapters": {"sim", "tools", "cli", "backends"},
    "sim": {"tools", "cli", "backends"},
    "tools": {"cli-commands"},
    "cli": set(),
}


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[0] == "backends":
        parts[0] = "asyncconn_backends"
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _layer(module: str) -> str:
    if module == "vllm" or module.startswith("vllm."):
        return "vllm"
    if module.startswith("asyncconn_backends"):
        return "backends"
    parts = module.split(".")
    if parts[0] != "asyncconn":
        return "third-party"
    sub = parts[1] if len(parts) > 1 else ""
    if sub == "vllm":
        return "vllm-adapters"
    if sub == "sim":
        return "sim"
    if sub == "tools":
        return "tools"
    if sub in {"cli", "__main__"}:
        # The CLI's shared argument types are a leaf the benchmarks' flag tables use; commands are not.
        if module == "asyncconn.cli._args" or module.startswith("asyncconn.cli._args."):
            return "cli"
        return "cli-commands" if sub == "cli" else "cli"
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


def _sources() -> list[Path]:
    return sorted([*(ROOT / "asyncconn").rglob("*.py"), *(ROOT / "backends").rglob("*.py")])


@pytest.mark.parametrize("path", _sources(), ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_run_one_way(path: Path) -> None:
    module = _module_name(path)
    layer = _layer(module)
    if layer in {"cli", "cli-commands"}:
        return
    bad = sorted(
        target for target in _imports(path, module) if _layer(target) in FORBIDDEN[layer] and target != module
    )
    assert not bad, f"{module} ({layer}) imports {bad}"


def test_the_rule_catches_a_core_module_importing_an_adapter() -> None:
    """The check above is not vacuous: the classifier puts each kind of module where the rule expects."""
    assert _layer("asyncconn.transfer.loader") == "core"
    assert _layer("asyncconn.vllm.kv.worker") == "vllm-adapters"
    assert _layer("asyncconn_backends.redis.backend") == "backends"
    assert _layer("asyncconn.sim.engine") == "sim"
    assert _layer("asyncconn.tools.bench.kv") == "tools"
    assert _layer("asyncconn.cli.main") == "cli-commands"
    assert _layer("asyncconn.cli._args") == "cli"
    assert "vllm-adapters" in FORBIDDEN[_layer("asyncconn.store")]
    imported = _imports(ROOT / "backends" / "redis" / "cluster.py", "asyncconn_backends.redis.cluster")
    assert "asyncconn_backends.redis.backend.RedisBackend" in imported  # a relative import, resolved


def test_every_package_is_installed() -> None:
    """pyproject lists the packages by hand (backends/ installs as ``asyncconn_backends``): none missed."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(config["packages"])
    on_disk = {_module_name(init) for init in _sources() if init.name == "__init__.py"}
    assert listed == on_disk
    assert config["package-dir"] == {"asyncconn_backends": "backends"}


def test_no_generic_top_level_module_is_installed() -> None:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {name.split(".")[0] for name in config["packages"]} == {"asyncconn", "asyncconn_backends"}
