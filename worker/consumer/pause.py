"""The gate applied to the consumers: while the worker's gate is closed (its run store or its
runtime is down here, worker/upkeep/gate_watch.py decides), its task consumers are cancelled, so
its messages stay in Redis for workers that can serve them; they consume again once it opens.
Consumers are only touched from the consumer's own event loop, never from the gate's thread.
"""

from __future__ import annotations

import logging
from typing import Any

from celery import bootsteps

from worker.consumer.slots import CodeTestConsumer
from worker.gate import gate

log = logging.getLogger("studio_code.worker")

#: how often the event loop applies the gate to the consumers
APPLY_EVERY_S = 0.25


class GateStep(bootsteps.StartStopStep):
    """Consumer step: every APPLY_EVERY_S, in the event loop, cancels this worker's task
    consumers while the gate is closed and consumes again once it opens. Idempotent: after a
    broker reconnect (new consumers, consuming) a closed gate cancels them again."""

    label = "studio gate"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.paused = False
        self._timer: Any = None
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        if self._timer is None:
            self._timer = c.timer.call_repeatedly(APPLY_EVERY_S, self.apply, (c,), priority=0)

    def stop(self, c: Any) -> None:
        if self._timer is not None:
            try:
                self._timer.cancel()
            except Exception:  # noqa: BLE001
                pass
            self._timer = None

    def shutdown(self, c: Any) -> None:
        self.stop(c)

    @staticmethod
    def _consumers(c: Any) -> list[Any]:
        out = [c.task_consumer] if getattr(c, "task_consumer", None) is not None else []
        for step in getattr(c, "steps", []) or []:
            if isinstance(step, CodeTestConsumer):
                out += list(step.consumers or [])
        return out

    def apply(self, c: Any) -> None:
        closed = gate().reason() is not None
        try:
            consumers = self._consumers(c)
            if closed:
                for consumer in consumers:
                    if getattr(consumer, "_active_tags", None):
                        consumer.cancel()
                if not self.paused:
                    log.error("consumers paused: %s", gate().reason())
                self.paused = True
            elif self.paused:
                for consumer in consumers:
                    if consumer.queues and not getattr(consumer, "_active_tags", None):
                        consumer.consume()
                self.paused = False
                log.warning("consumers resumed")
        except Exception:  # noqa: BLE001 - e.g. a broker blip: the next tick tries again
            log.exception("could not apply the gate to the consumers")
