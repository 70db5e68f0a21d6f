"""The engine posture: what the Docker engine under the sandboxes is, and which known container
escapes of its runc, containerd and dockerd it still has.

``read_posture`` asks the engine twice (``/version``: the versions of dockerd, containerd and
runc; ``/info``: runtimes, cgroups, security options, plugins) and ``posture_of`` checks the
answers against the table of known escapes (``executor/runtimes/docker/escapes.py`` and
``known_escapes.toml``, which says how to update it). Nothing here decides: the docker runtime
refuses a vulnerable engine only when STUDIO_CODE_ENGINE_REFUSE_VULNERABLE is on; a worker
logs a WARNING and sets the ``studio_code_engine_vulnerable`` gauge; meta shows it.

A component's distribution package version (which may carry a backported fix) is read from
what the engine reports (Debian's runc and containerd put it in their GitCommit) or, for
dockerd, from this host's dpkg database when its package has the very upstream version the
engine reports.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict

from executor.runtimes.docker.escapes import (
    Advisory,
    Version,
    dpkg_split,
    is_package_version,
    load_table,
    parse_version,
)

if TYPE_CHECKING:
    from executor.models import CodeJob, CodeResult

Component = Literal["runc", "containerd", "docker"]
#: how long a read of the engine's posture is believed (an engine upgrade restarts dockerd)
POSTURE_TTL_S = 300.0
DPKG_STATUS = Path("/var/lib/dpkg/status")
#: the Debian packages of each component (Debian's own, and the Docker project's)
PACKAGES = {
    "docker": ("docker.io", "docker-ce"),
    "containerd": ("containerd", "containerd.io"),
    "runc": ("runc",),
}

#: what each kind of runtime means for the code in a sandbox (meta, the start-up line)
WALL_GVISOR = (
    "the code meets gVisor's kernel in user space (the Sentry), not the host's: the host "
    "kernel sees only the Sentry's own filtered system calls"
)
WALL_HOST = (
    "the code meets the host's kernel directly, behind namespaces, cgroups, the seccomp "
    "profile and dropped capabilities (one wall)"
)

# --- the posture ----------------------------------------------------------------------------------


class ComponentVersion(BaseModel):
    """A component's version as the engine reports it, and its distribution package version
    when one is known."""

    model_config = ConfigDict(frozen=True)

    name: Component
    version: str
    package: str | None = None


class AdvisoryMatch(BaseModel):
    """A known escape the engine's version of ``component`` has."""

    model_config = ConfigDict(frozen=True)

    component: Component
    cve: str
    ghsa: str
    version: str
    package: str | None
    fixed: tuple[str, ...]
    summary: str
    link: str
    #: False when the flaw needs a feature this engine does not use (``note`` says which)
    applies: bool = True
    note: str | None = None


class EnginePosture(BaseModel):
    """What the sandboxes stand on: the Docker engine, its OCI runtime, the kernel features it
    uses, and the known escapes of its versions (``vulnerable`` when one applies)."""

    model_config = ConfigDict(frozen=True)

    docker: ComponentVersion
    api_version: str
    containerd: ComponentVersion | None
    runc: ComponentVersion | None
    #: the OCI runtime sandboxes start with (STUDIO_CODE_OCI_RUNTIME or the engine default)
    oci_runtime: str
    oci_runtime_path: str | None
    #: its version (runc: the engine's report; runsc: this host's package or `runsc
    #: --version`; None: not known here, e.g. a worker in a container)
    oci_runtime_version: str | None = None
    #: "gvisor" (runsc: a user-space kernel between the code and the host's) or "host"
    oci_runtime_kernel: Literal["gvisor", "host"] = "host"
    #: gVisor's platform (how it intercepts the code's system calls): its --platform
    #: argument, "default" when none is given (runsc's own choice: ptrace in 20221219)
    oci_runtime_platform: str | None = None
    #: what it means, one sentence (WALL_GVISOR or WALL_HOST)
    wall: str = WALL_HOST
    default_runtime: str
    runtimes: list[str]
    cgroup_version: str | None
    cgroup_driver: str | None
    seccomp: bool
    #: the engine's default seccomp profile ("default" = its built-in one); the sandboxes
    #: get the project's own profile whatever this is
    seccomp_default_profile: str | None
    apparmor: bool
    selinux: bool
    userns_remap: bool
    rootless: bool
    authorization_plugins: list[str]
    kernel: str | None
    operating_system: str | None
    advisories: list[AdvisoryMatch]
    vulnerable: bool

    def warning(self) -> str | None:
        """The start-up WARNING: which escapes apply and the way out; None when none."""
        bad = [a for a in self.advisories if a.applies]
        if not bad:
            return None
        by_component: dict[str, list[AdvisoryMatch]] = {}
        for a in bad:
            by_component.setdefault(a.component, []).append(a)
        parts = []
        for component, found in by_component.items():
            ids = ", ".join(a.cve for a in found)
            fixed = sorted({f for a in found for f in a.fixed}, key=_sort_key)
            version = found[0].package or found[0].version
            parts.append(f"{component} {version} has {ids} (fixed in {' / '.join(fixed)})")
        return (
            "The Docker engine under the sandboxes has known container escapes: "
            + "; ".join(parts)
            + ". The table compares upstream versions; a distribution may have patched its "
            "package without a newer version, which the table knows only where it lists it "
            "(distro_fixed). Upgrade: the Docker project's packages (docker-ce, containerd.io "
            "from download.docker.com), a newer distribution, or a runc from the "
            "distribution's backports; see docs/security.md, 'The engine posture'."
        )

    def compact(self) -> dict[str, Any]:
        """What a worker announces in its heartbeat (the API's meta shows it per worker)."""
        return {
            "docker": self.docker.version,
            "containerd": self.containerd.version if self.containerd else None,
            "runc": self.runc.version if self.runc else None,
            "oci_runtime": self.oci_runtime,
            "oci_runtime_version": self.oci_runtime_version,
            "oci_runtime_kernel": self.oci_runtime_kernel,
            "oci_runtime_platform": self.oci_runtime_platform,
            "cgroup_version": self.cgroup_version,
            "userns_remap": self.userns_remap,
            "rootless": self.rootless,
            "vulnerable": self.vulnerable,
            "advisories": [a.cve for a in self.advisories if a.applies],
        }

    def runtime_line(self) -> str:
        """The start-up line: the runtime that starts sandboxes, its version, the platform,
        and what it means."""
        what = self.oci_runtime
        if self.oci_runtime_version:
            what += f" {self.oci_runtime_version}"
        if self.oci_runtime_kernel == "gvisor":
            what += f" (gVisor, platform {self.oci_runtime_platform})"
        return f"sandboxes start with {what}: {self.wall}"


def _sort_key(v: str) -> Version:
    return parse_version(v) or Version(0, 0, 0)


def _security_options(info: Mapping[str, Any]) -> dict[str, dict[str, str]]:
    # ["name=seccomp,profile=default", "name=userns", ...] -> {"seccomp": {"profile": ...}}
    out: dict[str, dict[str, str]] = {}
    for opt in info.get("SecurityOptions") or []:
        fields = dict(p.split("=", 1) for p in str(opt).split(",") if "=" in p)
        name = fields.pop("name", str(opt))
        out[name] = fields
    return out


def _component(version: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    for c in version.get("Components") or []:
        if str(c.get("Name", "")).lower() == name:
            return c  # type: ignore[no-any-return]
    return None


def installed_packages(path: Path = DPKG_STATUS) -> dict[str, str]:
    """{package: version} of this host's installed Debian packages of the engine's
    components (empty when there is no dpkg database)."""
    wanted = {p for names in PACKAGES.values() for p in names} | {"runsc"}
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return {}
    out = {}
    for para in text.split("\n\n"):
        if para.partition("\n")[0].removeprefix("Package: ") not in wanted:
            continue  # dpkg writes Package first: only a few paragraphs are read
        fields = dict(
            line.split(": ", 1) for line in para.splitlines() if ": " in line and line[0] != " "
        )
        if fields.get("Package") in wanted and "installed" in fields.get("Status", ""):
            out[fields["Package"]] = fields.get("Version", "")
    return out


def _runtime_args(entry: Mapping[str, Any]) -> list[str]:
    args = entry.get("runtimeArgs") or entry.get("RuntimeArgs") or []
    return [str(a) for a in args]


def _platform(args: list[str]) -> str:
    for i, a in enumerate(args):
        for flag in ("--platform", "-platform"):
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
            if a == flag and i + 1 < len(args):
                return args[i + 1]
    return "default"


def runsc_version(path: str | None, host: Mapping[str, str]) -> str | None:
    """runsc's version: this host's runsc package, or what ``path --version`` says when that
    file is on this host; None when neither (a worker in a container, say)."""
    if host.get("runsc"):
        return host["runsc"]
    if not path or not os.path.isabs(path) or not os.access(path, os.X_OK):
        return None
    try:
        out = subprocess.run(
            [path, "--version"], capture_output=True, text=True, timeout=5, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    first = out.splitlines()[0] if out else ""
    return first.removeprefix("runsc version ").strip() or None


def _package_of(name: str, version: str, reported: str, host: Mapping[str, str]) -> str | None:
    if is_package_version(reported) and reported.startswith(version):
        return reported  # Debian's runc and containerd report their package version
    for pkg in PACKAGES.get(name, ()):
        installed = host.get(pkg)
        if installed and dpkg_split(installed)[1] == version:
            return installed  # this host's package of the very version the engine runs
    return None


def posture_of(
    version: Mapping[str, Any],
    info: Mapping[str, Any],
    *,
    oci_runtime: str = "",
    host_packages: Mapping[str, str] | None = None,
    table: tuple[Advisory, ...] | None = None,
) -> EnginePosture:
    """The posture from the engine's ``/version`` and ``/info`` answers (pure: tests feed
    it fake answers). ``oci_runtime`` is STUDIO_CODE_OCI_RUNTIME (empty: the default);
    ``host_packages`` this host's installed packages (``installed_packages``)."""
    host = host_packages or {}
    docker_v = str(version.get("Version") or info.get("ServerVersion") or "")
    components: dict[str, ComponentVersion] = {
        "docker": ComponentVersion(
            name="docker", version=docker_v, package=_package_of("docker", docker_v, "", host)
        )
    }
    for name, commit_key in (("containerd", "ContainerdCommit"), ("runc", "RuncCommit")):
        c = _component(version, name) or {}
        commit = (c.get("Details") or {}).get("GitCommit") or (info.get(commit_key) or {}).get("ID")
        reported = str(commit or "")
        v = str(c.get("Version") or "")
        if not v and is_package_version(reported):
            v = reported  # an engine without Components: the package version is all there is
        if v:
            components[name] = ComponentVersion(
                name=name,  # type: ignore[arg-type]
                version=v,
                package=_package_of(name, dpkg_split(v)[1] if "-" in v else v, reported, host),
            )
    runtimes = dict(info.get("Runtimes") or {})
    default_runtime = str(info.get("DefaultRuntime") or "runc")
    used = oci_runtime or default_runtime
    entry = runtimes.get(used) or {}
    path = entry.get("path") or entry.get("Path")
    binary = os.path.basename(str(path or used))
    uses_runc = binary == "runc"
    gvisor = binary.startswith("runsc")
    sec = _security_options(info)
    authz = list((info.get("Plugins") or {}).get("Authorization") or [])

    matches = []
    for adv in table or load_table():
        comp = components.get(adv.component)
        if comp is None or not adv.affected(comp.version, comp.package):
            continue
        applies, note = True, None
        if adv.only_when == "authorization_plugin" and not authz:
            applies, note = False, "only with an authorization plugin; this engine has none"
        elif adv.only_when == "cri":
            applies, note = False, "only through containerd's CRI plugin, which Docker does not use"
        elif adv.component == "runc" and not uses_runc:
            applies, note = False, f"the sandboxes start with {used!r}, not runc"
        matches.append(
            AdvisoryMatch(
                component=comp.name,
                cve=adv.cve,
                ghsa=adv.ghsa,
                version=comp.version,
                package=comp.package,
                fixed=adv.fixed,
                summary=adv.summary,
                link=adv.link,
                applies=applies,
                note=note,
            )
        )
    seccomp = sec.get("seccomp")
    return EnginePosture(
        docker=components["docker"],
        api_version=str(version.get("ApiVersion") or ""),
        containerd=components.get("containerd"),
        runc=components.get("runc"),
        oci_runtime=used,
        oci_runtime_path=str(path) if path else None,
        oci_runtime_version=(
            runsc_version(str(path or ""), host)
            if gvisor
            else (components["runc"].package or components["runc"].version)
            if uses_runc and "runc" in components
            else None
        ),
        oci_runtime_kernel="gvisor" if gvisor else "host",
        oci_runtime_platform=_platform(_runtime_args(entry)) if gvisor else None,
        wall=WALL_GVISOR if gvisor else WALL_HOST,
        default_runtime=default_runtime,
        runtimes=sorted(runtimes),
        cgroup_version=str(info["CgroupVersion"]) if info.get("CgroupVersion") else None,
        cgroup_driver=str(info["CgroupDriver"]) if info.get("CgroupDriver") else None,
        seccomp=seccomp is not None,
        seccomp_default_profile=(seccomp or {}).get("profile"),
        apparmor="apparmor" in sec,
        selinux="selinux" in sec,
        userns_remap="userns" in sec,
        rootless="rootless" in sec,
        authorization_plugins=authz,
        kernel=info.get("KernelVersion") or version.get("KernelVersion"),
        operating_system=info.get("OperatingSystem"),
        advisories=matches,
        vulnerable=any(m.applies for m in matches),
    )


def read_posture(api: Any, *, oci_runtime: str = "") -> EnginePosture:
    """Ask the engine (a docker.APIClient) and check it against the table. Raises the
    SDK's DockerException when the engine does not answer."""
    return posture_of(
        api.version(), api.info(), oci_runtime=oci_runtime, host_packages=installed_packages()
    )


# --- proof from inside a sandbox ------------------------------------------------------------------

SANDBOX_PROBE = """
import ctypes
def main(state):
    status = dict(l.split(":\\t", 1) for l in open("/proc/self/status").read().splitlines()
                  if ":\\t" in l)
    seen = {k: status.get(k, "").strip() for k in ("Seccomp", "CapEff", "Uid")}
    # prctl, not the NoNewPrivs line: gVisor's /proc/self/status has none
    libc = ctypes.CDLL(None)
    seen["NoNewPrivs"] = str(libc.prctl(39, 0, 0, 0, 0))  # PR_GET_NO_NEW_PRIVS
    seen["SeccompMode"] = str(libc.prctl(21, 0, 0, 0, 0))  # PR_GET_SECCOMP: 2, a filter
    return seen
"""


def sandbox_proof(run: Callable[[CodeJob], CodeResult]) -> dict[str, Any]:
    """Run one Python sandbox under the real policy (``run``: an Executor's) and report what
    its kernel says: ``no_new_privs`` and ``seccomp_filter`` (mode 2) true when applied, its
    effective capabilities and uid. ``error`` instead when it could not run."""
    from executor.models import CodeJob

    result = run(CodeJob(language="python", code=SANDBOX_PROBE, timeout_s=20))
    if not isinstance(result.output, dict):
        message = result.error.message if result.error else repr(result.output)
        return {"error": f"the probe sandbox did not run: {message}"}
    seen = result.output
    return {
        "no_new_privs": seen.get("NoNewPrivs") == "1",
        "seccomp_filter": seen.get("SeccompMode") == "2",
        "cap_eff": seen.get("CapEff"),
        "uid": (seen.get("Uid") or "").split("\t")[0] or None,
    }
