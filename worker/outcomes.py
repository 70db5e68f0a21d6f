"""What Celery's own tools (Flower, celery-exporter, ``celery events``) see of a job.

The run store is the truth; Celery only carries messages. But operators watch Celery's
events, so a job's Celery outcome follows its stored one:

* ``succeeded``: the task returns (``task-succeeded``);
* ``failed``, ``timed_out``, ``invalid``: the task raises ``NodeFailed`` after the result is
  stored (``task-failed``). It is declared in the task's ``throws``: logged as expected,
  without a traceback, and never retried (no ``autoretry_for``, ``max_retries=0``; with
  acks_late a failure acknowledges the message, Celery's default);
* ``cancelled``: the task raises Celery's ``Terminated`` (declared in ``throws``), which
  the worker's main process turns into ONE ``task-revoked`` event: none more when the
  revoke reached it first and announced it (``CodeClient.cancel`` sends every cancel as a
  revoke), the event itself when it did not. So a job whose Redis flag ended it before the
  main process read the revoke (a busy worker), or whose revoke broadcast was lost, still
  shows as revoked, never as failed or succeeded.

Also here: a revoke with terminate from Flower or ``celery control revoke --terminate``
(SIGTERM by default) becomes the product's cancel (``cancel_on_terminate``), and
``inspect active_queues`` lists code.test, which its own consumer reads (worker.consumer.slots).
"""

from __future__ import annotations

import logging
import os
from typing import Any

from celery.exceptions import Terminated

from executor.models import Status
from executor.store import Ended, RunStore, RunSummary
from worker.context import context_of
from worker.protocol import CANCEL_SIGNAL, QUEUE_TEST, TASK_NAME

log = logging.getLogger("studio_code.worker")

FAILED_STATUSES = (Status.FAILED, Status.TIMED_OUT, Status.INVALID)


class NodeFailed(Exception):  # noqa: N818 - the name Flower shows as the failure type
    """Raised to Celery (only) when a job's stored outcome is failed, timed_out or invalid."""


def report_outcome(store: RunStore, job_id: str, ended: Ended | None = None) -> None:
    """Raise what Celery should see for the job's stored outcome (see the module doc):
    ``ended`` when this process wrote it (no read then), else read from the store.
    Returns for a success, an open job, an unknown one, or an unreadable store."""
    run: Ended | RunSummary | None = ended
    if run is None:
        try:
            run = store.get_summary(job_id)
        except Exception as e:  # noqa: BLE001 - never turn a store hiccup into a task failure
            log.warning("job %s: outcome for Celery's events unknown (%s)", job_id, e)
            return
    if run is None:
        return
    if run.status in FAILED_STATUSES:
        code = run.error.code.value if run.error else "?"
        message = run.error.message if run.error else ""
        raise NodeFailed(f"{run.status.value} {code}: {message}")
    if run.status is Status.CANCELLED:
        raise Terminated("cancelled")


def cancel_on_terminate(store: RunStore, pid: int, signum: int) -> bool:
    """Celery asks to terminate pool process ``pid`` with ``signum`` (a revoke with
    terminate). When that process runs one of our jobs, do the product's cancel instead:
    record the intent in the run store, then send the cancel signal, which makes the job's
    watch read the store at once; the executor removes the sandbox and the job ends
    ``cancelled``. SIGKILL still kills the process (an operator's last resort); the intent
    is recorded first so the revoke backstop ends the job ``cancelled``. False when ``pid``
    runs no job of ours (Celery then does what it was asked)."""
    from celery.worker.state import active_requests

    job_id = next(
        (r.id for r in list(active_requests) if r.worker_pid == pid and r.name == TASK_NAME), None
    )
    if job_id is None:
        return False
    try:
        store.request_cancel(job_id)
    except Exception:  # noqa: BLE001 - the signal below still nudges; the backstop reads it
        log.exception("job %s: recording the terminate as a cancel failed", job_id)
    if signum == 9:
        return False
    log.warning("job %s: revoke with terminate (signal %s) carried out as a cancel", job_id, signum)
    try:
        os.kill(pid, int(CANCEL_SIGNAL))
    except ProcessLookupError:
        pass
    return True


def active_queues(state: Any) -> list[dict[str, Any]]:
    """``inspect active_queues``: Celery's task consumer's queues, plus code.test when the
    worker reads it on its own consumer (worker.consumer.slots.CodeTestConsumer)."""
    consumer = state.consumer
    queues: list[dict[str, Any]] = []
    if consumer.task_consumer:
        queues = [dict(q.as_dict(recurse=True)) for q in consumer.task_consumer.queues]
    if context_of(consumer.app).test_slots and not any(q.get("name") == QUEUE_TEST for q in queues):
        queues.append(dict(consumer.app.amqp.queues[QUEUE_TEST].as_dict(recurse=True)))
    return queues


def register_inspect_commands() -> None:
    """Replace Celery's ``active_queues`` with ours (same name, same reply shape)."""
    from celery.worker.control import inspect_command

    inspect_command(name="active_queues")(active_queues)
