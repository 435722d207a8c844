from __future__ import annotations

import sys
import textwrap
import types
from pathlib import Path

import pytest
import torch
from asyncconn_backends.memory import MemoryBackend

import asyncconn
from asyncconn import backend as registry
from asyncconn.backend import available_schemes, open_backend, register_backend, resolve_backend
from asyncconn.exceptions import BackendNotInstalled, ConfigError, UnknownSchemeError
from asyncconn.store import TensorStore
from examples.custom_backend import TTLMemoryBackend


def test_builtins_resolve_lazily() -> None:
    assert resolve_backend("memory") is MemoryBackend
    assert {"memory", "file", "redis", "rediss", "unix"} <= set(available_schemes())


def test_unknown_scheme_names_available_ones_and_entry_point_group() -> None:
    with pytest.raises(UnknownSchemeError) as info:
        resolve_backend("s3")
    msg = str(info.value)
    assert "'s3'" in msg and "memory" in msg and "asyncconn.backends" in msg


def test_missing_extra_names_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._BUILTINS, "fancy", ("no_such_module_xyz:Backend", "asyncconn[fancy]"))
    with pytest.raises(BackendNotInstalled, match=r"pip install 'asyncconn\[fancy\]'"):
        resolve_backend("fancy")


def test_builtins_cannot_be_overridden_and_duplicates_need_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_registered", {})
    with pytest.raises(ConfigError, match="built in"):
        register_backend("redis", TTLMemoryBackend)
    register_backend("ttlmem", TTLMemoryBackend)
    with pytest.raises(ConfigError, match="already registered"):
        register_backend("ttlmem", TTLMemoryBackend)
    register_backend("ttlmem", "examples.custom_backend:TTLMemoryBackend", override=True)
    assert resolve_backend("ttlmem") is TTLMemoryBackend


def test_non_backend_target_is_rejected(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(registry, "_registered", {})
    register_backend("bogus", "asyncconn.url:parse_url")
    with pytest.raises(ConfigError, match="not a StorageBackend"):
        resolve_backend("bogus")


async def test_entry_point_plugin_is_discovered(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pkg = tmp_path / "acplugin_demo"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from examples.custom_backend import TTLMemoryBackend as Plugin\n")
    dist = tmp_path / "acplugin_demo-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: acplugin-demo\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(
        textwrap.dedent("""
        [asyncconn.backends]
        plugdemo = acplugin_demo:Plugin
        """)
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    assert "plugdemo" in available_schemes()
    store = TensorStore(await open_backend("plugdemo://?ttl=5s"))
    await store.put([("k", torch.ones(3))])
    (got,) = await store.get(["k"])
    assert got is not None and torch.equal(got, torch.ones(3))
    await store.close()
    sys.modules.pop("acplugin_demo", None)


async def test_bad_parameter_is_named() -> None:
    with pytest.raises(ConfigError, match="'latency'"):
        await open_backend("memory://?latency=soon")


def test_public_api_is_explicit() -> None:
    exported = set(asyncconn.__all__)
    public = {
        n
        for n in dir(asyncconn)
        if not n.startswith("_") and not isinstance(getattr(asyncconn, n), types.ModuleType)
    }
    assert public - {"annotations"} <= exported
    for name in exported:
        assert hasattr(asyncconn, name), name
