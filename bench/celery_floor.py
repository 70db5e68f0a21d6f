"""The floor of the queue's own overhead, for ``bench.queue``: the same Celery app (broker,
queues, acks, prefetch, prefork) with an EMPTY task that only pushes a done notice, as the
real task does at its end. submit→notice-seen in the caller is what Celery and Redis alone
cost on this machine, with no run store, no runtime and no checks: the queue's own overhead
can only come near it, never under it.

    celery -A bench.celery_floor worker --pool prefork -c 1 -Q code.run
"""

from __future__ import annotations

import redis
from celery import Celery

from executor.settings import load_settings
from worker.assembly import make_app
from worker.protocol import DONE_TTL_S

TASK = "bench.floor"


def floor_app() -> Celery:
    settings = load_settings()
    app = make_app(settings)
    # Celery's own consumer: the studio's test-slot consumer needs the worker's steps
    app.conf.worker_consumer = "celery.worker.consumer:Consumer"
    client = redis.Redis.from_url(settings.redis_url)

    @app.task(name=TASK, acks_late=True, ignore_result=True)  # type: ignore[untyped-decorator]
    def floor(key: str) -> None:
        pipe = client.pipeline(transaction=False)
        pipe.rpush(key, "1")
        pipe.expire(key, DONE_TTL_S)
        pipe.execute()

    return app


celery = floor_app()
