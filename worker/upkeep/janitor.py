"""The worker's main process: what it cleans up that its pool processes could not.

* **Reaper**, at start and every STUDIO_QUEUE_REAP_INTERVAL_S: ``runtime.reap()`` removes
  sandboxes labelled with THIS host whose owner process (``studio.owner`` = host:pid) is
  dead - a worker or a pool process killed mid-job or with idle pre-started sandboxes - and
  any sandbox past its ``studio.deadline`` (its owner should have removed it by then,
  wherever it runs). Then ``store.fail_stuck`` ends jobs
  still ``running`` long after their timeout, once redelivery had its chance: no job stays
  running forever.
* **Revoke backstop**: on Celery's ``task_revoked`` (this process, for a job it holds) it
  waits a moment for the pool process to stop the sandbox itself, then kills whatever is
  still labelled with the job id, and ends the job ``cancelled`` if nobody did.
* **Terminate guard**: Celery's terminate marks the signalled pool process as "terminated
  by us" in billiard's bookkeeping. Our cancel signal never ends the process, so that
  mark would stay and mislabel a later, real crash of the process (its job would be
  treated as revoked and not redelivered). The cancel signal is therefore sent plainly.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any, Literal

import redis

from executor.errors import ErrorCode, StoreUnavailable
from executor.models import CodeResult, Status
from executor.runtimes.base import Runtime
from executor.runtimes.constants import KILL_GRACE_S
from executor.service import make_runtime
from executor.settings import Settings
from executor.store import RunStore, open_store
from worker import redis_conn
from worker.outcomes import cancel_on_terminate
from worker.protocol import CANCEL_SIGNAL, stuck_after_s
from worker.upkeep.flusher import Flusher
from worker.upkeep.loop import Supervised
from worker.upkeep.queued import QueuedSweep
from worker.upkeep.retention import apply_retention
from worker.upkeep.retry_due import send_due

log = logging.getLogger("studio_code.worker")

#: how long the pool process gets to stop a cancelled job's sandbox before the backstop
BACKSTOP_DELAY_S = 2.0


class Janitor:
    """Reaper thread + revoke backstop of one worker (its main process)."""

    def __init__(
        self,
        settings: Settings,
        nodename: str,
        app: Any = None,
        *,
        store: RunStore | None = None,
        runtime: Runtime | None | Literal["own"] = "own",
        redis_client: redis.Redis | None = None,
        flush: Callable[[RunStore], int] | None = None,
    ) -> None:
        """``store``, ``runtime``, ``redis_client`` and ``flush``: the main process's
        (worker.upkeep.owner); without them the janitor opens and closes its own."""
        self.settings = settings
        self.nodename = nodename
        self.host = socket.gethostname()
        self.runtime = make_runtime(settings) if runtime == "own" else runtime
        self._owns_store = store is None
        self.store: RunStore = store if store is not None else open_store(settings.sqlalchemy_url)
        if self._owns_store:
            log.info("run store: %s (store id %s)", self.store.describe(), self.store.store_id)
        self._own_redis: redis.Redis | None = None
        if redis_client is None:
            redis_client = self._own_redis = redis_conn.client(settings)
        self.flush = flush if flush is not None else Flusher(redis_client)
        self.queued = (
            QueuedSweep(settings, self.store, app, nodename, client=redis_client)
            if app is not None
            else None
        )
        # its thread: restarted when the loop raises (worker.upkeep.loop)
        self._runner = Supervised("reaper", self._loop)
        self._stop = self._runner.stopping
        #: the retries whose delay passed, sent every STUDIO_QUEUE_RETRY_TICK_S (its own
        #: thread: the reaper's pass may take seconds)
        self.app = app
        self._retries = Supervised("retry-due", self._retry_loop) if app is not None else None

    # --- reaper ------------------------------------------------------------------------

    def start(self) -> None:
        self._runner.start()
        if self._retries is not None:
            self._retries.start()

    def stop(self) -> None:
        if self._retries is not None:
            self._retries.stop(10)
        self._runner.stop(30)
        if self._own_redis is not None:
            self._own_redis.close()
        if self._owns_store:
            self.store.close()

    def _loop(self, stop: threading.Event) -> None:
        while not self._stop.is_set():
            try:
                self.sweep()
            except StoreUnavailable as e:  # the gate says it (paused); no traceback a second
                log.warning("reaper sweep waits for the run store: %s", e.message)
            except Exception:  # noqa: BLE001 - keep sweeping
                log.exception("reaper sweep failed")
            self._stop.wait(self.settings.queue_reap_interval_s)

    def _retry_loop(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                send_due(self.store, self.app, self.settings)
            except StoreUnavailable as e:
                log.warning("retry sweep waits for the run store: %s", e.message)
            except Exception:  # noqa: BLE001 - keep sweeping (the lost-message sweep backs it)
                log.exception("retry sweep failed")
            stop.wait(self.settings.queue_retry_tick_s)

    def sweep(self) -> dict[str, list[str]]:
        """One pass: orphaned/overdue sandboxes removed, stuck jobs failed."""
        reaped = self.reap_sandboxes()
        # Results parked while the store was down are written first: their jobs are still
        # ``running`` and must end with their real outcome, not "worker stopped".
        self._flush_parked()
        # A job whose worker died mid-run may still have its message in the broker (put back
        # at the END of a long queue): it will run again to its real outcome, so it is not
        # stuck. Without a broker reading, nothing is kept back (fail_stuck as before).
        in_broker = self.queued.in_broker() if self.queued is not None else None
        failed = self.store.fail_stuck(
            stuck_after_s(self.settings),
            reason="The worker running this job stopped before the job ended and the job "
            "was not picked up again: run it again.",
            default_timeout_s=self.settings.code_max_seconds,
            keep=in_broker or (),
        )
        if failed:
            log.warning("reaper: jobs stuck running ended failed: %s", ", ".join(failed))
        apply_retention(self.store, self.settings)
        out = {"reaped": reaped, "failed": failed}
        if self.queued is not None:
            out.update(self.queued.run())
        return out

    def _flush_parked(self) -> None:
        written = self.flush(self.store)
        if written:
            log.warning("reaper: wrote %d result(s) kept while the store was down", written)

    def reap_sandboxes(self) -> list[str]:
        """Remove sandboxes whose owner on this host is dead or whose deadline passed
        (pre-started ones included): the runtime knows how; returns what it removed."""
        if self.runtime is None:
            return []
        return self.runtime.reap()

    # --- revoke backstop ---------------------------------------------------------------

    def on_revoked(self, sender: Any = None, request: Any = None, **_: Any) -> None:
        job_id = getattr(request, "id", None)
        if not job_id:
            return
        timer = threading.Timer(BACKSTOP_DELAY_S, self._backstop, args=(job_id,))
        timer.daemon = True
        timer.start()

    def _backstop(self, job_id: str) -> None:
        try:
            if not self.store.is_cancel_requested(job_id):
                return  # not our cancel (a revoke by hand): the job keeps running
            if self.runtime is not None and self.runtime.kill(job_id):
                log.warning(
                    "backstop: removed the sandbox of cancelled job %s (its pool process had not)",
                    job_id,
                )
            deadline = time.monotonic() + KILL_GRACE_S
            while time.monotonic() < deadline:
                rec = self.store.get(job_id, inputs=False)
                if rec is None or rec.finished:
                    return
                time.sleep(0.5)
            rec = self.store.get(job_id, inputs=False)
            if rec is None or rec.finished:
                return
            if rec.worker and not rec.worker.startswith(f"{self.nodename}:"):
                return  # another worker holds it; its own backstop or fail_stuck ends it
            self.store.finish(
                CodeResult.ended(
                    job_id,
                    rec.language,
                    Status.CANCELLED,
                    ErrorCode.CODE_CANCELLED,
                    "Cancelled while running.",
                    runtime=self.settings.code_runtime,
                ),
                worker=f"{self.nodename}:backstop",
            )
            log.warning("backstop: ended cancelled job %s (its pool process did not)", job_id)
        except Exception:  # noqa: BLE001
            log.exception("backstop for job %s failed", job_id)


def guard_terminate(pool: Any, store: RunStore | None = None) -> None:
    """Send the cancel signal without billiard's "terminated" bookkeeping (see above); with
    ``store``, any other terminate of a process running a job is carried out as a cancel
    (worker.outcomes.cancel_on_terminate)."""
    original = pool.terminate_job

    def terminate_job(pid: int, signal: Any = None) -> Any:
        if (
            signal is not None
            and int(signal) != int(CANCEL_SIGNAL)
            and store is not None
            and cancel_on_terminate(store, pid, int(signal))
        ):
            return None
        if signal is not None and int(signal) == int(CANCEL_SIGNAL):
            try:
                os.kill(pid, int(signal))
            except ProcessLookupError:
                pass
            return None
        return original(pid, signal)

    pool.terminate_job = terminate_job
