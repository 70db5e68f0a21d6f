"""The socket guard's first step: a request's bytes read strictly, before any decision.

h11 (the parser used next) is lenient in places, and the engine (Go's net/textproto) reads
some heads differently again; every such difference was a bypass once (issue 30). So the
raw head is checked byte by byte first and refused (HTTP 400) with a bare CR or LF, a
control or non-ASCII byte, an obs-fold or a header line of another shape;
``Transfer-Encoding``, ``Expect``, ``TE``, ``Trailer``, two ``Content-Length``, ``Host``,
``Connection`` or ``Upgrade`` headers; a request line other than ``GET|HEAD|POST|DELETE
/origin-form HTTP/1.1`` (no absolute form, no ``OPTIONS *``, no HTTP/1.0); a head over
``MAX_HEAD``. Then h11 reads it, and must agree. Nothing here does I/O.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import h11

MAX_HEAD = 64 * 1024
MAX_BODY = 4 * 1024 * 1024


class Refused(Exception):
    """A call the guard does not pass on; the message says what and why."""

    def __init__(self, message: str, status: int = 403) -> None:
        super().__init__(message)
        self.message, self.status = message, status


_REQUEST_LINE = re.compile(rb"^(GET|HEAD|POST|DELETE) (/[!-~]*) HTTP/1\.1$")
_HEADER_LINE = re.compile(rb"^[!#$%&'*+.^_`|~0-9A-Za-z-]+: *(?:[!-~](?:[ -~]*[!-~])?)? *$")
_NOT_HEAD_BYTE = re.compile(rb"[^\x20-\x7e\r\n]")
_BARE_LF = re.compile(rb"(?<!\r)\n")
_BARE_CR = re.compile(rb"\r(?!\n)")
_FOLD = re.compile(rb"\n[ \t]")
#: headers a request to the guard never carries (the framing is Content-Length only)
_NEVER = {b"transfer-encoding", b"expect", b"te", b"trailer", b"proxy-connection"}
_LENGTH = re.compile(rb"^(0|[1-9][0-9]{0,8})$")
_CONNECTION = {b"keep-alive", b"close", b"upgrade"}


def check_raw(region: bytes, complete: bool) -> None:
    """Refuse what h11 would read leniently (or Go's net/textproto differently): a bare LF
    or CR, a control or non-ASCII byte, an obs-fold. ``region``: the head so far."""
    if not complete and region.endswith(b"\r"):
        region = region[:-1]  # its LF may come with the next read
    if m := _NOT_HEAD_BYTE.search(region):
        raise Refused(f"a control or non-ASCII byte {m.group(0)!r} in the request head", 400)
    if _BARE_LF.search(region):
        raise Refused("a bare LF in the request head: lines end with CRLF", 400)
    if _BARE_CR.search(region):
        raise Refused("a bare CR in the request head: lines end with CRLF", 400)
    if _FOLD.search(region):
        raise Refused("a folded header line (obs-fold) in the request head", 400)


@dataclass
class Request:
    """A request as the guard read it (h11's reading, after the guard's own checks)."""

    method: str
    target: str
    headers: list[tuple[str, str]]  # names lowercased
    body: bytes = b""

    def get(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k == name]
        return values[0] if values else None


def parse_head(head: bytes) -> tuple[h11.Connection, Request, int]:
    """The request ``head`` names, read by the guard's line rules and by h11 (which must
    agree), and the length of its body."""
    lines = head[:-4].split(b"\r\n")
    m = _REQUEST_LINE.match(lines[0])
    if not m:
        raise Refused(
            f"the request line {lines[0][:100]!r}: the guard takes GET, HEAD, POST or DELETE "
            "of a path, HTTP/1.1",
            400,
        )
    names: list[bytes] = []
    for line in lines[1:]:
        if not _HEADER_LINE.match(line):
            raise Refused(f"a malformed header line {line[:80]!r}", 400)
        name, _, value = line.partition(b":")
        names.append(name.lower())
        if name.lower() == b"content-length" and not _LENGTH.match(value.strip()):
            raise Refused(f"Content-Length {value.strip()[:40]!r}: not a length", 400)
    for name in set(names):
        if name in _NEVER:
            raise Refused(f"the header {name.decode()}: the guard takes a plain request", 400)
        if names.count(name) > 1 and name in (
            b"content-length",
            b"host",
            b"connection",
            b"upgrade",
        ):
            raise Refused(f"the header {name.decode()} given twice", 400)
    conn = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD + 1)
    conn.receive_data(head)
    try:
        event = conn.next_event()
    except h11.RemoteProtocolError as e:
        raise Refused(f"a malformed request ({e})", 400) from e
    if not isinstance(event, h11.Request) or event.http_version != b"1.1":
        raise Refused("a malformed request", 400)
    headers = [(k.decode("ascii"), v.decode("ascii")) for k, v in event.headers]
    req = Request(event.method.decode("ascii"), event.target.decode("ascii"), headers)
    if req.method != m.group(1).decode() or req.target != m.group(2).decode():
        raise Refused("a request line read two ways", 400)
    connection = req.get("connection")
    for option in connection.split(",") if connection is not None else []:
        if option.strip().lower().encode() not in _CONNECTION:
            raise Refused(f"Connection {req.get('connection')!r}: not a connection option", 400)
    return conn, req, int(req.get("content-length") or "0")


def check_length(length: int) -> None:
    if length > MAX_BODY:
        raise Refused("the request body is too large for a sandbox call", 413)


def read_body(conn: h11.Connection, req: Request, data: bytes, length: int) -> None:
    """``req.body``: ``data`` (the ``length`` bytes after the head) as h11 reads it, which
    must agree with the guard's framing."""
    conn.receive_data(data)
    body = bytearray()
    while True:
        try:
            event = conn.next_event()
        except h11.RemoteProtocolError as e:
            raise Refused(f"a malformed request body ({e})", 400) from e
        if isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            break
        else:  # NEED_DATA: h11 and the guard disagree on the framing
            raise Refused("a request body framed two ways", 400)
    if len(body) != length:
        raise Refused("a request body framed two ways", 400)
    req.body = bytes(body)


def refusal(status: int, message: str) -> bytes:
    body = json.dumps({"message": message}).encode()
    reason = {
        400: "Bad Request",
        403: "Forbidden",
        404: "Not Found",
        408: "Request Timeout",
        431: "Too Large",
        503: "Service Unavailable",
    }
    return (
        f"HTTP/1.1 {status} {reason.get(status, 'Refused')}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body
