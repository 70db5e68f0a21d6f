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

This module is what a pool process does with its result (store it or park it:
``store_or_park``); a parked result itself (park, look up, write one) is worker.parked,
shared with the main process, whose flush of them all is worker.upkeep.flusher.
"""

from __future__ import annotations

import logging
import time
from typing import NamedTuple

import redis

from executor.errors import StoreUnavailable
from executor.models import CodeResult
from executor.store import Ended, RunStore
from worker import gate
from worker.parked import park

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
    gate.report(gate.RUN_STORE, f"finish of job {result.job_id} failed: {error}")
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
