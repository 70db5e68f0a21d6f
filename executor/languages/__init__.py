"""The languages of Code nodes, by name."""

from __future__ import annotations

from functools import cache
from typing import TYPE_CHECKING

from executor.errors import CodeInvalid

if TYPE_CHECKING:
    from executor.languages.base import Language
    from executor.settings import Settings


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


def offered_language(name: str, settings: Settings) -> Language:
    """The language ``name`` if STUDIO_CODE_LANGUAGES offers it; raises CodeInvalid saying
    what is offered. Loads that language only (no runtime, no other language's checker)."""
    if name not in settings.languages:
        offered = ", ".join(settings.languages) or "none"
        raise CodeInvalid(
            f"{name} Code nodes are not offered here (STUDIO_CODE_LANGUAGES={offered}): "
            f"rewrite the node in an offered language or add {name} to "
            "STUDIO_CODE_LANGUAGES."
        )
    return get_language(name)
