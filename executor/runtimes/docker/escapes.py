"""The table of known container escapes (``known_escapes.toml`` beside this file) and the
version comparison it needs. Standard library only, so ``scripts/host-setup.sh`` can ask it
with the system's python3 in a few milliseconds, without the project installed:

    python3 -S executor/runtimes/docker/escapes.py runc 1.1.5+ds1 1.1.5+ds1-1+deb12u1

prints one line per advisory that affects that version (exit status 0 either way).

Versions are compared UPSTREAM (``1.1.5+ds1`` is runc 1.1.5). A distribution may carry a fix
as a patch on an older version (Debian's ``1.1.5+ds1-1+deb12u1`` has the CVE-2024-21626
fix): the table's ``distro_fixed`` lists such package versions where they were verified.
"""

from __future__ import annotations

import re
import sys
import tomllib
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

TABLE_PATH = Path(__file__).with_name("known_escapes.toml")
COMPONENTS = ("runc", "containerd", "docker")
#: what ``only_when`` may name: the engine feature an advisory needs
CONDITIONS = ("authorization_plugin", "cri")

# --- upstream versions ------------------------------------------------------------------------

_UPSTREAM = re.compile(r"^v?(\d+)\.(\d+)(?:\.(\d+))?(?:[-~.]?(alpha|beta|rc)\.?(\d+))?", re.I)
_PRE_RANK = {"alpha": 0, "beta": 1, "rc": 2}
_FINAL = 3


class Version(NamedTuple):
    """An upstream version, ordered: ``1.4.0-rc.3`` < ``1.4.0``; what follows the numbers and
    the pre-release (``+ds1``, ``-0-g51d5e94``, ``~ds1-1+deb12u3``) is not part of it."""

    major: int
    minor: int
    patch: int
    pre_rank: int = _FINAL
    pre_num: int = 0

    @property
    def line(self) -> tuple[int, int]:
        """The release line (``(1, 2)`` for 1.2.8)."""
        return (self.major, self.minor)


def parse_version(text: str) -> Version | None:
    """``1.1.5``, ``v1.1.12-0-g51d5e94``, ``1.4.0-rc.3``, ``1.0.0-rc7``, ``1.0-rc6``,
    ``1.1.5+ds1-1+deb12u1``, ``1.6.20~ds1``, ``20.10.24+dfsg1`` -> a Version; None when the
    text does not start with one."""
    m = _UPSTREAM.match(text.strip())
    if m is None:
        return None
    major, minor, patch, pre, num = m.groups()
    rank = _PRE_RANK[pre.lower()] if pre else _FINAL
    return Version(int(major), int(minor), int(patch or 0), rank, int(num or 0))


# --- Debian package versions (dpkg --compare-versions) ------------------------------------------


def _dpkg_order(c: str) -> int:
    # dpkg's lexical order: ~ before everything (even the end), letters before other signs
    if c == "~":
        return -1
    if c.isalpha():
        return ord(c)
    return ord(c) + 256


def _dpkg_part(a: str, b: str) -> int:
    """dpkg's verrevcmp: alternating runs of non-digits (lexical) and digits (numeric)."""
    i = j = 0
    while i < len(a) or j < len(b):
        while (i < len(a) and not a[i].isdigit()) or (j < len(b) and not b[j].isdigit()):
            ac = _dpkg_order(a[i]) if i < len(a) and not a[i].isdigit() else 0
            bc = _dpkg_order(b[j]) if j < len(b) and not b[j].isdigit() else 0
            if ac != bc:
                return ac - bc
            i += 1
            j += 1
        na = nb = ""
        while i < len(a) and a[i].isdigit():
            na += a[i]
            i += 1
        while j < len(b) and b[j].isdigit():
            nb += b[j]
            j += 1
        if int(na or 0) != int(nb or 0):
            return int(na or 0) - int(nb or 0)
    return 0


def dpkg_split(version: str) -> tuple[int, str, str]:
    """A Debian version's epoch, upstream part and revision (``"1.1.5+ds1-1+deb12u1"`` ->
    ``(0, "1.1.5+ds1", "1+deb12u1")``)."""
    epoch, _, rest = version.partition(":") if ":" in version else ("0", "", version)
    upstream, sep, revision = rest.rpartition("-")
    if not sep:
        upstream, revision = rest, ""
    return int(epoch or 0), upstream, revision


def dpkg_compare(a: str, b: str) -> int:
    """<0, 0 or >0 as Debian version ``a`` is older than, equal to or newer than ``b``."""
    ea, ua, ra = dpkg_split(a)
    eb, ub, rb = dpkg_split(b)
    if ea != eb:
        return ea - eb
    return _dpkg_part(ua, ub) or _dpkg_part(ra, rb)


def is_package_version(text: str) -> bool:
    """True for a distribution package version (``1.1.5+ds1-1+deb12u1``), False for a git
    describe (``v1.1.12-0-g51d5e94``), a bare version or a commit id."""
    if not text or not text[0].isdigit() or "-" not in text:
        return False
    return re.search(r"-\d+-g[0-9a-f]{7,}$", text) is None


# --- the table ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Advisory:
    """One known container escape (a ``[[advisory]]`` of known_escapes.toml)."""

    component: str
    cve: str
    ghsa: str
    fixed: tuple[str, ...]
    summary: str
    link: str
    verified: str
    distro_fixed: tuple[str, ...] = field(default=())
    only_when: str | None = None

    def affected(self, version: str, package: str | None = None) -> bool:
        """True when upstream ``version`` lacks the fix and ``package`` (the distribution's
        package version, when known) is not one that carries it as a backport."""
        v = parse_version(version)
        if v is None:
            return True  # a version that cannot be read is not believed fixed
        if package and any(_backported(package, f) for f in self.distro_fixed):
            return False
        fixes = sorted(f for f in (parse_version(x) for x in self.fixed) if f is not None)
        same_line = [f for f in fixes if f.line == v.line]
        if same_line:
            return v < same_line[0]
        return v.line < fixes[-1].line  # an older line no fixed release was made for


def _backported(package: str, fixed: str) -> bool:
    # the same upstream version, at or above the package revision that carries the fix
    return dpkg_split(package)[1] == dpkg_split(fixed)[1] and dpkg_compare(package, fixed) >= 0


_CVE = re.compile(r"^CVE-\d{4}-\d{4,}$")
_GHSA = re.compile(r"^GHSA(-[23456789cfghjmpqrvwx]{4}){3}$")


def _advisory(raw: dict[str, Any]) -> Advisory:
    where = raw.get("cve", "an advisory")
    known = set(Advisory.__dataclass_fields__)
    if set(raw) - known:
        raise ValueError(f"{where}: unknown keys {sorted(set(raw) - known)}")
    adv = Advisory(
        **{
            **raw,
            "fixed": tuple(raw.get("fixed") or ()),
            "distro_fixed": tuple(raw.get("distro_fixed") or ()),
        }
    )
    problems = []
    if adv.component not in COMPONENTS:
        problems.append(f"component {adv.component!r} is not one of {', '.join(COMPONENTS)}")
    if not _CVE.match(adv.cve):
        problems.append(f"cve {adv.cve!r} is not CVE-YYYY-NNNN")
    if not _GHSA.match(adv.ghsa):
        problems.append(f"ghsa {adv.ghsa!r} is not GHSA-xxxx-xxxx-xxxx")
    if not adv.fixed or any(parse_version(f) is None for f in adv.fixed):
        problems.append(f"fixed {list(adv.fixed)} must list upstream versions such as 1.2.8")
    if any(not is_package_version(p) for p in adv.distro_fixed):
        problems.append(f"distro_fixed {list(adv.distro_fixed)} must list package versions")
    if adv.only_when is not None and adv.only_when not in CONDITIONS:
        problems.append(f"only_when {adv.only_when!r} is not one of {', '.join(CONDITIONS)}")
    if problems:
        raise ValueError(f"{TABLE_PATH.name}, {where}: " + "; ".join(problems))
    return adv


@cache
def load_table(path: Path = TABLE_PATH) -> tuple[Advisory, ...]:
    """The known escapes. Raises ValueError naming the entry and what is wrong with it."""
    with path.open("rb") as f:
        data = tomllib.load(f)
    return tuple(_advisory(dict(a)) for a in data.get("advisory", []))


def affecting(
    component: str, version: str, package: str | None = None, table: tuple[Advisory, ...] = ()
) -> list[Advisory]:
    """The advisories of ``component`` that ``version`` (and ``package``) has."""
    return [
        a
        for a in (table or load_table())
        if a.component == component and a.affected(version, package)
    ]


def main(argv: list[str]) -> int:
    """``escapes.py COMPONENT VERSION [PACKAGE_VERSION]``: one line per advisory it has
    (``CVE GHSA fixed-versions [only_when]``); nothing when none."""
    if len(argv) not in (2, 3) or argv[0] not in COMPONENTS:
        print(f"usage: escapes.py {{{'|'.join(COMPONENTS)}}} VERSION [PACKAGE]", file=sys.stderr)
        return 2
    for a in affecting(argv[0], argv[1], argv[2] if len(argv) == 3 else None):
        print(a.cve, a.ghsa, "/".join(a.fixed), a.only_when or "")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
