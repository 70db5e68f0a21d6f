"""Prometheus metrics of a worker host: one ``/metrics`` (and ``/healthz``) per worker.

Celery's prefork pool runs tasks in child processes, so the metrics live in
prometheus-client's *multiprocess* mode: every process writes its values to memory-mapped
files in ``PROMETHEUS_MULTIPROC_DIR`` and the worker's MAIN process serves them all, merged,
from a small HTTP server (``MetricsServer``).

Operator rules (docs/operations.md):

* ``PROMETHEUS_MULTIPROC_DIR`` must be set in the worker's environment BEFORE the process
  starts (prometheus-client picks its value store when it is first imported), must be a
  directory of this one worker alone, and is emptied when the worker starts
  (``worker_init``): files left by a previous run would otherwise be added to this one's.
* ``STUDIO_METRICS_PORT`` turns the server on (0, the default, leaves it off);
  ``STUDIO_METRICS_HOST`` is the address it binds (``0.0.0.0`` under Compose so Prometheus
  can reach it).

The task calls the hooks: ``record_result`` once per finished job, ``sandbox_running``
around the sandbox, ``record_cancel`` when it kills a sandbox for a cancel or skips a job
cancelled while queued. No metric name starts with ``celery_``: that namespace belongs to
celery-exporter, which an operator may run beside this.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    make_wsgi_app,
    multiprocess,
)
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from executor.errors import ErrorCode
from executor.models import CodeResult, Status
from executor.settings import KNOWN_LANGUAGES, Settings

log = logging.getLogger("studio_code.metrics")

PREFIX = "studio_code"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

QUEUE_WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
START_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1, 2, 5, 10)
RUN_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900, 3600)
CANCEL_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30)


class MetricsSettings(BaseSettings):
    """The metrics server's STUDIO_* variables (the executor's Settings ignores them)."""

    model_config = SettingsConfigDict(env_prefix="STUDIO_", extra="ignore", frozen=True)

    metrics_port: int = Field(
        0, ge=0, le=65535, description="Port of the worker's /metrics and /healthz; 0: off."
    )
    metrics_host: str = Field(
        "127.0.0.1", description="Address the metrics server binds (0.0.0.0 under Compose)."
    )
    metrics_ready_interval_s: float = Field(
        30.0, ge=0, description="Seconds between language readiness probes; 0: no probes."
    )


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

    def all(self) -> list[Counter | Gauge | Histogram]:
        return [getattr(self, f) for f in self.__dataclass_fields__]


def build_metrics(registry: CollectorRegistry | None = REGISTRY) -> WorkerMetrics:
    """The worker's metrics, registered in ``registry`` (a fresh one in unit tests)."""
    lr = ("language", "runtime")
    return WorkerMetrics(
        jobs=Counter(
            f"{PREFIX}_jobs", "Code-node jobs finished by this worker, by outcome.",
            [*lr, "status"], registry=registry),
        errors=Counter(
            f"{PREFIX}_job_errors", "Finished jobs by error code (CODE_ERROR, CODE_TIMEOUT...).",
            [*lr, "code"], registry=registry),
        queue_wait=Histogram(
            f"{PREFIX}_queue_wait_seconds",
            "From submit (queued_at in the run store) to a worker slot taking the job.",
            ["queue"], buckets=QUEUE_WAIT_BUCKETS, registry=registry),
        sandbox_start=Histogram(
            f"{PREFIX}_sandbox_start_seconds",
            "Creating and starting one sandbox (container or child process).",
            lr, buckets=START_BUCKETS, registry=registry),
        run=Histogram(
            f"{PREFIX}_run_seconds", "The user's code running in its sandbox.",
            lr, buckets=RUN_BUCKETS, registry=registry),
        sandboxes_running=Gauge(
            f"{PREFIX}_sandboxes_running", "Sandboxes running now on this worker.",
            ["language"], multiprocess_mode="livesum", registry=registry),
        cancellations=Counter(
            f"{PREFIX}_cancellations",
            "Cancels carried out: stage=running killed a sandbox, stage=queued skipped a job "
            "cancelled before it started.",
            ["stage"], registry=registry),
        cancel_latency=Histogram(
            f"{PREFIX}_cancel_latency_seconds",
            "From the worker learning of a cancel to the sandbox being gone.",
            buckets=CANCEL_BUCKETS, registry=registry),
        oom=Counter(
            f"{PREFIX}_oom", "Jobs stopped for using more than STUDIO_CODE_MEMORY.",
            lr, registry=registry),
        timeouts=Counter(
            f"{PREFIX}_timeouts", "Jobs stopped at their timeout.", lr, registry=registry),
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
        for status in (Status.SUCCEEDED, Status.FAILED, Status.TIMED_OUT, Status.CANCELLED,
                       Status.INVALID):
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


# --- pre-started sandboxes (the runtime's pool; executor/runtimes/pool.py) ----------------


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
            f"{PREFIX}_pool_idle", "Pre-started sandboxes waiting for a job on this worker.",
            ["language"], multiprocess_mode="livesum", registry=registry),
        idle_age=Gauge(
            f"{PREFIX}_pool_idle_age_seconds",
            "Age of the oldest pre-started sandbox waiting for a job (at the last update, "
            "every few seconds).",
            ["language"], multiprocess_mode="livemax", registry=registry),
        hits=Counter(
            f"{PREFIX}_pool_hits", "Jobs that took a pre-started sandbox.",
            ["language"], registry=registry),
        misses=Counter(
            f"{PREFIX}_pool_misses",
            "Jobs that started a sandbox cold (pool empty, or limits other than the pool's).",
            ["language"], registry=registry),
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


# --- multiprocess bookkeeping ------------------------------------------------------------


def multiprocess_dir() -> Path | None:
    """PROMETHEUS_MULTIPROC_DIR, or None in single-process mode."""
    value = os.environ.get(MULTIPROC_ENV)
    return Path(value) if value else None


def reset_multiprocess_dir() -> None:
    """Empty PROMETHEUS_MULTIPROC_DIR (creating it when missing). Call it in the worker's
    main process at start, before the pool forks: value files of a previous run would be
    summed into this one's (counters would never restart, livesum gauges would stay up)."""
    path = multiprocess_dir()
    if path is None:
        return
    path.mkdir(parents=True, exist_ok=True)
    for f in path.glob("*.db"):
        f.unlink(missing_ok=True)
    from prometheus_client import values

    if not getattr(values.ValueClass, "__name__", "").startswith("MmapedValue"):
        log.warning(
            "%s is set but prometheus_client was imported before it was: this process keeps "
            "its metrics in memory. Set %s in the environment that starts the worker.",
            MULTIPROC_ENV, MULTIPROC_ENV)


def process_dead(pid: int) -> None:
    """A pool process ended: drop its live gauges (its counters stay in the sums)."""
    if multiprocess_dir() is not None:
        multiprocess.mark_process_dead(pid)


# --- language readiness (main process) --------------------------------------------------


class ReadinessCollector(Collector):
    """``studio_code_language_ready{language}``: 1 when the language's test program ran in
    the runtime at the last probe. A background thread in the worker's main process probes
    every ``interval_s``; a scrape never waits for a sandbox."""

    def __init__(self, settings: Settings, interval_s: float) -> None:
        self.settings = settings
        self.interval_s = interval_s
        self._ready: dict[str, bool] = {}
        self._executor: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [self._family()]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        return [self._family()]

    def _family(self) -> GaugeMetricFamily:
        g = GaugeMetricFamily(
            f"{PREFIX}_language_ready",
            "1 when the language's test program ran in the runtime at the last probe.",
            labels=["language"])
        for name in KNOWN_LANGUAGES:
            g.add_metric([name], 1.0 if self._ready.get(name) else 0.0)
        return g

    def probe_once(self) -> dict[str, bool]:
        from executor.service import Executor

        if self._executor is None:  # one, kept: its Docker client is reused between probes
            self._executor = Executor(self.settings)
        executor = self._executor
        out = {}
        for name in KNOWN_LANGUAGES:
            if name not in self.settings.languages or executor.disabled_reason():
                out[name] = False
                continue
            try:
                out[name] = executor.readiness(executor.language(name), fresh=True).ready
            except Exception:  # noqa: BLE001 - a failed probe means "not ready"
                log.exception("readiness probe of %s failed", name)
                out[name] = False
        self._ready = out
        return out

    def start(self) -> None:
        if self.interval_s <= 0 or self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="studio-ready", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.probe_once()
            self._stop.wait(self.interval_s)

    def stop(self, timeout_s: float = 30.0) -> None:
        """Stop probing and wait for a probe in progress, so its sandbox is removed before
        the process exits."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
            self._thread = None


class _DefaultRegistry(Collector):
    """The process's default registry, seen through another registry (single-process mode)."""

    def collect(self) -> Iterable[Any]:
        return REGISTRY.collect()


# --- health -------------------------------------------------------------------------------


def dependency_problems(settings: Settings, *, store: Any = None) -> dict[str, str | None]:
    """What a worker needs, each None when reachable or a sentence saying what is wrong:
    ``redis`` (the broker), ``run_store`` and, in the docker runtime, ``docker``."""
    checks: dict[str, str | None] = {}
    try:
        import redis

        client = redis.Redis.from_url(
            settings.redis_url, socket_timeout=3, socket_connect_timeout=3)
        try:
            client.ping()
        finally:
            client.close()
        checks["redis"] = None
    except Exception as e:  # noqa: BLE001 - any failure is "unreachable"
        checks["redis"] = f"Redis at STUDIO_REDIS_URL is not reachable: {e}"
    try:
        if store is None:
            from executor.store import open_store

            with open_store(settings.sqlalchemy_url) as s:
                s.get("__healthz__")
        else:
            store.get("__healthz__")
        checks["run_store"] = None
    except Exception as e:  # noqa: BLE001
        checks["run_store"] = f"The run store (STUDIO_DATABASE_URL) is not reachable: {e}"
    from executor.service import runtime_class

    cls = runtime_class(settings)
    if cls is not None and cls.service is not None:
        runtime = cls(settings)
        try:
            checks[cls.service] = runtime.health_problem()
        finally:
            runtime.close()
    return checks


# --- the server ----------------------------------------------------------------------------


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


class MetricsServer:
    """``/metrics`` (every process of this worker, merged) and ``/healthz`` (Redis, run
    store and Docker reachable: 200, else 503) on one port, in a thread of the worker's main
    process."""

    def __init__(
        self, settings: Settings, *, port: int, host: str = "127.0.0.1",
        ready_interval_s: float = 30.0,
    ) -> None:
        self.settings = settings
        self.registry = CollectorRegistry()
        if multiprocess_dir() is not None:
            multiprocess.MultiProcessCollector(self.registry)
        else:
            self.registry.register(_DefaultRegistry())
        self.readiness = ReadinessCollector(settings, ready_interval_s)
        self.registry.register(self.readiness)
        from worker.autoscale import SLOTS

        self.registry.register(SLOTS)
        self._metrics_app = make_wsgi_app(self.registry)
        self._store: Any = None
        self._store_lock = threading.Lock()
        self._httpd = make_server(host, port, self._app, ThreadingWSGIServer,
                                  handler_class=_QuietHandler)
        self._thread: threading.Thread | None = None

    @property
    def port(self) -> int:
        return int(self._httpd.server_port)

    def _health(self) -> tuple[bool, dict[str, str | None]]:
        with self._store_lock:
            if self._store is None:
                try:
                    from executor.store import open_store

                    self._store = open_store(self.settings.sqlalchemy_url)
                except Exception:  # noqa: BLE001 - reported by the check below
                    self._store = None
            store = self._store
        checks = dependency_problems(self.settings, store=store) if store else \
            dependency_problems(self.settings)
        checks.update(gate_checks())
        return all(v is None for v in checks.values()), checks

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/healthz/ready"):
            ok, checks = self._health()
            body = json.dumps({"ok": ok, "checks": checks}).encode()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "application/json"),
                            ("Content-Length", str(len(body)))])
            return [body]
        if path in ("/metrics", "/"):
            return self._metrics_app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: use /metrics or /healthz\n"]

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="studio-metrics", daemon=True)
        self._thread.start()
        self.readiness.start()
        log.info("metrics on http://%s:%s/metrics", self._httpd.server_name, self.port)
        return self

    def stop(self) -> None:
        self.readiness.stop()
        self._httpd.shutdown()
        self._httpd.server_close()
        if self._store is not None:
            self._store.close()
            self._store = None


# --- wiring into Celery ------------------------------------------------------------------

_server: MetricsServer | None = None
_server_lock = threading.Lock()


def start_metrics_server(
    settings: Settings, ms: MetricsSettings | None = None
) -> MetricsServer | None:
    """Start this process's metrics server when STUDIO_METRICS_PORT is set (once)."""
    global _server
    ms = ms or MetricsSettings()  # type: ignore[call-arg]  # fields come from the env
    if not ms.metrics_port:
        return None
    with _server_lock:
        if _server is None:
            _server = MetricsServer(settings, port=ms.metrics_port, host=ms.metrics_host,
                                    ready_interval_s=ms.metrics_ready_interval_s).start()
        return _server


def stop_metrics_server() -> None:
    global _server
    with _server_lock:
        if _server is not None:
            _server.stop()
            _server = None


def connect_worker_signals(settings_factory: Callable[[], Settings]) -> None:
    """Hook the metrics into a Celery worker's life: empty the multiprocess dir at start,
    serve /metrics from the main process once ready, drop a pool child's live gauges when it
    exits, and stop the server (waiting for a readiness probe's sandbox) at shutdown."""
    from celery import signals

    def on_init(**_: Any) -> None:
        reset_multiprocess_dir()

    def on_ready(sender: Any = None, **_: Any) -> None:
        from worker.autoscale import SLOTS

        SLOTS.consumer = sender  # worker_ready's sender is Celery's consumer
        try:
            touch_series(settings_factory())
        except Exception as e:  # noqa: BLE001 - a metric is never worth a worker
            log.warning("metrics series not created: %s", e)
        try:
            start_metrics_server(settings_factory())
        except OSError as e:
            log.error("cannot start the metrics server: %s", e)

    def on_child_exit(pid: int | None = None, **_: Any) -> None:
        process_dead(pid or os.getpid())

    def on_shutdown(**_: Any) -> None:
        stop_metrics_server()

    signals.worker_init.connect(on_init, weak=False)
    signals.worker_ready.connect(on_ready, weak=False)
    signals.worker_process_shutdown.connect(on_child_exit, weak=False)
    signals.worker_shutdown.connect(on_shutdown, weak=False)



# --- faults: dead letters and the gate (worker.poison, worker.gate) ------------------------


@cache
def _dead_letters() -> Counter:
    return Counter(
        f"{PREFIX}_dead_letters",
        "Queue items set aside in studio:dead:<queue> because the worker could not use them "
        "(undecodable, not a task message, unknown task, bad arguments).",
        ["queue", "reason"])


def record_dead_letter(queue: str, reason: str) -> None:
    """One poison item set aside (``reason``: a short label such as 'undecodable')."""
    _dead_letters().labels(queue, reason).inc()


def gate_checks() -> dict[str, str | None]:
    """``paused``: why this worker is not taking jobs (run store unwritable, runtime down),
    None while it is. A paused worker's readiness answers 503 with this sentence."""
    from worker.gate import pause_reason

    return {"paused": pause_reason()}
