"""The worker's MAIN process: its metrics server (``/metrics``, ``/healthz``), the language
readiness probes, and the multiprocess bookkeeping that merges the pool's values.

Celery's prefork pool runs tasks in child processes, so the metrics live in
prometheus-client's *multiprocess* mode: every process writes its values (worker.metrics)
to memory-mapped files in ``PROMETHEUS_MULTIPROC_DIR`` and the worker's main process serves
them all, merged, from a small HTTP server (``MetricsServer``).

Operator rules (docs/operations.md):

* ``PROMETHEUS_MULTIPROC_DIR`` must be set in the worker's environment BEFORE the process
  starts (prometheus-client picks its value store when it is first imported), must be a
  directory of this one worker alone, and is emptied when the worker starts
  (``worker_init``): files left by a previous run would otherwise be added to this one's.
* ``STUDIO_METRICS_PORT`` turns the server on (0, the default, leaves it off);
  ``STUDIO_METRICS_HOST`` is the address it binds (``0.0.0.0`` under Compose so Prometheus
  can reach it); ``STUDIO_METRICS_READY_INTERVAL_S`` paces the readiness probes. All three
  are fields of the one ``Settings``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, make_server

from prometheus_client import REGISTRY, CollectorRegistry, make_wsgi_app, multiprocess
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer
from prometheus_client.registry import Collector

from executor.settings import KNOWN_LANGUAGES, Settings
from worker.health import dependency_problems
from worker.metrics import PREFIX, touch_series

log = logging.getLogger("studio_code.metrics")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: why a worker is paused, as checks (``{"paused": None}`` while it is not)
PausedCheck = Callable[[Settings], dict[str, str | None]]


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
            MULTIPROC_ENV,
            MULTIPROC_ENV,
        )


def process_dead(pid: int) -> None:
    """A pool process ended: drop its live gauges (its counters stay in the sums)."""
    if multiprocess_dir() is not None:
        multiprocess.mark_process_dead(pid)


#: value files whose values add up across processes: an ended process's are kept in ONE
#: ``<type>_ended.db`` per type (the collector reads no pid from these file names)
ADDITIVE_TYPES = ("counter", "histogram", "summary")
ENDED_FILE = "ended"


def _ended(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except (PermissionError, OverflowError):  # another user's process; not a pid at all
        return False
    return False


def fold_ended_processes(path: Path, ended: Callable[[int], bool] = _ended) -> list[int]:
    """Fold the value files of every process that has ended into the directory's
    ``<type>_ended.db`` files, so that the files do not pile up over weeks of pool processes
    replaced (``--max-tasks-per-child``, a SIGKILL, a hard time limit) while every scrape
    reads every file: each of its counter, histogram and summary values is added to the
    same key of ``<type>_ended.db`` and its file removed (the sums stay the same); its live
    gauges (left behind by a process that was killed and never ran its exit hook) are
    removed, as ``mark_process_dead`` does for one that exits. Only the worker's main
    process calls this, under the lock its scrapes hold. Returns the pids folded."""
    from prometheus_client.mmap_dict import MmapedDict

    by_pid: dict[int, list[Path]] = {}
    for f in path.glob("*.db"):
        number = f.stem.rpartition("_")[2]
        if number.isdigit():
            by_pid.setdefault(int(number), []).append(f)
    folded: list[int] = []
    archives: dict[str, MmapedDict] = {}
    try:
        for pid, files in sorted(by_pid.items()):
            if pid == os.getpid() or not ended(pid):
                continue
            ours = [
                f
                for f in files  # an "all", "max"... gauge keeps an ended process's value
                if not (f.name.startswith("gauge_") and not f.name.startswith("gauge_live"))
            ]
            if not ours:
                continue
            for f in ours:
                kind = f.name.partition("_")[0]
                if kind in ADDITIVE_TYPES:
                    values = list(MmapedDict.read_all_values_from_file(str(f)))
                    archive = archives.get(kind)
                    if archive is None:
                        archive = archives[kind] = MmapedDict(str(path / f"{kind}_{ENDED_FILE}.db"))
                    for key, value, timestamp, _ in values:
                        if value:
                            before, _ = archive.read_value(key)
                            archive.write_value(key, before + value, timestamp)
                        else:  # the series exists (a zero): keep it shown
                            archive.read_value(key)
                f.unlink()
            folded.append(pid)
    finally:
        for archive in archives.values():
            archive.close()
    return folded


class FoldingCollector(multiprocess.MultiProcessCollector):  # type: ignore[misc]
    """prometheus-client's MultiProcessCollector that first folds the files of ended
    processes (``fold_ended_processes``). Scrapes, in threads of their own, take turns: a
    file is never removed while another scrape reads the directory."""

    def __init__(self, registry: CollectorRegistry, path: Path) -> None:
        super().__init__(None, str(path))
        self._dir = path
        self._lock = threading.Lock()
        registry.register(self)

    def collect(self) -> Iterable[Any]:
        with self._lock:
            try:
                folded = fold_ended_processes(self._dir)
            except Exception as e:  # noqa: BLE001 - a scrape still answers with what it can
                log.warning("could not fold the value files of ended processes: %s", e)
            else:
                if folded:
                    log.debug("folded the value files of ended processes %s", folded)
            return list(super().collect())


# --- language readiness (main process) --------------------------------------------------


class ReadinessCollector(Collector):
    """``studio_code_language_ready{language}``: 1 when the language's test program ran in
    the runtime at the last probe. A background thread in the worker's main process probes
    every ``interval_s``; a scrape never waits for a sandbox."""

    def __init__(self, settings: Settings, interval_s: float) -> None:
        self.settings = settings
        self.interval_s = interval_s
        self._ready: dict[str, bool] = {}
        #: the engine's posture at the last probe (EnginePosture.compact), None: not read
        self.engine: dict[str, Any] | None = None
        self._executor: Any = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return [self._family(), self._engine_family()]

    def collect(self) -> Iterable[GaugeMetricFamily]:
        return [self._family(), self._engine_family()]

    def _engine_family(self) -> GaugeMetricFamily:
        g = GaugeMetricFamily(
            f"{PREFIX}_engine_vulnerable",
            "1 when the Docker engine's runc, containerd or dockerd has a known container "
            "escape (executor/runtimes/docker/known_escapes.toml), 0 when none; absent when the "
            "engine could not be read.",
        )
        if self.engine is not None:
            g.add_metric([], 1.0 if self.engine["vulnerable"] else 0.0)
        return g

    def _family(self) -> GaugeMetricFamily:
        g = GaugeMetricFamily(
            f"{PREFIX}_language_ready",
            "1 when the language's test program ran in the runtime at the last probe.",
            labels=["language"],
        )
        for name in KNOWN_LANGUAGES:
            g.add_metric([name], 1.0 if self._ready.get(name) else 0.0)
        return g

    def probe_once(self) -> dict[str, bool]:
        from executor.service import Executor

        if self._executor is None:  # one, kept: its Docker client is reused between probes
            self._executor = Executor(self.settings)
        executor = self._executor
        posture = executor.runtime.engine_posture() if executor.runtime is not None else None
        self.engine = posture.compact() if posture is not None else None
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


# --- the server ----------------------------------------------------------------------------


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        pass


class MetricsServer:
    """``/metrics`` (every process of this worker, merged) and ``/healthz`` (Redis, run
    store and Docker reachable: 200, else 503) on one port, in a thread of the worker's main
    process."""

    def __init__(
        self,
        settings: Settings,
        *,
        port: int,
        host: str = "127.0.0.1",
        ready_interval_s: float = 30.0,
        paused: PausedCheck | None = None,
    ) -> None:
        """``paused``: why the worker is paused, added to ``/healthz``'s checks (on a worker:
        worker.upkeep.gate_watch.gate_checks, which worker.assembly passes)."""
        self.settings = settings
        self.paused = paused
        self.registry = CollectorRegistry()
        path = multiprocess_dir()
        if path is not None:
            FoldingCollector(self.registry, path)
        else:
            self.registry.register(_DefaultRegistry())
        self.readiness = ReadinessCollector(settings, ready_interval_s)
        self.registry.register(self.readiness)
        from worker.autoscale import SLOTS

        self.registry.register(SLOTS)
        self._metrics_app = make_wsgi_app(self.registry)
        self._store: Any = None
        self._store_lock = threading.Lock()
        self._httpd = make_server(
            host, port, self._app, ThreadingWSGIServer, handler_class=_QuietHandler
        )
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
        checks = (
            dependency_problems(self.settings, store=store)
            if store
            else dependency_problems(self.settings)
        )
        if self.paused is not None:
            checks.update(self.paused(self.settings))
        return all(v is None for v in checks.values()), checks

    def _app(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> Any:
        path = environ.get("PATH_INFO", "")
        if path in ("/healthz", "/healthz/ready"):
            ok, checks = self._health()
            # the engine's posture is shown, never a check: a vulnerable engine is not a
            # refusal unless STUDIO_CODE_ENGINE_REFUSE_VULNERABLE (then the gate says so)
            engine = self.readiness.engine
            body = json.dumps({"ok": ok, "checks": checks, "engine": engine}).encode()
            start_response(
                "200 OK" if ok else "503 Service Unavailable",
                [("Content-Type", "application/json"), ("Content-Length", str(len(body)))],
            )
            return [body]
        if path in ("/metrics", "/"):
            return self._metrics_app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: use /metrics or /healthz\n"]

    def start(self) -> MetricsServer:
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="studio-metrics", daemon=True
        )
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
    settings: Settings, paused: PausedCheck | None = None
) -> MetricsServer | None:
    """Start this process's metrics server when STUDIO_METRICS_PORT is set (once)."""
    global _server
    if not settings.metrics_port:
        return None
    with _server_lock:
        if _server is None:
            _server = MetricsServer(
                settings,
                port=settings.metrics_port,
                host=settings.metrics_host,
                ready_interval_s=settings.metrics_ready_interval_s,
                paused=paused,
            ).start()
        return _server


def stop_metrics_server() -> None:
    global _server
    with _server_lock:
        if _server is not None:
            _server.stop()
            _server = None


def connect_worker_signals(
    settings_factory: Callable[[], Settings], paused: PausedCheck | None = None
) -> None:
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
            start_metrics_server(settings_factory(), paused)
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
