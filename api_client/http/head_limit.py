"""Request heads bounded in the server too: ``studio-code serve``'s HTTP protocol.

``RequestLimits`` (api_client.http.limits) answers 431 HEADERS_TOO_LARGE for a header or a
head over its cap, wherever the app is served, but it sees a request only once the server
has read its whole head, and uvicorn's httptools protocol keeps reading a head however
large it grows (a 4 MiB header was read whole, then served). ``bounded_http_protocol``
gives ``serve`` the same protocol with one change: the bytes of a head still being read
are counted as they arrive, and a head past STUDIO_API_HEAD_MAX_BYTES is answered 431 (the
same JSON body) and its connection closed, so the server never holds more of a head than
the cap and one read (asyncio reads at most 256 KiB at a time).

Counted: every read that arrives while a head is incomplete, from the read after the one
that began it (a read can hold the end of the previous request too: not counting the
first read of a head never counts another request's bytes, so a head within the cap is
never refused here; the middleware checks it exactly).
"""

from __future__ import annotations

import logging
from typing import Any

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
        super().on_headers_complete()

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
