"""Signals an autoscaler reads: backlog per queue, age of the oldest queued job, live
workers and busy/idle slots per queue.

* ``QueueCollector`` (served by the API's ``/metrics``, which stays up when workers scale
  to zero): ``studio_code_queue_backlog{queue}`` is every run waiting: LLEN of the queue's
  Redis lists plus, for code.run, the runs waiting on their users' lists (worker.fair; see
  docs/operations.md for what KEDA reads; every worker group's queues, executor.groups),
  and ``studio_code_queue_oldest_seconds{queue}``
  the age of the oldest job still ``queued`` in the run store (0 when none waits). With
  them: ``studio_code_queue_fairness{mode}``, ``studio_code_queue_user_waiting{rank}`` (the
  runs waiting of the TOP_USERS users with the most, rank 1..TOP_USERS, 0 where fewer users
  wait, and of all others, rank ``rest``: always TOP_USERS + 1 series, never one per user,
  and no user id: a user's name is no label value, docs/operations.md "Fair share") and
  ``studio_code_queue_users_waiting``.
* ``SlotsCollector`` (served by each worker's ``/metrics``): ``studio_code_worker_up{queue}``
  is 1 for each queue this worker consumes once it is ready (0 before), so its sum over
  workers is the live workers per queue; ``studio_code_worker_slots{queue,state}`` counts
  this worker's pool processes that can take a job of the queue, busy or idle.

Live workers here are "workers Prometheus scraped", read from the worker itself; Redis
heartbeats per worker and queue (another part of the project) are the API-side view.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from worker.context import context_of
from worker.fair import TOP_USERS, FairQueue
from worker.protocol import (
    KOMBU_PRIORITY_STEPS,
    QUEUE_RUN,
    QUEUE_TEST,
    QUEUES,
    group_of_queue,
    kind_of_queue,
    queue_lists,
)

log = logging.getLogger("studio_code.metrics")

PREFIX = "studio_code"
KIND_OF = {QUEUE_RUN: "run", QUEUE_TEST: "test"}


class QueueCollector(Collector):
    """Backlog (Redis) and oldest wait (run store) per queue, read at scrape time. A
    source that cannot be read leaves its family empty for that scrape (and is logged):
    an autoscaler then sees no data, never a false 0."""

    def __init__(
        self,
        redis_client: Any,
        store_factory: Any,
        fairness: str = "users",
        queues: Iterable[str] = QUEUES,
    ) -> None:
        """``queues``: whose backlog to report (the default worker group's, then every
        other group's: worker.protocol.group_queues; bounded by executor.groups.MAX_GROUPS)."""
        self.queues = tuple(dict.fromkeys([*QUEUES, *queues]))
        self.redis = redis_client
        self.store_factory = store_factory  # called per scrape: the store may open late
        self.fairness = fairness
        self.fair = FairQueue(redis_client, 0)
        #: another group's workflow runs waiting on its lanes (worker.fair.group_keys)
        self.lanes = {
            q: FairQueue(redis_client, 0, group=group_of_queue(q)).jobs_key
            for q in self.queues
            if q != QUEUE_RUN and kind_of_queue(q) == "run"
        }

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [
            self._backlog_family(),
            self._oldest_family(),
            *self._fair_families(),
        ]

    @staticmethod
    def _fair_families() -> tuple[GaugeMetricFamily, GaugeMetricFamily, GaugeMetricFamily]:
        return (
            GaugeMetricFamily(
                f"{PREFIX}_queue_fairness",
                "1 for the fairness mode of code.run this API submits with "
                "(STUDIO_QUEUE_RUN_FAIRNESS: users or off).",
                labels=["mode"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_queue_user_waiting",
                f"Runs waiting on the lists of the {TOP_USERS} users with the most (rank "
                "1 = the most; 0 where fewer users wait), and of all other users together "
                "(rank rest). No user id: who they are is in admin-only meta.",
                labels=["rank"],
            ),
            GaugeMetricFamily(
                f"{PREFIX}_queue_users_waiting",
                "Users with workflow runs waiting on their lists (fairness between users).",
            ),
        )

    @staticmethod
    def _backlog_family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            f"{PREFIX}_queue_backlog",
            "Messages waiting in the queue's Redis lists (LLEN), not yet taken by a worker.",
            labels=["queue"],
        )

    @staticmethod
    def _oldest_family() -> GaugeMetricFamily:
        return GaugeMetricFamily(
            f"{PREFIX}_queue_oldest_seconds",
            "Age of the oldest job still queued in the run store (0 when none waits).",
            labels=["queue"],
        )

    def collect(self) -> Iterable[GaugeMetricFamily]:
        backlog = self._backlog_family()
        mode, by_user, users = self._fair_families()
        mode.add_metric([self.fairness], 1.0)
        try:
            stats = self.fair.stats(TOP_USERS)
            pipe = self.redis.pipeline(transaction=False)
            for queue in self.queues:
                for key in queue_lists(queue):
                    pipe.llen(key)
            for key in self.lanes.values():
                pipe.hlen(key)
            lengths = pipe.execute()
            on_lanes = dict(zip(self.lanes, lengths[len(lengths) - len(self.lanes) :], strict=True))
            n = len(KOMBU_PRIORITY_STEPS)
            for i, queue in enumerate(self.queues):
                waiting = sum(lengths[i * n : (i + 1) * n])
                if queue == QUEUE_RUN:  # and the runs held back on their users' lists
                    waiting += stats.waiting
                waiting += int(on_lanes.get(queue, 0))  # another group's, on its lanes
                backlog.add_metric([queue], float(waiting))
            # ranks only, every one of them each scrape: a bounded, stable set of series
            counts = [load.waiting for load in stats.top[:TOP_USERS]]
            for rank in range(1, TOP_USERS + 1):
                waiting = counts[rank - 1] if rank <= len(counts) else 0
                by_user.add_metric([str(rank)], float(waiting))
            by_user.add_metric(["rest"], float(stats.waiting - sum(counts)))
            users.add_metric([], float(stats.users_waiting))
        except Exception as e:  # noqa: BLE001 - a scrape never fails for a dependency
            log.warning("queue backlog unreadable: %s", e)
        oldest = self._oldest_family()
        try:
            store = self.store_factory()
            now = datetime.now(UTC)
            for queue in QUEUES:
                at = store.oldest_queued_at(KIND_OF[queue])
                oldest.add_metric(
                    [queue], 0.0 if at is None else max(0.0, (now - at).total_seconds())
                )
        except Exception as e:  # noqa: BLE001
            log.warning("oldest queued job unreadable: %s", e)
        return [backlog, oldest, mode, by_user, users]


class SlotsCollector(Collector):
    """This worker's slots and liveness per queue (see the module doc). ``consumer`` is
    Celery's consumer, set once the worker is ready."""

    def __init__(self) -> None:
        self.consumer: Any = None

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return list(self._families())

    def collect(self) -> Iterable[GaugeMetricFamily]:
        return list(self._families(self.consumer))

    @staticmethod
    def slots(consumer: Any) -> dict[str, tuple[int, int]]:
        """queue -> (busy, total) for the queues ``consumer``'s worker reads."""
        from celery.worker.state import active_requests

        controller = consumer.controller
        concurrency = int(controller.concurrency or 0)
        test_slots = context_of(consumer.app).test_slots
        queues = consumer.app.amqp.queues
        # its worker group's (code.test and code.run for the default group)
        names = sorted(set(queues.consume_from or queues))
        busy_by_queue = {q: 0 for q in names}
        busy = 0
        for req in list(active_requests):
            busy += 1
            key = (req.delivery_info or {}).get("routing_key")
            if key in busy_by_queue:
                busy_by_queue[key] += 1
        out = {}
        for q in names:
            if test_slots:  # split pool (worker.consumer.slots): each queue has its own processes
                total = test_slots if q == QUEUE_TEST else concurrency - test_slots
                out[q] = (min(busy_by_queue[q], total), total)
            else:  # one pool, both queues: every process can take either
                out[q] = (min(busy, concurrency), concurrency)
        return out

    def _families(self, consumer: Any = None) -> Iterable[GaugeMetricFamily]:
        up = GaugeMetricFamily(
            f"{PREFIX}_worker_up",
            "1 for each queue this worker consumes, once ready; sum over workers = live "
            "workers per queue.",
            labels=["queue"],
        )
        slots = GaugeMetricFamily(
            f"{PREFIX}_worker_slots",
            "This worker's pool processes that can take a job of the queue, by state.",
            labels=["queue", "state"],
        )
        table: dict[str, tuple[int, int]] = {}
        if consumer is not None:
            try:
                table = self.slots(consumer)
            except Exception as e:  # noqa: BLE001
                log.warning("worker slots unreadable: %s", e)
        # the default group's queues always (at 0 on another group's worker), and this
        # worker's own
        for q in dict.fromkeys([*QUEUES, *table]):
            busy, total = table.get(q, (0, 0))
            up.add_metric([q], 1.0 if q in table else 0.0)
            slots.add_metric([q, "busy"], float(busy))
            slots.add_metric([q, "idle"], float(total - busy))
        yield up
        yield slots


#: the worker's collector: its metrics server serves it, worker_ready gives it the consumer
SLOTS = SlotsCollector()
