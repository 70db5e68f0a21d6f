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
from typing import Any, NamedTuple, NoReturn

import redis
from celery import Celery, Task, current_app, signals
from celery.exceptions import Reject, Terminated

from executor import tracing
from executor.errors import ErrorCode, StoreUnavailable
from executor.models import CodeResult, Status
from executor.service import Executor
from executor.settings import Settings
from executor.store import Claim, Ended, JobRecord, RunStore, open_store
from worker import fair, gate, metrics, parked, poison, pool_start, preimport, redis_conn
from worker import tracing as worker_tracing
from worker.cancel import CancelWatch
from worker.context import studio_app
from worker.job import forked, pending, rerun, retries, unrunnable
from worker.job.log_publisher import add_end_mark, publishing
from worker.outcomes import NodeFailed, report_outcome
from worker.protocol import (
    CANCEL_SIGNAL,
    MAX_ATTEMPTS,
    QUEUE_RUN,
    TASK_NAME,
    add_done_notice,
    cancel_key,
)

log = logging.getLogger("studio_code.worker")

#: a pool process that hands a message back waits this long first (see _hand_back)
HAND_BACK_PAUSE_S = 1.0


class ProcessState:
    """What one pool process keeps between jobs: the store, the executor (with the store as
    its audit sink), a Redis client for cancel flags and done notices."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.store: RunStore = open_store(settings.sqlalchemy_url)
        self.executor = Executor(settings, audit=self.store)
        # Short timeouts: the cancel flag is read inside the sandbox's poll loop.
        self.redis = redis_conn.client(settings, socket_timeout=0.5, socket_connect_timeout=0.5)
        #: this process frees a user's cap slot and releases the next runs at a job's end
        self.fair = fair.FairQueue.of(self.redis, settings, settings.worker_group)
        self.pid = os.getpid()
        self.current_job: str | None = None
        #: the job that ran owes its live-logs stream the end mark (sent by end_job)
        self.owes_end_mark = False
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

    def watch(self, job_id: str, flagged: bool | None = None) -> CancelWatch:
        return CancelWatch(
            job_id, store=self.store, client=self.redis, nudged=self.take_signal, flagged=flagged
        )

    def start_reads(self, job_id: str) -> tuple[Any, bool, list[dict[str, Any]]]:
        """The job's start in one round trip: its parked result (if a run before this one
        parked it), its cancel flag and its attempts the infrastructure lost (worker.job.
        rerun). Raises redis.RedisError."""
        pipe = self.redis.pipeline(transaction=False)
        parked.add_lookup(pipe, job_id)
        pipe.exists(cancel_key(job_id))
        rerun.add_lookup(pipe, job_id)
        found, flagged, lost = pipe.execute()
        return found, bool(flagged), rerun.decode(lost)

    def end_job(
        self,
        job_id: str,
        *,
        done: bool,
        fair_end: bool,
        record: JobRecord | None = None,
        paused: bool = False,
    ) -> None:
        """The job's end in one round trip: the live-logs end mark (owed by ``publishing``
        with ``end_mark=False``), the done notice that wakes ``CodeClient.wait`` (one item
        per time the task body ended for the job) and the fair queue's end (frees the
        user's cap slot and releases the next runs into code.run, so the slot this frees
        finds a message); ``record``: the finished record this run wrote, which the notice
        carries to the waiters (worker.protocol.notice_item); ``paused``: the attempt ended
        and the next one waits out a retry's delay (its slot is freed, its lane kept for the
        next attempt's message: worker.fair, ``pause``). Never raises: waiters poll
        the store, the workers' release loop and the sweep's reconcile catch up."""
        end_mark, self.owes_end_mark = self.owes_end_mark, False
        if not (end_mark or done or fair_end):
            return
        pipe = self.redis.pipeline(transaction=False)
        if end_mark:
            add_end_mark(pipe, job_id)
        if done:
            add_done_notice(pipe, job_id, record)
        if fair_end:
            self.fair.add_ended(pipe, [job_id], paused=paused)
        try:
            replies = pipe.execute(raise_on_error=False)
        except redis.RedisError as e:
            log.warning(
                "could not announce the end of job %s (waiters poll the store): %s", job_id, e
            )
            return
        if fair_end and isinstance(replies[-1], redis.exceptions.NoScriptError):
            # this Redis has not seen the script: load it
            fair.job_ended(self.fair, job_id, paused=paused)
            replies = replies[:-1]
        failed = [r for r in replies if isinstance(r, Exception)]
        if failed:
            log.warning("the end of job %s was not all announced: %s", job_id, failed[0])

    def close(self) -> None:
        self.executor.close()  # idle pre-started sandboxes go with the process
        self.store.close()
        self.redis.close()


class Outcome(NamedTuple):
    """What one run of the task body did: ``name`` for the worker's log (see run_job);
    when this run stored the job's result, what that finish wrote (``report_outcome`` tells
    Celery from it, without reading the row back); ``fair_end``: whether it ends the job for
    the fair queue (after its result is stored, before its message is acknowledged): a
    delivery the claim skipped because the job has not ended (still running elsewhere, a
    retry's attempt before its time) frees nothing."""

    name: str
    ended: Ended | None = None
    fair_end: bool = True


_state: ProcessState | None = None
_state_lock = threading.Lock()


def process_state(app: Celery) -> ProcessState:
    """This process's state, built by worker_process_init (or on first use, e.g. under
    ``--pool solo``)."""
    global _state
    with _state_lock:
        if _state is None or _state.pid != os.getpid():
            ours = studio_app(app)
            if ours is None:
                raise RuntimeError(
                    f"the task runs under {app!r}, not the studio's app: start workers with "
                    "`studio-code worker` or `celery -A worker worker`"
                )
            _state = ProcessState(ours.settings)
            try:
                signal.signal(CANCEL_SIGNAL, _state.on_cancel_signal)
            except ValueError:  # not the main thread (threads pool): polling still works
                pass
        return _state


def _on_process_init(**_: Any) -> None:
    app = studio_app(current_app._get_current_object())
    if app is None:
        return
    try:
        _start_process(app)
    finally:  # its errors are its first job's to report: it did start
        pool_start.mark_started()


def _start_process(app: Any) -> None:
    forked.release_inherited_sockets()  # before this process makes any of its own
    try:
        state = process_state(app)
    except StoreUnavailable as e:
        # the first job tries again (and hands its message back while the store is down)
        gate.report(gate.RUN_STORE, f"the pool process cannot open the run store: {e}")
        log.warning("the run store could not be opened at process start: %s", e)
        return
    try:
        # Connect now, not in the first job, and pre-start this slot's sandboxes.
        state.executor.prepare(observe=_observe_pool)
    except Exception as e:  # noqa: BLE001 - the first job reports it as its result
        log.warning("the runtime could not get ready at process start: %s", e)


def _observe_pool(stats: dict[str, Any] | None) -> None:
    """The pool's observer: its gauges, and its pre-import memory for the worker's heartbeat
    (worker/preimport.py)."""
    _metrics(metrics.record_pool, stats)
    preimport.report(stats)


def _on_worker_init(**_: Any) -> None:
    forked.note_main_process()  # the main process, before its pool processes are forked


def _on_process_shutdown(**_: Any) -> None:
    global _state
    if _state is not None and _state.pid == os.getpid():
        _state.close()
        _state = None


_connected = False


def connect_process_signals() -> None:
    global _connected
    if not _connected:
        signals.worker_init.connect(_on_worker_init, weak=False)
        signals.worker_process_init.connect(_on_process_init, weak=False)
        signals.worker_process_shutdown.connect(_on_process_shutdown, weak=False)
        worker_tracing.connect()  # only when the OTEL_* variables ask for traces
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
        # a failed or cancelled node is an expected outcome, not a worker error
        throws=(NodeFailed, Terminated),
    )(run_job)


def run_job(task: Task, *args: Any, **kwargs: Any) -> str:
    """The task: ``_run_job`` in the job's trace span (when the worker traces)."""
    with worker_tracing.job(task.request, _job_id_of(args, kwargs)):
        return _run_job(task, *args, **kwargs)


def _run_job(task: Task, *args: Any, **kwargs: Any) -> str:
    """Run job ``job_id`` (its code and state are in the run store). Returns what happened,
    for the worker's log: ``finished``, ``duplicate``, ``skipped``, ``parked`` (the result
    waits in Redis for the store), ``parked-duplicate`` (a redelivery found a parked result
    someone else wrote) or ``dead-letter``. Raises ``Reject(requeue=True)`` to hand
    the message back, unconsumed, when the store or the runtime is down here."""
    job_id = _job_id_of(args, kwargs)
    try:
        state = process_state(task.app)
    except StoreUnavailable as e:
        _step_aside(
            gate.RUN_STORE,
            f"the pool process cannot open the run store: {e}",
            f"job {job_id}: this pool process could not start",
        )
    request = task.request
    if job_id is None:
        poison.dead_letter_task(state.redis, request, args, kwargs)
        return "dead-letter"
    worker = f"{request.hostname}:{os.getpid()}"
    queue = (request.delivery_info or {}).get("routing_key") or QUEUE_RUN
    # From claim to done notice the runtime's own upkeep (a pre-started sandbox's
    # replacement, the used one's removal) waits: it starts as soon as the caller can have
    # its answer.
    with state.executor.on_path():
        try:
            outcome, ended, fair_end = _run(state, job_id, worker, queue, request)
        except Reject:
            # handed back: the job has not ended, nothing to announce but the end mark
            state.end_job(job_id, done=False, fair_end=False)
            raise
        except BaseException:
            # the waiter re-reads the store (the reaper ends it)
            state.end_job(job_id, done=True, fair_end=False)
            raise
        # a parked result is announced by whoever writes it; a run waiting out a retry's
        # delay has not ended (its waiters keep waiting)
        parked = outcome in ("parked", "parked-duplicate", "retry-wait")
        state.end_job(
            job_id,
            done=not parked,
            fair_end=fair_end,
            record=None if ended is None else ended.record,
            paused=outcome == "retry-wait",
        )
    if not parked:
        # failed: NodeFailed, cancelled: Terminated (Celery's view)
        report_outcome(state.store, job_id, ended)
    return outcome


def _job_id_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    if len(args) == 1 and not kwargs and isinstance(args[0], str) and args[0]:
        return args[0]
    if not args and set(kwargs) == {"job_id"} and isinstance(kwargs["job_id"], str):
        return kwargs["job_id"] or None
    return None


def _step_aside(part: str, reason: str, why: str) -> NoReturn:
    """Report, then hand back: the gate hears that ``part`` (gate.RUN_STORE or gate.RUNTIME)
    failed here, for ``reason`` (the main process probes it and closes the gate while it is
    down), and the message goes back to its queue, unconsumed (``why``: the Reject's
    reason)."""
    gate.report(part, reason)
    _hand_back(why)


def _hand_back(why: str) -> NoReturn:
    """The message goes back to its queue, unconsumed (the gate stops this worker taking it
    again; a pause first keeps a gate that has not closed yet from spinning on it)."""
    time.sleep(HAND_BACK_PAUSE_S)
    raise Reject(why, requeue=True)


def _run(state: ProcessState, job_id: str, worker: str, queue: str, request: Any = None) -> Outcome:
    """One delivery of the job: claim, run, finish. A result an earlier run parked is
    written instead of running the code again; a job the claim does not return is skipped;
    a claimed job that must not run ends failed without a sandbox. Hands the message back
    (``_hand_back``) while the store or the runtime is down here."""
    if gate.closed_in_child() or gate.pending_in_child():
        # closed, or a failure reported here not probed yet: another worker (or this one
        # once its gate decided) takes it, and no attempt is counted
        _hand_back(f"job {job_id} handed back: {gate.RUN_STORE} or runtime unavailable here")
    written, flagged, lost = _start(state, job_id)
    if written is not None:
        return Outcome("finished" if written else "parked-duplicate")
    try:
        claim = state.store.try_claim(job_id, worker, again=redelivered(request))
    except StoreUnavailable as e:  # any other error (a bug) raises: handing back would loop
        _step_aside(
            gate.RUN_STORE,
            f"claim of job {job_id} failed: {e}",
            f"job {job_id}: the run store is unreachable",
        )
    rec = claim.record
    if rec is None:
        return _not_claimed(state, claim, job_id, worker, request)
    result = _refused(rec, state.settings)
    if result is None:
        result = _decided(state, _execute(state, rec, flagged), rec, worker, lost)
        if lost:
            result = rerun.with_rerun_row(result, rec.attempts, lost)
        if rec.retry is not None:  # the node's own retries (worker.job.retries)
            try:
                after = retries.after_attempt(state.store, state.settings, rec, result, worker)
            except StoreUnavailable as e:
                after = _next_attempt_unwritten(rec, result, e)
            if after is None:
                return Outcome("retry-wait")
            result = after
    return _finish(state, result, rec, worker, queue)


def _start(
    state: ProcessState, job_id: str
) -> tuple[bool | None, bool | None, list[dict[str, Any]]]:
    """The job's start reads (``ProcessState.start_reads``) and the result an earlier run
    of it parked, written now: True when this call wrote it, False when it had been
    written, None when there is none (or Redis cannot tell: the job runs); then its cancel
    flag and its lost attempts. Hands the message back while the store cannot take the
    parked result (it stays parked)."""
    flagged: bool | None = None
    lost: list[dict[str, Any]] = []
    try:
        found, flagged, lost = state.start_reads(job_id)
        written = parked.write_one(state.store, state.redis, job_id, found=found)
    except redis.RedisError as e:
        log.warning("job %s: cannot look for a parked result (%s)", job_id, e)
        written = None
    except StoreUnavailable as e:
        # the result stays parked
        _step_aside(
            gate.RUN_STORE, str(e), f"job {job_id}: its parked result waits for the run store"
        )
    return written, flagged, lost


def redelivered(request: Any) -> bool:
    """Whether the broker handed this message back before (kombu marks a message it puts
    back on its queue: a worker died holding it, its visibility timeout passed, a worker
    handed it back): only such a delivery may take a job that is ``running`` (its worker
    died). A first delivery claims only a ``queued`` job, so the queued sweep's resend of a
    message a slow worker still holds never runs the job beside it (worker.upkeep.queued).
    No request (a direct call): as before, a redelivery."""
    if request is None:
        return True
    return bool((getattr(request, "delivery_info", None) or {}).get("redelivered"))


def _not_claimed(
    state: ProcessState, claim: Claim, job_id: str, worker: str, request: Any
) -> Outcome:
    """Unknown, cancelled while queued, already finished (a redelivery) or not ended
    (running elsewhere, a retry's attempt before its time), as the claim said (no read of
    the row after it): nothing to do."""
    if claim.unknown:
        unrunnable.unknown_job(state.store, state.redis, job_id, request, worker)
        return Outcome("unknown")
    if claim.cancelled_queued:
        _metrics(metrics.record_cancel, stage="queued")
    return Outcome("skipped", fair_end=not claim.open)


def _refused(rec: JobRecord, settings: Settings) -> CodeResult | None:
    """The failed result of a claimed job that must not run (its row cannot be read, or
    its worker stopped on every attempt), or None: it runs."""
    if rec.problems:
        log.error("job %s: its row cannot be read: %s", rec.job_id, "; ".join(rec.problems))
        message = unrunnable.unreadable_message(rec)
    elif rec.claims > MAX_ATTEMPTS:
        message = (
            f"The job was started {rec.claims - 1} times and each time its worker stopped "
            "before it ended, so it was not started again: check the workers' logs (memory, "
            "crashes), then run it again."
        )
    else:
        return None
    return _result(rec, settings, Status.FAILED, ErrorCode.RUNTIME_UNAVAILABLE, message)


def _execute(state: ProcessState, rec: JobRecord, flagged: bool | None) -> CodeResult:
    """Run the claimed job in a sandbox, its cancel state watched (``CancelWatch``) and its
    live logs published; a cancel before the sandbox starts, or a failure of the worker
    around the executor, is the result."""
    job = rec.to_job()
    watch = state.watch(rec.job_id, flagged)
    state.current_job = rec.job_id
    state.take_signal()  # a signal that came before this job was meant for another one
    try:
        if watch():
            result = _result(
                rec,
                state.settings,
                Status.CANCELLED,
                ErrorCode.CODE_CANCELLED,
                "Cancelled before its sandbox started.",
            )
        else:
            with (
                _metrics_context(metrics.sandbox_running, job.language),
                publishing(state.redis, rec.job_id, end_mark=False, attempt=rec.attempts),
            ):  # live logs, flushed before finish; the end mark goes with the done notice
                state.owes_end_mark = True
                result = state.executor.run(job, should_cancel=watch)
    except Exception as e:  # noqa: BLE001 - the executor never raises for the job itself
        log.exception("job %s: the worker failed around the executor", rec.job_id)
        result = _result(
            rec,
            state.settings,
            Status.FAILED,
            ErrorCode.RUNTIME_UNAVAILABLE,
            f"The worker failed to run the job ({e}); run it again.",
        )
    finally:
        state.current_job = None
    if watch.cancelled_at is not None:
        _metrics(metrics.record_cancel, time.monotonic() - watch.cancelled_at, stage="running")
    return result


def _decided(
    state: ProcessState,
    result: CodeResult,
    rec: JobRecord,
    worker: str,
    lost: list[dict[str, Any]],
) -> CodeResult:
    """The run's re-run decision (``rerun.decide``) carried out: the result to finish, or
    the job handed back (its lost cause kept for the next attempt first) to run again
    elsewhere (the main process probes the runtime at once: this worker steps aside while
    it is unhealthy)."""
    runtime = state.executor.runtime
    decision = rerun.decide(
        result,
        claims=rec.claims,
        rerun_safe=runtime is not None and runtime.rerun_safe,
        why_down=lambda: _why_down(state, rec),
        lost=lost,
    )
    if decision.action == "hand back":
        if decision.cause is not None:
            rerun.record(state.redis, rec.job_id, rec.attempts, decision.cause, worker)
        log.error("job %s %s", rec.job_id, decision.note)
        # No engine call here: an engine starting again accepts connections before it
        # answers (a ping waited 15 s for it, measured); the gate's probe asks instead.
        why = (
            "the runtime cannot run it on this worker"
            if decision.cause is None
            else f"its sandbox was lost to the infrastructure ({decision.cause})"
        )
        _step_aside(gate.RUNTIME, decision.report or "", f"job {rec.job_id}: {why}")
    if decision.report is not None:  # the engine refused it: the job ends, the gate is told
        gate.report(gate.RUNTIME, decision.report)
    return decision.result


def _why_down(state: ProcessState, rec: JobRecord) -> str | None:
    """Why the runtime cannot run the job's language here now (Docker unreachable, image
    missing), or None."""
    runtime = state.executor.runtime
    if runtime is None:
        return None
    try:
        return runtime.unavailable_reason(state.executor.language(rec.language))
    except Exception as e:  # noqa: BLE001
        return str(e)


def _next_attempt_unwritten(rec: JobRecord, result: CodeResult, error: Exception) -> CodeResult:
    """The store went away as an attempt ended with an outcome its policy retries: its next
    attempt could not be written (worker.job.retries). The message is handed back while the
    infrastructure's budget lasts (MAX_ATTEMPTS claims of this attempt), so the attempt runs
    again once a worker can reach the store: an infrastructure re-run, since this attempt's
    outcome was never recorded. Acknowledging the message instead would leave the run
    ``running`` with no message until the reaper ended it failed. With the budget spent, the
    run ends with this attempt's outcome (parked until the store is back, as any result)."""
    gate.report(gate.RUN_STORE, f"the next attempt of job {rec.job_id} was not written: {error}")
    if rec.claims < MAX_ATTEMPTS:
        _hand_back(f"job {rec.job_id}: its next attempt waits for the run store")
    log.error(
        "job %s: its next attempt could not be written (%s) and its %d claims are spent: it "
        "ends with this attempt's outcome",
        rec.job_id,
        error,
        rec.claims,
    )
    return result


def _finish(
    state: ProcessState, result: CodeResult, rec: JobRecord, worker: str, queue: str
) -> Outcome:
    """Store the result, or park it while the store is down (worker.job.pending)."""
    ttl_s = int(state.settings.queue_pending_ttl_s)
    with tracing.result_store(result):  # a span when the worker traces
        stored = pending.store_or_park(state.store, state.redis, result, worker, ttl_s=ttl_s)
        if stored.parked:
            return Outcome("parked")
        if stored.ended is None:
            return Outcome("duplicate")
        wait_s = None
        if rec.started_at is not None:
            wait_s = (rec.started_at - rec.queued_at).total_seconds()
        _metrics(metrics.record_result, result, wait_s, queue=queue)
        return Outcome("finished", stored.ended)


def _result(
    rec: JobRecord, settings: Settings, status: Status, code: ErrorCode, message: str
) -> CodeResult:
    return CodeResult.ended(
        rec.job_id, rec.language, status, code, message, runtime=settings.code_runtime
    )


# --- metrics, never allowed to break a job --------------------------------------------------


def _metrics(hook: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    try:
        hook(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - a metric is never worth a job
        log.warning("metrics hook %s failed: %s", hook.__name__, e)


def _metrics_context(
    hook: Callable[..., AbstractContextManager[Any]], *args: Any
) -> AbstractContextManager[Any]:
    try:
        return hook(*args)
    except Exception as e:  # noqa: BLE001
        log.warning("metrics hook %s failed: %s", hook.__name__, e)
        return nullcontext()
