"""Run INSIDE the image at build time: write what code in it can import to
/usr/share/studio-code/modules.json, and fail the build if a listed package is missing.

    python3 record_modules.py requirements.txt [packages.lock] > /usr/share/studio-code/modules.json

{"python": "3.12.7", "stdlib": [...], "packages": {"pydantic": ["pydantic"], ...},
 "modules": [every top-level module importable from outside the standard library],
 "versions": {"pydantic": "2.10.3", ...},      # each listed package's installed version
 "requirements": ["pydantic", "python-dateutil==2.9.*"],   # the list as it was asked for
 "lock": {"annotated-types": "0.7.0", ...}}    # every installed distribution

"packages" keeps its first shape (name -> modules), so an older executor reads a newer image.
With a second argument, the lock is also written there as `name==version` lines: pip's
constraints format, so `studio-code image build --python-constraints` rebuilds the same.
"""

import importlib.metadata as md
import json
import os
import pkgutil
import re
import sys
import sysconfig


def requirements(path):
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            line = line.split("#", 1)[0].strip()
            if line:
                out.append(line)
    return out


def name_of(requirement):
    return re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]


def installed_modules():
    """Top-level modules importable from outside the standard library folders."""
    paths = sysconfig.get_paths()
    stdlib = {os.path.realpath(paths["stdlib"]), os.path.realpath(paths["platstdlib"])}
    stdlib.add(os.path.dirname(os.path.realpath(__file__)))  # this script's own folder
    out = set()
    for m in pkgutil.iter_modules():
        where = os.path.realpath(getattr(m.module_finder, "path", "") or "")
        if where and where not in stdlib and not where.endswith("lib-dynload"):
            out.add(m.name)
    return out


def norm(name):
    return re.sub(r"[-_.]+", "-", name).lower()


def main():
    installed = installed_modules()
    by_module = md.packages_distributions()
    dists = {}
    for module, owners in by_module.items():
        for owner in owners:
            dists.setdefault(norm(owner), set()).add(module)
    versions_of = {}
    for dist in md.distributions():
        name = dist.metadata["Name"]
        if name:
            versions_of.setdefault(norm(name), (name, dist.version))
    packages, versions, missing = {}, {}, []
    asked = requirements(sys.argv[1])
    for name in map(name_of, asked):
        key = norm(name)
        modules = sorted(m for m in dists.get(key, ()) if not m.startswith("_"))
        if not modules:
            # A distribution packaged without RECORD or top_level.txt (Debian's, often):
            # its module is its name, maybe without a python- prefix.
            guesses = {key.replace("-", "_"), key.removeprefix("python-").replace("-", "_")}
            modules = sorted(guesses & installed)
        if not modules:
            missing.append(name)
        packages[name] = modules
        if key in versions_of:
            versions[name] = versions_of[key][1]
    if missing:
        sys.exit("record_modules: not installed in the image: " + ", ".join(missing))
    out = {
        "python": sys.version.split()[0],
        "stdlib": sorted(sys.stdlib_module_names),
        "packages": packages,
        "modules": sorted(m for m in installed | set(by_module) if not m.startswith("_")),
        "versions": versions,
        "requirements": asked,
        "lock": {name: version for name, version in sorted(versions_of.values())},
    }
    if len(sys.argv) > 2:
        with open(sys.argv[2], "w", encoding="utf-8") as f:
            f.write("# Every Python distribution in this image (pip constraints format).\n")
            f.writelines(f"{n}=={v}\n" for n, v in sorted(versions_of.values()))
    json.dump(out, sys.stdout, indent=1, sort_keys=True)
    sys.stdout.write("\n")


main()
