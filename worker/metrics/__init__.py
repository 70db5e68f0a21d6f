"""What a worker's processes record: the Prometheus metric objects and the hooks that fill
them (one ``/metrics`` per worker host serves them: worker/metrics/server.py).

Pool processes write their values to memory-mapped files in ``PROMETHEUS_MULTIPROC_DIR``
(prometheus-client's multiprocess mode); the worker's main process merges and serves them.
The task calls the hooks: ``record_result`` once per finished job, ``sandbox_running``
around the sandbox, ``record_cancel`` when it kills a sandbox for a cancel or skips a job
cancelled while queued; the pool's observer calls ``record_pool``, the poison-message
guard ``record_dead_letter``. No metric name starts with ``celery_``: that namespace belongs
to celery-exporter, which an operator may run beside this.

Beside it: the server, readiness probes, why the worker is paused and multiprocess bookkeeping
(``worker.metrics.server``, main process only). What the API shares with it is at worker/'s
top: the health checks (``worker.health``) and the autoscaling signals (``worker.autoscale``).
The STUDIO_METRICS_* variables are fields of the one ``Settings``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from typing import Any

from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from executor.errors import ErrorCode
from executor.models import CodeResult, Status
from executor.settings import KNOWN_LANGUAGES, Settings

PREFIX = "studio_code"

QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
START_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10)
RUN_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)
CANCEL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)
MIB = 1 << 20
#: a run's peak memory: 8 MiB .. 4 GiB (the usual STUDIO_CODE_MEMORY steps are edges)
MEMORY_BUCKETS = tuple(
    float(n * MIB) for n in (8, 16, 32, 64, 128, 192, 256, 384, 512, 1024, 2048, 4096)
)
CPU_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300)


# --- the catalogue --------------------------------------------------------------------


@dataclass(frozen=True)
class WorkerMetrics:
    """Every metric a worker exports. Built once per process (``metrics()``)."""

    jobs: Counter
    errors: Counter
    queue_wait: Histogram
    sandbox_start: Histogram
    run: Histogram
    sandboxes_running: Gauge
    cancellations: Counter
    cancel_latency: Histogram
    oom: Counter
    timeouts: Counter
    memory_peak: Histogram
    cpu: Histogram

    def all(self) -> list[Counter | Gauge | Histogram]:
        return [getattr(self, f) for f in self.__dataclass_fields__]


def build_metrics(registry: CollectorRegistry | None = REGISTRY) -> WorkerMetrics:
    """The worker's metrics, registered in ``registry`` (a fresh one in unit tests)."""
    lr = ("language", "runtime")
    return WorkerMetrics(
        jobs=Counter(
            f"{PREFIX}_jobs",
            "Code-node jobs finished by this worker, by outcome.",
            [*lr, "status"],
            registry=registry,
        ),
        errors=Counter(
            f"{PREFIX}_job_errors",
            "Finished jobs by error code (CODE_ERROR, CODE_TIMEOUT...).",
            [*lr, "code"],
            registry=registry,
        ),
        queue_wait=Histogram(
            f"{PREFIX}_queue_wait_seconds",
            "From submit (queued_at in the run store) to a worker slot taking the job.",
            ["queue"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=registry,
        ),
        sandbox_start=Histogram(
            f"{PREFIX}_sandbox_start_seconds",
            "Creating and starting one sandbox (container or child process).",
            lr,
            buckets=START_BUCKETS,
            registry=registry,
        ),
        run=Histogram(
            f"{PREFIX}_run_seconds",
            "The user's code running in its sandbox.",
            lr,
            buckets=RUN_BUCKETS,
            registry=registry,
        ),
        sandboxes_running=Gauge(
            f"{PREFIX}_sandboxes_running",
            "Sandboxes running now on this worker.",
            ["language"],
            multiprocess_mode="livesum",
            registry=registry,
        ),
        cancellations=Counter(
            f"{PREFIX}_cancellations",
            "Cancels carried out: stage=running killed a sandbox, stage=queued skipped a job "
            "cancelled before it started.",
            ["stage"],
            registry=registry,
        ),
        cancel_latency=Histogram(
            f"{PREFIX}_cancel_latency_seconds",
            "From the worker learning of a cancel to the sandbox being gone.",
            buckets=CANCEL_BUCKETS,
            registry=registry,
        ),
        oom=Counter(
            f"{PREFIX}_oom",
            "Jobs stopped for using more than STUDIO_CODE_MEMORY.",
            lr,
            registry=registry,
        ),
        timeouts=Counter(
            f"{PREFIX}_timeouts", "Jobs stopped at their timeout.", lr, registry=registry
        ),
        memory_peak=Histogram(
            f"{PREFIX}_run_memory_peak_bytes",
            "A run's peak memory as the host measured it (its sandbox's cgroup, interpreter "
            "included): size STUDIO_CODE_MEMORY from its p99. Runs not measured are left out.",
            lr,
            buckets=MEMORY_BUCKETS,
            registry=registry,
        ),
        cpu=Histogram(
            f"{PREFIX}_run_cpu_seconds",
            "A run's CPU time (user + system) as the host measured it; a pre-started "
            "sandbox's start is not in it. Runs not measured are left out.",
            lr,
            buckets=CPU_BUCKETS,
            registry=registry,
        ),
    )


@cache
def metrics() -> WorkerMetrics:
    """This process's metrics, created on first use: a prefork child creates its own value
    files, and the main process (which only serves them) creates none."""
    return build_metrics()


# --- hooks the task calls ----------------------------------------------------------------


def _trace_seconds(result: CodeResult, step: str) -> float | None:
    for row in result.trace:
        if row.step == step:
            return row.duration_ms / 1000
    return None


def record_result(
    result: CodeResult, queue_wait_s: float | None = None, *, queue: str = "code.run"
) -> None:
    """Count one finished job: outcome, error code, OOM/timeout, and the sandbox's start and
    run durations from its trace. Call it once per result the worker wrote."""
    m = metrics()
    language, runtime = result.language, result.runtime or result.code_runtime or "unknown"
    m.jobs.labels(language, runtime, result.status.value).inc()
    if result.error is not None:
        m.errors.labels(language, runtime, result.error.code.value).inc()
        if result.error.code is ErrorCode.CODE_MEMORY:
            m.oom.labels(language, runtime).inc()
    if result.status is Status.TIMED_OUT:
        m.timeouts.labels(language, runtime).inc()
    start_s = _trace_seconds(result, "sandbox.start")
    if start_s is not None:
        m.sandbox_start.labels(language, runtime).observe(start_s)
    run_s = _trace_seconds(result, "code.run")
    if run_s is not None:
        m.run.labels(language, runtime).observe(run_s)
    used = result.usage
    if used is not None:
        if used.memory_peak_bytes is not None:
            m.memory_peak.labels(language, runtime).observe(used.memory_peak_bytes)
        if used.cpu_ms is not None:
            m.cpu.labels(language, runtime).observe(used.cpu_ms / 1000)
    if queue_wait_s is not None:
        record_queue_wait(queue_wait_s, queue=queue)


def record_queue_wait(seconds: float, *, queue: str = "code.run") -> None:
    """How long a job waited in the queue before a slot took it."""
    metrics().queue_wait.labels(queue).observe(max(0.0, seconds))


def touch_series(settings: Settings) -> None:
    """Create every labelled series a dashboard or alert reads, at 0, so a fresh worker
    shows 0 rather than "no data" until the first job, timeout or cancel."""
    m = metrics()
    runtime = settings.code_runtime
    for language in KNOWN_LANGUAGES:
        m.sandboxes_running.labels(language)
        m.timeouts.labels(language, runtime)
        m.oom.labels(language, runtime)
        for status in (
            Status.SUCCEEDED,
            Status.FAILED,
            Status.TIMED_OUT,
            Status.CANCELLED,
            Status.INVALID,
        ):
            m.jobs.labels(language, runtime, status.value)
    for stage in ("running", "queued"):
        m.cancellations.labels(stage)


@contextmanager
def sandbox_running(language: str) -> Iterator[None]:
    """Counts a sandbox as running for the duration of the block (the gauge is a
    multiprocess ``livesum``: the sum over the worker's live processes)."""
    gauge = metrics().sandboxes_running.labels(language)
    gauge.inc()
    try:
        yield
    finally:
        gauge.dec()


def record_cancel(latency_s: float | None = None, *, stage: str = "running") -> None:
    """One cancel carried out; ``latency_s`` from learning of it to the sandbox gone."""
    m = metrics()
    m.cancellations.labels(stage).inc()
    if latency_s is not None:
        m.cancel_latency.observe(max(0.0, latency_s))


# --- pre-started sandboxes (the runtime's pool; executor/runtimes/docker/pool.py) ----------------


@dataclass(frozen=True)
class PoolMetrics:
    """The pool of pre-started sandboxes of each pool process, summed over the worker."""

    idle: Gauge
    idle_age: Gauge
    hits: Counter
    misses: Counter


def build_pool_metrics(registry: CollectorRegistry | None = REGISTRY) -> PoolMetrics:
    return PoolMetrics(
        idle=Gauge(
            f"{PREFIX}_pool_idle",
            "Pre-started sandboxes waiting for a job on this worker.",
            ["language"],
            multiprocess_mode="livesum",
            registry=registry,
        ),
        idle_age=Gauge(
            f"{PREFIX}_pool_idle_age_seconds",
            "Age of the oldest pre-started sandbox waiting for a job (at the last update, "
            "every few seconds).",
            ["language"],
            multiprocess_mode="livemax",
            registry=registry,
        ),
        hits=Counter(
            f"{PREFIX}_pool_hits",
            "Jobs that took a pre-started sandbox.",
            ["language"],
            registry=registry,
        ),
        misses=Counter(
            f"{PREFIX}_pool_misses",
            "Jobs that started a sandbox cold (pool empty, or limits other than the pool's).",
            ["language"],
            registry=registry,
        ),
    )


@cache
def pool_metrics() -> PoolMetrics:
    return build_pool_metrics()


_pool_seen: dict[tuple[str, str], int] = {}
_pool_lock = threading.Lock()


def record_pool(stats: dict[str, Any] | None) -> None:
    """The runtime's ``pool_stats()`` (cumulative hits and misses, idle now): sets the
    gauges and adds what the counters have not seen yet. Called by the pool's observer."""
    if not stats:
        return
    m = pool_metrics()
    with _pool_lock:
        for language, entry in stats.get("languages", {}).items():
            m.idle.labels(language).set(entry.get("idle", 0))
            m.idle_age.labels(language).set(entry.get("oldest_idle_s", 0.0))
            for name, counter in (("hits", m.hits), ("misses", m.misses)):
                total = int(entry.get(name, 0))
                seen = _pool_seen.get((language, name), 0)
                if total > seen:
                    counter.labels(language).inc(total - seen)
                _pool_seen[(language, name)] = total


# --- faults: dead letters and the gate (worker.poison, worker.gate) ---------------


@cache
def _dead_letters() -> Counter:
    return Counter(
        f"{PREFIX}_dead_letters",
        "Queue items set aside in studio:dead:<queue> because the worker could not use them "
        "(undecodable, not a task message, unknown task, bad arguments).",
        ["queue", "reason"],
    )


def record_dead_letter(queue: str, reason: str) -> None:
    """One poison item set aside (``reason``: a short label such as 'undecodable')."""
    _dead_letters().labels(queue, reason).inc()


@cache
def _loop_restarts() -> Counter:
    return Counter(
        f"{PREFIX}_worker_loop_restarts",
        "Times a loop of the worker's main process (gate, janitor, heartbeat) raised out of "
        "its body and was restarted (worker.upkeep.loop).",
        ["loop"],
    )


def record_loop_restart(loop: str) -> None:
    """One main-process loop restarted after it raised."""
    _loop_restarts().labels(loop).inc()
