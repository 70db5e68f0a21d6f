"""Nothing stays ``queued`` without an owner: the sweep of queued jobs, run by ONE worker's
janitor at a time (a Redis lock) every STUDIO_QUEUE_REAP_INTERVAL_S.

* **Waited too long**: a job queued longer than its queue's bound
  (STUDIO_QUEUE_RUN_MAX_WAIT_S, STUDIO_QUEUE_TEST_MAX_WAIT_S) ends ``failed``
  RUNTIME_UNAVAILABLE with a sentence saying no worker took it (``fail_queued`` changes
  only rows that are still queued, so a job a worker claims meanwhile is left alone). Its
  message, if any, is then skipped by ``claim``.
* **Lost message**: a job queued longer than STUDIO_QUEUE_LOST_AFTER_S whose message is
  neither in a queue list nor in kombu's ``unacked`` hash (held by a worker) is sent again.
  Its message was lost: an API that died between the row and the message, a Redis crash
  within its fsync second, a message consumed while the store could not be claimed. The
  broker is read twice, a second apart, each time in one MULTI (kombu moves a message from
  the list to the hash in two steps), and the row must still be queued: only then is it
  re-sent. ``claim`` keeps a job exactly-once. A run waiting on its user's list
  (worker.fair) is not lost: that list is read in the same MULTI.
* **Fair bookkeeping**: ended jobs leave their user's waiting list, and a run released to
  code.run whose job ended without its end being seen (failed by the reaper, a worker
  killed after its result) frees its user's cap slot (``FairQueue.reconcile``).

Cost: one SELECT of old queued rows per sweep; the broker is read only when there are some,
and never when the queues hold more than MAX_SCAN messages (then only the wait bound acts).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any

import redis

from executor.settings import Settings
from executor.store import RunStore
from worker import redis_conn
from worker.fair import FairQueue, user_cap
from worker.protocol import (
    FAIR_JOBS_KEY,
    KOMBU_UNACKED,
    QUEUE_TEST,
    QUEUES,
    SWEEP_LOCK_KEY,
    TASK_NAME,
    job_headers,
    max_wait_s,
    message_job_id,
    never_taken_message,
    queue_lists,
    queue_of,
)

log = logging.getLogger("studio_code.worker")

MAX_SCAN = 20_000
CONFIRM_AFTER_S = 1.0


def broker_job_ids(client: redis.Redis, candidates: Iterable[str] = ()) -> set[str] | None:
    """The job ids of every message in the queues or held by a worker, and those of
    ``candidates`` waiting on their user's list (worker.fair), read in one MULTI; None when
    there are more than MAX_SCAN messages (too many to read every sweep)."""
    asked = list(candidates)
    keys = [k for q in QUEUES for k in queue_lists(q)]
    pipe = client.pipeline(transaction=True)
    for key in keys:
        pipe.llen(key)
    pipe.hlen(KOMBU_UNACKED)
    if sum(int(n) for n in pipe.execute()) > MAX_SCAN:
        return None
    pipe = client.pipeline(transaction=True)
    for key in keys:
        pipe.lrange(key, 0, -1)
    pipe.hvals(KOMBU_UNACKED)
    if asked:
        pipe.hmget(FAIR_JOBS_KEY, asked)
    *lists, held = pipe.execute()
    ids: set[str] = set()
    if asked:
        ids.update(j for j, user in zip(asked, held, strict=True) if user is not None)
        *lists, held = lists
    for items in lists:
        for raw in items:
            job_id = message_job_id(raw)
            if job_id:
                ids.add(job_id)
    for raw in held:
        try:
            job_id = message_job_id(json.loads(raw)[0])
        except (ValueError, IndexError, TypeError):
            job_id = None
        if job_id:
            ids.add(job_id)
    return ids


class QueuedSweep:
    """One worker's part in sweeping queued jobs; ``run`` is called by its janitor."""

    def __init__(
        self, settings: Settings, store: RunStore, app: Any, nodename: str, *, client: Any = None
    ) -> None:
        """``client``: the main process's Redis client (worker.upkeep.owner), else its own."""
        self.settings = settings
        self.store = store
        self.app = app
        self.nodename = nodename
        self._owns_client = client is None
        self.redis: redis.Redis = client or redis_conn.client(settings)
        self.fair = FairQueue(self.redis, user_cap(settings))

    def close(self) -> None:
        if self._owns_client:
            self.redis.close()

    def _lock(self) -> bool:
        ttl_ms = max(500, int(self.settings.queue_reap_interval_s * 900))
        return bool(self.redis.set(SWEEP_LOCK_KEY, self.nodename, nx=True, px=ttl_ms))

    def in_broker(self) -> set[str] | None:
        """Job ids whose message is in a queue or held by a worker now (None: unknown, e.g.
        Redis unreachable or too many messages to read)."""
        try:
            return broker_job_ids(self.redis)
        except redis.RedisError as e:
            log.warning("cannot read the broker's messages (%s)", e)
            return None

    def run(self, *, force: bool = False) -> dict[str, list[str]]:
        """One sweep (skipped when another worker swept within the interval, unless
        ``force``): ``expired`` jobs ended failed, ``resent`` jobs whose message was lost,
        ``freed`` released runs whose end was not seen."""
        if not force and not self._lock():
            return {"expired": [], "resent": [], "freed": []}
        return {
            "expired": self.end_overdue(),
            "resent": self.resend_lost(),
            "freed": self.reconcile(),
        }

    def reconcile(self) -> list[str]:
        """Runs released to code.run whose job the store says ended, though their end was
        not seen: their users' cap slots are freed (and runs released)."""
        try:
            held = self.fair.held()
            if not held:
                return []
            statuses = self.store.statuses(held)
            ended = {j for j in held if j not in statuses or statuses[j].finished}
            self.fair.reconcile(ended)
        except redis.RedisError as e:
            log.warning("queued sweep: fair bookkeeping not reconciled (%s)", e)
            return []
        if ended:
            log.warning(
                "queued sweep: %d released run(s) had ended unseen; their users' slots are "
                "free again: %s",
                len(ended),
                ", ".join(sorted(ended)[:20]),
            )
        return sorted(ended)

    def end_overdue(self) -> list[str]:
        ended: list[str] = []
        for queue in QUEUES:
            bound = max_wait_s(self.settings, queue)
            if bound <= 0:
                continue
            kind = "test" if queue == QUEUE_TEST else "run"
            old = [q.job_id for q in self.store.list_queued(bound, kind=kind)]
            if old:
                done = self.store.fail_queued(old, never_taken_message(self.settings, queue))
                if done:
                    self._forget(done)
                    log.error(
                        "queued sweep: %d job(s) waited in %s longer than %g s and "
                        "ended failed (no worker took them): %s",
                        len(done),
                        queue,
                        bound,
                        ", ".join(done[:20]),
                    )
                ended += done
        return ended

    def _forget(self, job_ids: list[str]) -> None:
        try:
            self.fair.forget(job_ids)
        except redis.RedisError as e:  # claim skips them when they are released
            log.warning("queued sweep: ended jobs stay on their users' lists (%s)", e)

    def resend_lost(self) -> list[str]:
        candidates = self.store.list_queued(self.settings.queue_lost_after_s, limit=500)
        if not candidates:
            return []
        asked = [c.job_id for c in candidates]
        present = broker_job_ids(self.redis, asked)
        if present is None:
            log.warning(
                "queued sweep: more than %d messages queued; lost messages are not "
                "looked for (the queue-wait bounds still end old jobs)",
                MAX_SCAN,
            )
            return []
        missing = {c.job_id: c for c in candidates if c.job_id not in present}
        if not missing:
            return []
        time.sleep(CONFIRM_AFTER_S)
        present = broker_job_ids(self.redis, list(missing)) or set()
        still = self.store.get_many((j for j in missing if j not in present), inputs=False)
        resent = []
        for job_id, rec in still.items():
            if rec.status != "queued":
                continue
            queue = queue_of(missing[job_id].kind)
            self.app.send_task(
                TASK_NAME,
                args=(job_id,),
                task_id=job_id,
                queue=queue,
                ignore_result=True,
                headers=job_headers(self.store.store_id, self.store.describe()),
            )
            resent.append(job_id)
        if resent:
            log.error(
                "queued sweep: %d queued job(s) had no message in the queues nor held "
                "by a worker (lost); sent again: %s",
                len(resent),
                ", ".join(resent[:20]),
            )
        return sorted(resent)
