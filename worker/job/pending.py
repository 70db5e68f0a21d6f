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

This module is what a pool process does (store a result or park it: ``store_or_park``; look
up, write one); the main process's flush of them all is worker.upkeep.flusher.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, NamedTuple

import redis

from executor.errors import StoreUnavailable
from executor.models import CodeResult
from executor.store import Ended, RunStore
from worker.job import gate_page
from worker.protocol import PENDING_SET, announce_done, pending_key

log = logging.getLogger("studio_code.worker")

#: the pauses between tries of a result's finish while the store is down (then it is parked)
FINISH_RETRIES_S = (0.2, 1.0, 3.0)
#: how long a pool process keeps trying to store or park a result when both are down
PARK_FOR_S = 60.0


class Stored(NamedTuple):
    """What ``store_or_park`` did with a result: ``ended``, what its finish wrote;
    ``parked``, it waits in Redis for the store; neither: the job had ended already."""

    ended: Ended | None = None
    parked: bool = False


def store_or_park(
    store: RunStore, client: redis.Redis, result: CodeResult, worker: str, *, ttl_s: int
) -> Stored:
    """Store the result; while the store cannot take it, park it in Redis (written by the
    main process when the store is back). Never drops a result that was computed."""
    error: StoreUnavailable | None = None
    for delay in (*FINISH_RETRIES_S, None):
        try:
            return Stored(store.finish_with_outcome(result, worker=worker))
        except StoreUnavailable as e:  # any other error: the result itself is refused
            error = e  # (raised: the reaper ends the job)
            if delay is None:
                break
            log.warning("job %s: storing the result failed (%s), retrying", result.job_id, e)
            time.sleep(delay)
    gate_page.report(gate_page.RUN_STORE, f"finish of job {result.job_id} failed: {error}")
    _park_retrying(store, client, result, worker, ttl_s)
    return Stored(parked=True)


def _park_retrying(
    store: RunStore, client: redis.Redis, result: CodeResult, worker: str, ttl_s: int
) -> None:
    """Keep the result in Redis until the store answers. Redis down too: retry both with
    back-off for as long as the task may run, then give up (the message is not acked: a
    redelivery runs the job again, the only case where it may run twice)."""
    deadline = time.monotonic() + PARK_FOR_S
    delay = 0.5
    while True:
        try:
            park(client, result, worker, ttl_s)
            log.error(
                "job %s: the run store is unreachable; its result (%s) is kept in Redis "
                "for up to %d s and written when the store is back",
                result.job_id,
                result.status.value,
                ttl_s,
            )
            return
        except redis.RedisError as e:
            try:
                store.finish(result, worker=worker)
                return  # stored now (or the job had ended already)
            except Exception:  # noqa: BLE001
                pass
            if time.monotonic() > deadline:
                log.error(
                    "job %s: neither the run store nor Redis takes its result (%s); "
                    "the job will be handed out again",
                    result.job_id,
                    e,
                )
                raise
            time.sleep(delay)
            delay = min(delay * 2, 5.0)


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
