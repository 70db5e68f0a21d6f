"""``studio-code image build``: the sandbox images from a package list, in one command.

    studio-code image build --python-packages "requests==2.32.*,pandas" \\
        --ts-packages "npm:zod@3,npm:date-fns@4" [--wheels DIR] [--offline|--registry]

The lists are checked here (a bad entry is refused before anything is built, with
REQUEST_INVALID and the entry named), written as a requirements file and a ``deps.ts``, and
handed to ``docker/build.sh``, which builds each image (from a registry base, or offline:
debootstrap + PyPI wheels for the image's own Python + ``docker import``), pins and records
the versions in the image (``/usr/share/studio-code/packages.lock``, ``modules.json``, the
``studio.packages`` label) and imports every package under the sandbox policy. A package
that cannot be had fails the build, named: IMAGE_BUILD_FAILED.

Without a list for either language both images are built with the repository's lists
(``docker/studio-code/requirements.txt``, ``docker/studio-code-ts/deps.ts``): ``make image``.
build.sh's progress goes to stderr; stdout gets ONE JSON object: each image built, its id and
its packages at their versions, and the STUDIO_CODE_TS_PACKAGES value that fits it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from executor.settings import Settings

ROOT = Path(__file__).resolve().parents[1]
BUILD_SH = ROOT / "docker" / "build.sh"
DEFAULT_REQUIREMENTS = ROOT / "docker" / "studio-code" / "requirements.txt"
DEFAULT_DEPS_TS = ROOT / "docker" / "studio-code-ts" / "deps.ts"

REQUEST_INVALID = "REQUEST_INVALID"
#: the build ran and failed (a package that cannot be had, no engine, no mirror...)
IMAGE_BUILD_FAILED = "IMAGE_BUILD_FAILED"

# PEP 508's name, extras, then version specifiers (and an optional environment marker).
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_REQUIREMENT = re.compile(
    rf"(?P<name>{_NAME})(?:\[[A-Za-z0-9._,-]+\])?"
    r"(?P<spec>(?:\s*(?:===|==|!=|~=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+\s*,?)*)(?:\s*;.*)?"
)
_TS_SPEC = re.compile(r"""["']((?:npm|jsr):[^"']+)["']""")


class ListInvalid(ValueError):
    """A package list the command refuses, with a sentence naming the entry."""


class ImageRefused(Exception):
    """Raised when the command cannot build: a bad list (REQUEST_INVALID, exit status 2) or
    a build that failed (IMAGE_BUILD_FAILED, 1); the CLI prints it as its refusal."""

    def __init__(self, code: str, message: str, exit_status: int) -> None:
        super().__init__(message)
        self.code, self.message, self.exit_status = code, message, exit_status


def python_requirements(text: str, source: str) -> list[str]:
    """The requirements of a comma- or line-separated list (``#`` starts a comment): each
    a PyPI name with an optional version (``requests``, ``requests==2.32.*``,
    ``pandas>=2,<3``). A name twice, a URL or a pip option is refused."""
    out: list[str] = []
    seen: dict[str, str] = {}
    for line in text.splitlines():
        line = line.split("#", 1)[0]
        # commas separate entries, except inside a specifier list (`>=2,<3`)
        for entry in re.split(r",(?=\s*[A-Za-z0-9])", line):
            entry = entry.strip()
            if not entry:
                continue
            m = _REQUIREMENT.fullmatch(entry)
            if m is None:
                raise ListInvalid(
                    f"{source} entry '{entry}' is not a package: write a PyPI name with an "
                    "optional version, e.g. requests or requests==2.32.* (no URL, path or pip "
                    "option; give a wheel folder with --wheels)"
                )
            key = re.sub(r"[-_.]+", "-", m["name"]).lower()
            if key in seen:
                raise ListInvalid(
                    f"{source} names {m['name']} twice ('{seen[key]}' and '{entry}'): keep one"
                )
            seen[key] = entry
            out.append(re.sub(r"\s+", "", entry.split(";", 1)[0]))
    return out


_PIN = re.compile(rf"{_NAME}==[A-Za-z0-9](?:[A-Za-z0-9.+!_-]*[A-Za-z0-9])?")


def python_constraints(text: str, source: str) -> list[str]:
    """The pins of a constraints file (an image's ``packages.lock``): one ``name==version``
    a line, ``#`` comments and blank lines allowed, each name once (read with
    ``python_requirements``). Anything else is refused, its line named: a pip option
    (``--index-url``, ``--find-links``, ``-r``...), a URL, a range, extras or a marker. pip
    is then handed a file written from these pins only (``build_images``), never this one."""
    pins: list[str] = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {number}"
        if _PIN.fullmatch(line) is None:
            raise ListInvalid(
                f"{where} '{line[:200]}' is not a pin: a constraints file holds one "
                "name==version a line (e.g. an image's packages.lock), with # comments and "
                "blank lines; no pip option (--index-url, --find-links, -r...), URL, range "
                "or marker (give a wheel folder with --wheels)"
            )
        try:
            [pin] = python_requirements(line, where)
        except ValueError as e:  # a comma in the version: not one pin
            raise ListInvalid(f"{where} '{line[:200]}' is not one pin: {e}") from None
        pins.append(pin)
    python_requirements("\n".join(pins), source)  # each name once
    return pins


def ts_specs(text: str, source: str) -> list[str]:
    """The specifiers of a list (``npm:zod@3,npm:date-fns@4``, commas or lines) or of a
    ``deps.ts`` (its quoted ``npm:``/``jsr:`` imports), each checked as
    STUDIO_CODE_TS_PACKAGES checks them (pinned to a major)."""
    from executor.packages import parse_packages

    code = "\n".join(line.split("//", 1)[0] for line in text.splitlines())  # no comments
    found = _TS_SPEC.findall(code)
    if not found:
        found = [x for line in text.splitlines() for x in line.split("#", 1)[0].split(",")]
    try:
        return [str(p) for p in parse_packages(",".join(found), source=source)]
    except ValueError as e:
        raise ListInvalid(str(e)) from e


def _read(path: str, option: str) -> str:
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ListInvalid(f"Cannot read {option} {path}: {e}. Give a UTF-8 text file.") from e


def _labels(image: str) -> dict[str, Any]:
    out = subprocess.run(
        ["docker", "image", "inspect", image],
        capture_output=True,
        text=True,
        timeout=60,
    )
    if out.returncode != 0:
        return {}
    info = json.loads(out.stdout)[0]
    labels = info.get("Config", {}).get("Labels") or {}
    return {"id": info.get("Id"), "labels": labels}


def _built(image: str, language: str) -> dict[str, Any]:
    from executor.packages import parse_image_packages

    found = _labels(image)
    labels = found.get("labels", {})
    versions = parse_image_packages(labels.get("studio.packages", ""), language)
    entry: dict[str, Any] = {"image": image, "id": found.get("id"), "packages": versions}
    if language == "python":
        entry["python"] = labels.get("studio.python")
    return entry


def build_images(args: argparse.Namespace, settings: Settings) -> dict[str, Any]:
    """``studio-code image build``: what it prints when the images are built; ImageRefused
    otherwise (api_client.cli.cmd_image prints either)."""
    try:
        plan = check_lists(args)
    except ListInvalid as e:
        raise ImageRefused(REQUEST_INVALID, str(e), 2) from None
    if not BUILD_SH.exists():
        raise ImageRefused(
            IMAGE_BUILD_FAILED,
            f"{BUILD_SH} is not here: run studio-code image build from a checkout of the "
            "repository (the build script and the image recipes live in docker/).",
            1,
        )
    py_image = args.python_tag or settings.code_image
    ts_image = args.ts_tag or settings.code_ts_image
    with tempfile.TemporaryDirectory(prefix="studio-image-") as tmp:
        env = build_env(args, plan, Path(tmp), py_image, ts_image)
        targets = [lang for lang in ("python", "typescript") if plan[lang] is not None]
        target = targets[0] if len(targets) == 1 else "all"
        mode = ["--offline"] if args.offline else ["--registry"] if args.registry else []
        started = time.monotonic()
        error = _run_build([str(BUILD_SH), target, *mode], env)
        seconds = round(time.monotonic() - started, 1)
    if error is not None:
        raise ImageRefused(IMAGE_BUILD_FAILED, error, 1)
    images = {}
    if "python" in targets:
        images["python"] = _built(py_image, "python")
    if "typescript" in targets:
        images["typescript"] = _built(ts_image, "typescript")
    out: dict[str, Any] = {"ok": True, "command": "image", "images": images, "seconds": seconds}
    if plan["typescript"] is not None:
        # the allow-list that fits the image (the spec fixes its default; an image with other
        # packages needs it set: readiness and meta say so otherwise)
        out["settings"] = {"STUDIO_CODE_TS_PACKAGES": ",".join(plan["typescript"])}
    return out


def build_env(
    args: argparse.Namespace,
    plan: dict[str, list[str] | None],
    folder: Path,
    py_image: str,
    ts_image: str,
) -> dict[str, str]:
    """build.sh's environment; the files it reads (requirements, deps.ts, constraints) are
    written in ``folder`` from the checked lists of ``plan``, never the caller's files."""
    env = dict(os.environ)
    # the host's pip and python3 for build.sh: this interpreter's (it has pip)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("STUDIO_PIP", f"{sys.executable} -m pip")
    env["STUDIO_CODE_IMAGE"] = py_image
    env["STUDIO_CODE_TS_IMAGE"] = ts_image
    if plan["python"] is not None:
        req = folder / "requirements.txt"
        req.write_text("".join(f"{r}\n" for r in plan["python"]), encoding="utf-8")
        env["STUDIO_PY_REQUIREMENTS"] = str(req)
    if plan["typescript"] is not None:
        deps = folder / "deps.ts"
        deps.write_text("".join(f'import "{s}";\n' for s in plan["typescript"]), "utf-8")
        env["STUDIO_TS_DEPS"] = str(deps)
    if args.wheels:
        env["STUDIO_PY_WHEELS"] = str(Path(args.wheels).resolve())
    if plan["constraints"] is not None:
        pins = folder / "constraints.txt"
        pins.write_text("".join(f"{c}\n" for c in plan["constraints"]), encoding="utf-8")
        env["STUDIO_PY_CONSTRAINTS"] = str(pins)
    if args.debian_only:
        env["STUDIO_PY_SOURCE"] = "debian"
    return env


def check_lists(args: argparse.Namespace) -> dict[str, list[str] | None]:
    """Each language's checked list (None: that image is not built), and the checked pins
    of --python-constraints (None: none given); ListInvalid names a bad entry."""
    py: list[str] | None = None
    ts: list[str] | None = None
    if args.python_packages is not None:
        py = python_requirements(args.python_packages, "--python-packages")
    elif args.python_packages_file:
        text = _read(args.python_packages_file, "--python-packages-file")
        py = python_requirements(text, f"--python-packages-file {args.python_packages_file}")
    if args.ts_packages is not None:
        ts = ts_specs(args.ts_packages, "--ts-packages")
    elif args.ts_packages_file:
        text = _read(args.ts_packages_file, "--ts-packages-file")
        ts = ts_specs(text, f"--ts-packages-file {args.ts_packages_file}")
    if py is None and ts is None:  # the repository's lists: make image
        py = python_requirements(DEFAULT_REQUIREMENTS.read_text("utf-8"), str(DEFAULT_REQUIREMENTS))
        ts = ts_specs(DEFAULT_DEPS_TS.read_text("utf-8"), str(DEFAULT_DEPS_TS))
    for option in ("wheels", "python_constraints"):
        value = getattr(args, option)
        flag = "--" + option.replace("_", "-")
        if value and py is None:
            raise ListInvalid(f"{flag} is for the Python image: give --python-packages too")
        if option == "wheels" and value and not Path(value).is_dir():
            raise ListInvalid(f"--wheels {value} is not a folder: give a folder of .whl files")
        if option == "python_constraints" and value and not Path(value).is_file():
            raise ListInvalid(
                f"--python-constraints {value} is not a file: give a pip "
                "constraints file, e.g. an image's packages.lock"
            )
    constraints = None
    if args.python_constraints:
        text = _read(args.python_constraints, "--python-constraints")
        constraints = python_constraints(text, f"--python-constraints {args.python_constraints}")
    return {"python": py, "typescript": ts, "constraints": constraints}


def _run_build(argv: list[str], env: dict[str, str]) -> str | None:
    """Run build.sh, its output passed on to stderr (stdout is this command's JSON); None
    when it built, else its last ERROR line as a sentence."""
    proc = subprocess.Popen(
        argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    )
    last_error = ""
    assert proc.stdout is not None
    for line in proc.stdout:
        sys.stderr.write(line)
        if "ERROR:" in line:
            last_error = line.split("ERROR:", 1)[1].strip()
    if proc.wait() == 0:
        return None
    why = last_error or f"docker/build.sh exited with status {proc.returncode}"
    return f"The image build failed: {why.rstrip('.')}. Its log above (stderr) has the details."


def add_image_command(sub: Any, handler: Any) -> None:
    """``image build``: added to the CLI's parser by api_client.cli, with its ``handler``."""
    image = sub.add_parser("image", help="build the sandbox images from a package list")
    what = image.add_subparsers(dest="image_command", required=True, metavar="ACTION")
    build = what.add_parser(
        "build",
        help="build studio-code:1 / studio-code-ts:1 (STUDIO_CODE_IMAGE, STUDIO_CODE_TS_IMAGE)",
        description="Build the sandbox images from package lists. Only the images whose "
        "list is given are built; with no list, both, from the repository's lists.",
    )
    py = build.add_mutually_exclusive_group()
    py.add_argument(
        "--python-packages",
        metavar="LIST",
        help='PyPI requirements, comma-separated: "requests==2.32.*,pandas"',
    )
    py.add_argument("--python-packages-file", metavar="FILE", help="a requirements file")
    ts = build.add_mutually_exclusive_group()
    ts.add_argument(
        "--ts-packages", metavar="LIST", help='npm:name@major, comma-separated: "npm:zod@3"'
    )
    ts.add_argument(
        "--ts-packages-file", metavar="FILE", help="a deps.ts, or one npm:name@major a line"
    )
    build.add_argument(
        "--wheels",
        metavar="DIR",
        help="a folder of wheels: the Python packages come from it only (air-gapped sites)",
    )
    build.add_argument(
        "--python-constraints",
        metavar="FILE",
        help="pip constraints for every distribution (an image's packages.lock rebuilds it)",
    )
    build.add_argument(
        "--debian-only",
        action="store_true",
        help="offline: Debian's python3-<name> packages instead of PyPI wheels",
    )
    build.add_argument("--python-tag", metavar="TAG", help="default: STUDIO_CODE_IMAGE")
    build.add_argument("--ts-tag", metavar="TAG", help="default: STUDIO_CODE_TS_IMAGE")
    mode = build.add_mutually_exclusive_group()
    mode.add_argument("--offline", action="store_true", help="no container registry")
    mode.add_argument("--registry", action="store_true", help="docker build FROM a base")
    build.set_defaults(handler=handler)
