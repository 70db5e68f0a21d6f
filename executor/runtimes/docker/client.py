"""The process's one connection to the Docker engine, opened on first use.

Everything of the docker runtime that asks the engine shares it (its sandboxes, and the
image facts it reads for the save-time check and the package lists: ``images``), so a
one-shot ``studio-code run`` asks the engine its API version once, not once per user. A
forked child (a Celery pool process) opens its own: a connection is never shared across a
fork.
"""

from __future__ import annotations

import os
import re
import sys
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import docker

TIMEOUT_S = 30
#: the base URL the SDK gives an engine reached through a local socket, not tcp://
LOCAL_SCHEME = "http+docker://"
#: idle connections to a local engine kept for reuse (more at once are opened, then closed)
MAX_IDLE_CONNECTIONS = 16
_API_VERSION = re.compile(r"1\.\d{1,3}")
_lock = threading.Lock()
_shared: tuple[int, str, docker.APIClient] | None = None


def import_sdk() -> None:
    """Import the Docker SDK without modules it loads for what this process never does,
    15 to 35 ms of a one-shot ``studio-code run`` here (then imported on first use, if ever):
    ``importlib.metadata``, which urllib3's HTTP/2 support calls only when HTTP/2 is
    turned on (never, for the engine's socket); charset_normalizer, which requests calls
    only to guess the text encoding of a response that names none (``.text``; the engine's
    answers are read as JSON or bytes), its version read as requests does; idna, which
    requests only re-exports (``requests.packages``) and calls for a host name that is not
    ASCII (the engine's is ``localhost`` or the one DOCKER_HOST names); zipfile, which
    requests opens only to find a CA bundle inside a zip archive (an HTTPS engine's)."""
    if "docker" in sys.modules:
        return
    from executor.deferred_import import on_first_use

    with (
        on_first_use("importlib.metadata", functions=("version",)),
        on_first_use("charset_normalizer", names_of="version"),
        on_first_use("idna"),
        on_first_use("zipfile"),
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
            from docker.constants import MINIMUM_DOCKER_API_VERSION

            # made at the lowest version, which asks the engine nothing, then set to the
            # engine's own (what version="auto" sets): see engine_api_version
            api = docker.from_env(timeout=TIMEOUT_S, version=MINIMUM_DOCKER_API_VERSION).api
            _lighten(api)
            api._version = engine_api_version(api)
            _shared = (os.getpid(), host, api)
        return _shared[2]


def engine_api_version(api: docker.APIClient) -> str:
    """The engine's API version, as the SDK's ``version="auto"`` reads it, from the
    ``Api-Version`` header of ``GET /_ping`` (about 1 ms here) rather than ``GET /version``
    (about 7 ms, and dockerd runs runc, containerd and docker-init to report their versions:
    engine CPU that a one-shot ``studio-code run`` paid on every run). An engine whose ping
    does not say it is asked ``/version``, as the SDK would; one that cannot be reached
    raises the SDK's DockerException, as ``docker.from_env()`` would."""
    try:
        ping = api._get(api._url("/_ping", versioned_api=False))
        said = ping.headers.get("Api-Version", "") if ping.ok else ""
    except Exception:  # noqa: BLE001 - the SDK's own read says why, as before
        said = ""
    if _API_VERSION.fullmatch(said):
        return said
    return api._retrieve_server_version()  # type: ignore[no-any-return]


def _lighten(api: docker.APIClient) -> None:
    """Two costs the SDK's client pays on every call to an engine on a local socket, here a
    pooled job's four calls (create, attach, start, remove), each then ~1.2 ms of CPU:

    * its unix-socket adapter keeps a connection pool per request URL, path included, so a
      call naming a container it has not named before opens a new pool and a new connection
      (and its 25 pools hold up to 25 idle connections). One pool for the socket, as for any
      HTTP host: the connections are kept and reused; a hijacked attach stream is never
      given back to a pool (the SDK hands its socket out, its response is never read);
    * requests reads the proxy variables of the whole environment again on every call; a
      local socket (unix, ssh, npipe) never goes through an HTTP proxy. A tcp:// engine keeps
      them (HTTPS_PROXY, REQUESTS_CA_BUNDLE, .netrc), and its pools (the SDK's, per host).
    """
    if not api.base_url.startswith(LOCAL_SCHEME):
        return
    api.trust_env = False
    from docker.transport.unixconn import UnixHTTPAdapter

    adapter = api.adapters.get(LOCAL_SCHEME)
    if isinstance(adapter, UnixHTTPAdapter):
        adapter.max_pool_size = MAX_IDLE_CONNECTIONS
        by_url = adapter.get_connection

        def one_pool(url: str, proxies: object = None) -> object:
            return by_url(LOCAL_SCHEME + "socket", proxies)

        adapter.get_connection = one_pool  # type: ignore[method-assign]
