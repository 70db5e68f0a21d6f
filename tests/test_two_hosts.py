"""Two hosts on one machine: a second Docker engine (its own data-root, exec-root, socket,
pidfile; no bridge, no iptables) with the sandbox images loaded into it stands for a second
worker machine. One ``studio-code worker`` per engine (DOCKER_HOST differs), one Redis and
one PostgreSQL of this test's own on loopback ports: what docs/operations.md calls a
multi-host deployment.

* jobs spread over both engines (each sandbox is on the engine of the worker that ran it);
* the second engine is stopped (SIGTERM to its pid) while jobs run: every job still ends
  exactly once with a clear outcome, none is lost or stuck. The accounting: every job
  submitted is ``succeeded`` (on engine 1, or on engine 2 before it stopped) or ``failed``
  with RUNTIME_UNAVAILABLE (a worker whose engine is gone fails what it takes, saying so;
  once workers step aside when their runtime is unavailable, that bucket empties and those
  jobs succeed on engine 1 - the assertion holds either way). After the stop, no job
  succeeds on engine 2.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import LABEL_JOB, free_port, require
from tests.services import BIN, SecondEngine, Service

pytestmark = [pytest.mark.slow, pytest.mark.docker, pytest.mark.redis, pytest.mark.postgres]

WORK = "import time\n\ndef main(state):\n    time.sleep(state['s'])\n    return state['i']\n"


@pytest.fixture
def engine2(docker_client: Any, python_image: str) -> Iterator[SecondEngine]:
    require(os.geteuid() == 0, "a second dockerd needs root")
    engine = SecondEngine()
    try:
        t0 = time.monotonic()
        engine.start()
        engine.load(python_image)
        print(f"second engine up with {python_image} loaded in {time.monotonic() - t0:.1f}s")
        yield engine
    finally:
        engine.stop()
        engine.remove()


class PostgresServer:
    """A PostgreSQL of this test's own (initdb as the postgres user), on a loopback port."""

    def __init__(self) -> None:
        bins = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
        require(bool(bins), "no PostgreSQL server binaries (apt-get install postgresql)")
        self.bin = bins[-1].parent
        self.dir = Path(tempfile.mkdtemp(prefix="sc-pg-", dir="/tmp"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def start(self) -> None:
        shutil.chown(self.dir, "postgres", "postgres")
        data = self.dir / "data"
        as_pg = ["runuser", "-u", "postgres", "--"]
        init = subprocess.run(
            [*as_pg, str(self.bin / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert init.returncode == 0, init.stderr
        self.proc = subprocess.Popen(
            [
                *as_pg,
                str(self.bin / "postgres"),
                "-D",
                str(data),
                "-p",
                str(self.port),
                "-c",
                "listen_addresses=127.0.0.1",
                "-k",
                str(self.dir),
                "-c",
                "fsync=off",
            ],
            stdout=subprocess.DEVNULL,
            stderr=open(self.dir / "log", "wb"),  # noqa: SIM115
            start_new_session=True,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            ok = (
                subprocess.run(
                    [str(self.bin / "pg_isready"), "-h", "127.0.0.1", "-p", str(self.port), "-q"],
                    timeout=10,
                ).returncode
                == 0
            )
            if ok:
                return
            time.sleep(0.2)
        pytest.fail(f"PostgreSQL did not start: {(self.dir / 'log').read_text()[-2000:]}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            # runuser's child is the postmaster: SIGINT to the group is a fast shutdown
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture
def own_postgres() -> Iterator[PostgresServer]:
    require(shutil.which("runuser") is not None, "runuser is missing")
    pg = PostgresServer()
    try:
        pg.start()
        yield pg
    finally:
        pg.stop()


def job_sandboxes(engine: Any) -> list[str]:
    """Job ids of the sandboxes running on ``engine``: a sandbox is named
    studio-code-<job id> (a pre-started one is renamed so when a job takes it; labels
    cannot change, so its studio.job_id label is never set)."""
    out = engine.docker("ps", "--format", "{{.Names}}").stdout.split()
    return [
        n.removeprefix("studio-code-")
        for n in out
        if n.startswith("studio-code-") and not n.startswith("studio-code-pool-")
    ]


def start_worker(env: dict[str, str], docker_host: str, name: str, log: Path) -> Service:
    """``studio-code worker`` on the engine at ``docker_host`` (not waited for)."""
    return Service(
        [str(BIN / "studio-code"), "worker", "-c", "3", "-n", f"{name}@%h", "--loglevel", "INFO"],
        {**env, "DOCKER_HOST": docker_host},
        log,
    )


def wait_ready(*workers: Service) -> None:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if all(" ready." in w.output() for w in workers):
            return
        if not all(w.alive() for w in workers):
            break
        time.sleep(0.2)
    outs = "\n---\n".join(w.output()[-3000:] for w in workers)
    for w in workers:
        w.stop(10)
    pytest.fail(f"the workers did not become ready:\n{outs}")


def test_two_engines_share_jobs_and_a_lost_engine_loses_no_job(
    tmp_path: Path,
    docker_client: Any,
    python_image: str,
    engine2: SecondEngine,
    redis_server: Any,
    own_postgres: PostgresServer,
) -> None:
    from api_client.client import CodeClient
    from executor.settings import load_settings

    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("STUDIO_", "DOCKER_")) and k != "PROMETHEUS_MULTIPROC_DIR"
    }
    env.update(
        {
            "STUDIO_ENABLE_CODE_NODES": "1",
            "STUDIO_CODE_RUNTIME": "docker",
            "STUDIO_CODE_IMAGE": python_image,
            "STUDIO_CODE_LANGUAGES": "python",
            "STUDIO_REDIS_URL": redis_server.url,
            "STUDIO_DATABASE_URL": own_postgres.url,
            "STUDIO_CODE_MAX_SECONDS": "15",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }
    )
    tag = uuid.uuid4().hex[:4]
    names = {"e1": f"e1-{tag}", "e2": f"e2-{tag}"}
    w1 = start_worker(env, "unix:///var/run/docker.sock", names["e1"], tmp_path / "e1.log")
    w2 = start_worker(env, engine2.host, names["e2"], tmp_path / "e2.log")
    wait_ready(w1, w2)
    settings = load_settings(
        enable_code_nodes=True,
        redis_url=redis_server.url,
        database_url=own_postgres.url,
        code_image=python_image,
        code_languages="python",
        code_max_seconds=15,
    )
    client = CodeClient(settings)

    def engine_of(worker: str | None) -> str:
        node = (worker or "").split("@")[0]
        return next((e for e, n in names.items() if n == node), f"unknown:{worker}")

    try:
        # 1. both engines take jobs; each sandbox is on its worker's engine
        first = [client.submit(WORK, "python", {"i": i, "s": 1.0}, user="two") for i in range(12)]
        seen_on_e2: set[str] = set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(seen_on_e2) < 2:
            seen_on_e2 |= set(job_sandboxes(engine2)) & set(first)
            time.sleep(0.1)
        recs = [client.wait(j, 120) for j in first]
        assert [r.status.value for r in recs] == ["succeeded"] * 12, recs
        assert [r.output for r in recs] == list(range(12))
        per_engine = Counter(engine_of(r.worker) for r in recs)
        print(f"first batch per engine: {dict(per_engine)}")
        assert per_engine["e1"] > 0 and per_engine["e2"] > 0, per_engine
        assert seen_on_e2, "no sandbox was ever seen on the second engine"
        assert all(engine_of(client.status(j).worker) == "e2" for j in seen_on_e2)

        # 2. the second engine goes away while jobs run on both
        second = [client.submit(WORK, "python", {"i": i, "s": 2.0}, user="two") for i in range(24)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            running_e2 = job_sandboxes(engine2)
            if running_e2:
                break
            time.sleep(0.1)
        else:
            pytest.fail("no job ran on the second engine")
        engine2.stop()
        assert not engine2.running()
        stopped_at = time.time()

        recs = [client.wait(j, 180) for j in second]
        outcomes: Counter[str] = Counter()
        for i, r in enumerate(recs):
            assert r.status.finished, f"{r.job_id} is stuck {r.status.value}"
            engine = engine_of(r.worker)
            if r.status.value == "succeeded":
                assert r.output == i, r
                if engine == "e2":  # only what had started before its engine was gone
                    assert r.started_at is not None and r.started_at.timestamp() <= stopped_at, r
                outcomes[f"succeeded on {engine}"] += 1
            else:
                assert r.status.value == "failed", r
                assert r.error is not None and r.error.code == "RUNTIME_UNAVAILABLE", r
                assert r.error.message, r
                outcomes["failed RUNTIME_UNAVAILABLE"] += 1
        print(f"after the second engine stopped: {dict(outcomes)} of {len(second)}")
        assert sum(outcomes.values()) == len(second)  # none lost
        assert outcomes["succeeded on e1"] > 0, outcomes
        # exactly once: one row per job, one attempt each, no sandbox left on engine 1
        assert len({r.job_id for r in recs}) == len(second)
        # a job the stranded worker took before it stepped aside may have been handed back
        # once (an attempt), never more than MAX_ATTEMPTS
        assert all(1 <= r.attempts <= 3 for r in recs), [(r.job_id, r.attempts) for r in recs]
        # A pre-started sandbox answers at its result frame and is removed right after its
        # job's done notice, off the caller's path: allow the last ones a moment.
        removal_deadline = time.monotonic() + 30
        for j in first + second:
            while True:
                left = docker_client.containers.list(
                    all=True, filters={"label": f"{LABEL_JOB}={j}"}, ignore_removed=True
                ) + docker_client.containers.list(
                    all=True, filters={"name": f"studio-code-{j}"}, ignore_removed=True
                )
                if not left or time.monotonic() > removal_deadline:
                    break
                time.sleep(0.2)
            assert not left, f"sandbox of {j} left on engine 1"
        assert w1.alive(), w1.output()[-3000:]
    finally:
        client.close()
        w1.stop(60)
        w2.stop(60)
