"""A counting relay in front of the Docker engine's socket (bench.engine_calls): a unix socket
of its own that passes every byte on to the engine's, both ways, and counts each HTTP request
a client makes on it as ``METHOD /path/template`` (h11 reads the requests; the answers are
passed on unread). An attach's connection turns into a raw stream after its request
(``Upgrade: tcp``): from there on its bytes are passed on uncounted. It never changes,
delays or refuses a byte: the engine sees what it would see on its own socket.

    with CountingRelay(Path(tmp) / "relay.sock") as relay:
        ... DOCKER_HOST=relay.host ...
        relay.counts()  # Counter({"POST /containers/create": 3, ...})
"""

from __future__ import annotations

import re
import socket
import threading
from collections import Counter
from pathlib import Path
from typing import Any

import h11

#: ``/v1.41`` and the like, at the start of a path
VERSION = re.compile(r"^/v\d+\.\d+(?=/)")
#: the second segment of these is a name or an id (``/containers/json`` and the like aside)
NAMED = {"containers", "exec", "networks", "volumes", "plugins", "secrets", "configs"}
FIXED = {"json", "create", "prune"}


def template(target: bytes) -> str:
    """``/v1.41/containers/3f2a.../start?x=1`` -> ``/containers/{id}/start``; an image's name
    (which may hold slashes) -> ``/images/{name}/<verb>``."""
    path = VERSION.sub("", target.decode("latin-1").split("?", 1)[0])
    parts = path.split("/")
    if len(parts) > 2 and parts[1] in NAMED and parts[2] not in FIXED:
        parts[2] = "{id}"
    elif len(parts) > 3 and parts[1] == "images" and parts[2] not in FIXED:
        parts = [*parts[:2], "{name}", parts[-1]]
    return "/".join(parts)


class CountingRelay:
    """Listens on ``path``; each connection is relayed to ``upstream`` (a unix socket path)."""

    def __init__(self, path: Path, upstream: str = "/var/run/docker.sock") -> None:
        self.path = path
        self.host = f"unix://{path}"
        self.upstream = upstream
        self._counts: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(str(path))
        self._listener.listen(64)
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="relay-accept", daemon=True)
        self._thread.start()

    def __enter__(self) -> CountingRelay:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def counts(self) -> Counter[str]:
        """What was counted so far (a copy)."""
        with self._lock:
            return Counter(self._counts)

    def close(self) -> None:
        self._closed = True
        try:
            self._listener.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._listener.close()
        self._thread.join(5)
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            engine = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                engine.connect(self.upstream)
            except OSError:
                client.close()
                engine.close()
                continue
            ends = [2]
            for src, dst, count in ((client, engine, True), (engine, client, False)):
                threading.Thread(
                    target=self._pump, args=(src, dst, count, ends), daemon=True
                ).start()

    def _pump(self, src: socket.socket, dst: socket.socket, count: bool, ends: list[int]) -> None:
        """Bytes from ``src`` to ``dst`` until EOF (then half-closed, as an attach's stdin
        needs); with ``count``, the requests in them counted."""
        conn: Any = h11.Connection(h11.SERVER) if count else None
        try:
            while True:
                data = src.recv(1 << 16)
                if not data:
                    break
                dst.sendall(data)
                if conn is not None:
                    conn = self._count(conn, data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        with self._lock:
            ends[0] -= 1
            last = ends[0] == 0
        if last:
            src.close()
            dst.close()

    def _count(self, conn: Any, data: bytes) -> Any:
        """Feed ``data`` to the parser; returns the parser to go on with, or None once the
        connection is a raw stream (an upgrade) or no longer HTTP."""
        conn.receive_data(data)
        while True:
            try:
                event = conn.next_event()
            except h11.RemoteProtocolError:
                return None
            if event is h11.NEED_DATA:
                return conn
            if event is h11.PAUSED or isinstance(event, h11.ConnectionClosed):
                # a request ended: the next one starts a new parser (the answer is not read
                # here, so h11 would wait for it forever)
                if conn.their_state is h11.MIGHT_SWITCH_PROTOCOL:
                    return None
                rest, _ = conn.trailing_data
                conn = h11.Connection(h11.SERVER)
                if not rest:
                    return conn
                conn.receive_data(rest)
                continue
            if isinstance(event, h11.Request):
                key = f"{event.method.decode()} {template(event.target)}"
                with self._lock:
                    self._counts[key] += 1
