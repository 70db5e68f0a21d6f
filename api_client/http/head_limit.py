"""Request heads bounded in the server too: ``studio-code serve``'s HTTP protocol.

``RequestLimits`` (api_client.http.limits) answers 431 HEADERS_TOO_LARGE for a header or a
head over its cap, wherever the app is served, but it sees a request only once the server
has read its whole head, and uvicorn's httptools protocol keeps reading a head however
large it grows (a 4 MiB header was read whole, then served). ``bounded_http_protocol``
gives ``serve`` the same protocol with one change: the bytes of a head still being read
are counted as they arrive, and a head past STUDIO_API_HEAD_MAX_BYTES is answered 431 (the
same JSON body) and its connection closed, so the server never holds more of a head than
the cap and one read (asyncio reads at most 256 KiB at a time).

The same protocol writes a response's head and its body in one send when the body follows
in the same turn of the loop (a whole response: every JSON answer), instead of uvicorn's
two writes, so the caller reads the answer in one segment rather than waking twice (the
second write arriving after the caller woke for the first). A head whose body comes later
(a stream, Server-Sent Events) is written at the end of that turn, as before.

Counted: every read that arrives while a head is incomplete, from the read after the one
that began it (a read can hold the end of the previous request too: not counting the
first read of a head never counts another request's bytes, so a head within the cap is
never refused here; the middleware checks it exactly).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from api_client.http.limits import (
    HEADERS_TOO_LARGE,
    REFUSED_TOTAL,
    error_body,
    head_too_large_message,
)
from executor.settings import Settings

log = logging.getLogger("studio_code.http")


class _BoundedHttpTools(HttpToolsProtocol):
    """uvicorn's httptools protocol, a head over ``head_max`` answered 431 and closed."""

    head_max = 64 * 1024
    refusal = b""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._in_head = False
        self._began = False  # a head began during the current read
        self._head_bytes = 0

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head, self._began, self._head_bytes = True, True, 0

    def on_headers_complete(self) -> None:
        self._in_head = False
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is not None and self.cycle is not before:
            self.cycle.transport = cast(asyncio.Transport, _OneWrite(self.transport, self.loop))

    def data_received(self, data: bytes) -> None:
        self._began = False
        super().data_received(data)
        if not self._in_head or self._began or self.transport.is_closing():
            return
        self._head_bytes += len(data)
        if self._head_bytes > self.head_max:
            self._refuse()

    def _refuse(self) -> None:
        log.warning(
            "a request head over %d bytes from %s refused (431)", self.head_max, self.client
        )
        idle = self.cycle is None or self.cycle.response_complete
        if idle:  # no response of an earlier request under way on this connection
            self.transport.write(self.refusal)
        self.transport.close()


class _OneWrite:
    """A request's view of its connection's transport: its first write (the response's
    head) is held until the next write (its body), which sends both at once, or until the
    end of the current turn of the loop (a body that comes later), or a close."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None
        self._first = True

    def write(self, data: bytes) -> None:
        if self._first:
            self._first = False
            self._held = data
            self._loop.call_soon(self._flush)
            return
        held, self._held = self._held, None
        self._transport.write(data if held is None else held + data)

    def _flush(self) -> None:
        held, self._held = self._held, None
        if held is not None and not self._transport.is_closing():
            self._transport.write(held)

    def close(self) -> None:
        self._flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


def bounded_http_protocol(settings: Settings) -> type[HttpToolsProtocol]:
    """The protocol class ``serve`` hands uvicorn (``http=``): heads over
    STUDIO_API_HEAD_MAX_BYTES answered 431 HEADERS_TOO_LARGE while they are read."""
    limit = settings.api_head_max_bytes
    body = error_body(HEADERS_TOO_LARGE, head_too_large_message(limit + 1, limit, at_least=True))
    refusal = (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
        b"content-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"connection: close\r\n\r\n" + body
    )

    class BoundedHttpTools(_BoundedHttpTools):
        head_max = settings.api_head_max_bytes

        def _refuse(self) -> None:
            REFUSED_TOTAL.labels(HEADERS_TOO_LARGE).inc()
            super()._refuse()

    BoundedHttpTools.refusal = refusal
    return BoundedHttpTools
