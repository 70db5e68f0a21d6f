"""The package lists the editor, meta and readiness show: a language's setting
(``STUDIO_CODE_PACKAGES``, ``STUDIO_CODE_TS_PACKAGES``) against what its image lists at its
versions (``ImagePackages``, as the runtime read it: ``ImageFacts.packages()``).

``shown_packages`` is what the editor and meta show (an unset STUDIO_CODE_PACKAGES means the
image's own list), and ``packages_warning`` is the one sentence readiness and meta give when
a setting disagrees with the image. Apart from executor/packages.py, which the settings
import, so that neither module imports the other back.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from executor.packages import ImagePackages
    from executor.settings import Settings


def _same(name: str) -> str:
    return name


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def shown_packages(settings: Settings, language: str, found: ImagePackages | None) -> list[str]:
    """The list the editor shows: STUDIO_CODE_TS_PACKAGES for TypeScript (the allow-list);
    for Python STUDIO_CODE_PACKAGES when it is set, else the image's own list (``found``),
    else the seed's default."""
    if language != "python":
        return [str(p) for p in settings.ts_packages]
    if "code_packages" in settings.model_fields_set or found is None:
        return list(settings.python_packages)
    return list(found.versions)


def compares(settings: Settings, language: str) -> bool:
    """Whether ``packages_warning`` can say anything: a TypeScript list (always set, the
    spec's default or not), or a STUDIO_CODE_PACKAGES that is set. Readiness reads the image
    only then."""
    return language != "python" or "code_packages" in settings.model_fields_set


def packages_warning(settings: Settings, language: str, found: ImagePackages | None) -> str | None:
    """One sentence naming the packages a setting lists that the image has not, and those the
    image has that it leaves out; None when they agree or the image's list is unknown. An
    unset STUDIO_CODE_PACKAGES is the image's list, so it never disagrees."""
    if found is None or not compares(settings, language):
        return None
    if language == "python":
        setting, listed = "STUDIO_CODE_PACKAGES", list(settings.python_packages)
        key: Callable[[str], str] = _norm
        how = "unset it (the image's own list is then shown) or set it to"
    else:
        setting, listed = "STUDIO_CODE_TS_PACKAGES", [str(p) for p in settings.ts_packages]
        key = _same
        how = "set it to"
    have = {key(name): name for name in found.versions}
    named = {key(name): name for name in listed}
    absent = [named[k] for k in named if k not in have]
    extra = [have[k] for k in have if k not in named]
    if not absent and not extra:
        return None
    parts = []
    if absent:
        parts.append(f"lists {', '.join(absent)}, which the image {found.image} does not have")
    if extra:
        where = "it" if absent else f"the image {found.image}"
        parts.append(f"leaves out {', '.join(extra)}, which {where} has")
    return f"{setting} {', and '.join(parts)}: {how} {','.join(found.versions)}."
