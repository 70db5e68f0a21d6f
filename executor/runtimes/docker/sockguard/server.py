"""The socket guard's server: one thread, one event loop (asyncio on epoll; never
``select()``, which fails past descriptor 1024), so a connection costs a descriptor and a
little memory, never a thread (under a pids limit a thread per connection ended the guard:
issue 38).

Per connection: read a request (``grammar``, within ``Bounds.head_timeout_s`` of its first
byte), decide (``routes.decide``, its container lookups answered here with an engine
inspect of the guard's own), read and check a create's body (``create``), then write the
engine the call the guard made (``upstream``) and frame its answer back; an allowed attach
becomes a raw stream both ways. Engine connections are kept between calls and reused.

Bounded (``Bounds``, STUDIO_CODE_SOCKGUARD_*): connections in total and per peer
(SO_PEERCRED uid and pid), answered 503 and closed past either; a request not whole in time
408; an idle connection closed. The soft RLIMIT_NOFILE is raised to the hard one at start
and the total bound lowered to what it allows. An accept that fails (EMFILE...) or a
connection's task that cannot start pauses the accept loop (backing off), and a connection
that fails in any way ends alone: nothing a client does ends the guard.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import resource
import socket
import stat
import struct
import time
from dataclasses import dataclass
from typing import Any

from executor.runtimes.docker.sockguard.create import Policy, create_body
from executor.runtimes.docker.sockguard.grammar import (
    MAX_HEAD,
    Refused,
    Request,
    check_length,
    check_raw,
    parse_head,
    read_body,
    refusal,
)
from executor.runtimes.docker.sockguard.routes import (
    LOOKUP_VERSION,
    NeedLookup,
    decide,
    ours,
)
from executor.runtimes.docker.sockguard.upstream import (
    CHUNK,
    Answer,
    Broken,
    Call,
    Closed,
    Late,
    Upstream,
    exchange,
    recv,
    splice,
)
from executor.sandbox_names import LABEL_OWNER

log = logging.getLogger("studio_code.sockguard")

#: engine connections kept open between two calls
IDLE_UPSTREAM = 16


class _Client:
    """The client's socket (non-blocking) and what was read of it past the last request.
    A request must be read whole within ``head_timeout_s`` of its first byte; a connection
    with no request begun for ``idle_timeout_s`` is closed."""

    def __init__(
        self, sock: socket.socket, loop: asyncio.AbstractEventLoop, bounds: Bounds
    ) -> None:
        self.sock = sock
        self.loop = loop
        self.bounds = bounds
        self.buf = bytearray()
        self.deadline: float | None = None  # monotonic: the request begun must be read by then

    async def _fill(self) -> None:
        if self.deadline is None:
            timeout = self.bounds.idle_timeout_s
        else:
            timeout = self.deadline - time.monotonic()
        try:
            data = await recv(self.loop, self.sock, timeout)
        except Late:
            if self.deadline is None:
                raise Closed() from None  # idle: closed without a word
            raise
        if not data:
            raise Closed()
        if self.deadline is None:
            self.deadline = time.monotonic() + self.bounds.head_timeout_s
        self.buf += data

    async def head(self) -> bytes:
        """Up to and including the blank line ending a request's head, checked as it comes."""
        self.deadline = (
            time.monotonic() + self.bounds.head_timeout_s if self.buf else None
        )  # a pipelined request's first bytes are here already
        while True:
            end = self.buf.find(b"\r\n\r\n")
            region = bytes(self.buf[: end + 4] if end >= 0 else self.buf[: MAX_HEAD + 4])
            check_raw(region, end >= 0)
            if end >= 0:
                if end + 4 > MAX_HEAD:
                    raise Refused("the request head is too long", 431)
                del self.buf[: end + 4]
                return region
            if len(self.buf) > MAX_HEAD:
                raise Refused("the request head is too long", 431)
            await self._fill()

    async def exact(self, n: int) -> bytes:
        while len(self.buf) < n:
            await self._fill()
        out = bytes(self.buf[:n])
        del self.buf[:n]
        return out


def _drop(sock: socket.socket, last: bytes) -> None:
    """Close a client's connection, with ``last`` if its socket takes it at once. What the
    client sent and the guard did not read is read first (a unix socket closed with unread
    bytes resets its peer, which would lose ``last``)."""
    try:
        if last:
            sock.send(last, socket.MSG_DONTWAIT)
        sock.shutdown(socket.SHUT_WR)
        for _ in range(16):
            if not sock.recv(CHUNK, socket.MSG_DONTWAIT):
                break
    except OSError:
        pass
    sock.close()


@dataclass(frozen=True)
class Bounds:
    """How much of the guard one client, and all of them, may hold (issue 38): connections
    in total and per peer (the connecting process as SO_PEERCRED names it: uid and pid; a
    peer in another pid namespace, such as a worker container, is pid 0, so those of one
    uid share one bound), the time a request may take from its first byte to its last,
    and the time a connection may sit with no request begun. STUDIO_CODE_SOCKGUARD_*."""

    max_connections: int = 4096
    max_per_peer: int = 1024
    head_timeout_s: float = 5.0
    idle_timeout_s: float = 300.0

    @classmethod
    def from_settings(cls, settings: Any) -> Bounds:
        return cls(
            max_connections=settings.code_sockguard_max_connections,
            max_per_peer=settings.code_sockguard_max_per_peer,
            head_timeout_s=settings.code_sockguard_head_timeout_s,
            idle_timeout_s=settings.code_sockguard_idle_timeout_s,
        )


#: descriptors kept free of clients: the listening socket, the log, the engine lookups'
FD_RESERVE = 64
#: the longest pause of the accept loop after a failure (EMFILE, no memory for a task)
MAX_BACKOFF_S = 1.0


def raise_nofile() -> int:
    """Raise this process's RLIMIT_NOFILE soft limit to its hard limit; the soft limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    return soft


def peer_of(sock: socket.socket) -> tuple[int, int]:
    """The connecting process's (uid, pid) (SO_PEERCRED); (-1, -1) when unknown."""
    try:
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid, uid, _gid = struct.unpack("3i", raw)
    except OSError:
        return -1, -1
    return uid, pid


class _Every:
    """A log line at most once a second, saying how many like it were left out."""

    def __init__(self) -> None:
        self.next = 0.0
        self.skipped = 0

    def log(self, level: int, message: str) -> None:
        now = time.monotonic()
        if now < self.next:
            self.skipped += 1
            return
        if self.skipped:
            message += f" (and {self.skipped} more like it in the last second)"
        self.next, self.skipped = now + 1.0, 0
        log.log(level, message)


class SockGuard:
    """Listens on ``listen`` (a unix socket path) and passes allowed calls to ``upstream``.

    One thread, one event loop (asyncio's epoll; never ``select()``, which fails past
    descriptor 1024): a connection costs its descriptor and a little memory, no thread.
    ``bounds`` caps what clients hold; a failure to accept (EMFILE...) or to start a
    connection's task closes that client and pauses the accept loop, never ends the guard.
    """

    def __init__(
        self,
        policy: Policy,
        listen: str,
        upstream: str,
        *,
        mode: int = 0o660,
        trace: bool = False,
        bounds: Bounds | None = None,
    ) -> None:
        self.policy, self.listen, self.upstream = policy, listen, upstream
        self.mode, self.trace = mode, trace
        self.bounds = bounds or Bounds()
        self._ours: set[str] = set()  # full ids checked (or created) as sandboxes
        self._server: socket.socket | None = None
        self._closing = False
        self._idle: list[Upstream] = []  # engine connections between two calls
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._peers: dict[tuple[int, int], int] = {}
        self._open = 0
        self._max_open = self.bounds.max_connections
        self._refusing = _Every()
        self._late = _Every()
        self._failing = _Every()

    def bind(self) -> None:
        try:
            if stat.S_ISSOCK(os.lstat(self.listen).st_mode):
                os.unlink(self.listen)  # a previous guard's
        except FileNotFoundError:
            pass
        # Bound and listening under a name of its own, then renamed into place: the path
        # appears only once a connect to it is accepted (a client that sees the path
        # between bind and listen would be refused, ECONNREFUSED).
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        staging = f"{self.listen}.{os.getpid()}.new"
        old = os.umask(0o777 & ~self.mode)
        try:
            server.bind(staging)
        finally:
            os.umask(old)
        try:
            os.chmod(staging, self.mode)
            server.listen(4096)
            os.rename(staging, self.listen)
        except BaseException:
            server.close()
            with contextlib.suppress(OSError):
                os.unlink(staging)
            raise
        server.setblocking(False)
        self._server = server

    def serve_forever(self) -> None:
        if self._server is None:
            self.bind()
        soft = raise_nofile()
        # each client may hold an engine connection too: two descriptors
        self._max_open = max(1, min(self.bounds.max_connections, (soft - FD_RESERVE) // 2))
        log.info(
            "sockguard: listening on %s, passing sandbox calls on to %s (images: %s); at most "
            "%d connections (%d per peer; RLIMIT_NOFILE %d), a request whole within %g s",
            self.listen,
            self.upstream,
            ", ".join(sorted(self.policy.images)),
            self._max_open,
            self.bounds.max_per_peer,
            soft,
            self.bounds.head_timeout_s,
        )
        if self._max_open < self.bounds.max_connections:
            log.warning(
                "sockguard: RLIMIT_NOFILE %d allows %d connections, not the %d of "
                "STUDIO_CODE_SOCKGUARD_MAX_CONNECTIONS",
                soft,
                self._max_open,
                self.bounds.max_connections,
            )
        if not self._closing:
            asyncio.run(self._main())

    def close(self) -> None:
        """Stop serving (from any thread, or a signal handler)."""
        self._closing = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None:
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:
                pass  # the loop has ended
        elif self._server is not None:
            self._server.close()
        try:
            os.unlink(self.listen)
        except OSError:
            pass

    async def _main(self) -> None:
        assert self._server is not None
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        if self._closing:
            return
        accepting = asyncio.create_task(self._accept(self._server))
        try:
            await self._stop.wait()
        finally:
            accepting.cancel()
            self._server.close()

    async def _accept(self, server: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        backoff = 0.0
        tasks: set[asyncio.Task[None]] = set()
        while not self._closing:
            if backoff:
                await asyncio.sleep(backoff)
            try:
                client, _ = await loop.sock_accept(server)
            except OSError as e:
                # EMFILE, ENFILE, ENOBUFS, ENOMEM: wait for clients to go, then on
                backoff = min(MAX_BACKOFF_S, max(0.05, backoff * 2))
                self._failing.log(logging.ERROR, f"sockguard: accepting a connection: {e}")
                continue
            peer = peer_of(client)
            why = self._admit(peer)
            if why:
                self._refusing.log(logging.WARNING, f"sockguard refused a connection: {why}")
                _drop(client, refusal(503, f"sockguard: {why}"))
                continue
            try:
                client.setblocking(False)
                task = loop.create_task(self._serve(client, peer))
            except Exception as e:  # no memory for it: this client goes, the guard stays
                self._release(peer)
                _drop(client, b"")
                backoff = min(MAX_BACKOFF_S, max(0.05, backoff * 2))
                self._failing.log(logging.ERROR, f"sockguard: serving a connection: {e!r}")
                continue
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            backoff = 0.0

    def _admit(self, peer: tuple[int, int]) -> str:
        """Count a new connection of ``peer`` in, or say why not."""
        if self._open >= self._max_open:
            return (
                f"{self._open} connections open, at most {self._max_open} "
                "(STUDIO_CODE_SOCKGUARD_MAX_CONNECTIONS)"
            )
        held = self._peers.get(peer, 0)
        if held >= self.bounds.max_per_peer:
            return (
                f"uid {peer[0]} pid {peer[1]} holds {held} connections, at most "
                f"{self.bounds.max_per_peer} (STUDIO_CODE_SOCKGUARD_MAX_PER_PEER)"
            )
        self._open += 1
        self._peers[peer] = held + 1
        return ""

    def _release(self, peer: tuple[int, int]) -> None:
        self._open -= 1
        left = self._peers.get(peer, 1) - 1
        if left > 0:
            self._peers[peer] = left
        else:
            self._peers.pop(peer, None)

    # --- one client connection ---------------------------------------------------------

    async def _serve(self, client: socket.socket, peer: tuple[int, int]) -> None:
        loop = asyncio.get_running_loop()
        cs = _Client(client, loop, self.bounds)
        try:
            while await self._one(cs):
                pass
        except (OSError, Closed):
            pass
        except Late:
            self._late.log(
                logging.WARNING,
                f"sockguard: a request of uid {peer[0]} pid {peer[1]} not whole within "
                f"{self.bounds.head_timeout_s:g} s (STUDIO_CODE_SOCKGUARD_HEAD_TIMEOUT_S): "
                "connection closed",
            )
            _drop(
                client,
                refusal(
                    408,
                    f"sockguard: the request was not whole within {self.bounds.head_timeout_s:g} s",
                ),
            )
        except Exception:  # a bug in a connection's handling ends it, never the guard
            log.exception("sockguard: a connection failed")
        finally:
            client.close()
            self._release(peer)

    async def _one(self, cs: _Client) -> bool:
        """Read, decide and pass on one request; False: close the client connection."""
        loop = cs.loop
        what = ""
        try:
            head = await cs.head()
            what = head.split(b"\r\n", 1)[0].decode("ascii")[:200]
            conn, req, length = parse_head(head)
            call = await self._decide(req)
            check_length(length)
            read_body(conn, req, await cs.exact(length) if length else b"", length)
            cs.deadline = None
            if call.op == "create":
                call.body = create_body(self.policy, req, dict(call.query).get("name"))
        except Refused as e:
            if not what and cs.buf:
                first = bytes(cs.buf[:200]).split(b"\n", 1)[0]
                what = first.decode("ascii", "backslashreplace").rstrip("\r")
            if e.status == 404:  # the engine's own answer, not a refusal
                log.info("sockguard: %s: %s", what, e.message)
            else:
                log.warning("sockguard refused %s: %s", what, e.message)
            await loop.sock_sendall(cs.sock, refusal(e.status, f"sockguard: {e.message}"))
            return False
        if self.trace:
            log.info("sockguard passed %s %s", call.method, call.target)
        try:
            up = self._connect()
        except OSError as e:  # EMFILE, or the engine is gone: this client's call fails
            self._failing.log(logging.ERROR, f"sockguard: connecting to the engine: {e}")
            message = f"sockguard: the engine's socket could not be reached ({e})"
            await loop.sock_sendall(cs.sock, refusal(503, message))
            return False
        try:
            answer = await exchange(loop, up, call, cs.sock)
        except (Broken, Closed, OSError) as e:
            up.sock.close()
            if isinstance(e, Broken):
                log.warning("sockguard: %s", e)
            return False
        except BaseException:
            up.sock.close()
            raise
        if answer.upgraded is not None:
            try:
                await loop.sock_sendall(cs.sock, answer.render())
                pending, cs.buf = bytes(cs.buf), bytearray()
                await splice(loop, cs.sock, pending, up.sock, answer.upgraded)
            finally:
                up.sock.close()
            return False
        self._after(call, answer)
        if up.reusable():
            self._put_back(up)
        else:
            up.sock.close()
        closing = (req.get("connection") or "").lower() == "close"
        await loop.sock_sendall(
            cs.sock, answer.render(head_only=call.method == "HEAD", closing=closing)
        )
        return not closing

    def _after(self, call: Call, answer: Answer) -> None:
        """What the guard learns from an answer: the ids it created, the ids removed."""
        if call.op == "create" and answer.status == 201:
            try:
                self._remember(str(json.loads(answer.body)["Id"]))
            except (ValueError, KeyError, TypeError):
                pass
        elif call.op == "remove" and 200 <= answer.status < 300:
            self._ours.discard(call.path.rsplit("/", 1)[1])

    def _connect(self) -> Upstream:
        """An idle engine connection the engine still holds open, else a new one (the Docker
        SDK opens a connection per URL, so most client connections carry one call: reusing
        the engine's side saves a connect per call)."""
        while self._idle:
            up = self._idle.pop()
            try:
                if up.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b"":
                    up.sock.close()  # closed by the engine meanwhile
                    continue
            except BlockingIOError:
                return up  # open, nothing unread: as it was left
            except OSError:
                pass
            up.sock.close()  # unread bytes or an error: not reusable
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.setblocking(False)
        try:
            # a unix socket connects at once, or fails: EAGAIN when the engine's backlog is
            # full (a blocking connect would hold the whole event loop)
            s.connect(self.upstream)
        except OSError:
            s.close()
            raise
        return Upstream(s)

    def _put_back(self, up: Upstream) -> None:
        if len(self._idle) < IDLE_UPSTREAM:
            self._idle.append(up)
            return
        up.sock.close()

    # --- the decision: routes.decide, its lookups answered here -----------------------

    async def _decide(self, req: Request) -> Call:
        """``decide``'s call for ``req``; each container it must know of is looked up on the
        engine (``_sandbox_id``) and the decision taken again, with the answer."""
        known: dict[str, str | Refused] = {}

        def lookup(ref: str) -> str:
            if ref in self._ours:
                return ref
            if ref not in known:
                raise NeedLookup(ref)
            found = known[ref]
            if isinstance(found, Refused):
                raise found
            return found

        while True:
            try:
                return decide(req, lookup, self.policy.images)
            except NeedLookup as need:
                try:
                    known[need.ref] = await self._sandbox_id(need.ref)
                except Refused as e:
                    known[need.ref] = e

    async def _sandbox_id(self, ref: str) -> str:
        """The full id of the container ``ref`` names if it is one of ours, else Refused. The
        lookup has an engine connection of its own."""
        if ref in self._ours:
            return ref
        try:
            up = self._connect()
        except OSError as e:
            raise Refused(f"looking up {ref}: {e}", 502) from e
        try:
            loop = asyncio.get_running_loop()
            lookup = Call("GET", f"{LOOKUP_VERSION}/containers/{ref}/json")
            answer = await exchange(loop, up, lookup)
        except (Broken, OSError) as e:
            up.sock.close()
            raise Refused(f"looking up {ref}: {e}", 502) from e
        if up.reusable():
            self._put_back(up)
        else:
            up.sock.close()
        if answer.status == 404:
            raise Refused(f"No such container: {ref}", 404)
        if answer.status != 200:
            raise Refused(f"the engine answered {answer.status} looking up {ref}", 502)
        try:
            info = json.loads(answer.body)
            cid, name = str(info["Id"]), info.get("Name")
        except (ValueError, KeyError, TypeError) as e:
            raise Refused(f"the engine's answer looking up {ref} is not an inspect", 502) from e
        if not (re.match(r"^[0-9a-f]{64}$", cid) and (cid.startswith(ref) or name == f"/{ref}")):
            raise Refused(f"the engine's answer looking up {ref} is for another container", 502)
        if not ours((info.get("Config") or {}).get("Labels")):
            raise Refused(
                f"container {ref}: not a sandbox (no {LABEL_OWNER} label with a job or pool)"
            )
        self._remember(cid)
        return cid

    def _remember(self, cid: str) -> None:
        if len(self._ours) > 100_000:
            self._ours.clear()
        self._ours.add(cid)
