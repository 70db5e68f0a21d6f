"""Two loopback TCP relays of a test's or a bench's own.

``Relay``: in front of a server of one's own (a redis-server), it forwards both ways until
``cut()``, which makes every connection it holds go SILENT: nothing is forwarded any more,
nothing is closed, no RST, no FIN, what a failover behind a VIP, a NAT or conntrack reset,
or a host losing power looks like from the client. While cut, new connections are accepted
by the kernel and held, never forwarded. ``heal()`` forwards new connections again (and the
held ones); the connections silenced by the cut stay silent forever, until ``stop()``
closes everything.

``ClosingRelay``: its ``cut()`` CLOSES every connection (what a server that went away looks
like): the store behind it is unreachable until ``restore()``.

Threads only (one acceptor, two pumps per connection), loopback only."""

from __future__ import annotations

import select
import socket
import threading
from pathlib import Path

from testkit.processes import StopsOnExit, free_port


class _Pair:
    """One client connection and its upstream: forwarded until silenced."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.silent = False
        self.closed = False

    def close(self) -> None:
        self.closed = True
        for s in (self.client, self.upstream):
            try:
                s.close()
            except OSError:
                pass


class Relay(StopsOnExit):
    """``127.0.0.1:<port>`` -> ``127.0.0.1:<target_port>``; see the module docstring."""

    def __init__(self, target_port: int, host: str = "127.0.0.1") -> None:
        self.target = (host, target_port)
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, 0))
        self._listener.listen(512)
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._pairs: list[_Pair] = []
        self._held: list[socket.socket] = []
        self._cut = False
        self._stopped = threading.Event()
        #: connections forwarded since the start (a test can see clients reconnect)
        self.connections = 0
        self._acceptor = threading.Thread(target=self._accept, name="relay-accept", daemon=True)
        self._acceptor.start()

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    @property
    def is_cut(self) -> bool:
        return self._cut

    def cut(self) -> None:
        """Every connection held now goes silent for good; new ones are held."""
        with self._lock:
            self._cut = True
            for pair in self._pairs:
                pair.silent = True

    def heal(self) -> None:
        """New connections (and those held during the cut) are forwarded again; the ones
        the cut silenced stay silent."""
        with self._lock:
            self._cut = False
            held, self._held = self._held, []
        for client in held:
            self._forward(client)

    def stop(self) -> None:
        self._stopped.set()
        try:
            self._listener.close()
        except OSError:
            pass
        with self._lock:
            pairs, self._pairs = self._pairs, []
            held, self._held = self._held, []
        for pair in pairs:
            pair.close()
        for s in held:
            s.close()
        self._acceptor.join(timeout=5)

    # --- the threads -------------------------------------------------------------------

    def _accept(self) -> None:
        while not self._stopped.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._cut:
                    self._held.append(client)
                    continue
            self._forward(client)

    def _forward(self, client: socket.socket) -> None:
        try:
            upstream = socket.create_connection(self.target, timeout=5)
            upstream.settimeout(None)
        except OSError:
            client.close()  # the server itself is down: what a client would see then
            return
        pair = _Pair(client, upstream)
        with self._lock:
            if self._stopped.is_set():
                pair.close()
                return
            if self._cut:  # cut while connecting: silent from the start
                pair.silent = True
            self._pairs.append(pair)
            self.connections += 1
        threading.Thread(target=self._pump, args=(pair,), name="relay-pump", daemon=True).start()

    def _pump(self, pair: _Pair) -> None:
        ends = {pair.client: pair.upstream, pair.upstream: pair.client}
        while not pair.closed and not self._stopped.is_set():
            if pair.silent:
                # Read nothing, write nothing, close nothing: the peer's kernel keeps the
                # connection open and its bytes sit in buffers, unanswered.
                self._stopped.wait(0.5)
                continue
            try:
                readable, _, _ = select.select(list(ends), [], [], 0.2)
            except (OSError, ValueError):
                break
            for src in readable:
                if pair.silent:
                    break
                try:
                    data = src.recv(65536)
                except OSError:
                    data = b""
                if not data:  # a real close by one side: passed on as a close
                    pair.close()
                    break
                try:
                    ends[src].sendall(data)
                except OSError:
                    pair.close()
                    break
        if self._stopped.is_set() or pair.closed:
            pair.close()
            with self._lock:
                if pair in self._pairs:
                    self._pairs.remove(pair)


class ClosingRelay:
    """A loopback TCP relay to 127.0.0.1:<port>; ``cut()`` closes it and every connection
    through it: the store behind it is unreachable until ``restore()``."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.port = free_port()
        self._socks: list[socket.socket] = []
        self._server: socket.socket | None = None
        self.restore()

    def restore(self) -> None:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", self.port))
        server.listen(16)
        self._server = server
        threading.Thread(target=self._accept, args=(server,), daemon=True).start()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                a, _ = server.accept()
            except OSError:
                return
            b = socket.create_connection(("127.0.0.1", self.target))
            self._socks += [a, b]
            for src, dst in ((a, b), (b, a)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cut(self) -> None:
        if self._server is not None:
            try:  # wakes the accept() blocked in the relay's thread (close alone does not)
                self._server.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._server.close()
            self._server = None
        for s in self._socks:
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            s.close()
        self._socks.clear()


class UnixRelay:
    """A unix socket at ``path`` forwarding to another (the machine's Docker socket by
    default), each direction until its sender half-closes; ``paths`` holds the target of
    every HTTP request line a client sent through it (the engine calls it relayed). Docker
    'comes back' for a process whose DOCKER_HOST names ``path`` when this starts."""

    def __init__(self, path: Path, target: str = "/var/run/docker.sock") -> None:
        self.path, self.target = path, target
        self.server: socket.socket | None = None
        self.paths: list[str] = []

    def start(self) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(str(self.path))
        self.server.listen(64)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        assert self.server is not None
        while True:
            try:
                client, _ = self.server.accept()
            except OSError:
                return
            upstream = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            upstream.connect(self.target)
            for a, b, sent in ((client, upstream, True), (upstream, client, False)):
                threading.Thread(target=self._pipe, args=(a, b, sent), daemon=True).start()

    def _pipe(self, a: socket.socket, b: socket.socket, requests: bool) -> None:
        try:
            while data := a.recv(65536):
                if requests:
                    for line in data.split(b"\r\n"):
                        parts = line.split(b" ")
                        if len(parts) == 3 and parts[2].startswith(b"HTTP/1."):
                            self.paths.append(parts[1].decode("latin-1"))
                b.sendall(data)
        except OSError:
            pass
        finally:
            try:
                b.shutdown(socket.SHUT_WR)  # a half-close: the other direction goes on
            except OSError:
                pass

    def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
        self.path.unlink(missing_ok=True)
