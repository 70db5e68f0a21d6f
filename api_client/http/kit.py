"""The routing kit every route group of ``api_client.http.routes`` builds on: the error
shape, who is calling, and the services behind the routes.

Who is calling: the studio's own API (or its proxy) authenticates the person and sets
``X-Studio-User: <user id>`` and, for admins, ``X-Studio-Admin: 1``. This service trusts
those headers as sent, so the proxy MUST strip them from every client request and this
port must be reachable from the studio only (docs/operations.md). Without X-Studio-User,
/api/code/* and /api/runs* answer 401 (``caller``). The studio itself proves who it is with
``Authorization: Bearer <STUDIO_API_TOKEN>`` (checked, with the Host allow-list and the
body limits, by ``api_client.http.limits.RequestLimits`` before the app reads a byte).

A caller reads and cancels only its own runs; an admin, any run. Another user's run
answers 404, exactly like an unknown id, so ids cannot be probed for existence
(``own_record``).

Every error is ``{"error": {"code": "...", "message": "..."}}``: the executor's codes
(CODE_INVALID 400, RATE_LIMITED 429, CODE_NODES_DISABLED and RUNTIME_UNAVAILABLE 503) and
the HTTP ones (REQUEST_INVALID 400/422, HOST_NOT_ALLOWED, HEADER_REPEATED and
REQUEST_TOO_DEEP 400, UNAUTHENTICATED 401, NOT_FOUND 404, METHOD_NOT_ALLOWED 405,
CONFLICT 409, REQUEST_TOO_LARGE 413, HEADERS_TOO_LARGE 431, INTERNAL 500), the
framework's own 404/405/422 included. ``ErrorRoute`` gives a router's own errors the shape,
inside the router, so a studio app that mounts the routes needs no exception handler of
ours.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Callable, Coroutine
from typing import Annotated, Any

from fastapi import Depends, Header, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from prometheus_client import Counter
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from api_client.http.inflight import InFlight
from api_client.http.wire import CODE_INVALID_ERROR, ErrorBody
from api_client.idempotency import HEADER as IDEMPOTENCY_HEADER
from api_client.idempotency import IdempotencyConflict
from executor.errors import CodeInvalid, ErrorCode, RateLimited, StudioCodeError
from executor.outage import is_outage
from executor.settings import Settings
from executor.store.base import JobRecord

log = logging.getLogger("studio_code.http")

USER_HEADER = "X-Studio-User"
ADMIN_HEADER = "X-Studio-Admin"

RATE_LIMITED_TOTAL = Counter(
    "studio_code_rate_limited",
    "Editor test calls refused with 429 because the user was over STUDIO_CODE_TEST_PER_MINUTE "
    "or STUDIO_CODE_TEST_IN_FLIGHT.",
)

# --- errors ---------------------------------------------------------------------------------


class ApiError(Exception):
    """Raised by a route to answer with an error body and an HTTP status."""

    def __init__(self, status: int, code: str, message: str, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.extra = status, code, message, extra
        self.headers: dict[str, str] = {}


def error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    info: dict[str, Any] = {"code": code, "message": message}
    info.update({k: v for k, v in extra.items() if v is not None})
    return JSONResponse({"error": info}, status_code=status, headers=headers)


def from_studio_error(e: StudioCodeError) -> JSONResponse:
    if isinstance(e, IdempotencyConflict):
        return error_response(409, "IDEMPOTENCY_CONFLICT", e.message, job_id=e.job_id)
    status = e.code.http_status
    if isinstance(e, RateLimited):
        retry = max(1, math.ceil(e.retry_after_s))
        RATE_LIMITED_TOTAL.inc()
        return error_response(
            status, str(e.code), e.message, {"Retry-After": str(retry)}, retry_after_s=retry
        )
    return error_response(status, str(e.code), e.message)


_HTTP_CODES = {
    400: "REQUEST_INVALID",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    413: "REQUEST_TOO_LARGE",
    422: "REQUEST_INVALID",
    429: "RATE_LIMITED",
}


def from_http_exception(request: Request, e: StarletteHTTPException) -> JSONResponse:
    """The framework's own errors (no route, wrong method, an unreadable body) in the shape."""
    where = f"{request.method} {request.url.path}"
    if e.status_code == 404:
        message = f"No route {where} here: the routes are listed in /openapi.json."
    elif e.status_code == 405:
        allow = (e.headers or {}).get("Allow", "")
        message = f"{where} is not allowed: use {allow or 'another method'} on this path."
    elif e.status_code == 400:
        message = (
            "The request body could not be read as JSON (" + str(e.detail) + "): send "
            "a JSON object with Content-Type: application/json."
        )
    else:
        message = f"{e.detail} ({where})."
    code = _HTTP_CODES.get(e.status_code, f"HTTP_{e.status_code}")
    return error_response(e.status_code, code, message, dict(e.headers or {}) or None)


class ErrorRoute(APIRoute):
    """Turns what a route raises into the JSON error body, inside the router, so the
    studio's own app needs no exception handler of ours when it mounts the router."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as e:
                return error_response(e.status, e.code, e.message, e.headers or None, **e.extra)
            except StudioCodeError as e:
                return from_studio_error(e)
            except RequestValidationError as e:
                return invalid_body(e)
            except StarletteHTTPException as e:
                return from_http_exception(request, e)
            except Exception as e:
                if is_outage(e):
                    log.warning("dependency unreachable on %s: %s", request.url.path, e)
                    return error_response(
                        503,
                        str(ErrorCode.RUNTIME_UNAVAILABLE),
                        f"A service the executor needs is not reachable ({type(e).__name__}"
                        "; the API's log has the details). Check Redis (STUDIO_REDIS_URL) "
                        "and the run store (STUDIO_DATABASE_URL); GET /healthz/ready says "
                        "which.",
                    )
                raise

        return route


def invalid_body(e: RequestValidationError) -> JSONResponse:
    """A body the wire models refuse: 422 REQUEST_INVALID, or, when the executor's own rule
    refused a value (a node's CPU share below its floor: wire.CODE_INVALID_ERROR), that
    rule's CODE_INVALID and sentence, as CodeClient would have answered it."""
    for err in e.errors():
        if err.get("type") == CODE_INVALID_ERROR:
            return from_studio_error(CodeInvalid(str(err.get("msg", ""))))
    return error_response(422, "REQUEST_INVALID", validation_message(e))


def validation_message(e: RequestValidationError) -> str:
    parts = []
    for err in e.errors()[:5]:
        where = ".".join(str(x) for x in err.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {err.get('msg', 'invalid')}")
    return "The request is not valid: " + "; ".join(parts) + "."


ERRORS: dict[int | str, dict[str, Any]] = {
    s: {"model": ErrorBody} for s in (400, 401, 404, 409, 422, 429, 503)
}

# --- the caller -----------------------------------------------------------------------------


class Caller(BaseModel):
    """Who is calling, as the studio's API said in its headers."""

    user: str
    admin: bool = False

    def may_see(self, rec: JobRecord) -> bool:
        return self.admin or rec.user == self.user


async def caller(
    x_studio_user: Annotated[
        str | None,
        Header(
            alias=USER_HEADER,
            description="The studio user id; set by the studio's API "
            "or proxy only (stripped from client requests).",
        ),
    ] = None,
    x_studio_admin: Annotated[
        str | None,
        Header(
            alias=ADMIN_HEADER,
            description="1 when the user is an admin; set by the studio's API or proxy only.",
        ),
    ] = None,
) -> Caller:
    user = (x_studio_user or "").strip()
    if not user:
        raise ApiError(
            401,
            "UNAUTHENTICATED",
            f"No {USER_HEADER} header: the studio's API must say which user calls.",
        )
    if len(user) > 200:
        raise ApiError(422, "REQUEST_INVALID", f"{USER_HEADER} is longer than 200 characters.")
    return Caller(user=user, admin=says_admin(x_studio_admin))


def says_admin(header: str | None) -> bool:
    """Whether an ``X-Studio-Admin`` value says the caller is an admin."""
    return (header or "").strip().lower() in ("1", "true", "yes")


def admin_caller(headers: Any) -> bool:
    """A route that needs no user (GET /api/meta/runtime) shows an admin's view only to a
    named caller (X-Studio-User) the studio says is an admin (X-Studio-Admin: 1)."""
    return bool((headers.get(USER_HEADER) or "").strip()) and says_admin(headers.get(ADMIN_HEADER))


CallerDep = Annotated[Caller, Depends(caller)]
JobIdPath = Annotated[str, Path(min_length=1, max_length=200, description="The job id.")]

# --- the service behind the routes ----------------------------------------------------------


class Services:
    """What the routes need: the queue client (submit, wait, cancel, validate, meta) and
    the settings. One per app; built lazily so creating the app touches no service."""

    def __init__(self, settings: Settings, client: Any = None) -> None:
        self.settings = settings
        self._client = client
        self._lock = threading.Lock()
        self.in_flight = InFlight(settings.code_test_in_flight)

    @property
    def client(self) -> Any:
        with self._lock:
            if self._client is None:
                from api_client.client import CodeClient

                self._client = CodeClient(self.settings)
            return self._client

    @property
    def opened(self) -> Any:
        """The client once made (None before): for the event loop, which must not open it."""
        return self._client

    def close(self) -> None:
        client, self._client = self._client, None
        close = getattr(client, "close", None)
        if callable(close):
            close()

    async def aclose(self) -> None:
        aclose = getattr(self._client, "aclose", None)
        if callable(aclose):
            await aclose()
        self.close()

    def record(self, job_id: str) -> JobRecord | None:
        from api_client.client import JobNotFound

        try:
            return self.client.status(job_id)  # type: ignore[no-any-return]
        except JobNotFound:
            return None

    def health(self) -> dict[str, str | None]:
        from worker.health import dependency_problems

        try:
            store = getattr(self.client, "store", None)
        except Exception:  # noqa: BLE001 - the store could not open: the check says why
            store = None
        return dependency_problems(self.settings, store=store)

    def workers(self) -> dict[str, Any] | None:
        """Live workers per queue (serving, slots, paused with reasons); None when Redis or
        the client cannot be reached (the checks say why)."""
        try:
            from worker.registry import summary

            return summary(self.client.live_workers())
        except Exception:  # noqa: BLE001 - readiness reports, never raises
            return None


async def _services(request: Request) -> Services:
    return request.app.state.studio_code  # type: ignore[no-any-return]


ServicesDep = Annotated[Services, Depends(_services)]


def own_record(services: Services, job_id: str, who: Caller) -> JobRecord:
    rec = services.record(job_id)
    if rec is None or not who.may_see(rec):
        raise ApiError(404, "NOT_FOUND", f"No run {job_id!r} that you can see.")
    return rec


def idempotency_key(request: Request) -> str | None:
    """The caller's ``Idempotency-Key`` header (checked where it is used), or None."""
    return request.headers.get(IDEMPOTENCY_HEADER)


def trace_headers(request: Request) -> dict[str, str | None]:
    """The caller's W3C trace context (``traceparent``, ``tracestate`` headers), as the
    client's submit and wait take it (executor.tracing)."""
    headers = request.headers
    return {"traceparent": headers.get("traceparent"), "tracestate": headers.get("tracestate")}
