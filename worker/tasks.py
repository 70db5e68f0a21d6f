"""The one task, kept thin: claim the job in the run store, run it with the executor, store
the result. Everything it needs per pool process is built once, in ``worker_process_init``.

Cancel, as seen from a pool process: ``api_client.cancel`` marks the job in the run store
and sets its Redis flag, then revokes it with ``terminate=True, signal=SIGUSR2``. Celery
sends that signal to the pid that took the job, which may by then run ANOTHER job (the
known terminate race). So the signal never kills anything here: the handler only raises a
flag, and the job that is running reads its OWN cancel state (``CancelWatch``); a signal
meant for an earlier job changes nothing. The watch also polls the Redis flag every ~100 ms,
so a revoke lost on the pub/sub channel (a worker that was disconnected, or started after
it) cancels all the same, and a job cancelled while queued is never started: ``claim``
returns None.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import redis
from celery import Celery, Task, current_app, signals

from executor.errors import ErrorCode
from executor.models import CodeJob, CodeResult, Status
from executor.service import Executor
from executor.settings import Settings
from executor.store import JobRecord, RunStore, open_store
from worker import metrics, unrunnable
from worker.cancel import CancelWatch
from worker.live_logs import publishing
from worker.outcomes import NodeFailed, report_outcome
from worker.protocol import (
    CANCEL_SIGNAL,
    DONE_TTL_S,
    MAX_ATTEMPTS,
    QUEUE_RUN,
    TASK_NAME,
    done_key,
)

log = logging.getLogger("studio_code.worker")

FINISH_RETRIES_S = (0.2, 1.0, 3.0)


class ProcessState:
    """What one pool process keeps between jobs: the store, the executor (with the store as
    its audit sink), a Redis client for cancel flags and done notices."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store: RunStore = open_store(settings.sqlalchemy_url)
        self.executor = Executor(settings, audit=self.store)
        # Short timeouts: the cancel flag is read inside the sandbox's poll loop.
        self.redis = redis.Redis.from_url(
            settings.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5
        )
        self.pid = os.getpid()
        self.current_job: str | None = None
        self._signalled = False

    def on_cancel_signal(self, signum: int, frame: Any) -> None:
        # Runs in the main thread between two bytecodes of whatever it was doing: no I/O
        # (it may be inside a Redis or SQL call on the very clients a check would use) and
        # no lock (it may hold it). A plain attribute store is atomic.
        self._signalled = True

    def take_signal(self) -> bool:
        """True once after a cancel signal (a hint only: a lost one is caught by polling)."""
        if self._signalled:
            self._signalled = False
            return True
        return False

    def watch(self, job_id: str) -> CancelWatch:
        return CancelWatch(job_id, store=self.store, client=self.redis, nudged=self.take_signal)

    def notify_done(self, job_id: str) -> None:
        """Wake ``CodeClient.wait``: one item per time the task body ended for the job."""
        try:
            pipe = self.redis.pipeline()
            pipe.rpush(done_key(job_id), "1")
            pipe.expire(done_key(job_id), DONE_TTL_S)
            pipe.execute()
        except redis.RedisError as e:
            log.warning("could not announce the end of job %s (waiters poll the store): %s",
                        job_id, e)

    def close(self) -> None:
        self.executor.close()  # idle pre-started sandboxes go with the process
        self.store.close()
        self.redis.close()


_state: ProcessState | None = None
_state_lock = threading.Lock()


def process_state(app: Celery) -> ProcessState:
    """This process's state, built by worker_process_init (or on first use, e.g. under
    ``--pool solo``)."""
    global _state
    with _state_lock:
        if _state is None or _state.pid != os.getpid():
            settings: Settings = app.studio_settings  # type: ignore[attr-defined]
            _state = ProcessState(settings)
            try:
                signal.signal(CANCEL_SIGNAL, _state.on_cancel_signal)
            except ValueError:  # not the main thread (threads pool): polling still works
                pass
        return _state


def _on_process_init(**_: Any) -> None:
    app = current_app._get_current_object()
    if getattr(app, "studio_settings", None) is None:
        return
    state = process_state(app)
    try:
        # Connect now, not in the first job, and pre-start this slot's sandboxes.
        state.executor.prepare(observe=lambda stats: _metrics(metrics.record_pool, stats))
    except Exception as e:  # noqa: BLE001 - the first job reports it as its result
        log.warning("the runtime could not get ready at process start: %s", e)


def _on_process_shutdown(**_: Any) -> None:
    global _state
    if _state is not None and _state.pid == os.getpid():
        _state.close()
        _state = None


_connected = False


def connect_process_signals() -> None:
    global _connected
    if not _connected:
        signals.worker_process_init.connect(_on_process_init, weak=False)
        signals.worker_process_shutdown.connect(_on_process_shutdown, weak=False)
        _connected = True


def register(app: Celery) -> None:
    """Add the task to ``app`` (a worker's app)."""
    app.task(
        name=TASK_NAME,
        bind=True,
        acks_late=True,
        reject_on_worker_lost=True,
        ignore_result=True,
        # Never retried by Celery: a job either ran (result in the store) or did not.
        max_retries=0,
        throws=(NodeFailed,),  # a failed node is an expected outcome, not a worker error
    )(run_job)


def run_job(task: Task, job_id: str) -> str:
    """Run job ``job_id`` (its code and state are in the run store). Returns what happened,
    for the worker's log: ``finished``, ``duplicate`` or ``skipped``."""
    state = process_state(task.app)
    request = task.request
    worker = f"{request.hostname}:{os.getpid()}"
    queue = (request.delivery_info or {}).get("routing_key") or QUEUE_RUN
    try:
        outcome = _run(state, job_id, worker, queue, request)
    finally:
        state.notify_done(job_id)
    report_outcome(state.store, job_id)  # failed: NodeFailed, cancelled: Ignore (Celery's view)
    return outcome


def _run(state: ProcessState, job_id: str, worker: str, queue: str,
         request: Any = None) -> str:
    rec = state.store.claim(job_id, worker)
    if rec is None:
        # Unknown, cancelled while queued, or already finished (a redelivery): nothing to do.
        if _cancelled_before_start(state, job_id):
            _metrics(metrics.record_cancel, stage="queued")
        elif unrunnable.unknown_job(state.store, state.redis, job_id, request, worker):
            return "unknown"
        return "skipped"
    if rec.problems:
        log.error("job %s: its row cannot be read: %s", job_id, "; ".join(rec.problems))
        result = _result(rec, state.settings, Status.FAILED, ErrorCode.RUNTIME_UNAVAILABLE,
                         unrunnable.unreadable_message(rec))
        return _finish(state, result, rec, worker, queue)
    if rec.attempts > MAX_ATTEMPTS:
        result = _result(
            rec, state.settings, Status.FAILED, ErrorCode.RUNTIME_UNAVAILABLE,
            f"The job was started {rec.attempts - 1} times and each time its worker stopped "
            "before it ended, so it was not started again: check the workers' logs (memory, "
            "crashes), then run it again.")
        return _finish(state, result, rec, worker, queue)
    job = CodeJob(
        job_id=rec.job_id, language=rec.language, code=rec.code, state_json=rec.state_json,
        timeout_s=rec.timeout_s, kind=rec.kind, user=rec.user,
        memory_bytes=rec.memory_bytes, cpus=rec.cpus,
    )
    watch = state.watch(job_id)
    state.current_job = job_id
    state.take_signal()  # a signal that came before this job was meant for another one
    try:
        if watch():
            result = _result(rec, state.settings, Status.CANCELLED, ErrorCode.CODE_CANCELLED,
                             "Cancelled before its sandbox started.")
        else:
            with _metrics_context(metrics.sandbox_running, job.language), \
                    publishing(state.redis, job_id):  # live logs, flushed before finish
                result = state.executor.run(job, should_cancel=watch)
    except Exception as e:  # noqa: BLE001 - the executor never raises for the job itself
        log.exception("job %s: the worker failed around the executor", job_id)
        result = _result(rec, state.settings, Status.FAILED, ErrorCode.RUNTIME_UNAVAILABLE,
                         f"The worker failed to run the job ({e}); run it again.")
    finally:
        state.current_job = None
    if watch.cancelled_at is not None:
        _metrics(metrics.record_cancel, time.monotonic() - watch.cancelled_at, stage="running")
    return _finish(state, result, rec, worker, queue)


def _finish(state: ProcessState, result: CodeResult, rec: JobRecord, worker: str,
            queue: str) -> str:
    for delay in (*FINISH_RETRIES_S, None):
        try:
            wrote = state.store.finish(result, worker=worker)
            break
        except Exception as e:
            if delay is None:
                raise  # the job stays running; the reaper's fail_stuck ends it
            log.warning("job %s: storing the result failed (%s), retrying", rec.job_id, e)
            time.sleep(delay)
    if not wrote:
        return "duplicate"
    wait_s = None
    if rec.started_at is not None:
        wait_s = (rec.started_at - rec.queued_at).total_seconds()
    _metrics(metrics.record_result, result, wait_s, queue=queue)
    return "finished"


def _cancelled_before_start(state: ProcessState, job_id: str) -> bool:
    try:
        rec = state.store.get(job_id)
    except Exception:  # noqa: BLE001
        return False
    return rec is not None and rec.status is Status.CANCELLED and rec.started_at is None


def _result(rec: JobRecord, settings: Settings, status: Status, code: ErrorCode,
            message: str) -> CodeResult:
    return CodeResult.ended(rec.job_id, rec.language, status, code, message,
                            runtime=settings.code_runtime)


# --- metrics, never allowed to break a job --------------------------------------------------


def _metrics(hook: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    try:
        hook(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a metric is never worth a job
        log.warning("metrics hook %s failed: %s", hook.__name__, e)


def _metrics_context(hook: Callable[..., AbstractContextManager[Any]],
                     *args: Any) -> AbstractContextManager[Any]:
    try:
        return hook(*args)
    except Exception as e:  # noqa: BLE001
        log.warning("metrics hook %s failed: %s", hook.__name__, e)
        return nullcontext()
