"""The package lists: ``STUDIO_CODE_TS_PACKAGES`` and its parser, and what an image says
it has.

A list such as ``npm:zod@3,npm:date-fns@4`` names the only packages a TypeScript node may
import, each pinned to a major. Settings parse it at start-up; the save-time check
(``executor.languages.ts_imports``) compares a node's imports with it. This module is apart
from that check so that reading the settings loads no TypeScript parser.

An image built by ``studio-code image build`` (docker/build.sh) says what it has: the label
``studio.packages`` (``pydantic==2.10.3,...``; ``npm:zod@3.25.76,...``) and, for Python,
``modules.json``'s ``versions``. The runtime reads them (``ImageFacts.packages()``, e.g.
executor/runtimes/docker/images.py) into an ``ImagePackages``; what the editor, meta and
readiness make of it against the settings is executor/package_lists.py (this module is
what the settings import: it imports no settings).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, NoReturn

__all__ = [
    "DEFAULT_PYTHON_PACKAGES",
    "DEFAULT_TS_PACKAGES",
    "PACKAGES_LABEL",
    "SETTING_REASONS",
    "ImagePackages",
    "PackageSpec",
    "parse_image_packages",
    "parse_packages",
    "parse_preimport",
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
