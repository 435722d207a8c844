"""Old names kept for one release: they still work, and warn (``DeprecationWarning``) where they are used.

The list, with each new name, is in docs/transfer.md ("Deprecated names").
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

__all__ = ["renamed_attribute", "renamed_method"]


def renamed_method(old: str, new: str) -> Callable[..., Any]:
    """A method ``old`` that warns and calls ``new`` (same arguments, same result)."""

    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        warnings.warn(
            f"{type(self).__name__}.{old}() is deprecated, use {new}()", DeprecationWarning, stacklevel=2
        )
        return getattr(self, new)(*args, **kwargs)

    method.__name__ = method.__qualname__ = old
    method.__doc__ = f"Deprecated: use :meth:`{new}`."
    return method


def renamed_attribute(module: str, renamed: dict[str, tuple[str, Any]], name: str) -> Any:
    """For a module's ``__getattr__``: the new object behind an old name of ``renamed`` (old -> (new,
    object)), with a warning; ``AttributeError`` for any other name."""
    if name in renamed:
        new, value = renamed[name]
        warnings.warn(f"{module}.{name} is deprecated, use {new}", DeprecationWarning, stacklevel=3)
        return value
    raise AttributeError(f"module {module!r} has no attribute {name!r}")
