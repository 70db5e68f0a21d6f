"""Workers say who they are: one announcement per worker and queue, renewed every
STUDIO_QUEUE_HEARTBEAT_INTERVAL_S by the worker's MAIN process, so the API can refuse at
once a job that no live worker would take, and an autoscaler can read live slots (the readers,
``WorkerRegistry`` and ``WorkerInfo``, are worker/registry.py).

The announcements live in one Redis hash per queue (``protocol.workers_key``): field = the
worker's nodename, value = JSON with the queue, the slots it gives that queue, its state
(``serving``, or ``paused`` with the reason ``not_serving_reason`` gave), its host, pid and
run store, its engine (versions and known escapes, worker/upkeep/engine_watch.py; null
without one), what its pre-started sandboxes pre-import and hold (``preimport``,
worker/preimport.py), its worker group and what one slot holds (``group``,
``memory_bytes``, ``cpus``: executor.groups), and ``seen_at`` / ``expires_at`` in REDIS's
clock (so machines whose clocks disagree still agree on who is alive). A worker that stops
cleanly removes its fields at once; a killed one stops counting ``heartbeat_ttl_s`` after
its last beat (its field is removed by the next beat of any worker of that queue).

Cost: one script call per beat (all queues of the worker), one per read (all queues asked).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
from collections.abc import Callable
from typing import Any

import redis
from celery import bootsteps

from worker import lua
from worker import preimport as preimport_report
from worker.context import context_of, studio_app
from worker.protocol import QUEUE_TEST, heartbeat_ttl_s, workers_key
from worker.registry import PAUSED, SERVING
from worker.upkeep.loop import Supervised

log = logging.getLogger("studio_code.worker")

#: the beat's script (worker/upkeep/heartbeat_beat.lua: what it takes and returns); the read's
#: is the registry's (worker/registry_read.lua)
_BEAT_LUA = lua.source(__package__, "heartbeat_beat.lua")


def _never() -> str | None:
    return None


class Heartbeat:
    """Announces one worker on its queues every ``interval_s`` from a thread of the calling
    process, until ``stop`` (which removes the announcements at once).

    ``not_serving_reason`` is asked at every beat: while it returns a sentence, the worker
    is announced ``paused`` with it (the API does not count it as serving); an exception
    it raises counts as a reason too (a worker that cannot tell is not counted).
    ``queue_reason(queue)`` is asked the same way for each queue: one queue's consumer
    may have lost its broker while another's has not (worker.upkeep.broker_watch).

    ``client``: the Redis client to beat with (worker.redis_conn); default: one of
    ``redis_url``."""

    def __init__(
        self,
        redis_url: str,
        nodename: str,
        slots: dict[str, int],
        *,
        interval_s: float,
        ttl_s: float,
        not_serving_reason: Callable[[], str | None] = _never,
        store: str = "",
        store_id: Callable[[], str] | str = "",
        engine: Callable[[], dict[str, Any] | None] | None = None,
        queue_reason: Callable[[str], str | None] | None = None,
        client: redis.Redis | None = None,
        preimport: Callable[[], dict[str, Any] | None] | None = None,
        group: dict[str, Any] | None = None,
    ) -> None:
        self.nodename = nodename
        #: its worker group and what one slot holds (executor.groups): {"group",
        #: "memory_bytes", "cpus"}; None: not announced (read as the default group)
        self.group = dict(group or {})
        self.slots = dict(slots)
        self.interval_s = interval_s
        self.ttl_s = ttl_s
        self.not_serving_reason = not_serving_reason
        self.store = store
        self._store_id = store_id
        self._engine = engine
        self.queue_reason = queue_reason
        self._preimport = preimport
        self.redis = client or redis.Redis.from_url(
            redis_url, socket_timeout=3, socket_connect_timeout=3
        )
        self._beat = self.redis.register_script(_BEAT_LUA)
        # its thread: restarted when the loop raises (worker.upkeep.loop)
        self._runner = Supervised("heartbeat", self._loop)
        self._stop = self._runner.stopping
        self.state: str | None = None
        self._states: dict[str, tuple[str, str]] = {}
        self._failing = False

    def _reason(self, queue: str | None = None) -> str | None:
        try:
            if queue is None:
                return self.not_serving_reason()
            return self.queue_reason(queue) if self.queue_reason is not None else None
        except Exception as e:  # noqa: BLE001 - a worker that cannot tell is not counted
            return f"the worker's serving check failed: {e}"

    def _identity(self) -> str:
        if callable(self._store_id):
            try:
                return self._store_id()
            except Exception:  # noqa: BLE001 - the store is down: announce without its id
                return ""
        return self._store_id

    def _engine_now(self) -> dict[str, Any] | None:
        if self._engine is None:
            return None
        try:
            return self._engine()
        except Exception:  # noqa: BLE001 - the engine does not answer: announce without it
            return None

    def _preimport_now(self) -> dict[str, Any] | None:
        if self._preimport is None:
            return None
        try:
            return self._preimport()
        except Exception as e:  # noqa: BLE001 - a figure is never worth a beat
            log.debug("heartbeat: pre-import memory not announced: %s", e)
            return None

    def beat(self) -> str:
        """Announce once on every queue; returns the state announced (``paused`` when any
        queue is)."""
        reason = self._reason()
        base = {
            "nodename": self.nodename,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "store": self.store,
            "store_id": self._identity(),
            "engine": self._engine_now(),
            "preimport": self._preimport_now(),
            **self.group,
        }
        queues = sorted(self.slots)
        states: dict[str, tuple[str, str | None]] = {}
        for q in queues:
            why = reason or self._reason(q)
            states[q] = (SERVING if why is None else PAUSED, why)
        entries = [
            json.dumps({**base, "queue": q, "slots": self.slots[q], "state": s, "reason": why})
            for q, (s, why) in states.items()
        ]
        # said before the write: a worker that cannot reach Redis still says so in its log
        self._log_changes(states)
        self._beat(
            keys=[workers_key(q) for q in queues], args=[self.nodename, self.ttl_s, *entries]
        )
        return self.state or SERVING

    def _log_changes(self, states: dict[str, tuple[str, str | None]]) -> None:
        # a reason's kind (before its first colon), not its figures (an age that grows)
        kinds = {q: (s, (why or "").split(":")[0]) for q, (s, why) in states.items()}
        if kinds == self._states:
            return
        serving = [q for q, (state, _) in states.items() if state == SERVING]
        paused = {q: why for q, (state, why) in states.items() if state != SERVING}
        if serving:
            log.info(
                "heartbeat: %s serves %s",
                self.nodename,
                ", ".join(f"{q} ({self.slots[q]} slots)" for q in serving),
            )
        for queue, why in paused.items():
            if self._states.get(queue) != kinds[queue]:
                log.error(
                    "heartbeat: %s is not serving %s (the API refuses jobs it alone would "
                    "take): %s",
                    self.nodename,
                    queue,
                    why,
                )
        self._states = kinds
        self.state = PAUSED if paused else SERVING

    def start(self) -> None:
        """Beat once now (so the worker counts as soon as it starts), then in a thread."""
        try:
            self.beat()
        except redis.RedisError as e:
            log.warning("heartbeat: could not announce %s yet: %s", self.nodename, e)
        self._runner.start()

    def _loop(self, stop: threading.Event) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.beat()
                if self._failing:
                    log.warning("heartbeat: announcing %s again", self.nodename)
                self._failing = False
            except Exception as e:  # noqa: BLE001 - keep beating
                if not self._failing:
                    log.warning("heartbeat: could not announce %s: %s", self.nodename, e)
                self._failing = True

    def stop(self) -> None:
        """Stop beating and remove the announcements (the worker no longer counts)."""
        self._runner.stop(10)
        try:
            pipe = self.redis.pipeline()
            for queue in self.slots:
                pipe.hdel(workers_key(queue), self.nodename)
            pipe.execute()
        except redis.RedisError as e:
            log.warning(
                "heartbeat: could not withdraw %s (it expires by itself): %s", self.nodename, e
            )
        self.redis.close()


def queue_slots(app: Any, worker: Any) -> dict[str, int]:
    """The slots this worker gives each queue it consumes: with test slots kept
    (worker.consumer.slots), code.test gets those and code.run the rest of the pool; otherwise one
    consumer shares the whole pool between the queues."""
    from worker.context import consumed_queues

    queues = consumed_queues(app)
    concurrency = int(getattr(worker, "concurrency", 0) or 0) or 1
    test_slots = context_of(app).test_slots
    out = {}
    for queue in sorted(queues):
        if test_slots and queue == QUEUE_TEST:
            out[queue] = test_slots
        elif test_slots:
            out[queue] = max(1, concurrency - test_slots)
        else:
            out[queue] = concurrency
    return out


class HeartbeatStep(bootsteps.StartStopStep):
    """Consumer step: announces the worker once its task consumer exists (and again after a
    broker reconnect), withdraws it when the consumer stops (warm shutdown included).

    The app's ``context.not_serving_reason`` says why the worker should not count as
    serving (e.g. its runtime is unavailable)."""

    label = "studio heartbeat"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self.heartbeat: Heartbeat | None = None
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        app = studio_app(c.app)
        if app is None or self.heartbeat is not None:
            return
        settings, context = app.settings, app.context
        from executor.store.sql import describe_url
        from worker import redis_conn
        from worker.upkeep import broker_watch

        dead_after_s = settings.redis_dead_after_s

        self.heartbeat = Heartbeat(
            settings.redis_url,
            c.hostname,
            queue_slots(c.app, c.controller),
            interval_s=settings.queue_heartbeat_interval_s,
            ttl_s=heartbeat_ttl_s(settings),
            not_serving_reason=context.not_serving_reason,
            store=describe_url(settings.sqlalchemy_url),
            # read by the janitor when it opened the store (no second connection here, and
            # nothing that could hang the beat while the store is down)
            store_id=lambda: context.store_id,
            # the upkeep's last read of the engine (worker.upkeep.engine_watch): never waits for it
            engine=lambda: context.engine(),
            queue_reason=lambda queue: broker_watch.lost_reason(queue, dead_after_s),
            client=redis_conn.client(settings),
            # what the pool processes measured of their pre-started sandboxes (worker/preimport.py)
            preimport=lambda: preimport_report.announcement(settings),
            # its group and what a slot holds: the caps its guard enforces
            group={
                "group": settings.worker_group,
                "memory_bytes": settings.max_memory_bytes,
                "cpus": settings.max_cpus,
            },
        )
        self.heartbeat.start()

    def stop(self, c: Any) -> None:
        if c.blueprint.state == bootsteps.RUN:
            # a restart after a lost connection: keep beating; while the consumer is away,
            # worker.upkeep.broker_watch says "broker connection lost" (paused, not gone)
            return
        self._withdraw()

    def _withdraw(self) -> None:
        if self.heartbeat is not None:
            self.heartbeat.stop()
            self.heartbeat = None

    def shutdown(self, c: Any) -> None:
        self._withdraw()
