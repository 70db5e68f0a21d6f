"""Why this worker is not taking messages now: one gate, opened and closed by the main process.

A worker steps aside while it cannot do a job's work:

* **run_store**: the run store cannot be written (PostgreSQL down, SQLite locked or
  unwritable). A job could not be claimed, nor its result stored.
* **runtime**: no offered language can run here (Docker unreachable, every image missing).

While the gate is closed the worker's consumers are cancelled (Celery's task consumer for
``code.run`` and ``CodeTestConsumer`` for ``code.test``), so its messages stay in Redis for
workers that can serve them; readiness (``/healthz``) answers 503 with the reason; the
reason is logged at ERROR once when it starts and at WARNING when it ends.

Who decides: a thread of the main process (``GateWatch``) probes the store (a write probe)
and the runtime every STUDIO_QUEUE_PROBE_INTERVAL_S, and every second while closed or right
after a pool process reported a failure (``report``, through a page of shared memory made
before the pool forks). Consumers are only touched from the consumer's own event loop
(``GateStep``, worker/consumer/pause.py: a timer tick), never from the thread.
``pause_reason()`` is the plain callable the rest of the worker (health, heartbeats) reads.
The pool processes' side (the shared page, ``report``, ``closed_in_child``) is worker.gate.
"""

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from executor.errors import StoreUnavailable
from worker.gate import KINDS, RUN_STORE, RUNTIME, answered, gate, last_report, pause_reason
from worker.upkeep.loop import Supervised

log = logging.getLogger("studio_code.worker")

#: while closed, or after a report: how often the main process probes again
FAST_PROBE_S = 1.0


def gate_checks(settings: Any = None) -> dict[str, str | None]:
    """``paused``: why this worker is not taking jobs (run store unwritable, runtime down,
    with ``settings``: a consumer that lost its broker, worker.upkeep.broker_watch), None
    while it is. A paused worker's readiness answers 503 with this sentence."""
    from worker.upkeep import broker_watch

    reason = pause_reason()
    if reason is None and settings is not None:
        reason = broker_watch.any_lost_reason(
            broker_watch.ROUND_TRIPS.queues(), settings.redis_dead_after_s
        )
    return {"paused": reason}


def store_write_problem(store: Any) -> str | None:
    """None when the run store takes a write now, else a sentence naming it. A write probe:
    a store that answers reads but refuses writes (SQLite locked, read-only) is down too."""
    name = repr(store)
    try:
        engine = store.engine
        if engine.dialect.name == "sqlite":
            _sqlite_write_probe(engine)
        else:
            with engine.connect() as conn:
                conn.exec_driver_sql("SELECT 1")
        return None
    except StoreUnavailable as e:  # the store said it: its sentence names the store
        return e.message
    except Exception as e:  # noqa: BLE001 - any failure means "cannot write"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return (
            f"the run store {name} cannot be written ({first}): check the database "
            "(STUDIO_DATABASE_URL)"
        )


def _sqlite_write_probe(engine: Any) -> None:
    import sqlite3

    from executor.store.sqlite import no_fork_inside

    path = engine.url.database
    if not path or path == ":memory:":
        return
    # It takes the write lock: a pool process forked meanwhile would inherit it for good
    # (see executor/store/sqlite.py, ForkGate), so no fork while it runs.
    with no_fork_inside():
        conn = sqlite3.connect(path, timeout=2.0, isolation_level=None)
        try:
            conn.execute("BEGIN IMMEDIATE")  # the write lock: fails when locked or read-only
            conn.execute("CREATE TEMP TABLE IF NOT EXISTS studio_probe (x)")
            conn.execute("ROLLBACK")
        finally:
            conn.close()


def runtime_problem(executor: Any) -> str | None:
    """None when at least one offered language can run here, else why none can."""
    if executor.disabled_reason() or executor.runtime is None:
        return None  # jobs end INVALID/failed with their own message: nothing to wait for
    reasons = []
    for name in executor.settings.languages:
        try:
            reason = executor.runtime.unavailable_reason(executor.language(name))
        except Exception as e:  # noqa: BLE001
            reason = str(e)
        if reason is None:
            return None
        reasons.append(reason)
    if not reasons:
        return None
    return f"the {executor.runtime_name} runtime cannot run nodes: {reasons[0]}"


class GateWatch:
    """The main process's probing thread: closes and opens the gate, and writes the results
    that pool processes parked while the store was down (``flusher.flush``)."""

    def __init__(
        self,
        settings: Any,
        *,
        flush: Callable[[Any], int] | None = None,
        store: Any = None,
        executor: Any = None,
    ) -> None:
        """``store`` and ``executor``: the main process's (worker.upkeep.owner); without them
        the watch opens its own store (on its first probe) and builds its own executor."""
        from executor.service import Executor
        from executor.store import open_store

        self.settings = settings
        self.interval_s = float(getattr(settings, "queue_probe_interval_s", 5.0))
        self._open_store = lambda: open_store(settings.sqlalchemy_url)
        self._store: Any = store
        self._owns_store = store is None
        self.executor = executor if executor is not None else Executor(settings)
        self.flush = flush
        # its thread: restarted when the loop raises (worker.upkeep.loop)
        self._runner = Supervised("gate", self._loop)
        self._stop = self._runner.stopping
        self._seen = {k: last_report(k) for k in KINDS}

    def start(self) -> None:
        self._runner.start()

    def stop(self) -> None:
        self._runner.stop(15)
        if self._store is not None and self._owns_store:
            self._store.close()
            self._store = None

    def _loop(self, stop: threading.Event) -> None:
        next_probe = 0.0
        while not self._stop.is_set():
            now = time.monotonic()
            reported = any(last_report(k) > self._seen[k] for k in KINDS)
            if reported or now >= next_probe:
                self._seen = {k: last_report(k) for k in KINDS}
                try:
                    self.probe_once()
                except Exception:  # noqa: BLE001 - keep probing
                    log.exception("gate probe failed")
                for kind, reported_at in self._seen.items():
                    answered(kind, reported_at)  # the pool processes take jobs again
                closed = gate().reason() is not None
                next_probe = time.monotonic() + (FAST_PROBE_S if closed else self.interval_s)
            self._stop.wait(0.2)

    def probe_once(self) -> dict[str, str | None]:
        store_problem = self._probe_store()
        gate().set(RUN_STORE, store_problem)
        if store_problem is None and self.flush is not None:
            try:
                self.flush(self._store)
            except Exception as e:  # noqa: BLE001 - next probe tries again
                log.error("could not write parked results yet: %s", e)
        problem = runtime_problem(self.executor)
        gate().set(RUNTIME, problem)
        return {RUN_STORE: store_problem, RUNTIME: problem}

    def _probe_store(self) -> str | None:
        if self._store is None:
            try:
                self._store = self._open_store()
            except Exception as e:  # noqa: BLE001
                first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
                return (
                    f"the run store cannot be opened ({first}): check the database "
                    "(STUDIO_DATABASE_URL)"
                )
        return store_write_problem(self._store)
