"""The process's client of the Docker engine learns the engine's API version from its ping,
not from ``GET /version`` (which makes dockerd run runc, containerd and docker-init for
their versions): through a logging relay in front of the machine's engine socket."""

from __future__ import annotations

import os
import socket
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

ENGINE_SOCKET = "/var/run/docker.sock"


class LoggingRelay:
    """A unix socket relayed to the engine's, the request line of each request it forwards
    written down (``paths``); threads only."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.paths: list[str] = []
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(path))
        self.server.listen(16)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(ENGINE_SOCKET)
            threading.Thread(target=self._pump, args=(client, upstream, True), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client, False), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, requests: bool) -> None:
        try:
            while data := src.recv(1 << 16):
                if requests:
                    for line in data.split(b"\r\n"):
                        parts = line.split(b" ")
                        if len(parts) == 3 and parts[2].startswith(b"HTTP/1."):
                            self.paths.append(parts[1].decode("latin-1"))
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def relay(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[LoggingRelay]:
    if not os.path.exists(ENGINE_SOCKET):
        pytest.skip("no Docker engine socket on this machine")
    r = LoggingRelay(tmp_path / "engine.sock")
    monkeypatch.setenv("DOCKER_HOST", f"unix://{r.path}")
    try:
        yield r
    finally:
        r.close()


def test_the_engine_client_reads_the_api_version_from_the_ping(relay: LoggingRelay) -> None:
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
