"""The API's own metrics: requests by route and status class, their latency, and the
queue signals an autoscaler reads (worker.autoscale.QueueCollector).

``instrument(app, services)`` adds the ASGI middleware and returns a registry of this
app's collectors, which ``/metrics`` serves beside the process's default one. Every
route's series exist at 0 from the start.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, MutableMapping
from typing import Any

from fastapi import FastAPI
from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry, Counter, Histogram

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

STATUS_CLASSES = ("2xx", "3xx", "4xx", "5xx")
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)

REQUESTS = Counter(
    "studio_code_http_requests",
    "HTTP requests answered by the API, by method, route template and status class.",
    ["method", "route", "status"],
)
LATENCY = Histogram(
    "studio_code_http_request_duration_seconds",
    "From the request's arrival to the end of its response, by method and route template.",
    ["method", "route"],
    buckets=LATENCY_BUCKETS,
)


class RequestMetrics:
    """Pure ASGI middleware (no buffering: a streamed response passes as it comes). The
    route label is the matched template (``/api/runs/{job_id}``), never the raw path, so
    ids cannot blow up the series; an unmatched path is ``unmatched``."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            method = str(scope.get("method", "GET"))
            REQUESTS.labels(method, route, f"{status // 100}xx").inc()
            LATENCY.labels(method, route).observe(time.perf_counter() - start)


def api_routes(routes: Iterable[Any]) -> Iterator[APIRoute]:
    """Every APIRoute, included routers' too (FastAPI keeps an included router whole)."""
    for route in routes:
        if isinstance(route, APIRoute):
            yield route
        inner = getattr(route, "original_router", None)
        if inner is not None:
            yield from api_routes(inner.routes)


def instrument(app: FastAPI, services: Any) -> CollectorRegistry:
    """Add the request metrics to ``app`` (its routes' series at 0) and return a registry
    with the queue signals, read through ``services`` at scrape time."""
    from worker import redis_conn
    from worker.autoscale import QueueCollector

    app.add_middleware(RequestMetrics)  # type: ignore[arg-type]
    for route in api_routes(app.routes):
        for method in sorted(route.methods or ()):
            LATENCY.labels(method, route.path)
            for cls in STATUS_CLASSES:
                REQUESTS.labels(method, route.path, cls)
    registry = CollectorRegistry(auto_describe=False)
    client = redis_conn.client(services.settings)
    from executor.groups import groups_of
    from worker.protocol import group_queues

    # the backlog of every worker group's queues (bounded: executor.groups.MAX_GROUPS)
    queues = [q for g in groups_of(services.settings) for q in group_queues(g.name)]
    registry.register(
        QueueCollector(
            client, lambda: services.client.store, services.settings.queue_run_fairness, queues
        )
    )
    return registry
