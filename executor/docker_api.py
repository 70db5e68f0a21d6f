"""The process's one connection to the Docker engine, opened on first use.

The docker runtime and the save-time check of imports (executor/languages/python_modules.py)
share it, so a one-shot ``studio-code run`` asks the engine its API version once, not once
per user. A forked child (a Celery pool process) opens its own: a connection is never
shared across a fork.
"""

from __future__ import annotations

import os
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import docker

TIMEOUT_S = 30
_lock = threading.Lock()
_shared: tuple[int, str, docker.APIClient] | None = None


def shared_api() -> docker.APIClient:
    """This process's client of the engine DOCKER_HOST names; raises DockerException
    (docker.errors) when it cannot be reached."""
    global _shared
    host = os.environ.get("DOCKER_HOST", "")
    with _lock:
        if _shared is None or _shared[0] != os.getpid() or _shared[1] != host:
            import docker

            # a DOCKER_HOST changed since (a socket guard put in front, a test's engine):
            # the engine it names now, not the one first reached
            _shared = (os.getpid(), host, docker.from_env(timeout=TIMEOUT_S).api)
        return _shared[2]
