"""Editor test calls never wait behind workflow runs: pool processes kept for ``code.test``.

Priority alone cannot promise that: when every process runs a long workflow node, a test
call waits for one of them to end, whatever its priority. So a worker that consumes both
queues keeps STUDIO_QUEUE_TEST_SLOTS of its STUDIO_CODE_CONCURRENCY pool processes for
tests and has two consumers:

* Celery's own task consumer reads ``code.run`` (and any other queue given with -Q) with a
  prefetch of the run slots: ``-c`` (= STUDIO_CODE_CONCURRENCY) minus the test slots;
* ``CodeTestConsumer`` reads ``code.test`` on a channel of its own with a prefetch of the
  test slots.

With acks_late a message counts against its channel's prefetch until its job ENDS, so at
most ``-c`` minus ``test slots`` runs and ``test slots`` tests are held at once: the pool
has exactly that many processes, a test message always finds an idle process, and the default
'fair' scheduling hands it to one at once. The cost: one slot of ``-c`` never runs a
workflow node; set STUDIO_QUEUE_TEST_SLOTS=0 on workers that serve no editor.

Not applied with ``--autoscale`` (the pool size moves) nor when the worker consumes only
one of the two queues; then the one consumer reads code.test before code.run (the broker's
'priority' queue order).
"""

from __future__ import annotations

import logging
from typing import Any

from celery import Celery, bootsteps
from celery.worker.consumer import Consumer

from worker import poison
from worker.consumer.events import events_on_request
from worker.context import consumed_queues, context_of, studio_app
from worker.protocol import QUEUE_TEST

log = logging.getLogger("studio_code.worker")

#: the longest pause between two attempts of the consumer to reach Redis again
RECONNECT_MAX_S = 2.0


def reserved_test_slots(app: Celery, autoscale: Any = None) -> int:
    """Processes to keep for code.test on a worker of ``app`` (0: no split)."""
    ours = studio_app(app)
    wanted = ours.settings.queue_test_slots if ours is not None else 0
    names = consumed_queues(app)
    if not wanted or QUEUE_TEST not in names or names == {QUEUE_TEST}:
        return 0
    if autoscale:
        log.warning(
            "--autoscale: no pool processes are kept for %s; it is read first, but "
            "a test call may wait for a slot",
            QUEUE_TEST,
        )
        return 0
    return int(wanted)


class ReserveTestSlots(bootsteps.Step):
    """Worker step: grows the pool by the test slots before the pool is created."""

    label = "studio test slots"

    def __init__(self, w: Any, autoscale: Any = None, **kwargs: Any) -> None:
        slots = reserved_test_slots(w.app, autoscale)
        # The specification: STUDIO_CODE_CONCURRENCY is the containers at once per server
        # process. So the test slots come OUT of the pool, never on top of it, and a pool
        # too small to split keeps one consumer (code.test read first).
        if slots and int(w.concurrency) <= slots:
            log.warning(
                "concurrency %s is too small to keep %s process(es) for %s; it is "
                "read first instead",
                w.concurrency,
                slots,
                QUEUE_TEST,
            )
            slots = 0
        context_of(w.app).test_slots = slots
        super().__init__(w, **kwargs)


class StudioConsumer(Consumer):
    """Celery's consumer whose task channel prefetches for the run slots only.

    Without Celery's mingle and gossip (what --without-mingle --without-gossip turn off):
    mingle asks every other worker on each (re)connect and waits for their answers;
    cancels are flags in Redis and the run store here (worker.cancel), not gossip.
    And, unless events are on (-E, for Flower or celery-exporter), without Celery's
    worker heartbeat events (--without-heartbeat): they are published from the event loop
    with a retry that never ends while Redis cannot be reached, so a lost broker stopped
    the whole loop (no broker watch, no reconnect) until Redis came back. The studio's
    heartbeat (worker.upkeep.heartbeat) is what the API reads.

    Its event dispatcher stays on all the same (worker.consumer.events), so Flower's and
    celery-exporter's ``enable_events`` broadcast turns task events on."""

    def __init__(self, *args: Any, worker_options: Any = None, **kwargs: Any) -> None:
        off = {"without_mingle": True, "without_gossip": True}
        if not kwargs.get("task_events"):  # -E (Flower, celery-exporter) keeps them
            off["without_heartbeat"] = True
        worker_options = {**(worker_options or {}), **off}
        super().__init__(*args, worker_options=worker_options, **kwargs)
        events_on_request(self)
        self.test_slots = context_of(self.app).test_slots
        initial: int = self.initial_prefetch_count  # type: ignore[has-type]
        if self.test_slots and initial:
            reserved = self.test_slots * self.prefetch_multiplier
            self.initial_prefetch_count = max(self.prefetch_multiplier, initial - reserved)

    # Poison messages: set aside in studio:dead:<queue> (worker.poison), never just dropped.

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        poison.on_bad_message(message, f"undecodable body: {type(exc).__name__}: {exc}")

    def on_unknown_message(self, body: Any, message: Any) -> None:
        poison.on_bad_message(message, "unknown message format (not a Celery task)")

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        poison.on_bad_message(message, f"unknown task: {exc}")

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        poison.on_bad_message(message, f"invalid task: {exc}")

    def ensure_connected(self, conn: Any) -> Any:
        # Celery's retries wait 2, 4, ... 30 s between attempts: after a long outage the
        # worker would stay away up to 30 s after Redis is back. Each attempt is bounded
        # by the connect timeout (worker.redis_conn), so attempts follow each other.
        ensure = conn.ensure_connection

        def quickly(*args: Any, **kwargs: Any) -> Any:
            kwargs.update(interval_start=0, interval_step=1, interval_max=RECONNECT_MAX_S)
            return ensure(*args, **kwargs)

        conn.ensure_connection = quickly
        return super().ensure_connected(conn)

    @property
    def max_prefetch_count(self) -> int:
        # Celery restores the prefetch to this after a reconnect: the run slots, not the pool.
        slots = context_of(self.app).test_slots
        return max(1, self.pool.num_processes - slots) * self.prefetch_multiplier


class CodeTestConsumer(bootsteps.ConsumerStep):
    """Consumer step: reads code.test on its own channel, prefetch = test slots, and feeds
    the messages to Celery's normal task handling (same pool, same acks_late)."""

    label = "studio test queue"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.slots = context_of(c.app).test_slots
        self.enabled = self.slots > 0
        self._c: Any = None
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        # Celery's task consumer was made with every -Q queue and has not consumed yet
        # (that happens when the event loop starts): code.test is ours.
        c.task_consumer.cancel_by_queue(QUEUE_TEST)
        self._c = c
        super().start(c)

    def stop(self, c: Any) -> None:
        # A warm shutdown stops the consumers BEFORE the pool finishes its jobs: only cancel
        # here. Closing the channel now would hand its unacked messages back to the queue
        # and the acks of the jobs still ending would be lost (redelivered once ended).
        for consumer in self.consumers or []:
            try:
                consumer.cancel()
            except Exception as e:  # noqa: BLE001
                log.warning("cancelling the %s consumer failed: %s", QUEUE_TEST, e)

    def get_consumers(self, channel: Any) -> list[Any]:
        c = self._c
        queue = c.app.amqp.queues[QUEUE_TEST]
        consumer = c.app.amqp.TaskConsumer(
            channel, queues=[queue], on_decode_error=c.on_decode_error
        )
        consumer.qos(prefetch_count=self.slots * c.prefetch_multiplier)
        consumer.on_message = c.create_task_handler()
        return [consumer]
