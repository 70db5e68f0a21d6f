"""The worker's side of the traces (executor.tracing): connected only when the standard
OTEL_* variables ask for traces, so a worker that does not trace pays nothing.

* the main process, as a message arrives (Celery's ``task_received``, before the request
  goes to a pool process): the ``studio_code.queue_wait`` span, whose context replaces the
  message's ``traceparent`` in the request the pool process gets;
* the pool process: ``job`` opens ``studio_code.job`` around the task body from that
  ``traceparent``;
* each process exports what it holds when it ends.

Fair share (worker.fair) moves a workflow run's message whole (its headers with it) and
records no time of release, so queue_wait includes that wait (``studio.queue.
fair_share_included``)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

from executor import tracing
from worker.protocol import HEADER_FAIR_USER, QUEUE_RUN

_connected = False


def connect() -> None:
    """Connect the worker's signals when this process traces (else nothing)."""
    global _connected
    if _connected or not tracing.on():
        return
    from celery import signals

    tracing.set_role("worker")
    signals.task_received.connect(_on_received, weak=False)
    signals.worker_process_init.connect(_on_process_init, weak=False)
    signals.worker_process_shutdown.connect(_on_exit, weak=False)
    signals.worker_shutdown.connect(_on_exit, weak=False)
    _connected = True
    tracing.prepare()  # the SDK loaded before the pool forks, not on a first message


def _on_received(sender: Any = None, request: Any = None, **_: Any) -> None:
    try:
        headers = request.request_dict
        queue = (request.delivery_info or {}).get("routing_key") or QUEUE_RUN
        tracing.queue_wait(headers, str(request.id), queue, HEADER_FAIR_USER in headers)
    except Exception as e:  # noqa: BLE001 - a span is never worth a job
        tracing.log.warning("queue_wait span failed: %s", e)


def _on_process_init(**_: Any) -> None:
    tracing.set_role("pool")
    tracing.prepare()  # this process's own exporter, before its first job


def _on_exit(**_: Any) -> None:
    tracing.flush()


def job(request: Any, job_id: str | None) -> Any:
    """Context manager of the pool process's ``studio_code.job`` span for ``request``
    (a no-op when the worker does not trace)."""
    if not _connected:
        return nullcontext(None)
    from celery.exceptions import Terminated

    from worker.outcomes import NodeFailed

    return tracing.job(
        getattr(request, tracing.HEADER_TRACEPARENT, None),
        getattr(request, tracing.HEADER_TRACESTATE, None),
        job_id,
        expected=(NodeFailed, Terminated),  # a failed or cancelled node: its status says it
    )
