"""What one sandbox is: its create arguments (``sandbox_policy``: the whole isolation policy,
on one screen), its labels and its name. Cold and pre-started sandboxes are both made from it.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from docker.types import LogConfig, Ulimit

from executor.errors import CodeInvalid
from executor.floors import MIN_MEMORY_BYTES, MIN_NANO_CPUS, MIN_PIDS
from executor.inputs import check_cpus, cpus_range, size_text
from executor.languages.base import Language
from executor.models import CodeJob, Limits
from executor.runtimes.constants import KILL_GRACE_S, TMPFS_SIZE
from executor.runtimes.docker.seccomp import is_gvisor, profile_json
from executor.sandbox_names import (  # noqa: F401 (the runtime's names, from here)
    LABEL_DEADLINE,
    LABEL_JOB,
    LABEL_LANGUAGE,
    LABEL_OWNER,
    LABEL_POOL,
    container_name,
)
from executor.settings import Settings, sandbox_ids

#: STUDIO_CODE_OCI_RUNTIME=auto: gVisor's runsc when the engine lists it, else its default
AUTO = "auto"
GVISOR = "runsc"
#: how long ``oci_runtime``'s reading of the engine's runtimes is believed (a runtime is
#: registered or removed with a reload of the engine, rarely)
AUTO_TTL_S = 300.0
_auto: dict[str, tuple[float, str | None]] = {}  # DOCKER_HOST -> (read at, runtime)
_auto_lock = threading.Lock()


def oci_runtime(settings: Settings, api: Any = None) -> str | None:
    """The OCI runtime sandboxes are created with: STUDIO_CODE_OCI_RUNTIME, ``auto`` resolved
    (``runsc`` when the engine lists it under Runtimes, else None); None: the engine's
    default. ``auto`` asks the engine (``api``, or this process's client) once per
    AUTO_TTL_S; a failed read keeps the last answer, or raises the SDK's DockerException."""
    name = settings.code_oci_runtime
    if name != AUTO:
        return name or None
    host = os.environ.get("DOCKER_HOST", "")
    with _auto_lock:
        seen = _auto.get(host)
    if seen is not None and time.monotonic() - seen[0] < AUTO_TTL_S:
        return seen[1]
    if api is None:
        from executor.runtimes.docker.client import shared_api

        api = shared_api()
    try:
        runtimes = api.info().get("Runtimes") or {}
    except Exception:
        if seen is not None:
            return seen[1]
        raise
    got = GVISOR if GVISOR in runtimes else None
    with _auto_lock:
        _auto[host] = (time.monotonic(), got)
    return got


def sandbox_policy(
    settings: Settings,
    language: Language,
    job: CodeJob,
    limits: Limits,
    owner: str,
    *,
    api: Any = None,
) -> dict[str, Any]:
    """Every isolation control and limit of one sandbox: the create_container arguments.

    Specification's Isolation table: no network; read-only root with a 64 MB tmpfs /tmp and
    no host mounts; all capabilities dropped, no-new-privileges, the server's own uid:gid
    (nobody when the server is root); only HOME=/tmp and the language's flags in the
    environment; the state on stdin; our own seccomp profile. Limits table: memory with swap
    equal to memory, CPU share, pids. Also: no log driver (output comes through the attach
    stream, so a print flood cannot fill the host's disk) and no /dev/shm (ipc none), so
    /tmp is the only writable place. The OCI runtime: ``oci_runtime`` (``api`` answers
    STUDIO_CODE_OCI_RUNTIME=auto's question, when given).
    """
    refuse_below_floors(limits)
    uid, gid = sandbox_ids()
    runtime = oci_runtime(settings, api)
    host_config = {
        "network_mode": "none",
        "read_only": True,
        "tmpfs": {"/tmp": f"rw,nosuid,nodev,noexec,size={TMPFS_SIZE},mode=1777"},
        "binds": [],
        "cap_drop": ["ALL"],
        # our own seccomp profile (executor/runtimes/docker/seccomp.json): Docker's default minus
        # io_uring, userfaultfd, keyrings, bpf, perf, ptrace, namespaces, mounts and every
        # socket family but AF_UNIX (under gVisor: its variant, seccomp.for_gvisor)
        "security_opt": [
            "no-new-privileges",
            f"seccomp={profile_json(gvisor=is_gvisor(runtime))}",
        ],
        "privileged": False,
        "ipc_mode": "none",
        "mem_limit": limits.memory_bytes,
        "memswap_limit": limits.memory_bytes,
        "nano_cpus": nano_cpus(limits.cpus),
        "pids_limit": limits.pids,
        "ulimits": [Ulimit(name="core", soft=0, hard=0), Ulimit(name="msgqueue", soft=0, hard=0)],
        "log_config": LogConfig(type=LogConfig.types.NONE),
        # the OCI runtime (None: the engine's default); runsc: gVisor, the second wall
        "runtime": runtime,
    }
    deadline = int(time.time() + limits.timeout_s + KILL_GRACE_S)
    return {
        "image": language.image(settings),
        "command": language.command(settings, limits, in_container=True),
        "user": f"{uid}:{gid}",
        "environment": language.environment(settings, in_container=True),
        "working_dir": "/tmp",
        "hostname": "sandbox",
        "network_disabled": True,
        "stdin_open": True,  # with detach=False this also sets StdinOnce: EOF ends stdin
        "detach": False,
        "use_config_proxy": False,  # never copy the client's proxy settings into the sandbox
        "labels": {
            LABEL_JOB: job.job_id,
            LABEL_OWNER: owner,
            LABEL_DEADLINE: str(deadline),
            LABEL_LANGUAGE: language.name,
        },
        "host_config": host_config,
    }


def nano_cpus(cpus: float) -> int:
    """The engine's NanoCpus for a CPU share, never below MIN_NANO_CPUS: a share the kernel
    cannot enforce raises CodeInvalid (it is never rounded up, nor down to 0, which the
    engine reads as no limit at all)."""
    check_cpus(cpus, max_cpus=None, source="The sandbox's cpus")
    nano = int(cpus * 1e9)  # as the socket guard computes its cap: the two agree
    if nano < MIN_NANO_CPUS:  # pragma: no cover - cpus >= MIN_CPUS gives at least this
        raise CodeInvalid(f"The sandbox's cpus={cpus:g} gives NanoCpus {nano}: {cpus_range()}.")
    return nano


def refuse_below_floors(limits: Limits) -> None:
    """CodeInvalid when a limit is below its floor (executor/floors.py): every
    door refuses such a value first, so this is the last guard, never a clamp."""
    if limits.memory_bytes < MIN_MEMORY_BYTES:
        raise CodeInvalid(
            f"The sandbox's memory={size_text(limits.memory_bytes)} is less than a runner "
            f"starts in: give {size_text(MIN_MEMORY_BYTES)} or more."
        )
    if limits.pids < MIN_PIDS:
        raise CodeInvalid(
            f"The sandbox's pids={limits.pids} is fewer processes than a runner needs: give "
            f"STUDIO_CODE_PIDS={MIN_PIDS} or more."
        )


def shape_limits(memory_bytes: int, cpus: float, pids: int) -> Limits:
    """The limits of a sandbox that runs no job (the socket guard's reference shape, a
    container a file is copied out of): only the resource caps matter, the job's own
    timeout and output caps are placeholders."""
    return Limits(
        memory_bytes=memory_bytes,
        cpus=cpus,
        pids=pids,
        timeout_s=1,
        log_max_bytes=1,
        output_max_bytes=1,
    )
