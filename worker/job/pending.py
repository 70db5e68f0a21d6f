"""Results computed while the run store was down: parked in Redis, written when it is back.

A pool process that ran a job but cannot ``finish()`` it (the store is unreachable after the
short retries) parks the result under ``studio:pending:<job_id>`` (the CodeResult as JSON
and the worker that ran it, with a TTL of STUDIO_QUEUE_PENDING_TTL_S) and adds the id to the
set ``studio:pending``; the job's message is then acknowledged. The code never runs again:

* every worker's main process writes parked results as soon as its store answers (the gate's
  probe, every STUDIO_QUEUE_PROBE_INTERVAL_S and every second while the store is down) and
  before its reaper fails jobs stuck ``running``, so a restarted worker flushes them too;
* a redelivered message (the worker died between parking and acking) finds the parked
  result before claiming and writes it instead of running the code.

The promise: a store outage shorter than STUDIO_QUEUE_PENDING_TTL_S (default 7 days) loses
no result, as long as Redis keeps its data (AOF, as deploy/compose.yaml runs it).

This module is what a pool process does (park, look up, write one); the main process's flush
of them all is worker.upkeep.flusher.
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
