"""Keep docs/ true to the code: every extra_config key and URL parameter is documented, CI runs the README's
test command."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from asyncconn.backend import _BUILTINS, resolve_backend
from asyncconn.config import Settings

ROOT = Path(__file__).resolve().parent.parent
CONFIG_DOC = (ROOT / "docs" / "configuration.md").read_text()


@pytest.mark.parametrize("key", [k for k, _, _ in Settings.documentation()])
def test_every_extra_config_key_is_documented(key: str) -> None:
    assert f"`{key}`" in CONFIG_DOC, f"docs/configuration.md does not document extra_config key {key!r}"


@pytest.mark.parametrize("scheme", sorted({target for target, _ in _BUILTINS.values()}))
def test_every_url_parameter_is_documented(scheme: str) -> None:
    cls = resolve_backend(next(s for s, (t, _) in _BUILTINS.items() if t == scheme))
    section = CONFIG_DOC.split(f"<!-- params:{cls.__module__} -->", 1)
    assert len(section) == 2, f"docs/configuration.md has no parameter table for {cls.__module__}"
    table = section[1].split("<!-- end -->", 1)[0]
    for name in cls.params:
        assert f"`{name}`" in table, f"URL parameter {name!r} of {cls.__module__} is not documented"


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"^(bash \.ci/setup && [^\n#]+?)\s*(?:#.*)?$", readme, re.M)
    assert len(commands) >= 2, "README must start with the two set-up commands"
    test_command = commands[1].strip()
    assert test_command in (ROOT / ".ci" / "run").read_text()
