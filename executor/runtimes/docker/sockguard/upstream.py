"""The socket guard's engine side: the request it writes (``Call``), the answer it reads
whole and frames again (``Answer``), and the raw stream of an upgraded attach, all on
non-blocking sockets of the guard's event loop.

The engine's answers are framed by the guard: read whole with ``h11`` (a ``1xx`` is
consumed, never passed on), sent to the client with the guard's own status line, a few of the
engine's headers (``ANSWER_HEADERS``) and its own ``Content-Length``. An engine connection is
reused only after an answer read completely. Waits are readiness waits on the loop's epoll
(never ``select()``, which fails past descriptor 1024).
"""

from __future__ import annotations

import asyncio
import http
import socket
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import h11

from executor.runtimes.docker.sockguard.grammar import MAX_HEAD

MAX_ANSWER = 64 * 1024 * 1024
CHUNK = 1 << 16
#: the engine's answer headers passed back (framing and connection headers are the guard's)
ANSWER_HEADERS = ("content-type", "api-version", "docker-experimental", "ostype", "server", "date")


class Closed(Exception):
    """The peer closed its end."""


class Late(Exception):
    """A wait that ran out of time (a request not read whole within the head timeout)."""


@dataclass
class Call:
    """The request the guard sends the engine, written by the guard."""

    method: str
    path: str  # canonical, with the version prefix
    query: list[tuple[str, str]] = field(default_factory=list)
    body: bytes | None = None  # create's validated body
    upgrade: bool = False  # attach
    op: str = ""

    @property
    def target(self) -> str:
        return self.path + (f"?{urlencode(self.query)}" if self.query else "")

    def request(self) -> list[Any]:
        """The h11 events of this call."""
        headers = [("Host", "docker")]
        if self.body is not None:
            headers += [("Content-Type", "application/json")]
        if self.method == "POST":
            headers += [("Content-Length", str(len(self.body or b"")))]
        if self.upgrade:
            headers += [("Connection", "Upgrade"), ("Upgrade", "tcp")]
        events: list[Any] = [h11.Request(method=self.method, target=self.target, headers=headers)]
        if self.body:
            events.append(h11.Data(data=self.body))
        events.append(h11.EndOfMessage())
        return events


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes
    upgraded: bytes | None = None  # after a 101: what the engine sent past the head

    def render(self, head_only: bool = False, closing: bool = False) -> bytes:
        """The answer as the guard frames it for the client."""
        try:
            reason = http.HTTPStatus(self.status).phrase
        except ValueError:
            reason = "Unknown"
        lines = [f"HTTP/1.1 {self.status} {reason}"]
        lines += [f"{k.title()}: {v}" for k, v in self.headers if k in ANSWER_HEADERS]
        if self.status == 101:
            lines += ["Connection: Upgrade", "Upgrade: tcp"]
        elif head_only:
            length = next((v for k, v in self.headers if k == "content-length"), None)
            lines += [f"Content-Length: {length}"] if length is not None else []
        elif self.status not in (204, 304):
            lines += [f"Content-Length: {len(self.body)}"]
        if closing:
            lines += ["Connection: close"]
        head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return head if head_only or self.status in (101, 204, 304) else head + self.body


class Upstream:
    """A connection to the engine and h11's state of it."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.conn = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_HEAD)

    def reusable(self) -> bool:
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.DONE:
            self.conn.start_next_cycle()
            return True
        return False


def _wake(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


async def readable(
    loop: asyncio.AbstractEventLoop, socks: list[socket.socket], timeout: float | None
) -> socket.socket:
    """The first of ``socks`` that is readable (or closed); Late after ``timeout`` s. A
    readiness wait (the event loop's epoll), nothing read: no bytes lost if it is left."""
    fut: asyncio.Future[Any] = loop.create_future()
    fds = [s.fileno() for s in socks]
    for s, fd in zip(socks, fds, strict=True):
        loop.add_reader(fd, _wake, fut, s)
    late = loop.call_later(max(timeout, 0.0), _wake, fut, None) if timeout is not None else None
    try:
        ready = await fut
    finally:
        for fd in fds:
            loop.remove_reader(fd)
        if late is not None:
            late.cancel()
    if ready is None:
        raise Late()
    return ready  # type: ignore[no-any-return]


async def recv(
    loop: asyncio.AbstractEventLoop, sock: socket.socket, timeout: float | None = None
) -> bytes:
    """What ``sock`` (non-blocking) has, up to CHUNK; b"" once it is closed."""
    while True:
        try:
            return sock.recv(CHUNK)
        except (BlockingIOError, InterruptedError):
            pass
        await readable(loop, [sock], timeout)


async def exchange(
    loop: asyncio.AbstractEventLoop,
    up: Upstream,
    call: Call,
    client: socket.socket | None = None,
) -> Answer:
    """Send ``call`` on ``up`` and read its answer whole (1xx consumed), or up to a 101.
    While it waits, a ``client`` that closes ends the call (a client that gave up on a long
    poll); one that sends (a pipelined request) waits in the kernel."""
    await loop.sock_sendall(up.sock, b"".join(up.conn.send(e) or b"" for e in call.request()))
    status, headers, body = 0, [], bytearray()
    watching = client is not None
    while True:
        try:
            event = up.conn.next_event()
        except h11.RemoteProtocolError as e:
            raise Broken(f"the engine's answer to {call.method} {call.path} ({e})") from e
        if event is h11.NEED_DATA:
            if watching and client is not None:
                if await readable(loop, [up.sock, client], None) is client:
                    try:
                        if not client.recv(1, socket.MSG_PEEK):
                            raise Closed()
                        watching = False
                    except (BlockingIOError, InterruptedError):
                        pass
                    continue
            up.conn.receive_data(await recv(loop, up.sock))
        elif isinstance(event, h11.InformationalResponse):
            if event.status_code == 101 and call.upgrade:
                data, _ = up.conn.trailing_data
                hdrs = [(k.decode(), v.decode("latin-1")) for k, v in event.headers]
                return Answer(101, hdrs, b"", upgraded=bytes(data))
            continue  # a 1xx (100 Continue...) is never passed on
        elif isinstance(event, h11.Response):
            status = event.status_code
            headers = [(k.decode(), v.decode("latin-1")) for k, v in event.headers]
        elif isinstance(event, h11.Data):
            body += event.data
            if len(body) > MAX_ANSWER:
                raise Broken(f"the engine's answer to {call.method} {call.path} is too long")
        elif isinstance(event, h11.EndOfMessage):
            return Answer(status, headers, bytes(body))
        else:  # ConnectionClosed, PAUSED
            raise Broken(f"the engine closed before answering {call.method} {call.path}")


class Broken(Exception):
    """The engine's side failed or answered in a way the guard cannot frame."""


async def splice(
    loop: asyncio.AbstractEventLoop,
    client: socket.socket,
    pending: bytes,
    up: socket.socket,
    upgraded: bytes,
) -> None:
    """After an upgrade (attach): raw bytes both ways until both ends closed. A half-close
    (the sandbox's stdin EOF) is passed on as one."""
    if upgraded:
        await loop.sock_sendall(client, upgraded)
    if pending:
        await loop.sock_sendall(up, pending)

    async def pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := await recv(loop, src):
                await loop.sock_sendall(dst, data)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    await asyncio.gather(pump(client, up), pump(up, client))
