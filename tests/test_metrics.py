"""Worker metrics for real: jobs with mixed outcomes through a real prefork worker in
Prometheus multiprocess mode, scraped over HTTP from its metrics server and parsed with
prometheus-client's own parser. Plus the naming rules, checked on the catalogue."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from testkit.processes import children, free_port, wait_for
from testkit.sandboxes import containers_of
from testkit.stack import studio_env
from testkit.worker import start_worker
from tests.snippets import OK_CODE, RAISE_CODE, SLEEP_CODE

OOM_CODE = (
    "def main(state):\n"
    "    chunks = []\n"
    "    for _ in range(400):\n"
    "        chunks.append(bytearray(1024 * 1024))\n"
    "    return len(chunks)\n"
)


def scrape(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of /metrics as {(name, sorted labels): value}."""
    r = httpx.get(url, timeout=10)
    assert r.status_code == 200, r.text
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def total(samples: dict[Any, float], name: str, **labels: str) -> float:
    """Sum of ``name``'s samples whose labels include ``labels``."""
    return sum(
        v
        for (n, ls), v in samples.items()
        if n == name and all(dict(ls).get(k) == val for k, val in labels.items())
    )


def metered_worker(
    tmp_path: Path,
    redis_url: str,
    image: str,
    *,
    worker_options: dict[str, Any] | None = None,
    client_settings: dict[str, Any] | None = None,
    **env: Any,
) -> tuple[Any, Any, str, Any]:
    """A real worker with its metrics server on (multiprocess mode, ``tmp_path/prom``; ``env``
    added to its environment) and a CodeClient on the same Redis and store: (worker,
    client, its /metrics URL, the client's settings)."""
    from api_client.client import CodeClient
    from executor.settings import load_settings

    port = free_port()
    db = f"sqlite:///{tmp_path / 'runs.db'}"
    environ = studio_env(
        redis_url,
        db,
        image,
        PROMETHEUS_MULTIPROC_DIR=tmp_path / "prom",
        STUDIO_METRICS_PORT=port,
        **env,
    )
    worker = start_worker(environ, tmp_path / "worker.log", **(worker_options or {}))
    settings = load_settings(
        enable_code_nodes=True,
        redis_url=redis_url,
        database_url=db,
        code_image=image,
        code_languages="python",
        **(client_settings or {}),
    )
    return worker, CodeClient(settings), f"http://127.0.0.1:{port}/metrics", settings


@pytest.mark.docker
@pytest.mark.redis
def test_scraped_counts_equal_the_jobs_run(
    tmp_path: Path, redis_server: Any, python_image: str, docker_client: Any
) -> None:
    prom = tmp_path / "prom"
    prom.mkdir()
    stale = prom / "counter_424242.db"
    stale.write_bytes(b"left by a previous run")  # the worker must empty the dir at start
    worker, client, metrics_url, _ = metered_worker(
        tmp_path,
        redis_server.url,
        python_image,
        client_settings={"code_max_seconds": 15, "code_memory": "64m"},
        STUDIO_CODE_MEMORY="64m",
    )
    health_url = metrics_url.replace("/metrics", "/healthz")
    try:
        assert not stale.exists(), "the worker did not empty PROMETHEUS_MULTIPROC_DIR"
        health = httpx.get(health_url, timeout=30)
        assert health.status_code == 200, health.text

        plan = (
            [("succeeded", OK_CODE, None)] * 3
            + [("failed", RAISE_CODE, None)] * 2
            + [("timed_out", SLEEP_CODE, 1.0)] * 2
            + [("failed", OOM_CODE, None)]
        )
        ids = {
            client.submit(code, "python", {"s": 30}, timeout_s=t, user="m"): want
            for want, code, t in plan
        }

        # one more, cancelled while its sandbox runs
        cancel_id = client.submit(SLEEP_CODE, "python", {"s": 60}, user="m")
        deadline = time.monotonic() + 30
        while not containers_of(docker_client, cancel_id) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert containers_of(docker_client, cancel_id), "the sandbox to cancel never started"
        client.cancel(cancel_id)
        ids[cancel_id] = "cancelled"

        results = {job_id: client.wait(job_id, 60) for job_id in ids}
        got = {job_id: r.status.value for job_id, r in results.items()}
        assert got == ids

        # the pool process counts right after it stores the result: allow it a moment
        want = {"succeeded": 3, "failed": 3, "timed_out": 2, "cancelled": 1}
        deadline = time.monotonic() + 20
        while True:
            samples = scrape(metrics_url)
            seen = {s: total(samples, "studio_code_jobs_total", status=s) for s in want}
            if seen == want or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert seen == want
        jobs = len(ids)
        assert total(samples, "studio_code_jobs_total") == jobs
        assert total(samples, "studio_code_jobs_total", language="python", runtime="docker") == jobs
        errors = {
            c: total(samples, "studio_code_job_errors_total", code=c)
            for c in ("CODE_ERROR", "CODE_TIMEOUT", "CODE_MEMORY", "CODE_CANCELLED")
        }
        assert errors == {"CODE_ERROR": 2, "CODE_TIMEOUT": 2, "CODE_MEMORY": 1, "CODE_CANCELLED": 1}
        assert total(samples, "studio_code_oom_total") == 1
        assert total(samples, "studio_code_timeouts_total") == 2
        assert total(samples, "studio_code_cancellations_total", stage="running") == 1
        assert total(samples, "studio_code_cancel_latency_seconds_count") == 1
        assert 0 < total(samples, "studio_code_cancel_latency_seconds_sum") < 15
        # every job had a sandbox: start and run observed once each, queue wait too
        assert total(samples, "studio_code_sandbox_start_seconds_count") == jobs
        assert total(samples, "studio_code_run_seconds_count") == jobs
        assert total(samples, "studio_code_queue_wait_seconds_count", queue="code.run") == jobs
        assert total(samples, "studio_code_sandboxes_running") == 0
        # what each run used, as measured and stored: one observation per measured run (a
        # timeout and a cancel are measured before their sandbox goes), the OOM near 64m
        measured = [r.usage for r in results.values() if r.usage is not None]
        assert len(measured) == jobs, [r.usage for r in results.values()]
        peak = "studio_code_run_memory_peak_bytes"
        assert total(samples, f"{peak}_count", language="python", runtime="docker") == jobs
        assert total(samples, f"{peak}_sum") == sum(u.memory_peak_bytes or 0 for u in measured)
        assert total(samples, f"{peak}_sum") >= 60 * 2**20  # the OOM run alone
        assert total(samples, "studio_code_run_cpu_seconds_count") == jobs
        # multiprocess mode is what served these: value files of the pool processes
        assert list(prom.glob("counter_*.db"))

        # readiness of each language, from the main process's probe
        deadline = time.monotonic() + 30
        while total(samples, "studio_code_language_ready", language="python") != 1:
            assert time.monotonic() < deadline, "python never reported ready"
            time.sleep(0.5)
            samples = scrape(metrics_url)
        assert total(samples, "studio_code_language_ready", language="typescript") == 0
        # the engine's posture, from the same probe: 1 exactly when a known escape applies
        from executor.runtimes.docker.posture import read_posture

        vulnerable = read_posture(docker_client.api).vulnerable
        assert ("studio_code_engine_vulnerable", ()) in samples, sorted(samples)
        assert samples[("studio_code_engine_vulnerable", ())] == (1.0 if vulnerable else 0.0)
        health = httpx.get(health_url, timeout=30).json()
        assert health["engine"]["vulnerable"] is vulnerable, health

        assert not any(n.startswith("celery_") for n, _ in samples)
    finally:
        client.close()
        code = worker.stop(60)
        assert code == 0, worker.output()[-3000:]


@pytest.mark.docker
@pytest.mark.redis
def test_a_running_sandbox_shows_in_the_gauge(
    tmp_path: Path, redis_server: Any, python_image: str, docker_client: Any
) -> None:
    # 3 processes: 2 for workflow runs + the one kept for editor test calls
    worker, client, url, _ = metered_worker(
        tmp_path,
        redis_server.url,
        python_image,
        worker_options={"concurrency": 3},
        STUDIO_METRICS_READY_INTERVAL_S=0,
    )
    try:
        ids = [client.submit(SLEEP_CODE, "python", {"s": 60}, user="g") for _ in range(2)]
        deadline = time.monotonic() + 30
        while total(scrape(url), "studio_code_sandboxes_running", language="python") != 2:
            assert time.monotonic() < deadline, "the gauge never showed both sandboxes"
            time.sleep(0.1)
        for job_id in ids:
            client.cancel(job_id)
        for job_id in ids:
            assert client.wait(job_id, 30).status.value == "cancelled"
        deadline = time.monotonic() + 10
        while total(scrape(url), "studio_code_sandboxes_running") != 0:
            assert time.monotonic() < deadline, "the gauge did not come back to 0"
            time.sleep(0.1)
    finally:
        client.close()
        worker.stop(60)


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.timeout(240)
def test_ended_pool_processes_leave_their_counts_and_no_files_or_live_gauges(
    tmp_path: Path, redis_server: Any, python_image: str, docker_client: Any
) -> None:
    """A worker that runs for weeks replaces pool processes (``--max-tasks-per-child``, a
    SIGKILL, a hard time limit). What each ended one counted stays in the sums, but its
    value files do not pile up in PROMETHEUS_MULTIPROC_DIR (every scrape reads every file),
    and the live gauges of one that was killed (it never ran its exit hook) leave the sums."""
    prom = tmp_path / "prom"
    worker, client, url, settings = metered_worker(
        tmp_path,
        redis_server.url,
        python_image,
        worker_options={"concurrency": 1, "extra_args": ["--max-tasks-per-child", "2"]},
        STUDIO_QUEUE_TEST_SLOTS=0,
    )

    def ended_files() -> list[str]:
        """Value files of processes that are gone."""
        out = []
        for f in prom.glob("*.db"):
            pid = f.stem.rsplit("_", 1)[1]
            if pid.isdigit() and not Path(f"/proc/{pid}").exists():
                out.append(f.name)
        return sorted(out)

    def settled(jobs: int) -> dict[Any, float]:
        """The scrape once the jobs and the pool's takes (hits + misses) counted reach
        ``jobs`` and the one live slot shows its one pre-started sandbox."""
        seen: list[Any] = []

        def counted() -> dict[Any, float] | None:
            samples = scrape(url)
            seen[:] = [
                total(samples, "studio_code_jobs_total"),
                total(samples, "studio_code_pool_hits_total")
                + total(samples, "studio_code_pool_misses_total"),
                total(samples, "studio_code_pool_idle", language="python"),
                sorted(p.name for p in prom.glob("*.db")),
            ]
            return samples if seen[:3] == [jobs, jobs, 1] else None

        samples: dict[Any, float] = wait_for(
            counted, 60, f"{jobs} jobs and takes counted, 1 idle", 0.2, lambda: seen
        )
        return samples

    try:
        ids = [client.submit(OK_CODE, "python", {}, user="r") for _ in range(8)]
        assert {client.wait(j, 60).status.value for j in ids} == {"succeeded"}
        pids = {int(client.status(j).worker.rsplit(":", 1)[1]) for j in ids}  # type: ignore[union-attr]
        assert len(pids) == 4, pids  # 2 jobs per process
        samples = settled(8)
        assert total(samples, "studio_code_jobs_total", status="succeeded") == 8
        assert total(samples, "studio_code_run_seconds_count") == 8
        assert ended_files() == [], "the value files of ended pool processes piled up"

        # a pool process SIGKILLed while it holds a pre-started sandbox: its live gauge
        # leaves the sums (the new process pre-starts its own), its counts stay
        [slot] = [p for p in children(worker.pid) if p not in pids]

        def reported(pid: int) -> bool:  # its pre-started sandbox is in its live gauge
            return (prom / f"gauge_livesum_{pid}.db").exists()

        wait_for(lambda: reported(slot), 60, "the live slot's sandbox reported", 0.1)
        os.kill(slot, signal.SIGKILL)
        wait_for(
            lambda: [p for p in children(worker.pid) if p != slot and reported(p)],
            60,
            "a new pool process with its sandbox reported",
            0.1,
        )
        samples = settled(8)
        assert ended_files() == [], "the killed process's value files stayed"
        from executor.runtimes.docker.policy import LABEL_POOL
        from worker.upkeep.janitor import Janitor

        def slot_sandboxes() -> list[dict]:
            return docker_client.api.containers(
                all=True, filters={"label": f"{LABEL_POOL}={os.uname().nodename}:{slot}"}
            )

        # its sandbox is the reaper's, as always: this one's, or the worker's own reaper's
        # if its round came first on a loaded machine; it must be gone after this round
        janitor = Janitor(settings, "reaper@test")
        try:
            reaped = janitor.reap_sandboxes()
            assert len(reaped) <= 1, reaped
            wait_for(lambda: not slot_sandboxes(), 30, "the killed process's sandbox reaped")
        finally:
            janitor.store.close()
        more = [client.submit(OK_CODE, "python", {}, user="r") for _ in range(2)]
        assert {client.wait(j, 60).status.value for j in more} == {"succeeded"}
        samples = settled(10)
        assert total(samples, "studio_code_run_seconds_count") == 10
        assert total(samples, "studio_code_sandboxes_running") == 0
    finally:
        client.close()
        code = worker.stop(60)
        assert code == 0, worker.output()[-3000:]


def test_folding_adds_an_ended_process_values_and_keeps_what_is_not_its_to_drop(
    tmp_path: Path,
) -> None:
    """fold_ended_processes on real value files: an ended process's counters are added
    into counter_ended.db (a second one's on top), its live gauges go, a gauge of another
    mode ("all": one series per pid, by design) stays, a live process is not touched, and a
    file whose name holds no pid is left alone without stopping the fold."""
    from prometheus_client.mmap_dict import MmapedDict, mmap_key

    from worker.metrics.server import fold_ended_processes

    key = mmap_key("c", "c_total", ["l"], ["x"], "a counter")

    def write(name: str, value: float) -> None:
        m = MmapedDict(str(tmp_path / name))  # name may hold a subdirectory
        m.write_value(key, value, 0.0)
        m.close()

    for pid in (111, 222, 333):
        write(f"counter_{pid}.db", 2.0)
        write(f"gauge_livesum_{pid}.db", 1.0)
        write(f"gauge_all_{pid}.db", 1.0)
    write("counter_99999999999999999999.db", 5.0)
    gone = {111}

    def names() -> list[str]:
        return sorted(f.name for f in tmp_path.glob("*.db"))

    assert fold_ended_processes(tmp_path, ended=lambda pid: pid in gone) == [111]
    gone.add(222)
    assert fold_ended_processes(tmp_path, ended=lambda pid: pid in gone) == [222]
    assert names() == [
        "counter_333.db",
        "counter_99999999999999999999.db",
        "counter_ended.db",
        "gauge_all_111.db",
        "gauge_all_222.db",
        "gauge_all_333.db",
        "gauge_livesum_333.db",
    ]
    folded = list(MmapedDict.read_all_values_from_file(str(tmp_path / "counter_ended.db")))
    assert [(k, v) for k, v, _, _ in folded] == [(key, 4.0)]
    # the default test of "ended" (os.kill) on a number no pid can be: not ended, no error
    (tmp_path / "odd").mkdir()
    write("odd/counter_99999999999999999999.db", 5.0)
    assert fold_ended_processes(tmp_path / "odd") == []
    assert (tmp_path / "odd" / "counter_99999999999999999999.db").exists()


# --- naming --------------------------------------------------------------------------------


def _families(registry: CollectorRegistry) -> list[Any]:
    return list(text_string_to_metric_families(generate_latest(registry).decode()))


def test_metric_names_follow_the_conventions() -> None:
    from worker.metrics import build_metrics, record_cancel  # noqa: F401 - importable hooks

    registry = CollectorRegistry()
    m = build_metrics(registry)
    # give every labelled metric one child so its samples are exposed
    m.jobs.labels("python", "docker", "succeeded").inc()
    m.errors.labels("python", "docker", "CODE_ERROR").inc()
    m.queue_wait.labels("code.run").observe(0.1)
    m.sandbox_start.labels("python", "docker").observe(0.1)
    m.run.labels("python", "docker").observe(0.1)
    m.sandboxes_running.labels("python").set(0)
    m.cancellations.labels("running").inc()
    m.cancel_latency.observe(0.1)
    m.oom.labels("python", "docker").inc()
    m.timeouts.labels("python", "docker").inc()
    m.memory_peak.labels("python", "docker").observe(5e6)
    m.cpu.labels("python", "docker").observe(0.01)

    from api_client.http.kit import RATE_LIMITED_TOTAL

    api_registry = CollectorRegistry()
    api_registry.register(RATE_LIMITED_TOTAL)

    families = _families(registry) + _families(api_registry)
    names = {f.name for f in families}
    for wanted in (
        "studio_code_jobs",
        "studio_code_queue_wait_seconds",
        "studio_code_sandbox_start_seconds",
        "studio_code_run_seconds",
        "studio_code_sandboxes_running",
        "studio_code_cancellations",
        "studio_code_cancel_latency_seconds",
        "studio_code_oom",
        "studio_code_timeouts",
        "studio_code_run_memory_peak_bytes",
        "studio_code_run_cpu_seconds",
        "studio_code_rate_limited",
    ):
        assert wanted in names, (wanted, names)
    for f in families:
        assert f.name.startswith("studio_code_"), f.name
        assert not f.name.startswith("celery_")
        for s in f.samples:
            assert not s.name.startswith("celery_"), s.name
            if f.type == "counter":
                assert s.name.endswith(("_total", "_created")), s.name
            if f.type == "histogram":  # in base units
                assert f.name.endswith(("_seconds", "_bytes")), f.name
    assert {
        s.labels.get("status") for f in families if f.name == "studio_code_jobs" for s in f.samples
    } >= {"succeeded"}


def test_the_dashboard_queries_only_metrics_that_exist() -> None:
    import json
    import re

    from testkit.processes import ROOT

    dash = json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs
    used = {m for e in exprs for m in re.findall(r"\bstudio_code_[a-z_]+", e)}
    exposed = {
        "studio_code_jobs_total",
        "studio_code_job_errors_total",
        "studio_code_queue_wait_seconds_bucket",
        "studio_code_sandbox_start_seconds_bucket",
        "studio_code_run_seconds_bucket",
        "studio_code_sandboxes_running",
        "studio_code_cancellations_total",
        "studio_code_cancel_latency_seconds_bucket",
        "studio_code_oom_total",
        "studio_code_timeouts_total",
        "studio_code_run_memory_peak_bytes_bucket",
        "studio_code_run_cpu_seconds_bucket",
        "studio_code_rate_limited_total",
        "studio_code_language_ready",
        "studio_code_engine_vulnerable",
        # autoscaling and API signals (worker.autoscale, api_client.http.metrics)
        "studio_code_queue_backlog",
        "studio_code_queue_oldest_seconds",
        "studio_code_queue_user_waiting",
        "studio_code_queue_users_waiting",
        "studio_code_worker_slots",
        "studio_code_worker_up",
        "studio_code_http_requests_total",
        "studio_code_http_request_duration_seconds_bucket",
    }
    assert used <= exposed, used - exposed
    assert exposed <= used, exposed - used
