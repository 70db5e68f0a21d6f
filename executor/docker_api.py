"""The process's one connection to the Docker engine, opened on first use.

The docker runtime and the save-time check of imports (executor/languages/python_modules.py)
share it, so a one-shot ``studio-code run`` asks the engine its API version once, not once
per user. A forked child (a Celery pool process) opens its own: a connection is never
shared across a fork.
"""

from __future__ import annotations

import os
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import docker

TIMEOUT_S = 30
_lock = threading.Lock()
_shared: tuple[int, str, docker.APIClient] | None = None


def import_sdk() -> None:
    """Import the Docker SDK without two modules it loads for what this process never does,
    10 to 30 ms of a one-shot ``studio-code run`` here (then imported on first use, if ever):
    ``importlib.metadata``, which urllib3's HTTP/2 support calls only when HTTP/2 is
    turned on (never, for the engine's socket), and charset_normalizer, which requests
    calls only to guess the text encoding of a response that names none (``.text``; the
    engine's answers are read as JSON or bytes). Its version is read as requests does."""
    if "docker" in sys.modules:
        return
    from executor.deferred_import import on_first_use

    with (
        on_first_use("importlib.metadata", functions=("version",)),
        on_first_use("charset_normalizer", names_of="version"),
    ):
        import docker  # noqa: F401


def shared_api() -> docker.APIClient:
    """This process's client of the engine DOCKER_HOST names; raises DockerException
    (docker.errors) when it cannot be reached."""
    global _shared
    host = os.environ.get("DOCKER_HOST", "")
    with _lock:
        if _shared is None or _shared[0] != os.getpid() or _shared[1] != host:
            import_sdk()
            import docker

            # a DOCKER_HOST changed since (a socket guard put in front, a test's engine):
            # the engine it names now, not the one first reached
            _shared = (os.getpid(), host, docker.from_env(timeout=TIMEOUT_S).api)
        return _shared[2]
