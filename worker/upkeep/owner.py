"""The one owner of the worker's main-process upkeep: its one run store, one Redis client,
one runtime (through one Executor) and one parked-result flusher, and the loops that use them:
the gate's probe (worker.upkeep.gate_watch), the janitor (worker.upkeep.janitor: reaper, queued
sweep, retention; its revoke backstop runs on Celery's ``task_revoked``) and the release of
fair-share runs into code.run (worker.fair.release_loop); the engine's posture is read through
the same runtime (worker.upkeep.engine_watch).

``UpkeepStep`` is the worker step that builds it once the pool runs and stops it at shutdown.
The heartbeat stays a consumer step (it follows the broker connection: announced when the task
consumer exists, withdrawn when it stops).
"""

from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, cast

from celery import bootsteps, signals

from executor.errors import StoreUnavailable
from executor.service import Executor
from executor.settings import Settings
from executor.store import RunStore, open_store
from worker import redis_conn
from worker.context import studio_app
from worker.fair import FairQueue, release_loop
from worker.upkeep.engine_watch import EngineWatch
from worker.upkeep.flusher import Flusher
from worker.upkeep.gate_watch import GateWatch
from worker.upkeep.janitor import Janitor, guard_terminate
from worker.upkeep.loop import Supervised

log = logging.getLogger("studio_code.worker")


class StoreWhenUp:
    """The main process's run store, opened when it can be: a worker that starts while its
    store is down (PostgreSQL not up yet, a read-only or missing data folder) starts all the
    same, paused by the gate's probe, instead of exiting. Until the store opens every call
    raises the StoreUnavailable that ``open_store`` raised (each call tries again, at most
    once a second); then it is the store itself, and ``on_open`` hears its id."""

    RETRY_S = 1.0

    def __init__(self, url: str) -> None:
        self._url = url
        self._store: RunStore | None = None
        self._error: StoreUnavailable | None = None
        self._tried_at = -math.inf
        self._lock = threading.Lock()
        self.on_open: Callable[[str], None] | None = None
        try:
            self._get()
        except StoreUnavailable:
            pass  # logged; the gate's probe pauses the worker until it opens

    def _get(self) -> RunStore:
        with self._lock:
            if self._store is not None:
                return self._store
            if self._error is not None and time.monotonic() - self._tried_at < self.RETRY_S:
                raise self._error
            self._tried_at = time.monotonic()
            try:
                store = open_store(self._url)
                store_id = store.store_id
            except StoreUnavailable as e:
                if self._error is None:
                    log.error("run store: %s; the worker waits for it, paused", e.message)
                self._error = e
                raise
            self._store, self._error = store, None
        log.info("run store: %s (store id %s)", store.describe(), store_id)
        if self.on_open is not None:
            self.on_open(store_id)
        return store

    @property
    def opened(self) -> bool:
        return self._store is not None

    @property
    def last_error(self) -> str:
        return self._error.message if self._error is not None else "no error"

    @property
    def store_id(self) -> str:
        try:
            return self._get().store_id
        except StoreUnavailable:
            return ""

    def describe(self) -> str:
        from executor.store import describe_url

        return describe_url(self._url)

    def close(self) -> None:
        with self._lock:
            store, self._store = self._store, None
        if store is not None:
            store.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._get(), name)

    def __repr__(self) -> str:
        return f"StoreWhenUp({self.describe()!r})"


class Upkeep:
    """The main process's resources and loops (see the module doc)."""

    def __init__(self, settings: Settings, nodename: str, app: Any) -> None:
        self.settings = settings
        self.redis = redis_conn.client(settings)
        # Its runtime serves the gate's probe, the reaper and the revoke backstop; it is
        # never prepared here (no pre-started sandboxes in the main process).
        self.executor = Executor(settings)
        self.late_store = StoreWhenUp(settings.sqlalchemy_url)
        self.store = cast(RunStore, self.late_store)
        self.flusher = Flusher(self.redis)
        self.gate = GateWatch(
            settings, flush=self.flusher, store=self.store, executor=self.executor
        )
        # the engine's posture, through the same runtime (the heartbeat announces it)
        self.engine = EngineWatch(self.executor.runtime)
        self.janitor = Janitor(
            settings,
            nodename,
            app,
            store=self.store,
            runtime=self.executor.runtime,
            redis_client=self.redis,
            flush=self.flusher,
        )
        self.fair_release = Supervised(
            "fair-release", release_loop(FairQueue.of(self.redis, settings, settings.worker_group))
        )

    def start(self) -> None:
        try:
            self.gate.probe_once()  # a worker that starts with its store down waits
        except Exception:  # noqa: BLE001
            log.exception("first gate probe failed")
        self.engine.posture()  # its WARNING, when an escape applies, is part of the start-up
        self.gate.start()
        self.janitor.start()
        self.fair_release.start()

    def stop(self) -> None:
        self.fair_release.stop(10)
        self.janitor.stop()
        self.gate.stop()
        self.store.close()
        self.redis.close()


class UpkeepStep(bootsteps.StartStopStep):
    """Worker step: starts the main process's upkeep once the pool runs, stops it at
    shutdown; the store id goes to the worker context (the heartbeat announces it)."""

    label = "studio upkeep"
    requires = ("celery.worker.components:Pool",)

    def __init__(self, w: Any, **kwargs: Any) -> None:
        self.upkeep: Upkeep | None = None
        super().__init__(w, **kwargs)

    def create(self, w: Any) -> None:
        return None

    def start(self, w: Any) -> None:
        app = studio_app(w.app)
        if app is None or self.upkeep is not None:
            return
        self.upkeep = Upkeep(app.settings, w.hostname, app)
        context = app.context
        self.upkeep.late_store.on_open = lambda store_id: setattr(context, "store_id", store_id)
        context.store_id = self.upkeep.store.store_id
        context.engine = self.upkeep.engine.announcement
        if w.pool is not None and hasattr(w.pool, "terminate_job"):
            guard_terminate(w.pool, self.upkeep.store)
        signals.task_revoked.connect(self.upkeep.janitor.on_revoked, weak=False)
        self.upkeep.start()
        wait_s = app.settings.queue_store_start_wait_s
        if not self.upkeep.late_store.opened and wait_s > 0:
            threading.Thread(
                target=self._stop_unless_opened,
                args=(self.upkeep.late_store, context, wait_s),
                name="studio-store-start-wait",
                daemon=True,
            ).start()

    @staticmethod
    def _stop_unless_opened(store: StoreWhenUp, context: Any, wait_s: float) -> None:
        """A store that never opens within STUDIO_QUEUE_STORE_START_WAIT_S (a wrong URL, a
        database that is not there) stops the worker with an error: its supervisor restarts
        it and its log says why, instead of a worker paused for good."""
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            if store.opened:
                return
            time.sleep(min(1.0, wait_s))
        try:
            store.store_id  # noqa: B018 - one last try
        except StoreUnavailable:
            pass
        if store.opened:
            return
        context.fatal = (
            f"the run store could not be opened within STUDIO_QUEUE_STORE_START_WAIT_S="
            f"{wait_s:g} s of the worker's start ({store.last_error}): check "
            "STUDIO_DATABASE_URL (or STUDIO_DATA_DIR) and that the database is up"
        )
        log.critical("stopping: %s", context.fatal)
        os.kill(os.getpid(), signal.SIGTERM)

    def stop(self, w: Any) -> None:
        if self.upkeep is not None:
            signals.task_revoked.disconnect(self.upkeep.janitor.on_revoked)
            self.upkeep.stop()
            self.upkeep = None

    def shutdown(self, w: Any) -> None:
        self.stop(w)
