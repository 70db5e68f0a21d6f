"""The main process's side of parked results (worker.parked): ``flush`` writes every
result parked in Redis as soon as the run store answers again (called by the gate's probe and
by the reaper before it fails jobs stuck ``running``).
"""

from __future__ import annotations

import logging
from typing import Any

import redis

from executor.errors import StoreUnavailable
from worker.parked import write_one
from worker.protocol import PENDING_SET

log = logging.getLogger("studio_code.worker")


def flush(store: Any, client: redis.Redis) -> int:
    """Write every parked result the store does not have yet; returns how many were
    written. Raises (leaving the rest parked) when the store fails."""
    written = 0
    for raw_id in client.sscan_iter(PENDING_SET, count=200):
        job_id = raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id)
        try:
            outcome = write_one(store, client, job_id)
        except StoreUnavailable:
            raise  # the store went away again: the rest waits for the next flush
        except Exception as e:  # noqa: BLE001 - this result only: the others are written
            log.error(
                "job %s: its parked result cannot be written (%s); it stays in Redis "
                "until STUDIO_QUEUE_PENDING_TTL_S",
                job_id,
                e,
            )
            continue
        if outcome is None:
            client.srem(PENDING_SET, job_id)
            log.error(
                "job %s: its parked result expired (STUDIO_QUEUE_PENDING_TTL_S) before "
                "the run store was back; the reaper ends it",
                job_id,
            )
        elif outcome:
            written += 1
    return written


class Flusher:
    """``flush`` on one Redis client: the main process has ONE (worker.upkeep.owner), which
    the gate's probe and the reaper both call."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client

    def __call__(self, store: Any) -> int:
        return flush(store, self.client)
