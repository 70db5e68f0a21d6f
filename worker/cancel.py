"""How a running job learns that it was cancelled: the ``should_cancel`` the executor polls (in a
pool process, worker.job.tasks, and in an API that runs a call itself, ``CodeClient.run_inline``).

The executor calls it about every 100 ms while the sandbox runs, so each call must be
cheap: one Redis ``EXISTS`` of the job's cancel flag, and none when the flag was read less
than FRESH_S ago (the job's start reads it with its other start reads, and the pool's take
and the sandbox's first poll follow within milliseconds: one read answers them all). The
run store (the truth, where ``cancel`` records the intent FIRST) is read once a second, at
once when the process got the cancel signal, and instead of Redis while Redis is
unreachable. So a cancel whose revoke broadcast was lost, or whose Redis flag was lost,
still stops the job.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import redis

from executor.store import RunStore
from worker.protocol import cancel_key

log = logging.getLogger("studio_code.worker")

STORE_EVERY_S = 1.0
REDIS_RETRY_S = 1.0
#: a Redis read of the flag younger than this answers a call (under the executor's poll
#: interval, 100 ms, so a steady poll still reads it each time)
FRESH_S = 0.08


class CancelWatch:
    """``should_cancel`` for ONE job. Once it has said True it keeps saying True.

    ``nudged`` (optional) returns True once after the process received the cancel signal.
    A signal is only a hint: it may have been meant for a job this process ran before
    (Celery signals a pid, not a job), so it makes the watch read the store for THIS job
    and never cancels by itself. ``flagged``: the Redis flag as read for this job just
    before (None: not read), which answers the calls of the next FRESH_S as any read does."""

    def __init__(
        self,
        job_id: str,
        *,
        store: RunStore,
        client: redis.Redis | None,
        nudged: Callable[[], bool] | None = None,
        flagged: bool | None = None,
    ) -> None:
        self.job_id = job_id
        self.store = store
        self.client = client
        self.nudged = nudged
        self.key = cancel_key(job_id)
        self.cancelled_at: float | None = None  # time.monotonic() when it first said True
        now = time.monotonic()
        self._next_store = now + STORE_EVERY_S
        self._redis_ok_after = now
        #: the flag as the job's start read it (with its parked-result lookup, one round
        #: trip): the calls of the next FRESH_S use it instead of their own EXISTS
        self._flagged = flagged
        #: when Redis last answered for the flag (a False answer stands until FRESH_S later)
        self._read_at = now if flagged is not None else None

    def __call__(self) -> bool:
        if self.cancelled_at is not None:
            return True
        now = time.monotonic()
        read_store = now >= self._next_store
        if self.nudged is not None and self.nudged():
            read_store = True
        hit = False
        flagged, self._flagged = self._flagged, None
        if flagged is not None:
            hit = flagged
        elif self._read_at is not None and now - self._read_at < FRESH_S:
            pass  # Redis answered a moment ago: that answer stands
        elif self.client is not None and now >= self._redis_ok_after:
            try:
                hit = bool(self.client.exists(self.key))
                self._read_at = now
            except redis.RedisError as e:
                log.warning(
                    "cancel flag of job %s unreadable (%s): using the run store", self.job_id, e
                )
                self._redis_ok_after = now + REDIS_RETRY_S
                read_store = True
        if not hit and read_store:
            self._next_store = now + STORE_EVERY_S
            try:
                hit = self.store.is_cancel_requested(self.job_id)
            except Exception as e:  # noqa: BLE001 - a store hiccup must not kill the job
                log.warning("run store unreadable while job %s runs: %s", self.job_id, e)
        if hit:
            self.cancelled_at = now
        return hit
