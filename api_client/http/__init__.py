"""The studio's HTTP API for Code nodes (FastAPI): route groups the studio mounts, or a
whole app that ``studio-code serve`` runs with uvicorn.

    app        ``create_app`` (the routes, /healthz/*, /metrics, the docs) and ``serve``
    kit        what every route shares: the error shape (``ErrorRoute``), the caller
               (X-Studio-User / X-Studio-Admin), the services behind the routes
    routes     the route groups: ``code`` (/api/meta/runtime, /api/code/*) and ``runs``
               (/api/runs*); ``routes.ROUTERS`` is every group
    wire       the request and response models (Pydantic only: no FastAPI)
    limits     ``RequestLimits``, the ASGI middleware that bounds every request
    docs       offline /docs and /redoc, and the corrected OpenAPI
    metrics    the API's request metrics and queue signals on /metrics
    inflight   the per-user cap on editor test calls waiting at once (in Redis)

Importing this package loads none of them (``api_client.http.wire`` loads no FastAPI).

Mounting in the studio: ``app.include_router(r)`` for each ``r`` of
``api_client.http.routes.ROUTERS``, ``app.state.studio_code =
api_client.http.kit.Services(settings)``; ``ErrorRoute`` gives the routers' own errors the
shape. The limits are a middleware: ``app.add_middleware(RequestLimits, settings=settings,
router_only=True)`` checks these routers' paths only (Host, the token when
STUDIO_API_TOKEN is set, body caps, JSON depth) and leaves the studio's routes alone;
404/405 of paths the studio's app does not have are the studio's app's to shape.
"""
