"""Every request bounded before the app reads it: a pure ASGI middleware.

``RequestLimits`` runs before FastAPI (which reads a body whole and parses it with the
recursion-prone ``json`` module) and answers in the documented error shape, in order:

    a header or the head over its cap 431 HEADERS_TOO_LARGE (STUDIO_API_HEADER_MAX_BYTES,
                                                            STUDIO_API_HEAD_MAX_BYTES)
    Host not in the allow-list        400 HOST_NOT_ALLOWED  (DNS rebinding)
    an identity header sent twice     400 HEADER_REPEATED   (X-Studio-User, X-Studio-Admin,
                                                            Authorization, Host)
    no or a wrong shared secret       401 UNAUTHENTICATED   (STUDIO_API_TOKEN, when set)
    a body over the route's cap       413 REQUEST_TOO_LARGE (Content-Length checked before a
                                                            byte is read; a chunked body
                                                            counted as it arrives)
    JSON nested deeper than the cap   400 REQUEST_TOO_DEEP  (STUDIO_API_JSON_MAX_DEPTH)

The head's sizes are those of the head as the server received it (each header line as
``name: value``, the request line as ``METHOD target HTTP/1.1``); a server must also stop
reading a head that grows too large before it is whole: ``studio-code serve`` does
(api_client.http.head_limit), a studio serving the routers sets its own server's limit.

``GET /healthz/live`` skips the Host and token checks: a liveness probe (Kubernetes sends
the pod's IP as Host) must work with no secret, and it answers nothing but ``{"ok": true}``.

The body is read here, at most up to the route's cap, and handed to the app as one
message; whatever the app receives after it (``http.disconnect``) comes from the server
untouched, so a route can still notice that its caller went away.

Where it applies: ``create_app`` wraps the whole app (``router_only=False``: every path;
an unknown path gets the small cap). A studio that mounts ``api_client.http.routes.ROUTERS``
in its own app adds it with ``router_only=True`` (and ``prefix`` if it included the routers
under one): only the routers' paths are checked and the studio's own routes pass untouched.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
from array import array
from collections.abc import Awaitable, Callable, MutableMapping
from itertools import accumulate
from typing import Any

from prometheus_client import Counter

from executor.settings import Settings

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

REFUSED_TOTAL = Counter(
    "studio_code_http_refused",
    "Requests the API refused before reading them, by error code (HEADERS_TOO_LARGE, "
    "HOST_NOT_ALLOWED, HEADER_REPEATED, UNAUTHENTICATED, REQUEST_TOO_LARGE, REQUEST_TOO_DEEP, "
    "REQUEST_INVALID).",
    ["code"],
)

LIVENESS_PATH = "/healthz/live"
#: the routes this service serves under /api (a studio mounting the router checks these only)
ROUTER_PREFIXES = ("/api/code/", "/api/runs", "/api/meta/")
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1")
IDENTITY_HEADERS = (b"x-studio-user", b"x-studio-admin", b"authorization", b"host")

#: the cap of every route not named in ``body_cap``: no other route takes a body
SMALL_BODY_BYTES = 64 * 1024
#: POST /api/code/validate: the code alone (1,000,000 characters, JSON-escaped)
CODE_BODY_BYTES = 8 * 1024 * 1024
#: a body up to this size is scanned for depth on the event loop; a larger one in a thread
_INLINE_SCAN_BYTES = 256 * 1024


HEADERS_TOO_LARGE = "HEADERS_TOO_LARGE"


def head_too_large_message(size: int, limit: int, *, at_least: bool = False) -> str:
    """The sentence of a 431 for a head of ``size`` bytes (``at_least``: still growing)."""
    return (
        f"The request's head (its request line and headers) is {size} bytes"
        f"{' or more' if at_least else ''}, over the {limit} the API takes "
        "(STUDIO_API_HEAD_MAX_BYTES): send fewer or smaller headers (a proxy or tracer "
        "adding large ones may be the cause)."
    )


def head_refusal(scope: Scope, settings: Settings) -> tuple[int, str, str] | None:
    """431 HEADERS_TOO_LARGE when a header line (``name: value``) is longer than
    STUDIO_API_HEADER_MAX_BYTES or the head (request line and header lines, each with its
    CRLF) than STUDIO_API_HEAD_MAX_BYTES; None when it fits."""
    line_max = settings.api_header_max_bytes
    target = len(scope.get("raw_path") or scope.get("path", "").encode())
    query = scope.get("query_string", b"")
    size = len(scope.get("method", "")) + 1 + target + (len(query) + 1 if query else 0) + 11
    for name, value in scope.get("headers", ()):
        line = len(name) + 2 + len(value)
        if line > line_max:
            shown = name.decode("latin-1")[:100]
            return (
                431,
                HEADERS_TOO_LARGE,
                f"The request's {shown!r} header is {line} bytes, over the {line_max} the "
                "API takes for one header (STUDIO_API_HEADER_MAX_BYTES): send it smaller, "
                "or not at all (a proxy or tracer adding a large one may be the cause).",
            )
        size += line + 2
    size += 2
    if size > settings.api_head_max_bytes:
        return 431, HEADERS_TOO_LARGE, head_too_large_message(size, settings.api_head_max_bytes)
    return None


def body_cap(settings: Settings, method: str, path: str) -> int:
    """The largest body a route takes, by method and path (relative to the router)."""
    if method == "POST" and path in ("/api/runs", "/api/code/test"):
        return settings.run_body_max_bytes
    if method == "POST" and path == "/api/code/validate":
        return min(CODE_BODY_BYTES, settings.run_body_max_bytes)
    return SMALL_BODY_BYTES


def is_loopback(host: str) -> bool:
    """A bind address or Host name that only this machine can reach."""
    host = host.strip().strip("[]").lower().rstrip(".")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind_refusal(settings: Settings, host: str) -> str | None:
    """Why ``serve`` must not bind ``host``: a non-loopback address with no shared secret
    would let anyone who reaches the port claim any user (None when it may)."""
    if is_loopback(host) or settings.api_token_bytes:
        return None
    return (
        f"Refusing to serve on {host!r} without STUDIO_API_TOKEN: the API believes the "
        "X-Studio-User header, so anyone who can reach a non-loopback port could act as "
        "any user (and, in subprocess mode, run code on this host). Set STUDIO_API_TOKEN "
        "(or STUDIO_API_TOKEN_FILE) to a secret the studio sends as 'Authorization: "
        "Bearer <token>', or bind 127.0.0.1."
    )


def _host_name(value: str) -> str:
    """The name part of a Host header: 'Example.com:8080' -> 'example.com', '[::1]:80' -> '::1'."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.split(":", 1)[0]
    return value.rstrip(".")


_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_SIGN = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")
_BLOCK = 1 << 15


def json_depth_over(body: bytes, max_depth: int) -> bool:
    """True when the JSON text nests arrays/objects deeper than ``max_depth``.

    Linear, in C but for a loop over 32 KiB blocks (which lets other threads run): escaped
    backslashes and quotes out, then every other piece between quotes (the strings) out,
    then all but brackets; then the running depth, skipping a block that cannot reach the
    limit. Invalid JSON may be misjudged: the parser refuses it anyway (and the stdlib
    parser raises on deep invalid input, it does not crash)."""
    if body.count(b"[") + body.count(b"{") <= max_depth:
        return False
    if b"\\" in body:  # a run of backslashes pairs up left to right, as JSON reads it
        body = body.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(body.split(b'"')[0::2]).translate(None, _NOT_BRACKETS)
    if len(brackets) <= max_depth:
        return False
    signs = brackets.translate(_SIGN)
    depth = 0
    for i in range(0, len(signs), _BLOCK):
        block = signs[i : i + _BLOCK]
        opens = block.count(1)
        if (
            depth + opens > max_depth
            and max(accumulate(array("b", block), initial=depth)) > max_depth
        ):
            return True
        depth += 2 * opens - len(block)
    return False


def error_body(code: str, message: str) -> bytes:
    return json.dumps({"error": {"code": code, "message": message}}).encode()


class RequestLimits:
    """The pure ASGI middleware described in the module docstring."""

    def __init__(
        self,
        app: ASGIApp,
        settings: Settings,
        *,
        bind_host: str | None = None,
        router_only: bool = False,
        prefix: str = "",
    ) -> None:
        self.app = app
        self.settings = settings
        self.router_only = router_only
        self.prefix = prefix.rstrip("/")
        self.any_host = "*" in settings.allowed_hosts
        hosts = {*LOOPBACK_NAMES, *settings.allowed_hosts}
        if bind_host and bind_host not in ("0.0.0.0", "::"):
            hosts.add(_host_name(bind_host))
        self.hosts = frozenset(hosts)
        self.token = settings.api_token_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = self._route_path(scope)
        if path is None:  # not ours (a studio's own route)
            await self.app(scope, receive, send)
            return
        refusal = head_refusal(scope, self.settings) or self._check_headers(scope, path)
        if refusal is not None:
            await _respond(send, *refusal)
            return
        cap = body_cap(self.settings, scope["method"], path)
        body, refusal = await self._read_body(scope, receive, cap)
        if refusal is None and body and _is_json(scope) and await self._too_deep(body):
            limit = self.settings.api_json_max_depth
            refusal = (
                400,
                "REQUEST_TOO_DEEP",
                f"The JSON body nests arrays or objects more than {limit} deep (the "
                f"limit, STUDIO_API_JSON_MAX_DEPTH={limit}): flatten the state.",
            )
        if refusal is not None:
            await _respond(send, *refusal)
            return
        await self.app(scope, _replay(body, receive), send)

    def _route_path(self, scope: Scope) -> str | None:
        path: str = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root) :] or "/"
        if self.prefix:
            if not path.startswith(self.prefix + "/"):
                return None if self.router_only else path
            path = path[len(self.prefix) :]
        if self.router_only and not path.startswith(ROUTER_PREFIXES):
            return None
        return path

    def _check_headers(self, scope: Scope, path: str) -> tuple[int, str, str] | None:
        seen: dict[bytes, bytes] = {}
        for name, value in scope.get("headers", ()):
            name = name.lower()
            if name in IDENTITY_HEADERS:
                if name in seen:
                    header = name.decode().title()
                    return (
                        400,
                        "HEADER_REPEATED",
                        f"The {header} header was sent more than once: a proxy must "
                        "replace it, not add another, or the caller could choose which "
                        "one counts. Send it once.",
                    )
                seen[name] = value
        live = path == LIVENESS_PATH and scope["method"] in ("GET", "HEAD")
        if not live and not self.any_host:
            host = _host_name(seen.get(b"host", b"").decode("latin-1"))
            if host not in self.hosts:
                return (
                    400,
                    "HOST_NOT_ALLOWED",
                    f"Host {host!r} is not one this API answers to (a page that "
                    "re-pointed its own name at this machine would send it): call it by "
                    "a loopback name or add the name to STUDIO_API_ALLOWED_HOSTS.",
                )
        if self.token and not live:
            scheme, _, given = seen.get(b"authorization", b"").partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), self.token):
                return (
                    401,
                    "UNAUTHENTICATED",
                    "Missing or wrong 'Authorization: Bearer <token>': this API answers "
                    "only the studio, which sends STUDIO_API_TOKEN.",
                )
        return None

    async def _read_body(
        self, scope: Scope, receive: Receive, cap: int
    ) -> tuple[bytes, tuple[int, str, str] | None]:
        too_large = (
            413,
            "REQUEST_TOO_LARGE",
            f"The request body is larger than {cap} bytes, the most "
            f"{scope['method']} {scope.get('path', '')} takes: send a smaller state "
            "(STUDIO_API_BODY_MAX_BYTES and STUDIO_CODE_STATE_MAX_BYTES set it).",
        )
        for name, value in scope.get("headers", ()):
            if name.lower() == b"content-length":
                try:
                    if int(value) > cap:
                        return b"", too_large
                except ValueError:
                    return b"", (
                        400,
                        "REQUEST_INVALID",
                        "The Content-Length header is not a number.",
                    )
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                break
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > cap:
                return b"", too_large
            if chunk:
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        return b"".join(chunks), None

    async def _too_deep(self, body: bytes) -> bool:
        limit = self.settings.api_json_max_depth
        if len(body) <= _INLINE_SCAN_BYTES:
            return json_depth_over(body, limit)
        from anyio import to_thread  # a big body: scan it off the event loop

        return await to_thread.run_sync(json_depth_over, body, limit)


def _is_json(scope: Scope) -> bool:
    """What FastAPI would parse as JSON: no content type, or application/json or */*+json."""
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-type":
            media = value.split(b";", 1)[0].strip().lower()
            return media.startswith(b"application/") and (
                media == b"application/json" or media.endswith(b"+json")
            )
    return True


def _replay(body: bytes, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


async def _respond(send: Send, status: int, code: str, message: str) -> None:
    REFUSED_TOTAL.labels(code).inc()
    body = error_body(code, message)
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    if status == 413:
        # the rest of the body is not read: the connection cannot be reused
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
