""" "Serving" is proven, not assumed: each queue's consumer shows a round trip to Redis on
its own connection at least every STUDIO_REDIS_DEAD_AFTER_S, or the worker's main process
says it has lost its broker.

What counts as a round trip of a queue's consumer (in the worker's main process):

* an answer to the BRPOP of the channel that consumes it (kombu sends it with a 1 s
  server-side timeout, so a live consumer is answered every second, message or not:
  ``worker.poison.PoisonChannel`` notes when, ``probe`` passes it on);
* while that channel does not ask (every slot of the queue is busy, or the worker's gate
  cancelled its consumers while the run store or the runtime is down here, so kombu sends
  no BRPOP), a PING through the channel's own connections, once a second from the
  consumer's event loop (``BrokerWatchStep``);
* the consumer (re)connecting: Celery connected it a moment ago.

Readers: the heartbeat (a queue without a recent round trip is announced ``paused``,
"broker connection lost", so the API refuses at once what that worker would take), the
worker's readiness (``/healthz`` 503), and the watchdog (``BrokerWatchdog``): a consumer
that shows no round trip for STUDIO_REDIS_GIVE_UP_S while a fresh connection to Redis
answers is stuck for good, so the worker exits non-zero (a JSON line on stderr says why)
and its supervisor starts it again. While Redis itself is unreachable it waits: a new
process could not do better, and Celery reconnects by itself when Redis is back.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections.abc import Iterable
from typing import Any

import redis
from celery import bootsteps

from worker.context import studio_app

log = logging.getLogger("studio_code.worker")

#: the exit code of a worker whose consumer is stuck (EX_TEMPFAIL: try again)
EXIT_BROKER_LOST = 75
LOST = "broker connection lost"


class RoundTrips:
    """When each queue's consumer last heard from Redis (monotonic seconds), in this
    process; thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._at: dict[str, float] = {}

    def seen(self, queues: Iterable[str], *, at: float | None = None) -> None:
        """``queues``' consumer had an answer from Redis at ``at`` (monotonic; now). An
        older answer than the one known changes nothing."""
        now = time.monotonic() if at is None else at
        with self._lock:
            for queue in queues:
                self._at[str(queue)] = max(now, self._at.get(str(queue), now))

    def age_s(self, queue: str) -> float | None:
        """Seconds since the last round trip of ``queue``'s consumer; None: never seen."""
        with self._lock:
            at = self._at.get(queue)
        return None if at is None else time.monotonic() - at

    def queues(self) -> list[str]:
        """The queues whose consumers this process has seen."""
        with self._lock:
            return sorted(self._at)

    def forget(self) -> None:
        with self._lock:
            self._at.clear()


ROUND_TRIPS = RoundTrips()


def seen(queues: Iterable[str]) -> None:
    """A round trip of the consumer of ``queues`` just ended."""
    ROUND_TRIPS.seen(queues)


def lost_reason(queue: str, dead_after_s: float) -> str | None:
    """Why ``queue`` is not served (None while its consumer shows round trips). A queue
    this process never consumed has no reason: the watch only speaks for its consumers."""
    age = ROUND_TRIPS.age_s(queue)
    if age is None or age <= dead_after_s:
        return None
    return (
        f"{LOST}: the {queue} consumer has had no answer from Redis for {age:.0f} s "
        f"(STUDIO_REDIS_DEAD_AFTER_S={dead_after_s:g}); it reconnects by itself"
    )


def any_lost_reason(queues: Iterable[str], dead_after_s: float) -> str | None:
    for queue in sorted(queues):
        reason = lost_reason(queue, dead_after_s)
        if reason is not None:
            return reason
    return None


# --- the consumer's side ----------------------------------------------------------------------


def _channels(c: Any) -> list[Any]:
    try:
        cycle = c.connection.transport.cycle
    except AttributeError:
        return []
    return list(getattr(cycle, "_channels", ()))


def probe(c: Any, dead_after_s: float) -> None:
    """From the consumer's event loop, once a second: a PING for each consuming channel
    that has no BRPOP out (its slots are full) and no recent round trip, so a busy queue
    shows round trips too; then, when a queue's consumer has shown none for
    ``dead_after_s``, a connection error, which makes Celery drop the connection and
    connect again (its "Connection to broker lost" path)."""
    for channel in _channels(c):
        active = list(getattr(channel, "active_queues", ()) or ())
        if active:
            channel.studio_consumed = active
        # A channel whose consumers the gate cancelled (worker.upkeep.gate_watch: the store or the
        # runtime is down here) sends no BRPOP: it is PINGed, as a busy one is, so a pause
        # longer than dead_after_s is not taken for a silent connection (which would drop
        # the connection, and with it the acks of the jobs running, and let the watchdog
        # exit the worker after STUDIO_REDIS_GIVE_UP_S).
        queues = active or list(getattr(channel, "studio_consumed", ()) or ())
        if not queues:
            continue  # the control (pub/sub) channel: kombu checks it itself
        answered_at = float(getattr(channel, "answered_at", 0.0) or 0.0)
        if answered_at:
            ROUND_TRIPS.seen(queues, at=answered_at)
        age = max((ROUND_TRIPS.age_s(q) or 0.0) for q in queues)
        if age > dead_after_s:
            # its BRPOP's answer will never come: closing the channel must not wait for it
            pending, channel._in_poll = getattr(channel, "_in_poll", None), None
            if pending:
                pending.disconnect()
            raise redis.ConnectionError(
                f"{LOST}: the {','.join(queues)} consumer has had no answer from Redis for "
                f"{age:.0f} s (STUDIO_REDIS_DEAD_AFTER_S={dead_after_s:g}): connecting again"
            )
        try:
            asking = bool(active) and channel.qos.can_consume()
        except Exception:  # noqa: BLE001 - a closing channel
            continue
        if asking or age < dead_after_s / 2:
            continue  # its BRPOP (out, or sent at the next tick) is the round trip
        try:
            with channel.conn_or_acquire() as client:
                client.ping()
        except Exception as e:  # noqa: BLE001 - no round trip: the watch sees it age
            log.debug("broker watch: PING of %s failed: %s", ",".join(queues), e)
            continue
        seen(queues)


class BrokerWatchStep(bootsteps.StartStopStep):
    """Consumer step: marks the consumed queues seen when the consumer (re)connects and
    PINGs, once a second from the event loop, through channels that have no BRPOP out."""

    label = "studio broker watch"
    requires = ("celery.worker.consumer.tasks:Tasks",)

    def __init__(self, c: Any, **kwargs: Any) -> None:
        self._tref: Any = None
        super().__init__(c, **kwargs)

    def start(self, c: Any) -> None:
        from worker.context import consumed_queues

        seen(consumed_queues(c.app))
        app = studio_app(c.app)
        settings = app.settings if app is not None else None
        timer = getattr(c, "timer", None)
        if settings is not None and timer is not None and self._tref is None:
            self._tref = timer.call_repeatedly(1.0, probe, (c, settings.redis_dead_after_s))

    def stop(self, c: Any) -> None:
        if self._tref is not None:
            self._tref.cancel()
            self._tref = None

    def shutdown(self, c: Any) -> None:
        self.stop(c)


# --- the watchdog -----------------------------------------------------------------------------


def _redis_answers(settings: Any) -> bool:
    from worker import redis_conn

    client = redis_conn.client(settings)
    try:
        return bool(client.ping())
    except Exception:  # noqa: BLE001 - unreachable
        return False
    finally:
        client.close()


def _stopping() -> bool:
    from celery.worker import state

    return bool(state.should_stop or state.should_terminate)


class BrokerWatchdog:
    """A thread of the main process: exits the worker (EXIT_BROKER_LOST) when a consumed
    queue's consumer shows no round trip for ``give_up_s`` while Redis answers."""

    def __init__(self, settings: Any, queues: Iterable[str], give_up_s: float) -> None:
        self.settings = settings
        self.queues = sorted(queues)
        self.give_up_s = give_up_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="studio-broker-watch", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None

    def stale(self) -> tuple[str, float] | None:
        for queue in self.queues:
            age = ROUND_TRIPS.age_s(queue)
            if age is not None and age > self.give_up_s:
                return queue, age
        return None

    def _loop(self) -> None:
        while not self._stop.wait(1.0):
            found = self.stale()
            if found is None or _stopping():
                continue
            if not _redis_answers(self.settings):
                continue  # Redis is down: Celery reconnects when it is back
            if self._stop.is_set() or _stopping() or self.stale() is None:
                continue
            self.give_up(*found)

    def give_up(self, queue: str, age_s: float) -> None:
        line = {
            "event": "worker_exit",
            "code": "BROKER_CONSUMER_STUCK",
            "exit_code": EXIT_BROKER_LOST,
            "pid": os.getpid(),
            "queue": queue,
            "message": (
                f"The {queue} consumer has had no answer from Redis for {age_s:.0f} s "
                f"(STUDIO_REDIS_GIVE_UP_S={self.give_up_s:g}) while a new connection to "
                "Redis answers: it is stuck, so the worker exits for its supervisor to "
                "start it again (its jobs come back to the queue)."
            ),
        }
        text = json.dumps(line)
        log.critical("%s", text)
        try:
            sys.stderr.write(text + "\n")
            sys.stderr.flush()
        finally:
            os._exit(EXIT_BROKER_LOST)


class BrokerWatchdogStep(bootsteps.StartStopStep):
    """Worker step: runs the watchdog (STUDIO_REDIS_GIVE_UP_S; 0: off)."""

    label = "studio broker watchdog"

    def __init__(self, w: Any, **kwargs: Any) -> None:
        self.watchdog: BrokerWatchdog | None = None
        super().__init__(w, **kwargs)

    def start(self, w: Any) -> None:
        from worker.context import consumed_queues

        app = studio_app(w.app)
        settings = app.settings if app is not None else None
        if settings is None or not settings.redis_give_up_s or self.watchdog is not None:
            return
        self.watchdog = BrokerWatchdog(settings, consumed_queues(w.app), settings.redis_give_up_s)
        self.watchdog.start()

    def stop(self, w: Any) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None

    def shutdown(self, w: Any) -> None:
        self.stop(w)
