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
* **Lost holder**: a job still queued whose message has sat in the ``unacked`` hash for
  longer than a live worker ever holds one unclaimed (``held_lost_after_s``, by kombu's
  ``unacked_index``: the delivery's time) is sent again too. Its worker lost it: after a
  Sentinel failover the new primary has the delivery (replicated) while the worker that
  took it dropped it with the old primary's connection, and kombu would hand it out only
  after the visibility timeout. Read twice as above; then the stale delivery is removed
  (hash and index, in one script, only if it is still there and still that old) before the
  job is sent again. A first delivery claims only a queued job (``claim(again=False)``),
  so the holder, if it was only slow, and the new copy cannot both run it.
* **Fair bookkeeping**: ended jobs leave their user's waiting list, and a run released to
  code.run whose job ended without its end being seen (failed by the reaper, a worker
  killed after its result) frees its user's cap slot (``FairQueue.reconcile``); a lane kept
  for a retry's next attempt (worker.fair, ``pause``) whose job ended meanwhile goes. Each
  worker group's fair queue alike.

A workflow run's message sent again goes through its group's fair queue (worker.fair,
``again``), never straight to its queue: a job that holds its slot (released, its message
lost after) gets its message back in its queue, the slot counted once; any other waits on
its lane (the one its last attempt had, else the lane of its user, tenant and workflow as the
run store's row holds them: a run whose fair state Redis lost entirely comes back to its own
lane) at its keys' caps.

Cost: one SELECT of old queued rows per sweep; the broker is read only when there are some,
and never when the queues hold more than MAX_SCAN messages (then only the wait bound acts).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any, NamedTuple

import redis

from executor.groups import groups_of
from executor.settings import Settings
from executor.store import RunStore
from worker import lua, redis_conn
from worker.fair import FairQueue, fair_headers
from worker.protocol import (
    FAIR_JOBS_KEY,
    KOMBU_UNACKED,
    KOMBU_UNACKED_INDEX,
    QUEUE_TEST,
    QUEUES,
    SWEEP_LOCK_KEY,
    TASK_NAME,
    group_queues,
    held_lost_after_s,
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


class Broker(NamedTuple):
    """What the broker holds, as one MULTI read it: ``waiting``, the job ids of messages in
    a queue list (or of candidates on their user's list, worker.fair); ``held``, for each
    job id whose message a worker took and has not acknowledged (kombu's ``unacked`` hash),
    its deliveries: (delivery tag, delivery time by kombu's ``unacked_index``, None when the
    index has no entry)."""

    waiting: set[str]
    held: dict[str, list[tuple[str, float | None]]]

    def ids(self) -> set[str]:
        return self.waiting | set(self.held)


def read_broker(
    client: redis.Redis,
    candidates: Iterable[str] = (),
    queues: Iterable[str] = QUEUES,
    jobs_keys: Iterable[str] = (FAIR_JOBS_KEY,),
) -> Broker | None:
    """The broker's messages (``Broker``) in ``queues`` (default: the default worker
    group's), with ``candidates`` looked for on their lanes (``jobs_keys``: the fair queues'
    hashes of waiting runs, default: the default group's), read in one MULTI; None when
    there are more than MAX_SCAN messages (too many to read every sweep)."""
    asked = list(candidates)
    keys = [k for q in queues for k in queue_lists(q)]
    pipe = client.pipeline(transaction=True)
    for key in keys:
        pipe.llen(key)
    pipe.hlen(KOMBU_UNACKED)
    if sum(int(n) for n in pipe.execute()) > MAX_SCAN:
        return None
    pipe = client.pipeline(transaction=True)
    for key in keys:
        pipe.lrange(key, 0, -1)
    pipe.hgetall(KOMBU_UNACKED)
    pipe.zrange(KOMBU_UNACKED_INDEX, 0, -1, withscores=True)
    lanes = list(jobs_keys) if asked else []
    for key in lanes:
        pipe.hmget(key, asked)
    replies = pipe.execute()
    waiting: set[str] = set()
    for _ in lanes:
        users = replies.pop()
        waiting.update(j for j, user in zip(asked, users, strict=True) if user is not None)
    *lists, unacked, index = replies
    for items in lists:
        for raw in items:
            job_id = message_job_id(raw)
            if job_id:
                waiting.add(job_id)
    delivered = {_text(tag): float(score) for tag, score in index}
    held: dict[str, list[tuple[str, float | None]]] = {}
    for tag, raw in unacked.items():
        try:
            job_id = message_job_id(json.loads(raw)[0])
        except (ValueError, IndexError, TypeError):
            job_id = None
        if job_id:
            held.setdefault(job_id, []).append((_text(tag), delivered.get(_text(tag))))
    return Broker(waiting, held)


def _text(value: str | bytes) -> str:
    return value.decode() if isinstance(value, bytes) else value


def broker_job_ids(client: redis.Redis, candidates: Iterable[str] = ()) -> set[str] | None:
    """The job ids of every message in the queues or held by a worker, and those of
    ``candidates`` waiting on their user's list (worker.fair), read in one MULTI; None when
    there are more than MAX_SCAN messages (too many to read every sweep)."""
    broker = read_broker(client, candidates)
    return None if broker is None else broker.ids()


#: worker/upkeep/take_stale.lua: removes stale deliveries from kombu's unacked hash and
#: index, each only if it is still there and its delivery time still at or before the cutoff
#: (or it still has none): a delivery kombu restored, a worker acknowledged or took again
#: meanwhile is left alone
TAKE_STALE = lua.source(__package__, "take_stale.lua")


def take_stale(client: redis.Redis, tags: list[str], cutoff: float) -> int:
    """Remove the deliveries ``tags`` from kombu's unacked hash and index, atomically, those
    still there and delivered at or before ``cutoff`` (Unix seconds; no delivery time
    counts as stale). How many were removed."""
    if not tags:
        return 0
    return int(client.eval(TAKE_STALE, 2, KOMBU_UNACKED, KOMBU_UNACKED_INDEX, repr(cutoff), *tags))


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
        #: every worker group's queues (executor.groups: the default group's, this
        #: worker's, STUDIO_WORKER_GROUPS'): a message waiting in any is not lost
        names = {settings.worker_group, *(g.name for g in groups_of(settings))}
        self.queues = tuple(q for name in sorted(names) for q in group_queues(name))
        #: and each group's fair queue (worker.fair.group_keys)
        self.fairs = [FairQueue.of(self.redis, settings, name) for name in sorted(names)]

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
        """Runs released to their queue whose job the store says ended, though their end was
        not seen: their keys' cap slots are freed (and runs released); lanes kept for a
        retry's next attempt whose job ended go. Every group's fair queue."""
        ended: set[str] = set()
        try:
            for fair in self.fairs:
                held, paused = fair.held(), fair.paused()
                if not held and not paused:
                    continue
                statuses = self.store.statuses([*held, *paused])
                gone = {j for j in statuses if statuses[j].finished}
                gone |= {j for j in [*held, *paused] if j not in statuses}
                fair.reconcile(gone & set(held))
                fair.forget(sorted(gone & set(paused)))
                ended |= gone & set(held)
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
            for fair in self.fairs:
                fair.forget(job_ids)
        except redis.RedisError as e:  # claim skips them when they are released
            log.warning("queued sweep: ended jobs stay on their users' lists (%s)", e)

    def resend_lost(self) -> list[str]:
        candidates = self.store.list_queued(self.settings.queue_lost_after_s, limit=500)
        if not candidates:
            return []
        bound = held_lost_after_s(self.settings)
        lanes = [f.jobs_key for f in self.fairs]
        broker = read_broker(self.redis, [c.job_id for c in candidates], self.queues, lanes)
        if broker is None:
            log.warning(
                "queued sweep: more than %d messages queued; lost messages are not "
                "looked for (the queue-wait bounds still end old jobs)",
                MAX_SCAN,
            )
            return []
        missing = {
            c.job_id: c for c in candidates if _unowned(broker, c.job_id, time.time() - bound)
        }
        if not missing:
            return []
        time.sleep(CONFIRM_AFTER_S)
        cutoff = time.time() - bound
        broker = read_broker(self.redis, list(missing), self.queues, lanes) or Broker(set(), {})
        still = self.store.get_many(
            (j for j in missing if _unowned(broker, j, cutoff)), inputs=False
        )
        resent, taken = [], []
        for job_id, rec in still.items():
            if rec.status != "queued":
                continue
            stale = [tag for tag, _ in broker.held.get(job_id, [])]
            if stale:
                # its holder lost it: the delivery goes first, unless it moved meanwhile
                if not take_stale(self.redis, stale, cutoff):
                    continue
                taken.append(job_id)
            lost = missing[job_id]
            self.app.send_task(
                TASK_NAME,
                args=(job_id,),
                task_id=job_id,
                queue=queue_of(lost.kind, lost.worker_group),
                ignore_result=True,
                headers={
                    **job_headers(self.store.store_id, self.store.describe()),
                    # a workflow run: through its group's fair queue (the module's doc)
                    **fair_headers(
                        self.settings, lost.kind, lost.user, lost.tenant, lost.workflow, again=True
                    ),
                },
            )
            resent.append(job_id)
        if resent:
            log.error(
                "queued sweep: %d queued job(s) had no message in the queues nor held "
                "by a live worker (lost; %d of them delivered more than %g s ago to a "
                "worker that never claimed them); sent again: %s",
                len(resent),
                len(taken),
                bound,
                ", ".join(resent[:20]),
            )
        return sorted(resent)


def _unowned(broker: Broker, job_id: str, cutoff: float) -> bool:
    """No message of ``job_id`` waits in a queue and none is held by a live worker: every
    delivery of it (if any) was made at or before ``cutoff`` (or has no delivery time)."""
    if job_id in broker.waiting:
        return False
    return all(at is None or at <= cutoff for _, at in broker.held.get(job_id, []))
