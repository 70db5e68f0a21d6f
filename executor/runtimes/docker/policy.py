"""What one sandbox is: its create arguments (``sandbox_policy``: the whole isolation policy,
on one screen), its labels and its name. Cold and pre-started sandboxes are both made from it.
"""

from __future__ import annotations

import time
from typing import Any

from docker.types import LogConfig, Ulimit

from executor.languages.base import Language
from executor.models import CodeJob, Limits
from executor.runtimes.constants import KILL_GRACE_S
from executor.runtimes.docker.seccomp import profile_json
from executor.sandbox_names import (  # noqa: F401 (the runtime's names, from here)
    LABEL_DEADLINE,
    LABEL_JOB,
    LABEL_LANGUAGE,
    LABEL_OWNER,
    LABEL_POOL,
    container_name,
)
from executor.settings import Settings, sandbox_ids

TMPFS_SIZE = "64m"


def sandbox_policy(
    settings: Settings, language: Language, job: CodeJob, limits: Limits, owner: str
) -> dict[str, Any]:
    """Every isolation control and limit of one sandbox: the create_container arguments.

    Specification's Isolation table: no network; read-only root with a 64 MB tmpfs /tmp and
    no host mounts; all capabilities dropped, no-new-privileges, the server's own uid:gid
    (nobody when the server is root); only HOME=/tmp and the language's flags in the
    environment; the state on stdin; our own seccomp profile. Limits table: memory with swap
    equal to memory, CPU share, pids. Also: no log driver (output comes through the attach
    stream, so a print flood cannot fill the host's disk) and no /dev/shm (ipc none), so
    /tmp is the only writable place.
    """
    uid, gid = sandbox_ids()
    host_config = {
        "network_mode": "none",
        "read_only": True,
        "tmpfs": {"/tmp": f"rw,nosuid,nodev,noexec,size={TMPFS_SIZE},mode=1777"},
        "binds": [],
        "cap_drop": ["ALL"],
        # our own seccomp profile (executor/runtimes/docker/seccomp.json): Docker's default minus
        # io_uring, userfaultfd, keyrings, bpf, perf, ptrace, namespaces, mounts and every
        # socket family but AF_UNIX
        "security_opt": ["no-new-privileges", f"seccomp={profile_json()}"],
        "privileged": False,
        "ipc_mode": "none",
        "mem_limit": limits.memory_bytes,
        "memswap_limit": limits.memory_bytes,
        "nano_cpus": int(limits.cpus * 1e9),
        "pids_limit": limits.pids,
        "ulimits": [Ulimit(name="core", soft=0, hard=0), Ulimit(name="msgqueue", soft=0, hard=0)],
        "log_config": LogConfig(type=LogConfig.types.NONE),
        "runtime": settings.code_oci_runtime or None,  # the OCI runtime: engine default
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
