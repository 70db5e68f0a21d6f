"""The languages of Code nodes, by name."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from executor.languages.base import Language


@cache
def get_language(name: str) -> Language:
    """The Language object for ``name`` ("python" or "typescript")."""
    if name == "python":
        from executor.languages.python import Python

        return Python()
    if name == "typescript":
        from executor.languages.typescript import TypeScript

        return TypeScript()
    raise KeyError(name)
