"""The worker's consumer starts only once its pool processes have started (worker.pool_start
says why): a worker step between Celery's pool and its consumer (Celery starts the consumer
last). A pool process that has not said so within STUDIO_QUEUE_POOL_START_TIMEOUT_S stops
the worker with an error naming it, for its supervisor to start it again; it was never
announced (no heartbeat, no ping), so the API never counted it as serving."""

from __future__ import annotations

import logging
import os
import signal
import time
from typing import Any

from celery import bootsteps
from celery.exceptions import WorkerTerminate

from worker.context import studio_app
from worker.pool_start import started_pids

log = logging.getLogger("studio_code.worker")

POLL_S = 0.05


def starting(pool: Any) -> list[int]:
    """The pids of a prefork pool's live processes that have not said they started ([] for
    another pool: solo, threads). One that died is not waited for: Celery forks another
    once its loop runs, and watches that one (worker_proc_alive_timeout)."""
    procs = getattr(getattr(pool, "_pool", None), "_pool", None) or []
    done = started_pids()
    return sorted(p.pid for p in procs if p.pid and p.pid not in done and p.is_alive())


class PoolStartStep(bootsteps.StartStopStep):
    label = "studio pool start"
    requires = ("celery.worker.components:Pool",)

    def create(self, w: Any) -> None:
        return None

    def start(self, w: Any) -> None:
        app = studio_app(w.app)
        if app is None or w.pool is None:
            return
        timeout_s = app.settings.queue_pool_start_timeout_s
        deadline = time.monotonic() + timeout_s
        while True:
            waiting = starting(w.pool)
            if not waiting:
                return
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_S)
        reason = (
            f"pool process(es) {', '.join(map(str, waiting))} did not start within "
            f"STUDIO_QUEUE_POOL_START_TIMEOUT_S={timeout_s:g} s (opening the run store, "
            "connecting the runtime, pre-starting sandboxes): the worker stops before it "
            "takes any job; see its log for what the pool process was doing"
        )
        app.context.fatal = reason
        log.critical("stopping: %s", reason)
        for pid in waiting:  # stuck: a warm stop would wait for them for ever
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        w.exitcode = 1  # what `celery worker` exits with (a cold stop sets none)
        raise WorkerTerminate(1)
