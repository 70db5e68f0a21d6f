"""The dependency lock: requirements.lock pins every package pyproject.toml asks for, inside
its range; the majors whose internals the worker uses stay bounded; and every install path
(`make install`, the app image that Compose builds too, the TypeScript sandbox image's deno)
takes the lock's versions. Static: it reads the files, no index is asked."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parent.parent
LOCK = ROOT / "requirements.lock"

#: the packages whose internals the worker relies on (kombu's Redis key layout and unacked
#: hash, a transport subclass, Celery's consumer): a new major must be a decision
BOUNDED = ("celery", "kombu", "redis")


def _pins() -> dict[str, Version]:
    pins: dict[str, Version] = {}
    for line in LOCK.read_text().splitlines():
        if not line or line[0] in " #":
            continue
        req = Requirement(line)
        (spec,) = req.specifier
        assert spec.operator == "==", f"not an exact pin in requirements.lock: {line}"
        pins[canonicalize_name(req.name)] = Version(spec.version)
    return pins


def _wanted() -> list[Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["http"], *extras["otel"], *extras["dev"]]
    return [Requirement(r) for r in wanted]


def test_the_lock_pins_every_dependency_inside_its_range() -> None:
    pins = _pins()
    missing = [str(r) for r in _wanted() if canonicalize_name(r.name) not in pins]
    assert not missing, f"not in requirements.lock (run `make lock`): {missing}"
    outside = [
        f"{r} (locked {pins[canonicalize_name(r.name)]})"
        for r in _wanted()
        if not r.specifier.contains(pins[canonicalize_name(r.name)], prereleases=True)
    ]
    assert not outside, f"requirements.lock is outside pyproject.toml's range: {outside}"
    # the two the lock adds: the venv's installer and the app image's build backend
    assert {"pip", "hatchling"} <= pins.keys()


def test_celery_kombu_and_redis_stay_below_their_next_major() -> None:
    pins = _pins()
    declared = {canonicalize_name(r.name): r for r in _wanted()}
    for name in BOUNDED:
        assert name in declared, f"{name} is not a direct dependency in pyproject.toml"
        nxt = Version(f"{pins[name].major + 1}")
        assert not declared[name].specifier.contains(nxt, prereleases=True), (
            f"pyproject.toml lets {name} {nxt} in: keep `<{nxt}` until the worker is checked "
            "against it (docs/operations.md, Upgrading dependencies)"
        )


def test_make_install_and_the_app_image_install_the_lock() -> None:
    makefile = (ROOT / "Makefile").read_text()
    stamp = re.search(r"^\$\(STAMP\):(.*)$", makefile, re.M)
    assert stamp and "$(LOCK)" in stamp.group(1), "make install must rerun when the lock changes"
    assert re.search(r"^LOCK := requirements\.lock$", makefile, re.M)
    assert re.search(r"pip install -q -c \$\(LOCK\) -e '\.\[http,dev\]'", makefile)
    assert re.search(r"pip install -q -c \$\(LOCK\) --upgrade pip", makefile)
    # the app image (deploy/build-images.sh and Compose's build both use deploy/Dockerfile)
    dockerfile = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^COPY [^\n]*requirements\.lock", dockerfile, re.M)
    assert re.search(r'-c requirements\.lock \\\n\s+hatchling "\.\[\$\{EXTRAS\}\]"', dockerfile)
    assert re.search(r"^ARG EXTRAS=http$", dockerfile, re.M)  # the API's extra by default
    ignore = (ROOT / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
    assert "!requirements.lock" in ignore
    assert '"$ROOT/requirements.lock"' in (ROOT / "deploy" / "build-images.sh").read_text()
