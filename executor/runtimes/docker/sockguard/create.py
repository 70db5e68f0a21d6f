"""The socket guard's create policy: the one container a worker may create is a sandbox
exactly as ``sandbox_policy`` (executor/runtimes/docker/policy.py) makes it, from the same
settings the workers run with.

Its host config's fixed fields equal to the policy's (network none, read-only root, the
tmpfs, no binds, CapDrop ALL, no-new-privileges and the project's own seccomp profile, ipc
none, the ulimits, no log driver); ``Runtime`` exactly the configured OCI runtime
(STUDIO_CODE_OCI_RUNTIME; unset: none named, the engine's default); memory, swap, CPU and
pids set and within the settings' caps, the CPU at least ``MIN_NANO_CPUS``; every other field
of the request empty (no Privileged, Mounts, Devices, CapAdd, host namespaces,
MaskedPaths...) but ``CgroupParent`` of exactly ``<engine parent>/studio-code-usage-<16
hex>`` (``parent_shape``); a configured image, the project's labels, and ``User`` the
sandbox's ``uid:gid`` or another ``uid:gid`` of decimal digits, both non-zero. Nothing here
does I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

# the least CPU a sandbox is created with (cpus 0.01, a 1 ms quota at the engine's 100 ms
# period: below it runc fails the start, and 0 or none is no limit at all); the front doors
# refuse less, the guard holds it for any client
from executor.floors import MIN_NANO_CPUS
from executor.runtimes.docker.sockguard.grammar import Refused, Request
from executor.sandbox_names import (
    ENGINE_PARENT,
    LABEL_DEADLINE,
    LABEL_JOB,
    LABEL_OWNER,
    LABEL_POOL,
    NAME_PREFIX,
    USAGE_PARENT_PREFIX,
)

#: a sandbox's container name (create, rename)
NAME = re.compile(rf"^{NAME_PREFIX}[A-Za-z0-9_.-]{{1,200}}$")
_USER = re.compile(r"^([1-9][0-9]{0,9}):([1-9][0-9]{0,9})$")


def parent_shape(engine_parent: str) -> re.Pattern[str]:
    """The one cgroup parent a create may name: a run's own, made by runc below the engine's
    parent for containers (executor/runtimes/docker/usage.py), matched whole (``fullmatch``:
    no newline after)."""
    return re.compile(rf"{re.escape(engine_parent)}/{USAGE_PARENT_PREFIX}[0-9a-f]{{16}}")


@dataclass(frozen=True)
class Policy:
    """What a create must look like, from the same settings the workers run with."""

    images: frozenset[str]
    host_config: dict[str, Any]  # the fixed fields of sandbox_policy's host config
    max_memory: int
    max_nano_cpus: int
    max_pids: int
    user: str = ""  # the sandboxes' uid:gid (sandbox_ids), as the workers send it
    #: STUDIO_CODE_USAGE_CGROUP_PARENT: the per-run cgroup parents are below it
    engine_parent: str = ENGINE_PARENT
    #: STUDIO_CODE_OCI_RUNTIME: the one ``HostConfig.Runtime`` a create names ("": none)
    runtime: str = ""

    @classmethod
    def from_settings(cls, settings: Any, images: list[str] | None = None) -> Policy:
        from docker.types import HostConfig

        from executor.languages import get_language
        from executor.models import CodeJob
        from executor.runtimes.docker.policy import sandbox_policy, shape_limits
        from executor.settings import sandbox_ids

        limits = shape_limits(settings.max_memory_bytes, settings.max_cpus, settings.code_pids)
        python = get_language("python")
        policy = sandbox_policy(settings, python, CodeJob(code=""), limits, "guard:0")
        # the runtime as the workers resolve it (``auto``: runsc when the engine lists it,
        # read once as the guard starts), and its seccomp profile (gVisor's variant)
        runtime = policy["host_config"].get("runtime") or ""
        fixed = dict(HostConfig(version="1.41", **policy["host_config"]))
        for varying in ("Memory", "MemorySwap", "NanoCpus", "PidsLimit", "Runtime"):
            fixed.pop(varying, None)
        return cls(
            images=frozenset(images or [settings.code_image, settings.code_ts_image]),
            host_config=fixed,
            max_memory=settings.max_memory_bytes,
            max_nano_cpus=int(settings.max_cpus * 1e9),
            max_pids=settings.code_pids,
            user="{}:{}".format(*sandbox_ids()),
            engine_parent=settings.code_usage_cgroup_parent,
            runtime=runtime,
        )

    def check_create(self, body: dict[str, Any], name: str | None) -> None:
        """Raise Refused unless ``body`` is a sandbox exactly as ``sandbox_policy`` makes it."""
        if name is None or not NAME.match(name):
            raise Refused(
                f"container name {name!r}: a sandbox is created with ?name={NAME_PREFIX}..."
            )
        top = _fields(body, "the create request")
        image = top.get("image")
        if image not in self.images:
            raise Refused(
                f"image {image!r} is not one of the configured sandbox images "
                f"({', '.join(sorted(self.images))})"
            )
        labels = top.get("labels")
        if not isinstance(labels, dict) or not (
            LABEL_OWNER in labels
            and LABEL_DEADLINE in labels
            and (LABEL_JOB in labels or LABEL_POOL in labels)
        ):
            raise Refused(
                f"labels {labels!r}: a sandbox carries {LABEL_OWNER}, {LABEL_DEADLINE} and "
                f"{LABEL_JOB} or {LABEL_POOL}"
            )
        user = top.get("user")
        if not isinstance(user, str) or not _sandbox_user(user, self.user):
            raise Refused(
                f"User {user!r}: a sandbox runs as {self.user or 'uid:gid'} (decimal uid:gid, "
                "both non-zero), never as root or the image's user"
            )
        if top.get("networkdisabled") is not True:
            raise Refused("NetworkDisabled is not true: a sandbox has no network")
        allowed_top = {
            "image", "labels", "user", "networkdisabled", "hostconfig", "hostname", "cmd",
            "env", "workingdir", "tty", "openstdin", "stdinonce", "attachstdin",
            "attachstdout", "attachstderr",
        }  # fmt: skip
        _only_empty(top, allowed_top, "")
        hc = top.get("hostconfig")
        if not isinstance(hc, dict):
            raise Refused("no HostConfig: a sandbox is created with the project's host config")
        host = _fields(hc, "HostConfig")
        self._check_host(host)

    def _check_host(self, host: dict[str, Any]) -> None:
        # the refusals an operator is most likely to look for, named first
        if host.get("privileged"):
            raise Refused("HostConfig.Privileged: a sandbox is never privileged")
        for key in ("binds", "mounts", "volumesfrom", "devices", "devicerequests"):
            if host.get(key):
                raise Refused(
                    f"HostConfig.{_NAMES[key]} {host[key]!r}: a sandbox has no host "
                    "mounts or devices (a tmpfs /tmp only)"
                )
        for key in ("pidmode", "ipcmode", "utsmode", "usernsmode", "cgroupnsmode"):
            if str(host.get(key) or "").startswith(("host", "container:")):
                raise Refused(
                    f"HostConfig.{_NAMES[key]} {host[key]!r}: no host or shared namespace"
                )
        if host.get("networkmode") != "none":
            raise Refused(
                f"HostConfig.NetworkMode {host.get('networkmode')!r}: a sandbox's network is none"
            )
        if host.get("capadd"):
            raise Refused(f"HostConfig.CapAdd {host['capadd']!r}: a sandbox adds no capability")
        opts = host.get("securityopt") or []
        for opt in opts if isinstance(opts, list) else [opts]:
            if isinstance(opt, str) and opt.replace(":", "=").split("=")[0] in (
                "seccomp",
                "apparmor",
                "label",
                "systempaths",
            ):
                if "unconfined" in opt or "disable" in opt:
                    raise Refused(f"HostConfig.SecurityOpt {opt!r}: confinement is never off")
        for key in ("maskedpaths", "readonlypaths"):
            if key in host:
                raise Refused(f"HostConfig.{_NAMES[key]}: the engine's masked /proc paths stay")
        runtime = host.get("runtime")
        if (runtime or "") != self.runtime:
            want = (
                f"the configured OCI runtime {self.runtime!r}"
                if self.runtime
                else "the engine's default OCI runtime, none named"
            )
            raise Refused(
                f"HostConfig.Runtime {str(runtime)[:120]!r}: a sandbox runs with {want} "
                "(STUDIO_CODE_OCI_RUNTIME)"
            )
        # then the whole shape: the fixed fields equal to sandbox_policy's
        for key, want in self.host_config.items():
            got = host.get(key.lower())
            if got != want:
                shown = str(got)[:120] + ("..." if len(str(got)) > 120 else "")
                raise Refused(f"HostConfig.{key} {shown}: not the sandbox policy's value")
        memory, swap = host.get("memory"), host.get("memoryswap")
        if not _int_in(memory, self.max_memory) or swap != memory:
            raise Refused(
                f"HostConfig.Memory {memory!r} / MemorySwap {swap!r}: a sandbox's memory is "
                f"set, at most {self.max_memory}, and its swap equal to it"
            )
        cpus: Any = host.get("nanocpus")
        if not _int_in(cpus, self.max_nano_cpus) or cpus < MIN_NANO_CPUS:
            raise Refused(
                f"HostConfig.NanoCpus {cpus!r}: set, at least {MIN_NANO_CPUS} (0.01 CPU: "
                f"less, or none, is no CPU limit) and at most {self.max_nano_cpus}"
            )
        if not _int_in(host.get("pidslimit"), self.max_pids):
            raise Refused(
                f"HostConfig.PidsLimit {host.get('pidslimit')!r}: set, at most {self.max_pids}"
            )
        parent = host.get("cgroupparent")
        if parent not in (None, "") and not (
            isinstance(parent, str) and parent_shape(self.engine_parent).fullmatch(parent)
        ):
            raise Refused(
                f"HostConfig.CgroupParent {str(parent)[:120]!r}: a sandbox's cgroup parent is "
                f"its run's own {self.engine_parent}/{USAGE_PARENT_PREFIX}<16 hex> (usage per "
                "run), or none"
            )
        fixed = {k.lower() for k in self.host_config}
        allowed = fixed | {"memory", "memoryswap", "nanocpus", "pidslimit", "cgroupparent"}
        allowed |= {"runtime"}
        _only_empty(host, allowed, "HostConfig.")


#: the engine's spelling of the fields the refusals name
_NAMES = {
    n.lower(): n
    for n in (
        "Binds Mounts VolumesFrom Devices DeviceRequests PidMode IpcMode UTSMode UsernsMode "
        "CgroupnsMode NetworkMode CapAdd SecurityOpt MaskedPaths ReadonlyPaths"
    ).split()
}


def _fields(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """``obj``'s keys lowercased (the engine matches JSON keys case-insensitively): two keys
    that differ only in case, or a key that is not plain ASCII, are refused."""
    out: dict[str, Any] = {}
    for key, value in obj.items():
        low = key.lower()
        if not key.isascii() or low in out:
            raise Refused(f"{where}: the key {key!r} is ambiguous")
        out[low] = value
    return out


def _sandbox_user(user: str, configured: str) -> bool:
    """The sandbox's configured ``uid:gid``, or another of plain decimal digits (no sign, no
    leading zero: runc reads ``00`` and ``+0`` as 0) naming a non-zero uid and gid."""
    m = _USER.match(user)
    return m is not None and (user == configured or all(0 < int(n) < 2**31 for n in m.groups()))


def _only_empty(fields: dict[str, Any], allowed: set[str], prefix: str) -> None:
    for key, value in fields.items():
        if key not in allowed and value not in (None, False, 0, "", [], {}):
            raise Refused(f"{prefix}{key} {str(value)[:120]}: not a field a sandbox sets")


def _int_in(value: Any, top: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= top


def create_body(policy: Policy, req: Request, name: str | None) -> bytes:
    """The create body to send: ``req``'s, checked against ``policy``, serialised again."""
    try:
        spec = json.loads(req.body or b"null")
    except ValueError as e:
        raise Refused(f"the create body is not JSON ({e})", 400) from e
    if not isinstance(spec, dict):
        raise Refused("the create body is not a JSON object", 400)
    try:
        policy.check_create(spec, name)
    except Refused as e:
        raise Refused(f"a sandbox create refused: {e.message}") from e
    # what was checked is what the engine reads: no duplicate key whose last copy the
    # engine and this parser might disagree on
    return json.dumps(spec).encode()
