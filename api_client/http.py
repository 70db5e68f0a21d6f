"""The studio's HTTP routes for Code nodes: a FastAPI router the studio mounts, or a whole
app (``create_app``) that ``studio-code serve`` runs with uvicorn.

    GET  /api/meta/runtime          what the editor sees (no user needed)
    POST /api/code/validate         save-time check: 200, or 400 CODE_INVALID with the reason
    POST /api/code/test             an editor test call: rate limited per user per minute
                                    and in flight (429 with Retry-After), runs on queue
                                    code.test, waits (bounded, async: no thread held)
    POST /api/runs                  submit a workflow run's Code node (202)
    GET  /api/runs/{job_id}         the run, with its result once finished
    POST /api/runs/{job_id}/cancel  cancel it (the worker kills its sandbox)
    GET  /healthz/live, /healthz/ready, /metrics   operations (not in the OpenAPI)

Who is calling: the studio's own API (or its proxy) authenticates the person and sets
``X-Studio-User: <user id>`` and, for admins, ``X-Studio-Admin: 1``. This service trusts
those headers as sent, so the proxy MUST strip them from every client request and this
port must be reachable from the studio only (docs/operations.md). Without X-Studio-User,
/api/code/* and /api/runs* answer 401. The studio itself proves who it is with
``Authorization: Bearer <STUDIO_API_TOKEN>`` (checked, with the Host allow-list and the
body limits, by ``api_client.limits.RequestLimits`` before the app reads a byte).

No route holds a thread while it waits: a test call's wait is async (redis.asyncio), and
sync routes do only short work (a store read or write) in the thread pool.

A caller reads and cancels only its own runs; an admin, any run. Another user's run
answers 404, exactly like an unknown id, so ids cannot be probed for existence.

Every error is ``{"error": {"code": "...", "message": "..."}}``: the executor's codes
(CODE_INVALID 400, RATE_LIMITED 429, CODE_NODES_DISABLED and RUNTIME_UNAVAILABLE 503) and
the HTTP ones (REQUEST_INVALID 400/422, HOST_NOT_ALLOWED, HEADER_REPEATED and
REQUEST_TOO_DEEP 400, UNAUTHENTICATED 401, NOT_FOUND 404, METHOD_NOT_ALLOWED 405,
CONFLICT 409, REQUEST_TOO_LARGE 413, INTERNAL 500), the framework's own 404/405/422
included.

The request and response models live in ``api_client.wire`` (re-exported here). The one
way to run these routes as a server is ``studio-code serve`` (``serve`` below).

Mounting in the studio: ``app.include_router(router)``, ``app.state.studio_code =
Services(settings)``; ``ErrorRoute`` gives the router's own errors the shape. The limits
are a middleware: ``app.add_middleware(RequestLimits, settings=settings,
router_only=True)`` checks this router's paths only (Host, the token when
STUDIO_API_TOKEN is set, body caps, JSON depth) and leaves the studio's routes alone;
404/405 of paths the studio's app does not have are the studio's app's to shape.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from typing import Annotated, Any

from fastapi import APIRouter, BackgroundTasks, Depends, FastAPI, Header, Path, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    generate_latest,
    multiprocess,
)
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from api_client.inflight import InFlight
from api_client.limits import RequestLimits, bind_refusal
from api_client.wire import (  # noqa: F401 - re-exported: every wire record imports from here
    CODE_MAX_CHARS,
    CodeBody,
    ErrorBody,
    ErrorInfo,
    Health,
    LanguageBody,
    LanguageMeta,
    LanguageName,
    LimitsMeta,
    NodeCheck,
    Problem,
    RunBody,
    RuntimeMeta,
    RunView,
    RunWaiting,
    ValidateResult,
)
from executor.errors import ErrorCode, RateLimited, SettingsError, StudioCodeError
from executor.inputs import capped_timeout_s
from executor.models import Status
from executor.outage import is_outage
from executor.settings import Settings
from executor.store.base import JobRecord

log = logging.getLogger("studio_code.http")

USER_HEADER = "X-Studio-User"
ADMIN_HEADER = "X-Studio-Admin"
#: waited for a test call's result on top of its own timeout: queue wait and sandbox start
TEST_WAIT_MARGIN_S = 30.0

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


def _error_response(
    status: int, code: str, message: str, headers: dict[str, str] | None = None, **extra: Any
) -> JSONResponse:
    info: dict[str, Any] = {"code": code, "message": message}
    info.update({k: v for k, v in extra.items() if v is not None})
    return JSONResponse({"error": info}, status_code=status, headers=headers)


def _from_studio_error(e: StudioCodeError) -> JSONResponse:
    status = e.code.http_status
    if isinstance(e, RateLimited):
        retry = max(1, math.ceil(e.retry_after_s))
        RATE_LIMITED_TOTAL.inc()
        return _error_response(
            status, str(e.code), e.message, {"Retry-After": str(retry)}, retry_after_s=retry
        )
    return _error_response(status, str(e.code), e.message)


_HTTP_CODES = {
    400: "REQUEST_INVALID",
    401: "UNAUTHENTICATED",
    404: "NOT_FOUND",
    405: "METHOD_NOT_ALLOWED",
    413: "REQUEST_TOO_LARGE",
    422: "REQUEST_INVALID",
    429: "RATE_LIMITED",
}


def _from_http_exception(request: Request, e: StarletteHTTPException) -> JSONResponse:
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
    return _error_response(e.status_code, code, message, dict(e.headers or {}) or None)


class ErrorRoute(APIRoute):
    """Turns what a route raises into the JSON error body, inside the router, so the
    studio's own app needs no exception handler of ours when it mounts the router."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def route(request: Request) -> Response:
            try:
                return await handler(request)
            except ApiError as e:
                return _error_response(e.status, e.code, e.message, e.headers or None, **e.extra)
            except StudioCodeError as e:
                return _from_studio_error(e)
            except RequestValidationError as e:
                return _error_response(422, "REQUEST_INVALID", _validation_message(e))
            except StarletteHTTPException as e:
                return _from_http_exception(request, e)
            except Exception as e:
                if is_outage(e):
                    log.warning("dependency unreachable on %s: %s", request.url.path, e)
                    return _error_response(
                        503,
                        str(ErrorCode.RUNTIME_UNAVAILABLE),
                        f"A service the executor needs is not reachable ({type(e).__name__}"
                        "; the API's log has the details). Check Redis (STUDIO_REDIS_URL) "
                        "and the run store (STUDIO_DATABASE_URL); GET /healthz/ready says "
                        "which.",
                    )
                raise

        return route


def _validation_message(e: RequestValidationError) -> str:
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
    admin = (x_studio_admin or "").strip().lower() in ("1", "true", "yes")
    return Caller(user=user, admin=admin)


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
        from worker.metrics.health import dependency_problems

        try:
            store = getattr(self.client, "store", None)
        except Exception:  # noqa: BLE001 - the store could not open: the check says why
            store = None
        return dependency_problems(self.settings, store=store)

    def workers(self) -> dict[str, Any] | None:
        """Live workers per queue (serving, slots, paused with reasons); None when Redis or
        the client cannot be reached (the checks say why)."""
        try:
            from worker.upkeep.heartbeat import summary

            return summary(self.client.live_workers())
        except Exception:  # noqa: BLE001 - readiness reports, never raises
            return None


async def _services(request: Request) -> Services:
    return request.app.state.studio_code  # type: ignore[no-any-return]


ServicesDep = Annotated[Services, Depends(_services)]


def _own_record(services: Services, job_id: str, who: Caller) -> JobRecord:
    rec = services.record(job_id)
    if rec is None or not who.may_see(rec):
        raise ApiError(404, "NOT_FOUND", f"No run {job_id!r} that you can see.")
    return rec


def _problems(raw: Any) -> list[Problem]:
    out = []
    for p in raw or []:
        line = getattr(p, "line", None) or None  # the executor's 0 means "no line"
        out.append(Problem(line=line, message=getattr(p, "message", str(p))))
    return out


# --- routes ---------------------------------------------------------------------------------

router = APIRouter(route_class=ErrorRoute)


@router.get(
    "/api/meta/runtime",
    response_model=RuntimeMeta,
    tags=["meta"],
    responses={503: {"model": ErrorBody}},
)
def get_runtime_meta(services: ServicesDep) -> dict[str, Any]:
    """Enabled, runtime, each language's readiness (its test program ran) and packages,
    and the limits in force."""
    return services.client.meta()  # type: ignore[no-any-return]


@router.post("/api/code/validate", response_model=ValidateResult, tags=["code"], responses=ERRORS)
def validate_code(body: CodeBody, who: CallerDep, services: ServicesDep) -> ValidateResult:
    """The save-time check: 200 when the code may be saved, else 400 CODE_INVALID whose
    message (and ``problems``) give the reason."""
    problems = _problems(
        services.client.validate(
            body.code, body.language, memory=body.memory, cpus=body.cpus, timeout_s=body.timeout_s
        )
    )
    if problems:
        raise ApiError(
            400,
            str(ErrorCode.CODE_INVALID),
            "; ".join(
                p.message if p.line is None else f"line {p.line}: {p.message}" for p in problems
            ),
            problems=[p.model_dump() for p in problems],
        )
    return ValidateResult(ok=True, language=body.language)


@router.post("/api/code/nodes/check", response_model=NodeCheck, tags=["code"], responses=ERRORS)
def check_node(body: LanguageBody, who: CallerDep, services: ServicesDep) -> NodeCheck:
    """Workflow validation of a Code node: 200 when a node of this language can run now;
    503 CODE_NODES_DISABLED or RUNTIME_UNAVAILABLE, or 400 CODE_INVALID for a language that
    is not offered, each with the reason and how to fix it."""
    services.client.validate_node(body.language)
    return NodeCheck(ok=True, language=body.language)


@router.post(
    "/api/code/test",
    response_model=RunView,
    tags=["code"],
    responses={
        **ERRORS,
        202: {
            "model": RunView,
            "description": "Not finished within the wait: poll GET /api/runs/{job_id}.",
        },
    },
)
async def test_code(
    body: RunBody,
    who: CallerDep,
    services: ServicesDep,
    request: Request,
    response: Response,
    background: BackgroundTasks,
) -> Any:
    """An editor test call: at most STUDIO_CODE_TEST_PER_MINUTE per user per minute and
    STUDIO_CODE_TEST_IN_FLIGHT waiting at once (then 429 with Retry-After), run on the
    code.test queue, answered with the result (200) or, when it takes longer than its
    timeout plus a margin, with the run so far (202)."""
    s = services.settings
    # the first call of a process opens the run store: never on the event loop
    client = services.opened or await run_in_threadpool(lambda: services.client)
    wait_s = capped_timeout_s(body.timeout_s, max_seconds=s.code_max_seconds) + TEST_WAIT_MARGIN_S
    aredis = client.async_redis
    slot = await services.in_flight.acquire(aredis, who.user, wait_s + 5)
    try:
        job_id = await run_in_threadpool(
            lambda: client.submit(
                body.code,
                body.language,
                body.state,
                body.timeout_s,
                who.user,
                "test",
                memory=body.memory,
                cpus=body.cpus,
            )
        )
        rec = await _unless_disconnected(request, client.wait_async(job_id, wait_s, submitted=True))
    except BaseException:
        await services.in_flight.release(aredis, slot)
        raise
    # the slot goes back as the answer goes out (not after Redis confirms it: that round
    # trip is off the call's path); the request ends once it is back
    background.add_task(services.in_flight.release_now(aredis, slot))
    if rec is None:  # nobody is listening; the run goes on and GET /api/runs/{id} has it
        return _error_response(499, "CLIENT_GONE", "The caller went away before the result.")
    if not rec.status.finished:
        response.status_code = 202
    return RunView.of(rec)


async def _unless_disconnected(
    request: Request, wait: Coroutine[Any, Any, JobRecord]
) -> JobRecord | None:
    """``wait``'s result, or None as soon as the caller disconnects (the wait is cancelled,
    so the caller's in-flight slot is given back at once). What ``wait`` raises comes out
    as itself (a 503, a 404). The watch is a task of its own that cancels this one on a
    disconnect; once the wait is over it is cancelled, not waited for (nothing of it is
    left to run), so the answer does not wait a turn of the loop for it."""
    this = asyncio.current_task()
    assert this is not None
    gone = False

    async def watch() -> None:
        nonlocal gone
        try:
            while (await request.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # noqa: BLE001 - cannot tell: keep waiting for the result
            return
        gone = True
        this.cancel()

    watcher = asyncio.ensure_future(watch())
    try:
        return await wait
    except asyncio.CancelledError:
        if gone and this.uncancel() == 0:  # our own cancel and nobody else's
            return None
        raise
    finally:
        watcher.cancel()


@router.post("/api/runs", response_model=RunView, status_code=202, tags=["runs"], responses=ERRORS)
def submit_run(body: RunBody, who: CallerDep, services: ServicesDep) -> RunView:
    """Queue a workflow run's Code node (queue code.run); poll GET /api/runs/{job_id}."""
    job_id = services.client.submit(
        body.code,
        body.language,
        body.state,
        body.timeout_s,
        who.user,
        kind="run",
        memory=body.memory,
        cpus=body.cpus,
    )
    rec = services.record(job_id)
    if rec is None:  # pragma: no cover
        raise ApiError(503, str(ErrorCode.RUNTIME_UNAVAILABLE), "The run was lost.")
    return RunView.of(rec)


@router.get("/api/runs/{job_id}", response_model=RunView, tags=["runs"], responses=ERRORS)
def get_run(job_id: JobIdPath, who: CallerDep, services: ServicesDep) -> RunView:
    """The run and, once finished, its result. 404 for an unknown id or another user's
    run (unless the caller is an admin). A queued run that fairness between users holds
    back says where it waits (``waiting``)."""
    rec = _own_record(services, job_id, who)
    view = RunView.of(rec)
    if rec.status is Status.QUEUED and rec.kind == "run":
        where = services.client.where(job_id)
        if where is not None:
            view.waiting = RunWaiting.model_validate(where.as_dict())
    return view


@router.post(
    "/api/runs/{job_id}/cancel",
    response_model=RunView,
    status_code=202,
    tags=["runs"],
    responses=ERRORS,
)
def cancel_run(job_id: JobIdPath, who: CallerDep, services: ServicesDep) -> RunView:
    """Cancel a run: a queued one never starts, a running one has its sandbox killed and
    ends ``cancelled``. Cancelling a cancelled run again is fine (202); one that finished
    otherwise answers 409."""
    rec = _own_record(services, job_id, who)
    if rec.status.finished and rec.status is not Status.CANCELLED:
        raise ApiError(
            409,
            "CONFLICT",
            f"Run {job_id} already finished ({rec.status.value}); nothing to cancel.",
        )
    from api_client.client import JobNotFound

    try:
        services.client.cancel(job_id)
    except JobNotFound as e:  # removed between the read and the cancel
        raise ApiError(404, "NOT_FOUND", f"No run {job_id!r} that you can see.") from e
    return RunView.of(services.record(job_id) or rec)


# --- the app --------------------------------------------------------------------------------


def _metrics_registry() -> CollectorRegistry:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    return REGISTRY


def create_app(settings: Settings, *, client: Any = None, bind_host: str | None = None) -> FastAPI:
    """The routes as a whole app (what ``studio-code serve`` runs), with /healthz/* and
    /metrics, every request bounded by ``RequestLimits`` (``bind_host`` joins the Host
    allow-list). The studio can instead mount ``router``: see the module docstring."""
    services = Services(settings, client)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        from executor.store.sql import describe_url

        log.info("run store: %s", describe_url(settings.sqlalchemy_url))
        yield
        await services.aclose()

    app = FastAPI(
        docs_url=None,
        redoc_url=None,  # served offline by api_client.docs
        lifespan=lifespan,
        title="studio-code",
        version="0.1.0",
        description="Code nodes of the workflow studio: validate, test, run, cancel. "
        f"Callers are named by the {USER_HEADER} header (and {ADMIN_HEADER}: 1 for admins), "
        "which only the studio's API or proxy may set.",
    )
    app.state.studio_code = services
    app.include_router(router)
    from api_client import docs, routes_runs

    app.include_router(routes_runs.router)
    docs.install_docs(app)
    app.add_middleware(RequestLimits, settings=settings, bind_host=bind_host)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return _error_response(422, "REQUEST_INVALID", _validation_message(e))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return _from_http_exception(request, e)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        return _error_response(
            500,
            "INTERNAL",
            "The API failed on this request (a bug; its "
            "log has the traceback). Try again; report it if it repeats.",
        )

    @app.get("/healthz/live", include_in_schema=False)
    async def live() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/healthz/ready", include_in_schema=False, response_model=Health)
    def ready() -> JSONResponse:
        """503 while Docker (docker runtime), Redis or the run store is unreachable; also
        shows the live workers per queue (no worker is not a 503: the API still serves)."""
        checks = services.health()
        ok = all(v is None for v in checks.values())
        return JSONResponse(
            {"ok": ok, "checks": checks, "workers": services.workers()},
            status_code=200 if ok else 503,
        )

    registry = _metrics_registry()
    from api_client.http_metrics import instrument

    queue_registry = instrument(app, services)

    @app.get("/metrics", include_in_schema=False)
    def metrics() -> Response:
        body = generate_latest(registry) + generate_latest(queue_registry)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    return app


def serve(
    settings: Settings, host: str = "127.0.0.1", port: int = 8080, log_level: str = "info"
) -> None:
    """Run the app with uvicorn until SIGTERM / Ctrl-C, then return (after uvicorn's
    graceful shutdown). Every log line, access log included, goes to stderr: stdout is
    the CLI's one JSON object."""
    import copy
    import signal

    import uvicorn
    from uvicorn.config import LOGGING_CONFIG

    refusal = bind_refusal(settings, host)
    if refusal:
        raise SettingsError(refusal)
    log_config = copy.deepcopy(LOGGING_CONFIG)
    log_config["handlers"]["access"]["stream"] = "ext://sys.stderr"
    if threading.current_thread() is threading.main_thread():
        # uvicorn re-raises the signal that stopped it once it has shut down; with this
        # handler that ends in a normal return instead of the process dying on SIGTERM.
        signal.signal(signal.SIGTERM, lambda *_: None)
    uvicorn.run(
        create_app(settings, bind_host=host),
        host=host,
        port=port,
        log_level=log_level,
        log_config=log_config,
        proxy_headers=False,
        server_header=False,
    )
