"""OpenTelemetry traces of a job, from the studio's request to the sandbox: off unless the
standard variables ask for them, and then exported over OTLP (http/protobuf).

On when ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` or ``OTEL_EXPORTER_OTLP_ENDPOINT`` is set (and
neither ``OTEL_SDK_DISABLED=true`` nor ``OTEL_TRACES_EXPORTER=none``); the SDK reads the rest
itself: ``OTEL_SERVICE_NAME`` (default here: ``studio-code``), ``OTEL_TRACES_SAMPLER`` and
``_ARG``, ``OTEL_BSP_*``, ``OTEL_EXPORTER_OTLP_HEADERS``... Needs the ``otel`` extra
(``pip install 'studio-code[otel]'``); without it a process that is asked to trace says so
once in its log and runs untraced.

Off, this module imports nothing but the standard library and every hook is a check of a
module flag or a context variable: ``opentelemetry`` is imported only by a process that traces,
on its first span (tests/test_tracing.py checks a CLI run and a worker import none of it).

The spans of one job (docs/operations.md, "Traces"), each with ``studio.job_id``:

* ``studio_code.submit`` (the API, ``CodeClient.submit`` / ``enqueue``): the checks, the
  stored row and the message; child of the caller's W3C ``traceparent``. Its context goes
  with the Celery message as the headers ``traceparent`` / ``tracestate``, with
  ``studio_sent_ns`` (the send time, Unix ns);
* ``studio_code.queue_wait`` (the worker's main process, when it receives the message):
  from ``studio_sent_ns`` to then; a workflow run's wait on its user's fair-share list is
  inside it (the fair queue moves the message whole and records no release time);
* ``studio_code.job`` (the pool process): the task body, child of queue_wait, with
  ``studio_code.sandbox_start`` (``studio.sandbox.pooled``), ``studio_code.code_run`` and
  ``studio_code.result_store`` under it;
* ``studio_code.wait`` (``CodeClient.wait`` / ``wait_async``, given the caller's
  ``traceparent``): the caller's wait for the result.

No trace id or variable goes to the sandbox: the runtimes build its environment from the
specification's fixed list alone.
"""

from __future__ import annotations

import contextvars
import functools
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from contextlib import contextmanager, nullcontext
from typing import Any

log = logging.getLogger("studio_code.tracing")

#: the Celery message headers the trace travels in (W3C names, as Celery's own OpenTelemetry
#: instrumentation uses), and the send time the worker's queue_wait span starts at
HEADER_TRACEPARENT = "traceparent"
HEADER_TRACESTATE = "tracestate"
HEADER_SENT_NS = "studio_sent_ns"

SERVICE_DEFAULT = "studio-code"
#: attribute names (one place; docs/operations.md lists them)
JOB_ID = "studio.job_id"
LANGUAGE = "studio.language"
RUNTIME = "studio.runtime"
KIND = "studio.kind"
QUEUE = "studio.queue"
STATUS = "studio.status"
ERROR_CODE = "studio.error_code"
POOLED = "studio.sandbox.pooled"
FAIR_SHARE = "studio.queue.fair_share_included"
BAD_PARENT = "studio.traceparent_invalid"

_on: bool | None = None  # decided from the environment at the first hook that asks
_lock = threading.Lock()
_pid = 0
_tracer: Any = None
_provider: Any = None
_role = "api"
#: the open span a hook below attaches to: the submit in the API, the job in a pool process
_submit: contextvars.ContextVar[Any] = contextvars.ContextVar("studio_submit_span", default=None)
_job: contextvars.ContextVar[Any] = contextvars.ContextVar("studio_job_span", default=None)


def _never_fails(otherwise: Callable[..., Any]) -> Callable[[Callable[..., Any]], Any]:
    """A hook that fails (a broken exporter, a bug here) logs it and returns ``otherwise``
    of its arguments: a span is never worth a job or a request."""

    def wrap(hook: Callable[..., Any]) -> Any:
        @functools.wraps(hook)
        def call(*args: Any, **kwargs: Any) -> Any:
            try:
                return hook(*args, **kwargs)
            except Exception as e:  # noqa: BLE001
                log.warning("tracing: %s failed (no span): %s", hook.__name__, e)
                return otherwise(*args, **kwargs)

        return call

    return wrap


def _no_span(*_: Any, **__: Any) -> Any:
    return nullcontext(None)


def _nothing(*_: Any, **__: Any) -> None:
    return None


def wanted(env: Mapping[str, str] = os.environ) -> bool:
    """Whether the standard variables in ``env`` ask for traces over OTLP."""
    if env.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    if (env.get("OTEL_TRACES_EXPORTER") or "otlp").strip().lower() == "none":
        return False
    return bool(
        env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def on() -> bool:
    """Whether this process traces (read once from the environment)."""
    global _on
    if _on is None:
        _on = wanted()
    return _on


def set_enabled(value: bool | None) -> None:
    """Trace in this process or not, whatever the environment says (None: as it says):
    for a bench that compares both in one process. The exporter still comes from the
    environment."""
    global _on
    _on = value


def set_role(role: str) -> None:
    """What this process is in the traces' resource (``studio.role``: api, worker, pool)."""
    global _role
    _role = role


@_never_fails(_nothing)
def prepare() -> None:
    """When this process traces, load the SDK and make its exporter now (a process's
    start), not on its first job's path."""
    if on():
        tracer()


def tracer() -> Any:
    """This process's tracer (its own provider per pid: a forked pool process never uses
    its parent's exporter); None when the otel extra is missing (tracing turns off)."""
    global _pid, _tracer, _provider, _on
    pid = os.getpid()
    if _pid == pid:
        return _tracer
    with _lock:
        if _pid == pid:
            return _tracer
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
        except ImportError as e:
            log.warning(
                "OTEL_EXPORTER_OTLP_ENDPOINT is set but OpenTelemetry is not installed (%s): "
                "no traces; install the otel extra (pip install 'studio-code[otel]').",
                e,
            )
            _on = False
            _pid, _tracer = pid, None
            return None
        attributes: dict[str, Any] = {"studio.role": _role, "process.pid": pid}
        named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        )
        if not named:
            attributes["service.name"] = SERVICE_DEFAULT
        # the sampler (OTEL_TRACES_SAMPLER, _ARG), the exporter's endpoint, headers and
        # timeout, the batching (OTEL_BSP_*): the SDK reads them from the environment
        try:
            provider = TracerProvider(resource=Resource.create(attributes))
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
        except Exception as e:  # noqa: BLE001 - a bad variable: untraced, said once
            log.warning("tracing is off: OpenTelemetry could not be set up (%s)", e)
            _on = False
            _pid, _tracer = pid, None
            return None
        _provider, _tracer = provider, provider.get_tracer("studio_code")
        _pid = pid
        return _tracer


def flush() -> None:
    """Export what this process holds (a pool process's or worker's end)."""
    if _provider is not None and _pid == os.getpid():
        try:
            _provider.shutdown()
        except Exception as e:  # noqa: BLE001 - a span is never worth a process's end
            log.warning("exporting the last spans failed: %s", e)


def _propagator() -> Any:
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

    return TraceContextTextMapPropagator()


def parent_of(traceparent: str | None, tracestate: str | None) -> tuple[Any, bool]:
    """The OpenTelemetry context of a W3C ``traceparent`` (and ``tracestate``), and False
    when one was given but could not be read: the span then starts a trace of its own, as
    the W3C Trace Context recommendation says (a request is never refused for it)."""
    if not traceparent:
        return None, True
    carrier = {HEADER_TRACEPARENT: str(traceparent)}
    if tracestate:
        carrier[HEADER_TRACESTATE] = str(tracestate)
    ctx = _propagator().extract(carrier)
    from opentelemetry import trace

    valid = trace.get_current_span(ctx).get_span_context().is_valid
    return (ctx if valid else None), valid


def inject(span: Any, carrier: MutableMapping[str, Any]) -> None:
    """Put ``span``'s context in ``carrier`` as traceparent (and tracestate)."""
    from opentelemetry import trace

    _propagator().inject(carrier, context=trace.set_span_in_context(span))


def start(name: str, parent: Any = None, **kwargs: Any) -> Any:
    """A span of this process's tracer (``parent``: a span or a context; None: a root)."""
    t = tracer()
    if t is None:
        return None
    if parent is not None and not isinstance(parent, dict) and hasattr(parent, "end"):
        from opentelemetry import trace

        parent = trace.set_span_in_context(parent)
    return t.start_span(name, context=parent, **kwargs)


def failed(span: Any, e: BaseException) -> None:
    """Mark ``span`` failed by ``e`` (its error code when it carries one)."""
    from opentelemetry.trace import Status, StatusCode

    code = getattr(e, "code", None)
    span.set_attribute(ERROR_CODE, str(code) if code is not None else type(e).__name__)
    span.set_status(Status(StatusCode.ERROR, str(e)[:200]))


@contextmanager
def _spanning(
    span: Any,
    var: contextvars.ContextVar[Any] | None = None,
    expected: tuple[type[BaseException], ...] = (),
) -> Iterator[Any]:
    token = var.set(span) if var is not None else None
    try:
        yield span
    except expected:
        raise
    except BaseException as e:
        if span is not None:
            try:
                failed(span, e)
            except Exception as bad:  # noqa: BLE001 - the job's own exception goes on
                log.warning("tracing: marking a span failed did not work: %s", bad)
        raise
    finally:
        if var is not None and token is not None:
            var.reset(token)
        if span is not None:
            span.end()


def _parented(name: str, traceparent: str | None, tracestate: str | None, kind: str) -> Any:
    if tracer() is None:  # the otel extra is missing: off (said once)
        return None
    from opentelemetry.trace import SpanKind

    parent, valid = parent_of(traceparent, tracestate)
    span = start(name, parent, kind=getattr(SpanKind, kind))
    if span is not None and not valid:
        span.set_attribute(BAD_PARENT, True)
    return span


# --- the API's side ----------------------------------------------------------------------


@_never_fails(_no_span)
def submitting(traceparent: str | None = None, tracestate: str | None = None) -> Any:
    """Context manager of the ``studio_code.submit`` span (yields it, or None when off).
    Inside an open one (``submit`` calls ``enqueue``) it is that one again."""
    if not on() or (_submit.get() is not None and not traceparent):
        return nullcontext(_submit.get())
    span = _parented("studio_code.submit", traceparent, tracestate, "PRODUCER")
    return _spanning(span, _submit)


@_never_fails(_nothing)
def message_headers(headers: MutableMapping[str, Any], job: Any, runtime: str) -> None:
    """The open submit span's context and the send time, in a job's message headers, and
    the job's attributes on the span (nothing when no submit span is open)."""
    span = _submit.get()
    if span is None:
        return
    span.set_attributes(
        {JOB_ID: job.job_id, LANGUAGE: job.language, KIND: job.kind, RUNTIME: runtime}
    )
    inject(span, headers)
    headers[HEADER_SENT_NS] = time.time_ns()


@_never_fails(_no_span)
def waiting(job_id: str, traceparent: str | None, tracestate: str | None) -> Any:
    """Context manager of the caller's ``studio_code.wait`` span, when the caller gave its
    ``traceparent`` (yields the span, or None)."""
    if not traceparent or not on():
        return nullcontext(None)
    span = _parented("studio_code.wait", traceparent, tracestate, "CLIENT")
    if span is not None:
        span.set_attribute(JOB_ID, job_id)
    return _spanning(span)


@_never_fails(lambda span, rec: rec)
def waited(span: Any, rec: Any) -> Any:
    """Put the job's end (a JobRecord) on the wait span; returns ``rec``."""
    if span is not None:
        _ended(span, rec.status, rec.error, language=rec.language, runtime=rec.code_runtime)
    return rec


def _ended(span: Any, status: Any, error: Any, **more: Any) -> None:
    span.set_attribute(STATUS, str(status))
    if error is not None:
        span.set_attribute(ERROR_CODE, str(error.code))
    for key, value in more.items():
        if value is not None:
            span.set_attribute(f"studio.{key}", str(value))


# --- the worker's side -------------------------------------------------------------------


@_never_fails(_nothing)
def queue_wait(request: MutableMapping[str, Any], job_id: str, queue: str, fair: bool) -> None:
    """In the worker's main process, as a message arrives: the ``studio_code.queue_wait``
    span from the message's send time to now, and its context in ``request`` (the request
    dict the pool process gets), so the job's spans are its children."""
    sent = request.get(HEADER_SENT_NS)
    if not isinstance(sent, int) or sent <= 0 or tracer() is None:
        return
    from opentelemetry.trace import SpanKind

    parent, valid = parent_of(request.get(HEADER_TRACEPARENT), request.get(HEADER_TRACESTATE))
    span = start("studio_code.queue_wait", parent, kind=SpanKind.CONSUMER, start_time=sent)
    if span is None:
        return
    span.set_attributes({JOB_ID: job_id, QUEUE: queue, FAIR_SHARE: fair})
    if not valid:
        span.set_attribute(BAD_PARENT, True)
    span.end()
    inject(span, request)


@_never_fails(_no_span)
def job(
    traceparent: str | None,
    tracestate: str | None,
    job_id: str | None,
    expected: tuple[type[BaseException], ...] = (),
) -> Any:
    """Context manager of the pool process's ``studio_code.job`` span (the task body);
    the executor's and the store's spans below attach to it. ``expected``: exceptions that
    are an outcome, not a failure of the span (the job's status says it)."""
    if not on():
        return nullcontext(None)
    span = _parented("studio_code.job", traceparent, tracestate, "CONSUMER")
    if span is not None and job_id:
        span.set_attribute(JOB_ID, job_id)
    return _spanning(span, _job, expected)


@_never_fails(_no_span)
def result_store(result: Any) -> Any:
    """Context manager of ``studio_code.result_store`` under the open job span, which gets
    the result's attributes (status, error code, language, runtime)."""
    parent = _job.get()
    if parent is None:
        return nullcontext(None)
    for span in (parent, start("studio_code.result_store", parent)):
        if span is not None:
            span.set_attributes(
                {JOB_ID: result.job_id, LANGUAGE: result.language, RUNTIME: result.code_runtime}
            )
            _ended(span, result.status, result.error)
    return _spanning(span)


@_never_fails(_nothing)
def sandbox(result: Any, raw: Any, started_ns: int) -> None:
    """``studio_code.sandbox_start`` and ``studio_code.code_run`` under the open job span,
    from what the runtime measured (its start, from ``started_ns``, then the run)."""
    parent = _job.get()
    if parent is None:
        return
    common = {JOB_ID: result.job_id, LANGUAGE: result.language, RUNTIME: result.code_runtime}
    ran_ns = started_ns + int(raw.start_ms * 1e6)
    span = start("studio_code.sandbox_start", parent, start_time=started_ns)
    if span is not None:
        span.set_attributes({**common, POOLED: bool(raw.pooled)})
        span.end(end_time=ran_ns)
    span = start("studio_code.code_run", parent, start_time=ran_ns)
    if span is not None:
        span.set_attributes(common)
        if raw.exit_code is not None:
            span.set_attribute("studio.exit_code", raw.exit_code)
        _ended(span, result.status, result.error)
        usage = getattr(result, "usage", None)  # measured by the host; None: not measured
        if usage is not None:
            for key in ("memory_peak_bytes", "cpu_ms", "pids_peak", "source"):
                value = getattr(usage, key, None)
                if value is not None:
                    span.set_attribute(f"studio.usage.{key}", value)
        span.end(end_time=ran_ns + int(raw.run_ms * 1e6))
