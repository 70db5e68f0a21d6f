"""gVisor (runsc) as a matrix axis of the sandbox suites: which OCI runtimes a suite runs
under (``OCI_RUNTIMES``), the rule a missing runsc follows (``require_runsc``: skip on a
laptop, fail under CI=true, where scripts/host-setup.sh registered it), and the proof FROM
INSIDE a sandbox of which kernel its code met (``KERNEL_PROBE`` and ``kernel_seen``).

The marker: gVisor's kernel reports its own fixed release (``4.4.0``; /proc/version
``Linux version 4.4.0 #1 SMP Sun Jan 10 15:06:54 PST 2016``), a runc sandbox the host's own
(``os.uname().release`` of the test's process, which shares the host's kernel). Both are
read: the release must be the host's under runc, and under runsc it must differ from the
host's and be gVisor's."""

from __future__ import annotations

import os
from typing import Any

from testkit.processes import require

RUNC, RUNSC = "runc", "runsc"
OCI_RUNTIMES = (RUNC, RUNSC)
GVISOR_RELEASE = "4.4.0"

#: a Python node that reports its kernel (no permission needed in the sandbox)
KERNEL_PROBE = """
import os
def main(state):
    return {"release": os.uname().release, "version": open("/proc/version").read().strip()}
"""


def engine_runtimes(api: Any) -> list[str]:
    """The runtimes the engine lists (``docker info``)."""
    return sorted((api.info().get("Runtimes") or {}).keys())


def require_runsc(api: Any, oci: str) -> None:
    """A test under ``oci`` = runsc needs the engine to list it (scripts/host-setup.sh
    registers it): skip on a laptop without it, fail under CI=true."""
    if oci == RUNSC:
        require(RUNSC in engine_runtimes(api), "the Docker engine lists no runsc (gVisor)")


def kernel_seen(seen: dict[str, Any]) -> str:
    """``oci``'s name from what KERNEL_PROBE saw (or its release alone): "runsc" (gVisor's
    kernel), "runc" (the host's), or what it was when neither."""
    release, version = seen.get("release"), seen.get("version")
    host = os.uname().release
    if release == host and (version is None or host in str(version)):
        return RUNC
    if release == GVISOR_RELEASE and release != os.uname().release:
        return RUNSC
    return f"neither: {seen!r}"


def assert_ran_under(oci: str, seen: dict[str, Any]) -> None:
    """The code that saw ``seen`` (KERNEL_PROBE's output) ran under ``oci``."""
    assert kernel_seen(seen) == oci, f"expected the kernel of {oci}, the code saw {seen!r}"
