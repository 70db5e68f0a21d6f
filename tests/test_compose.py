"""deploy/: the Compose file as Compose itself reads it, and the scaling and graceful-stop
stories it promises, played on THIS machine with real processes (``docker compose up``
cannot run here: the engine has no bridge network).

* ``docker-compose config`` accepts the file; no service is privileged; the workers get
  the Docker socket; Redis runs with AOF (everysec) and noeviction; the workers' stop grace
  covers STUDIO_CODE_MAX_SECONDS; workers can be scaled (no fixed name, no host port).
* ``--scale worker=2``: two worker processes on one Redis and one PostgreSQL share jobs.
* ``docker stop`` of a busy worker (SIGTERM, then the grace): its running jobs finish, no
  sandbox is left, no job is lost (what it had not started is run by another worker).
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import ROOT, require
from tests.test_http import containers_of, start_worker, studio_env

COMPOSE_FILE = ROOT / "deploy" / "compose.yaml"


def compose_cmd() -> list[str] | None:
    """The Compose CLI here: Debian's docker-compose 1.29, or the `docker compose` plugin."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


@pytest.fixture(scope="module")
def config() -> dict[str, Any]:
    cmd = compose_cmd()
    require(cmd is not None, "neither docker-compose nor the docker compose plugin is installed")
    assert cmd is not None
    out = subprocess.run([*cmd, "-f", str(COMPOSE_FILE), "--profile", "images", "config"],
                         capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    parsed = yaml.safe_load(out.stdout)
    assert isinstance(parsed, dict)
    return parsed


def seconds(value: Any) -> float:
    """A Compose duration ('45s', '1m30s', '1m', 45) in seconds."""
    if isinstance(value, int | float):
        return float(value)
    parts = re.findall(r"(\d+(?:\.\d+)?)(h|ms|m|s|us)", str(value))
    assert parts, f"not a duration: {value!r}"
    unit = {"h": 3600, "m": 60, "s": 1, "ms": 0.001, "us": 1e-6}
    return sum(float(n) * unit[u] for n, u in parts)


# --- the file --------------------------------------------------------------------------------


def test_compose_config_is_valid_and_has_every_service(config: dict[str, Any]) -> None:
    assert {"redis", "postgres", "api", "worker", "prometheus", "sandbox-python",
            "sandbox-typescript"} <= set(config["services"])


def test_no_service_is_privileged(config: dict[str, Any]) -> None:
    for name, svc in config["services"].items():
        assert not svc.get("privileged"), f"{name} is privileged"
        assert "SYS_ADMIN" not in (svc.get("cap_add") or []), name
        assert svc.get("pid") != "host" and svc.get("network_mode") != "host", name


def _mounts(svc: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, str):
            src, _, rest = v.partition(":")
            out.append((src, rest.split(":")[0]))
        else:
            out.append((v.get("source"), v.get("target")))
    return out


def test_the_workers_start_sandboxes_through_the_docker_socket(config: dict[str, Any]) -> None:
    worker = config["services"]["worker"]
    assert ("/var/run/docker.sock", "/var/run/docker.sock") in _mounts(worker)
    env = worker["environment"]
    assert env["STUDIO_CODE_RUNTIME"] == "docker"
    assert env["STUDIO_ENABLE_CODE_NODES"] == "1"
    assert env["STUDIO_DATABASE_URL"].startswith("postgresql+psycopg://")
    assert env["STUDIO_REDIS_URL"].startswith("redis://redis:")
    assert worker["command"][:2] == ["studio-code", "worker"]
    # metrics: a multiprocess dir of its own and a port Prometheus scrapes
    assert env["PROMETHEUS_MULTIPROC_DIR"].startswith("/tmp/")
    assert env["STUDIO_METRICS_PORT"] == "9808" and env["STUDIO_METRICS_HOST"] == "0.0.0.0"
    api = config["services"]["api"]
    assert api["command"][:2] == ["studio-code", "serve"]
    # the API trusts X-Studio-User: it must not listen on every host address
    for port in api.get("ports") or []:
        host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).split(":")[0]
        assert host_ip == "127.0.0.1", port


def test_redis_keeps_acknowledged_jobs(config: dict[str, Any]) -> None:
    redis = config["services"]["redis"]
    command = redis["command"]
    line = " ".join(command) if isinstance(command, list) else command
    assert re.search(r"--appendonly\s+yes", line)
    assert re.search(r"--appendfsync\s+everysec", line)
    assert re.search(r"--maxmemory-policy\s+noeviction", line)
    assert any(target == "/data" for _, target in _mounts(redis))


def test_worker_stop_grace_covers_the_longest_job(config: dict[str, Any]) -> None:
    from executor.runtimes.docker import KILL_GRACE_S

    worker = config["services"]["worker"]
    max_s = float(worker["environment"]["STUDIO_CODE_MAX_SECONDS"])
    grace = seconds(worker["stop_grace_period"])
    assert grace >= max_s, (grace, max_s)
    assert grace >= max_s + KILL_GRACE_S  # the kill grace of a job that hit its timeout
    assert worker.get("stop_signal", "SIGTERM") == "SIGTERM"  # Celery's warm shutdown


def test_workers_can_be_scaled(config: dict[str, Any]) -> None:
    worker = config["services"]["worker"]
    assert "container_name" not in worker  # --scale needs generated names
    assert not worker.get("ports"), "a published port cannot be shared by replicas"
    assert worker.get("healthcheck", {}).get("test"), "the worker has no healthcheck"
    assert "9808/healthz" in " ".join(worker["healthcheck"]["test"])
    assert "/healthz/ready" in " ".join(config["services"]["api"]["healthcheck"]["test"])


def test_sandbox_images_are_built_on_the_engine_compose_talks_to(config: dict[str, Any]) -> None:
    py = config["services"]["sandbox-python"]
    ts = config["services"]["sandbox-typescript"]
    assert py["image"] == "studio-code:1" and ts["image"] == "studio-code-ts:1"
    assert py["profiles"] == ["images"] and ts["profiles"] == ["images"]
    assert py["network_mode"] == ts["network_mode"] == "none"
    dockerfile = Path(ts["build"]["context"]) / ts["build"]["dockerfile"]
    assert dockerfile.resolve() == (ROOT / "deploy" / "sandbox-ts.Dockerfile").resolve()
    deps = (ROOT / "docker" / "studio-code-ts" / "deps.ts").read_text()
    assert "deps.ts" in dockerfile.read_text() and "npm:zod@3" in deps


def test_prometheus_scrapes_every_worker_and_the_api(config: dict[str, Any]) -> None:
    prom = config["services"]["prometheus"]
    assert any(target == "/etc/prometheus/prometheus.yml" for _, target in _mounts(prom))
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    worker_sd = jobs["studio-code-worker"]["dns_sd_configs"][0]
    assert worker_sd["names"] == ["worker"] and worker_sd["port"] == 9808
    assert jobs["studio-code-api"]["static_configs"][0]["targets"] == ["api:8080"]


def test_the_app_dockerfile_installs_the_project() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=python:3\.12-slim$", text, re.M)
    assert 'pip install ".[http]"' in text
    assert re.search(r"^USER 10001:10001$", text, re.M)
    json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())


# --- scaling: two workers, one Redis, one PostgreSQL ---------------------------------------


WORK_CODE = "import time\n\ndef main(state):\n    time.sleep(0.4)\n    return state['i']\n"


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.postgres
def test_two_workers_share_the_jobs(tmp_path: Path, redis_server: Any, pg_schema_url: str,
                                    python_image: str, docker_client: Any) -> None:
    from api_client.client import CodeClient
    from executor.settings import load_settings

    postgres_url = pg_schema_url
    env = studio_env(redis_server.url, postgres_url, python_image)
    workers = [start_worker(env, tmp_path / f"w{i}.log", name=f"scale{i}-{uuid.uuid4().hex[:4]}")
               for i in range(2)]
    settings = load_settings(enable_code_nodes=True, redis_url=redis_server.url,
                             database_url=postgres_url, code_image=python_image,
                             code_languages="python")
    client = CodeClient(settings)
    try:
        ids = [client.submit(WORK_CODE, "python", {"i": i}, user="scale") for i in range(20)]
        recs = [client.wait(job_id, 120) for job_id in ids]
        assert [r.status.value for r in recs] == ["succeeded"] * 20
        assert [r.output for r in recs] == list(range(20))
        nodes = {r.worker.split("@")[0] for r in recs if r.worker}
        assert len(nodes) == 2, f"one worker ran everything: {[r.worker for r in recs]}"
        assert all(r.attempts == 1 for r in recs)
    finally:
        client.close()
        for w in workers:
            w.stop(60)


# --- graceful stop ----------------------------------------------------------------------------


LONG_CODE = "import time\n\ndef main(state):\n    time.sleep(3)\n    return state['i']\n"


@pytest.mark.docker
@pytest.mark.redis
def test_sigterm_to_a_busy_worker_loses_no_job(tmp_path: Path, redis_server: Any,
                                               python_image: str, docker_client: Any) -> None:
    """What `docker stop` (SIGTERM, then SIGKILL after stop_grace_period) does to a worker
    running two 3 s jobs with two more waiting: the running ones finish there, within the
    bound, the waiting ones are run by the next worker, and no sandbox is left."""
    from api_client.client import CodeClient
    from executor.settings import load_settings

    max_s = 10
    env = studio_env(redis_server.url, f"sqlite:///{tmp_path / 'runs.db'}", python_image,
                     STUDIO_CODE_MAX_SECONDS=max_s)
    # -c 3: two processes for workflow runs + the one kept for editor test calls
    first = start_worker(env, tmp_path / "first.log", name=f"first-{uuid.uuid4().hex[:4]}",
                         concurrency=3)
    settings = load_settings(enable_code_nodes=True, redis_url=redis_server.url,
                             database_url=f"sqlite:///{tmp_path / 'runs.db'}",
                             code_image=python_image, code_languages="python",
                             code_max_seconds=max_s)
    client = CodeClient(settings)
    second = None
    try:
        ids = [client.submit(LONG_CODE, "python", {"i": i}, user="stop") for i in range(4)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            running = [i for i in ids if client.status(i).status.value == "running"]
            if len(running) == 2 and all(containers_of(docker_client, i) for i in running):
                break
            time.sleep(0.05)
        else:
            pytest.fail("the worker never ran two jobs at once")

        t0 = time.monotonic()
        first.signal(signal.SIGTERM)
        code = first.wait(max_s + 15)  # compose's stop_grace_period: MAX_SECONDS + margin
        took = time.monotonic() - t0
        assert code is not None, f"the worker outlived its grace:\n{first.output()[-3000:]}"
        assert code == 0, first.output()[-3000:]
        for job_id in running:
            rec = client.status(job_id)
            assert rec.status.value == "succeeded", rec
            assert not containers_of(docker_client, job_id)
        assert took < max_s + 15

        # the jobs it had not started are still there for the next worker
        second = start_worker(env, tmp_path / "second.log", name=f"second-{uuid.uuid4().hex[:4]}")
        recs = [client.wait(job_id, 90) for job_id in ids]
        assert [r.status.value for r in recs] == ["succeeded"] * 4, recs
        assert [r.output for r in recs] == [0, 1, 2, 3]
        for r in recs:
            assert not containers_of(docker_client, r.job_id)
        assert {r.worker.split("@")[0] for r in recs if r.job_id in running} == \
            {first_name(first)}
    finally:
        client.close()
        first.stop(30)
        if second is not None:
            second.stop(60)


def first_name(proc: Any) -> str:
    m = re.search(r"(first-[0-9a-f]{4})@", proc.output())
    assert m, proc.output()[-2000:]
    return m.group(1)
