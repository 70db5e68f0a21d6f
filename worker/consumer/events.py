"""Celery's task events for Flower and celery-exporter, on request, without stalling the loop.

A worker runs without -E and without Celery's worker heartbeat events (worker.consumer.slots:
their publish retried forever in the event loop while Redis was away). Two things make
Flower's and celery-exporter's ``enable_events`` broadcast work all the same:

* ``events_on_request``: Celery turns a consumer's event dispatcher off when no group of
  events is wanted (no -E, no gossip, no heartbeat), and ``enable_events`` then adds the
  ``task`` group to a dispatcher that never sends: Flower saw no task. Here the dispatcher
  is on with the ``worker`` group only, which nothing sends (no heartbeat or gossip step):
  nothing is published until the broadcast, task events after it, as with -E.
* ``QuietDispatcher``: events are published from the event loop without retry, but Celery
  keeps a failed one and tries every kept one again at each flush, each try blocking the
  loop up to the socket timeout while Redis is silent. After a failure this dispatcher
  keeps events (the newest ``KEEP_MAX``) without trying for ``QUIET_S``; the consumer's
  reconnect makes a new dispatcher, which sends what was kept at once.
"""

from __future__ import annotations

import time
from collections import deque
from typing import Any

from celery.events.dispatcher import EventDispatcher
from celery.worker.consumer.events import Events

#: no publish is tried for this long after one failed (the loop blocks once, not per event)
QUIET_S = 30.0
#: events kept while they cannot be sent; the oldest are dropped beyond it
KEEP_MAX = 1000


def events_on_request(consumer: Any) -> None:
    """Turn the consumer's Events step on when Celery left it off (no -E): started (and
    stopped) where Celery would have, before the task step builds the strategies that hand
    the dispatcher to each request."""
    order = consumer.blueprint.order
    step = next((s for s in order if isinstance(s, Events)), None)
    if step is None or step in consumer.steps:  # on already (-E)
        return
    step.send_events = step.enabled = True
    earlier = set(order[: order.index(step)])
    consumer.steps.insert(sum(1 for s in consumer.steps if s in earlier), step)


class QuietDispatcher(EventDispatcher):
    """Celery's dispatcher that stops trying for ``QUIET_S`` after a failed publish."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._outbound_buffer: deque[Any] = deque(maxlen=KEEP_MAX)
        self._quiet_until = 0.0

    def _publish(
        self,
        event: Any,
        producer: Any,
        routing_key: str,
        retry: bool = False,
        retry_policy: Any = None,
        utcoffset: Any = None,
    ) -> None:
        # Celery's _publish, with the quiet time
        if producer is None:
            return
        if time.monotonic() < self._quiet_until:
            self._outbound_buffer.append((event, routing_key))
            return
        try:
            producer.publish(
                event,
                routing_key=routing_key,
                exchange=self.exchange.name,
                retry=retry,
                retry_policy=retry_policy,
                declare=[self.exchange],
                serializer=self.serializer,
                headers=self.headers,
                delivery_mode=self.delivery_mode,
            )
        except Exception:
            if not self.buffer_while_offline:
                raise
            self._outbound_buffer.append((event, routing_key))
            self._quiet_until = time.monotonic() + QUIET_S
