"""The sandbox's own seccomp profile: ``seccomp.json`` beside this file, derived from Docker's
default profile by ``docker/seccomp/derive.py`` (docs/security.md lists what it removes and
why). The docker runtime passes it with every container (``sandbox_policy``); runtime meta
shows its sha256 so an operator can check which profile the sandboxes run under.

Under gVisor (runsc, registered with ``--oci-seccomp``) the same profile is applied by gVisor's
own kernel with one difference, ``for_gvisor``: runsc (20221219, Debian 12's) answers every
SCMP_ACT_ERRNO rule with EPERM, ignoring the rule's ``errnoRet``. The profile answers ``clone3``
with ENOSYS (its flags are behind a pointer, so no filter can check them for namespace flags:
glibc then falls back to ``clone``, whose flags the profile does check). Answered EPERM, glibc
does not fall back and no thread starts: Deno failed to start under runsc. gVisor's kernel of
this release has no clone3 at all (it answers ENOSYS itself, seen with runsc --strace), so the
gVisor variant lets clone3 through to it; tests/test_docker_isolation.py checks from inside a
runsc sandbox that clone3 still answers ENOSYS (a gVisor that implements clone3 fails it)."""

from __future__ import annotations

import copy
import errno
import hashlib
import json
from functools import cache
from pathlib import Path
from typing import Any

PROFILE_PATH = Path(__file__).with_name("seccomp.json")


@cache
def profile_bytes() -> bytes:
    """The profile file as shipped (what the sha256 is of)."""
    return PROFILE_PATH.read_bytes()


def for_gvisor(profile: dict[str, Any]) -> dict[str, Any]:
    """The profile as gVisor gets it: each ENOSYS rule (``clone3``) lets the call through to
    gVisor's kernel, which answers ENOSYS itself (see the module's docstring)."""
    out = copy.deepcopy(profile)
    for rule in out["syscalls"]:
        if rule.get("action") == "SCMP_ACT_ERRNO" and rule.get("errnoRet") == errno.ENOSYS:
            rule["action"] = "SCMP_ACT_ALLOW"
            del rule["errnoRet"]
    return out


@cache
def profile_json(gvisor: bool = False) -> str:
    """The profile as compact JSON text, for ``security_opt: ["seccomp=<text>"]`` (the
    daemon takes the profile's text, not a path: the docker CLI reads the file itself);
    ``gvisor``: its variant for runsc (``for_gvisor``)."""
    profile = json.loads(profile_bytes())
    return json.dumps(for_gvisor(profile) if gvisor else profile, separators=(",", ":"))


@cache
def profile_sha256(gvisor: bool = False) -> str:
    """The sha256 of the file (``gvisor``: of the variant's compact JSON text)."""
    if gvisor:
        return hashlib.sha256(profile_json(gvisor=True).encode()).hexdigest()
    return hashlib.sha256(profile_bytes()).hexdigest()


def is_gvisor(oci_runtime: str | None) -> bool:
    """A runtime name that is gVisor's: runsc, or an entry named after it (runsc-kvm)."""
    return bool(oci_runtime) and str(oci_runtime).startswith("runsc")
