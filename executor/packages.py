"""The package lists: ``STUDIO_CODE_TS_PACKAGES`` and its parser, and what an image says
it has.

A list such as ``npm:zod@3,npm:date-fns@4`` names the only packages a TypeScript node may
import, each pinned to a major. Settings parse it at start-up; the save-time check
(``executor.languages.ts_imports``) compares a node's imports with it. This module is apart
from that check so that reading the settings loads no TypeScript parser.

An image built by ``studio-code image build`` (docker/build.sh) says what it has: the label
``studio.packages`` (``pydantic==2.10.3,...``; ``npm:zod@3.25.76,...``) and, for Python,
``modules.json``'s ``versions``. The runtime reads them (``ImageFacts.packages()``, e.g.
executor/runtimes/docker/images.py) into an ``ImagePackages``; ``shown_packages`` is what
the editor and meta show (an unset STUDIO_CODE_PACKAGES means the image's own list), and
``packages_warning`` is the one sentence readiness and meta give when a setting disagrees
with the image.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING, Final, NoReturn

if TYPE_CHECKING:
    from executor.settings import Settings

__all__ = [
    "DEFAULT_PYTHON_PACKAGES",
    "DEFAULT_TS_PACKAGES",
    "PACKAGES_LABEL",
    "SETTING_REASONS",
    "ImagePackages",
    "PackageSpec",
    "compares",
    "packages_warning",
    "parse_image_packages",
    "parse_packages",
    "parse_preimport",
    "shown_packages",
]

#: Default of ``STUDIO_CODE_PACKAGES`` (the seed's image): what is shown when the image's own
#: list cannot be read (no Docker, the subprocess runtime, an image without modules.json).
DEFAULT_PYTHON_PACKAGES: Final = "pydantic,python-dateutil"

#: The image label that lists the packages at their versions (docker/build.sh writes it).
PACKAGES_LABEL: Final = "studio.packages"

#: Default of the ``STUDIO_CODE_TS_PACKAGES`` setting; ``docker/studio-code-ts/deps.ts`` must
#: import exactly these packages (a test checks it), since that file fills the image's cache.
DEFAULT_TS_PACKAGES: Final = "npm:zod@3,npm:date-fns@4"

#: Reasons ``parse_packages`` gives for a bad ``STUDIO_CODE_TS_PACKAGES`` entry.
SETTING_REASONS: Final[Mapping[str, str]] = MappingProxyType(
    {
        "entry": (
            "STUDIO_CODE_TS_PACKAGES entry '{entry}' {problem}: write each package as"
            " npm:name@major, e.g. npm:zod@3"
        ),
        "no_registry": "has no registry",
        "registry": "has the unsupported registry '{registry}' (use npm or jsr)",
        "name": "has an invalid package name '{name}'",
        "jsr_scope": "names a jsr package without a scope (jsr names are @scope/name)",
        "unpinned": "is not pinned",
        "not_a_major": "is not pinned to a major version ('{version}' is not a plain major number)",
        "duplicate": "repeats the package {package}, which is already listed",
    }
)
_SETTING: Final = "STUDIO_CODE_TS_PACKAGES"

#: The registries a package may come from.
REGISTRIES: Final = ("npm", "jsr")
# npm's name rules, loosely: no leading dot/underscore, no spaces or slashes inside a part.
NAME_PART: Final = r"[A-Za-z0-9~][A-Za-z0-9._~-]*"
_NAME_RE: Final = re.compile(rf"(?:@{NAME_PART}/)?{NAME_PART}")
_MAJOR_RE: Final = re.compile(r"0|[1-9][0-9]*")
#: A specifier's scheme (``npm:``, ``jsr:``, ``https:``...).
SCHEME_RE: Final = re.compile(r"(?P<scheme>[A-Za-z][A-Za-z0-9+.-]*):")


@dataclass(frozen=True)
class PackageSpec:
    """One allowed package: ``npm:zod@3`` is ``PackageSpec("npm", "zod", 3)``."""

    registry: str
    name: str
    major: int

    def __str__(self) -> str:
        return f"{self.registry}:{self.name}@{self.major}"


def parse_packages(value: str, *, source: str = _SETTING) -> tuple[PackageSpec, ...]:
    """Parse ``STUDIO_CODE_TS_PACKAGES``, e.g. ``'npm:zod@3,npm:date-fns@4'``.

    Blank entries are ignored and ``''`` gives ``()``, which allows no package. Raises
    ValueError with a sentence naming the bad entry and the expected form, e.g.
    "STUDIO_CODE_TS_PACKAGES entry 'npm:zod' is not pinned: write each package as
    npm:name@major, e.g. npm:zod@3". ``source`` names the list in that sentence
    (``studio-code image build`` checks its --ts-packages with it).
    """
    specs: list[PackageSpec] = []
    seen: set[tuple[str, str]] = set()
    for raw in value.split(","):
        entry = raw.strip()
        if not entry:
            continue
        try:
            spec = _parse_entry(entry)
            if (spec.registry, spec.name) in seen:
                package = f"{spec.registry}:{spec.name}"
                _bad_entry(entry, "duplicate", package=package)
        except ValueError as e:
            if source == _SETTING:
                raise
            raise ValueError(str(e).replace(_SETTING, source, 1)) from None
        seen.add((spec.registry, spec.name))
        specs.append(spec)
    return tuple(specs)


def _parse_entry(entry: str) -> PackageSpec:
    scheme = SCHEME_RE.match(entry)
    if scheme is None:
        _bad_entry(entry, "no_registry")
    registry = scheme["scheme"]
    if registry not in REGISTRIES:
        _bad_entry(entry, "registry", registry=registry)
    rest = entry[scheme.end() :]
    # The version follows the last "@"; a scoped name's own "@" is always first.
    name, at, pinned = rest.rpartition("@")
    version: str | None = pinned
    if not at or not name:
        name, version = rest, None
    if not _NAME_RE.fullmatch(name):
        _bad_entry(entry, "name", name=name)
    if registry == "jsr" and not name.startswith("@"):
        _bad_entry(entry, "jsr_scope")
    if version is None or version == "":
        _bad_entry(entry, "unpinned")
    if not _MAJOR_RE.fullmatch(version):
        _bad_entry(entry, "not_a_major", version=version)
    return PackageSpec(registry, name, int(version))


def _bad_entry(entry: str, problem: str, **fields: str) -> NoReturn:
    detail = SETTING_REASONS[problem].format(**fields)
    raise ValueError(SETTING_REASONS["entry"].format(entry=entry, problem=detail))


_MODULE_RE: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")


def parse_preimport(value: str) -> str:
    """``STUDIO_CODE_PREIMPORT``: ``""`` (none), ``image`` (the image's listed packages) or
    module names as code imports them (``pandas,numpy,dateutil.parser``); normalised to
    that comma-separated form. Raises ValueError with a sentence naming a bad entry."""
    entries = [x.strip() for x in value.split(",") if x.strip()]
    if entries == ["image"]:
        return "image"
    if "image" in entries:
        raise ValueError(
            "STUDIO_CODE_PREIMPORT entry 'image' stands for every package the image lists: "
            "write it alone, or name the modules instead"
        )
    for entry in entries:
        if not _MODULE_RE.fullmatch(entry):
            raise ValueError(
                f"STUDIO_CODE_PREIMPORT entry '{entry}' is not a module name: write the "
                "modules as code imports them, comma-separated (pandas,numpy), or image for "
                "every package the image lists"
            )
    return ",".join(dict.fromkeys(entries))


# --- what an image says it has -------------------------------------------------------------


@dataclass(frozen=True)
class ImagePackages:
    """The packages one image lists: Python's by PyPI name, TypeScript's by the allow-list's
    spec (``npm:zod@3``), each with the version built in ("" when the image does not say)."""

    image: str
    versions: Mapping[str, str]


def parse_image_packages(label: str, language: str) -> dict[str, str]:
    """The ``studio.packages`` label: ``cowsay==6.1,python-dateutil==2.8.2`` gives
    ``{"cowsay": "6.1", ...}``; ``npm:zod@3.25.76`` gives ``{"npm:zod@3": "3.25.76"}``.
    An entry of another shape is skipped."""
    out: dict[str, str] = {}
    for entry in (x.strip() for x in label.split(",")):
        if language == "python":
            name, sep, version = entry.partition("==")
            if name and sep:
                out[name] = version
        else:
            scheme = SCHEME_RE.match(entry)
            name, at, version = entry[scheme.end() :].rpartition("@") if scheme else ("", "", "")
            major = version.split(".", 1)[0]
            if scheme and at and name and _MAJOR_RE.fullmatch(major):
                out[f"{scheme['scheme']}:{name}@{major}"] = version
    return out


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
