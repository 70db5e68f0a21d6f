"""deploy/: the Compose file as Compose itself reads it, the deployment brought up for real
(``make up`` with a project of its own, on the host-network variant when the engine has no
bridge), and the scaling and graceful-stop stories it promises, played with real processes.

* ``docker-compose config`` accepts the file; no service is privileged; only the workers get
  the Docker socket; every service has resource limits and rotated logs; Redis runs with a
  password, maxmemory, AOF (everysec) and noeviction; no password has a default; the
  workers' stop grace covers STUDIO_CODE_MAX_SECONDS; workers can be scaled.
* ``make up`` / ``make scale`` / ``make down`` (slow): Python and TypeScript nodes over the
  API, each in a sandbox a worker container started through the socket, jobs spread over
  3 workers, a running node cancelled, nothing left behind.
* ``--scale worker=2``: two worker processes on one Redis and one PostgreSQL share jobs.
* ``docker stop`` of a busy worker (SIGTERM, then the grace): its running jobs finish, no
  sandbox is left, no job is lost (what it had not started is run by another worker).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.processes import ROOT, require, wait_for
from testkit.sandboxes import containers_of
from testkit.stack import studio_env
from testkit.worker import start_worker

#: every test here runs the Compose CLI (or the whole deployment): out of `make test-fast`
pytestmark = pytest.mark.compose

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


HOSTNET_FILE = ROOT / "deploy" / "compose.hostnet.yaml"
BRIDGE_FILE = ROOT / "deploy" / "compose.bridge.yaml"
SECRETS = {"REDIS_PASSWORD": "r3dis-pw", "POSTGRES_PASSWORD": "pg-pw", "STUDIO_API_TOKEN": "tok"}


def compose_config(
    tmp: Path,
    *files: Path,
    env: dict[str, str] | None = None,
    profiles: tuple[str, ...] = ("images",),
) -> subprocess.CompletedProcess[str]:
    cmd = compose_cmd()
    require(cmd is not None, "neither docker-compose nor the docker compose plugin is installed")
    assert cmd is not None
    env_file = tmp / "env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in (env or {}).items()))
    args = [a for f in files for a in ("-f", str(f))]
    return subprocess.run(
        [
            *cmd,
            "--env-file",
            str(env_file),
            *args,
            *(a for p in profiles for a in ("--profile", p)),
            "config",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
    )


def _parse(out: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert out.returncode == 0, out.stderr
    parsed = yaml.safe_load(out.stdout)
    assert isinstance(parsed, dict)
    return parsed


@pytest.fixture(scope="module")
def config(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("compose")
    return _parse(
        compose_config(
            tmp,
            COMPOSE_FILE,
            BRIDGE_FILE,
            env={**SECRETS, "DOCKER_GID": "4242", "STATE_DIR": str(tmp)},
        )
    )


@pytest.fixture(scope="module")
def hostnet(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("compose")
    return _parse(
        compose_config(
            tmp,
            COMPOSE_FILE,
            HOSTNET_FILE,
            env={
                **SECRETS,
                "DOCKER_GID": "4242",
                "STATE_DIR": str(tmp),
                "REDIS_HOST": "127.0.0.1",
                "REDIS_BIND": "127.0.0.1",
                "REDIS_PORT": "16379",
                "API_BIND": "127.0.0.1",
            },
        )
    )


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
    assert {
        "redis",
        "postgres",
        "api",
        "worker",
        "sockguard",
        "prometheus",
    } <= set(config["services"])


def test_no_service_is_privileged(config: dict[str, Any]) -> None:
    for name, svc in config["services"].items():
        assert not svc.get("privileged"), f"{name} is privileged"
        assert "SYS_ADMIN" not in (svc.get("cap_add") or []), name
        assert svc.get("pid") != "host" and svc.get("network_mode") != "host", name


def test_every_service_is_limited_and_rotates_its_logs(config: dict[str, Any]) -> None:
    for name in ("redis", "postgres", "api", "worker", "sockguard", "prometheus"):
        svc = config["services"][name]
        assert svc.get("mem_limit"), f"{name} has no memory limit"
        assert float(svc.get("cpus", 0)) > 0, f"{name} has no CPU limit"
        assert int(svc.get("pids_limit", 0)) > 0, f"{name} has no pids limit"
        log = svc.get("logging") or {}
        assert log.get("driver") == "json-file", name
        assert log["options"]["max-size"] and int(log["options"]["max-file"]) >= 1, name


def test_no_password_or_group_is_defaulted(tmp_path: Path) -> None:
    """Without the env file `make up` writes, Compose refuses to start: no silent
    `studio` password, no assumed docker group."""
    for missing in ("REDIS_PASSWORD", "POSTGRES_PASSWORD", "STUDIO_API_TOKEN", "DOCKER_GID"):
        env = {**SECRETS, "DOCKER_GID": "4242", "STATE_DIR": str(tmp_path)}
        del env[missing]
        out = compose_config(tmp_path, COMPOSE_FILE, env=env)
        assert out.returncode != 0, f"{missing} unset was accepted"
        assert "make up" in out.stderr, out.stderr


def test_only_the_socket_guard_gets_the_docker_socket(config: dict[str, Any]) -> None:
    for name, svc in config["services"].items():
        has = any("docker.sock" in (src or "") for src, _ in _mounts(svc))
        # the default workers' guard, and the big worker group's own (`--profile big`)
        guard = name in ("sockguard", "sockguard-big")
        assert has == guard, f"{name}: engine socket mounted = {has}"
    guard = config["services"]["sockguard"]
    assert guard["group_add"] == ["4242"]
    assert guard["command"][:2] == ["studio-code", "sockguard"]
    listen = guard["command"][guard["command"].index("--listen") + 1]
    assert guard["command"][guard["command"].index("--upstream") + 1] == "/var/run/docker.sock"
    assert ("docker-guard", "/run/studio") in _mounts(guard) and listen.startswith("/run/studio/")
    assert guard["network_mode"] == "none"  # it needs no network, on any engine
    # it checks creates by the workers' own images and limits
    for key in ("STUDIO_CODE_IMAGE", "STUDIO_CODE_TS_IMAGE", "STUDIO_CODE_MAX_SECONDS"):
        assert guard["environment"][key] == config["services"]["worker"]["environment"][key]
    for name in ("api", "worker"):
        assert "group_add" not in config["services"][name], name
    assert config["services"]["api"]["environment"]["STUDIO_API_TOKEN"] == "tok"


def test_the_api_docker_variant_gives_the_api_the_guard_not_the_engine(tmp_path: Path) -> None:
    out = compose_config(
        tmp_path,
        COMPOSE_FILE,
        BRIDGE_FILE,
        ROOT / "deploy" / "compose.api-docker.yaml",
        env={**SECRETS, "DOCKER_GID": "4242", "STATE_DIR": str(tmp_path)},
    )
    api = _parse(out)["services"]["api"]
    assert _mounts(api) == [("docker-guard", "/run/studio")]
    assert api["environment"]["DOCKER_HOST"] == "unix:///run/studio/docker.sock"
    assert "group_add" not in api
    assert {"redis", "postgres", "sockguard"} <= set(api["depends_on"])


def test_hostnet_variant_binds_loopback_and_keeps_reaping_safe(hostnet: dict[str, Any]) -> None:
    svcs = hostnet["services"]
    for name in ("redis", "postgres", "api", "worker", "prometheus"):
        assert svcs[name]["network_mode"] == "host", name
        assert not svcs[name].get("ports"), name  # Compose v1 refuses them on the host network
    assert "--bind 127.0.0.1 --port 16379" in " ".join(svcs["redis"]["command"])
    assert svcs["api"]["command"][2:4] == ["--host", "127.0.0.1"]
    assert (
        svcs["worker"]["environment"]["STUDIO_REDIS_URL"] == "redis://:r3dis-pw@127.0.0.1:16379/0"
    )
    # replicas share the host's hostname: the reaper's host:pid owners need the host's pids
    assert svcs["worker"]["pid"] == "host"
    assert "-n" in svcs["worker"]["command"][-1] and "urandom" in svcs["worker"]["command"][-1]


def _mounts(svc: dict[str, Any]) -> list[tuple[str, str]]:
    out = []
    for v in svc.get("volumes") or []:
        if isinstance(v, str):
            src, _, rest = v.partition(":")
            out.append((src, rest.split(":")[0]))
        else:
            out.append((v.get("source"), v.get("target")))
    return out


def _read_only(svc: dict[str, Any], target: str) -> bool:
    for v in svc.get("volumes") or []:
        if isinstance(v, str) and v.split(":")[1] == target:
            return v.endswith(":ro")
        if isinstance(v, dict) and v.get("target") == target:
            return bool(v.get("read_only"))
    raise AssertionError(f"no mount at {target}")


def test_only_the_usage_sweeper_writes_the_host_cgroups(config: dict[str, Any]) -> None:
    """The host's cgroup fs is mounted writable into one service: the sweeper, which has no
    network and one capability; the workers read it; the rest do not see it."""
    for name, svc in config["services"].items():
        if ("/sys/fs/cgroup", "/host/sys/fs/cgroup") not in _mounts(svc):
            continue
        assert name in ("worker", "worker-big", "usage-sweeper"), name
        assert _read_only(svc, "/host/sys/fs/cgroup") == (name != "usage-sweeper"), name
    sweeper = config["services"]["usage-sweeper"]
    assert sweeper["network_mode"] == "none" and sweeper["cap_drop"] == ["ALL"]
    # rmdir in a v1 hierarchy's root (root's, mode 0555): the one capability it gets
    assert sweeper["cap_add"] == ["DAC_OVERRIDE"] and not sweeper.get("group_add")
    assert config["services"]["worker"]["depends_on"]["usage-sweeper"]
    assert config["services"]["worker"]["environment"]["STUDIO_CODE_USAGE_SWEEPER"] == "1"


def test_the_workers_start_sandboxes_through_the_socket_guard(config: dict[str, Any]) -> None:
    worker = config["services"]["worker"]
    # the guard's socket, and the host's cgroup fs (what each run used) read-only
    assert sorted(_mounts(worker)) == [
        ("/sys/fs/cgroup", "/host/sys/fs/cgroup"),
        ("docker-guard", "/run/studio"),
    ]
    assert _read_only(worker, "/host/sys/fs/cgroup")
    guard = config["services"]["sockguard"]["command"]
    env = worker["environment"]
    assert env["DOCKER_HOST"] == f"unix://{guard[guard.index('--listen') + 1]}"
    assert worker["depends_on"]["sockguard"]["condition"] == "service_healthy"
    assert env["STUDIO_CODE_RUNTIME"] == "docker"
    assert env["STUDIO_ENABLE_CODE_NODES"] == "1"
    assert env["STUDIO_DATABASE_URL"] == "postgresql+psycopg://studio:pg-pw@postgres:5432/studio"
    assert env["STUDIO_REDIS_URL"] == "redis://:r3dis-pw@redis:6379/0"
    assert worker["command"][:2] == ["studio-code", "worker"]
    # metrics: a multiprocess dir of its own and a port Prometheus scrapes
    assert env["PROMETHEUS_MULTIPROC_DIR"].startswith("/tmp/")
    assert env["STUDIO_METRICS_PORT"] == "9808" and env["STUDIO_METRICS_HOST"] == "0.0.0.0"
    api = config["services"]["api"]
    assert api["command"][:2] == ["studio-code", "serve"]
    # the API trusts X-Studio-User: it must not listen on every host address
    assert api.get("ports"), "compose.bridge.yaml publishes the API's port"
    for port in api.get("ports") or []:
        host_ip = port.get("host_ip") if isinstance(port, dict) else str(port).split(":")[0]
        assert host_ip == "127.0.0.1", port


def test_the_big_worker_group_is_a_second_worker_service_off_until_asked(
    config: dict[str, Any], tmp_path: Path
) -> None:
    """deploy/compose.yaml's example of a second worker group (docs/operations.md, "Worker
    groups"): worker-big and its own socket guard, in profile big (not started without
    `--profile big`); with
    it, the workers of group big with the big slot's caps, behind a guard holding the same
    caps, and the API told of the group by STUDIO_WORKER_GROUPS."""
    for name in ("worker-big", "sockguard-big"):  # `config` lists them; `up` starts them not
        assert config["services"].get(name, {}).get("profiles", ["big"]) == ["big"], name
    env = {
        **SECRETS,
        "DOCKER_GID": "4242",
        "STATE_DIR": str(tmp_path),
        "STUDIO_WORKER_GROUPS": "big:4g:3",
        "BIG_WORKER_MEMORY": "4g",
        "BIG_WORKER_CPUS": "3",
    }
    svcs = _parse(compose_config(tmp_path, COMPOSE_FILE, BRIDGE_FILE, env=env, profiles=("big",)))[
        "services"
    ]
    big, guard, worker = svcs["worker-big"], svcs["sockguard-big"], svcs["worker"]
    assert big["environment"]["STUDIO_WORKER_GROUP"] == "big"
    assert "STUDIO_WORKER_GROUP" not in worker["environment"]  # default
    for svc in (big, guard, worker, svcs["api"]):
        assert svc["environment"]["STUDIO_WORKER_GROUPS"] == "big:4g:3"
    for svc in (big, guard):
        assert svc["environment"]["STUDIO_CODE_MAX_MEMORY"] == "4g"
        assert str(svc["environment"]["STUDIO_CODE_MAX_CPUS"]) == "3"
    assert "STUDIO_CODE_MAX_MEMORY" not in svcs["sockguard"]["environment"]
    assert big["command"] == worker["command"] and big["mem_limit"] == worker["mem_limit"]
    assert sorted(_mounts(big)) == [
        ("/sys/fs/cgroup", "/host/sys/fs/cgroup"),
        ("docker-guard-big", "/run/studio"),
    ]
    assert ("docker-guard-big", "/run/studio") in _mounts(guard)
    assert big["environment"]["DOCKER_HOST"] == "unix:///run/studio/docker.sock"
    assert big["depends_on"]["sockguard-big"]["condition"] == "service_healthy"
    assert guard["network_mode"] == "none" and guard["command"][:2] == ["studio-code", "sockguard"]
    # on the host network the big workers are reaped as every worker is (pid: host)
    host = _parse(compose_config(tmp_path, COMPOSE_FILE, HOSTNET_FILE, env=env, profiles=("big",)))[
        "services"
    ]
    assert host["worker-big"]["pid"] == "host" and host["worker-big"]["network_mode"] == "host"
    assert host["worker-big"]["environment"]["STUDIO_WORKER_GROUP"] == "big"


def test_redis_keeps_acknowledged_jobs(config: dict[str, Any]) -> None:
    redis = config["services"]["redis"]
    command = redis["command"]
    line = " ".join(command) if isinstance(command, list) else command
    assert re.search(r"--appendonly\s+yes", line)
    assert re.search(r"--appendfsync\s+everysec", line)
    assert re.search(r"--maxmemory-policy\s+noeviction", line)
    assert re.search(r"--maxmemory\s+\d+mb", line)
    assert "requirepass" in line and "r3dis-pw" not in line  # the password is not in argv
    assert redis["environment"]["REDIS_PASSWORD"] == "r3dis-pw"
    assert any(target == "/data" for _, target in _mounts(redis))


def test_worker_stop_grace_covers_the_longest_job(config: dict[str, Any]) -> None:
    from executor.runtimes.constants import KILL_GRACE_S

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


def test_compose_builds_no_sandbox_image_and_follows_the_built_tags_and_lists(
    config: dict[str, Any], tmp_path: Path
) -> None:
    """The sandbox images come from `studio-code image build` (the package lists, pinned and
    recorded, smoke-tested under the sandbox policy), never from a Compose build of the
    repository's files; Compose's services take the tags and lists that build printed from
    the env file (deploy/compose.sh keeps them there), the executor's defaults when unset."""
    assert not (ROOT / "deploy" / "sandbox-ts.Dockerfile").exists()
    for name, svc in config["services"].items():
        image = str(svc.get("image", ""))
        assert not (image.startswith("studio-code:") or image.startswith("studio-code-ts:")), name
    built = {
        "STUDIO_CODE_IMAGE": "studio-code:2",
        "STUDIO_CODE_TS_IMAGE": "studio-code-ts:2",
        "STUDIO_CODE_PACKAGES": "pydantic,python-dateutil,requests",
        "STUDIO_CODE_TS_PACKAGES": "npm:zod@3,npm:date-fns@4,npm:ulid@2",
        "STUDIO_CODE_PREIMPORT": "pydantic.main",
    }
    base = {**SECRETS, "DOCKER_GID": "4242", "STATE_DIR": str(tmp_path)}
    chosen = _parse(compose_config(tmp_path, COMPOSE_FILE, BRIDGE_FILE, env={**base, **built}))
    for svc in ("api", "worker", "sockguard"):
        env = config["services"][svc]["environment"]
        assert env["STUDIO_CODE_IMAGE"] == "studio-code:1", svc
        assert env["STUDIO_CODE_TS_IMAGE"] == "studio-code-ts:1", svc
        # unset: no value reaches the container, so the executor's default applies
        unset = ("STUDIO_CODE_PACKAGES", "STUDIO_CODE_TS_PACKAGES", "STUDIO_CODE_PREIMPORT")
        assert all(env.get(n) is None for n in unset), (svc, env)
        env = chosen["services"][svc]["environment"]
        assert {k: env.get(k) for k in built} == built, svc
    script = (ROOT / "deploy" / "compose.sh").read_text()
    assert all(name in script for name in built)  # kept in the env file across `make up`s


def test_prometheus_scrapes_every_worker_and_the_api(config: dict[str, Any]) -> None:
    prom = config["services"]["prometheus"]
    assert any(target == "/etc/prometheus/prometheus.yml" for _, target in _mounts(prom))
    scrape = yaml.safe_load((ROOT / "deploy" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in scrape["scrape_configs"]}
    worker_sd = jobs["studio-code-worker"]["dns_sd_configs"][0]
    assert worker_sd["names"] == ["worker"] and worker_sd["port"] == 9808
    assert jobs["studio-code-api"]["static_configs"][0]["targets"] == ["api:8080"]
    assert (
        jobs["studio-code-api"]["authorization"]["credentials_file"] == "/etc/prometheus/api_token"
    )


def test_the_app_dockerfile_installs_the_project() -> None:
    text = (ROOT / "deploy" / "Dockerfile").read_text()
    assert re.search(r"^ARG BASE=python:3\.12-slim$", text, re.M)
    # the http extra by default; http,otel with STUDIO_APP_EXTRAS (traces)
    assert re.search(r'pip install .*"\.\[\$\{EXTRAS\}\]"', text)
    assert re.search(r"^ARG EXTRAS=http$", text, re.M)
    assert re.search(r"^USER 10001:10001$", text, re.M)
    json.loads((ROOT / "deploy" / "grafana-dashboard.json").read_text())


# --- scaling: two workers, one Redis, one PostgreSQL ---------------------------------------


WORK_CODE = "import time\n\ndef main(state):\n    time.sleep(0.4)\n    return state['i']\n"


@pytest.mark.docker
@pytest.mark.redis
@pytest.mark.postgres
def test_two_workers_share_the_jobs(
    tmp_path: Path, redis_server: Any, pg_schema_url: str, python_image: str, docker_client: Any
) -> None:
    from api_client.client import CodeClient
    from executor.settings import load_settings

    postgres_url = pg_schema_url
    env = studio_env(redis_server.url, postgres_url, python_image)
    workers = [
        start_worker(env, tmp_path / f"w{i}.log", name=f"scale{i}-{uuid.uuid4().hex[:4]}")
        for i in range(2)
    ]
    settings = load_settings(
        enable_code_nodes=True,
        redis_url=redis_server.url,
        database_url=postgres_url,
        code_image=python_image,
        code_languages="python",
    )
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
def test_sigterm_to_a_busy_worker_loses_no_job(
    tmp_path: Path, redis_server: Any, python_image: str, docker_client: Any
) -> None:
    """What `docker stop` (SIGTERM, then SIGKILL after stop_grace_period) does to a worker
    running two 3 s jobs with two more waiting: the running ones finish there, within the
    bound, the waiting ones are run by the next worker, and no sandbox is left."""
    from api_client.client import CodeClient
    from executor.settings import load_settings

    max_s = 10
    env = studio_env(
        redis_server.url,
        f"sqlite:///{tmp_path / 'runs.db'}",
        python_image,
        STUDIO_CODE_MAX_SECONDS=max_s,
    )
    # -c 3: two processes for workflow runs + the one kept for editor test calls
    first = start_worker(
        env, tmp_path / "first.log", name=f"first-{uuid.uuid4().hex[:4]}", concurrency=3
    )
    settings = load_settings(
        enable_code_nodes=True,
        redis_url=redis_server.url,
        database_url=f"sqlite:///{tmp_path / 'runs.db'}",
        code_image=python_image,
        code_languages="python",
        code_max_seconds=max_s,
    )
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
            _gone(docker_client, job_id)
        assert took < max_s + 15

        # the jobs it had not started are still there for the next worker
        second = start_worker(env, tmp_path / "second.log", name=f"second-{uuid.uuid4().hex[:4]}")
        recs = [client.wait(job_id, 90) for job_id in ids]
        assert [r.status.value for r in recs] == ["succeeded"] * 4, recs
        assert [r.output for r in recs] == [0, 1, 2, 3]
        for r in recs:
            _gone(docker_client, r.job_id)
        assert {r.worker.split("@")[0] for r in recs if r.job_id in running} == {first_name(first)}
    finally:
        client.close()
        first.stop(30)
        if second is not None:
            second.stop(60)


def first_name(proc: Any) -> str:
    m = re.search(r"(first-[0-9a-f]{4})@", proc.output())
    assert m, proc.output()[-2000:]
    return m.group(1)


# --- make up / scale / down, for real ----------------------------------------------------------


def _gone(docker_client: Any, job_id: str, timeout_s: float = 15.0) -> None:
    """The job's sandbox is removed: a pre-started one answers at its result frame and is
    removed right after, off the caller's path, so allow it a moment."""
    deadline = time.monotonic() + timeout_s
    while containers_of(docker_client, job_id) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not containers_of(docker_client, job_id), f"the sandbox of {job_id} was left"


INSIDE_PY = (
    "import os, socket, time\n\n"
    "def main(state):\n"
    "    time.sleep(state.get('sleep', 0))\n"
    "    try:\n"
    "        with socket.socket() as s:\n"
    "            s.connect(('127.0.0.1', 9))\n"
    "        net = 'connected'\n"
    "    except OSError as e:\n"
    "        net = type(e).__name__\n"
    "    return {'i': state.get('i'), 'hostname': socket.gethostname(), 'uid': os.getuid(),\n"
    "            'ifaces': sorted(os.listdir('/sys/class/net')), 'net': net}\n"
)
INSIDE_TS = (
    'import { z } from "npm:zod@3";\n'
    "export default function main(state: { n: number }) {\n"
    "  const t = Date.now();\n"
    "  while (Date.now() - t < 3000) { /* busy: long enough to be seen running */ }\n"
    "  return { doubled: z.object({ n: z.number() }).parse(state).n * 2,\n"
    "           deno: Deno.version.deno };\n"
    "}\n"
)
SLEEPY_PY = "import time\n\ndef main(state):\n    time.sleep(state['s'])\n    return state['i']\n"


class Deployment:
    """One `make up` of its own: project name, loopback ports, the API token it wrote."""

    def __init__(self, project: str) -> None:
        from testkit.processes import free_port

        self.project = project
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("STUDIO_")}
        # the host-network variant listens on these (the bridge variant publishes the API's)
        self.ports = {
            name: free_port()
            for name in ("REDIS_PORT", "POSTGRES_PORT", "API_PORT", "PROMETHEUS_PORT")
        }
        self.env.update({k: str(v) for k, v in self.ports.items()})
        self.base = f"http://127.0.0.1:{self.ports['API_PORT']}"
        self.token = ""

    def make(self, *args: str, timeout: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["make", "--no-print-directory", *args, f"PROJECT={self.project}"],
            cwd=ROOT,
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )

    def env_file(self) -> dict[str, str]:
        path = ROOT / "deploy" / ".state" / self.project / "env"
        return dict(
            line.split("=", 1)
            for line in path.read_text().splitlines()
            if "=" in line and not line.startswith("#")
        )

    def headers(self, user: str = "compose") -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}", "X-Studio-User": user}

    def containers(self, docker_client: Any, service: str | None = None) -> list[Any]:
        labels = [f"com.docker.compose.project={self.project}"]
        if service:
            labels.append(f"com.docker.compose.service={service}")
        return docker_client.containers.list(
            all=True, filters={"label": labels}, ignore_removed=True
        )


def _owned_by_a_worker(docker_client: Any, dep: Deployment, sandbox: Any) -> bool:
    """The sandbox's studio.owner (host:pid) is a process of one of this deployment's
    worker containers: by hostname (bridge) or by host pid (host network, pid: host)."""
    host, _, pid = sandbox.labels["studio.owner"].rpartition(":")
    for w in dep.containers(docker_client, "worker"):
        if w.attrs["HostConfig"]["NetworkMode"] == "host":
            top = docker_client.api.top(w.id, ps_args="-eo pid")
            if pid in {row[0].strip() for row in top["Processes"]}:
                return True
        elif host == w.attrs["Config"]["Hostname"]:
            return True
    return False


@pytest.mark.slow
@pytest.mark.docker
@pytest.mark.timeout(1800)  # a first run on a fresh machine builds the service images
def test_make_up_runs_nodes_scales_cancels_and_down_leaves_nothing(
    docker_client: Any, python_image: str, ts_image: str
) -> None:
    import httpx

    require(compose_cmd() is not None, "neither docker-compose nor docker compose is installed")
    dep = Deployment(f"sctest{uuid.uuid4().hex[:6]}")
    job_ids: list[str] = []
    try:
        t0 = time.monotonic()
        up = dep.make("up", timeout=1500)
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-5000:]
        print(f"make up: {time.monotonic() - t0:.1f}s")
        env = dep.env_file()
        dep.token = env["STUDIO_API_TOKEN"]
        assert len(env["REDIS_PASSWORD"]) >= 32 and len(env["POSTGRES_PASSWORD"]) >= 32
        assert env["DOCKER_GID"] == str(os.stat("/var/run/docker.sock").st_gid)
        mode = (ROOT / "deploy" / ".state" / dep.project / "env").stat().st_mode & 0o777
        assert mode == 0o600, oct(mode)
        http = httpx.Client(base_url=dep.base, timeout=30)

        def healthy() -> bool:
            try:
                r = http.get("/healthz/ready", headers=dep.headers())
            except httpx.TransportError:
                return False
            checks = r.json().get("checks", {})
            return (
                checks.get("redis") is None
                and checks.get("run_store") is None
                and "redis" in checks
            )

        wait_for(healthy, 180, "the API ready (Redis and PostgreSQL reachable)", 1)

        def health(service: str) -> list[str]:
            return [
                c.attrs["State"].get("Health", {}).get("Status", c.status)
                for c in dep.containers(docker_client, service)
            ]

        for svc in ("redis", "postgres", "api", "worker"):
            wait_for(
                lambda s=svc: health(s) == ["healthy"],
                120,
                f"{svc} healthy",
                1,
                describe=lambda s=svc: health(s),
            )
        # the API has no Docker socket; the workers do
        api = dep.containers(docker_client, "api")[0]
        assert not any("docker.sock" in m["Source"] for m in api.attrs["Mounts"])

        def submit(code: str, language: str, state: dict[str, Any]) -> str:
            r = http.post(
                "/api/runs",
                headers=dep.headers(),
                json={"code": code, "language": language, "state": state},
            )
            assert r.status_code == 202, r.text
            job_ids.append(r.json()["job_id"])
            return str(r.json()["job_id"])

        def run(job_id: str) -> dict[str, Any]:
            r = http.get(f"/api/runs/{job_id}", headers=dep.headers())
            assert r.status_code == 200, r.text
            return dict(r.json())

        def seen_running(job_id: str) -> Any:
            boxes = containers_of(docker_client, job_id)
            return boxes[0] if boxes and run(job_id)["status"] == "running" else None

        # a Python and a TypeScript node, each seen in its sandbox while it runs
        py = submit(INSIDE_PY, "python", {"i": 1, "sleep": 3})
        box = wait_for(lambda: seen_running(py), 90, "the Python sandbox running", 0.2)
        assert box.image.tags == [python_image]
        assert _owned_by_a_worker(docker_client, dep, box), box.labels
        # a cold sandbox under its run's own cgroup parent below the engine's (passed by the
        # guard)
        parent = box.attrs["HostConfig"]["CgroupParent"]
        assert re.fullmatch(r"/docker/studio-code-usage-[0-9a-f]{16}", parent), parent
        ts = submit(INSIDE_TS, "typescript", {"n": 21})
        tbox = wait_for(lambda: seen_running(ts), 90, "the TypeScript sandbox running", 0.2)
        assert tbox.image.tags == [ts_image]
        assert _owned_by_a_worker(docker_client, dep, tbox), tbox.labels
        rec = wait_for(lambda: (r := run(py))["finished"] and r, 90, "the Python node done", 0.2)
        assert rec["status"] == "succeeded", rec
        inside = rec["output"]
        # from inside: the sandbox's hostname, the worker image's uid, no network but lo
        assert inside["hostname"] == "sandbox" and inside["uid"] == 10001, inside
        # seccomp (our profile) refuses AF_INET: no network socket at all, only lo
        assert inside["ifaces"] == ["lo"] and inside["net"] == "PermissionError", inside
        assert rec["runtime"] == "docker" and rec["worker"], rec
        # what it used, measured by the worker through its read-only view of the host's
        # cgroups; the parent goes once empty (the usage-sweeper)
        usage = rec["usage"]
        assert usage is not None and usage["source"] in ("cgroup-v1", "cgroup-v2"), rec
        assert usage["memory_peak_bytes"] > 1_000_000 and usage["cpu_ms"] > 0, usage
        rec = wait_for(
            lambda: (r := run(ts))["finished"] and r, 90, "the TypeScript node done", 0.2
        )
        assert rec["status"] == "succeeded", rec
        assert rec["output"]["doubled"] == 42 and rec["output"]["deno"], rec
        assert rec["usage"] is not None and rec["usage"]["memory_peak_bytes"] > 1_000_000, rec
        _gone(docker_client, py)
        _gone(docker_client, ts)

        # three workers, and the jobs spread over them
        scale = dep.make("scale", "N=3", timeout=300)
        assert scale.returncode == 0, scale.stderr[-3000:]
        wait_for(
            lambda: health("worker") == ["healthy"] * 3,
            180,
            "3 healthy workers",
            1,
            describe=lambda: health("worker"),
        )
        batch = [submit(SLEEPY_PY, "python", {"i": i, "s": 1.5}) for i in range(18)]
        recs = [
            wait_for(lambda j=j: (r := run(j))["finished"] and r, 180, f"job {j} done", 0.5)
            for j in batch
        ]
        assert [r["status"] for r in recs] == ["succeeded"] * 18, recs
        assert [r["output"] for r in recs] == list(range(18))
        nodes = {r["worker"].split(":")[0] for r in recs}
        print(f"jobs per worker: {Counter(r['worker'].split(':')[0] for r in recs)}")
        assert len(nodes) == 3, f"the jobs did not spread over 3 workers: {nodes}"

        # cancel a running node: its sandbox is killed, it ends cancelled
        long = submit(SLEEPY_PY, "python", {"i": 0, "s": 25})
        wait_for(lambda: seen_running(long), 90, "the long node running", 0.2)
        r = http.post(f"/api/runs/{long}/cancel", headers=dep.headers())
        assert r.status_code == 202, r.text
        rec = wait_for(
            lambda: (x := run(long))["finished"] and x, 30, "the cancelled node ended", 0.2
        )
        assert rec["status"] == "cancelled", rec
        assert rec["error"]["code"] == "CODE_CANCELLED", rec
        wait_for(lambda: not containers_of(docker_client, long), 15, "its sandbox gone", 0.2)
        # the first node's parent, empty since it ended (the batch between): removed by the
        # usage-sweeper once empty for 20 s
        wait_for(
            lambda: (
                not os.path.exists(f"/sys/fs/cgroup/memory{parent}")
                and not os.path.exists(f"/sys/fs/cgroup{parent}")
            ),
            60,
            f"the empty parent {parent} removed by the usage-sweeper",
            1,
        )
        http.close()
    finally:
        t1 = time.monotonic()
        down = dep.make("down", "PURGE=1", timeout=300)
        print(f"make down: {time.monotonic() - t1:.1f}s")
    assert down.returncode == 0, down.stderr[-3000:]
    assert not dep.containers(docker_client), "make down left containers"
    label = f"com.docker.compose.project={dep.project}"
    assert not docker_client.networks.list(filters={"label": label}), "make down left a network"
    assert not docker_client.volumes.list(filters={"label": label}), "PURGE=1 left volumes"
    for job_id in job_ids:
        assert not containers_of(docker_client, job_id), f"sandbox of {job_id} left"
    assert not (ROOT / "deploy" / ".state" / dep.project).exists()
