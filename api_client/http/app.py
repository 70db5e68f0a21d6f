"""The studio's HTTP API as a whole app (``create_app``), which ``studio-code serve`` runs
with uvicorn (``serve``): the routes of ``api_client.http.routes``, the offline docs, and

    GET  /healthz/live, /healthz/ready, /metrics   operations (not in the OpenAPI)

every request bounded by ``api_client.http.limits.RequestLimits``.

No route holds a thread while it waits: a test call's wait is async (redis.asyncio), and
sync routes do only short work (a store read or write) in the thread pool. The one way to
run the API as a server is ``studio-code serve``.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    generate_latest,
    multiprocess,
)
from starlette.exceptions import HTTPException as StarletteHTTPException

from api_client.http import docs, routes
from api_client.http.kit import (
    ADMIN_HEADER,
    USER_HEADER,
    Services,
    error_response,
    from_http_exception,
    invalid_body,
)
from api_client.http.limits import RequestLimits, bind_refusal
from api_client.http.metrics import instrument
from api_client.http.wire import Health
from executor.errors import SettingsError
from executor.settings import Settings

log = logging.getLogger("studio_code.http")


def _metrics_registry() -> CollectorRegistry:
    if os.environ.get("PROMETHEUS_MULTIPROC_DIR"):
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    return REGISTRY


def create_app(settings: Settings, *, client: Any = None, bind_host: str | None = None) -> FastAPI:
    """The routes as a whole app (what ``studio-code serve`` runs), with /healthz/* and
    /metrics, every request bounded by ``RequestLimits`` (``bind_host`` joins the Host
    allow-list). The studio can instead mount ``routes.ROUTERS``: see ``api_client.http``."""
    services = Services(settings, client)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        from executor.store.sql import describe_url

        log.info("run store: %s", describe_url(settings.sqlalchemy_url))
        yield
        await services.aclose()

    app = FastAPI(
        docs_url=None,
        redoc_url=None,  # served offline by api_client.http.docs
        lifespan=lifespan,
        title="studio-code",
        version="0.1.0",
        description="Code nodes of the workflow studio: validate, test, run, cancel. "
        f"Callers are named by the {USER_HEADER} header (and {ADMIN_HEADER}: 1 for admins), "
        "which only the studio's API or proxy may set.",
    )
    app.state.studio_code = services
    for router in routes.ROUTERS:
        app.include_router(router)
    docs.install_docs(app)
    app.add_middleware(RequestLimits, settings=settings, bind_host=bind_host)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, e: RequestValidationError) -> JSONResponse:
        return invalid_body(e)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        return from_http_exception(request, e)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        return error_response(
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
    graceful shutdown); its HTTP protocol stops reading a request head past its cap
    (api_client.http.head_limit). Every log line, access log included, goes to stderr:
    stdout is the CLI's one JSON object."""
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
    from api_client.http.head_limit import bounded_http_protocol

    uvicorn.run(
        create_app(settings, bind_host=host),
        host=host,
        port=port,
        # httptools, a head that grows past STUDIO_API_HEAD_MAX_BYTES refused while read
        http=bounded_http_protocol(settings),
        log_level=log_level,
        log_config=log_config,
        proxy_headers=False,
        server_header=False,
    )
