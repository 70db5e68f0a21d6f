"""A result parked in Redis while the run store was down (worker.job.pending parks it): park
it, look it up, write one to the store. Shared: a pool process writes the parked result of
a redelivered job before claiming (worker.job.tasks); the main process flushes them all when
the store is back (worker.upkeep.flusher).

``studio:pending:<job_id>``: JSON ``{"worker", "result"}`` with a TTL of
STUDIO_QUEUE_PENDING_TTL_S; ``studio:pending``: the set of their ids.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import redis

from executor.models import CodeResult
from worker.protocol import PENDING_SET, announce_done, pending_key

log = logging.getLogger("studio_code.worker")


def park(client: redis.Redis, result: CodeResult, worker: str, ttl_s: int) -> None:
    """Keep ``result`` until the store answers (raises redis.RedisError when Redis is down)."""
    body = json.dumps({"worker": worker, "result": result.model_dump(mode="json")})
    pipe = client.pipeline()
    pipe.set(pending_key(result.job_id), body, ex=max(1, int(ttl_s)))
    pipe.sadd(PENDING_SET, result.job_id)
    pipe.execute()


def parked(client: redis.Redis, job_id: str) -> tuple[CodeResult, str] | None:
    """The parked result of ``job_id`` and the worker that ran it, or None."""
    return _decode(client.get(pending_key(job_id)))


def _decode(raw: Any) -> tuple[CodeResult, str] | None:
    if raw is None:
        return None
    data = json.loads(raw)
    return CodeResult.model_validate(data["result"]), str(data["worker"])


def add_lookup(pipe: Any, job_id: str) -> None:
    """The parked-result lookup, added to a pipeline the job's start shares; its reply goes
    to ``write_one(..., found=reply)``."""
    pipe.get(pending_key(job_id))


def forget(client: redis.Redis, job_id: str) -> None:
    pipe = client.pipeline()
    pipe.delete(pending_key(job_id))
    pipe.srem(PENDING_SET, job_id)
    pipe.execute()


def write_one(store: Any, client: redis.Redis, job_id: str, *, found: Any = ...) -> bool | None:
    """Write the parked result of ``job_id``: True when this call wrote it, False when the
    job had already ended, None when nothing is parked. Raises when the store is down.
    ``found``: the reply of an ``add_lookup`` already made (else it is read here)."""
    parked_result = parked(client, job_id) if found is ... else _decode(found)
    if parked_result is None:
        return None
    result, worker = parked_result
    wrote = bool(store.finish(result, worker=worker))
    forget(client, job_id)
    if wrote:  # the one writer that won announces the end (two flushers may race)
        announce_done(client, job_id)
        log.warning(
            "job %s: wrote its result (%s), kept in Redis while the run store was down",
            job_id,
            result.status.value,
        )
        _count(result)
    return wrote


def _count(result: CodeResult) -> None:
    try:
        from worker import metrics

        metrics.record_result(result)
    except Exception as e:  # noqa: BLE001 - a metric is never worth a result
        log.warning("metrics for a parked result failed: %s", e)
