"""The process's client of the Docker engine learns the engine's API version from its ping,
not from ``GET /version`` (which makes dockerd run runc, containerd and docker-init for
their versions): through a relay in front of the machine's engine socket that writes down
every call."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from testkit.processes import require
from testkit.relay import UnixRelay

ENGINE_SOCKET = "/var/run/docker.sock"


@pytest.fixture
def relay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[UnixRelay]:
    require(Path(ENGINE_SOCKET).exists(), "no Docker engine socket on this machine")
    r = UnixRelay(tmp_path / "engine.sock", ENGINE_SOCKET)
    r.start()
    monkeypatch.setenv("DOCKER_HOST", f"unix://{r.path}")
    try:
        yield r
    finally:
        r.stop()


@pytest.mark.docker
def test_the_engine_client_reads_the_api_version_from_the_ping(relay: UnixRelay) -> None:
    import docker

    from executor.runtimes.docker.client import shared_api

    api = shared_api()  # a new client: DOCKER_HOST names the relay
    assert api.ping() is True
    assert api.containers(limit=1) is not None  # a versioned call answers
    engine = docker.APIClient(base_url=f"unix://{ENGINE_SOCKET}", version="auto")
    try:
        assert api.api_version == engine.api_version  # what version="auto" would have set
    finally:
        engine.close()
    assert relay.paths[0] == "/_ping", relay.paths
    assert not [p for p in relay.paths if p.endswith("/version")], relay.paths
    assert any(p.startswith(f"/v{api.api_version}/containers/json") for p in relay.paths)
