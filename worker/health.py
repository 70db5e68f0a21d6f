"""Health checks a worker and the API share: are the services a Code node needs reachable?

``dependency_problems`` backs the API's ``GET /healthz/ready``, the worker's metrics
server's ``/healthz`` (worker/metrics/server.py, which adds, on a worker, why it is paused:
``gate_checks``) and the Compose health check of a worker. Each check is None when fine,
else a sentence that says what is wrong. Nothing heavy is imported until a check runs.
"""

from __future__ import annotations

from typing import Any

from executor.settings import Settings


def dependency_problems(settings: Settings, *, store: Any = None) -> dict[str, str | None]:
    """What a worker needs, each None when reachable or a sentence saying what is wrong:
    ``redis`` (the broker), ``run_store`` and, in the docker runtime, ``docker``."""
    checks: dict[str, str | None] = {}
    try:
        from worker import redis_conn

        # short: readiness must answer before its caller's own timeout
        client = redis_conn.client(settings, socket_timeout=3, socket_connect_timeout=3)
        try:
            client.ping()
        finally:
            client.close()
        checks["redis"] = None
    except Exception as e:  # noqa: BLE001 - any failure is "unreachable"
        checks["redis"] = f"Redis at STUDIO_REDIS_URL is not reachable: {e}"
    try:
        if store is None:
            from executor.store import open_store

            with open_store(settings.sqlalchemy_url) as s:
                s.get("__healthz__")
        else:
            store.get("__healthz__", inputs=False)
        checks["run_store"] = None
    except Exception as e:  # noqa: BLE001
        checks["run_store"] = f"The run store (STUDIO_DATABASE_URL) is not reachable: {e}"
    from executor.service import runtime_class

    cls = runtime_class(settings)
    if cls is not None and cls.service is not None:
        runtime = cls(settings)
        try:
            checks[cls.service] = runtime.health_problem()
        finally:
            runtime.close()
    return checks
